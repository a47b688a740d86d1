"""The bfloat16 engine-vs-trainer log-prob gap: what RL's importance ratios see on an accelerator.

The float32 ``engine_vs_trainer`` check proves the two paths compute the same function; on an
accelerator RL runs them in bfloat16 (the engine on bfloat16 weights, the trainer on float32 master
weights with bfloat16 compute), at the device's default matmul precision, with different kernels
and shapes (one token at a time from the KV cache vs one packed forward). Their disagreement on
the sampled tokens is the off-policy error RL corrects with importance ratios; this measures it,
and the same with the engine's projections in int8 and fp8 (``[inference.backend] quantization``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.devicecheck.checks import parity_engine_setup, parity_model
from jaxrl.devicecheck.common import Device, Shapes


def mismatch_stats(logp_trainer: np.ndarray, logp_engine: np.ndarray) -> dict[str, float]:
    """Per sampled token, delta = trainer - engine log-prob (tokens drawn from the engine):
    mean and max |delta|; KL(engine || trainer) estimated as mean(-delta) (k1) and as
    mean(exp(delta) - 1 - delta) (k3, never negative); the importance ratio exp(delta)'s extremes."""
    delta = np.asarray(logp_trainer, np.float64) - np.asarray(logp_engine, np.float64)
    ratio = np.exp(delta)
    return {"abs_delta_mean": float(np.abs(delta).mean()), "abs_delta_max": float(np.abs(delta).max()),
            "kl_k1": float(-delta.mean()), "kl_k3": float((ratio - 1 - delta).mean()),
            "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max())}


def logprob_mismatch(dev: Device, shapes: Shapes, quantization: str = "none") -> Iterator[dict[str, Any]]:
    """Sample at temperature 1 from the engine in bfloat16 (its projections in ``quantization``:
    "none", "int8", "fp8"), score the same tokens with the trainer's log-prob path in bfloat16
    compute, and report ``mismatch_stats``. Random weights give flatter distributions than a
    trained checkpoint (``entropy_mean`` says how flat)."""
    new = shapes.engine_new_tokens
    trainer_model = parity_model(shapes, jnp.bfloat16)  # float32 master weights, bfloat16 compute
    graphdef, state = nnx.split(trainer_model)
    engine_model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    prompts, icfg = parity_engine_setup(shapes, seed=7)
    stats = sampled_vs_trainer(trainer_model, engine_model, icfg.model_copy(update={"quantization": quantization}),
                               prompts, new)  # fmt: skip
    name = "logprob_mismatch_bf16" if quantization == "none" else f"logprob_mismatch_{quantization}"
    yield {"bench": name, **stats,
           "engine": "bfloat16 weights and compute" + ("" if quantization == "none" else f", projections {quantization}"),
           "trainer": "float32 weights, bfloat16 compute",
           "layers": shapes.parity["num_hidden_layers"], "temperature": 1.0}


def sampled_vs_trainer(trainer_model: Any, engine_model: Any, config: Any, prompts: list[list[int]], new: int) -> dict[str, Any]:
    """``new`` tokens per prompt sampled at temperature 1 by an engine of ``engine_model`` with
    ``config``, scored by the trainer's log-prob path on ``trainer_model``: ``mismatch_stats``,
    the tokens compared, the trainer's mean entropy on them and both sides' kernels."""
    from jaxrl.engine.engine import Engine
    from jaxrl.engine.requests import Request
    from jaxrl.engine.token_sampling import SamplingParams
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.trainer.step import packed_logprobs

    engine = Engine(engine_model, config)
    outs = engine.generate([Request(p, SamplingParams(max_tokens=new, temperature=1.0, seed=i))
                            for i, p in enumerate(prompts)])  # fmt: skip
    n, width = len(prompts), max(len(p) for p in prompts) + new
    tokens = np.zeros((n, width), np.int32)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens[i, : len(p) + len(o.token_ids)] = p + o.token_ids
    mb = {"tokens": tokens, "positions": np.broadcast_to(np.arange(width), (n, width)).astype(np.int32),
          "segment_ids": np.ones((n, width), np.int32), "temperature": np.ones((n, width), np.float32)}  # fmt: skip
    kernels = Kernels.create("auto", field="trainer.kernels")
    graphdef, state = nnx.split(trainer_model)

    @jax.jit
    def score(state: Any, mb: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return packed_logprobs(nnx.merge(graphdef, state), mb, kernels, 4096)

    logp, entropy = map(np.asarray, score(state, {k: jnp.asarray(v) for k, v in mb.items()}))
    got, want, ent = [], [], []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        cols = slice(len(p) - 1, len(p) - 1 + len(o.token_ids))
        got.append(logp[i, cols])
        want.append(np.asarray(o.logprobs))
        ent.append(entropy[i, cols])
    return {**mismatch_stats(np.concatenate(got), np.concatenate(want)),
            "tokens": int(sum(len(o.token_ids) for o in outs)), "entropy_mean": float(np.concatenate(ent).mean()),
            "engine_kernels": engine.kernels.impl, "trainer_kernels": kernels.impl}  # fmt: skip


MISMATCH = {
    f"logprob_mismatch_{name}": functools.partial(logprob_mismatch, quantization=q)
    for name, q in (("bf16", "none"), ("int8", "int8"), ("fp8", "fp8"))
}
"""The device check's mismatch measures: the bfloat16 engine, and with 8-bit projections."""

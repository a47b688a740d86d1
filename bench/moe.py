"""Mixture-of-experts dispatch cost on CPU: a sparse MLP against a dense MLP of the same ACTIVE size.

The pair is the reverse_text main job's model and its MoE twin (``jaxrl.models.tiny``:
``REVERSE_TEXT_DENSE`` / ``REVERSE_TEXT_MOE``, 12 experts, 2 per token, equal active parameters).
Two levels, each a train step (forward + backward of a squared-output loss, every weight's
gradient) and a decode step (one token per row):

* ``layer``: the MLP half of one layer alone on [tokens, hidden]: SwiGLU vs router + routed
  experts (the expert kernel ``Kernels.expert_mlp`` picks on this platform: ``tiled_gmm`` on CPU),
  and the same experts through XLA's ragged dot (``ragged_dot``: on CPU a masked dense dot against
  every expert, shown for the record of why CPU does not use it);
* ``model``: the whole 4-layer decoder (training forward + backward of the logits' CE; decode
  through a KV cache).

Every timed call alternates dense / MoE in one process (so a shared machine slows both alike) and
the medians are printed as JSON lines, with ``moe_over_dense`` the ratio of medians. Float32, one
device. Run on a quiet machine:

    python bench/moe.py [--rows 8 --seq 256 --decode-rows 32 --reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np


def _time(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms of each zero-argument callable (blocking), calls interleaved, after a warm-up."""
    import jax

    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _layer_fns(dense_arch, moe_arch, tokens: int, train: bool) -> dict[str, Callable[[], object]]:  # type: ignore[no-untyped-def]
    import jax
    import jax.numpy as jnp
    from jaxrl_kernels.moe import expert_mlp_reference, route

    from jaxrl.kernel_dispatch import Kernels

    d, f = dense_arch.hidden_size, dense_arch.intermediate_size
    e, k, fe = moe_arch.num_experts, moe_arch.num_experts_per_tok, moe_arch.moe_intermediate_size
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 8))
    x = jax.random.normal(next(keys), (tokens, d), jnp.float32)
    dense_w = [0.05 * jax.random.normal(next(keys), s) for s in ((d, f), (d, f), (f, d))]
    moe_w = [0.05 * jax.random.normal(next(keys), s) for s in ((d, e), (e, d, fe), (e, d, fe), (e, fe, d))]
    tiled = Kernels.create("auto", field="bench").expert_mlp() or expert_mlp_reference

    def dense(x, w):  # type: ignore[no-untyped-def]
        return (jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2]

    def sparse(experts):  # type: ignore[no-untyped-def]
        def fn(x, w):  # type: ignore[no-untyped-def]
            ids, gates, _ = route(x, w[0], k, moe_arch.norm_topk_prob)
            return experts(x, ids, gates, w[1], w[2], w[3])

        return fn

    def wrap(fn, w):  # type: ignore[no-untyped-def]
        if train:
            step = jax.jit(jax.grad(lambda w, x: jnp.sum(fn(x, w) ** 2)))
            return lambda: step(w, x)
        step = jax.jit(fn)
        return lambda: step(x, w)

    return {
        "dense": wrap(dense, dense_w),
        "moe": wrap(sparse(tiled), moe_w),
        "moe_ragged_dot": wrap(sparse(expert_mlp_reference), moe_w),
    }


def _model_fns(dense_cfg: dict, moe_cfg: dict, a: argparse.Namespace, train: bool) -> dict[str, Callable[[], object]]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.kv_cache import KVCache

    kernels = Kernels.create("auto", field="bench")
    rng = np.random.default_rng(0)
    out: dict[str, Callable[[], object]] = {}
    for name, cfg in (("dense", dense_cfg), ("moe", moe_cfg)):
        arch = arch_from_hf_config(cfg)
        graphdef, state = nnx.split(Decoder(arch, rngs=nnx.Rngs(0)))
        if train:
            tokens = jnp.asarray(rng.integers(0, arch.vocab_size, (a.rows, a.seq)), jnp.int32)
            positions = jnp.broadcast_to(jnp.arange(a.seq), tokens.shape)

            def loss(state, tokens, positions, graphdef=graphdef):  # type: ignore[no-untyped-def]
                model = nnx.merge(graphdef, state)
                hidden, _ = model(tokens, positions, kernels=kernels)
                logp = jax.nn.log_softmax(model.logits(hidden)[:, :-1])
                return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

            step = jax.jit(jax.grad(loss))
            out[name] = lambda step=step, state=state, t=tokens, p=positions: step(state, t, p)
        else:
            cache = KVCache.zeros(arch, a.decode_rows, a.seq)
            tokens = jnp.asarray(rng.integers(0, arch.vocab_size, (a.decode_rows, 1)), jnp.int32)
            positions = jnp.full((a.decode_rows, 1), a.seq // 2, jnp.int32)  # half the cache in view

            def decode(state, cache, tokens, positions, graphdef=graphdef):  # type: ignore[no-untyped-def]
                model = nnx.merge(graphdef, state)
                hidden, cache = model(tokens, positions, cache=cache, kernels=kernels)
                return model.logits_f32(hidden), cache

            step = jax.jit(decode)
            out[name] = lambda step=step, state=state, c=cache, t=tokens, p=positions: step(state, c, t, p)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="train rows (the main job's micro-batch)")
    parser.add_argument("--seq", type=int, default=256, help="train sequence length and decode cache length")
    parser.add_argument("--decode-rows", type=int, default=32, help="sequences per decode step")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=320)
    a = parser.parse_args()
    for name in ("rows", "seq", "decode_rows", "reps", "vocab"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.models.tiny import REVERSE_TEXT_DENSE, REVERSE_TEXT_MOE, qwen3_config, qwen3_moe_config

    dense_cfg = qwen3_config(vocab_size=a.vocab, max_position_embeddings=a.seq, **REVERSE_TEXT_DENSE).to_dict()
    moe_cfg = qwen3_moe_config(vocab_size=a.vocab, max_position_embeddings=a.seq, **REVERSE_TEXT_MOE).to_dict()
    dense_arch, moe_arch = arch_from_hf_config(dense_cfg), arch_from_hf_config(moe_cfg)
    common = {
        "active_params": [dense_arch.num_active_params(), moe_arch.num_active_params()],
        "moe_total_params": moe_arch.num_params(),
        "experts": moe_arch.num_experts,
        "top_k": moe_arch.num_experts_per_tok,
        "loadavg": os.getloadavg()[0],
    }
    cases = [
        ("layer", "train", a.rows * a.seq, lambda: _layer_fns(dense_arch, moe_arch, a.rows * a.seq, True)),
        ("layer", "decode", a.decode_rows, lambda: _layer_fns(dense_arch, moe_arch, a.decode_rows, False)),
        ("model", "train", a.rows * a.seq, lambda: _model_fns(dense_cfg, moe_cfg, a, True)),
        ("model", "decode", a.decode_rows, lambda: _model_fns(dense_cfg, moe_cfg, a, False)),
    ]
    for level, step, tokens, build in cases:
        ms = _time(build(), a.reps)
        line = {"level": level, "step": step, "tokens": tokens, **{f"{k}_ms": round(v, 3) for k, v in ms.items()}}
        line["moe_over_dense"] = round(ms["moe"] / ms["dense"], 3)
        if "moe_ragged_dot" in ms:
            line["ragged_dot_over_dense"] = round(ms["moe_ragged_dot"] / ms["dense"], 3)
        print(json.dumps({**line, **common}), flush=True)


if __name__ == "__main__":
    main()

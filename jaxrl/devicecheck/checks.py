"""Correctness on the device: each function returns JSON-able lines ``{"check": name, "ok": ...}``.

Float32 comparisons run at ``jax.default_matmul_precision("highest")``: by default TPUs run
float32 dots as bfloat16 passes and NVIDIA GPUs as TF32, which would make a float32 parity check
measure the matmul mode rather than the code. bfloat16 is checked on its own, against float32 on
the CPU, with a tolerance stated in its line. The Pallas kernels keep their own precision, so a
check of a Pallas kernel has a looser tolerance than one of a reference (stated in its line).
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.devicecheck.common import Device, Shapes, export_for_transformers, random_decoder, torch_free

# Scaled error (max |got - want| / max |want|) allowed in float32 at highest precision.
F32_TOL = {"cpu": 1e-4, "gpu": 1e-3, "tpu": 1e-3}
PALLAS_TOL = 2e-2  # Pallas on TPU (dots at the chip's default bf16-pass precision); cuDNN in bfloat16
# bfloat16 compute (float32 master weights) on the device vs float32 on the CPU.
BF16_LOSS_RTOL = 2e-2
BF16_GRAD_COSINE = 0.99
BF16_GRAD_NORM_RTOL = 5e-2


def scaled_err(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-12))


_PARITY: dict[int, Any] = {}


def parity_engine_setup(shapes: Shapes, seed: int) -> tuple[list[list[int]], Any]:
    """The engine checks' prompts (``engine_prompts`` of them, 3 tokens shorter each, so
    prefill pads) and the engine config sized to run them all in one batch."""
    from jaxrl.engine.config import EngineConfig

    n, new, prompt_len = shapes.engine_prompts, shapes.engine_new_tokens, shapes.parity_tokens[1]
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, shapes.parity["vocab_size"], prompt_len - 3 * i).tolist() for i in range(n)]
    config = EngineConfig(
        max_model_len=prompt_len + new + 8, max_seqs=n, max_batched_tokens=n * prompt_len,
        decode_batch_buckets=[n], prefill_len_buckets=[prompt_len], prefill_batch_buckets=[n], decode_steps=4,
        decode_steps_idle=4,
    )
    return prompts, config


def parity_model(shapes: Shapes, dtype: Any = jnp.float32) -> Any:
    """The correctness model (random float32 weights, made once per run) computing in ``dtype``:
    each caller gets its own module object over the same arrays."""
    if id(shapes) not in _PARITY:
        _PARITY[id(shapes)] = random_decoder(shapes.parity)
    model = nnx.merge(*nnx.split(_PARITY[id(shapes)]))
    model.dtype = dtype
    return model


def _parity_tokens(shapes: Shapes, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shapes.parity_tokens)


def logits_vs_transformers(dev: Device, shapes: Shapes) -> list[dict[str, Any]]:
    """The decoder's logits (training forward, the platform's kernels) vs transformers on the same
    weights: torch on the same device where it sees it, else torch on the CPU."""
    name = "logits_vs_transformers"
    if dev.torch_device is None:
        return [{"check": name, "ok": True, "skipped": dev.torch_note}]
    import torch
    import transformers

    from jaxrl.kernel_dispatch import Kernels

    cfg = shapes.parity
    model = parity_model(shapes)
    tokens = _parity_tokens(shapes, cfg["vocab_size"])
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    kernels = Kernels.create("auto", field="trainer.kernels")
    graphdef, state = nnx.split(model)

    @jax.jit
    def logits(state: Any, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, state)
        hidden, _ = m(tokens, positions, kernels=kernels)
        return m.logits(hidden)

    with jax.default_matmul_precision("highest"):
        got = np.asarray(logits(state, jnp.asarray(tokens), jnp.asarray(positions)))
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = export_for_transformers(model, cfg, Path(tmp))
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(dev.torch_device).eval()
        with torch.no_grad():
            want = hf(torch.as_tensor(tokens, device=dev.torch_device)).logits.float().cpu().numpy()
    del hf
    torch_free(dev.torch_device)
    err, tol = scaled_err(got, want), F32_TOL[dev.platform]
    return [{"check": name, "ok": err <= tol, "scaled_err": err, "max_abs_err": float(np.abs(got - want).max()),
             "tol": tol, "dtype": "float32", "torch_device": dev.torch_device, "kernels": kernels.impl,
             "shape": list(tokens.shape), "layers": cfg["num_hidden_layers"]}]


def engine_vs_trainer(dev: Device, shapes: Shapes) -> list[dict[str, Any]]:
    """Greedy tokens and sampled log-probs of the engine vs the trainer's log-probs of one forward
    over prompt + completion (``jaxrl.trainer.step.packed_logprobs``, the platform's kernels).

    Greedy agreement is judged tie-tolerantly: each engine token's trainer log-prob must be within
    the tolerance of the best token's (an exact argmax match is reported beside it)."""
    from jaxrl.engine.engine import Engine
    from jaxrl.engine.requests import Request
    from jaxrl.engine.token_sampling import SamplingParams
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.trainer.step import packed_logprobs

    n, new = shapes.engine_prompts, shapes.engine_new_tokens
    prompt_len = shapes.parity_tokens[1]
    model = parity_model(shapes)
    prompts, icfg = parity_engine_setup(shapes, seed=1)
    kernels = Kernels.create("auto", field="trainer.kernels")
    with jax.default_matmul_precision("highest"):
        engine = Engine(model, icfg)
        outs = engine.generate([Request(p, SamplingParams(max_tokens=new, temperature=0.0)) for p in prompts])
        width = prompt_len + new
        seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
        tokens = np.zeros((n, width), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        mb = {"tokens": tokens, "positions": np.broadcast_to(np.arange(width), (n, width)).astype(np.int32),
              "segment_ids": np.ones((n, width), np.int32), "temperature": np.ones((n, width), np.float32)}
        graphdef, state = nnx.split(model)

        @jax.jit
        def score(state: Any, mb: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
            m = nnx.merge(graphdef, state)
            logp, _ = packed_logprobs(m, mb, kernels, 4096)
            hidden, _ = m(mb["tokens"], mb["positions"], mb["segment_ids"], kernels=kernels)
            all_logp = jax.nn.log_softmax(m.logits(hidden).astype(jnp.float32), axis=-1)[:, :-1]
            return logp, all_logp.max(-1), all_logp.argmax(-1)

        logp, best, argmax = map(np.asarray, score(state, {k: jnp.asarray(v) for k, v in mb.items()}))
    tol = F32_TOL[dev.platform]
    lp_err = gap = 0.0
    exact_match = True
    for i, (p, o) in enumerate(zip(prompts, outs)):
        cols = slice(len(p) - 1, len(p) - 1 + new)
        lp_err = max(lp_err, float(np.abs(logp[i, cols] - np.asarray(o.logprobs)).max()))
        gap = max(gap, float((best[i, cols] - logp[i, cols]).max()))
        exact_match &= bool(np.array_equal(argmax[i, cols], o.token_ids))
    ok = all(len(o.token_ids) == new for o in outs) and lp_err <= tol and gap <= tol
    return [{"check": "engine_vs_trainer", "ok": ok, "logprob_max_abs_err": lp_err, "greedy_gap_max": gap,
             "greedy_exact_argmax": exact_match, "tol": tol, "requests": n, "new_tokens": new, "dtype": "float32",
             "engine_kernels": engine.kernels.impl, "trainer_kernels": kernels.impl}]


def _bf16_batch(cfg: dict[str, Any], shapes: Shapes) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """A packed micro-batch with both loss components: SFT rows (CE) and RL rows (advantages +-1,
    sampling log-probs of a uniform policy)."""
    from jaxrl.trainer.packing import component_counts, pack
    from jaxrl.training_sample import TrainingSample

    rows, length = shapes.parity_tokens
    vocab = cfg["vocab_size"]
    rng = np.random.default_rng(2)
    samples = []
    for i in range(2 * rows):
        toks = rng.integers(0, vocab, length // 2)
        if i % 2:
            samples.append(TrainingSample.sft(toks, np.ones(len(toks))))
        else:
            mask = np.arange(len(toks)) >= len(toks) // 2
            samples.append(TrainingSample(toks, mask, np.where(mask, -np.log(vocab), 0.0), mask.astype(np.float32),
                                          np.zeros(len(toks)), advantage=1.0 if i % 4 else -1.0))
    batch = pack(samples, length, rows_multiple=rows)
    return batch.as_dict(), component_counts(batch)


def bf16_loss_grads(dev: Device, shapes: Shapes) -> list[dict[str, Any]]:
    """The train step's loss and gradients (``jaxrl.trainer.step.micro_batch_loss``) with bfloat16
    compute on float32 master weights on the device, vs float32 on the CPU (same weights)."""
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.trainer.config import TrainerConfig
    from jaxrl.trainer.step import micro_batch_loss

    cfg = shapes.parity
    model = parity_model(shapes, jnp.bfloat16)  # float32 master weights, bfloat16 compute
    graphdef, state = nnx.split(model)
    mb, counts = _bf16_batch(cfg, shapes)
    tcfg = TrainerConfig(seq_len=shapes.parity_tokens[1], micro_batch_rows=shapes.parity_tokens[0])
    device_kernels = Kernels.create("auto", field="trainer.kernels")

    def loss_and_grads(graphdef: Any, state: Any, mb: dict, counts: dict, kernels: Kernels) -> tuple[Any, Any]:
        fn = jax.jit(jax.value_and_grad(lambda p, m, c: micro_batch_loss(p, graphdef, m, c, tcfg, kernels)[0]))
        loss, grads = fn(state, mb, counts)
        return float(loss), [np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)]

    dev_mb = {k: jnp.asarray(v) for k, v in mb.items()}
    dev_counts = {k: jnp.float32(v) for k, v in counts.items()}
    loss_dev, g_dev = loss_and_grads(graphdef, state, dev_mb, dev_counts, device_kernels)

    cpu = jax.devices("cpu")[0]
    model.dtype = jnp.float32  # the same weights, float32 compute, on the CPU
    graphdef32, _ = nnx.split(model)
    with jax.default_matmul_precision("highest"):
        loss_cpu, g_cpu = loss_and_grads(graphdef32, jax.device_put(state, cpu), jax.device_put(mb, cpu),
                                         jax.device_put({k: np.float32(v) for k, v in counts.items()}, cpu), Kernels())
    flat_dev, flat_cpu = np.concatenate(g_dev), np.concatenate(g_cpu)
    cosine = float(flat_dev @ flat_cpu / (np.linalg.norm(flat_dev) * np.linalg.norm(flat_cpu)))
    norm_err = float(abs(np.linalg.norm(flat_dev) / np.linalg.norm(flat_cpu) - 1))
    leaf_cos = [float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)) for a, b in zip(g_dev, g_cpu)]
    loss_err = abs(loss_dev - loss_cpu) / abs(loss_cpu)
    ok = loss_err <= BF16_LOSS_RTOL and cosine >= BF16_GRAD_COSINE and norm_err <= BF16_GRAD_NORM_RTOL
    return [{"check": "bf16_loss_grads", "ok": ok, "loss_bf16": loss_dev, "loss_f32_cpu": loss_cpu,
             "loss_rel_err": loss_err, "grad_cosine": cosine, "grad_norm_rel_err": norm_err,
             "grad_min_leaf_cosine": min(leaf_cos),
             "tol": {"loss_rel": BF16_LOSS_RTOL, "grad_cosine": BF16_GRAD_COSINE, "grad_norm_rel": BF16_GRAD_NORM_RTOL},
             "kernels": device_kernels.impl, "components": {k: v for k, v in counts.items() if v}}]


def _kernel_line(name: str, impl: str, errs: dict[str, float], tol: float, **extra: Any) -> dict[str, Any]:
    return {"check": name, "ok": all(e <= tol for e in errs.values()), "impl": impl, **errs, "tol": tol, **extra}


def _reference_line(name: str, platform: str) -> dict[str, Any]:
    return {"check": name, "ok": True, "impl": "reference",
            "skipped": f"kernel_dispatch keeps the pure-JAX reference on {platform}: nothing else to compare"}


def kernel_training_attention(dev: Device, shapes: Shapes) -> list[dict[str, Any]]:
    """The dispatched training attention over packed segments vs the decoder's reference
    (forward and the gradients of q, k, v)."""
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.models.layers import attention, packed_causal_mask

    d = shapes.kernel_dims
    kernels = Kernels.create("auto", field="trainer.kernels")
    b, t = d["batch"], d["seq"]
    seg = np.ones((b, t), np.int32)
    seg[:, t // 3:] = 2  # two samples per row; the second restarts
    seg[1, -t // 8:] = 0  # padding at the end of a row
    # cuDNN (GPU) takes bfloat16 only; elsewhere the kernels are checked in float32.
    dtype = jnp.bfloat16 if kernels.impl == "cudnn" else jnp.float32
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, t, d["heads"], d["head_dim"]), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, t, d["kv_heads"], d["head_dim"]), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, t, d["kv_heads"], d["head_dim"]), jnp.float32).astype(dtype)
    ct = jax.random.normal(keys[3], q.shape, jnp.float32).astype(dtype)
    attend = kernels.training_attention(jnp.asarray(seg), jax.ShapeDtypeStruct(q.shape, q.dtype))
    if attend is None:
        return [_reference_line("kernel_training_attention", dev.platform)]
    mask = packed_causal_mask(jnp.asarray(seg))
    live = jnp.asarray(seg > 0)[:, :, None, None]  # padding rows' outputs are unspecified

    def run(fn: Any, q: jax.Array, k: jax.Array, v: jax.Array, ct: jax.Array) -> tuple[Any, ...]:
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v) * live, q, k, v)
        return (out, *vjp(ct))

    # The arrays go in as arguments: closed over, jit would compile them into the program as constants.
    with jax.default_matmul_precision("highest"):
        got = jax.jit(partial(run, attend))(q, k, v, ct)
        want = jax.jit(partial(run, lambda q, k, v: attention(q, k, v, mask)))(q, k, v, ct)
    got = tuple(g.astype(jnp.float32) for g in got)
    want = tuple(w.astype(jnp.float32) for w in want)
    errs = {f"{n}_scaled_err": scaled_err(g, w) for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    tol = PALLAS_TOL if kernels.impl in ("pallas", "cudnn") else F32_TOL[dev.platform]
    return [_kernel_line("kernel_training_attention", kernels.impl, errs, tol, shape=[b, t, d["heads"], d["head_dim"]])]


def kernel_cached_attention(dev: Device, shapes: Shapes) -> list[dict[str, Any]]:
    """The engine's dispatched one-token attention over the KV cache vs the decoder's
    ``cached_attention`` reference (rows out of order, lengths from 1 to the cache's end)."""
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.models.layers import cached_attention

    d = shapes.kernel_dims
    kernels = Kernels.create("auto", field="inference.backend.kernels")
    rows_n, s, b = 2 * d["batch"] + 1, d["cache_len"], 2 * d["batch"]
    rng = np.random.default_rng(4)
    rows = jnp.asarray(rng.permutation(rows_n)[:b], jnp.int32)
    positions = jnp.asarray(np.concatenate([[0, s - 1], rng.integers(0, s, b - 2)])[:, None], jnp.int32)
    attend = kernels.cached_attention(positions, rows)
    if attend is None:
        return [_reference_line("kernel_cached_attention", dev.platform)]
    keys = jax.random.split(jax.random.key(5), 3)
    cache = (d["layers"], rows_n, d["kv_heads"], s, d["head_dim"])
    kc = jax.random.normal(keys[0], cache, jnp.float32)
    vc = jax.random.normal(keys[1], cache, jnp.float32)
    q = jax.random.normal(keys[2], (b, 1, d["heads"], d["head_dim"]), jnp.float32)
    layer = jnp.int32(d["layers"] - 1)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(attend)(q, kc, vc, layer)
        want = jax.jit(cached_attention)(q, kc, vc, layer, rows, positions)
    impl = "cpu_cached_attention" if kernels.impl == "reference" else kernels.impl
    tol = PALLAS_TOL if kernels.impl == "pallas" else F32_TOL[dev.platform]
    return [_kernel_line("kernel_cached_attention", impl, {"out_scaled_err": scaled_err(got, want)}, tol,
                         cache_shape=list(cache))]


def kernel_logprobs(dev: Device, shapes: Shapes) -> list[dict[str, Any]]:
    """The trainer's dispatched fused log-probs (the Pallas kernel on TPU, the blocked custom-VJP
    reference elsewhere) vs the naive full-softmax reference: log-probs, entropies and the
    gradients of hidden and lm_head."""
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.trainer.logprobs import token_logprobs, token_logprobs_reference

    d = shapes.kernel_dims
    kernels = Kernels.create("auto", field="trainer.kernels")
    fn = kernels.token_logprobs() or token_logprobs
    n, dim, vocab = d["tokens"], d["hidden"], d["vocab"]
    keys = jax.random.split(jax.random.key(6), 5)
    hidden = jax.random.normal(keys[0], (n, dim), jnp.float32)
    head = jax.random.normal(keys[1], (dim, vocab), jnp.float32) * (2.0 / dim**0.5)
    targets = jax.random.randint(keys[2], (n,), 0, vocab)
    temperature = jax.random.uniform(keys[3], (n,), jnp.float32, 0.5, 1.5)
    ct = jax.random.normal(keys[4], (2, n), jnp.float32)

    def run(f: Any, hidden: jax.Array, head: jax.Array, targets: jax.Array, temperature: jax.Array,
            ct: jax.Array) -> tuple[Any, ...]:
        def scalar(h: Any, w: Any) -> Any:
            logp, ent = f(h, w, targets, temperature, block_size=1024)
            return jnp.sum(logp * ct[0] + ent * ct[1]), (logp, ent)

        (_, (logp, ent)), (gh, gw) = jax.value_and_grad(scalar, argnums=(0, 1), has_aux=True)(hidden, head)
        return logp, ent, gh, gw

    # The arrays go in as arguments: closed over, jit compiled the 0.6 GB lm_head into the program
    # as a constant (the first H200 run spent the check's whole 120 s compiling and caching it).
    args = (hidden, head, targets, temperature, ct)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(partial(run, fn))(*args)
        want = jax.jit(partial(run, token_logprobs_reference))(*args)
    names = ("logp", "entropy", "d_hidden", "d_lm_head")
    errs = {f"{k}_scaled_err": scaled_err(g, w) for k, g, w in zip(names, got, want)}
    impl = kernels.impl if kernels.token_logprobs() else "reference (blocked, custom VJP)"
    tol = PALLAS_TOL if kernels.impl == "pallas" else F32_TOL[dev.platform]
    return [_kernel_line("kernel_logprobs", impl, errs, tol, shape=[n, dim, vocab])]


CHECKS = {
    "logits_vs_transformers": logits_vs_transformers,
    "engine_vs_trainer": engine_vs_trainer,
    "bf16_loss_grads": bf16_loss_grads,
    "kernel_training_attention": kernel_training_attention,
    "kernel_cached_attention": kernel_cached_attention,
    "kernel_logprobs": kernel_logprobs,
}

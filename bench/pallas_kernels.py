"""Pallas kernels vs their pure-JAX references: accuracy everywhere, timings on TPU.

Accuracy runs on the CPU device in Pallas interpret mode (any machine): the max abs error of
each kernel's outputs (and, for log-probs and attention, its input gradients) against the
reference, on small awkward shapes (edge tiles, GQA, packed segments, short cache rows).

Timings run only where ``jaxrl_kernels.select.use_pallas()`` is true (TPU): reference vs kernel
(vs splash for attention), forward and forward+backward, median wall time of jitted calls.
Elsewhere a line says why they were skipped (the kernels are Mosaic kernels; see
``kernels/select.py``).

    python bench/pallas_kernels.py [--iters 10] [--skip-accuracy] [--skip-timing]

Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.attention import segment_attention, segment_attention_reference, splash_segment_attention
from jaxrl_kernels.decode_attention import decode_attention, decode_attention_reference
from jaxrl_kernels.logprobs import logprobs, logprobs_reference
from jaxrl_kernels.select import current_platform, use_pallas


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def errors(prefix: str, got, want) -> dict[str, float]:
    """Max abs error over all leaves, and the max over leaves of abs error / max |reference|."""
    abs_err, rel_err = 0.0, 0.0
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
        abs_err = max(abs_err, err)
        rel_err = max(rel_err, err / max(float(jnp.max(jnp.abs(y.astype(jnp.float32)))), 1e-30))
    return {f"max_abs_{prefix}err": abs_err, f"max_rel_{prefix}err": rel_err}


def out_and_grads(fn: Callable, diff: tuple[int, ...]) -> Callable:
    """A jitted ``(args, cot) -> (outputs, VJP of cot wrt the arguments at positions diff)``."""

    @jax.jit
    def run(args, cot):
        def f(*d):
            full = list(args)
            for i, x in zip(diff, d):
                full[i] = x
            return fn(*full)

        out, vjp = jax.vjp(f, *(args[i] for i in diff))
        return out, vjp(cot)

    return run


def _rng_arrays(seed: int, dtype, *shapes):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def packed_segments(b: int, t: int, seed: int) -> jax.Array:
    """Random packing: segments of 1..t/4 tokens, the tail padded with id 0."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for row in seg:
        pos, sid = 0, 1
        while pos < t - t // 8:
            n = int(rng.integers(1, max(2, t // 4)))
            row[pos : pos + n], pos, sid = sid, pos + n, sid + 1
    return jnp.asarray(seg)


# ---------------------------------------------------------------------------------------------
# Problems: (args, kernel fn, reference fn, differentiable argument positions).


def logprob_problem(n, d, v, dtype, block_n, block_v, interpret, seed=0):
    hidden, lm_head = _rng_arrays(seed, dtype, (n, d), (d, v))
    rng = np.random.default_rng(seed + 1)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    temperature = jnp.asarray(rng.uniform(0.5, 1.5, n), jnp.float32)
    kernel = lambda h, w, y, t: logprobs(h, w, y, t, block_n=block_n, block_v=block_v, interpret=interpret)
    cot = tuple(_rng_arrays(seed + 2, jnp.float32, (n,), (n,)))
    return (hidden, lm_head, targets, temperature), kernel, logprobs_reference, (0, 1, 3), cot


def attention_problem(b, t, h, k, d, dtype, block, interpret, seed=0):
    q, kk, v, cot = _rng_arrays(seed, dtype, (b, t, h, d), (b, t, k, d), (b, t, k, d), (b, t, h, d))
    kernel = lambda q, k, v, s: segment_attention(
        q, k, v, s, block_q=block, block_k=block, interpret=interpret
    )
    return (q, kk, v, packed_segments(b, t, seed)), kernel, segment_attention_reference, (0, 1, 2), cot


def decode_problem(b, s, h, k, d, dtype, block_s, interpret, seed=0):
    """Query b reads cache row b of a one-layer, heads-major [B, K, S, Dh] cache."""
    q, kc, vc = _rng_arrays(seed, dtype, (b, h, d), (b, k, s, d), (b, k, s, d))
    lengths = jnp.asarray(np.random.default_rng(seed + 1).integers(1, s + 1, b), jnp.int32)
    kernel = lambda q, k, v, n: decode_attention(q, k, v, n, block_s=block_s, interpret=interpret)
    return (q, kc, vc, lengths), kernel, decode_attention_reference, (), None


# ---------------------------------------------------------------------------------------------


def accuracy() -> None:
    problems = {
        "logprobs": logprob_problem(70, 32, 1000, jnp.float32, 32, 256, interpret=True),
        "segment_attention": attention_problem(2, 100, 4, 2, 32, jnp.float32, 32, interpret=True),
        "decode_attention": decode_problem(6, 100, 8, 2, 32, jnp.float32, 32, interpret=True),
    }
    with jax.default_device(jax.devices("cpu")[0]):
        for name, (args, kernel, ref, diff, cot) in problems.items():
            if diff:
                out, grads = out_and_grads(kernel, diff)(args, cot)
                out_r, grads_r = out_and_grads(ref, diff)(args, cot)
                errs = errors("", out, out_r) | errors("grad_", grads, grads_r)
            else:
                errs = errors("", jax.jit(kernel)(*args), ref(*args))
            emit(kernel=name, mode="interpret", device="cpu", shapes=[list(a.shape) for a in args], **errs)


def median_ms(fn: Callable, args: tuple, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def timing(iters: int) -> None:
    platform = current_platform()
    if not use_pallas(platform):
        emit(
            timing="skipped",
            platform=platform,
            reason="the kernels are Mosaic (TPU) kernels; see kernels/select.py",
        )
        return
    bf16 = jnp.bfloat16
    problems = {
        "logprobs": logprob_problem(2048, 2048, 151936, bf16, None, None, interpret=False),
        "segment_attention": attention_problem(2, 4096, 16, 8, 128, bf16, 128, interpret=False),
        "decode_attention": decode_problem(32, 4096, 16, 8, 128, bf16, None, interpret=False),
    }
    for name, (args, kernel, ref, diff, cot) in problems.items():
        impls = {"reference": ref, "pallas": kernel}
        if name == "segment_attention":
            impls["splash"] = splash_segment_attention
        for impl, fn in impls.items():
            row = {
                "kernel": name,
                "impl": impl,
                "platform": platform,
                "shapes": [list(a.shape) for a in args],
            }
            row["fwd_ms"] = median_ms(jax.jit(fn), args, iters)
            if diff:
                row["fwd_bwd_ms"] = median_ms(out_and_grads(fn, diff), (args, cot), iters)
            emit(**row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    a = p.parse_args()
    if not a.skip_accuracy:
        accuracy()
    if not a.skip_timing:
        timing(a.iters)


if __name__ == "__main__":
    main()

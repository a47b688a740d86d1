"""Peak temporary memory of log-prob forward + backward: blocked vs naive, small vs large vocab.

Compiles (never runs) ``jit(value_and_grad(sum(token_logprobs)))`` for N tokens and reads XLA's
memory analysis, so it takes seconds on CPU. The blocked version's temp memory should barely
grow from an 8k to a 152k vocabulary (target <= 1.3x); the naive one grows with N * V.

    python bench/logprob_memory.py [--tokens 2048] [--dim 512] [--block-size 4096]

Prints one JSON line per (impl, vocab) and one ratio line per impl.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from jaxrl.trainer.logprobs import token_logprobs, token_logprobs_reference

VOCABS = (8192, 151936)
IMPLS = {"blocked": token_logprobs, "reference": token_logprobs_reference}


def temp_bytes(fn, n: int, d: int, v: int, block_size: int) -> dict[str, int]:
    """XLA's compiled memory analysis of the value-and-grad (wrt hidden and lm_head)."""

    def loss(hidden, lm_head, targets, temperature):
        return jnp.sum(fn(hidden, lm_head, targets, temperature, block_size=block_size)[0])

    args = (
        jax.ShapeDtypeStruct((n, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.int32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    )
    stats = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return {"temp_bytes": stats.temp_size_in_bytes, "output_bytes": stats.output_size_in_bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--block-size", type=int, default=4096)
    a = p.parse_args()
    for impl, fn in IMPLS.items():
        temps = {}
        for v in VOCABS:
            stats = temp_bytes(fn, a.tokens, a.dim, v, a.block_size)
            temps[v] = stats["temp_bytes"]
            row = {"impl": impl, "tokens": a.tokens, "dim": a.dim, "vocab": v, "block_size": a.block_size}
            print(json.dumps(row | stats | {"logits_bytes": a.tokens * v * 4}), flush=True)
        ratio = temps[VOCABS[1]] / temps[VOCABS[0]]
        print(json.dumps({"impl": impl, "temp_ratio": round(ratio, 3), "vocabs": VOCABS}), flush=True)


if __name__ == "__main__":
    main()

"""Measured matmul peak: the denominator of MFU where no datasheet number applies (CPU)."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp


@functools.cache  # once per process: the host does not get faster between runs (tests start dozens)
def measure_matmul_peak(n: int = 1024, repeats: int = 10, dtype: jnp.dtype = jnp.float32) -> float:
    """Best observed FLOP/s of an ``n x n`` matmul on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best

"""Attention over the KV cache on XLA:CPU (decode steps and prefill chunks): a C++ XLA FFI kernel
(``cpu_cached_attention.cc``).

Why: the pure-JAX reference (``jaxrl.models.layers.cached_attention``) is memory-bound and
XLA:CPU reads the cache about three times per step (a gathered copy of each chunk, then the
products); the kernel reads each live key and value once. See the .cc file for the semantics,
which are the reference's (tests compare the two).

The source is built and registered by ``jaxrl_kernels.cpu_build`` (once per machine; where it cannot
be built, ``load()`` returns None and callers keep the reference).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_kernels.cpu_build import CppKernel

KERNEL = CppKernel("cpu_cached_attention.cc", "JaxrlCpuCachedAttention", "jaxrl_cpu_cached_attention")


def load() -> str | None:
    """The FFI target name once built and registered, or None (reason logged once)."""
    return KERNEL.load()


def build_and_register(compiler: str | None) -> str | None:
    """``load()`` with this compiler (uncached: tests use it to check the fallback)."""
    return KERNEL.build_and_register(compiler)


def cpu_cached_attention(
    q: jax.Array,
    kc: jax.Array,
    vc: jax.Array,
    layer: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    share_rows: jax.Array | None = None,
    share_lens: jax.Array | None = None,
) -> jax.Array:
    """``cached_attention``'s result (q [B, T, H, D] at ``positions`` [B, T] over cache row
    ``rows[b]`` of ``layer`` in the caches [L, R, K, S, D], float32 or bfloat16), from the C++
    kernel; ``load()`` must have returned a target. Padding rows and positions give zeros.

    ``share_rows`` / ``share_lens`` [B] (optional): positions < ``share_lens[b]`` of row
    ``rows[b]`` hold the same keys and values as row ``share_rows[b]``, and are read there (one
    copy shared by many rows stays in cache); the caller guarantees the values are equal, so the
    result is the same bit for bit."""
    target = load()
    assert target is not None, "cpu_cached_attention needs load() to succeed"
    if share_rows is None or share_lens is None:
        share_rows = share_lens = jnp.zeros(rows.shape, jnp.int32)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32),
        kc,
        vc,
        jnp.asarray(layer, jnp.int32),
        rows.astype(jnp.int32),
        positions.astype(jnp.int32),
        share_rows.astype(jnp.int32),
        share_lens.astype(jnp.int32),
    )
    return out.astype(q.dtype)

"""One-token decode attention over the engine's KV cache (Pallas), reading only the live prefix.

At each decode step every cache row ``b`` holds ``lengths[b]`` valid positions (the current
token's key and value already written at ``lengths[b] - 1``); everything after is stale. The
kernel walks the cache in ``block_s`` slices with an online softmax, and ``lengths`` is a scalar
prefetch: the index map clamps slices past a row's length onto its last live slice, so the
pipeline never fetches them, and the compute is skipped. Cost follows the live lengths, not the
cache size.

The cache stays in the engine's ``[B, S, K, Dh]`` layout (no per-step transpose of the whole
cache): the kernel views it as ``[B, S, K * Dh]`` (a free reshape) and takes kv head ``kh``'s keys
as the column slice ``[:, kh * Dh:(kh + 1) * Dh]`` of each tile, lane-aligned when ``Dh`` is a
multiple of 128. Queries of one kv head's group are the matching row slice of ``q[b]``.

A row with ``lengths[b] == 0`` attends to nothing and returns zeros (the decoder never produces
one: the current token is always in the cache). Lengths above ``S`` are clipped to ``S``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels._util import MASK_VALUE, cdiv, check_block, tpu_params

DEFAULT_BLOCK_S = 256
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _check_shapes(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array) -> None:
    b, h, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4:
        raise ValueError(
            f"k_cache and v_cache must both be [B, S, K, Dh], got {k_cache.shape} and {v_cache.shape}"
        )
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"caches must be [B={b}, S, K, Dh={d}], got {k_cache.shape}")
    if h % k_cache.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k_cache.shape[2]})")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be int32[B={b}], got shape {lengths.shape}")


@jax.jit
def decode_attention_reference(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array
) -> jax.Array:
    """Dense semantics: the decoder's ``attention`` of one query per row over cache positions
    ``< lengths[b]``; rows with ``lengths[b] == 0`` give zeros."""
    _check_shapes(q, k_cache, v_cache, lengths)
    b, h, d = q.shape
    s, kv_heads = k_cache.shape[1], k_cache.shape[2]
    live = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    qg = q.reshape(b, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, k_cache, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = jnp.where(live[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v_cache, preferred_element_type=jnp.float32)
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(b, h, d).astype(q.dtype)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    block_s: int = DEFAULT_BLOCK_S,
    interpret: bool = False,
) -> jax.Array:
    """Attention of ``q`` over the first ``lengths[b]`` positions of each cache row.

    Args:
      q: ``[B, H, Dh]`` queries of the current token.
      k_cache, v_cache: ``[B, S, K, Dh]`` with ``H`` a multiple of ``K``.
      lengths: ``int32[B]`` live positions per row (current token included).
      block_s: cache positions per tile (clipped to S; need not divide S). On TPU use a
        multiple of 8.
      interpret: run the kernel in Pallas interpret mode (any backend; for tests).

    Returns ``[B, H, Dh]`` in ``q``'s dtype. Forward only (decoding needs no gradient).
    """
    _check_shapes(q, k_cache, v_cache, lengths)
    check_block("block_s", block_s)
    b, s, kv_heads, d = k_cache.shape
    bs = min(block_s, s)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, s)

    def kv_index(row, j, lens):
        # Slices past the row's last live one map onto it: same block index, so no new DMA.
        # lax.div, not //: jnp's floor division of signed ints does not lower off-TPU (export).
        last_live = jnp.maximum(lax.div(lens[row] + bs - 1, bs) - 1, 0)
        return row, jnp.minimum(j, last_live), 0

    kv_spec = pl.BlockSpec((None, bs, kv_heads * d), kv_index)
    q_spec = pl.BlockSpec((None, q.shape[1], d), lambda row, j, lens: (row, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, cdiv(s, bs)),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((q.shape[1], 1), jnp.float32),
            pltpu.VMEM((q.shape[1], 1), jnp.float32),
            pltpu.VMEM((q.shape[1], d), jnp.float32),
        ],
    )
    flat = lambda c: c.reshape(b, s, kv_heads * d)
    return pl.pallas_call(
        partial(_decode_kernel, kv_heads=kv_heads, head_dim=d, scale=d**-0.5),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(lengths, q, flat(k_cache), flat(v_cache))


def _decode_kernel(lens_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, kv_heads, head_dim, scale):
    b, j = pl.program_id(0), pl.program_id(1)
    bs = k_ref.shape[0]
    group = q_ref.shape[0] // kv_heads
    length = lens_ref[b]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j * bs < length)
    def _step():
        pos = j * bs + lax.broadcasted_iota(jnp.int32, (1, bs), 1)
        live = pos < length  # [1, bs]; also masks positions past S in a partial last tile
        live_rows = j * bs + lax.broadcasted_iota(jnp.int32, (bs, 1), 0) < length
        for kh in range(kv_heads):  # static: K is small
            rows, cols = pl.ds(kh * group, group), pl.ds(kh * head_dim, head_dim)
            k = k_ref[:, cols]
            v = v_ref[:, cols]
            v = jnp.where(live_rows, v, jnp.zeros_like(v))  # stale / out-of-range rows may be NaN
            s = lax.dot_general(q_ref[rows, :], k, _NT, preferred_element_type=jnp.float32) * scale
            s = jnp.where(live, s, MASK_VALUE)
            m_prev = m_sc[rows, :]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.where(live, jnp.exp(s - m_new), 0.0)
            l_sc[rows, :] = alpha * l_sc[rows, :] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_sc[rows, :] = alpha * acc_sc[rows, :] + pv
            m_sc[rows, :] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        l = l_sc[...]
        o_ref[...] = jnp.where(l > 0, acc_sc[...] / jnp.where(l > 0, l, 1.0), 0.0).astype(o_ref.dtype)

"""One-token decode attention read in place from the engine's KV cache (Pallas).

The cache is heads-major, ``[layers, rows, kv_heads, max_len, head_dim]`` (the engine's layout,
``jaxrl.models.kv_cache.KVCache``): for one (layer, row, kv head) the positions are contiguous
``[max_len, head_dim]`` tiles, exactly the ``(block_s, head_dim)`` blocks this kernel reads, in
TPU's native tiled layout. So the kernel takes the *whole* cache plus three scalar-prefetched
operands (the layer, each query's cache row, each row's live length) and DMAs only live blocks of
the rows being decoded. Nothing is gathered, sliced, transposed or copied: an earlier
``[B, S, K, Dh]`` layout viewed as ``[B, S, K * Dh]`` cost a relayout copy of the whole K and V
cache per call on TPU (512 MiB of temporaries at 32 rows x 4096 positions x 8 x 128, bf16).

At each decode step, query ``b`` attends to positions ``< lengths[b]`` of cache row
``rows[b]`` (its own key and value already written at ``lengths[b] - 1``); everything after is
stale. The grid walks ``block_s`` slices with an online softmax; the index map clamps slices past
a row's length onto its last live slice, so the pipeline never fetches them, and the compute is
skipped. Cost follows the live lengths, not the cache size.

A query whose row lies outside the cache (the engine's padding) or whose length is 0 attends to
nothing and returns zeros. Lengths above ``max_len`` are clipped to it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_kernels._util import MASK_VALUE, cdiv, check_block
from jaxrl_kernels.tpu_budget import MiB, Chip, compiler_params, target_chip

# Bytes of K plus V per grid step to aim for: enough that a step's DMA (~1-3 us on v5e-v6e)
# dwarfs the ~0.35 us per-step overhead, small enough that a short row wastes little of its
# last block.
TARGET_STEP_BYTES = 2 * MiB
BLOCK_S_CANDIDATES = (128, 256, 512, 1024, 2048, 4096)
_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _as_5d(cache: jax.Array) -> jax.Array:
    """``[R, K, S, Dh]`` -> ``[1, R, K, S, Dh]`` (a leading unit dim: free in any layout)."""
    return cache[None] if cache.ndim == 4 else cache


def _check_shapes(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, lengths: jax.Array) -> None:
    b, h, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim not in (4, 5):
        raise ValueError(
            "k_cache and v_cache must both be [rows, K, S, Dh] or [layers, rows, K, S, Dh], "
            f"got {k_cache.shape} and {v_cache.shape}"
        )
    if k_cache.shape[-1] != d:
        raise ValueError(f"caches must end in head_dim {d} (q's), got {k_cache.shape}")
    if h % k_cache.shape[-3]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k_cache.shape[-3]})")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be int32[B={b}], got shape {lengths.shape}")


def _live(rows: jax.Array | None, lengths: jax.Array, n_rows: int, max_len: int, b: int):
    """(rows clamped into the cache, lengths: clipped to max_len, 0 for rows outside it)."""
    rows = jnp.arange(b, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    inside = (rows >= 0) & (rows < n_rows)
    lengths = jnp.where(inside, jnp.clip(lengths.astype(jnp.int32), 0, max_len), 0)
    return jnp.clip(rows, 0, n_rows - 1), lengths


@jax.jit
def decode_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    rows: jax.Array | None = None,
    layer: jax.Array | int = 0,
) -> jax.Array:
    """Dense semantics of ``decode_attention`` (same arguments): the decoder's ``attention`` of
    one query per row over cache positions ``< lengths[b]`` of row ``rows[b]``."""
    _check_shapes(q, k_cache, v_cache, lengths)
    k5, v5 = _as_5d(k_cache), _as_5d(v_cache)
    _, n_rows, kv_heads, s, d = k5.shape
    b, h, _ = q.shape
    rows, lengths = _live(rows, lengths, n_rows, s, b)
    k, v = k5[layer][rows], v5[layer][rows]  # [B, K, S, Dh]
    live = jnp.arange(s)[None, :] < lengths[:, None]  # [B, S]
    qg = q.reshape(b, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = jnp.where(live[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, v, preferred_element_type=jnp.float32)
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out.reshape(b, h, d).astype(q.dtype)


def choose_block_s(max_len: int, kv_heads: int, head_dim: int, itemsize: int, chip: Chip) -> int:
    """Cache positions per grid step: the largest candidate whose K + V bytes stay within
    ``TARGET_STEP_BYTES`` and whose double-buffered blocks fit the chip's budget; at most
    ``max_len``."""
    per_position = 2 * kv_heads * head_dim * itemsize  # K and V
    fits = [
        c
        for c in BLOCK_S_CANDIDATES
        if c * per_position <= TARGET_STEP_BYTES and 2 * c * per_position <= chip.block_budget
    ]
    return min(max(fits, default=BLOCK_S_CANDIDATES[0]), max_len)


def decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    rows: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    block_s: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Attention of ``q`` over the first ``lengths[b]`` positions of cache row ``rows[b]``.

    Args:
      q: ``[B, H, Dh]`` queries of the current token.
      k_cache, v_cache: ``[rows, K, S, Dh]``, or ``[layers, rows, K, S, Dh]`` with ``layer``
        naming the layer to read; ``H`` a multiple of ``K``. Read in place, never copied.
      lengths: ``int32[B]`` live positions per query (current token included).
      rows: ``int32[B]`` cache row of each query (default ``arange(B)``); a row outside the
        cache gives zeros (the engine pads batches with such rows).
      layer: int or int32 scalar (traced is fine: it is a scalar prefetch); required for 5-D caches.
      block_s: cache positions per tile (clipped to S; need not divide S). Default: chosen for
        the target chip (``choose_block_s``). On TPU use a multiple of 16.
      interpret: run the kernel in Pallas interpret mode (any backend; for tests).

    Returns ``[B, H, Dh]`` in ``q``'s dtype. Forward only (decoding needs no gradient).
    """
    _check_shapes(q, k_cache, v_cache, lengths)
    if k_cache.ndim == 5 and layer is None:
        raise ValueError("a [layers, rows, K, S, Dh] cache needs `layer`")
    k5, v5 = _as_5d(k_cache), _as_5d(v_cache)
    _, n_rows, kv_heads, s, d = k5.shape
    b, h, _ = q.shape
    chip = target_chip()
    if block_s is None:
        block_s = choose_block_s(s, kv_heads, d, k5.dtype.itemsize, chip)
    check_block("block_s", block_s)
    bs = min(block_s, s)
    rows, lengths = _live(rows, lengths, n_rows, s, b)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))

    def kv_index(i, j, layer_ref, rows_ref, lens_ref):
        # Slices past the row's last live one map onto it: same block index, so no new DMA.
        # lax.div, not //: jnp's floor division of signed ints does not lower off-TPU (export).
        last_live = jnp.maximum(lax.div(lens_ref[i] + bs - 1, bs) - 1, 0)
        return layer_ref[0], rows_ref[i], 0, jnp.minimum(j, last_live), 0

    kv_spec = pl.BlockSpec((None, None, kv_heads, bs, d), kv_index)
    q_spec = pl.BlockSpec((None, h, d), lambda i, j, *_: (i, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, cdiv(s, bs)),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, 1), jnp.float32),
            pltpu.VMEM((h, d), jnp.float32),
        ],
    )
    return pl.pallas_call(
        partial(_decode_kernel, scale=d**-0.5),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(chip, "parallel", "arbitrary"),
        interpret=interpret,
    )(layer_arr, rows, lengths, q, k5, v5)


def _decode_kernel(layer_ref, rows_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, scale):
    del layer_ref, rows_ref  # used by the index maps only
    i, j = pl.program_id(0), pl.program_id(1)
    kv_heads, bs = k_ref.shape[0], k_ref.shape[1]
    group = q_ref.shape[0] // kv_heads
    length = lens_ref[i]

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
            rows = pl.ds(kh * group, group)
            k = k_ref[kh]
            v = v_ref[kh]
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

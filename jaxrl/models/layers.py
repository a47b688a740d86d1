"""The decoder's layers as functions of arrays: RMS norm, RoPE, the projections, training
attention over packed segments, attention over the KV cache, the packed causal mask and the LoRA
merge. ``jaxrl.models.decoder`` composes them (as Levanter keeps its layers apart from its
models); kernels replace some of them behind ``jaxrl.kernel_dispatch``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Query rows per attention block in the training forward (see ``attention``): on CPU, 128
# measured fastest among 64 / 128 / 256 / whole rows at sequence length 512.
CAUSAL_BLOCK = 128


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [B, T, head_dim] in Hugging Face's rotate-half layout, times ``scale``
    (YaRN's attention factor; 1 otherwise)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, head_dim]."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


@jax.custom_vjp
def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w [K, M]``: a projection whose weight gradient is one canonical matmul.

    Autodiff would express the weight gradient as a dot that contracts the leading (token) axis
    of both operands; XLA:CPU leaves that form to its generic Eigen path, about half as fast as
    the YNNPACK kernels that take ``[M, K] @ [K, N]``. The backward pass here materialises the
    activations' transpose (``optimization_barrier`` stops XLA from folding it back into the
    dot), which costs a copy the size of ``x`` and nothing on other backends but that copy.
    """
    return jnp.dot(x, w)


def _dense_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return jnp.dot(x, w), (x, w)


def _dense_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dx = jnp.dot(g2, w.T).reshape(x.shape)
    dw = jnp.dot(jax.lax.optimization_barrier(x2.T), g2)
    return dx.astype(x.dtype), dw.astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    causal_block: int | None = None,
) -> jax.Array:
    """Grouped-query attention (training, and the dense reference in tests). q: [B,T,H,D];
    k, v: [B,S,K,D]; mask: bool [B,T,S].

    ``causal_block`` (training, where key s is query s and ``mask`` is causal): queries are
    taken in blocks of that many rows, each against only the keys up to its last row. The keys
    skipped are masked anyway, so the result is the same while the scores above the diagonal
    (almost half of them) are never computed, in the forward pass or the backward.
    """
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
    if causal_block is None or causal_block >= t:
        out = _attend(qg, k, v, mask)
    else:
        ends = list(range(causal_block, t, causal_block)) + [t]
        starts = [0] + ends[:-1]
        out = jnp.concatenate(
            [_attend(qg[:, s:e], k[:, :e], v[:, :e], mask[:, s:e, :e]) for s, e in zip(starts, ends)],
            axis=1,
        )
    return out.reshape(b, t, h, d).astype(q.dtype)


def _attend(qg: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention of qg [B,T,K,G,D] over k, v [B,S,K,D]; float32 [B,T,K,G,D] out.

    The softmax is left unnormalised until after the value product, so the division runs over
    [T, D] rather than [T, S]; the max is a constant shift of the softmax, so no gradient flows
    through it.
    """
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (qg.shape[-1] ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    shift = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    p = jnp.exp(scores - shift)
    denom = jnp.sum(p, axis=-1)  # [B,K,G,T]
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out / jnp.transpose(denom, (0, 3, 1, 2))[..., None]


# Cache positions attention over the KV cache reads per loop trip (``cached_attention``); on CPU, 64
# and 128 measured alike at 100-1000 positions, 256 slower.
CACHE_CHUNK = 128
# Batch rows that share one trip count in ``cached_attention``: a block stops at its own furthest
# query, so a batch sorted by length (the engine's decode batches are) reads little past each
# row's end. 32 rows x 4 layers on CPU at 150-900 positions: one block 19.6 ms, blocks of 8
# 13.2 (quiet host); blocks of 4 / 8 / 1 22.1 / 31.4 / 36.9 (another run, loaded host,
# interleaved medians); at 30-150 positions blocks of 4 / 8 6.2 / 7.9 ms.
ROW_BLOCK = 4


def cached_attention(
    q: jax.Array, kc: jax.Array, vc: jax.Array, layer: jax.Array, rows: jax.Array, positions: jax.Array,
    *, row_block: int | None = ROW_BLOCK,
) -> jax.Array:
    """Attention of queries q [B, T, H, D] at ``positions`` [B, T] over cache row ``rows[b]`` of
    ``layer`` in the caches [layers, rows, K, S, D]: each query sees the positions <= its own.
    Rows go in blocks of ``row_block`` (None: one block), each walking the cache as far as it
    needs (``_cached_attention_block``); ``Kernels.loops_sync_host`` says where one block is best."""
    b = q.shape[0]
    if row_block is None or b <= row_block or b % row_block:
        return _cached_attention_block(q, kc, vc, layer, rows, positions)
    blocks = [slice(i, i + row_block) for i in range(0, b, row_block)]
    return jnp.concatenate([_cached_attention_block(q[s], kc, vc, layer, rows[s], positions[s]) for s in blocks])


def _cached_attention_block(
    q: jax.Array, kc: jax.Array, vc: jax.Array, layer: jax.Array, rows: jax.Array, positions: jax.Array
) -> jax.Array:
    """``cached_attention`` of one block of rows.

    The reference for prefill and decode (the TPU decode kernel reads the cache in place
    instead). It walks the cache in chunks of ``CACHE_CHUNK`` positions with an online softmax,
    for as many chunks as the block's furthest query needs (a dynamic trip count: no program
    per length bucket, and short sequences in a long cache read only their part). Each chunk is
    read from the cache rows as contiguous slices (one gather of ``[B, K, chunk, D]``).
    Measured on CPU (decode, 32 rows, 4 layers) against reading a power-of-two length bucket
    of the rows at once: 3.7 -> 3.0 ms at 100 positions, 46 -> 15 ms at 600. Queries are folded
    into one axis with the group ([B, K, G*T, D] x [B, K, S, D]), which XLA:CPU runs 1.5x faster
    than a separate query-length axis. Queries at positions >= S (padding) are discarded.
    """
    b, t, h, d = q.shape
    kv_heads, max_len = kc.shape[2], kc.shape[3]
    g = h // kv_heads
    chunk = min(CACHE_CHUNK, max_len)
    qg = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)
    qg = qg.astype(jnp.float32) * (d**-0.5)
    query_pos = jnp.broadcast_to(positions[:, None, :], (b, g, t)).reshape(b, 1, g * t, 1)

    def read(cache: jax.Array, start: jax.Array) -> jax.Array:
        # A slice per row, stacked, not ``vmap`` of the slice: vmap makes it a gather, for which
        # XLA:TPU re-lays the whole cache positions-major and copies it back per program (the
        # engine prefill's temporaries were 2x its KV cache: Qwen3-0.6B, 16 x 4096 on v5e:2x4,
        # 1.88 GiB per chip for a 0.88 GiB cache; 0.07 with slices). A block has ROW_BLOCK
        # rows (or a batch not a multiple of it: the engine's buckets are powers of two).
        return jnp.stack([
            jax.lax.dynamic_slice(cache, (layer, rows[i], 0, start, 0), (1, 1, kv_heads, chunk, d))[0, 0]
            for i in range(b)
        ]).astype(jnp.float32)  # fmt: skip

    def body(i, carry):  # type: ignore[no-untyped-def]
        m, total, acc = carry
        first = i * chunk
        start = jnp.minimum(first, max_len - chunk)  # the last chunk may overlap the one before
        key_pos = start + jnp.arange(chunk)
        visible = (key_pos >= first) & (key_pos <= query_pos)  # [B, 1, G*T, chunk]
        scores = jnp.einsum("bkqd,bksd->bkqs", qg, read(kc, start))
        scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = jnp.exp(scores - m_new[..., None])
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("bkqs,bksd->bkqd", p, read(vc, start))
        return m_new, total * scale + jnp.sum(p, axis=-1), acc

    furthest = jnp.max(jnp.where(positions < max_len, positions, 0))
    trips = furthest // chunk + 1
    init = (
        jnp.full((b, kv_heads, g * t), -jnp.inf, jnp.float32),
        jnp.zeros((b, kv_heads, g * t), jnp.float32),
        jnp.zeros((b, kv_heads, g * t, d), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, trips, body, init)
    out = (acc / total[..., None]).reshape(b, kv_heads, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d).astype(q.dtype)


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """Causal mask that never crosses samples packed into one row. segment_ids: [B, T]."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal[None] & same


def lora_merge(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """One layer's weight ``w`` ``[*in, *out]`` plus ``scale * A @ B`` of its LoRA adapters
    (A ``[*in, r]``, B ``[r, *out]``), in ``w``'s dtype."""
    rank = a.shape[-1]
    delta = (scale * (a.reshape(-1, rank) @ b.reshape(rank, -1))).reshape(w.shape)
    return (w + delta.astype(w.dtype)).astype(w.dtype)

"""Causal attention restricted to packed segments (flash-style Pallas kernels, forward and backward).

Training rows pack several samples; token ``t`` may attend to token ``s`` only when ``s <= t`` and
both carry the same segment id (DESIGN 4). ``segment_attention`` computes exactly what
``attention(q, k, v, packed_causal_mask(segment_ids))`` in ``jaxrl.models.decoder`` computes, with
grouped-query heads and scale ``head_dim ** -0.5``, but never holds a ``[T, T]`` score matrix:

* forward: grid (batch, q head, q block, kv block); an online softmax (running max, sum and
  output accumulator in VMEM scratch) walks the kv blocks; it also writes the row logsumexp;
* backward (Pallas too): a dq kernel walks kv blocks per q block, and a dk/dv kernel walks
  (query head in the kv head's group) x (q block) per kv block, recomputing probabilities from the
  logsumexp, as in FlashAttention-2. GQA gradients are summed inside the dk/dv kernel, so no
  per-query-head copy of dk/dv is ever materialised.

Blocks above the causal diagonal are skipped, and their index maps point at the last block
needed, so the pipeline does not even fetch them. Padding segment id 0 is an ordinary segment:
padding tokens attend to each other, exactly as in the reference. Every query sees at least
itself, so no softmax row is empty.

``select_attention`` picks the implementation per platform: jax's splash attention on TPU
(block-sparse, tuned) when the sequence length suits it, this kernel on TPU otherwise, and the
pure-JAX reference on CPU and GPU (see ``jaxrl_kernels.select``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_kernels._util import MASK_VALUE, check_block, round_up, tpu_params
from jaxrl_kernels.select import current_platform, use_pallas

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
SPLASH_BLOCK = 128  # splash needs the sequence length to be a multiple of its blocks
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> None:
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != d:
        raise ValueError(f"k and v must be [B={b}, T={t}, K, Dh={d}], got {k.shape} and {v.shape}")
    if h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[2]})")
    if segment_ids.shape != (b, t):
        raise ValueError(f"segment_ids must be [B={b}, T={t}], got {segment_ids.shape}")


@jax.jit
def segment_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array
) -> jax.Array:
    """Dense semantics: the decoder's ``attention`` under ``packed_causal_mask(segment_ids)``."""
    _check_shapes(q, k, v, segment_ids)
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    mask = jnp.tril(jnp.ones((t, t), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def blocked_segment_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block: int = 512
) -> jax.Array:
    """``segment_attention_reference``'s result, for long sequences where no kernel runs (the
    context-parallel path on CPU): queries in blocks of ``block`` rows, each against the keys up to
    its last row only, so the scores above the causal diagonal (about half) are never computed
    or kept for the backward pass, and no [T, T] mask exists."""
    _check_shapes(q, k, v, segment_ids)
    b, t, h, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
    outs = []
    for start in range(0, t, block):
        end = min(start + block, t)
        rows, cols = jnp.arange(start, end), jnp.arange(end)
        mask = (cols[None, :] <= rows[:, None])[None] & (
            segment_ids[:, start:end, None] == segment_ids[:, None, :end]
        )
        scores = jnp.einsum("btkgd,bskd->bkgts", qg[:, start:end], k[:, :end], preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None, None], scores * (d**-0.5), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bkgts,bskd->btkgd", probs, v[:, :end], preferred_element_type=jnp.float32))
    return jnp.concatenate(outs, axis=1).reshape(b, t, h, d).astype(q.dtype)


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    interpret: bool = False,
) -> jax.Array:
    """Causal, segment-restricted grouped-query attention (Pallas forward and backward).

    Args:
      q: ``[B, T, H, Dh]``; k, v: ``[B, T, K, Dh]`` with ``H`` a multiple of ``K``.
      segment_ids: ``int32[B, T]``; tokens attend only within their own segment.
      block_q, block_k: tile sizes along T (clipped to T; T is padded to a multiple of both).
        On TPU use multiples of 128 (the kv segment-id tile is lane-major).
      interpret: run the kernels in Pallas interpret mode (any backend; for tests).

    Returns ``[B, T, H, Dh]`` in ``q``'s dtype; differentiable in ``q``, ``k`` and ``v``.
    """
    _check_shapes(q, k, v, segment_ids)
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    t = q.shape[1]
    bq, bk = min(block_q, t), min(block_k, t)
    t_pad = round_up(t, math.lcm(bq, bk))
    # Head-major layout, so each tile is a [block, Dh] matrix. Padding goes at the end of the
    # row, after every real token, so causality alone hides it from real queries.
    heads_major = lambda x: jnp.pad(x.swapaxes(1, 2), ((0, 0), (0, 0), (0, t_pad - t), (0, 0)))
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, t_pad - t)), constant_values=-1)
    out = _attention(heads_major(q), heads_major(k), heads_major(v), seg, (bq, bk), interpret)
    return out[:, :, :t].swapaxes(1, 2)


# ---------------------------------------------------------------------------------------------
# Kernel bodies. Tiles: q/do [bq, Dh], k/v [bk, Dh]; q segment ids as a [bq, 1] column and kv
# segment ids as a [1, bk] row, so their comparison broadcasts to the [bq, bk] score tile.


def _needed(i, j, bq, bk):
    """Whether kv block j holds any key at or before the last query of q block i."""
    return j * bk <= (i + 1) * bq - 1


def _last_kv_block(i, bq, bk):
    # lax.div, not //: block indices are non-negative, and Mosaic lowers jnp's floor division
    # of signed ints through a sign op that needs a real TPU to lower.
    return lax.div((i + 1) * bq - 1, bk)


def _scores(q, k, qseg, kseg, i, j, scale):
    """Scaled scores of one tile and its mask (causal within segment)."""
    bq, bk = q.shape[0], k.shape[0]
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32) * scale
    rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    cols = j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = (cols <= rows) & (qseg == kseg)
    return jnp.where(mask, s, MASK_VALUE), mask


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, scale):
    i, j = pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(_needed(i, j, bq, bk))
    def _step():
        s, mask = _scores(q_ref[...], k_ref[...], qseg_ref[...], kseg_ref[...], i, j, scale)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # finite, as s is
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        v = v_ref[...]
        acc_sc[...] = alpha * acc_sc[...] + lax.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_sc[...]  # > 0: every query attends to itself
        o_ref[...] = (acc_sc[...] / l).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l)


def _probs_and_dscores(in_refs, i, j, scale):
    """Recomputed probabilities p and d loss / d (unscaled) scores, ``p * (do @ v.T - delta)``.

    ``in_refs`` are the backward kernels' inputs: q, k, v, do, q/kv segment ids, lse, delta.
    """
    q_ref, k_ref, v_ref, do_ref, qseg_ref, kseg_ref, lse_ref, delta_ref = in_refs
    s, mask = _scores(q_ref[...], k_ref[...], qseg_ref[...], kseg_ref[...], i, j, scale)
    p = jnp.where(mask, jnp.exp(s - lse_ref[...]), 0.0)
    dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=jnp.float32)
    return p, p * (dp - delta_ref[...])


def _dq_kernel(*refs, scale):
    in_refs, (dq_ref, dq_sc) = refs[:8], refs[8:]
    q_ref, k_ref = in_refs[:2]
    i, j = pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(_needed(i, j, bq, bk))
    def _step():
        _, ds = _probs_and_dscores(in_refs, i, j, scale)
        k = k_ref[...]
        dq_sc[...] += lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, scale, q_blocks):
    in_refs, (dk_ref, dv_ref, dk_sc, dv_sc) = refs[:8], refs[8:]
    q_ref, k_ref, _, do_ref = in_refs[:4]
    j, r = pl.program_id(2), pl.program_id(3)  # r runs over (query head in group, q block)
    i = lax.rem(r, q_blocks)
    bq, bk = q_ref.shape[0], k_ref.shape[0]

    @pl.when(r == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(_needed(i, j, bq, bk))
    def _step():
        p, ds = _probs_and_dscores(in_refs, i, j, scale)
        q, do = q_ref[...], do_ref[...]
        dv_sc[...] += lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)
        dk_sc[...] += lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)

    @pl.when(r == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers (all arrays head-major and padded: q [B,H,Tp,Dh], k/v [B,K,Tp,Dh]).


def _fwd_call(q, k, v, seg, blocks, interpret):
    (b, h, t, d), kv_heads = q.shape, k.shape[1]
    group, (bq, bk) = h // kv_heads, blocks
    kv_block = lambda i, j: jnp.minimum(j, _last_kv_block(i, bq, bk))
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, h, i, j: (b, lax.div(h, group), kv_block(i, j), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j: (b, h, i, 0))
    return pl.pallas_call(
        partial(_fwd_kernel, scale=d**-0.5),
        grid=(b, h, t // bq, t // bk),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, bq, 1), lambda b, h, i, j: (b, i, 0)),
            pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
        ],
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, t, 1), jnp.float32)],
        scratch_shapes=[
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, d), jnp.float32),
        ],
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q, k, v, seg[:, :, None], seg[:, None, :])


def _dq_call(q, k, v, do, seg, lse, delta, blocks, interpret):
    (b, h, t, d), kv_heads = q.shape, k.shape[1]
    group, (bq, bk) = h // kv_heads, blocks
    kv_block = lambda i, j: jnp.minimum(j, _last_kv_block(i, bq, bk))
    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, h, i, j: (b, lax.div(h, group), kv_block(i, j), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j: (b, h, i, 0))
    return pl.pallas_call(
        partial(_dq_kernel, scale=d**-0.5),
        grid=(b, h, t // bq, t // bk),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            q_spec,
            pl.BlockSpec((None, bq, 1), lambda b, h, i, j: (b, i, 0)),
            pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, kv_block(i, j))),
            row_spec,
            row_spec,
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q, k, v, do, seg[:, :, None], seg[:, None, :], lse, delta)


def _dkv_call(q, k, v, do, seg, lse, delta, blocks, interpret):
    (b, h, t, d), kv_heads = q.shape, k.shape[1]
    group, (bq, bk) = h // kv_heads, blocks
    q_blocks = t // bq

    def q_index(b, kh, j, r):
        # Query head kh * group + r // q_blocks, q block r % q_blocks, clamped up to the first
        # q block that can see kv block j (earlier ones are skipped, so never fetched).
        i = jnp.maximum(lax.rem(r, q_blocks), lax.div(j * bk, bq))
        return b, kh * group + lax.div(r, q_blocks), i

    q_spec = pl.BlockSpec((None, None, bq, d), lambda b, kh, j, r: (*q_index(b, kh, j, r), 0))
    row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, kh, j, r: (*q_index(b, kh, j, r), 0))
    kv_spec = pl.BlockSpec((None, None, bk, d), lambda b, kh, j, r: (b, kh, j, 0))
    return pl.pallas_call(
        partial(_dkv_kernel, scale=d**-0.5, q_blocks=q_blocks),
        grid=(b, kv_heads, t // bk, group * q_blocks),
        in_specs=[
            q_spec,
            kv_spec,
            kv_spec,
            q_spec,
            pl.BlockSpec((None, bq, 1), lambda b, kh, j, r: (b, q_index(b, kh, j, r)[2], 0)),
            pl.BlockSpec((None, 1, bk), lambda b, kh, j, r: (b, 0, j)),
            row_spec,
            row_spec,
        ],
        out_specs=[kv_spec, kv_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)],
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q, k, v, do, seg[:, :, None], seg[:, None, :], lse, delta)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, seg, blocks, interpret):
    return _fwd_call(q, k, v, seg, blocks, interpret)[0]


def _attention_fwd(q, k, v, seg, blocks, interpret):
    out, lse = _fwd_call(q, k, v, seg, blocks, interpret)
    return out, (q, k, v, seg, out, lse)


def _attention_bwd(blocks, interpret, res, d_out):
    q, k, v, seg, out, lse = res
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    dq = _dq_call(q, k, v, d_out, seg, lse, delta, blocks, interpret)
    dk, dv = _dkv_call(q, k, v, d_out, seg, lse, delta, blocks, interpret)
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------
# Per-platform selection; splash attention on TPU.


def splash_segment_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, interpret: bool = False
) -> jax.Array:
    """``segment_attention`` through jax's splash attention (TPU; T a multiple of 128).

    Splash takes unscaled, head-major inputs per batch row and a static causal mask; segments
    come in as ``SegmentIds``. GQA maps onto its multi-head form (``H`` a multiple of ``K``).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _check_shapes(q, k, v, segment_ids)
    _, t, h, d = q.shape
    if t % SPLASH_BLOCK:
        raise ValueError(f"splash attention needs T a multiple of {SPLASH_BLOCK}, got T={t}")
    mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * h)
    kernel = splash.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret)
    seg = segment_ids.astype(jnp.int32)
    one_row = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(q=s, kv=s))
    q_scaled = (q.swapaxes(1, 2) * (d**-0.5)).astype(q.dtype)
    out = jax.vmap(one_row)(q_scaled, k.swapaxes(1, 2), v.swapaxes(1, 2), seg)
    return out.swapaxes(1, 2).astype(q.dtype)


def select_attention(platform: str | None = None) -> AttentionFn:
    """The segment attention to use on ``platform`` (default: JAX's default backend).

    TPU: splash attention when T is a multiple of 128, else our kernel (decided per call from
    static shapes). CPU and GPU: the pure-JAX reference (see ``jaxrl_kernels.select``).
    """
    if not use_pallas(platform or current_platform()):
        return segment_attention_reference
    return tpu_segment_attention


def tpu_segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The compiled kernel for TPU: splash when T is a multiple of 128, ours otherwise (decided
    from static shapes, per call)."""
    if q.shape[1] % SPLASH_BLOCK == 0:
        return splash_segment_attention(q, k, v, segment_ids)
    return segment_attention(q, k, v, segment_ids)

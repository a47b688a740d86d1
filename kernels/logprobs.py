"""Fused, vocabulary-blocked token log-probs and entropies of temperature-scaled logits (Pallas).

``logprobs`` computes, for every token row ``n``,
``logp[n] = log softmax(hidden[n] @ lm_head / temperature[n])[targets[n]]`` and the entropy of
that distribution, without ever holding ``[N, V]`` logits: the grid walks token blocks x
vocabulary blocks and keeps an online logsumexp (plus the target logit and ``sum p * logit``)
per row in VMEM scratch. The backward pass recomputes each block's logits from ``lse`` and
the entropy, in two kernels, because the two big gradients reduce over different axes:

* ``d_hidden`` (and ``d_temperature``) sum over vocabulary blocks: grid (tokens, vocab), the
  vocabulary axis innermost, the row gradient accumulated in scratch;
* ``d_lm_head`` sums over token blocks: grid (vocab, tokens), the token axis innermost, the
  ``[D, block_v]`` column gradient accumulated in scratch.

So the logits are computed three times in all (as in flash attention's backward), in exchange
for peak memory of one ``[block_n, block_v]`` tile. ``logprobs_reference`` is the naive
full-softmax version with the same semantics as ``jaxrl.trainer.logprobs.token_logprobs``.

Partial edge blocks (``N`` or ``V`` not a multiple of the block) are masked inside the kernels,
never padded outside them (a padded copy of ``lm_head`` would cost as much as the weights).
Softmax arithmetic is float32. Matmuls take the inputs' own dtype with float32 accumulation;
in the backward pass d(logits) is cast to that dtype first (as flash attention does with its
score gradients): a no-op for float32 inputs; for bfloat16 it matches what a float32
dot at TPU default precision does anyway.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels._util import cdiv, check_block, tpu_params

DEFAULT_BLOCK_N = 256
DEFAULT_BLOCK_V = 1024
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


@jax.jit
def logprobs_reference(
    hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Naive semantics of ``logprobs``: full float32 logits, log-softmax, gather, entropy."""
    logits = jnp.dot(hidden.astype(jnp.float32), lm_head.astype(jnp.float32))
    logits = logits / temperature.astype(jnp.float32)[:, None]
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    temperature: jax.Array,
    *,
    block_n: int = DEFAULT_BLOCK_N,
    block_v: int = DEFAULT_BLOCK_V,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``targets`` and entropy under ``softmax(hidden @ lm_head / temperature)``.

    Args:
      hidden: ``[N, D]`` final hidden states (any float dtype).
      lm_head: ``[D, V]`` output projection (any float dtype).
      targets: ``int32[N]`` token ids in ``[0, V)``.
      temperature: ``f32[N]`` per-token sampling temperature.
      block_n, block_v: tile sizes (token rows, vocabulary columns); clipped to ``N`` / ``V``.
        On TPU keep ``block_n`` a multiple of 8 and ``block_v`` a multiple of 128.
      interpret: run the Pallas kernels in interpret mode (any backend; for tests).

    Returns:
      ``(logp, entropy)``, both ``float32[N]``, differentiable with respect to ``hidden``,
      ``lm_head`` and ``temperature``; gradients come back in the inputs' dtypes.
    """
    check_block("block_n", block_n)
    check_block("block_v", block_v)
    n, d = hidden.shape
    if lm_head.ndim != 2 or lm_head.shape[0] != d:
        raise ValueError(f"lm_head must be [D={d}, V], got {lm_head.shape}")
    if targets.shape != (n,) or temperature.shape != (n,):
        raise ValueError(
            f"targets and temperature must be [N={n}], got {targets.shape} and {temperature.shape}"
        )
    blocks = (min(block_n, n), min(block_v, lm_head.shape[1]))
    return _logprobs(hidden, lm_head, targets.astype(jnp.int32), temperature, blocks, interpret)


# ---------------------------------------------------------------------------------------------
# Kernel bodies. Per-row vectors travel as [N, 1] columns: a block (block_n, 1) is legal on TPU
# (its minor dim equals the array's) and broadcasts against [block_n, block_v] tiles directly.


def _tile_logits(h, w, inv_t, col0, vocab):
    """Scaled logits of one tile with columns past ``vocab`` set to -inf, and their column ids."""
    cols = col0 + lax.broadcasted_iota(jnp.int32, (1, w.shape[1]), 1)
    z = lax.dot(h, w, preferred_element_type=jnp.float32)
    return jnp.where(cols < vocab, z * inv_t, -jnp.inf), cols


def _fwd_kernel(
    h_ref, w_ref, tgt_ref, invt_ref, logp_ref, ent_ref, lse_ref, m_sc, s_sc, e_sc, t_sc, *, vocab
):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
        e_sc[...] = jnp.zeros(e_sc.shape, jnp.float32)
        t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)

    bv = w_ref.shape[1]
    logits, cols = _tile_logits(h_ref[...], w_ref[...], invt_ref[...], j * bv, vocab)
    m_prev = m_sc[...]
    # Finite from the first tile on: every tile has at least one column inside the vocabulary.
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    scale = jnp.exp(m_prev - m_new)
    p = jnp.exp(logits - m_new)  # exactly 0 past the vocabulary
    s_sc[...] = s_sc[...] * scale + jnp.sum(p, axis=1, keepdims=True)
    # where, not a product: p * logit is 0 * -inf = NaN past the vocabulary.
    e_sc[...] = e_sc[...] * scale + jnp.sum(jnp.where(p > 0, p * logits, 0.0), axis=1, keepdims=True)
    t_sc[...] += jnp.sum(jnp.where(cols == tgt_ref[...], logits, 0.0), axis=1, keepdims=True)
    m_sc[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        s = s_sc[...]
        lse = m_sc[...] + jnp.log(s)
        lse_ref[...] = lse
        logp_ref[...] = t_sc[...] - lse
        ent_ref[...] = lse - e_sc[...] / s


def _tile_grad_logits(in_refs, col0, vocab):
    """d loss / d (scaled logits) of one tile, the logits with invalid columns zeroed, validity.

    ``in_refs`` are the backward kernels' inputs: hidden, lm_head, then the per-row columns
    targets, 1 / temperature, lse, E_p[logit], d logp, d entropy. With ``l`` the scaled logits
    and ``p`` their softmax: ``d logp / d l = onehot - p`` and ``d H / d l = -p * (l - E_p[l])``.
    Columns past the vocabulary get exactly 0.
    """
    h_ref, w_ref, tgt_ref, invt_ref, lse_ref, mean_ref, glogp_ref, gent_ref = in_refs
    logits, cols = _tile_logits(h_ref[...], w_ref[...], invt_ref[...], col0, vocab)
    valid = cols < vocab
    p = jnp.exp(logits - lse_ref[...])
    centred = jnp.where(valid, logits - mean_ref[...], 0.0)
    onehot = (cols == tgt_ref[...]).astype(jnp.float32)
    d_l = glogp_ref[...] * (onehot - p) - gent_ref[...] * p * centred
    return d_l, jnp.where(valid, logits, 0.0), valid


def _bwd_hidden_kernel(*refs, vocab):
    in_refs, (dh_ref, dt_ref, dh_sc, dt_sc) = refs[:8], refs[8:]
    _, w_ref, _, invt_ref = in_refs[:4]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_sc[...] = jnp.zeros(dh_sc.shape, jnp.float32)
        dt_sc[...] = jnp.zeros(dt_sc.shape, jnp.float32)

    d_l, logits, valid = _tile_grad_logits(in_refs, j * w_ref.shape[1], vocab)
    dt_sc[...] -= jnp.sum(d_l * logits, axis=1, keepdims=True)
    d_z = d_l * invt_ref[...]
    w = w_ref[...]
    w = jnp.where(valid, w, jnp.zeros_like(w))  # columns past V are unspecified memory (maybe NaN)
    dh_sc[...] += lax.dot_general(d_z.astype(w.dtype), w, _NT, preferred_element_type=jnp.float32)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        dh_ref[...] = dh_sc[...].astype(dh_ref.dtype)
        dt_ref[...] = dt_sc[...] * invt_ref[...]


def _bwd_head_kernel(*refs, vocab, n_rows):
    in_refs, (dw_ref, dw_sc) = refs[:8], refs[8:]
    h_ref, w_ref, _, invt_ref = in_refs[:4]
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        dw_sc[...] = jnp.zeros(dw_sc.shape, jnp.float32)

    bn = h_ref.shape[0]
    d_l, _, _ = _tile_grad_logits(in_refs, j * w_ref.shape[1], vocab)
    # Rows past N are unspecified memory (maybe NaN): zero both factors of the product.
    rows_ok = i * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0) < n_rows
    d_z = jnp.where(rows_ok, d_l * invt_ref[...], 0.0)
    h = h_ref[...]
    h = jnp.where(rows_ok, h, jnp.zeros_like(h))
    dw_sc[...] += lax.dot_general(h, d_z.astype(h.dtype), _TN, preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        dw_ref[...] = dw_sc[...].astype(dw_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP.


def _common_dot_dtype(hidden, lm_head):
    dt = jnp.promote_types(hidden.dtype, lm_head.dtype)
    return hidden.astype(dt), lm_head.astype(dt)


def _forward(hidden, lm_head, targets, inv_t, blocks, interpret):
    (n, d), vocab = hidden.shape, lm_head.shape[1]
    bn, bv = blocks
    col = lambda: pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    f32col = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    logp, ent, lse = pl.pallas_call(
        partial(_fwd_kernel, vocab=vocab),
        grid=(cdiv(n, bn), cdiv(vocab, bv)),
        in_specs=[
            pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
            pl.BlockSpec((d, bv), lambda i, j: (0, j)),
            col(),
            col(),
        ],
        out_specs=[col(), col(), col()],
        out_shape=[f32col, f32col, f32col],
        scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32)] * 4,
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(hidden, lm_head, targets[:, None], inv_t)
    return logp[:, 0], ent[:, 0], lse


def _backward(hidden, lm_head, targets, inv_t, lse, mean, g_logp, g_ent, blocks, interpret):
    (n, d), vocab = hidden.shape, lm_head.shape[1]
    bn, bv = blocks
    nb, vb = cdiv(n, bn), cdiv(vocab, bv)
    rows = (targets[:, None], inv_t, lse, mean, g_logp[:, None], g_ent[:, None])

    # d_hidden, d_temperature: grid (token block i, vocab block j), reduce over j.
    col = lambda: pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    d_h, d_t = pl.pallas_call(
        partial(_bwd_hidden_kernel, vocab=vocab),
        grid=(nb, vb),
        in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)), pl.BlockSpec((d, bv), lambda i, j: (0, j))]
        + [col() for _ in rows],
        out_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)), col()],
        out_shape=[jax.ShapeDtypeStruct((n, d), hidden.dtype), jax.ShapeDtypeStruct((n, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bn, d), jnp.float32), pltpu.VMEM((bn, 1), jnp.float32)],
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(hidden, lm_head, *rows)

    # d_lm_head: grid (vocab block j, token block i), reduce over i.
    col = lambda: pl.BlockSpec((bn, 1), lambda j, i: (i, 0))
    d_w = pl.pallas_call(
        partial(_bwd_head_kernel, vocab=vocab, n_rows=n),
        grid=(vb, nb),
        in_specs=[pl.BlockSpec((bn, d), lambda j, i: (i, 0)), pl.BlockSpec((d, bv), lambda j, i: (0, j))]
        + [col() for _ in rows],
        out_specs=pl.BlockSpec((d, bv), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct(lm_head.shape, lm_head.dtype),
        scratch_shapes=[pltpu.VMEM((d, bv), jnp.float32)],
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(hidden, lm_head, *rows)
    return d_h, d_w, d_t[:, 0]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _logprobs(hidden, lm_head, targets, temperature, blocks, interpret):
    return _fwd(hidden, lm_head, targets, temperature, blocks, interpret)[0]


def _fwd(hidden, lm_head, targets, temperature, blocks, interpret):
    inv_t = 1.0 / temperature.astype(jnp.float32)[:, None]
    h, w = _common_dot_dtype(hidden, lm_head)
    logp, ent, lse = _forward(h, w, targets, inv_t, blocks, interpret)
    return (logp, ent), (hidden, lm_head, targets, temperature, lse, ent)


def _bwd(blocks, interpret, res, cotangents):
    hidden, lm_head, targets, temperature, lse, ent = res
    g_logp, g_ent = (c.astype(jnp.float32) for c in cotangents)
    inv_t = 1.0 / temperature.astype(jnp.float32)[:, None]
    mean = lse - ent[:, None]  # E_p[logit]
    h, w = _common_dot_dtype(hidden, lm_head)
    d_h, d_w, d_t = _backward(h, w, targets, inv_t, lse, mean, g_logp, g_ent, blocks, interpret)
    return d_h.astype(hidden.dtype), d_w.astype(lm_head.dtype), None, d_t.astype(temperature.dtype)


_logprobs.defvjp(_fwd, _bwd)

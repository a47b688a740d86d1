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

Block sizes are chosen per kernel, at trace time, for the TPU being compiled for
(``jaxrl_kernels.tpu_budget``): the largest tiles that fit its VMEM, ranked by a roofline estimate.
The forward and ``d_hidden`` kernels re-read ``lm_head`` once per token block, so they want tall
token blocks; the ``d_lm_head`` kernel re-reads ``hidden`` once per vocabulary block, so it wants
wide vocabulary blocks. ``[D, block_v]`` and ``[block_n, D]`` tiles grow with the model width, so
at Qwen3-8B/32B widths the blocks that fit a v5e differ from a v6e's, and every kernel asks
Mosaic for the VMEM its blocks need (the default scoped limit is 16 MiB on v5e and v5p).
Float32 gradients accumulate in their output block (no separate scratch).

Partial edge blocks (``N`` or ``V`` not a multiple of the block) are masked inside the kernels,
never padded outside them (a padded copy of ``lm_head`` would cost as much as the weights).
Softmax arithmetic is float32. Matmuls take the inputs' own dtype with float32 accumulation;
in the backward pass d(logits) is cast to that dtype first (as flash attention does with its
score gradients): a no-op for float32 inputs; for bfloat16 it matches what a float32
dot at TPU default precision does anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_kernels._util import cdiv, check_block, round_up
from jaxrl_kernels.tpu_budget import Chip, best_blocks, compiler_params, target_chip

BLOCK_N_CANDIDATES = (16, 32, 64, 128, 256, 512, 1024, 2048)
BLOCK_V_CANDIDATES = (128, 256, 512, 1024, 2048, 4096)
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
    block_n: int | None = None,
    block_v: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``targets`` and entropy under ``softmax(hidden @ lm_head / temperature)``.

    Args:
      hidden: ``[N, D]`` final hidden states (any float dtype).
      lm_head: ``[D, V]`` output projection (any float dtype).
      targets: ``int32[N]`` token ids in ``[0, V)``.
      temperature: ``f32[N]`` per-token sampling temperature.
      block_n, block_v: tile sizes (token rows, vocabulary columns) for all three kernels;
        clipped to ``N`` / ``V``. Default (None): chosen per kernel for the target chip (see the
        module docstring). On TPU keep ``block_n`` a multiple of 16 and ``block_v`` of 128.
      interpret: run the Pallas kernels in interpret mode (any backend; for tests).

    Returns:
      ``(logp, entropy)``, both ``float32[N]``, differentiable with respect to ``hidden``,
      ``lm_head`` and ``temperature``; gradients come back in the inputs' dtypes.
    """
    n, d = hidden.shape
    if lm_head.ndim != 2 or lm_head.shape[0] != d:
        raise ValueError(f"lm_head must be [D={d}, V], got {lm_head.shape}")
    if targets.shape != (n,) or temperature.shape != (n,):
        raise ValueError(
            f"targets and temperature must be [N={n}], got {targets.shape} and {temperature.shape}"
        )
    itemsize = jnp.promote_types(hidden.dtype, lm_head.dtype).itemsize
    plan = plan_blocks(n, d, lm_head.shape[1], itemsize, target_chip(), block_n, block_v)
    return _logprobs(hidden, lm_head, targets.astype(jnp.int32), temperature, plan, interpret)


# ---------------------------------------------------------------------------------------------
# Block sizes per kernel and chip.

KERNELS = ("forward", "d_hidden", "d_lm_head")


@dataclass(frozen=True)
class Plan:
    """(block_n, block_v) of each kernel and the chip they were sized for (static, hashable)."""

    forward: tuple[int, int]
    d_hidden: tuple[int, int]
    d_lm_head: tuple[int, int]
    chip: Chip


def vmem_bytes(kernel: str, bn: int, bv: int, d: int, itemsize: int) -> int:
    """Estimated VMEM of one kernel: double-buffered input/output blocks, scratch, and a few
    ``[bn, bv]`` float32 temporaries. A ``[bn, 1]`` float32 column pads to 128 lanes."""
    col, tile = round_up(bn, 8) * 128 * 4, bn * bv * 4
    h, w = bn * d * itemsize, d * bv * itemsize
    f32_acc = itemsize != 4  # a float32 gradient accumulates in its own output block
    if kernel == "forward":  # in: h, w, 2 columns; out: 3 columns; scratch: 4 columns
        return 2 * (h + w) + 14 * col + 6 * tile
    if kernel == "d_hidden":  # in: h, w, 6 columns; out: dh, 1 column; scratch: dh (f32), 1 column
        return 2 * (h + w + h) + f32_acc * bn * d * 4 + 15 * col + 8 * tile
    # d_lm_head. in: h, w, 6 columns; out: dw; scratch: dw (f32)
    return 2 * (h + w + w) + f32_acc * d * bv * 4 + 12 * col + 8 * tile


def seconds(kernel: str, bn: int, bv: int, n: int, d: int, v: int, itemsize: int, chip: Chip) -> float:
    """Roofline estimate: forward and d_hidden stream ``lm_head`` once per token block;
    d_lm_head streams ``hidden`` once per vocabulary block."""
    nb, vb = cdiv(n, bn), cdiv(v, bv)
    matmuls = 1 if kernel == "forward" else 2
    if kernel == "d_lm_head":
        traffic = vb * n * d + 2 * d * v
    else:
        traffic = nb * d * v + (1 if kernel == "forward" else 2) * n * d
    return chip.seconds(2 * matmuls * n * d * v, traffic * itemsize, nb * vb, min(bn, bv))


def plan_blocks(
    n: int, d: int, v: int, itemsize: int, chip: Chip, block_n: int | None = None, block_v: int | None = None
) -> Plan:
    """Each kernel's blocks for ``chip``: given ones (clipped to N / V) or the best that fit."""
    for name, value in (("block_n", block_n), ("block_v", block_v)):
        if value is not None:
            check_block(name, value)
    ns = [min(block_n, n)] if block_n else sorted({min(b, n) for b in BLOCK_N_CANDIDATES})
    vs = [min(block_v, v)] if block_v else sorted({min(b, v) for b in BLOCK_V_CANDIDATES})

    def pick(kernel: str) -> tuple[int, int]:
        if block_n and block_v:
            return ns[0], vs[0]
        return best_blocks(
            ns,
            vs,
            lambda bn, bv: vmem_bytes(kernel, bn, bv, d, itemsize),
            lambda bn, bv: seconds(kernel, bn, bv, n, d, v, itemsize, chip),
            chip.block_budget,
        )

    return Plan(*(pick(k) for k in KERNELS), chip)


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


def _masked_on_last(step, steps, tail, ref, valid, use):
    """``use(ref[...])``, with ``ref``'s invalid part zeroed on the last step when the grid axis
    has a partial ``tail`` (a static int; 0: no partial block, no select at all)."""
    if not tail:
        use(ref[...])
        return

    @pl.when(step < steps - 1)
    def _full():
        use(ref[...])

    @pl.when(step == steps - 1)
    def _partial():
        x = ref[...]
        use(jnp.where(valid, x, jnp.zeros_like(x)))


def _bwd_hidden_kernel(*refs, vocab):
    # Scratch: d_temperature's column, then d_hidden's float32 accumulator unless d_hidden is
    # itself float32 (then it accumulates in its output block, resident across the vocab axis).
    in_refs, (dh_ref, dt_ref, dt_sc, *dh_sc) = refs[:8], refs[8:]
    acc = dh_sc[0] if dh_sc else dh_ref
    _, w_ref, _, invt_ref = in_refs[:4]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)
        dt_sc[...] = jnp.zeros(dt_sc.shape, jnp.float32)

    d_l, logits, valid = _tile_grad_logits(in_refs, j * w_ref.shape[1], vocab)
    dt_sc[...] -= jnp.sum(d_l * logits, axis=1, keepdims=True)
    d_z = d_l * invt_ref[...]

    def accumulate(w):
        acc[...] += lax.dot_general(d_z.astype(w.dtype), w, _NT, preferred_element_type=jnp.float32)

    # Columns past V (last block only) are unspecified memory, maybe NaN: zero them there. The
    # [D, block_v] select is costly to compile and run, so it exists only when V has a tail.
    _masked_on_last(j, pl.num_programs(1), vocab % w_ref.shape[1], w_ref, valid, accumulate)

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        if dh_sc:
            dh_ref[...] = acc[...].astype(dh_ref.dtype)
        dt_ref[...] = dt_sc[...] * invt_ref[...]


def _bwd_head_kernel(*refs, vocab, n_rows):
    in_refs, (dw_ref, *dw_sc) = refs[:8], refs[8:]
    acc = dw_sc[0] if dw_sc else dw_ref  # as in _bwd_hidden_kernel
    h_ref, w_ref, _, invt_ref = in_refs[:4]
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    bn = h_ref.shape[0]
    d_l, _, _ = _tile_grad_logits(in_refs, j * w_ref.shape[1], vocab)
    # Rows past N (last block only) are unspecified memory, maybe NaN: zero both factors.
    rows_ok = i * bn + lax.broadcasted_iota(jnp.int32, (bn, 1), 0) < n_rows
    d_z = jnp.where(rows_ok, d_l * invt_ref[...], 0.0)

    def accumulate(h):
        acc[...] += lax.dot_general(h, d_z.astype(h.dtype), _TN, preferred_element_type=jnp.float32)

    _masked_on_last(i, pl.num_programs(1), n_rows % bn, h_ref, rows_ok, accumulate)

    if dw_sc:

        @pl.when(i == pl.num_programs(1) - 1)
        def _finish():
            dw_ref[...] = acc[...].astype(dw_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers and the custom VJP.


def _common_dot_dtype(hidden, lm_head):
    dt = jnp.promote_types(hidden.dtype, lm_head.dtype)
    return hidden.astype(dt), lm_head.astype(dt)


def _f32_scratch(shape, dtype):
    """A float32 accumulator, unless the result is float32 and accumulates in place."""
    return [] if dtype == jnp.float32 else [pltpu.VMEM(shape, jnp.float32)]


def _forward(hidden, lm_head, targets, inv_t, plan, interpret):
    (n, d), vocab = hidden.shape, lm_head.shape[1]
    bn, bv = plan.forward
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
        compiler_params=compiler_params(plan.chip, "parallel", "arbitrary"),
        interpret=interpret,
    )(hidden, lm_head, targets[:, None], inv_t)
    return logp[:, 0], ent[:, 0], lse


def _backward(hidden, lm_head, targets, inv_t, lse, mean, g_logp, g_ent, plan, interpret):
    (n, d), vocab = hidden.shape, lm_head.shape[1]
    rows = (targets[:, None], inv_t, lse, mean, g_logp[:, None], g_ent[:, None])

    # d_hidden, d_temperature: grid (token block i, vocab block j), reduce over j.
    bn, bv = plan.d_hidden
    col = lambda: pl.BlockSpec((bn, 1), lambda i, j: (i, 0))
    d_h, d_t = pl.pallas_call(
        partial(_bwd_hidden_kernel, vocab=vocab),
        grid=(cdiv(n, bn), cdiv(vocab, bv)),
        in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)), pl.BlockSpec((d, bv), lambda i, j: (0, j))]
        + [col() for _ in rows],
        out_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)), col()],
        out_shape=[jax.ShapeDtypeStruct((n, d), hidden.dtype), jax.ShapeDtypeStruct((n, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32), *_f32_scratch((bn, d), hidden.dtype)],
        compiler_params=compiler_params(plan.chip, "parallel", "arbitrary"),
        interpret=interpret,
    )(hidden, lm_head, *rows)

    # d_lm_head: grid (vocab block j, token block i), reduce over i.
    bn, bv = plan.d_lm_head
    col = lambda: pl.BlockSpec((bn, 1), lambda j, i: (i, 0))
    d_w = pl.pallas_call(
        partial(_bwd_head_kernel, vocab=vocab, n_rows=n),
        grid=(cdiv(vocab, bv), cdiv(n, bn)),
        in_specs=[pl.BlockSpec((bn, d), lambda j, i: (i, 0)), pl.BlockSpec((d, bv), lambda j, i: (0, j))]
        + [col() for _ in rows],
        out_specs=pl.BlockSpec((d, bv), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct(lm_head.shape, lm_head.dtype),
        scratch_shapes=_f32_scratch((d, bv), lm_head.dtype),
        compiler_params=compiler_params(plan.chip, "parallel", "arbitrary"),
        interpret=interpret,
    )(hidden, lm_head, *rows)
    return d_h, d_w, d_t[:, 0]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _logprobs(hidden, lm_head, targets, temperature, plan, interpret):
    return _fwd(hidden, lm_head, targets, temperature, plan, interpret)[0]


def _fwd(hidden, lm_head, targets, temperature, plan, interpret):
    inv_t = 1.0 / temperature.astype(jnp.float32)[:, None]
    h, w = _common_dot_dtype(hidden, lm_head)
    logp, ent, lse = _forward(h, w, targets, inv_t, plan, interpret)
    return (logp, ent), (hidden, lm_head, targets, temperature, lse, ent)


def _bwd(plan, interpret, res, cotangents):
    hidden, lm_head, targets, temperature, lse, ent = res
    g_logp, g_ent = (c.astype(jnp.float32) for c in cotangents)
    inv_t = 1.0 / temperature.astype(jnp.float32)[:, None]
    mean = lse - ent[:, None]  # E_p[logit]
    h, w = _common_dot_dtype(hidden, lm_head)
    d_h, d_w, d_t = _backward(h, w, targets, inv_t, lse, mean, g_logp, g_ent, plan, interpret)
    return d_h.astype(hidden.dtype), d_w.astype(lm_head.dtype), None, d_t.astype(temperature.dtype)


_logprobs.defvjp(_fwd, _bwd)

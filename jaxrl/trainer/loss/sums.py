"""The loss's sums (DESIGN contract 3): RL, CE and ref-KL components over per-token weights.

Each component is normalised by its own *global* token count over the whole optimizer step, so
the functions here return unreduced sums and the division happens once, with counts the trainer
computes up front (they depend only on the batch, never on params):

    counts = loss_counts(rl_w, ce_w, loss_mask, cfg=cfg, ...)  # summed over the whole step
    for mb in micro_batches:                                   # and data-parallel shards
        sums = loss_sums(logp, logq, A, rl_w, ce_w, loss_mask, cfg, entropy=entropy,
                         segment_ids=..., policy_version=..., trainer_version=...)
        loss_mb = normalized_loss(sums, counts)                # grads of these are summed
        total = add_sums(total, sums)
    step_metrics = metrics(total)

Summing ``normalized_loss`` over micro-batches then equals the loss of the whole batch at once.
The RL component's per-token loss is the one ``cfg.rl_loss`` selects (an objective of
``objectives``, or ``custom``) on the micro-batch as one ``LossBatch``. Under sequence
normalisation (GSPO's default) the RL denominator is the step's count of samples with RL tokens
instead of its RL tokens.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import jax
import jax.numpy as jnp

from jaxrl.trainer.loss.batch import LossBatch, RLTokenLoss, count_segments, segment_total
from jaxrl.trainer.loss.config import LossConfig
from jaxrl.trainer.loss.objectives import ref_kl_token_loss, staleness_factor
from jaxrl.training_sample import COMPONENTS, LossComponent

LAG_BINS = ("0", "1", "2", "3p")
"""Staleness histogram bins: tokens sampled 0, 1, 2 and 3 or more policy versions ago."""


class LossCounts(TypedDict):
    """``loss_counts``: float32 token counts of each component (the normalisers of contract 3)."""

    rl: jax.Array
    ce: jax.Array
    ref_kl: jax.Array
    rl_norm: NotRequired[jax.Array]
    """The RL denominator (RL tokens, or samples with RL tokens under sequence normalisation);
    only where ``loss_counts`` was given a ``cfg``."""


class LossSums(TypedDict):
    """``loss_sums`` of one micro-batch, or their total over a step (``add_sums``): float32
    scalars. Keys ending in ``_max`` accumulate by maximum, all others by sum."""

    # The components: unreduced losses and token counts (normalized_loss divides the first by the second).
    rl_loss_sum: jax.Array
    ce_loss_sum: jax.Array
    ref_kl_loss_sum: jax.Array
    rl_count: jax.Array
    ce_count: jax.Array
    ref_kl_count: jax.Array
    rl_norm_count: jax.Array
    """The RL denominator: ``rl_count``, or the samples with RL tokens under sequence normalisation."""
    # The trust region (masked_* from the objective): mismatch KL ``r - log r - 1`` on kept / masked RL tokens.
    kl_kept_sum: jax.Array
    kl_masked_sum: jax.Array
    kept_count: jax.Array
    masked_count: jax.Array
    masked_high_count: jax.Array
    masked_low_count: jax.Array
    # Off-policy: the ratio over RL tokens and its per-sample geometric mean (``*_inv_max`` is the
    # max of ``1 / ratio``, so minima accumulate as maxima from 0), clipped and MIS-rejected
    # tokens, the staleness histogram over RL tokens before the staleness rule.
    ratio_sum: jax.Array
    ratio_max: jax.Array
    ratio_inv_max: jax.Array
    seq_ratio_sum: jax.Array
    seq_ratio_max: jax.Array
    seq_ratio_inv_max: jax.Array
    rl_seqs_count: jax.Array
    clipped_count: jax.Array
    rejected_count: jax.Array
    dual_clipped_count: jax.Array
    lag0_count: jax.Array
    lag1_count: jax.Array
    lag2_count: jax.Array
    lag3p_count: jax.Array
    rl_raw_count: jax.Array
    stale_dropped_count: jax.Array
    # CE: the negative log-likelihood of the CE tokens (unweighted).
    ce_nll_sum: jax.Array
    ce_nll_max: jax.Array
    # With ref_kl_w and logr: sum of ``logp - logr`` over the ref-KL tokens.
    teacher_kl_sum: NotRequired[jax.Array]
    # With entropy: over the policy's own tokens (rl and ref_kl), and over the CE tokens.
    entropy_sum: NotRequired[jax.Array]
    entropy_count: NotRequired[jax.Array]
    ce_entropy_sum: NotRequired[jax.Array]


def component_metrics(component: LossComponent) -> tuple[str, ...]:
    """Prefixes of the ``metrics`` names that describe ``component`` alone: zero by construction
    in a run where no sample weights it."""
    return (f"{component}_", "teacher_kl") if component == "ref_kl" else (f"{component}_",)


def _active(w: jax.Array, loss_mask: jax.Array) -> jax.Array:
    return (w != 0) & loss_mask


def loss_counts(
    rl_w: jax.Array,
    ce_w: jax.Array,
    loss_mask: jax.Array,
    ref_kl_w: jax.Array | None = None,
    *,
    cfg: LossConfig | None = None,
    segment_ids: jax.Array | None = None,
    policy_version: jax.Array | None = None,
    trainer_version: int | jax.Array | None = None,
) -> LossCounts:
    """Tokens in each component: nonzero weight and ``loss_mask``. Independent of params, so
    the trainer can total them over the whole optimizer step before any forward pass.

    With ``cfg``: the RL weights after its staleness rule (dropped tokens do not count), and an
    ``rl_norm`` entry, the RL component's denominator (RL tokens, or with sequence normalisation
    the samples that have RL tokens)."""
    if cfg is not None:
        rl_w = _effective_rl_w(rl_w, cfg, policy_version, trainer_version)
    counts = {"rl": _active(rl_w, loss_mask).sum(), "ce": _active(ce_w, loss_mask).sum()}
    counts["ref_kl"] = jnp.zeros((), jnp.int32) if ref_kl_w is None else _active(ref_kl_w, loss_mask).sum()
    if cfg is not None:
        seq = cfg.normalization() == "sequence"
        counts["rl_norm"] = (
            count_segments(_active(rl_w, loss_mask), _segments(segment_ids, rl_w)) if seq else counts["rl"]
        )
    return {k: jnp.asarray(v).astype(jnp.float32) for k, v in counts.items()}


def _segments(segment_ids: jax.Array | None, like: jax.Array) -> jax.Array:
    """Segment ids, or one segment per row where none are given (unpacked rows)."""
    return jnp.ones(like.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)


def _effective_rl_w(
    rl_w: jax.Array,
    cfg: LossConfig,
    policy_version: jax.Array | None,
    trainer_version: int | jax.Array | None,
) -> jax.Array:
    """``rl_w`` times the staleness factor of each token (unchanged without ``cfg.staleness``)."""
    if cfg.staleness is None:
        return rl_w
    if policy_version is None or trainer_version is None:
        raise ValueError("trainer.loss.staleness needs each token's policy_version and the trainer_version")
    s, lag = cfg.staleness, jnp.asarray(trainer_version) - jnp.asarray(policy_version)
    return rl_w * staleness_factor(lag, s.max_lag, s.mode, s.decay)


def _mismatch_kl(logp, logq):
    """``ratio - log_ratio - 1``: a non-negative estimate of KL(sampler || trainer) per token."""
    log_ratio = logp - logq
    return jnp.exp(log_ratio) - log_ratio - 1.0


def loss_sums(
    logp: jax.Array,
    logq: jax.Array,
    advantages: jax.Array,
    rl_w: jax.Array,
    ce_w: jax.Array,
    loss_mask: jax.Array,
    cfg: LossConfig,
    *,
    entropy: jax.Array | None = None,
    ref_kl_w: jax.Array | None = None,
    logr: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    positions: jax.Array | None = None,
    policy_version: jax.Array | None = None,
    trainer_version: int | jax.Array | None = None,
) -> LossSums:
    """Unreduced loss sums, token counts and metric sums of one micro-batch (``LossSums``); all
    inputs ``[B, T]``.

    ``loss_mask`` is False at padding and at each sample's first token. ``ref_kl_w`` and ``logr``
    (together) add the ref-KL component; ``entropy`` the entropy sums over the policy's own tokens
    (the rl and ref_kl components; never echo/CE targets, which the policy did not sample) and over
    the CE tokens (SFT targets, echo observations). ``segment_ids`` (default: one sample per row),
    ``positions``, ``policy_version`` (default: 0) and ``trainer_version`` (default: 0) reach the
    RL loss in its ``LossBatch``. Combine micro-batches with ``add_sums``.
    """
    if (ref_kl_w is None) != (logr is None):
        raise ValueError("loss_sums: pass ref_kl_w and logr together (or neither)")
    loss_mask = loss_mask.astype(bool)
    raw_rl_on = _active(rl_w, loss_mask)
    rl_w = _effective_rl_w(rl_w, cfg, policy_version, trainer_version)
    rl_on, ce_on = _active(rl_w, loss_mask), _active(ce_w, loss_mask)
    segments = _segments(segment_ids, rl_w)
    versions = jnp.zeros(rl_w.shape, jnp.int32) if policy_version is None else policy_version
    # Zero inputs outside each component *before* any exp: padding may hold anything, and a
    # where on the inputs (not the outputs) keeps both the values and the gradients finite.
    rl_logp, rl_logq, rl_adv, rl_weight = (jnp.where(rl_on, x, 0.0) for x in (logp, logq, advantages, rl_w))
    view = LossBatch(
        rl_logp, rl_logq, rl_adv, rl_weight, ce_w, jnp.zeros_like(ce_w) if ref_kl_w is None else ref_kl_w,
        loss_mask, segments, jnp.zeros_like(segments) if positions is None else positions, versions,
        jnp.asarray(0 if trainer_version is None else trainer_version, jnp.int32),
    )  # fmt: skip
    rl = cfg.rl_loss(view)
    rl_token_losses, rl_norm = rl.loss, rl_on.sum().astype(jnp.float32)
    if cfg.normalization() == "sequence":  # each sample's mean over its RL tokens, over the samples
        rl_token_losses = rl_token_losses / jnp.maximum(
            segment_total(rl_on.astype(jnp.float32), segments), 1.0
        )
        rl_norm = count_segments(rl_on, segments)
    ce_nll = -jnp.where(ce_on, logp, 0.0)
    out = {
        "rl_loss_sum": rl_token_losses.sum(),
        "ce_loss_sum": (jnp.where(ce_on, ce_w, 0.0) * ce_nll).sum(),
        "ref_kl_loss_sum": jnp.zeros((), jnp.float32),
        **{f"{c}_count": n for c, n in loss_counts(rl_w, ce_w, loss_mask, ref_kl_w).items()},
        "rl_norm_count": rl_norm,
        **_rl_metric_sums(rl, rl_on, rl_logp, rl_logq),
        **_offpolicy_sums(view, rl, raw_rl_on),
        "ce_nll_sum": jax.lax.stop_gradient(ce_nll.sum()),
        "ce_nll_max": jax.lax.stop_gradient(jnp.max(ce_nll, initial=0.0)),
    }
    trained = rl_on
    if ref_kl_w is not None:
        ref_on = _active(ref_kl_w, loss_mask)
        zero = lambda x: jnp.where(ref_on, x, 0.0)
        out["ref_kl_loss_sum"] = ref_kl_token_loss(
            zero(logp), zero(logq), zero(logr), zero(ref_kl_w), mask_low=cfg.mask_low, kl_tau=cfg.kl_tau
        ).sum()
        out["teacher_kl_sum"] = jax.lax.stop_gradient(zero(logp - logr).sum())
        trained = trained | ref_on
    if entropy is not None:
        out["entropy_sum"] = jax.lax.stop_gradient(jnp.where(trained, entropy, 0.0).sum())
        out["entropy_count"] = trained.sum().astype(jnp.float32)
        out["ce_entropy_sum"] = jax.lax.stop_gradient(jnp.where(ce_on, entropy, 0.0).sum())
    return out


def _offpolicy_sums(view: LossBatch, rl: RLTokenLoss, raw_rl_on: jax.Array) -> dict[str, jax.Array]:
    """Importance-ratio distribution at token and sequence level (the sequence ratio is the
    geometric mean ``exp(mean_t log r_t)``, GSPO's), clipped / MIS-rejected / dual-clipped token counts, and the
    staleness histogram over the RL tokens before the staleness rule (``raw_rl_on``).
    ``*_inv_max`` holds the max of ``1 / ratio``, so minima accumulate as maxima from 0."""
    on = view.rl_on
    count = lambda m: m.sum().astype(jnp.float32)
    log_r = jax.lax.stop_gradient(jnp.clip(view.log_ratio, -80.0, 80.0))
    seq_log_r = segment_total(jnp.where(on, log_r, 0.0), view.segment_ids)
    n_tokens = segment_total(on.astype(jnp.float32), view.segment_ids)
    seq_log_r = seq_log_r / jnp.maximum(n_tokens, 1.0)
    out = {}
    for name, lr, weight in (
        ("ratio", log_r, 1.0),
        ("seq_ratio", seq_log_r, 1.0 / jnp.maximum(n_tokens, 1.0)),
    ):
        out[f"{name}_sum"] = jnp.where(on, jnp.exp(lr) * weight, 0.0).sum()
        out[f"{name}_max"] = jnp.max(jnp.where(on, jnp.exp(lr), 0.0), initial=0.0)
        out[f"{name}_inv_max"] = jnp.max(jnp.where(on, jnp.exp(-lr), 0.0), initial=0.0)
    out["rl_seqs_count"] = count_segments(on, view.segment_ids)
    out["clipped_count"] = count(on & rl.clipped) if rl.clipped is not None else jnp.zeros((), jnp.float32)
    out["rejected_count"] = count(on & rl.rejected) if rl.rejected is not None else jnp.zeros((), jnp.float32)
    dual = rl.dual_clipped
    out["dual_clipped_count"] = count(on & dual) if dual is not None else jnp.zeros((), jnp.float32)
    lag = view.lag
    for b in LAG_BINS:
        in_bin = lag >= 3 if b == "3p" else lag == int(b)
        out[f"lag{b}_count"] = count(raw_rl_on & in_bin)
    out["rl_raw_count"] = count(raw_rl_on)
    out["stale_dropped_count"] = count(raw_rl_on & ~on)
    return out


def _rl_metric_sums(rl: RLTokenLoss, rl_on, logp, logq) -> dict[str, jax.Array]:
    """Mismatch KL on kept / masked rl tokens and the trust-region mask counts."""
    masked = rl_on & (rl.masked_high | rl.masked_low)
    kept = rl_on & ~masked
    mismatch = jax.lax.stop_gradient(_mismatch_kl(logp, logq))
    count = lambda m: m.sum().astype(jnp.float32)
    return {
        "kl_kept_sum": jnp.where(kept, mismatch, 0.0).sum(),
        "kl_masked_sum": jnp.where(masked, mismatch, 0.0).sum(),
        "kept_count": count(kept),
        "masked_count": count(masked),
        "masked_high_count": count(rl_on & rl.masked_high),
        "masked_low_count": count(rl_on & rl.masked_low),
    }


def add_sums(a: LossSums, b: LossSums) -> LossSums:
    """Accumulate two ``loss_sums`` results (micro-batches, shards): add sums, max the maxima."""
    if a.keys() != b.keys():
        raise ValueError(f"add_sums: key sets differ: {sorted(a.keys() ^ b.keys())}")
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den``, or exactly 0 where ``den == 0`` (the numerator is then 0 too)."""
    return num / jnp.maximum(den, 1.0)


def normalized_loss(sums: LossSums, counts: LossCounts) -> jax.Array:
    """``sum_c sums[c_loss_sum] / N_c`` with ``counts`` the *global* counts of the optimizer step
    (from ``loss_counts``, or the ``{c}_count`` keys of a step total); the RL component divides by
    ``counts["rl_norm"]`` where given (sequence normalisation). An empty component adds exactly 0
    and a zero gradient."""
    den = {c: counts["rl_norm"] if c == "rl" and "rl_norm" in counts else counts[c] for c in COMPONENTS}
    return sum(_safe_div(sums[f"{c}_loss_sum"], jax.lax.stop_gradient(den[c])) for c in COMPONENTS)


def counts_of(sums: LossSums) -> LossCounts:
    """The component counts held in a ``loss_sums`` result (or a total of them)."""
    return {c: sums[f"{c}_count"] for c in COMPONENTS} | {"rl_norm": sums["rl_norm_count"]}


def metrics(total: LossSums) -> dict[str, jax.Array]:
    """Per-step metrics from the step's accumulated ``loss_sums``; empty means are 0, not NaN."""
    out = {f"{c}_loss": _safe_div(total[f"{c}_loss_sum"], total[f"{c}_count"]) for c in COMPONENTS}
    out["rl_loss"] = _safe_div(total["rl_loss_sum"], total["rl_norm_count"])
    out |= {f"{c}_tokens": total[f"{c}_count"] for c in COMPONENTS}
    out |= {
        "mismatch_kl": _safe_div(total["kl_kept_sum"], total["kept_count"]),
        "mismatch_kl_masked": _safe_div(total["kl_masked_sum"], total["masked_count"]),
        "masked_high_frac": _safe_div(total["masked_high_count"], total["rl_count"]),
        "masked_low_frac": _safe_div(total["masked_low_count"], total["rl_count"]),
        "ce_nll_mean": _safe_div(total["ce_nll_sum"], total["ce_count"]),
        "ce_nll_max": total["ce_nll_max"],
    }
    out |= _offpolicy_metrics(total)
    if "teacher_kl_sum" in total:
        # mean of logp - logr over sampled ref-KL tokens: an estimate of KL(policy || teacher)
        out["teacher_kl"] = _safe_div(total["teacher_kl_sum"], total["ref_kl_count"])
    if "entropy_sum" in total:
        out["entropy"] = _safe_div(total["entropy_sum"], total["entropy_count"])
        out["ce_entropy"] = _safe_div(total["ce_entropy_sum"], total["ce_count"])
    return out


def _offpolicy_metrics(total: LossSums) -> dict[str, jax.Array]:
    """Ratio distribution (token and sequence level), clipped / rejected shares, staleness histogram."""
    inv = lambda x: jnp.where(x > 0, 1.0 / jnp.maximum(x, 1e-30), 0.0)
    out = {}
    for name, n in (("ratio", total["rl_count"]), ("seq_ratio", total["rl_seqs_count"])):
        out[f"{name}_mean"] = _safe_div(total[f"{name}_sum"], n)
        out[f"{name}_max"] = total[f"{name}_max"]
        out[f"{name}_min"] = inv(total[f"{name}_inv_max"])
    out["clipped_frac"] = _safe_div(total["clipped_count"], total["rl_count"])
    out["mis_rejected_frac"] = _safe_div(total["rejected_count"], total["rl_count"])
    out["dual_clipped_frac"] = _safe_div(total["dual_clipped_count"], total["rl_count"])
    out["rl_seqs"] = total["rl_seqs_count"]
    for b in LAG_BINS:
        out[f"stale_lag{b}_frac"] = _safe_div(total[f"lag{b}_count"], total["rl_raw_count"])
    out["stale_dropped_frac"] = _safe_div(total["stale_dropped_count"], total["rl_raw_count"])
    return out


def combine(total: LossSums) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss and metrics of a whole step's sums when they were computed in one piece."""
    return normalized_loss(total, counts_of(total)), metrics(total)

"""Built-in RL objectives over a ``LossBatch``: DPPO (default), PPO clip-higher, GSPO, CISPO, TIS,
with the MIS / IcePop ratio mask and the per-token staleness rule (docs/off-policy.md).

jaxrl makes one optimizer update per batch, so at the first (and only) update the trainer's
parameters *are* the old policy: the ratio ``r = exp(logp - logq)`` of trainer over sampler is
both PPO's ratio and the training/inference mismatch that TIS and MIS correct. Every objective
here returns a per-token term ``pg`` to maximise (without ``rl_w``); ``rl_objective`` adds the
mask, the ``kl_tau * log_ratio**2`` penalty and the weights. Terms whose value is a stop-gradient
weight times the advantage use ``exp(logp - sg(logp))`` (value 1, gradient ``d logp``), so the
logged loss is ``-w * A`` and the gradient is ``w * A * d logp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxrl.trainer.loss_view import LossBatch, RLTokenLoss, segment_mean, segment_total

if TYPE_CHECKING:
    from jaxrl.trainer.loss import LossConfig

sg = jax.lax.stop_gradient


def _score(logp: jax.Array) -> jax.Array:
    """Value 1, gradient ``d logp``: the score-function factor of a REINFORCE-style term."""
    return jnp.exp(logp - sg(logp))


def dppo_pg(v: LossBatch, cfg: LossConfig) -> tuple[jax.Array, ...]:
    """prime-rl's DPPO trust region on probabilities: ``pg = keep * A * r`` (contract 3)."""
    ratio = jnp.exp(v.log_ratio)
    dp = jnp.exp(v.logp) - jnp.exp(v.logq)
    positive = v.advantages > 0
    high = positive & (dp > cfg.mask_high)
    low = ~positive & (dp < -cfg.mask_low)
    keep = 1.0 - (high | low).astype(v.logp.dtype)
    return keep * v.advantages * ratio, high, low, None


def _clipped_surrogate(ratio: jax.Array, adv: jax.Array, lo: float, hi: float) -> tuple[jax.Array, ...]:
    """PPO's ``min(r A, clip(r, 1 - lo, 1 + hi) A)`` and where the clipped branch wins (no gradient)."""
    pg = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - lo, 1.0 + hi) * adv)
    return pg, (adv > 0) & (ratio > 1.0 + hi), (adv < 0) & (ratio < 1.0 - lo)


def ppo_pg(v: LossBatch, cfg: LossConfig) -> tuple[jax.Array, ...]:
    """PPO clip on the token ratio with asymmetric bounds (DAPO's clip-higher: ``clip_high > clip_low``)."""
    lo, hi = cfg.clip_bounds()
    pg, high, low = _clipped_surrogate(jnp.exp(v.log_ratio), v.advantages, lo, hi)
    return pg, high, low, None


def sequence_log_ratio(v: LossBatch) -> jax.Array:
    """GSPO's length-normalised sequence log-ratio ``mean_t log r_t`` over the sample's RL tokens,
    on every token of the sample (differentiable)."""
    return segment_mean(v.log_ratio, v.rl_on, v.segment_ids)


def gspo_pg(v: LossBatch, cfg: LossConfig) -> tuple[jax.Array, ...]:
    """GSPO: the clipped surrogate on ``s = exp(mean_t log r_t)`` per sequence. Every token of a
    sample carries the same term; with sequence normalisation (``loss_sums``) each sample counts
    once, so the loss is the paper's mean over sequences."""
    lo, hi = cfg.clip_bounds()
    pg, high, low = _clipped_surrogate(jnp.exp(sequence_log_ratio(v)), v.advantages, lo, hi)
    return pg, high, low, None


def cispo_pg(v: LossBatch, cfg: LossConfig) -> tuple[jax.Array, ...]:
    """CISPO (MiniMax-M1): ``sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``: the weight is
    clipped, the token's gradient is never dropped."""
    lo, hi = cfg.clip_bounds()
    ratio = sg(jnp.exp(v.log_ratio))
    weight = jnp.clip(ratio, 1.0 - lo, 1.0 + hi)
    none = jnp.zeros(ratio.shape, bool)
    return weight * v.advantages * _score(v.logp), none, none, (ratio > 1.0 + hi) | (ratio < 1.0 - lo)


def sequence_ratio_log(v: LossBatch) -> jax.Array:
    """``sum_t log r_t`` over the sample's RL tokens, on every token: the log of the sequence's
    importance weight (the product of its token ratios)."""
    return segment_total(jnp.where(v.rl_on, v.log_ratio, 0.0), v.segment_ids)


def tis_pg(v: LossBatch, cfg: LossConfig) -> tuple[jax.Array, ...]:
    """Truncated importance sampling: ``sg(min(w, tis_cap)) * A * logp`` with ``w`` the token ratio
    (``tis_level = "token"``) or the sequence's product of ratios (``"sequence"``)."""
    log_w = v.log_ratio if cfg.tis_level == "token" else sequence_ratio_log(v)
    w = sg(jnp.exp(jnp.minimum(log_w, 80.0)))  # exp(80) is finite in float32; min() below caps it
    none = jnp.zeros(w.shape, bool)
    return jnp.minimum(w, cfg.tis_cap) * v.advantages * _score(v.logp), none, none, w > cfg.tis_cap


OBJECTIVES = {"dppo": dppo_pg, "ppo": ppo_pg, "gspo": gspo_pg, "cispo": cispo_pg, "tis": tis_pg}


def mis_keep(v: LossBatch, cfg: LossConfig) -> jax.Array:
    """bool: tokens the MIS / IcePop mask keeps: the token ratio (``level = "token"``), the
    sequence's product of ratios (``"sequence"``) or their geometric mean (``"geometric"``)
    within ``[low, high]``."""
    assert cfg.mis is not None
    if cfg.mis.level == "token":
        log_w = v.log_ratio
    elif cfg.mis.level == "sequence":
        log_w = sequence_ratio_log(v)
    else:
        log_w = segment_mean(v.log_ratio, v.rl_on, v.segment_ids)
    log_w = sg(log_w)
    return (log_w >= jnp.log(cfg.mis.low)) & (log_w <= jnp.log(cfg.mis.high))


def rl_objective(v: LossBatch, cfg: LossConfig) -> RLTokenLoss:
    """The built-in RL token loss ``rl_w * (-adv_tau * keep_mis * pg + kl_tau * log_ratio**2)``."""
    pg, high, low, clipped = OBJECTIVES[cfg.type](v, cfg)
    rejected = None
    if cfg.mis is not None:
        keep = mis_keep(v, cfg)
        pg = jnp.where(keep, pg, 0.0)
        rejected = ~keep
    loss = v.rl_w * (-cfg.adv_tau * pg + cfg.kl_tau * jnp.square(v.log_ratio))
    return RLTokenLoss(loss, high, low, clipped, rejected)


def staleness_factor(lag: jax.Array, cfg: LossConfig) -> jax.Array:
    """Per-token multiplier of ``rl_w``: 1 up to ``max_lag`` versions behind the trainer; beyond,
    0 (``mode = "drop"``) or ``decay ** (lag - max_lag)`` (``"downweight"``)."""
    if cfg.staleness is None:
        return jnp.ones(lag.shape, jnp.float32)
    s = cfg.staleness
    over = jnp.maximum(lag - s.max_lag, 0).astype(jnp.float32)
    if s.mode == "drop":
        return jnp.where(over > 0, 0.0, 1.0)
    return jnp.power(jnp.float32(s.decay), over)

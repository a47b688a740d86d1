"""The built-in RL objectives, registered by name, and the rules around them (docs/off-policy.md).

An objective maps a ``LossBatch`` to a per-token term ``pg`` to maximise (without ``rl_w``);
``rl_token_loss`` makes any of them the RL component's per-token loss
``rl_w * (-adv_tau * pg + kl_tau * log_ratio**2)``, ``pg`` zeroed where the MIS / IcePop mask
(``mis_keep``) rejects the ratio. Also here: the staleness factor of ``rl_w`` and the ref-KL
component's token loss. Adding an objective is one decorated function below (plus a
``LossConfig`` field for a new knob).

jaxrl makes one optimizer update per batch, so at the first (and only) update the trainer's
parameters *are* the old policy: the ratio ``r = exp(logp - logq)`` of trainer over sampler is
both PPO's ratio and the training/inference mismatch that TIS and MIS correct. Terms whose value
is a stop-gradient weight times the advantage use ``exp(logp - sg(logp))`` (value 1, gradient
``d logp``), so the logged loss is ``-w * A`` and the gradient is ``w * A * d logp``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl.trainer.loss.batch import LossBatch, RLTokenLoss, segment_mean, segment_total

sg = jax.lax.stop_gradient
Normalization = Literal["token", "sequence"]
MISLevel = Literal["token", "sequence", "geometric"]
StalenessMode = Literal["drop", "downweight"]


class PolicyGradient(NamedTuple):
    """What an objective returns; all ``[B, T]``."""

    pg: jax.Array
    """Per-token term to maximise, without ``rl_w`` (the loss holds ``-adv_tau * pg``)."""
    masked_high: jax.Array
    """bool: ``pg`` dropped because the probability (or ratio) rose too far."""
    masked_low: jax.Array
    """bool: ``pg`` dropped because the probability (or ratio) fell too far."""
    clipped: jax.Array | None
    """bool: importance weight clipped or truncated, gradient kept (None: the objective has none)."""
    dual_clipped: jax.Array | None = None
    """bool: ``A < 0`` and the term held at its dual-clip floor ``clip_ratio_c * A`` (no gradient)."""


@dataclass(frozen=True)
class Objective:
    """One ``[trainer.loss] type``: its function and the ``[trainer.loss]`` fields it owns."""

    fn: Callable[..., PolicyGradient]
    """``fn(batch, **fields)``: each keyword-only parameter receives the ``[trainer.loss]`` field
    of its name (``clip_low`` / ``clip_high`` with ``clip``'s defaults filled in)."""
    knobs: frozenset[str]
    """Fields that only the objectives listing them read: set under another type, an error."""
    clip: tuple[float, float] | None
    """Default ``(clip_low, clip_high)`` of an objective that clips a ratio."""
    normalize: Normalization
    """What ``normalize = "auto"`` means for it: by RL tokens, or by samples (each sample's mean)."""

    @property
    def fields(self) -> tuple[str, ...]:
        """The ``[trainer.loss]`` fields ``fn`` takes."""
        params = inspect.signature(self.fn).parameters.values()
        return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


OBJECTIVES: dict[str, Objective] = {}
"""The built-in objectives by ``type``, in the order ``@objective`` registered them."""


def objective(
    name: str,
    *,
    knobs: tuple[str, ...] = (),
    clip: tuple[float, float] | None = None,
    normalize: Normalization = "token",
) -> Callable[[Callable[..., PolicyGradient]], Callable[..., PolicyGradient]]:
    """Register the decorated function as ``[trainer.loss] type = name`` (see ``Objective``)."""

    def register(fn: Callable[..., PolicyGradient]) -> Callable[..., PolicyGradient]:
        spec = Objective(fn, frozenset(knobs), clip, normalize)
        if name in OBJECTIVES or not spec.knobs <= set(spec.fields):
            raise ValueError(
                f"objective {name!r}: registered twice, or knobs {knobs} not among {spec.fields}"
            )
        OBJECTIVES[name] = spec
        return fn

    return register


def _score(logp: jax.Array) -> jax.Array:
    """Value 1, gradient ``d logp``: the score-function factor of a REINFORCE-style term."""
    return jnp.exp(logp - sg(logp))


def _clipped_surrogate(ratio: jax.Array, adv: jax.Array, lo: float, hi: float) -> tuple[jax.Array, ...]:
    """PPO's ``min(r A, clip(r, 1 - lo, 1 + hi) A)`` and where the clipped branch wins (no gradient)."""
    pg = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - lo, 1.0 + hi) * adv)
    return pg, (adv > 0) & (ratio > 1.0 + hi), (adv < 0) & (ratio < 1.0 - lo)


def _dual_clip(pg: jax.Array, adv: jax.Array, clip_ratio_c: float | None) -> tuple[jax.Array, jax.Array]:
    """Dual-clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``): for ``A < 0`` the term is
    ``max(pg, c * A)``. Neither PPO's clip nor DPPO's trust region bounds a negative-advantage
    token whose ratio *rose* (``min(r A, clip(r) A) = r A`` there), so one token at ``r = e^6``
    would weigh ~403 times a normal one; the floor caps its loss at ``c * |A|`` and drops its
    gradient once ``r A < c A``. Returns the term and where the floor holds (None: off)."""
    if clip_ratio_c is None:
        return pg, jnp.zeros(pg.shape, bool)
    floor = clip_ratio_c * adv
    dual = (adv < 0) & (pg < floor)
    return jnp.where(dual, floor, pg), dual


def sequence_log_ratio(v: LossBatch) -> jax.Array:
    """GSPO's length-normalised sequence log-ratio ``mean_t log r_t`` over the sample's RL tokens,
    on every token of the sample (differentiable)."""
    return segment_mean(v.log_ratio, v.rl_on, v.segment_ids)


def sequence_ratio_log(v: LossBatch) -> jax.Array:
    """``sum_t log r_t`` over the sample's RL tokens, on every token: the log of the sequence's
    importance weight (the product of its token ratios)."""
    return segment_total(jnp.where(v.rl_on, v.log_ratio, 0.0), v.segment_ids)


@objective("dppo", knobs=("mask_high", "clip_ratio_c"))
def dppo(v: LossBatch, *, mask_high: float, mask_low: float, clip_ratio_c: float | None) -> PolicyGradient:
    """prime-rl's DPPO trust region on probabilities (the default; contract 3): ``pg = keep * A * r``,
    ``keep`` false where ``A > 0`` and ``p - q > mask_high`` or ``A <= 0`` and ``p - q < -mask_low``;
    then the dual clip ``max(pg, clip_ratio_c * A)`` for ``A < 0`` (the trust region tests ``p - q``,
    which stays small when a rare token's ratio explodes: q = 1e-3, p = 0.4 gives r = 400)."""
    ratio = jnp.exp(v.log_ratio)
    dp = jnp.exp(v.logp) - jnp.exp(v.logq)
    positive = v.advantages > 0
    high = positive & (dp > mask_high)
    low = ~positive & (dp < -mask_low)
    keep = 1.0 - (high | low).astype(v.logp.dtype)
    pg, dual = _dual_clip(keep * v.advantages * ratio, v.advantages, clip_ratio_c)
    return PolicyGradient(pg, high, low, None, dual)


@objective("ppo", knobs=("clip_low", "clip_high", "clip_ratio_c"), clip=(0.2, 0.28))
def ppo(v: LossBatch, *, clip_low: float, clip_high: float, clip_ratio_c: float | None) -> PolicyGradient:
    """PPO clip on the token ratio with asymmetric bounds (DAPO's clip-higher: ``clip_high > clip_low``),
    dual-clipped at ``clip_ratio_c * A`` for ``A < 0``."""
    pg, high, low = _clipped_surrogate(jnp.exp(v.log_ratio), v.advantages, clip_low, clip_high)
    pg, dual = _dual_clip(pg, v.advantages, clip_ratio_c)
    return PolicyGradient(pg, high, low, None, dual)


@objective("gspo", knobs=("clip_low", "clip_high", "clip_ratio_c"), clip=(3e-4, 4e-4), normalize="sequence")
def gspo(v: LossBatch, *, clip_low: float, clip_high: float, clip_ratio_c: float | None) -> PolicyGradient:
    """GSPO: the clipped surrogate on ``s = exp(mean_t log r_t)`` per sequence. Every token of a
    sample carries the same term; with sequence normalisation (its default) each sample counts
    once, so the loss is the paper's mean over sequences. The dual clip (``A < 0``) bounds ``s``
    as PPO's bounds ``r`` (not in the GSPO paper: ``clip_ratio_c = false`` is the paper's loss)."""
    pg, high, low = _clipped_surrogate(jnp.exp(sequence_log_ratio(v)), v.advantages, clip_low, clip_high)
    pg, dual = _dual_clip(pg, v.advantages, clip_ratio_c)
    return PolicyGradient(pg, high, low, None, dual)


@objective("cispo", knobs=("clip_low", "clip_high"), clip=(1.0, 0.28))
def cispo(v: LossBatch, *, clip_low: float, clip_high: float) -> PolicyGradient:
    """CISPO (MiniMax-M1): ``sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``: the weight is
    clipped, the token's gradient is never dropped (``clip_low`` 1.0: no lower bound)."""
    ratio = sg(jnp.exp(v.log_ratio))
    weight = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    none = jnp.zeros(ratio.shape, bool)
    pg = weight * v.advantages * _score(v.logp)
    return PolicyGradient(pg, none, none, (ratio > 1.0 + clip_high) | (ratio < 1.0 - clip_low))


@objective("tis", knobs=("tis_level", "tis_cap"))
def tis(v: LossBatch, *, tis_level: Literal["token", "sequence"], tis_cap: float) -> PolicyGradient:
    """Truncated importance sampling: ``sg(min(w, tis_cap)) * A * logp`` with ``w`` the token ratio
    (``tis_level = "token"``) or the sequence's product of ratios (``"sequence"``)."""
    log_w = v.log_ratio if tis_level == "token" else sequence_ratio_log(v)
    w = sg(jnp.exp(jnp.minimum(log_w, 80.0)))  # exp(80) is finite in float32; min() below caps it
    none = jnp.zeros(w.shape, bool)
    return PolicyGradient(jnp.minimum(w, tis_cap) * v.advantages * _score(v.logp), none, none, w > tis_cap)


def mis_keep(v: LossBatch, level: MISLevel, low: float, high: float) -> jax.Array:
    """bool: tokens the MIS / IcePop mask keeps: the token ratio (``level = "token"``), the
    sequence's product of ratios (``"sequence"``) or their geometric mean (``"geometric"``)
    within ``[low, high]``."""
    if level == "token":
        log_w = v.log_ratio
    elif level == "sequence":
        log_w = sequence_ratio_log(v)
    else:
        log_w = segment_mean(v.log_ratio, v.rl_on, v.segment_ids)
    log_w = sg(log_w)
    return (log_w >= jnp.log(low)) & (log_w <= jnp.log(high))


def rl_token_loss(
    v: LossBatch, pg: PolicyGradient, *, adv_tau: float, kl_tau: float, keep: jax.Array | None = None
) -> RLTokenLoss:
    """The RL component's token loss ``rl_w * (-adv_tau * pg + kl_tau * log_ratio**2)`` (contract 3)
    of an objective's ``pg``, which is zeroed where ``keep`` (the MIS mask) is False."""
    term, high, low, clipped, dual = pg
    rejected = None
    if keep is not None:
        term = jnp.where(keep, term, 0.0)
        rejected = ~keep
        dual = None if dual is None else dual & keep
    # -(adv_tau * term), not -adv_tau * term: at the default adv_tau = 1 XLA drops the multiply,
    # leaving the negate DPPO's program always had.
    loss = v.rl_w * (-(adv_tau * term) + kl_tau * jnp.square(v.log_ratio))
    return RLTokenLoss(loss, high, low, clipped, rejected, dual)


def staleness_factor(lag: jax.Array, max_lag: int, mode: StalenessMode, decay: float) -> jax.Array:
    """Per-token multiplier of ``rl_w``: 1 up to ``max_lag`` versions behind the trainer; beyond,
    0 (``mode = "drop"``) or ``decay ** (lag - max_lag)`` (``"downweight"``)."""
    over = jnp.maximum(lag - max_lag, 0).astype(jnp.float32)
    if mode == "drop":
        return jnp.where(over > 0, 0.0, 1.0)
    return jnp.power(jnp.float32(decay), over)


def ref_kl_token_loss(
    logp: jax.Array, logq: jax.Array, logr: jax.Array, ref_kl_w: jax.Array, *, mask_low: float, kl_tau: float
) -> jax.Array:
    """The ref-KL component (on-policy distillation towards a reference): ``ref_kl_w *
    (-keep * sg(logr - logp) * ratio + kl_tau * log_ratio**2)``, ``keep`` false where the
    probability fell by more than ``mask_low`` since sampling."""
    log_ratio = logp - logq
    ratio = jnp.exp(log_ratio)
    keep = 1.0 - (jnp.exp(logp) - jnp.exp(logq) < -mask_low).astype(logp.dtype)
    advantage = sg(logr - logp)
    return ref_kl_w * (-keep * advantage * ratio + kl_tau * jnp.square(log_ratio))

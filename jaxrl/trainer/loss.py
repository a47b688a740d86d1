"""The trainer's loss (DESIGN contract 3): RL, CE and ref-KL components over per-token weights.

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
The RL component's per-token loss comes from the objective ``[trainer.loss]`` selects (DPPO by
default; GSPO, PPO clip-higher, CISPO, TIS and the MIS mask in ``policy_loss``, or ``custom``),
which sees the micro-batch as one ``LossBatch`` (``loss_view``): segments, sampler log-probs,
per-token policy versions. Under sequence normalisation (GSPO) the RL denominator is the
step's count of samples with RL tokens instead of its RL tokens.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from functools import cache
from typing import Literal

import jax
import jax.numpy as jnp
import pydantic

from jaxrl.trainer.loss_view import LossBatch, RLTokenLoss, count_segments, segment_total
from jaxrl.trainer.policy_loss import rl_objective, staleness_factor

COMPONENTS = ("rl", "ce", "ref_kl")


class MISConfig(pydantic.BaseModel):
    """``[trainer.loss.mis]``: masked importance sampling (MIS; IcePop at ``level = "token"``):
    tokens whose trainer/sampler ratio falls outside ``[low, high]`` lose their policy-gradient
    term (the ``kl_tau`` penalty stays). Works with every built-in ``type``."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    level: Literal["token", "sequence", "geometric"] = "token"
    """Which ratio is tested: each token's own ("token", IcePop), the sample's product of token
    ratios ("sequence", MIS), or that product's geometric mean ("geometric": length-normalised)."""
    low: float = pydantic.Field(0.5, gt=0, lt=1, allow_inf_nan=False)
    """Lower bound of the kept ratio (0 < low < 1)."""
    high: float = pydantic.Field(2.0, gt=1, allow_inf_nan=False)
    """Upper bound of the kept ratio (> 1)."""


class StalenessConfig(pydantic.BaseModel):
    """``[trainer.loss.staleness]``: tokens sampled more than ``max_lag`` policy versions before the
    trainer's current version are dropped from the RL component or down-weighted (per token: an
    engine that swapped weights mid-sequence reports each token's own version)."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_lag: int = pydantic.Field(1, ge=0)
    """Versions a token may lag the trainer and still count fully (0: on-policy tokens only)."""
    mode: Literal["drop", "downweight"] = "drop"
    """"drop": weight 0 (and out of the RL token count); "downweight": ``rl_w * decay ** (lag - max_lag)``."""
    decay: float = pydantic.Field(0.5, gt=0, lt=1, allow_inf_nan=False)
    """Per-version factor of ``mode = "downweight"`` (0 < decay < 1)."""


ObjectiveType = Literal["dppo", "ppo", "gspo", "cispo", "tis"]
_CLIP_DEFAULTS = {"ppo": (0.2, 0.28), "gspo": (3e-4, 4e-4), "cispo": (1.0, 0.28)}
_TYPE_KNOBS = {"dppo": {"mask_high"}, "ppo": {"clip_low", "clip_high"}, "gspo": {"clip_low", "clip_high"},
               "cispo": {"clip_low", "clip_high"}, "tis": {"tis_level", "tis_cap"}}  # fmt: skip


class LossConfig(pydantic.BaseModel):
    """Hyper-parameters of the RL token loss (DESIGN contract 3; docs/off-policy.md)."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    type: ObjectiveType = "dppo"
    """The policy-gradient objective: "dppo" (prime-rl's probability trust region, the default),
    "ppo" (ratio clip, asymmetric = DAPO's clip-higher), "gspo" (sequence-level ratio and clip,
    per-sequence normalisation), "cispo" (clipped stop-gradient IS weight times logp), "tis"
    (truncated IS weight at token or sequence level times logp)."""

    mask_high: float = pydantic.Field(0.2, ge=0)
    """Trust region for positive advantages: tokens whose probability rose by more than this
    since sampling (``exp(logp) - exp(logq) > mask_high``) get no policy-gradient term."""

    mask_low: float = pydantic.Field(0.2, ge=0)
    """Trust region for non-positive advantages: tokens whose probability fell by more than
    this get no policy-gradient term. Also the ``keep`` threshold of the ref-KL component."""

    clip_low: float | None = pydantic.Field(None, ge=0, le=1)
    """ppo / gspo / cispo: lower clip ``1 - clip_low`` of the ratio (None: 0.2 for ppo, 3e-4 for
    gspo, 1.0 for cispo, i.e. no lower bound)."""

    clip_high: float | None = pydantic.Field(None, ge=0, allow_inf_nan=False)
    """ppo / gspo / cispo: upper clip ``1 + clip_high`` of the ratio (None: 0.28 for ppo, DAPO's
    clip-higher; 4e-4 for gspo; 0.28 for cispo)."""

    tis_level: Literal["token", "sequence"] = "token"
    """tis: truncate each token's ratio ("token") or the sample's product of ratios ("sequence")."""

    tis_cap: float = pydantic.Field(2.0, ge=1, allow_inf_nan=False)
    """tis: the truncation ``C`` of the importance weight ``min(w, C)`` (>= 1)."""

    normalize: Literal["auto", "token", "sequence"] = "auto"
    """How the RL sum is normalised: "token" (by the step's RL token count, contract 3) or
    "sequence" (each sample's mean over its RL tokens, divided by the step's RL sample count).
    "auto": "sequence" for gspo, "token" otherwise."""

    adv_tau: float = 1.0
    """Scale of the policy-gradient term ``A * ratio``."""

    kl_tau: float = pydantic.Field(1e-3, ge=0)
    """Weight of the ``log_ratio ** 2`` penalty that keeps the trainer near the sampler
    (RL and ref-KL components)."""

    mis: MISConfig | None = None
    """``[trainer.loss.mis]``: mask tokens or samples whose importance ratio is out of bounds
    (MIS / IcePop), with any built-in ``type``. None: off."""

    staleness: StalenessConfig | None = None
    """``[trainer.loss.staleness]``: drop or down-weight tokens sampled too many policy versions
    ago. None: off (``orchestrator.max_async_level`` alone bounds the lag)."""

    custom: str | None = None
    """Import path (``pkg.module:function`` or ``pkg.module.function``) of a replacement RL
    token loss: ``fn(batch: LossBatch, cfg) -> RLTokenLoss`` (``jaxrl.trainer.loss_view``; the
    older ``fn(logp, logq, advantages, rl_w, cfg)`` is accepted too). Resolved when the config
    is validated, so a bad path fails at start-up."""

    @pydantic.field_validator("custom")
    @classmethod
    def _resolve_custom(cls, path: str | None) -> str | None:
        if path is not None:
            _custom_arity(path)
        return path

    @pydantic.model_validator(mode="after")
    def _knobs_match_type(self) -> LossConfig:
        # A knob of another type is refused unless it holds its default (what --dry-run prints).
        for knob in sorted(set().union(*_TYPE_KNOBS.values()) - _TYPE_KNOBS[self.type]):
            if knob in self.model_fields_set and getattr(self, knob) != type(self).model_fields[knob].default:
                users = sorted(t for t, k in _TYPE_KNOBS.items() if knob in k)
                raise ValueError(f"trainer.loss.{knob} applies to type {' / '.join(users)}, not {self.type!r}; "
                                 f"remove it or set trainer.loss.type")  # fmt: skip
        if self.custom is not None and ("type" in self.model_fields_set or self.mis is not None):
            raise ValueError("trainer.loss.custom replaces the built-in objective: drop trainer.loss.type and "
                             "trainer.loss.mis (a custom loss reads the ratios from its LossBatch)")  # fmt: skip
        return self

    def clip_bounds(self) -> tuple[float, float]:
        """(clip_low, clip_high) of ppo / gspo / cispo, defaults filled in per type."""
        lo, hi = _CLIP_DEFAULTS[self.type]
        return (lo if self.clip_low is None else self.clip_low, hi if self.clip_high is None else self.clip_high)

    def normalization(self) -> Literal["token", "sequence"]:
        """The RL component's normaliser, ``normalize`` resolved."""
        if self.normalize == "auto":
            return "sequence" if self.type == "gspo" and self.custom is None else "token"
        return self.normalize

    def rl_loss(self, view: LossBatch) -> RLTokenLoss:
        """The RL token loss this config selects (``custom`` or a built-in) on one micro-batch."""
        if self.custom is not None:
            fn = resolve_import_path(self.custom)
            if _custom_arity(self.custom) == 2:
                return fn(view, self)
            return fn(view.logp, view.logq, view.advantages, view.rl_w, self)
        if self.type == "dppo" and self.mis is None:  # contract 3's loss, computed exactly as before
            return rl_token_loss(view.logp, view.logq, view.advantages, view.rl_w, self)
        return rl_objective(view, self)


def _custom_arity(path: str) -> int:
    """2 for ``fn(batch, cfg)``, 5 for the token-level ``fn(logp, logq, advantages, rl_w, cfg)``."""
    fn = resolve_import_path(path)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
    if n not in (2, 5):
        raise ValueError(f"loss.custom = {path!r} takes {n} required arguments; expected (batch, cfg) "
                         "or (logp, logq, advantages, rl_w, cfg)")  # fmt: skip
    return n


@cache
def resolve_import_path(path: str) -> Callable:
    """Import ``pkg.module:function`` or ``pkg.module.function``; errors name the field and fix."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"loss.custom = {path!r}: expected 'pkg.module:function' or 'pkg.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"loss.custom = {path!r}: cannot import module {module_name!r} ({e}); "
            "check the spelling and that the package is installed or on PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        # ValueError, not TypeError: pydantic turns only ValueError into a ValidationError.
        raise ValueError(f"loss.custom = {path!r}: module {module_name!r} has no callable {attr!r}")  # noqa: TRY004
    return fn


def rl_token_loss(
    logp: jax.Array, logq: jax.Array, advantages: jax.Array, rl_w: jax.Array, cfg: LossConfig
) -> RLTokenLoss:
    """DPPO-style trust-region policy gradient plus a squared log-ratio penalty.

    Inputs must already be finite everywhere (``loss_sums`` zeroes them outside the component), so ``exp`` cannot overflow on padding and no NaN reaches the gradient.
    """
    log_ratio = logp - logq
    ratio = jnp.exp(log_ratio)
    dp = jnp.exp(logp) - jnp.exp(logq)
    positive = advantages > 0
    masked_high = positive & (dp > cfg.mask_high)
    masked_low = ~positive & (dp < -cfg.mask_low)
    keep = 1.0 - (masked_high | masked_low).astype(logp.dtype)
    pg = keep * cfg.adv_tau * advantages * ratio
    loss = rl_w * (-pg + cfg.kl_tau * jnp.square(log_ratio))
    return RLTokenLoss(loss, masked_high, masked_low)


def _ref_kl_token_loss(logp, logq, logr, ref_kl_w, cfg):
    """On-policy distillation towards a reference: ``keep * sg(logr - logp) * ratio`` + penalty."""
    log_ratio = logp - logq
    ratio = jnp.exp(log_ratio)
    keep = 1.0 - (jnp.exp(logp) - jnp.exp(logq) < -cfg.mask_low).astype(logp.dtype)
    advantage = jax.lax.stop_gradient(logr - logp)
    return ref_kl_w * (-keep * advantage * ratio + cfg.kl_tau * jnp.square(log_ratio))


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
) -> dict[str, jax.Array]:
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
        counts["rl_norm"] = count_segments(_active(rl_w, loss_mask), _segments(segment_ids, rl_w)) if seq else counts["rl"]
    return {k: jnp.asarray(v).astype(jnp.float32) for k, v in counts.items()}


def _segments(segment_ids: jax.Array | None, like: jax.Array) -> jax.Array:
    """Segment ids, or one segment per row where none are given (unpacked rows)."""
    return jnp.ones(like.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)


def _effective_rl_w(
    rl_w: jax.Array, cfg: LossConfig, policy_version: jax.Array | None, trainer_version: int | jax.Array | None
) -> jax.Array:
    """``rl_w`` times the staleness factor of each token (unchanged without ``cfg.staleness``)."""
    if cfg.staleness is None:
        return rl_w
    if policy_version is None or trainer_version is None:
        raise ValueError("trainer.loss.staleness needs each token's policy_version and the trainer_version")
    return rl_w * staleness_factor(jnp.asarray(trainer_version) - jnp.asarray(policy_version), cfg)


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
) -> dict[str, jax.Array]:
    """Unreduced loss sums, token counts and metric sums of one micro-batch; all inputs ``[B, T]``.

    ``loss_mask`` is False at padding and at each sample's first token. Keys: ``{c}_loss_sum``
    and ``{c}_count`` for c in rl / ce / ref_kl, ``rl_norm_count`` (the RL denominator: tokens,
    or samples under sequence normalisation), ``kl_kept_sum`` / ``kl_masked_sum`` (mismatch
    KL on rl tokens whose pg term was kept / dropped) with ``kept_count`` / ``masked_count``,
    ``masked_high_count``, ``masked_low_count``, ``ce_nll_sum``, ``ce_nll_max``, the off-policy
    sums of ``_offpolicy_sums``, and with ``entropy`` given, ``entropy_sum`` / ``entropy_count``
    over the policy's own tokens (the rl and ref_kl components; never echo/CE targets, which the
    policy did not sample) and ``ce_entropy_sum`` over the CE tokens (SFT targets, echo
    observations). ``segment_ids`` (default: one sample per row), ``positions``,
    ``policy_version`` (default: 0) and ``trainer_version`` (default: 0) reach the RL loss in its
    ``LossBatch``. Combine micro-batches with ``add_sums``.
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
        rl_token_losses = rl_token_losses / jnp.maximum(segment_total(rl_on.astype(jnp.float32), segments), 1.0)
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
        out["ref_kl_loss_sum"] = _ref_kl_token_loss(
            zero(logp), zero(logq), zero(logr), zero(ref_kl_w), cfg
        ).sum()
        out["teacher_kl_sum"] = jax.lax.stop_gradient(zero(logp - logr).sum())
        trained = trained | ref_on
    if entropy is not None:
        out["entropy_sum"] = jax.lax.stop_gradient(jnp.where(trained, entropy, 0.0).sum())
        out["entropy_count"] = trained.sum().astype(jnp.float32)
        out["ce_entropy_sum"] = jax.lax.stop_gradient(jnp.where(ce_on, entropy, 0.0).sum())
    return out


LAG_BINS = ("0", "1", "2", "3p")
"""Staleness histogram bins: tokens sampled 0, 1, 2 and 3 or more policy versions ago."""


def _offpolicy_sums(view: LossBatch, rl: RLTokenLoss, raw_rl_on: jax.Array) -> dict[str, jax.Array]:
    """Importance-ratio distribution at token and sequence level (the sequence ratio is the
    geometric mean ``exp(mean_t log r_t)``, GSPO's), clipped / MIS-rejected token counts, and the
    staleness histogram over the RL tokens before the staleness rule (``raw_rl_on``).
    ``*_inv_max`` holds the max of ``1 / ratio``, so minima accumulate as maxima from 0."""
    on = view.rl_on
    count = lambda m: m.sum().astype(jnp.float32)
    log_r = jax.lax.stop_gradient(jnp.clip(view.log_ratio, -80.0, 80.0))
    seq_log_r = segment_total(jnp.where(on, log_r, 0.0), view.segment_ids)
    n_tokens = segment_total(on.astype(jnp.float32), view.segment_ids)
    seq_log_r = seq_log_r / jnp.maximum(n_tokens, 1.0)
    out = {}
    for name, lr, weight in (("ratio", log_r, 1.0), ("seq_ratio", seq_log_r, 1.0 / jnp.maximum(n_tokens, 1.0))):
        out[f"{name}_sum"] = jnp.where(on, jnp.exp(lr) * weight, 0.0).sum()
        out[f"{name}_max"] = jnp.max(jnp.where(on, jnp.exp(lr), 0.0), initial=0.0)
        out[f"{name}_inv_max"] = jnp.max(jnp.where(on, jnp.exp(-lr), 0.0), initial=0.0)
    out["rl_seqs_count"] = count_segments(on, view.segment_ids)
    out["clipped_count"] = count(on & rl.clipped) if rl.clipped is not None else jnp.zeros((), jnp.float32)
    out["rejected_count"] = count(on & rl.rejected) if rl.rejected is not None else jnp.zeros((), jnp.float32)
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


def add_sums(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Accumulate two ``loss_sums`` results (micro-batches, shards): add sums, max the maxima."""
    if a.keys() != b.keys():
        raise ValueError(f"add_sums: key sets differ: {sorted(a.keys() ^ b.keys())}")
    return {k: jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k] for k in a}


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den``, or exactly 0 where ``den == 0`` (the numerator is then 0 too)."""
    return num / jnp.maximum(den, 1.0)


def normalized_loss(sums: dict[str, jax.Array], counts: dict[str, jax.Array]) -> jax.Array:
    """``sum_c sums[c_loss_sum] / N_c`` with ``counts`` the *global* counts of the optimizer step
    (from ``loss_counts``, or the ``{c}_count`` keys of a step total); the RL component divides by
    ``counts["rl_norm"]`` where given (sequence normalisation). An empty component adds exactly 0
    and a zero gradient."""
    den = {c: counts["rl_norm"] if c == "rl" and "rl_norm" in counts else counts[c] for c in COMPONENTS}
    return sum(_safe_div(sums[f"{c}_loss_sum"], jax.lax.stop_gradient(den[c])) for c in COMPONENTS)


def counts_of(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The component counts held in a ``loss_sums`` result (or a total of them)."""
    return {c: sums[f"{c}_count"] for c in COMPONENTS} | {"rl_norm": sums["rl_norm_count"]}


def metrics(total: dict[str, jax.Array]) -> dict[str, jax.Array]:
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


def _offpolicy_metrics(total: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Ratio distribution (token and sequence level), clipped / rejected shares, staleness histogram."""
    inv = lambda x: jnp.where(x > 0, 1.0 / jnp.maximum(x, 1e-30), 0.0)
    out = {}
    for name, n in (("ratio", total["rl_count"]), ("seq_ratio", total["rl_seqs_count"])):
        out[f"{name}_mean"] = _safe_div(total[f"{name}_sum"], n)
        out[f"{name}_max"] = total[f"{name}_max"]
        out[f"{name}_min"] = inv(total[f"{name}_inv_max"])
    out["clipped_frac"] = _safe_div(total["clipped_count"], total["rl_count"])
    out["mis_rejected_frac"] = _safe_div(total["rejected_count"], total["rl_count"])
    out["rl_seqs"] = total["rl_seqs_count"]
    for b in LAG_BINS:
        out[f"stale_lag{b}_frac"] = _safe_div(total[f"lag{b}_count"], total["rl_raw_count"])
    out["stale_dropped_frac"] = _safe_div(total["stale_dropped_count"], total["rl_raw_count"])
    return out


def combine(total: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss and metrics of a whole step's sums when they were computed in one piece."""
    return normalized_loss(total, counts_of(total)), metrics(total)

"""``[trainer.loss]``: which RL objective, its knobs, the MIS and staleness rules, a custom loss.

``LossConfig.type`` is one of ``objectives.OBJECTIVES``; the knobs each objective owns and its
clip defaults come from its registration there. ``LossConfig.rl_loss`` is the RL component's
token loss the config selects.
"""

from __future__ import annotations

import inspect
import math
from typing import Annotated, Any, Literal

import pydantic

from jaxrl.imports import resolve_import_path
from jaxrl.trainer.loss.batch import LossBatch, RLTokenLoss
from jaxrl.trainer.loss.objectives import (
    OBJECTIVES,
    MISLevel,
    StalenessMode,
    mis_keep,
    rl_token_loss,
)

CUSTOM_FIELD = "loss.custom"
ObjectiveType = Literal[tuple(OBJECTIVES)]  # type: ignore[valid-type]  # "dppo", "ppo", "gspo", "cispo", "tis"
_TYPE_KNOBS = {name: spec.knobs for name, spec in OBJECTIVES.items()}
_CLIP_DEFAULTS = {name: spec.clip for name, spec in OBJECTIVES.items() if spec.clip is not None}


class MISConfig(pydantic.BaseModel):
    """``[trainer.loss.mis]``: masked importance sampling (MIS; IcePop at ``level = "token"``):
    tokens whose trainer/sampler ratio falls outside ``[low, high]`` lose their policy-gradient
    term (the ``kl_tau`` penalty stays). Works with every built-in ``type``."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    level: MISLevel = "token"
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
    mode: StalenessMode = "drop"
    """"drop": weight 0 (and out of the RL token count); "downweight": ``rl_w * decay ** (lag - max_lag)``."""
    decay: float = pydantic.Field(0.5, gt=0, lt=1, allow_inf_nan=False)
    """Per-version factor of ``mode = "downweight"`` (0 < decay < 1)."""


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

    clip_ratio_c: Annotated[float, pydantic.Field(gt=1, allow_inf_nan=False)] | Literal[False] = 3.0
    """dppo / ppo / gspo: dual-clip PPO's ``c`` (Ye et al. 2020; verl's name): for ``A < 0`` the
    term is ``max(pg, c * A)``, so a token whose ratio exploded (``r = e^6`` weighs ~403) loses at
    most ``c * |A|`` and, beyond ``r = c``, its gradient. Must be > 1; ``false`` turns it off (the
    single clip; None is read as false). Off is ``false``, not None, because TOML has no null and
    the printed config (``--dry-run``) leaves None values out: they would read back as 3.0."""

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
    token loss: ``fn(batch: LossBatch, cfg) -> RLTokenLoss`` (``jaxrl.trainer.loss``; the
    older ``fn(logp, logq, advantages, rl_w, cfg)`` is accepted too). Resolved when the config
    is validated, so a bad path fails at start-up."""

    @pydantic.field_validator("clip_ratio_c", mode="before")
    @classmethod
    def _off_or_above_one(cls, c: Any) -> Any:
        # Off: false (TOML), None (Python), "false" / "null" (CLI strings); stored as False. A
        # number must be finite and > 1; one message for every bad value instead of the union's two.
        if c is None or c is False or (isinstance(c, str) and c.strip().lower() in ("false", "off", "none", "null")):
            return False
        try:
            value = float(c) if not isinstance(c, bool) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 1):
            raise ValueError(f"trainer.loss.clip_ratio_c = {c!r}: must be a number > 1 (dual clip) or false (off)")
        return value

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
        return (
            lo if self.clip_low is None else self.clip_low,
            hi if self.clip_high is None else self.clip_high,
        )

    def normalization(self) -> Literal["token", "sequence"]:
        """The RL component's normaliser, ``normalize`` resolved ("auto": the objective's own)."""
        if self.normalize == "auto":
            return OBJECTIVES[self.type].normalize if self.custom is None else "token"
        return self.normalize

    def objective_fields(self) -> dict[str, Any]:
        """The fields the selected objective's function takes, by name (clip bounds resolved)."""
        resolved = (
            dict(zip(("clip_low", "clip_high"), self.clip_bounds())) if self.type in _CLIP_DEFAULTS else {}
        )
        resolved["clip_ratio_c"] = self.clip_ratio_c or None  # the objectives take None for off
        return {name: resolved.get(name, getattr(self, name)) for name in OBJECTIVES[self.type].fields}

    def rl_loss(self, view: LossBatch) -> RLTokenLoss:
        """The RL token loss this config selects (``custom`` or a built-in) on one micro-batch."""
        if self.custom is not None:
            fn = resolve_import_path(self.custom, CUSTOM_FIELD)
            if _custom_arity(self.custom) == 2:
                return fn(view, self)
            return fn(view.logp, view.logq, view.advantages, view.rl_w, self)
        pg = OBJECTIVES[self.type].fn(view, **self.objective_fields())
        keep = None if self.mis is None else mis_keep(view, self.mis.level, self.mis.low, self.mis.high)
        return rl_token_loss(view, pg, adv_tau=self.adv_tau, kl_tau=self.kl_tau, keep=keep)


def _custom_arity(path: str) -> int:
    """2 for ``fn(batch, cfg)``, 5 for the token-level ``fn(logp, logq, advantages, rl_w, cfg)``."""
    fn = resolve_import_path(path, CUSTOM_FIELD)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
    if n not in (2, 5):
        raise ValueError(f"{CUSTOM_FIELD} = {path!r} takes {n} required arguments; expected (batch, cfg) "
                         "or (logp, logq, advantages, rl_w, cfg)")  # fmt: skip
    return n

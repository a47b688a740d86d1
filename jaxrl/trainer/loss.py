"""The trainer's loss (DESIGN contract 3): RL, CE and ref-KL components over per-token weights.

Each component is normalised by its own *global* token count over the whole optimizer step, so
the functions here return unreduced sums and the division happens once, with counts the trainer
computes up front (they depend only on the batch, never on params):

    counts = loss_counts(rl_w, ce_w, loss_mask)                # summed over the whole step
    for mb in micro_batches:                                   # and data-parallel shards
        sums = loss_sums(logp, logq, A, rl_w, ce_w, loss_mask, cfg, entropy=entropy)
        loss_mb = normalized_loss(sums, counts)                # grads of these are summed
        total = add_sums(total, sums)
    step_metrics = metrics(total)

Summing ``normalized_loss`` over micro-batches then equals the loss of the whole batch at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pydantic

COMPONENTS = ("rl", "ce", "ref_kl")


class LossConfig(pydantic.BaseModel):
    """Hyper-parameters of the RL token loss (DESIGN contract 3)."""

    model_config = pydantic.ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mask_high: float = pydantic.Field(0.2, ge=0)
    """Trust region for positive advantages: tokens whose probability rose by more than this
    since sampling (``exp(logp) - exp(logq) > mask_high``) get no policy-gradient term."""

    mask_low: float = pydantic.Field(0.2, ge=0)
    """Trust region for non-positive advantages: tokens whose probability fell by more than
    this get no policy-gradient term. Also the ``keep`` threshold of the ref-KL component."""

    adv_tau: float = 1.0
    """Scale of the policy-gradient term ``A * ratio``."""

    kl_tau: float = pydantic.Field(1e-3, ge=0)
    """Weight of the ``log_ratio ** 2`` penalty that keeps the trainer near the sampler
    (RL and ref-KL components)."""

    custom: str | None = None
    """Import path (``pkg.module:function`` or ``pkg.module.function``) of a replacement for
    ``rl_token_loss``, with the same signature and return type. Resolved when the config is
    validated, so a bad path fails at start-up."""

    @pydantic.field_validator("custom")
    @classmethod
    def _resolve_custom(cls, path: str | None) -> str | None:
        if path is not None:
            resolve_import_path(path)
        return path

    def rl_token_loss_fn(self) -> Callable[..., RLTokenLoss]:
        """The RL token-loss function this config selects (``custom`` or the built-in)."""
        return rl_token_loss if self.custom is None else resolve_import_path(self.custom)


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


class RLTokenLoss(NamedTuple):
    """What an RL token-loss function returns; all ``[B, T]``."""

    loss: jax.Array
    """Per-token loss, already multiplied by ``rl_w`` (0 where ``rl_w`` is 0)."""
    masked_high: jax.Array
    """bool: policy-gradient term dropped because the probability rose too far."""
    masked_low: jax.Array
    """bool: policy-gradient term dropped because the probability fell too far."""


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
    rl_w: jax.Array, ce_w: jax.Array, loss_mask: jax.Array, ref_kl_w: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Tokens in each component: nonzero weight and ``loss_mask``. Independent of params, so
    the trainer can total them over the whole optimizer step before any forward pass."""
    counts = {"rl": _active(rl_w, loss_mask).sum(), "ce": _active(ce_w, loss_mask).sum()}
    counts["ref_kl"] = jnp.zeros((), jnp.int32) if ref_kl_w is None else _active(ref_kl_w, loss_mask).sum()
    return {k: v.astype(jnp.float32) for k, v in counts.items()}


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
) -> dict[str, jax.Array]:
    """Unreduced loss sums, token counts and metric sums of one micro-batch; all inputs ``[B, T]``.

    ``loss_mask`` is False at padding and at each sample's first token. Keys: ``{c}_loss_sum``
    and ``{c}_count`` for c in rl / ce / ref_kl, ``kl_kept_sum`` / ``kl_masked_sum`` (mismatch
    KL on rl tokens whose pg term was kept / dropped) with ``kept_count`` / ``masked_count``,
    ``masked_high_count``, ``masked_low_count``, ``ce_nll_sum``, ``ce_nll_max``, and with
    ``entropy`` given, ``entropy_sum`` / ``entropy_count`` over the policy's own tokens (the rl
    and ref_kl components; never echo/CE targets, which the policy did not sample) and
    ``ce_entropy_sum`` over the CE tokens (SFT targets, echo observations).
    Combine micro-batches with ``add_sums``.
    """
    if (ref_kl_w is None) != (logr is None):
        raise ValueError("loss_sums: pass ref_kl_w and logr together (or neither)")
    loss_mask = loss_mask.astype(bool)
    rl_on, ce_on = _active(rl_w, loss_mask), _active(ce_w, loss_mask)
    # Zero inputs outside each component *before* any exp: padding may hold anything, and a
    # where on the inputs (not the outputs) keeps both the values and the gradients finite.
    rl_logp, rl_logq, rl_adv, rl_weight = (jnp.where(rl_on, x, 0.0) for x in (logp, logq, advantages, rl_w))
    rl = cfg.rl_token_loss_fn()(rl_logp, rl_logq, rl_adv, rl_weight, cfg)
    ce_nll = -jnp.where(ce_on, logp, 0.0)
    out = {
        "rl_loss_sum": rl.loss.sum(),
        "ce_loss_sum": (jnp.where(ce_on, ce_w, 0.0) * ce_nll).sum(),
        "ref_kl_loss_sum": jnp.zeros((), jnp.float32),
        **{f"{c}_count": n for c, n in loss_counts(rl_w, ce_w, loss_mask, ref_kl_w).items()},
        **_rl_metric_sums(rl, rl_on, rl_logp, rl_logq),
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
    (from ``loss_counts``, or the ``{c}_count`` keys of a step total). An empty component adds
    exactly 0 and a zero gradient."""
    return sum(_safe_div(sums[f"{c}_loss_sum"], jax.lax.stop_gradient(counts[c])) for c in COMPONENTS)


def counts_of(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The component counts held in a ``loss_sums`` result (or a total of them)."""
    return {c: sums[f"{c}_count"] for c in COMPONENTS}


def metrics(total: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-step metrics from the step's accumulated ``loss_sums``; empty means are 0, not NaN."""
    out = {f"{c}_loss": _safe_div(total[f"{c}_loss_sum"], total[f"{c}_count"]) for c in COMPONENTS}
    out |= {f"{c}_tokens": total[f"{c}_count"] for c in COMPONENTS}
    out |= {
        "mismatch_kl": _safe_div(total["kl_kept_sum"], total["kept_count"]),
        "mismatch_kl_masked": _safe_div(total["kl_masked_sum"], total["masked_count"]),
        "masked_high_frac": _safe_div(total["masked_high_count"], total["rl_count"]),
        "masked_low_frac": _safe_div(total["masked_low_count"], total["rl_count"]),
        "ce_nll_mean": _safe_div(total["ce_nll_sum"], total["ce_count"]),
        "ce_nll_max": total["ce_nll_max"],
    }
    if "teacher_kl_sum" in total:
        # mean of logp - logr over sampled ref-KL tokens: an estimate of KL(policy || teacher)
        out["teacher_kl"] = _safe_div(total["teacher_kl_sum"], total["ref_kl_count"])
    if "entropy_sum" in total:
        out["entropy"] = _safe_div(total["entropy_sum"], total["entropy_count"])
        out["ce_entropy"] = _safe_div(total["ce_entropy_sum"], total["ce_count"])
    return out


def combine(total: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss and metrics of a whole step's sums when they were computed in one piece."""
    return normalized_loss(total, counts_of(total)), metrics(total)

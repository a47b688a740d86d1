"""What every RL loss sees: one typed view of a packed micro-batch (DESIGN contracts 3-4).

Built-in objectives (``objectives``) and a user's ``loss.custom`` get the same ``LossBatch``,
so a sequence-level ratio (GSPO, sequence TIS/MIS) is as easy to write as a token-level one:
``segment_total`` sums any per-token quantity over its sample and hands the total back on every
token of that sample. This module imports nothing else of the loss package.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LossBatch(NamedTuple):
    """A packed micro-batch as the RL loss sees it; every array ``[B, T]`` (token t predicted
    from position t - 1). ``logp``, ``logq``, ``advantages`` and ``rl_w`` are 0 outside the
    RL component (``rl_w == 0`` or ``loss_mask`` False), so ``exp`` of them stays finite."""

    logp: jax.Array
    """Trainer log-prob of each token at its sampling temperature (differentiable)."""
    logq: jax.Array
    """Sampler (inference engine) log-prob of each token."""
    advantages: jax.Array
    """Advantage of the sample the token belongs to."""
    rl_w: jax.Array
    """RL weight after the staleness rule (``loss.staleness``); 0 = not in the RL component."""
    ce_w: jax.Array
    ref_kl_w: jax.Array
    loss_mask: jax.Array
    """bool: False at padding and at each sample's first token."""
    segment_ids: jax.Array
    """int: which sample of its row a token belongs to (1, 2, ...; 0 = padding)."""
    positions: jax.Array
    """int: position of the token inside its sample (0 at the sample's first token)."""
    policy_version: jax.Array
    """int: version of the policy that sampled the token (per token: an engine that swapped
    weights mid-sequence reports each token's own version)."""
    trainer_version: jax.Array
    """int scalar: version of the parameters being trained (the trainer's step count)."""

    @property
    def rl_on(self) -> jax.Array:
        """bool: tokens in the RL component."""
        return (self.rl_w != 0) & self.loss_mask

    @property
    def log_ratio(self) -> jax.Array:
        """``logp - logq``: log importance ratio of trainer over sampler (0 off the RL component)."""
        return self.logp - self.logq

    @property
    def lag(self) -> jax.Array:
        """Policy versions between the sampler of each token and the trainer (>= 0 in order)."""
        return self.trainer_version - self.policy_version


class RLTokenLoss(NamedTuple):
    """What an RL token-loss function returns; all ``[B, T]``."""

    loss: jax.Array
    """Per-token loss, already multiplied by ``rl_w`` (0 where ``rl_w`` is 0)."""
    masked_high: jax.Array
    """bool: policy-gradient term dropped because the probability (or ratio) rose too far."""
    masked_low: jax.Array
    """bool: policy-gradient term dropped because the probability (or ratio) fell too far."""
    clipped: jax.Array | None = None
    """bool: importance weight clipped or truncated (CISPO, TIS); the gradient is kept, scaled."""
    rejected: jax.Array | None = None
    """bool: policy-gradient term dropped by the MIS / IcePop ratio mask (``loss.mis``)."""
    dual_clipped: jax.Array | None = None
    """bool: ``A < 0`` and the term held at the dual-clip floor ``clip_ratio_c * A`` (no gradient)."""


def _segment_ids_global(segment_ids: jax.Array) -> tuple[jax.Array, int]:
    """Row-local segment ids made unique across rows, and how many ids there can be."""
    b, t = segment_ids.shape
    return (jnp.arange(b)[:, None] * (t + 1) + segment_ids).reshape(-1), b * (t + 1)


def segment_sums(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Sum of ``x`` over each segment of each row, as a flat array indexed by global segment id."""
    gid, n = _segment_ids_global(segment_ids)
    return jax.ops.segment_sum(x.reshape(-1), gid, num_segments=n)


def segment_total(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[B, T]``: on every token, the sum of ``x`` over the tokens of its segment (its sample)."""
    gid, _ = _segment_ids_global(segment_ids)
    return segment_sums(x, segment_ids)[gid].reshape(x.shape)


def segment_mean(x: jax.Array, on: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """``[B, T]``: on every token, the mean of ``x`` over the ``on`` tokens of its segment (0 if none)."""
    total = segment_total(jnp.where(on, x, 0.0), segment_ids)
    return total / jnp.maximum(segment_total(on.astype(x.dtype), segment_ids), 1.0)


def count_segments(on: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Number of segments (samples) with at least one ``on`` token, as float32."""
    per_segment = segment_sums(on.astype(jnp.float32), segment_ids)
    return (per_segment > 0).sum().astype(jnp.float32)

"""GRPO: advantage = reward - group mean over the group's members, optionally length-shaped as
prime-rl does.

Only the policy's own (sampled) tokens train, in the RL component. A group whose
advantages are all zero (every rollout scored the same) carries no signal: its samples get
rl_w = 0, so they add no RL tokens (nor their KL term) to the step.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from jaxrl.orchestrator.algo.base import (
    AlgoConfigBase,
    Algorithm,
    LossComponent,
    Member,
    TraceLengths,
    has_weight,
    members,
    trace_lengths,
    trainable_branches,
)
from jaxrl.orchestrator.traces import Branch, Rollout, branch_sample, trace_truncated
from jaxrl.training_sample import TrainingSample

ZERO_ADVANTAGE = 1e-8
"""Advantages within this of zero count as zero (float noise of equal rewards)."""

STD_EPS = 1e-6
"""Added to a group's reward spread before dividing (`std_normalize`), so equal rewards stay 0."""

Selection = tuple[np.ndarray, np.ndarray]
"""Echo selection of one branch: (ce_w float32[L], selected bool[L]); selected tokens leave RL."""


class LinearLengthPenalty(AlgoConfigBase):
    """prime-rl's linear length penalty: a pass-rate-scaled cut subtracted from each reward
    before the group baseline,
    `penalty_i = mean(r) * (w_out * out_i / max(out) + w_in * in_i / max(in) + w_turns * turns_i / max(turns))`,
    each quantity normalised by the group's own maximum (so the penalty is at most
    `mean(r) * (w_out + w_in + w_turns)` whatever the lengths). A term with weight 0 is off."""

    type: Literal["linear"] = "linear"
    num_output_tokens_weight: float = Field(0.25, ge=0, allow_inf_nan=False)
    """Weight of the output-token term (tokens the policy sampled)."""
    num_input_tokens_weight: float = Field(0.1, ge=0, allow_inf_nan=False)
    """Weight of the input-token term (tokens the model read but did not sample: prompts,
    tool outputs, template scaffold)."""
    num_turns_weight: float = Field(0.1, ge=0, allow_inf_nan=False)
    """Weight of the turns term (model calls)."""

    def penalties(self, rewards: np.ndarray, lengths: list[TraceLengths]) -> np.ndarray:
        """The penalty of each member of a group (float64)."""

        def term(values: list[int]) -> np.ndarray:
            v = np.asarray(values, np.float64)
            return v / max(v.max(), 1.0)

        frac = (
            self.num_output_tokens_weight * term([x.output_tokens for x in lengths])
            + self.num_input_tokens_weight * term([x.input_tokens for x in lengths])
            + self.num_turns_weight * term([x.turns for x in lengths])
        )
        return rewards.mean() * frac


class OverlongShaping(AlgoConfigBase):
    """DAPO's soft overlong punishment, added to each member's reward before the group baseline:
    with ``L`` the member's sampled (output) tokens, ``L_max = max_tokens`` and ``L_c = buffer``,
    ``0`` if ``L <= L_max - L_c``; ``penalty * (L_max - L_c - L) / L_c`` up to ``L_max``; and
    ``-penalty`` beyond. Long answers lose reward gradually instead of being cut off blind."""

    max_tokens: int = Field(ge=2)
    """``L_max``: output tokens at which the full penalty applies (usually the sampling
    ``max_completion_tokens``, times the turns of a multi-turn env)."""
    buffer: int = Field(ge=1)
    """``L_c``: length of the soft band before ``max_tokens`` (1 <= buffer < max_tokens)."""
    penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Reward removed at (and beyond) ``max_tokens``."""

    @model_validator(mode="after")
    def _buffer_fits(self) -> OverlongShaping:
        if self.buffer >= self.max_tokens:
            raise ValueError(f"overlong.buffer = {self.buffer} must be below overlong.max_tokens = {self.max_tokens}")
        return self

    def shaping(self, output_tokens: np.ndarray) -> np.ndarray:
        """The (non-positive) reward term of each member (float64)."""
        start = self.max_tokens - self.buffer
        soft = (start - output_tokens.astype(np.float64)) / self.buffer
        return self.penalty * np.where(output_tokens <= start, 0.0, np.maximum(soft, -1.0))


class GRPOConfig(AlgoConfigBase):
    type: Literal["grpo"] = "grpo"
    loss_components: ClassVar[frozenset[LossComponent]] = frozenset({"rl"})
    length_penalty: LinearLengthPenalty | None = None
    """`[...algo.length_penalty]`: prime-rl's linear length penalty (None: off)."""
    overlong: OverlongShaping | None = None
    """`[...algo.overlong]`: DAPO's soft overlong punishment on completion length (None: off)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering: a member whose answer was cut at the length limit
    (``finish_reason = "length"`` or a verifiers token-limit stop; ``traces.trace_truncated``)
    gets no RL weight, so a truncation is not credited as if the model had chosen to stop
    there. It stays in its group's baseline (DAPO masks the loss, not the reward). Metric:
    ``overlong_filtered_frac``. Beside or instead of the soft ``overlong`` shaping."""
    std_normalize: bool = False
    """Divide each group's centred rewards by the group's standard deviation (DeepSeekMath's
    GRPO; prime-rl and Dr. GRPO centre only). With Adam the overall scale is irrelevant; what
    changes is the weight between groups: a group whose rollouts differ in a few tokens (low
    spread) carries a precise signal about those tokens and gets as much weight as a group of
    diverse, noisy rollouts. A group with equal rewards stays all-zero."""

    @field_validator("length_penalty", mode="before")
    @classmethod
    def _migrate_number(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):
            raise ValueError(  # noqa: TRY004 - pydantic reports ValueError only
                f"length_penalty = {value} (a reward cut per sampled token) was replaced by prime-rl's "
                "linear penalty: set the table [orchestrator.train.env.algo.length_penalty] with "
                "num_output_tokens_weight (e.g. 0.25), num_input_tokens_weight and num_turns_weight "
                "(each term is normalised by the group's maximum and scaled by the group's mean reward)"
            )
        return value


class GroupRelative(Algorithm):
    """One scalar advantage per member (`advantages`), broadcast over its sampled tokens in
    the RL component; subclasses may select tokens for CE instead (`echo`)."""

    overlong_filter: bool = False
    """Zero the RL weight of truncated members (``GRPOConfig.overlong_filter``)."""

    @abstractmethod
    def member_advantages(self, group: list[Member]) -> np.ndarray:
        """One advantage per member of a group (failed rollouts are no members)."""

    def advantages(self, group: list[Rollout]) -> list[float]:
        """One advantage per member of the group's successful rollouts."""
        found = members(group)
        return self.member_advantages(found).tolist() if found else []

    def echo(self, trace: dict, branches: list[Branch]) -> list[Selection | None]:
        """Per-branch echo selections (None = none); plain RL selects nothing. May raise: the
        rollout then fails (a record with the error), not the step."""
        return [None] * len(branches)

    def _select(self, rollout: Rollout) -> dict[int, list[Selection | None]]:
        """Echo selections by trace (id); a raising hook marks the rollout failed."""
        try:
            return {id(trace): self.echo(trace, branches) for trace, branches in trainable_branches(rollout)}
        except Exception as e:  # noqa: BLE001 - user filter code: one failed rollout, not a failed step
            rollout.error = f"echo: {type(e).__name__}: {e}"
            return {}

    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        selections: dict[int, list[Selection | None]] = {}
        for rollout in group:
            if rollout.ok:
                selections |= self._select(rollout)
        found = members(group)
        if not found:
            return []
        advantages = self.member_advantages(found).tolist()
        rl_on = any(abs(a) > ZERO_ADVANTAGE for a in advantages)
        out = []
        for member, advantage in zip(found, advantages):
            member_rl = rl_on and not (self.overlong_filter and trace_truncated(member.trace))
            for branch, selection in zip(member.branches, selections[id(member.trace)]):
                rl_w = branch.sampled_mask.astype(np.float32) * float(member_rl)
                ce_w = None
                if selection is not None:
                    ce_w, selected = selection
                    rl_w = np.where(selected, 0.0, rl_w).astype(np.float32)
                sample = branch_sample(
                    branch,
                    member.rollout,
                    advantage=advantage,
                    rl_w=rl_w,
                    ce_w=ce_w,
                    metadata={
                        "trace_id": member.trace.get("id"),
                        "role": member.role,
                        "reward": member.reward,
                    },
                )
                if has_weight(sample):
                    out.append(sample)
        return out


class GRPO(GroupRelative):
    def __init__(self, config: GRPOConfig) -> None:
        self.config = config
        self.overlong_filter = config.overlong_filter

    def member_advantages(self, group: list[Member]) -> np.ndarray:
        rewards = np.array([m.reward for m in group], np.float64)
        shaped = rewards
        if self.config.length_penalty is not None:
            shaped = rewards - self.config.length_penalty.penalties(
                rewards, [trace_lengths(m.trace) for m in group]
            )
        if self.config.overlong is not None:
            shaped = shaped + self.config.overlong.shaping(np.array([trace_lengths(m.trace).output_tokens for m in group]))
        centred = shaped - shaped.mean()
        if self.config.std_normalize:
            return centred / (shaped.std() + STD_EPS)
        return centred

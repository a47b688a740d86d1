"""GRPO: advantage = reward - group mean, optionally with a linear length penalty.

Only the policy's own (sampled) tokens train, in the RL component. A group whose
advantages are all zero (every rollout scored the same) carries no signal: its samples get
rl_w = 0, so they add no RL tokens (nor their KL term) to the step.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from jaxrl.orchestrator.algo.base import (
    AlgoConfigBase,
    Algorithm,
    has_weight,
    sampled_tokens,
    trainable_branches,
)
from jaxrl.orchestrator.traces import Branch, Rollout, branch_sample
from jaxrl.samples import TrainingSample

ZERO_ADVANTAGE = 1e-8
"""Advantages within this of zero count as zero (float noise of equal rewards)."""


class GRPOConfig(AlgoConfigBase):
    type: Literal["grpo"] = "grpo"
    length_penalty: float = Field(0.0, ge=0.0)
    """Reward subtracted per sampled token before the group baseline:
    `shaped = reward - length_penalty * sampled_tokens` (0 = off)."""


class GRPO(Algorithm):
    def __init__(self, config: GRPOConfig) -> None:
        self.config = config

    def advantages(self, group: list[Rollout]) -> list[float]:
        """One advantage per rollout; failed rollouts get 0 and stay out of the baseline."""
        ok = [r for r in group if r.ok]
        if not ok:
            return [0.0] * len(group)
        shaped = {id(r): r.reward - self.config.length_penalty * sampled_tokens(r) for r in ok}
        baseline = sum(shaped.values()) / len(shaped)
        return [shaped[id(r)] - baseline if r.ok else 0.0 for r in group]

    def ce_weights(self, trace: dict, branches: list[Branch]) -> list[np.ndarray | None]:
        """Per-branch CE weight streams (None = none); GRPO trains no CE tokens."""
        return [None] * len(branches)

    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        advantages = self.advantages(group)
        rl_on = any(abs(a) > ZERO_ADVANTAGE for a in advantages)
        out = []
        for rollout, advantage in zip(group, advantages):
            if not rollout.ok:
                continue
            for trace, branches in trainable_branches(rollout):
                for branch, ce_w in zip(branches, self.ce_weights(trace, branches)):
                    rl_w = branch.sampled_mask.astype(np.float32) * float(rl_on)
                    if ce_w is not None:
                        rl_w = np.where(ce_w != 0, 0.0, rl_w).astype(np.float32)
                    sample = branch_sample(
                        branch,
                        rollout,
                        advantage=advantage,
                        rl_w=rl_w,
                        ce_w=ce_w,
                        metadata={"trace_id": trace.get("id")},
                    )
                    if has_weight(sample):
                        out.append(sample)
        return out

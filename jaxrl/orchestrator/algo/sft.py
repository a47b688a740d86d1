"""SFT on rollouts: cross-entropy on the policy's own sampled tokens (rejection sampling).

With `min_reward` set, only rollouts that scored at least that much are kept — the classic
rejection-sampling fine-tune. Nothing goes to the RL component.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from jaxrl.orchestrator.algo.base import AlgoConfigBase, Algorithm, has_weight, trainable_branches
from jaxrl.orchestrator.traces import Rollout, branch_sample
from jaxrl.samples import TrainingSample


class SFTConfig(AlgoConfigBase):
    type: Literal["sft"] = "sft"
    min_reward: float | None = None
    """Keep only rollouts with reward >= this (None keeps every successful rollout)."""
    weight: float = Field(1.0, gt=0.0)
    """CE weight of each sampled token."""


class SFT(Algorithm):
    def __init__(self, config: SFTConfig) -> None:
        self.config = config

    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        out = []
        for rollout in group:
            if not rollout.ok or (
                self.config.min_reward is not None and rollout.reward < self.config.min_reward
            ):
                continue
            for trace, branches in trainable_branches(rollout):
                for branch in branches:
                    sample = branch_sample(
                        branch,
                        rollout,
                        advantage=0.0,
                        rl_w=np.zeros(len(branch), np.float32),
                        ce_w=branch.sampled_mask.astype(np.float32) * self.config.weight,
                        metadata={"trace_id": trace.get("id")},
                    )
                    if has_weight(sample):
                        out.append(sample)
        return out

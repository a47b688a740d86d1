"""MaxRL (maximum-likelihood RL, arXiv:2602.02710): advantage = (r - mean) / mean.

Normalising by the group's mean reward instead of centring alone makes the policy gradient
unbiased for the order-`group_size` truncation of the maximum-likelihood objective: a task the
policy solves with probability p gets ~1/p weight. One success in a group of four gives
[3, -1, -1, -1]. Meant for non-negative (canonically 0/1) rewards; a group whose mean reward is
<= 0 carries no signal (all advantages 0). Same samples as GRPO otherwise.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np

from jaxrl.orchestrator.algo.base import AlgoConfigBase, LossComponent, Member
from jaxrl.orchestrator.algo.grpo import GroupRelative


class MaxRLConfig(AlgoConfigBase):
    type: Literal["max_rl"] = "max_rl"
    loss_components: ClassVar[frozenset[LossComponent]] = frozenset({"rl"})


class MaxRL(GroupRelative):
    def __init__(self, config: MaxRLConfig) -> None:
        self.config = config

    def member_advantages(self, group: list[Member]) -> np.ndarray:
        rewards = np.array([m.reward for m in group], np.float64)
        mean = rewards.mean()
        return np.zeros_like(rewards) if mean <= 0 else (rewards - mean) / mean

"""RAE, role-conditioned advantage estimation (SPIRAL, arXiv:2506.24119), for multi-agent
self-play: advantage = a member's reward minus an exponential moving average of the rewards of
the same seat on the same task, keyed by (env, example id, role).

In a zero-sum game the group mean is ~0 whatever the policy does, so a group baseline mixes the
seats' opposite reward scales (a first-mover edge would read as permanent credit). A per-seat
baseline measures each seat against its own usual result. A key's baseline starts at the first
rewards seen for it (so the first group's advantages are centred within the seat); every member
of a group is scored against the baseline from before the group, which then moves by the
group's mean reward for the key: `b <- decay * b + (1 - decay) * mean(r)`. So the result does
not depend on the order of members within a group, and groups of different tasks touch
different keys, so it does not depend on the order groups finish either. Baselines live in
orchestrator memory (a resumed run re-warms them).
"""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from jaxrl.orchestrator.algo.base import AlgoConfigBase, LossComponent, Member
from jaxrl.orchestrator.algo.grpo import GroupRelative


class RAEConfig(AlgoConfigBase):
    type: Literal["rae"] = "rae"
    loss_components: ClassVar[frozenset[LossComponent]] = frozenset({"rl"})
    decay: float = Field(0.95, ge=0.0, lt=1.0)
    """EMA decay of each (env, example, role) baseline."""


class RAE(GroupRelative):
    def __init__(self, config: RAEConfig) -> None:
        self.config = config
        self.baselines: dict[tuple[str, str, str], float] = {}

    def member_advantages(self, group: list[Member]) -> np.ndarray:
        keys = [(m.rollout.env, m.example, m.role) for m in group]
        rewards = np.array([m.reward for m in group], np.float64)
        by_key: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        for key, r in zip(keys, rewards):
            by_key[key].append(float(r))
        means = {key: float(np.mean(rs)) for key, rs in by_key.items()}
        before = {key: self.baselines.get(key, means[key]) for key in by_key}
        d = self.config.decay
        for key, mean in means.items():
            self.baselines[key] = d * before[key] + (1.0 - d) * mean
        return rewards - np.array([before[k] for k in keys])

"""SFT on rollouts: cross-entropy on the policy's own sampled tokens (rejection sampling).

With `min_reward` set, only rollouts that scored at least that much are kept — the classic
rejection-sampling fine-tune. Nothing goes to the RL component.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from jaxrl.orchestrator.algo.base import AlgoConfigBase, Algorithm, LossComponent, sampled_token_samples
from jaxrl.orchestrator.traces import Rollout
from jaxrl.training_sample import TrainingSample


class SFTConfig(AlgoConfigBase):
    type: Literal["sft"] = "sft"
    loss_components: ClassVar[frozenset[LossComponent]] = frozenset({"ce"})
    min_reward: float | None = None
    """Keep only rollouts with reward >= this (None keeps every successful rollout)."""
    weight: float = Field(1.0, gt=0.0)
    """CE weight of each sampled token."""


class SFT(Algorithm):
    def __init__(self, config: SFTConfig) -> None:
        self.config = config

    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        floor = self.config.min_reward
        kept = [r for r in group if r.ok and (floor is None or r.reward >= floor)]
        return sampled_token_samples(kept, stream="ce_w", weight=self.config.weight)

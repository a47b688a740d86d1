"""The algorithm interface: score one group of rollouts of the same task into samples.

An algorithm sees a whole group (the `group_size` rollouts of one task), so group-relative
credit (GRPO) is local to it. It decides the advantage of every rollout and the two
per-token weight streams of every sample (DESIGN contracts 3-4); the trainer never sees a
trace. Failed rollouts (`Rollout.error`) take no part: not in a baseline, no sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict

from jaxrl.orchestrator.traces import Branch, Rollout, trace_branches
from jaxrl.samples import TrainingSample


class AlgoConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Algorithm(ABC):
    """Turns one finished group of rollouts into training samples."""

    @abstractmethod
    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        """The samples of `group`; samples with no weight in any loss component are left out."""


def trainable_branches(rollout: Rollout) -> Iterator[tuple[dict, list[Branch]]]:
    """Each trainable trace of a rollout with its trainable branches."""
    for trace in rollout.trainable_traces:
        yield trace, [b for b in trace_branches(trace) if b.trainable]


def sampled_tokens(rollout: Rollout) -> int:
    """Tokens the policy sampled across the rollout's trainable branches."""
    return sum(b.num_sampled for _, branches in trainable_branches(rollout) for b in branches)


def has_weight(sample: TrainingSample) -> bool:
    """Whether any token of the sample (past the first, which is never predicted) is trained."""
    return bool(sample.rl_w[1:].any() or sample.ce_w[1:].any())

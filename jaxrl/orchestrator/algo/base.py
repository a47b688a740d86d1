"""The algorithm interface: score one group of rollouts of the same task into samples.

An algorithm sees a whole group (the `group_size` rollouts of one task), so group-relative
credit (GRPO, MaxRL) is local to it. Credit goes to *members*: each trainable trace of a
rollout (one per agent seat in a multi-agent episode; a non-trainable seat such as a judge is
no member) has its own reward and its own advantage, so the two seats of a zero-sum game get
opposite credit instead of one shared mean. The algorithm decides every member's advantage and
the per-token weight streams of every sample (DESIGN contracts 3-4); the trainer never sees a
trace. Failed rollouts (`Rollout.error`) take no part: not in a baseline, no sample.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from jaxrl.orchestrator.traces import Branch, Rollout, branch_sample, trace_branches, trace_reward
from jaxrl.training_sample import LossComponent, TrainingSample


class AlgoConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    loss_components: ClassVar[frozenset[LossComponent]] = frozenset()
    """The trainer's loss components (DESIGN contract 3) an algorithm's samples can weight: the
    run reads these (which metrics mean something, what to load) instead of algorithm names."""

    def teacher_config(self) -> Any:
        """The teacher model whose log-probs the algorithm's ref-KL samples need, or None."""
        return None


class Algorithm(ABC):
    """Turns one finished group of rollouts into training samples."""

    @abstractmethod
    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        """The samples of `group`; samples with no weight in any loss component are left out."""


def trainable_branches(rollout: Rollout) -> Iterator[tuple[dict, list[Branch]]]:
    """Each trainable trace of a rollout with its trainable branches."""
    for trace in rollout.trainable_traces:
        yield trace, [b for b in trace_branches(trace) if b.trainable]


@dataclass
class Member:
    """One trainable trace of a successful rollout: the unit of credit."""

    rollout: Rollout
    trace: dict
    branches: list[Branch]
    """Its trainable branches."""

    @property
    def reward(self) -> float:
        return trace_reward(self.trace)

    @property
    def role(self) -> str:
        """The env agent (seat) that produced the trace (verifiers' `agent.name`)."""
        return str((self.trace.get("agent") or {}).get("name", "agent"))

    @property
    def example(self) -> str:
        """The task's identity: the trace's task key, else the task's `idx`."""
        key = (self.trace.get("task") or {}).get("key")
        return str(key if key is not None else self.rollout.task.get("idx"))


def members(group: list[Rollout]) -> list[Member]:
    """The members of a group's successful rollouts, in rollout then trace order."""
    return [Member(r, trace, branches) for r in group if r.ok for trace, branches in trainable_branches(r)]


@dataclass(frozen=True)
class TraceLengths:
    """Size of a trace, each message node counted once (a node shared by several branches is
    one node): what prime-rl's length penalty calls `num_output_tokens`, `num_input_tokens`
    (`num_total_tokens - num_output_tokens`) and `num_turns`."""

    output_tokens: int
    """Tokens the policy sampled (mask True)."""
    input_tokens: int
    """Every other token: prompts, tool outputs, feedback, chat-template scaffold."""
    turns: int
    """Model calls (sampled message nodes)."""


def trace_lengths(trace: dict) -> TraceLengths:
    output = inputs = turns = 0
    for node in trace.get("nodes") or []:
        n_sampled = sum(bool(m) for m in node.get("mask") or [])
        output += n_sampled
        inputs += len(node.get("token_ids") or []) - n_sampled
        turns += bool(node.get("sampled", False))
    return TraceLengths(output, inputs, turns)


def has_weight(sample: TrainingSample) -> bool:
    """Whether any token of the sample (past the first, which is never predicted) is trained."""
    return bool(sample.rl_w[1:].any() or sample.ce_w[1:].any() or sample.ref_kl_w[1:].any())


def sampled_token_samples(
    rollouts: Iterable[Rollout], *, stream: Literal["ce_w", "ref_kl_w"], weight: float = 1.0, **metadata: Any
) -> list[TrainingSample]:
    """One sample per trainable branch of each successful rollout, with no RL credit
    (advantage 0, `rl_w` 0) and `weight` on every sampled token in the loss component `stream`:
    what SFT (`ce_w`) and on-policy distillation (`ref_kl_w`) train. Samples with nothing to
    train are left out; each carries its trace id and `metadata`."""
    out = []
    for rollout in rollouts:
        if not rollout.ok:
            continue
        for trace, branches in trainable_branches(rollout):
            for branch in branches:
                sample = branch_sample(
                    branch,
                    rollout,
                    advantage=0.0,
                    rl_w=np.zeros(len(branch), np.float32),
                    metadata={"trace_id": trace.get("id"), **metadata},
                    **{stream: branch.sampled_mask.astype(np.float32) * weight},
                )
                if has_weight(sample):
                    out.append(sample)
    return out

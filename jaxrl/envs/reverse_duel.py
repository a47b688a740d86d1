"""reverse_duel: a two-seat zero-sum game on reverse_text tasks, for multi-agent credit.

Both seats (`first`, `second`: the same policy) reverse the same text, each told which seat it
plays; each seat's reward is its similarity minus its opponent's, so the two rewards sum to 0.
With one advantage per rollout (the mean of its seats) such self-play would train nothing;
with per-member credit (`jaxrl.orchestrator.algo`) the better seat is pushed up and the worse
one down. Offline: both seats run the in-process `LocalChatHarness`.
"""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf

from jaxrl.envs.harness import LocalChatHarness
from jaxrl.envs.reverse_text import ReverseTextTaskset

SEATS = ("first", "second")


class ReverseDuelEnvConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The first seat."""
    second: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The second seat."""


class ReverseDuelEnv(vf.Env[ReverseDuelEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        prompt = task.data.system_prompt or ""
        await asyncio.gather(
            *(
                getattr(agents, seat).run(task.with_system_prompt(f"{prompt} You play the {seat} seat."))
                for seat in SEATS
            )
        )

    async def finalize(self, task: vf.Task, episode: vf.Episode) -> None:
        """Zero-sum rewards: each seat's similarity minus the other's (kept as a metric)."""
        traces = {t.agent.name: t for t in episode.traces}
        if set(traces) != set(SEATS):
            return  # a failed seat: the episode carries its error
        scores = {seat: t.reward for seat, t in traces.items()}
        for seat, trace in traces.items():
            other = scores[SEATS[1 - SEATS.index(seat)]]
            trace.record_metric("similarity", scores[seat])
            trace.rewards = {}
            trace.record_reward("margin", scores[seat] - other)


__all__ = ["LocalChatHarness", "ReverseDuelEnv", "ReverseTextTaskset"]

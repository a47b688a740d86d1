"""alphabet_sort: multi-turn, no tools — keep a growing list of names sorted.

The first user turn gives a few names; each later user turn adds more, and the model must
reply every time with the full sorted list, one name per line. The user side is scripted by
the env (`AlphabetSortEnv.run`, through verifiers' `Interaction`), so every user message is
an env-provided observation on the trace (what echo can train on). The reward is the mean
over user turns of the similarity between the reply's list and the expected list; a turn
the model never answered scores 0.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from pydantic import Field

from jaxrl.envs.common import NAMES, SplitTasksetConfig, draw_split, scripted_user, similarity
from jaxrl.envs.harness import LocalChatHarness

SYSTEM_PROMPT = "You keep a list of names sorted alphabetically. Always reply with the full sorted list, one name per line, and nothing else."


def first_message(names: list[str]) -> str:
    return "Sort these names:\n" + "\n".join(names)


def follow_up_message(names: list[str]) -> str:
    return "Add these names and reply with the full sorted list:\n" + "\n".join(names)


def parse_names(reply: str) -> list[str]:
    """The names of a reply, one per non-empty line."""
    return [line.strip() for line in reply.splitlines() if line.strip()]


class AlphabetSortData(vf.TaskData):
    turns: list[list[str]]
    """The names each user turn adds, in order (the first turn is the prompt)."""

    def expected(self) -> list[list[str]]:
        """The correct reply after each user turn: every name so far, sorted."""
        seen: list[str] = []
        out = []
        for names in self.turns:
            seen = seen + names
            out.append(sorted(seen))
        return out


class AlphabetSortTask(vf.Task[AlphabetSortData]):
    @vf.reward(weight=1.0)
    async def sorted_turns(self, trace: vf.Trace) -> float:
        """Mean over user turns of the reply's list similarity to the expected list."""
        replies = [parse_names(m.content or "") for m in trace.assistant_messages]
        expected = self.data.expected()
        return sum(similarity(r, e) for r, e in zip(replies, expected)) / len(expected)

    @vf.metric
    async def turns_correct(self, trace: vf.Trace) -> float:
        """Fraction of user turns answered exactly right."""
        replies = [parse_names(m.content or "") for m in trace.assistant_messages]
        expected = self.data.expected()
        return sum(r == e for r, e in zip(replies, expected)) / len(expected)


class AlphabetSortConfig(SplitTasksetConfig):
    min_turns: int = Field(1, ge=1)
    """Fewest user turns per task."""
    max_turns: int = Field(3, ge=1)
    """Most user turns per task."""
    first_names: int = Field(3, ge=1)
    """Names in the first user turn."""
    names_per_turn: int = Field(1, ge=1)
    """Names each later user turn adds."""


class AlphabetSortTaskset(vf.Taskset[AlphabetSortTask, AlphabetSortConfig]):
    def load(self) -> list[AlphabetSortTask]:
        cfg = self.config
        if cfg.max_turns < cfg.min_turns:
            raise ValueError(f"alphabet_sort: max_turns={cfg.max_turns} < min_turns={cfg.min_turns}")

        def sample(rng: random.Random) -> tuple[tuple[str, ...], ...]:
            n_turns = rng.randint(cfg.min_turns, cfg.max_turns)
            names = rng.sample(NAMES, cfg.first_names + (n_turns - 1) * cfg.names_per_turn)
            turns = [names[: cfg.first_names]]
            for i in range(n_turns - 1):
                start = cfg.first_names + i * cfg.names_per_turn
                turns.append(names[start : start + cfg.names_per_turn])
            return tuple(tuple(t) for t in turns)

        items = draw_split(
            sample,
            lambda t: "|".join(",".join(n) for n in t),
            split=cfg.split,
            num=cfg.size,
            seed=cfg.seed,
            name="alphabet_sort",
        )
        return [
            AlphabetSortTask(
                AlphabetSortData(
                    prompt=first_message(list(turns[0])),
                    system_prompt=SYSTEM_PROMPT,
                    turns=[list(t) for t in turns],
                ),
                cfg.task,
            )
            for turns in items
        ]


class AlphabetSortEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The one seat: the policy, driven turn by turn by the scripted user."""


class AlphabetSortEnv(vf.Env[AlphabetSortEnvConfig]):
    """The scripted user: the prompt opens, then one follow-up per remaining turn."""

    async def run(self, task: AlphabetSortTask, agents: vf.Agents) -> None:
        await scripted_user(task, agents, [follow_up_message(names) for names in task.data.turns[1:]])


__all__ = ["AlphabetSortEnv", "AlphabetSortTaskset", "LocalChatHarness"]

"""Which task each group runs: envs in proportion to their `ratio` (equal ratios: in turn), each
env's tasks in a seeded shuffled order, reshuffled every epoch. The sampler's state is a small
dict saved in every checkpoint."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


class TaskSampler:
    def __init__(
        self, tasks: dict[str, Sequence[dict[str, Any]]], seed: int, ratios: dict[str, float] | None = None
    ):
        empty = [name for name, ts in tasks.items() if not ts]
        if empty:
            raise ValueError(f"env(s) {empty} loaded no tasks; check their `args` (num_tasks, split)")
        self.tasks = {name: list(ts) for name, ts in tasks.items()}
        self.seed = seed
        self.envs = list(self.tasks)
        self.turn = 0  # index into envs of the next group
        self.cursor = {name: 0 for name in self.envs}  # tasks drawn so far, per env
        ratios = ratios or {}
        total = sum(ratios.get(name, 1.0) for name in self.envs)
        self.share = {name: ratios.get(name, 1.0) / total for name in self.envs}

    def _next_env(self) -> str:
        """The env furthest behind its share after this draw (ties: config order). Depends only
        on the counts drawn so far, so a restored state continues the same schedule."""
        after = self.turn + 1
        return max(self.envs, key=lambda name: self.share[name] * after - self.cursor[name])

    def _order(self, name: str, epoch: int) -> list[int]:
        order = list(range(len(self.tasks[name])))
        random.Random(f"{self.seed}/{name}/{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[str, dict[str, Any]]:
        """(env name, task wire data) of the next group."""
        name = self._next_env()
        self.turn += 1
        n = len(self.tasks[name])
        epoch, pos = divmod(self.cursor[name], n)
        self.cursor[name] += 1
        return name, self.tasks[name][self._order(name, epoch)[pos]]

    def state_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "cursor": dict(self.cursor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["cursor"]) != set(self.envs):
            raise ValueError(
                f"checkpointed task sampler has envs {sorted(state['cursor'])}, this run has {sorted(self.envs)}"
            )
        self.turn, self.cursor = int(state["turn"]), {k: int(v) for k, v in state["cursor"].items()}

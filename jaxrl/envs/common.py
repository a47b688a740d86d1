"""Pieces the built-in tasksets share: seeded offline generation, held-out splits, scoring.

Every built-in taskset is generated on the fly from a seed, so it runs with no network and
no data files. Train and eval never overlap: an item's split is a fixed function of its
content (a hash), independent of the seed, so any train seed and any eval seed draw from
disjoint pools.
"""

from __future__ import annotations

import difflib
import hashlib
import random
from collections.abc import Callable, Hashable, Sequence
from typing import Literal, TypeVar

import verifiers.v1 as vf
from pydantic import Field

T = TypeVar("T", bound=Hashable)

EVAL_PERCENT = 10
"""Share of every taskset's item space (by content hash) that belongs to the eval split."""

WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "tiger",
    "music",
    "paper",
    "light",
    "house",
    "water",
    "bread",
    "chair",
    "plant",
    "ocean",
    "night",
    "smile",
    "train",
    "heart",
    "glass",
    "storm",
    "field",
    "dream",
    "honey",
    "lemon",
    "mouse",
    "piano",
    "quiet",
    "robot",
    "sugar",
    "table",
    "under",
    "voice",
    "whale",
    "young",
    "zebra",
    "amber",
    "brick",
    "candy",
    "daisy",
    "eagle",
    "flame",
    "grape",
    "hotel",
    "igloo",
    "jelly",
    "koala",
    "llama",
    "mango",
    "noble",
    "olive",
    "pearl",
    "queen",
    "radio",
    "salad",
    "tulip",
    "unity",
    "vivid",
    "wagon",
    "yacht",
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "fish",
    "bird",
    "book",
    "door",
    "fire",
    "gold",
    "hill",
    "iron",
    "jazz",
    "kite",
    "lake",
    "milk",
    "nest",
    "oak",
    "pink",
    "rain",
    "salt",
    "tea",
    "vase",
    "wind",
    "yarn",
    "zinc",
    "blue",
    "cold",
    "dust",
    "echo",
    "frog",
    "gift",
    "hat",
    "ink",
    "jam",
    "key",
    "leaf",
    "map",
    "nut",
)
"""A fixed vocabulary of short lowercase words (100 distinct), the raw material of the tasks."""

NAMES = (
    "Alice",
    "Bruno",
    "Chloe",
    "Diego",
    "Emma",
    "Felix",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kara",
    "Liam",
    "Maya",
    "Nico",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wade",
    "Xena",
    "Yusuf",
    "Zoe",
    "Aaron",
    "Bella",
    "Carl",
    "Dana",
    "Eli",
    "Fiona",
    "Gus",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Milo",
    "Nora",
)
"""Distinct capitalised first names for the sorting tasks."""


def stable_hash(key: str) -> int:
    """A process-independent hash (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def split_of(key: str) -> Literal["train", "eval"]:
    """The split an item belongs to, from its content alone."""
    return "eval" if stable_hash(key) % 100 < EVAL_PERCENT else "train"


def draw_split(
    sample: Callable[[random.Random], T],
    key: Callable[[T], str],
    *,
    split: Literal["train", "eval"],
    num: int,
    seed: int,
    name: str,
    max_draws_per_item: int = 1000,
) -> list[T]:
    """`num` distinct items of `split`, drawn with a RNG seeded by (name, split, seed).

    Deterministic: the same arguments always give the same list in the same order. Raises
    when the item space is too small to hold `num` distinct items of the split.
    """
    rng = random.Random(f"{name}/{split}/{seed}")
    items: list[T] = []
    seen: set[str] = set()
    for _ in range(num * max_draws_per_item):
        if len(items) == num:
            return items
        item = sample(rng)
        k = key(item)
        if k in seen or split_of(k) != split:
            continue
        seen.add(k)
        items.append(item)
    if len(items) == num:
        return items
    raise ValueError(
        f"{name}: could only draw {len(items)} distinct {split} tasks, asked for num_tasks={num}; "
        "lower num_tasks or widen the generator's ranges"
    )


async def scripted_user(task: vf.Task, agents: vf.Agents, follow_ups: Sequence[str]) -> None:
    """One seat driven by a scripted user (multi-turn tasksets' ``Env.run``): the task's prompt
    opens, then each follow-up message is a user turn, until the policy's episode terminates."""
    async with agents.agent.interaction(task) as chat:
        segment = await chat.turn()
        for message in follow_ups:
            if segment.terminated:
                break
            segment = await chat.turn(message)


def similarity(a: Sequence, b: Sequence) -> float:
    """Longest-matching-blocks similarity in [0, 1] (difflib ratio; 1.0 iff equal)."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


class SplitTasksetConfig(vf.TasksetConfig):
    """Knobs every built-in taskset shares (set under `[orchestrator.*.env] args`)."""

    split: Literal["train", "eval"] = "train"
    """Which split to generate; eval items never appear in train, whatever the seeds."""
    num_tasks: int | None = Field(None, ge=1)
    """How many distinct tasks `load()` yields (None: 1000 for train, 100 for eval)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same tasks in the same order."""

    @property
    def size(self) -> int:
        """`num_tasks`, or the split's default."""
        if self.num_tasks is not None:
            return self.num_tasks
        return 1000 if self.split == "train" else 100

"""lookup: multi-turn with a tool — fetch codes with `lookup(key)`, then answer.

The tool's output is a deterministic, learnable function of its argument (each letter of
the word shifted along the alphabet), so a model can learn to predict what the tool says
back — exactly what the echo loss trains. With `shifts = 1` (the default) every task shifts
by one place, so a model can also learn to answer without the tool; with `shifts > 1` each
task shifts by its own hidden amount (1..shifts, never shown to the model), so the answer
needs what the tool returned, while the tool's output stays learnable once its first letter
is seen. Rewards: the reply's similarity to the codes (weight 0.75) and whether every key
was looked up (weight 0.25).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable

import verifiers.v1 as vf
from pydantic import Field, model_validator

from jaxrl.envs.common import SplitTasksetConfig, draw_split, similarity
from jaxrl.envs.harness import LocalChatHarness, ToolTaskData, tool_spec

SYSTEM_PROMPT = (
    "You answer questions about secret codes. Call the lookup tool once for each word, "
    "then reply with the codes only, separated by single spaces, in the order asked."
)

MAX_SHIFT = 25
"""Largest hidden shift: 26 would give the word back."""


def code(key: str, shift: int = 1) -> str:
    """The code of a word: each letter moved `shift` places along the alphabet (wrapping)."""
    letters = string.ascii_lowercase
    return key.lower().translate(str.maketrans(letters, letters[shift:] + letters[:shift]))


def _lookup_tool(shift: int) -> Callable[[str], str]:
    """The `lookup` tool of tasks whose hidden shift is `shift`: every variant is named `lookup`
    with the same signature and docstring, so the model sees one and the same tool."""

    def lookup(key: str) -> str:
        """Return the secret code of a word."""
        return code(key, shift)

    lookup.__qualname__ = "lookup"  # what a bad call's error names, as for a plain function
    return lookup


lookup = _lookup_tool(1)
# The harness resolves a task's tools by import path and offers them by `__name__`, so each hidden
# shift is a module attribute `lookup_shift<N>` whose function is still named `lookup`.
globals().update({f"lookup_shift{s}": _lookup_tool(s) for s in range(2, MAX_SHIFT + 1)})


def tool_path(shift: int) -> str:
    """Import path of the `lookup` tool for a hidden shift."""
    return f"{__name__}:lookup" if shift == 1 else f"{__name__}:lookup_shift{shift}"


def question(keys: list[str]) -> str:
    quoted = ", ".join(f"'{k}'" for k in keys)
    return f"What are the codes of {quoted}?" if len(keys) > 1 else f"What is the code of {quoted}?"


def reference_conversation(data: LookupData) -> tuple[list[dict], list[dict]]:
    """The ideal episode (look every key up, then answer) and its tool specs: SFT warm-start data."""
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": k})}}
        for i, k in enumerate(data.keys)
    ]
    messages: list[dict] = [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "name": "lookup", "content": code(k, data.shift)} for c, k in zip(calls, data.keys)),
        {"role": "assistant", "content": data.answer},
    ]
    return messages, [tool_spec(lookup)]


class LookupData(ToolTaskData):
    keys: list[str]
    """The words whose codes are asked, in order."""
    answer: str
    """The expected reply: the codes joined by single spaces."""
    shift: int = Field(1, ge=1, le=MAX_SHIFT)
    """The task's hidden shift (what its `lookup` tool applies); never shown to the model."""


class LookupTask(vf.Task[LookupData]):
    @vf.reward(weight=0.75)
    async def answer_similarity(self, trace: vf.Trace) -> float:
        """Similarity of the final reply to the expected codes, in [0, 1]."""
        return similarity(trace.last_reply, self.data.answer)

    @vf.reward(weight=0.25)
    async def looked_up(self, trace: vf.Trace) -> float:
        """Fraction of the asked keys whose code the tool returned."""
        outputs = {m.content for m in trace.tool_messages if m.name == "lookup"}
        return sum(code(k, self.data.shift) in outputs for k in self.data.keys) / len(self.data.keys)


class LookupConfig(SplitTasksetConfig):
    max_keys: int = Field(1, ge=1)
    """Most words asked per task (each task asks 1..max_keys distinct words)."""
    min_len: int = Field(3, ge=1)
    """Shortest word (words are random lowercase letters)."""
    max_len: int = Field(6, ge=1)
    """Longest word."""
    alphabet_size: int = Field(26, ge=2, le=26)
    """Letters the words are drawn from: the first `alphabet_size` of a-z. Fewer letters make
    random keys easier to guess, never the answer easier to know without the tool: the code is
    still each letter shifted along the full alphabet."""
    shifts: int = Field(1, ge=1, le=MAX_SHIFT)
    """Each task's code shifts its letters by a hidden amount drawn from 1..`shifts`. 1: always one
    place, learnable without the tool; > 1: the answer needs what the tool returned."""

    @model_validator(mode="after")
    def _lengths(self) -> LookupConfig:
        if self.max_len < self.min_len:
            raise ValueError(f"lookup: max_len={self.max_len} < min_len={self.min_len}; set max_len >= min_len")
        return self


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    def load(self) -> list[LookupTask]:
        cfg = self.config
        letters = string.ascii_lowercase[: cfg.alphabet_size]

        def word(rng: random.Random) -> str:
            return "".join(rng.choice(letters) for _ in range(rng.randint(cfg.min_len, cfg.max_len)))

        def sample(rng: random.Random) -> tuple[tuple[str, ...], int]:
            keys = tuple(dict.fromkeys(word(rng) for _ in range(rng.randint(1, cfg.max_keys))))
            # drawn only when it can vary, so `shifts = 1` keeps the tasks it always had
            return keys, (rng.randint(1, cfg.shifts) if cfg.shifts > 1 else 1)

        items = draw_split(sample, lambda item: " ".join(item[0]), split=cfg.split, num=cfg.size, seed=cfg.seed,
                           name="lookup")
        return [
            LookupTask(
                LookupData(
                    prompt=question(list(keys)),
                    system_prompt=SYSTEM_PROMPT,
                    tools=[tool_path(shift)],
                    keys=list(keys),
                    answer=" ".join(code(k, shift) for k in keys),
                    shift=shift,
                ),
                cfg.task,
            )
            for keys, shift in items
        ]


__all__ = ["LocalChatHarness", "LookupTaskset"]

"""reverse_text: single turn — reverse a short text character by character.

The reward is the similarity (difflib ratio, as prime-rl's reverse_text example uses an LCS
ratio) between the model's reply and the reversed text: dense, so even a tiny model gets a
gradient, and 1.0 only for the exact reversal.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from pydantic import Field

from jaxrl.envs.common import WORDS, SplitTasksetConfig, draw_split, similarity
from jaxrl.envs.harness import LocalChatHarness

SYSTEM_PROMPT = "Reverse the text character by character."
"""Short on purpose: every token of it is prefilled for every rollout and SFT example."""


class ReverseTextData(vf.TaskData):
    answer: str
    """The reversed text."""


def reference_conversation(data: ReverseTextData) -> tuple[list[dict], list[dict]]:
    """The ideal episode (the exact reversal) and its tool specs (none): SFT warm-start data."""
    messages = [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": data.answer},
    ]
    return messages, []


class ReverseTextTask(vf.Task[ReverseTextData]):
    @vf.reward(weight=1.0)
    async def reversed_similarity(self, trace: vf.Trace) -> float:
        """Similarity of the final reply to the reversed text, in [0, 1]."""
        return similarity(trace.last_reply, self.data.answer)


class ReverseTextConfig(SplitTasksetConfig):
    min_words: int = Field(1, ge=1)
    """Fewest words in a text."""
    max_words: int = Field(2, ge=1)
    """Most words in a text (words are joined by single spaces)."""


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    def load(self) -> list[ReverseTextTask]:
        cfg = self.config
        if cfg.max_words < cfg.min_words:
            raise ValueError(f"reverse_text: max_words={cfg.max_words} < min_words={cfg.min_words}")

        def sample(rng: random.Random) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(rng.randint(cfg.min_words, cfg.max_words)))

        texts = draw_split(
            sample, lambda t: t, split=cfg.split, num=cfg.size, seed=cfg.seed, name="reverse_text"
        )
        return [
            ReverseTextTask(ReverseTextData(prompt=t, system_prompt=SYSTEM_PROMPT, answer=t[::-1]), cfg.task)
            for t in texts
        ]


__all__ = ["LocalChatHarness", "ReverseTextTaskset"]

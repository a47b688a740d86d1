"""needle: single turn, long context — find one fact buried in a long document.

The prompt is a document of `context_words` filler words with one sentence "The code for KEY is
VALUE." at a random depth, then the question "What is the code for KEY?". The reward is the
similarity (difflib ratio) of the reply to VALUE: 1.0 only for the exact code. It is the
retrieval probe long-context evaluations use (needle in a haystack, as in RULER), made a
taskset so RL and its tests run at the context lengths agentic rollouts reach (set
`context_words` for the length you train: about one token per word with Qwen's tokenizer,
about six with jaxrl's character-level test tokenizer).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from pydantic import Field

from jaxrl.envs.common import WORDS, SplitTasksetConfig, draw_split, similarity
from jaxrl.envs.harness import LocalChatHarness

SYSTEM_PROMPT = "Answer with the code only."

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class NeedleData(vf.TaskData):
    answer: str
    """The code the question asks for."""


def reference_conversation(data: NeedleData) -> tuple[list[dict], list[dict]]:
    """The ideal episode (the code alone) and its tool specs (none): SFT warm-start data."""
    messages = [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": data.answer},
    ]
    return messages, []


class NeedleTask(vf.Task[NeedleData]):
    @vf.reward(weight=1.0)
    async def code_similarity(self, trace: vf.Trace) -> float:
        """Similarity of the final reply to the code, in [0, 1]."""
        return similarity(trace.last_reply.strip(), self.data.answer)


class NeedleConfig(SplitTasksetConfig):
    context_words: int = Field(1000, ge=1, le=1_000_000)
    """Filler words in the document (its length; the needle sentence and question come on top)."""
    key_len: int = Field(4, ge=1, le=16)
    """Letters in the key the question names."""
    code_len: int = Field(4, ge=1, le=16)
    """Letters in the code to answer."""


class NeedleTaskset(vf.Taskset[NeedleTask, NeedleConfig]):
    def load(self) -> list[NeedleTask]:
        cfg = self.config

        def sample(rng: random.Random) -> tuple[str, str, int, int]:
            key = "".join(rng.choice(ALPHABET) for _ in range(cfg.key_len))
            code = "".join(rng.choice(ALPHABET) for _ in range(cfg.code_len))
            return key, code, rng.randrange(cfg.context_words + 1), rng.randrange(2**31)

        drawn = draw_split(sample, lambda item: item[0], split=cfg.split, num=cfg.size, seed=cfg.seed, name="needle")
        tasks = []
        for key, code, depth, filler_seed in drawn:
            rng = random.Random(filler_seed)
            words = [rng.choice(WORDS) for _ in range(cfg.context_words)]
            words.insert(depth, f"The code for {key} is {code}.")
            prompt = " ".join(words) + f"\n\nWhat is the code for {key}?"
            tasks.append(NeedleTask(NeedleData(prompt=prompt, system_prompt=SYSTEM_PROMPT, answer=code), cfg.task))
        return tasks


__all__ = ["LocalChatHarness", "NeedleTaskset"]

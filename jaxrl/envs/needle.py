"""needle: long context, multi-turn — find facts buried in a long document.

The prompt is a document of `context_words` filler words with `questions` sentences "The code
for KEY is VALUE." at random depths, then the question "What is the code for KEY?" for the first
key; each later user turn (scripted by `NeedleEnv`) asks for the next key, so every turn attends
over the whole growing conversation. The reward is the mean over questions of the similarity
(difflib ratio) of the reply to its code: 1.0 only for every code exact; a question never
answered scores 0. It is the retrieval probe long-context evaluations use (needle in a
haystack, as in RULER), made a taskset so RL and its tests run at the context lengths agentic
rollouts reach (set `context_words` for the length you train: about one token per word with
Qwen's tokenizer, about six with jaxrl's character-level test tokenizer).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf
from pydantic import Field

from jaxrl.envs.common import WORDS, SplitTasksetConfig, draw_split, scripted_user, similarity
from jaxrl.envs.harness import LocalChatHarness

SYSTEM_PROMPT = "Answer with the code only."

ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def question(key: str) -> str:
    return f"What is the code for {key}?"


class NeedleData(vf.TaskData):
    keys: list[str]
    """The keys asked for, one per user turn (the first is in the prompt)."""
    answers: list[str]
    """Their codes, in the same order."""


def reference_conversation(data: NeedleData) -> tuple[list[dict], list[dict]]:
    """The ideal episode (each code alone) and its tool specs (none): SFT warm-start data."""
    messages = [{"role": "system", "content": data.system_prompt}, {"role": "user", "content": data.prompt}]
    for i, answer in enumerate(data.answers):
        if i:
            messages.append({"role": "user", "content": question(data.keys[i])})
        messages.append({"role": "assistant", "content": answer})
    return messages, []


class NeedleTask(vf.Task[NeedleData]):
    @vf.reward(weight=1.0)
    async def code_similarity(self, trace: vf.Trace) -> float:
        """Mean over questions of the reply's similarity to its code, in [0, 1]."""
        replies = [(m.content or "").strip() for m in trace.assistant_messages]
        return sum(similarity(r, a) for r, a in zip(replies, self.data.answers)) / len(self.data.answers)


class NeedleConfig(SplitTasksetConfig):
    context_words: int = Field(1000, ge=1, le=1_000_000)
    """Filler words in the document (its length; the needle sentence and question come on top)."""
    key_len: int = Field(4, ge=1, le=16)
    """Letters in the key the question names."""
    code_len: int = Field(4, ge=1, le=16)
    """Letters in the code to answer."""
    questions: int = Field(1, ge=1, le=16)
    """Facts buried in the document, asked for one per user turn."""


class NeedleTaskset(vf.Taskset[NeedleTask, NeedleConfig]):
    def load(self) -> list[NeedleTask]:
        cfg = self.config

        def sample(rng: random.Random) -> tuple[tuple[str, ...], tuple[str, ...], int]:
            keys: list[str] = []
            while len(keys) < cfg.questions:  # distinct keys: each question has one answer
                key = "".join(rng.choice(ALPHABET) for _ in range(cfg.key_len))
                keys += [key] if key not in keys else []
            codes = tuple("".join(rng.choice(ALPHABET) for _ in range(cfg.code_len)) for _ in keys)
            return tuple(keys), codes, rng.randrange(2**31)

        drawn = draw_split(sample, lambda item: ",".join(item[0]), split=cfg.split, num=cfg.size, seed=cfg.seed,
                           name="needle")  # fmt: skip
        tasks = []
        for keys, codes, filler_seed in drawn:
            rng = random.Random(filler_seed)
            words = [rng.choice(WORDS) for _ in range(cfg.context_words)]
            for key, code in zip(keys, codes, strict=True):
                words.insert(rng.randrange(len(words) + 1), f"The code for {key} is {code}.")
            data = NeedleData(prompt=" ".join(words) + "\n\n" + question(keys[0]), system_prompt=SYSTEM_PROMPT,
                              keys=list(keys), answers=list(codes))  # fmt: skip
            tasks.append(NeedleTask(data, cfg.task))
        return tasks


class NeedleEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The one seat: the policy, asked one question per turn."""


class NeedleEnv(vf.Env[NeedleEnvConfig]):
    """The scripted user: the document and the first question open, then one question per turn."""

    async def run(self, task: NeedleTask, agents: vf.Agents) -> None:
        await scripted_user(task, agents, [question(key) for key in task.data.keys[1:]])


__all__ = ["LocalChatHarness", "NeedleEnv", "NeedleTaskset"]

"""SFT data: reference conversations of a built-in taskset -> rendered samples, via grain.

Conversations are rendered with the `renderers` Qwen3 renderer (``build_training_sample``),
the same renderer the env servers use for RL rollouts, so an SFT warm start trains on exactly
the token layout that RL will sample. The loss mask is the renderer's "sampled" mask: the
assistant turns' tokens (CE weight 1), nothing else.

The pipeline is a grain ``MapDataset`` (shuffle -> repeat -> render -> batch); its iterator
state is a small dict that goes into every checkpoint, so a resumed run sees the same batches.
"""

from __future__ import annotations

import importlib
import typing
from typing import Any

import grain
from transformers import AutoTokenizer

from jaxrl.samples import TrainingSample

Message = dict[str, Any]


def reference_conversations(taskset: str, args: dict[str, Any], num: int, seed: int) -> list[list[Message]]:
    """``num`` train-split conversations (system, user, reference answer) of a built-in taskset.

    Single-turn tasksets only: their task data carries ``prompt``, ``system_prompt`` and
    ``answer`` (the reference reply). A multi-turn taskset has no single reference reply.
    """
    from jaxrl.envs import BUILTIN_ENVS

    if taskset not in BUILTIN_ENVS:
        raise ValueError(f"data.taskset = {taskset!r}: expected one of {sorted(BUILTIN_ENVS)}")
    module = importlib.import_module(BUILTIN_ENVS[taskset])
    taskset_cls = next(getattr(module, n) for n in module.__all__ if n.endswith("Taskset"))
    _, config_cls = typing.get_args(taskset_cls.__orig_bases__[0])  # vf.Taskset[Task, Config]
    tasks = list(taskset_cls(config_cls(split="train", num_tasks=num, seed=seed, **args)))
    out = []
    for task in tasks:
        data = task.data
        if not isinstance(getattr(data, "prompt", None), str) or not hasattr(data, "answer"):
            raise ValueError(f"data.taskset = {taskset!r} has no single-turn reference answers for SFT")
        conv: list[Message] = []
        if data.system_prompt:
            conv.append({"role": "system", "content": data.system_prompt})
        conv += [{"role": "user", "content": data.prompt}, {"role": "assistant", "content": data.answer}]
        out.append(conv)
    return out


class RenderConversation(grain.transforms.Map):
    """Conversation -> ``TrainingSample`` with CE weight on the model's own (sampled) tokens."""

    def __init__(self, tokenizer_dir: str):
        self.tokenizer_dir = tokenizer_dir
        self._renderer = None

    def map(self, conversation: list[Message]) -> TrainingSample:
        from renderers import Qwen3RendererConfig, build_training_sample, create_renderer

        if self._renderer is None:  # built lazily: grain may pickle transforms into workers
            tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            self._renderer = create_renderer(tok, Qwen3RendererConfig(enable_thinking=False))
        rendered = build_training_sample(self._renderer, conversation)
        return TrainingSample.sft(rendered.token_ids, rendered.loss_mask)


def sft_dataset(
    conversations: list[list[Message]], tokenizer_dir: str, batch_size: int, seed: int
) -> grain.MapDataset:
    """Infinite, shuffled (re-shuffled each epoch), batched ``list[TrainingSample]`` dataset."""
    return (
        grain.MapDataset.source(conversations)
        .shuffle(seed=seed)
        .repeat()
        .map(RenderConversation(tokenizer_dir))
        .batch(batch_size, batch_fn=list)
    )

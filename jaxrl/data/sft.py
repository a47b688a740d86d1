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
Example = tuple[list[Message], list[dict[str, Any]]]  # (messages, tool specs)


def reference_conversations(taskset: str, args: dict[str, Any], num: int, seed: int) -> list[Example]:
    """``num`` train-split reference episodes (messages, tool specs) of a built-in taskset.

    Each built-in env module that supports SFT defines ``reference_conversation(task_data)``:
    the ideal episode for a task (for tool envs: the tool calls, their outputs and the answer).
    """
    from jaxrl.envs import BUILTIN_ENVS

    if taskset not in BUILTIN_ENVS:
        raise ValueError(f"data.taskset = {taskset!r}: expected one of {sorted(BUILTIN_ENVS)}")
    module = importlib.import_module(BUILTIN_ENVS[taskset])
    make = getattr(module, "reference_conversation", None)
    if make is None:
        raise ValueError(f"data.taskset = {taskset!r} has no reference conversations for SFT")
    taskset_cls = next(getattr(module, n) for n in module.__all__ if n.endswith("Taskset"))
    _, config_cls = typing.get_args(taskset_cls.__orig_bases__[0])  # vf.Taskset[Task, Config]
    try:
        config = config_cls(split="train", num_tasks=num, seed=seed, **args)
    except Exception as e:  # pydantic names the bad field
        raise ValueError(f"data.taskset_args for {taskset!r}: {e}") from e
    return [make(task.data) for task in taskset_cls(config)]


class RenderConversation(grain.transforms.Map):
    """Conversation -> ``TrainingSample`` with CE weight on the model's own (sampled) tokens."""

    def __init__(self, tokenizer_dir: str):
        self.tokenizer_dir = tokenizer_dir
        self._renderer = None

    def map(self, example: Example) -> TrainingSample:
        from renderers import Qwen3RendererConfig, build_training_sample, create_renderer

        if self._renderer is None:  # built lazily: grain may pickle transforms into workers
            tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            self._renderer = create_renderer(tok, Qwen3RendererConfig(enable_thinking=False))
        messages, tools = example
        rendered = build_training_sample(self._renderer, messages, tools=tools or None)
        return TrainingSample.sft(rendered.token_ids, rendered.loss_mask)


def sft_dataset(
    conversations: list[Example], tokenizer_dir: str, batch_size: int, seed: int
) -> grain.MapDataset:
    """Infinite, shuffled (re-shuffled each epoch), batched ``list[TrainingSample]`` dataset."""
    return (
        grain.MapDataset.source(conversations)
        .shuffle(seed=seed)
        .repeat()
        .map(RenderConversation(tokenizer_dir))
        .batch(batch_size, batch_fn=list)
    )

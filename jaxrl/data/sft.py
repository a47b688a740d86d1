"""SFT data: reference conversations of a built-in taskset -> rendered samples, via grain.

Conversations are rendered with the run's `renderers` renderer (``[model] renderer``, through
``build_training_sample``), the same renderer the env servers use for RL rollouts, so an SFT warm start trains on exactly
the token layout that RL will sample. The loss mask is the renderer's "sampled" mask: the
assistant turns' tokens (CE weight 1), nothing else.

The pipeline is a grain ``MapDataset`` (shuffle -> repeat -> render -> batch); its iterator
state is a small dict that goes into every checkpoint, so a resumed run sees the same batches.
"""

from __future__ import annotations

import importlib
import typing
from collections.abc import Sequence
from typing import Any, Literal

import grain
from transformers import AutoTokenizer

from jaxrl.models.renderer import RendererSpec, create_renderer
from jaxrl.training_sample import TrainingSample

Message = dict[str, Any]
Example = tuple[list[Message], list[dict[str, Any]]]  # (messages, tool specs)


def reference_conversations(
    taskset: str, args: dict[str, Any], num: int, seed: int, split: Literal["train", "eval"] = "train"
) -> list[Example]:
    """``num`` reference episodes (messages, tool specs) of a built-in taskset's ``split``; the
    eval split never holds a train task, so it measures held-out loss.

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
        config = config_cls(split=split, num_tasks=num, seed=seed, **args)
    except Exception as e:  # pydantic names the bad field
        raise ValueError(f"data.taskset_args for {taskset!r}: {e}") from e
    return [make(task.data) for task in taskset_cls(config)]


class RenderConversation(grain.transforms.Map):
    """Conversation -> ``TrainingSample`` with CE weight on the model's own (sampled) tokens."""

    def __init__(self, tokenizer_dir: str, renderer: RendererSpec, content_roles: Sequence[str] = ()):
        self.tokenizer_dir = tokenizer_dir
        self.renderer = dict(renderer)
        self.content_roles = frozenset(content_roles)
        self._renderer = None

    def map(self, example: Example) -> TrainingSample:
        if self._renderer is None:  # built lazily: grain may pickle transforms into workers
            self._renderer = create_renderer(AutoTokenizer.from_pretrained(self.tokenizer_dir), self.renderer)
        messages, tools = example
        token_ids, loss_mask = render_for_sft(self._renderer, messages, tools, self.content_roles)
        return TrainingSample.sft(token_ids, loss_mask)


def render_for_sft(
    renderer: Any, messages: list[Message], tools: list[dict[str, Any]], content_roles: frozenset[str] = frozenset()
) -> tuple[list[int], list[bool]]:
    """(token ids, loss mask): the loss is on the tokens the model samples in its assistant turns,
    and on the content tokens (the renderer's ``is_content``) of ``content_roles`` messages.

    Renderers with sampled-token attribution (qwen3, llama-3, ...) give that mask directly. The
    ``default`` renderer (a chat template rendered verbatim, e.g. Qwen2.5) attributes whole
    message spans, so there each assistant span loses the tokens its generation prompt already
    holds (``<|im_start|>assistant\n``): the model never samples those.
    """
    from renderers import build_training_sample

    rendered = renderer.render(messages, tools=tools or None)
    if len(rendered.sampled_mask) == len(rendered.token_ids):
        sample = build_training_sample(renderer, messages, tools=tools or None, content_sft_roles=content_roles or None)
        return list(sample.token_ids), [bool(m) for m in sample.loss_mask]
    if content_roles:
        raise ValueError(
            f"data.content_roles = {sorted(content_roles)}: renderer {getattr(renderer.config, 'name', '?')!r} has no content "
            "attribution; "
            "name a family renderer in [model] renderer"
        )
    mask = [False] * len(rendered.token_ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = renderer.render_ids(messages[:i], tools=tools or None, add_generation_prompt=True)
        for t, owner in enumerate(rendered.message_indices):
            mask[t] = mask[t] or (owner == i and t >= len(prompt))
    return list(rendered.token_ids), mask


# How far ahead the training loop's batches are rendered. grain's defaults (16 threads, 500
# elements) are sized for reading records from disk; here an element is a whole batch and
# producing it is Python rendering (GIL-bound), so they rendered up to 500 batches nobody asked
# for on the cores the train step runs on: 40 steps of configs/reverse_text/sft.toml took 104.7 s
# (166 s of CPU) with them and 54.9 s (102 s) with these, the same batches (2-core host,
# 2026-11-29). Two threads and eight batches keep a step's batch ready while the device trains.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def sft_dataset(
    conversations: list[Example],
    tokenizer_dir: str,
    renderer: RendererSpec,
    batch_size: int,
    seed: int,
    *,
    content_roles: Sequence[str] = (),
) -> grain.MapDataset:
    """Infinite, shuffled (re-shuffled each epoch), batched ``list[TrainingSample]`` dataset;
    iterate it with ``to_iter_dataset(READ_OPTIONS)``."""
    return (
        grain.MapDataset.source(conversations)
        .shuffle(seed=seed)
        .repeat()
        .map(RenderConversation(tokenizer_dir, renderer, content_roles))
        .batch(batch_size, batch_fn=list)
    )

"""The run's chat template family: one `renderers` config for env servers, SFT and the chat endpoint.

``[model] renderer`` names a ``renderers`` 0.1.12 renderer (``qwen3``, ``llama-3``, ``gpt-oss``,
``default`` ...; validated by renderers' own ``RendererConfig`` union, so an unknown name or a
bad ``renderer_args`` field fails at config time) or ``"auto"``. Auto resolves, in order:

1. renderers' own ``MODEL_RENDERER_MAP`` for the hub id in ``[model] name`` (exact ids only);
2. the checkpoint's ``config.json`` ``model_type`` (``FAMILY_RENDERERS``): fine-tunes and
   jaxrl's own exports keep their family's template, which renderers' id map cannot know;
3. ``default``: the tokenizer's own chat template verbatim (no content attribution, so echo
   falls back to whole message spans), logged as a warning.

Qwen3 renders with thinking off unless ``renderer_args = {enable_thinking = true}``: jaxrl's
tokenizer template and every built-in recipe train the no-thinking layout.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

RendererSpec = dict[str, Any]
"""A `renderers` RendererConfig as a plain dict (``{"name": ..., **fields}``): what verifiers'
``TrainClientConfig.renderer`` takes and what crosses process boundaries."""

FAMILY_RENDERERS: dict[str, RendererSpec] = {
    "qwen3": {"name": "qwen3", "enable_thinking": False},
    "qwen3_moe": {"name": "qwen3", "enable_thinking": False},
    "llama": {"name": "llama-3"},  # Llama 3.x; checked against the tokenizer's special tokens
    # Qwen2.5 has no renderer of its own: its template is rendered verbatim, and its tool calls
    # are the Hermes <tool_call> JSON blocks that renderers' qwen3 parser reads.
    "qwen2": {"name": "default", "tool_parser": "qwen3"},
    "gpt_oss": {"name": "gpt-oss"},
    "gemma4": {"name": "gemma4"},
    "deepseek_v3": {"name": "deepseek-v3"},
}
"""``config.json`` model_type -> renderer, for checkpoints renderers' hub-id map does not list."""


@cache
def _config_classes() -> dict[str, type]:
    """Renderer name -> its typed config class, read from renderers' own ``RendererConfig`` union."""
    import renderers

    union = typing.get_args(renderers.RendererConfig)[0]
    return {cls.model_fields["name"].default: cls for cls in typing.get_args(union)}


def known_renderers() -> tuple[str, ...]:
    """Every renderer name `renderers` accepts."""
    return tuple(sorted(_config_classes()))


def validate_renderer(name: str, args: Mapping[str, Any]) -> None:
    """Config-time check of ``[model] renderer`` / ``renderer_args`` (raises ValueError naming the fix)."""
    if name not in known_renderers():
        raise ValueError(f"model.renderer = {name!r} is not a renderer; known: {', '.join(known_renderers())}")
    if name == "auto":
        return  # args are checked against the renderer auto resolves to
    _typed({"name": name, **args}, field="model.renderer_args")


def _typed(spec: Mapping[str, Any], *, field: str):  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    cls = _config_classes().get(spec.get("name"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"{field}: {spec.get('name')!r} is not a renderer; known: {', '.join(known_renderers())}")
    try:
        return cls.model_validate(dict(spec))
    except ValidationError as e:
        raise ValueError(f"{field} for renderer {spec.get('name')!r}: {e}") from None


def resolve_renderer(
    name: str, args: Mapping[str, Any], *, model_name: str | None, hf_config: Mapping[str, Any], tokenizer: Any
) -> RendererSpec:
    """The concrete renderer config of a run (``auto`` resolved; ``args`` applied and validated)."""
    if name != "auto":
        spec = {"name": name, **args}
    else:
        from renderers.base import MODEL_RENDERER_MAP

        model_type = str(hf_config.get("model_type", ""))
        if model_name in MODEL_RENDERER_MAP:
            spec = {"name": MODEL_RENDERER_MAP[model_name]}
            if spec["name"] == "qwen3":
                spec["enable_thinking"] = False
        elif model_type in FAMILY_RENDERERS and _has_family_tokens(model_type, tokenizer):
            spec = dict(FAMILY_RENDERERS[model_type])
        else:
            logger.warning(
                "model.renderer = 'auto': no renderer for %r (model_type %r); rendering with the tokenizer's "
                "chat template verbatim (no content attribution). Set [model] renderer to name one.",
                model_name, model_type,
            )  # fmt: skip
            spec = {"name": "default"}
        spec |= dict(args)
    return _typed(spec, field="model.renderer_args").model_dump(exclude_unset=False, exclude_none=True)


def model_renderer(model_cfg: Any, hf_config: Mapping[str, Any], tokenizer: Any) -> RendererSpec:
    """The concrete renderer of a ``[model]`` section (``renderer`` with ``auto`` resolved)."""
    return resolve_renderer(
        model_cfg.renderer, model_cfg.renderer_args, model_name=model_cfg.name, hf_config=hf_config, tokenizer=tokenizer
    )


def _has_family_tokens(model_type: str, tokenizer: Any) -> bool:
    """Llama 2 and Llama 3 share model_type "llama": Llama 3's template needs its header tokens."""
    if model_type != "llama":
        return True
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")]
    return all(isinstance(i, int) and i != unk for i in ids)


def template_kwarg_names(spec: Mapping[str, Any]) -> frozenset[str]:
    """The ``chat_template_kwargs`` keys a renderer ``spec`` accepts (its template fields)."""
    import renderers

    return frozenset(renderers.template_field_names(_typed(spec, field="renderer")))


def create_renderer(tokenizer: Any, spec: Mapping[str, Any], chat_template_kwargs: Mapping[str, Any] | None = None):  # type: ignore[no-untyped-def]
    """A `renderers` Renderer for ``tokenizer`` (``chat_template_kwargs`` validated by renderers)."""
    import renderers

    return renderers.create_renderer(tokenizer, _typed(spec, field="renderer"), chat_template_kwargs=chat_template_kwargs)

"""Request and response bodies of the inference HTTP API (DESIGN contract 6).

Requests accept and ignore unknown fields: real clients send extras (``cache_salt``,
``priority``, ``skip_special_tokens``, ``routed_experts_prompt_start``, penalties, ...). The
sampling settings honoured are those of ``jaxrl.inference.sampling.SamplingParams`` plus ``n``
(choice i uses seed + i when a seed is given), ``stop`` strings, ``ignore_eos`` (drop the
tokenizer's EOS from the stop tokens) and ``logprobs``; the rest (penalties, min_p, min_tokens,
...) are accepted and have no effect. Only the sampled token's log-prob is returned
(``top_logprobs`` lists are empty).

The generate response satisfies both parsers in the wild: every log-prob entry carries
``"token": "token_id:<id>"`` (renderers 0.1.12) and ``"token_id": <id>`` (vLLM "tokens" mode),
so ``output_mode`` is accepted and needs no switch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingFields(_Body):
    """Sampling fields shared by every endpoint (vLLM names)."""

    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)  # None: 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False


# -- POST /inference/v1/generate ----------------------------------------------------------------


class GenerateSamplingParams(SamplingFields):
    max_tokens: int | None = Field(None, ge=1)  # None: up to max_model_len
    logprobs: int | None = Field(None, ge=0)  # None: no log-probs in the response


class GenerateRequest(_Body):
    model: str | None = None
    token_ids: list[StrictInt]
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    output_mode: str | None = None
    request_id: str | None = None


class TokenLogprob(BaseModel):
    token: str  # "token_id:<id>"
    token_id: int
    logprob: float


class GenerateLogprobs(BaseModel):
    content: list[TokenLogprob]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}


class GenerateChoice(BaseModel):
    index: int
    token_ids: list[int]  # the matched stop token included
    logprobs: GenerateLogprobs | None
    finish_reason: Literal["stop", "length", "abort"]
    policy_version: int
    policy_version_final: int


class GenerateResponse(BaseModel):
    request_id: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]
    usage: Usage


# -- POST /v1/chat/completions --------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    stream: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_ids: bool = False


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: dict[str, Any]  # {"role": "assistant", "content": ..., "tool_calls": [...]}
    logprobs: dict[str, list[ChatLogprob]] | None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"]
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


# -- POST /v1/completions -------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[StrictInt]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    stream: bool = False


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"]
    token_ids: list[int]


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# -- weights, models ---------------------------------------------------------------------------------


class UpdateWeightsRequest(_Body):
    path: str
    """A Hugging Face model directory (config.json + safetensors) with the served architecture."""
    version: int | None = None
    """Policy version to assign (must increase); default: current + 1."""


class UpdateWeightsResponse(BaseModel):
    policy_version: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxrl"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

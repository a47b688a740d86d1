"""Request and response bodies of the inference HTTP API (DESIGN contract 6).

Requests accept and ignore unknown fields: real clients send extras (``cache_salt``,
``priority``, ``skip_special_tokens``, ``routed_experts_prompt_start``, ...). The fields they
name are strict: a boolean is ``true`` / ``false`` (never ``0`` or ``"yes"``), a number is a JSON
number (an integer field also takes ``35.0``, as JSON Schema's integer does). Chat's
``tool_choice`` ("auto" or "none": calls are not parsed) and ``response_format`` (``{"type":
"text"}``) take only what this server does: a named or required tool choice and JSON output need
constrained decoding, which it does not do, so they are refused, not ignored. ``stream: true``
answers as OpenAI and vLLM do (server-sent events, ``data: [DONE]`` last, usage in a last chunk
when ``stream_options.include_usage``), token by token as the engine samples them
(``streaming``). Every sampling field a request names is honoured or refused, never ignored: those of
``jaxrl.engine.token_sampling.SamplingParams`` (penalties included, with vLLM's semantics and
ranges) plus ``n`` (choice i uses seed + i when a seed is given), ``stop`` strings,
``ignore_eos`` (drop the tokenizer's EOS from the stop tokens) and ``logprobs``; ``min_p`` and
``min_tokens`` are not implemented and accept only their neutral value 0 (the schema says so).
Chat ``top_logprobs`` (with ``logprobs: true``) and completions' ``logprobs`` return that many
most likely tokens per token as vLLM and OpenAI shape them, up to the server's cap
(``inference.backend.max_logprobs``, vLLM's 20 by default; more is a 400 naming the field).

Which distribution a log-prob is of: ``LOGPROBS`` below (also the OpenAPI description).

Every value a request carries is range-checked here, so a bad value is a 400 naming the field
and nothing out of range reaches the engine thread (a ``top_k`` of 2**31 once overflowed an
int32 array there). The range types come from ``jaxrl.sampling_contract``, shared with the config
layer (``[orchestrator.*.sampling]``), so a run cannot configure what the server would refuse.

The generate response satisfies both parsers in the wild: every log-prob entry carries
``"token": "token_id:<id>"`` (renderers 0.1.12) and ``"token_id": <id>`` (vLLM "tokens" mode),
so ``output_mode`` is accepted and needs no switch.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

# The range types live beside the config layer's users, outside jaxrl.engine and jaxrl.serving
# (the orchestrator validates its sampling settings with them and must not import the engine side).
from jaxrl.sampling_contract import (
    JSON_INT64_MAX,
    JSON_INT64_MIN,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    FrequencyPenalty,
    LogprobCount,
    MaxTokens,
    PresencePenalty,
    RepetitionPenalty,
    Seed,
    StopString,
    Temperature,
    TopK,
    TopP,
)

LOGPROBS = """Every returned log-prob is log_softmax(logits' / temperature)[token], where logits'
are the model's logits after the request's penalties (repetition_penalty, then
frequency_penalty, then presence_penalty, with vLLM's semantics and ranges), before top-k /
top-p filtering; temperature 0 (greedy) reports temperature 1. Without penalties that is exactly
what the trainer recomputes (logits / temperature). With penalties it is the distribution the
token was drawn from (vLLM's processed_logprobs also reports post-penalty values): a trainer
scoring logits / temperature sees penalised tokens as off-policy by the penalty."""


class _Body(BaseModel):
    """A request body: unknown fields ignored, known ones strict (no ``0`` for ``false``, no
    ``"5"`` for ``5``): what the schema says is what the server takes."""

    model_config = ConfigDict(extra="ignore", strict=True)


def _json_integer(v: Any) -> Any:
    """JSON Schema's ``integer`` is any number with no fractional part (``35.0`` too); strings
    and booleans stay refused (pydantic's strict int)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _refused_because(reason: str) -> WrapValidator:
    """A field whose values beyond its type are refused with ``reason`` (one line, the field named
    by the error handler) instead of pydantic's bare "input should be ..."."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("unsupported", reason) from None

    return WrapValidator(check)


_JsonInt = BeforeValidator(_json_integer)
TokenId = Annotated[StrictInt, _JsonInt]
"""A token id as JSON Schema's integer; ``server_schema`` bounds it by the served vocabulary."""
N = Annotated[int, Field(ge=1, le=128), _JsonInt]
TopKInt = Annotated[TopK, _JsonInt]
SeedInt = Annotated[Seed, _JsonInt]
MaxTokensInt = Annotated[MaxTokens, _JsonInt]
LogprobCountInt = Annotated[LogprobCount, _JsonInt]
RESERVED_TEMPLATE_KWARGS = ("tokenize", "add_generation_prompt", "tools", "conversation", "messages")


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_EXACT = {float(b): b for b in (JSON_INT64_MIN, JSON_INT64_MAX)}


def _exact_integer_bounds(node: Any) -> None:
    """Integer bounds published as the integers the models enforce. FastAPI writes every bound as
    a double (``2147483647.0``), and a double cannot hold ``JSON_INT64_MIN`` (-(2**63) + 513): the
    schema then said -9.223372036854775e18, above the enforced minimum, so seeds below the
    published minimum were accepted. The int64 bounds are the only ones past 2**53."""
    if isinstance(node, list):
        for item in node:
            _exact_integer_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            for key in _BOUNDS:
                b = node.get(key)
                if isinstance(b, float) and b.is_integer():
                    node[key] = _EXACT.get(b, int(b)) if abs(b) >= 2**53 else int(b)
        for value in node.values():
            _exact_integer_bounds(value)


def server_schema(
    schema: dict[str, Any],
    *,
    vocab_size: int,
    max_model_len: int,
    allow_request_chat_template: bool,
    template_kwargs: Collection[str] | None = None,
    routes_experts: bool = True,
    max_logprobs: int = MAX_LOGPROBS,
) -> dict[str, Any]:
    """``schema`` (the app's OpenAPI document) narrowed to what one server accepts: token ids in
    its vocabulary, a token prompt shorter than ``max_model_len``, ``max_tokens`` below it (a
    prompt holds at least one token), no request-supplied chat template unless allowed, and only
    the ``chat_template_kwargs`` keys its renderer takes (``template_kwargs``; None: any), and no
    ``return_routed_experts: true`` from a dense model (``routes_experts`` False), and at most
    ``max_logprobs`` top log-probs (chat ``top_logprobs``, completions ``logprobs``). The
    server enforces each of these with a 400 naming the field; what no schema can say (prompt +
    max_tokens within max_model_len, a text or chat prompt's token count, a template that fails
    on the given messages) is left to that 400 alone."""
    _exact_integer_bounds(schema)
    defs = schema.get("components", {}).get("schemas", {})
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    prompt = {"type": "array", "items": token, "minItems": 1, "maxItems": max_model_len - 1}

    def variants(prop: dict[str, Any]) -> list[dict[str, Any]]:
        return prop.get("anyOf", [prop])

    for name in ("GenerateSamplingParams", "ChatCompletionRequest", "CompletionRequest"):
        props = defs[name]["properties"]
        for v in variants(props["stop_token_ids"]):
            if v.get("type") == "array":
                v["items"] = token
        for field in ("max_tokens", "max_completion_tokens"):
            for v in variants(props.get(field, {})):
                if v.get("type") == "integer":
                    v["maximum"] = max_model_len - 1
    for name, field in (("ChatCompletionRequest", "top_logprobs"), ("CompletionRequest", "logprobs")):
        for v in variants(defs[name]["properties"].get(field, {})):
            if v.get("type") == "integer":
                v["maximum"] = max_logprobs
    defs["GenerateRequest"]["properties"]["token_ids"].update(prompt)
    for v in variants(defs["CompletionRequest"]["properties"]["prompt"]):
        if v.get("type") == "array":
            v.update(prompt)
    if not allow_request_chat_template:
        chat = defs["ChatCompletionRequest"]["properties"]
        chat["chat_template"] = {"type": "null", "description": "request-supplied chat templates are off on this server"}
        for v in variants(chat["chat_template_kwargs"]):
            if v.get("type") == "object":
                v["propertyNames"] = {"not": {"enum": [*RESERVED_TEMPLATE_KWARGS, "chat_template"]}}
    if template_kwargs is not None:
        keys = sorted(set(template_kwargs) - {*RESERVED_TEMPLATE_KWARGS, "chat_template"})
        for v in variants(defs["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]):
            if v.get("type") == "object":
                v.update({"propertyNames": {"enum": keys}} if keys else {"maxProperties": 0})
    if not routes_experts:
        defs["GenerateSamplingParams"]["properties"]["return_routed_experts"] = {
            "enum": [False, None], "description": "this server's model is dense: it routes no experts"}  # fmt: skip
    return schema


class SamplingFields(_Body):
    """Sampling fields shared by every endpoint (vLLM names)."""

    n: N = 1
    temperature: Temperature | None = None  # None: 1.0
    top_p: TopP | None = None
    top_k: TopKInt | None = None
    seed: SeedInt | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    presence_penalty: PresencePenalty = Field(0.0, description="subtracted once from the logit of every token generated so far (0: off)")
    frequency_penalty: FrequencyPenalty = Field(0.0, description="subtracted from a token's logit once per time it was generated (0: off)")
    repetition_penalty: RepetitionPenalty = Field(
        1.0, description="divides the positive (multiplies the negative) logits of tokens in the prompt or generated so far (1: off)"
    )
    # Not implemented: only the neutral value (which real clients send) is accepted.
    min_p: float = Field(0.0, ge=0, le=0, description="not implemented by this server: only 0 is accepted")
    min_tokens: Annotated[int, _JsonInt] = Field(
        0, ge=0, le=0, description="not implemented by this server: only 0 is accepted"
    )


class StreamOptions(_Body):
    include_usage: bool = False
    """Send the usage in one more chunk (its ``choices`` empty) before ``data: [DONE]``."""


class _Streaming(_Body):
    stream: bool = False
    """Answer as server-sent events (``data: <chunk>``, then ``data: [DONE]``)."""
    stream_options: StreamOptions | None = None
    """Only with ``stream: true`` (as vLLM: refused otherwise, not ignored)."""

    @model_validator(mode="after")
    def _options_need_a_stream(self) -> _Streaming:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self


# -- POST /inference/v1/generate ----------------------------------------------------------------


class GenerateSamplingParams(SamplingFields):
    max_tokens: MaxTokensInt | None = None  # None: up to max_model_len
    logprobs: Annotated[int, Field(ge=0, le=1), _JsonInt] | None = None
    """0 or 1: each completion token's own log-prob in the response (None: none). This endpoint
    returns no top log-probs, so a count above 1 is refused rather than ignored: ask
    ``/v1/completions`` (``logprobs``) or ``/v1/chat/completions`` (``top_logprobs``) for them."""
    return_routed_experts: bool | None = None
    """Mixture-of-experts models: return each choice's ``routed_experts`` (None: the server's
    ``inference.server.return_routed_experts``); refused on a dense model."""
    routed_experts_prompt_start: Annotated[int, _JsonInt] | None = Field(None, ge=0, le=JSON_INT64_MAX)
    """First sequence position whose routing is returned (verifiers sends the length of the
    trace it already holds, minus one); at most the prompt's length. None: 0."""


class GenerateRequest(_Body):
    model: str | None = None
    token_ids: list[TokenId] = Field(min_length=1)
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


class RoutedExperts(BaseModel):
    """The experts each fed token used per sparse layer (vLLM's and verifiers' wire form):
    ``data`` is base64 of a C-order ``dtype`` array of ``shape`` [tokens, n_moe_layers, k], row i
    being sequence position ``start + i``; it covers the prompt and the completion but its last
    token (which no forward pass follows)."""

    data: str
    shape: list[int]
    start: int
    dtype: Literal["uint8", "uint16"]


class GenerateChoice(BaseModel):
    index: int
    token_ids: list[int]  # the matched stop token included
    logprobs: GenerateLogprobs | None
    finish_reason: Literal["stop", "length", "abort"]
    policy_version: int
    policy_version_final: int
    routed_experts: RoutedExperts | None = None
    token_versions: list[int]
    """The policy version that sampled each of ``token_ids`` (``weight_update = "immediate"``
    swaps weights mid-completion: early tokens carry the old version, later ones the new)."""


class GenerateResponse(BaseModel):
    request_id: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]
    usage: Usage


# -- POST /v1/chat/completions --------------------------------------------------------------------


class ContentPart(BaseModel):
    """An OpenAI content part; only text parts are served (the models are text-only)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"] = "text"
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class TextFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(SamplingFields, _Streaming):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Annotated[
        Literal["auto", "none"] | None,
        _refused_because(
            '"auto" or "none" only: a named or "required" tool choice needs constrained decoding, which this '
            "server does not do"
        ),
    ] = Field(None, description='"auto" (default): tool calls in the answer are parsed; "none": they are not.')
    response_format: Annotated[
        TextFormat | None,
        _refused_because(
            '{"type": "text"} only: JSON output (json_object, json_schema) needs guided decoding, which this '
            "server does not do"
        ),
    ] = None
    max_tokens: MaxTokensInt | None = None
    max_completion_tokens: MaxTokensInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCountInt | None = None
    chat_template: str | None = None
    """A request-supplied template (vLLM's field; also read from ``chat_template_kwargs``):
    refused unless the server allows them (``inference.server.allow_request_chat_template``)."""
    chat_template_kwargs: (
        Annotated[dict[str, Any], Field(json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})]
        | None
    ) = None
    """Extra template variables; the server sets those in ``RESERVED_TEMPLATE_KWARGS`` itself."""
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


class CompletionRequest(SamplingFields, _Streaming):
    model: str | None = None
    prompt: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
    max_tokens: MaxTokensInt | None = 16
    logprobs: LogprobCountInt | None = None


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
    """New weights from exactly one source: a model directory (``path``) or the trainer's
    publishers (``manifest``)."""

    path: (
        Annotated[
            StrictStr,
            Field(min_length=1, pattern=r"^[^\x00]+$"),
            _refused_because("a non-empty string with no NUL byte: a model directory or a gs:// URL"),
        ]
        | None
    ) = None
    """A Hugging Face model directory (config.json + safetensors) with the served architecture."""
    manifest: dict[str, Any] | None = None
    """A weight manifest (``jaxrl.weight_transfer.Manifest``, as its ``to_json`` writes it): the
    trainer processes' publisher endpoints and which shards of every param each holds. The server
    pulls exactly the pieces its own layout needs from them (its ``version`` is the publishers'
    key; the policy version served is ``version`` below)."""
    version: Annotated[int, Field(ge=0, le=JSON_INT64_MAX), _JsonInt] | None = None
    """Policy version to assign (must increase); default: current + 1."""
    timeout_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    """With ``manifest``: the pull's deadline in seconds (default 300); past it the update fails
    and the server keeps its weights."""

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        if (self.path is None) == (self.manifest is None):
            has = "both" if self.path is not None else "neither"
            raise ValueError(
                f"give exactly one of path (a model directory) or manifest (a weight manifest), not {has}"
            )
        if self.timeout_s is not None and self.manifest is None:
            raise ValueError("timeout_s: only with manifest (a pull's deadline)")
        return self


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx / 5xx body (OpenAI's error shape)."""

    error: ErrorBody


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

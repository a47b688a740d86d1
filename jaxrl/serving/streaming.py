"""``stream: true`` answers: a finished chat or text completion as OpenAI's (and vLLM's)
server-sent events, ``data: <chunk>`` each, ``data: [DONE]`` last.

The engine delivers whole completions, so the chunks of a response are built from the same
body the non-streaming answer would be (one path, the same content, log-probs and token ids)
and sent once it is complete: per choice, the role, then its content (with reasoning, tool calls
and log-probs, as deltas), then its finish reason; with ``stream_options.include_usage`` every
chunk carries ``"usage": null`` and one more chunk with no choices carries the usage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from jaxrl.serving import protocol


def sse(chunks: Iterator[dict[str, Any]]) -> StreamingResponse:
    """The chunks as an event stream, ``data: [DONE]`` after the last."""

    def events() -> Iterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _include_usage(body: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _envelope(out: dict[str, Any], kind: str, usage: bool) -> Any:
    head = {"id": out["id"], "object": kind, "created": out["created"], "model": out["model"]}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": choices, **extra, **({"usage": None} if usage else {})}

    return chunk


def chat_chunks(out: dict[str, Any], body: protocol.ChatCompletionRequest) -> Iterator[dict[str, Any]]:
    """A chat completion (``ChatServing.chat``'s answer) as ``chat.completion.chunk``s."""
    usage = _include_usage(body)
    chunk = _envelope(out, "chat.completion.chunk", usage)
    for choice in out["choices"]:
        i, message = choice["index"], choice["message"]
        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        extra = {"prompt_token_ids": out["prompt_token_ids"]} if "prompt_token_ids" in out and i == 0 else {}
        yield chunk([first], **extra)
        delta: dict[str, Any] = {"content": message.get("content") or ""}
        if "reasoning_content" in message:
            delta["reasoning_content"] = message["reasoning_content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        body_chunk = {"index": i, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
        if "token_ids" in choice:
            body_chunk["token_ids"] = choice["token_ids"]
        yield chunk([body_chunk])
        yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}])
    if usage:
        yield {**chunk([]), "usage": out["usage"]}


def completion_chunks(out: dict[str, Any], body: protocol.CompletionRequest) -> Iterator[dict[str, Any]]:
    """A text completion (``CompletionServing.completions``' answer) as ``text_completion`` chunks."""
    usage = _include_usage(body)
    chunk = _envelope(out, "text_completion", usage)
    for choice in out["choices"]:
        yield chunk([{**choice, "finish_reason": None}])
        yield chunk([{"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}])
    if usage:
        yield {**chunk([]), "usage": out["usage"]}

"""``stream: true`` answers: chat and text completions as OpenAI's (and vLLM's) server-sent
events, ``data: <chunk>`` each, ``data: [DONE]`` last, sent as the engine samples the tokens.

The engine hands each choice's new tokens over after every device call (``ChoiceStream``); each
batch becomes one chunk per choice: a chat ``delta`` (role first, then content / reasoning as
they grow, tool calls and the finish reason at the end) or a text completion's ``text``, with the
log-probs of the new tokens when asked and their ids when ``return_token_ids``. With
``stream_options.include_usage`` every chunk carries ``"usage": null`` and one more chunk with no
choices carries the usage, as vLLM does.

What a chunk carries is what later tokens cannot change: the visible text is built exactly as
the non-streamed answer builds it (stop token dropped, cut at a stop string, the same renderer
or tool-call parsing) from the tokens so far, and only its settled prefix is sent, holding back
an unfinished UTF-8 character and an end that may be the start of a stop string (or, when
tools are offered, of a ``<tool_call>`` tag); with the run's renderer, which strips what
it parses, without surrounding whitespace. Content stops streaming once a tool call opens (and,
without a renderer, when the request offers tools: whether the content ends stripped depends on
a call coming); the calls come whole in the last delta. So the deltas of a choice concatenate
to the non-streamed answer with the same seed.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from jaxrl.engine.requests import Completion, TokenDelta
from jaxrl.serving import protocol
from jaxrl.serving.completions import ChoiceStream, CompletionServing, usage

log = logging.getLogger(__name__)

TOOL_CALL_TAG = "<tool_call>"


def sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """The chunks as an event stream, ``data: [DONE]`` after the last. An engine failure midway
    ends the stream with an error event (vLLM's shape) instead of cutting it off."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except Exception as e:  # the engine failed after the stream began (200 sent)
            log.exception("stream failed")
            error = {"message": f"internal error: {e!r}", "type": "InternalServerError", "param": None, "code": 500}
            yield f"data: {json.dumps({'error': error})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _include_usage(body: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _settled(value: str, pending: list[str]) -> str:
    """The part of a provisional ``value`` later tokens cannot change: without an unfinished UTF-8
    character (decoded as U+FFFD) at its end, nor an end that may be the start of one of
    ``pending`` (stop strings, a tool-call tag)."""
    value = value.rstrip("\ufffd")
    cut = max((k for s in pending for k in range(1, min(len(s), len(value) + 1)) if value.endswith(s[:k])), default=0)
    return value[: len(value) - cut]


class _Tokens:
    """One choice's completion so far, and how much of it the client has been sent."""

    def __init__(self, serving: CompletionServing, stops: list[str], stop_ids: frozenset[int]):
        self._serving, self._stops, self._stop_ids = serving, stops, stop_ids
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []  # top log-probs per token (when asked)
        self.sent: dict[str, str] = {}  # text sent, per field ("content", "reasoning_content", "text")
        self.logprobs_sent = 0  # visible tokens whose log-probs were sent
        self.ids_sent = 0  # token ids sent (return_token_ids)

    def add(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            self.ids += d.token_ids
            self.logprobs += d.logprobs
            self.top += d.top_logprobs

    def visible(self) -> tuple[list[int], str]:
        """``CompletionServing.visible`` of the completion so far (its stop token is its last)."""
        stop = self.ids[-1] if self.ids and self.ids[-1] in self._stop_ids else None
        partial = Completion("", [], self.ids, self.logprobs, "length", 0, 0, 0, stop_token=stop)
        return self._serving.visible(partial, self._stops)

    def grow(self, field: str, value: str, *, final: bool = False) -> str:
        """What to send of ``field`` now that it reads ``value`` (settled unless ``final``)."""
        sent = self.sent.get(field, "")
        if not value.startswith(sent):
            # Not for prefix-stable parsing; what was sent cannot be taken back.
            log.warning("streamed %s diverged from the final answer; sending the rest as is", field)
            value = sent + value[len(sent) :] if final else sent
        self.sent[field] = value
        return value[len(sent) :]

    def new_logprobs(self, visible: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        """Ids, log-probs and top log-probs of the visible tokens (the first ``visible``) not sent yet."""
        start, self.logprobs_sent = self.logprobs_sent, max(self.logprobs_sent, visible)
        end = self.logprobs_sent
        return self.ids[start:end], self.logprobs[start:end], self.top[start:end]

    def new_ids(self) -> list[int]:
        start, self.ids_sent = self.ids_sent, len(self.ids)
        return self.ids[start:]


def _pending(stops: list[str], tools: bool) -> list[str]:
    """Strings whose start at the end of a provisional text holds that end back."""
    return [*stops, TOOL_CALL_TAG] if tools else list(stops)


def _stop_ids(serving: CompletionServing, body: protocol.SamplingFields) -> frozenset[int]:
    return frozenset(body.stop_token_ids or []) | frozenset([] if body.ignore_eos else serving.default_stop_ids)


class _Envelope:
    """The fields every chunk of one response shares."""

    def __init__(self, prefix: str, kind: str, model: str, usage: bool):
        self.head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}
        self.usage = usage

    def __call__(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**self.head, "choices": choices, **extra, **({"usage": None} if self.usage else {})}


async def chat_chunks(
    chat: Any,
    stream: ChoiceStream,
    body: protocol.ChatCompletionRequest,
    prompt: list[int],
    renderer: Any,
    stops: list[str],
) -> AsyncIterator[dict[str, Any]]:
    """A chat request's ``chat.completion.chunk``s (``chat``: the ``ChatServing`` that built the
    request; it builds each finished choice exactly as unstreamed)."""
    serving: CompletionServing = chat.completion
    tools = bool(body.tools) and body.tool_choice != "none"
    pending = _pending(stops, tools)
    chunk = _Envelope("chatcmpl", "chat.completion.chunk", serving.model_name, _include_usage(body))
    choices = [_Tokens(serving, stops, _stop_ids(serving, body)) for _ in range(body.n)]
    for i in range(body.n):
        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield chunk([first], **({"prompt_token_ids": prompt} if body.return_token_ids and i == 0 else {}))

    def tokens_part(state: _Tokens, visible: int) -> dict[str, Any]:
        ids, logprobs, top = state.new_logprobs(visible)
        entries = chat.logprob_entries(ids, logprobs, top)
        part: dict[str, Any] = {"logprobs": {"content": entries} if body.logprobs and ids else None}
        if body.return_token_ids:
            part["token_ids"] = state.new_ids()
        return part

    completions: list[Completion] = []
    async for batch in stream.events():
        for i, deltas, done in batch:
            state = choices[i]
            state.add(deltas)
            delta: dict[str, Any] = {}
            if done is None:  # running: what its content and reasoning gained, settled
                ids, text = state.visible()
                message = chat.message(ids, text, body, renderer, prompt)
                for field in ("reasoning_content", "content"):
                    if field == "content" and (TOOL_CALL_TAG in text or (tools and renderer is None)):
                        continue  # a call is (or may be) written: the content comes whole at the end
                    value = message.get(field) or ""
                    if field == "reasoning_content" and renderer is not None:
                        value = value.strip()  # renderers trim the reasoning they end (the content keeps its own)
                    if grown := state.grow(field, _settled(value, pending)):
                        delta[field] = grown
                part = tokens_part(state, len(ids))
                if delta or part["logprobs"] or part.get("token_ids"):
                    yield chunk([{"index": i, "delta": delta, **part, "finish_reason": None}])
                continue
            completions.append(done)
            final = chat.choice(i, done, stops, body, renderer, prompt)
            message = final["message"]
            for field in ("reasoning_content", "content"):
                if rest := state.grow(field, message.get(field) or "", final=True):
                    delta[field] = rest
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            part = tokens_part(state, len(serving.visible(done, stops)[0]))
            if delta or part["logprobs"] or part.get("token_ids"):
                yield chunk([{"index": i, "delta": delta, **part, "finish_reason": None}])
            yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": final["finish_reason"]}])
    if chunk.usage:
        yield {**chunk([]), "usage": usage(len(prompt), completions)}


def completion_stream(
    serving: CompletionServing, body: protocol.CompletionRequest, session: str | None
) -> AsyncIterator[dict[str, Any]]:
    """A text completion request, submitted now (a refused one raises before any chunk), and
    its chunks as the engine samples them."""
    prompt, params, stops = serving.text_request(body)
    return completion_chunks(serving, serving.stream(prompt, params, session, stops), body, prompt, stops)


async def completion_chunks(
    serving: CompletionServing,
    stream: ChoiceStream,
    body: protocol.CompletionRequest,
    prompt: list[int],
    stops: list[str],
) -> AsyncIterator[dict[str, Any]]:
    """A text completion request's ``text_completion`` chunks."""
    pending = _pending(stops, tools=False)
    chunk = _Envelope("cmpl", "text_completion", serving.model_name, _include_usage(body))
    choices = [_Tokens(serving, stops, _stop_ids(serving, body)) for _ in range(body.n)]
    offsets = [0] * body.n  # characters of log-prob pieces sent (text_offset)
    completions: list[Completion] = []
    async for batch in stream.events():
        for i, deltas, done in batch:
            state = choices[i]
            state.add(deltas)
            if done is None:
                ids, text = state.visible()
                text = state.grow("text", _settled(text, pending))
            else:
                completions.append(done)
                ids, text = serving.visible(done, stops)
                text = state.grow("text", text, final=True)
            new_ids, new_logprobs, new_top = state.new_logprobs(len(ids))
            logprobs = None
            if body.logprobs is not None and new_ids:
                logprobs = serving.text_logprobs(new_ids, new_logprobs, new_top, offsets[i])
                offsets[i] += sum(len(p) for p in logprobs["tokens"])
            token_ids = state.new_ids()
            finish = None if done is None else done.finish_reason
            if text or logprobs or token_ids or finish:
                yield chunk([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish, "token_ids": token_ids}])
    if chunk.usage:
        yield {**chunk([]), "usage": usage(len(prompt), completions)}

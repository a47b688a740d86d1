"""The logic behind ``/v1/chat/completions`` (vLLM's ``serving_chat``): rendering a chat to
prompt tokens in one of three ways (the run's renderer, the tokenizer's template, or a
request-supplied template in a budgeted sandbox), parsing the answer (tool calls, reasoning) and
building the choices. Sampling and the engine round trip are ``CompletionServing``'s."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from functools import partial
from typing import Any

from jinja2 import TemplateError

from jaxrl.engine.requests import Completion
from jaxrl.serving import protocol
from jaxrl.serving.completions import CompletionServing, stop_strings, usage
from jaxrl.serving.errors import BadRequest
from jaxrl.serving.streaming import chat_chunks
from jaxrl.serving.template_sandbox import TemplateBudgetError, render_in_sandbox

_MAX_CACHED_RENDERERS = 16
MAX_TEMPLATE_CHARS = 64 * 1024  # a request-supplied chat template (real ones are a few KB)
PROMPT_CHARS_PER_TOKEN = 64  # rendered prompts longer than this x max_model_len cannot fit anyway
SANDBOX_SLOTS = 2  # request-supplied templates rendering at once (each in its own process)

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CONTROL = re.compile(r"<\|[^|>]*\|>")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split Qwen/Hermes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks out of
    ``text``; returns (content before the first call, OpenAI tool_calls). Malformed blocks stay
    in the content."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(
            {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}
        )
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")].strip(), calls


def renderer_tool_calls(parsed: Any) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a renderer's ``ParsedResponse``. A call the renderer could
    not parse (broken JSON, no name) stays in the content as the model wrote it, as in
    ``parse_tool_calls`` and vLLM's Hermes parser: a malformed call is visible to the client and
    in the rollout's record, never dropped."""
    calls, broken = [], []
    for tc in parsed.tool_calls:
        if tc.status.value != "ok" or not tc.name:
            broken.append(tc.raw)
            continue
        arguments = tc.arguments if isinstance(tc.arguments, str) else json.dumps(tc.arguments or {})
        calls.append(
            {
                "id": tc.id or f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": tc.name, "arguments": arguments},
            }
        )
    content = "\n".join(part for part in (parsed.content, *broken) if part)
    return content, calls


def _message(m: protocol.ChatMessage) -> dict[str, Any]:
    msg = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # OpenAI content parts (text only), concatenated
        msg["content"] = "".join(p.text for p in m.content)
    msg.setdefault("content", "")
    return msg


class ChatServing:
    """Chat requests over ``completion``'s engine round trip; ``renderer``: the run's `renderers`
    config (`[model] renderer`), so chat prompts render and completions parse exactly as the env
    servers' do (None: the tokenizer's chat template)."""

    def __init__(
        self,
        completion: CompletionServing,
        *,
        renderer: Mapping[str, Any] | None = None,
        allow_request_chat_template: bool = False,
        request_template_timeout_s: float = 2.0,
    ):
        self.completion = completion
        self.tokenizer = completion.tokenizer
        self.renderer = dict(renderer) if renderer is not None else None
        self.allow_request_chat_template = allow_request_chat_template
        self.request_template_timeout_s = request_template_timeout_s
        self._renderers: dict[str, Any] = {}
        self._sandbox_slots = asyncio.Semaphore(SANDBOX_SLOTS)
        self._max_prompt_chars = PROMPT_CHARS_PER_TOKEN * completion.engine.max_model_len

    async def chat_stream(self, body: protocol.ChatCompletionRequest, session: str | None) -> AsyncIterator[dict[str, Any]]:
        """``stream: true``: the chat is rendered and submitted now (a refused request raises,
        before any chunk); the chunks follow the engine (``streaming.chat_chunks``)."""
        prompt, renderer = await self.render(body)
        params = self.completion.params(body, len(prompt), body.max_completion_tokens or body.max_tokens)
        stops = stop_strings(body)
        stream = self.completion.stream(prompt, params, session, stops)
        return chat_chunks(self, stream, body, prompt, renderer, stops)

    async def chat(self, body: protocol.ChatCompletionRequest, session: str | None) -> dict[str, Any]:
        prompt, renderer = await self.render(body)
        params = self.completion.params(body, len(prompt), body.max_completion_tokens or body.max_tokens)
        stops = stop_strings(body)
        completions = await self.completion.complete(prompt, params, session, stops)
        choices = [self.choice(i, c, stops, body, renderer, prompt) for i, c in enumerate(completions)]
        out = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.completion.model_name,
            "choices": choices,
            "usage": usage(len(prompt), completions),
        }
        if body.return_token_ids:
            out["prompt_token_ids"] = prompt
        return out

    # -- rendering -----------------------------------------------------------------------------

    def template_kwarg_names(self) -> frozenset[str] | None:
        """The ``chat_template_kwargs`` keys this server renders with: the run's renderer's template
        fields, or None (any) with the tokenizer's own template or request templates allowed."""
        if self.renderer is None or self.allow_request_chat_template:
            return None
        from jaxrl.models.renderer import template_kwarg_names

        return template_kwarg_names(self.renderer)

    async def render(self, body: protocol.ChatCompletionRequest) -> tuple[list[int], Any]:
        """Prompt token ids of a chat request (and the renderer that parses its answer, if any),
        rendered off the event loop: with the run's renderer (``[model] renderer``) or the server's
        own template in a worker thread, or with a request-supplied template (only when allowed)
        in a budgeted child process (``template_sandbox``)."""
        messages = [_message(m) for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None)
        template = body.chat_template if template is None else template
        for reserved in protocol.RESERVED_TEMPLATE_KWARGS:
            if reserved in kwargs:
                raise BadRequest(f"chat_template_kwargs.{reserved}: set by the server, not the request")
        if template is None and self.renderer is not None:
            try:
                renderer = self._chat_renderer(kwargs)
                render_ids = partial(renderer.render_ids, messages, tools=body.tools, add_generation_prompt=True)
                prompt = await asyncio.to_thread(render_ids)
            except (TemplateError, TypeError, KeyError, ValueError, AssertionError) as e:  # the renderer rejects it
                raise BadRequest(f"messages: the chat template failed: {e}") from None
            return list(prompt), renderer
        if template is not None:
            text = await self._render_request_template(template, messages, body.tools, kwargs)
        else:
            render = partial(
                self.tokenizer.apply_chat_template,
                messages,
                tools=body.tools,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
            try:
                text = await asyncio.to_thread(render)
            except (TemplateError, TypeError, KeyError, ValueError) as e:  # the template rejects it
                raise BadRequest(f"messages: the chat template failed: {e}") from None
        if len(text) > self._max_prompt_chars:
            raise BadRequest(f"messages: the rendered prompt has over {self._max_prompt_chars} characters")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False), None

    async def _render_request_template(
        self, template: Any, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]
    ) -> str:
        if not self.allow_request_chat_template:
            raise BadRequest(
                "chat_template: request-supplied chat templates are off on this server (they run code); "
                "start it with inference.server.allow_request_chat_template = true to accept them"
            )
        if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
            raise BadRequest(f"chat_template: must be a string of at most {MAX_TEMPLATE_CHARS} characters")
        specials = {k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)}
        context = {**specials, **kwargs, "messages": messages, "tools": tools, "add_generation_prompt": True}
        try:
            json.dumps(context)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"chat_template_kwargs: not JSON data: {e}") from None
        async with self._sandbox_slots:
            try:
                return await render_in_sandbox(
                    template,
                    context,
                    timeout_s=self.request_template_timeout_s,
                    max_chars=self._max_prompt_chars,
                )
            except TemplateBudgetError as e:
                raise BadRequest(f"chat_template: {e}") from None

    def _chat_renderer(self, kwargs: Mapping[str, Any] | None) -> Any:
        """The run's renderer with a request's chat_template_kwargs (validated by renderers), cached."""
        from jaxrl.models.renderer import create_renderer

        key = json.dumps(kwargs or {}, sort_keys=True, default=str)
        if key in self._renderers:
            return self._renderers[key]
        assert self.renderer is not None
        renderer = create_renderer(self.tokenizer, self.renderer, kwargs or None)
        if len(self._renderers) < _MAX_CACHED_RENDERERS:  # requests choose the keys: bound the cache
            self._renderers[key] = renderer
        return renderer

    # -- the answer ----------------------------------------------------------------------------

    def choice(
        self,
        index: int,
        c: Completion,
        stops: list[str],
        body: protocol.ChatCompletionRequest,
        renderer: Any = None,
        prompt: list[int] | None = None,
    ) -> dict[str, Any]:
        """One chat choice: the message (``message``), finish reason and log-probs."""
        ids, text = self.completion.visible(c, stops)
        message = self.message(ids, text, body, renderer, prompt)
        finish = "tool_calls" if "tool_calls" in message and c.finish_reason == "stop" else c.finish_reason
        logprobs = {"content": self.logprob_entries(ids, c.logprobs)} if body.logprobs else None
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def message(
        self,
        ids: list[int],
        text: str,
        body: protocol.ChatCompletionRequest,
        renderer: Any = None,
        prompt: list[int] | None = None,
    ) -> dict[str, Any]:
        """The assistant message of completion tokens ``ids`` (``text``: as the client sees them):
        content (control tokens dropped), reasoning, tool calls (parsed by the run's renderer,
        else Qwen/Hermes blocks when the request offers tools)."""
        reasoning = None
        no_calls = body.tool_choice == "none"  # a call the model writes stays in the content as text
        tools = None if no_calls else body.tools
        if renderer is not None:
            parsed = renderer.parse_response(ids, tools=tools, prompt_ids=prompt)
            reasoning = parsed.reasoning_content
            if no_calls:
                content = "\n".join(p for p in (parsed.content, *(tc.raw for tc in parsed.tool_calls)) if p)
                tool_calls = []
            else:
                content, tool_calls = renderer_tool_calls(parsed)
        else:
            content, tool_calls = parse_tool_calls(text) if tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": _CONTROL.sub("", content) or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message

    def logprob_entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        """OpenAI chat log-prob entries of ``ids`` (only the sampled token's: ``top_logprobs`` empty)."""
        entries = []
        for t, lp in zip(ids, logprobs):
            piece = self.completion.piece(t)
            entries.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
        return entries

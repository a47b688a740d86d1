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
from jaxrl.engine.token_sampling import SamplingParams
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
    return text[: text.index("<tool_call>")], calls


def _markup_start(text: str, body: int) -> int:
    """Where the markup (a ``<tool_call>`` tag) before a call's body at ``body`` starts: after
    the last whitespace before it."""
    head = text[:body].rstrip()
    return max(head.rfind(c) for c in " \t\r\n") + 1


def with_whitespace(text: str, content: str, *, end: int, closed: bool = True) -> str:
    """A parser's trimmed ``content`` widened to the whitespace around it in ``text``, the
    completion text it was parsed from, up to ``end`` (where a first tool call starts): a parser
    takes out only what it parses (reasoning, calls, their tags), as vLLM's do. An empty
    ``content`` is the whitespace ending ``text[:end]`` (after closed reasoning: ``closed``; an
    answer of whitespace alone is itself)."""
    if not content:
        head = text[:end]
        return head[len(head.rstrip()) :] if closed else ""
    start = text.rfind(content, 0, end)
    if start < 0:
        return content  # the parser rewrote it: nothing to align
    stop = start + len(content)
    while start > 0 and text[start - 1].isspace():
        start -= 1
    while stop < end and text[stop].isspace():
        stop += 1
    return text[start:stop]


def renderer_tool_calls(parsed: Any, content: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a renderer's ``ParsedResponse`` (``content``: its content
    with the whitespace around it, ``with_whitespace``; None: as parsed). A call the renderer could
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
    own = parsed.content if content is None else content
    return "\n".join(part for part in (own, *broken) if part), calls


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
        self._special_tokens = sorted(set(self.tokenizer.all_special_tokens), key=len, reverse=True)

    async def chat_stream(self, body: protocol.ChatCompletionRequest, session: str | None) -> AsyncIterator[dict[str, Any]]:
        """``stream: true``: the chat is rendered and submitted now (a refused request raises,
        before any chunk); the chunks follow the engine (``streaming.chat_chunks``)."""
        prompt, renderer = await self.render(body)
        params = self.params(body, len(prompt))
        stops = stop_strings(body)
        stream = self.completion.stream(prompt, params, session, stops)
        return chat_chunks(self, stream, body, prompt, renderer, stops)

    async def chat(self, body: protocol.ChatCompletionRequest, session: str | None) -> dict[str, Any]:
        prompt, renderer = await self.render(body)
        params = self.params(body, len(prompt))
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

    def params(self, body: protocol.ChatCompletionRequest, prompt_len: int) -> list[SamplingParams]:
        """The engine's sampling settings of a chat request (``CompletionServing.params``)."""
        longest = self.completion.engine.max_model_len - 1  # what the schema publishes (a prompt holds a token)
        for field in ("max_tokens", "max_completion_tokens"):  # both checked, whichever is used
            value = getattr(body, field)
            if value is not None and value > longest:
                raise BadRequest(f"{field}: at most {longest} on this server (max_model_len - 1), got {value}")
        if body.top_logprobs and not body.logprobs:
            raise BadRequest("top_logprobs: only with logprobs: true (set it, or drop top_logprobs)")
        top = self.completion.top_logprobs("top_logprobs", body.top_logprobs) if body.logprobs else 0
        return self.completion.params(body, prompt_len, body.max_completion_tokens or body.max_tokens, top)

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
        logprobs = {"content": self.logprob_entries(ids, c.logprobs, c.top_logprobs)} if body.logprobs else None
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
        content, reasoning, tool calls (parsed by the run's renderer, else Qwen/Hermes blocks when
        the request offers tools). The content is the text of the tokens (special tokens
        skipped) less only what the parsers took out, whitespace kept, as vLLM returns it:
        renderers trim the content they parse, so ``with_whitespace`` puts back what
        surrounds it. It is null only beside tool calls and empty."""
        reasoning, closed = None, True
        no_calls = body.tool_choice == "none"  # a call the model writes stays in the content as text
        tools = None if no_calls else body.tools
        if renderer is not None:
            parsed = renderer.parse_response(ids, tools=tools, prompt_ids=prompt)
            reasoning, closed = parsed.reasoning_content, parsed.reasoning_complete is not False
            raws = [tc.raw for tc in parsed.tool_calls if tc.raw]
            ends = [_markup_start(text, i) for i in (text.find(r) for r in raws) if i >= 0]
            own = with_whitespace(text, parsed.content, end=min(ends, default=len(text)), closed=closed)
            if no_calls:
                content = "\n".join(p for p in (own, *raws) if p)
                tool_calls = []
            else:
                content, tool_calls = renderer_tool_calls(parsed, own)
        else:
            content, tool_calls = parse_tool_calls(text) if tools else (text, [])
        content = self.without_special_tokens(content)
        message: dict[str, Any] = {"role": "assistant", "content": None if tool_calls and not content else content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        return message

    def without_special_tokens(self, text: str) -> str:
        """``text`` without the tokenizer's special tokens (what decoding with
        ``skip_special_tokens`` gives, as vLLM returns chat content)."""
        for token in self._special_tokens:
            text = text.replace(token, "")
        return text

    def logprob_entries(
        self, ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]] = ()
    ) -> list[dict[str, Any]]:
        """OpenAI chat log-prob entries of ``ids``; ``top_logprobs`` lists the request's
        ``top_logprobs`` most likely tokens of each (``top``: none asked, empty lists)."""
        entries = []
        for k, (t, lp) in enumerate(zip(ids, logprobs)):
            entry = self._entry(t, lp)
            entry["top_logprobs"] = [self._entry(i, v) for i, v in top[k]] if k < len(top) else []
            entries.append(entry)
        return entries

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        piece = self.completion.piece(token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

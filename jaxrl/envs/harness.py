"""An in-process chat harness with local Python tools: verifiers' agent loop, offline.

verifiers' bundled harnesses run a program that `uv` installs at run time (and tool servers
are MCP processes built the same way), which needs the network. This harness runs the same
loop inside the env-server process instead — as `Harness.launch` explicitly allows: every
model call goes through the rollout's interception `endpoint` with its `secret`, so the
trace records exactly what a launched program would have produced. Tools are plain Python
functions named by import path on the task's data (`ToolTaskData.tools`) and executed
locally; their results go back to the model as `tool` messages.

A taskset module may export this class in its `__all__` beside its `Taskset` (verifiers then
takes it as the taskset's harness); a taskset that exports no harness gets it anyway
(`jaxrl.envs.LOCAL_HARNESS`), unless its env config names another. Run it with
`runtime.type = "subprocess"` (the env server does so for every agent seat by default).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import weakref
from collections.abc import Callable
from typing import Any, get_type_hints

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from pydantic import Field
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.utils.loaders import plugged_fn

__all__ = ["LocalChatHarness", "LocalChatHarnessConfig", "ToolTaskData"]  # a verifiers harness plugin

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolTaskData(vf.TaskData):
    """Task data that offers the model local Python tools."""

    tools: list[str] = Field(default_factory=list)
    """Import paths (`pkg.module:function`) of the functions offered to the model as tools.
    Each takes JSON-typed keyword arguments (str/int/float/bool) and returns a value whose
    `str()` is the tool message; its docstring is the tool's description."""


class LocalChatHarnessConfig(vf.HarnessConfig):
    """Knobs of the in-process chat harness."""

    max_tool_rounds: int = Field(8, ge=1)
    """Model calls per segment before the loop gives up on a model that keeps calling
    tools (the rollout's own `agent.max_turns` limit applies on top)."""
    max_retries: int = Field(0, ge=0)
    """Retries of a failed model call by the OpenAI client. 0: a provider error ends the
    rollout at once and is recorded on its trace."""
    request_timeout: float = Field(600.0, gt=0)
    """Seconds one model call may take."""


def tool_spec(fn: Callable[..., Any]) -> dict:
    """The OpenAI function-tool declaration of a plain Python function."""
    properties: dict[str, dict] = {}
    required: list[str] = []
    hints = get_type_hints(fn)
    for name, param in inspect.signature(fn).parameters.items():
        json_type = _JSON_TYPES.get(hints.get(name))
        if json_type is None:
            raise TypeError(
                f"tool {fn.__name__!r}: parameter {name!r} is annotated {hints.get(name)!r}; "
                f"annotate it with one of {sorted(t.__name__ for t in _JSON_TYPES)}"
            )
        properties[name] = {"type": json_type}
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": inspect.getdoc(fn) or "",
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


async def call_tool(tools: dict[str, Callable[..., Any]], name: str, arguments: str) -> str:
    """Run one tool call; every failure becomes the tool's reply, as a real harness does."""
    fn = tools.get(name)
    if fn is None:
        return f"error: unknown tool {name!r}; available: {sorted(tools)}"
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as e:
        return f"error: invalid JSON in tool arguments ({e})"
    if not isinstance(args, dict):
        return f"error: tool arguments must be a JSON object, got {type(args).__name__}"
    try:
        result = fn(**args)
        if inspect.isawaitable(result):
            result = await result
    except Exception as e:  # noqa: BLE001 - a failing tool is data for the model
        return f"error: {type(e).__name__}: {e}"
    return str(result)


_HTTP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def shared_http_client() -> httpx.AsyncClient:
    """One HTTP connection pool per event loop, shared by every rollout's model client.

    Why: an OpenAI client that builds its own httpx client builds an SSL context with it
    (~25 ms of CPU loading the CA bundle, even for plain http). Per rollout that was the largest
    CPU cost of the env server in the reverse_text RL recipe (744 of 910 profile samples in
    ``launch``, on the cores the engine and trainer share). The rollout's endpoint, secret and
    timeout stay per client: they travel with each request, not with the pool."""
    loop = asyncio.get_running_loop()
    client = _HTTP.get(loop)
    if client is None or client.is_closed:
        client = _HTTP[loop] = DefaultAsyncHttpxClient()
    return client


class LocalChatHarness(vf.Harness[LocalChatHarnessConfig]):
    """Chat loop in the env-server process: call the model, run tool calls, repeat."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a user turn relaunches the loop on the whole conversation
    EXECUTES_CODE = False  # tools are the task's own deterministic functions
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        paths = data.tools if isinstance(data, ToolTaskData) else []
        tools = {fn.__name__: fn for fn in (plugged_fn(path) for path in paths)}
        specs = [tool_spec(fn) for fn in tools.values()]
        client = AsyncOpenAI(
            base_url=endpoint,
            api_key=secret,
            max_retries=self.config.max_retries,
            timeout=self.config.request_timeout,
            http_client=shared_http_client(),  # not closed here: the loop's pool outlives the rollout
        )
        for _ in range(self.config.max_tool_rounds):
            kwargs: dict[str, Any] = {"tools": specs} if specs else {}
            completion = await client.chat.completions.create(
                model=ctx.model, messages=messages, **kwargs
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            replies = await asyncio.gather(
                *(call_tool(tools, c.function.name, c.function.arguments) for c in message.tool_calls)
            )
            for call, reply in zip(message.tool_calls, replies):
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": call.function.name,
                        "content": reply,
                    }
                )
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")

"""The in-process harness's local tools: declarations and execution (the chat loop itself
runs against a real env server in tests/orchestrator/test_env_server.py)."""

from __future__ import annotations

import asyncio

import pytest

from jaxrl.envs.harness import LocalChatHarness, call_tool, tool_spec
from jaxrl.envs.lookup import lookup


def scale(x: float, times: int = 2, loud: bool = False) -> str:
    """Multiply a number."""
    return str(x * times)


async def slow_echo(text: str) -> str:
    return text


def bad(items: list) -> str:
    return ""


def boom(text: str) -> str:
    raise RuntimeError("kaput")


def test_tool_spec_from_signature_and_docstring():
    assert tool_spec(lookup) == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Return the secret code of a word.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
        },
    }
    params = tool_spec(scale)["function"]["parameters"]
    assert params["properties"] == {
        "x": {"type": "number"},
        "times": {"type": "integer"},
        "loud": {"type": "boolean"},
    }
    assert params["required"] == ["x"]
    with pytest.raises(TypeError, match="parameter 'items' is annotated <class 'list'>"):
        tool_spec(bad)


@pytest.mark.parametrize(
    ("name", "arguments", "reply"),
    [
        ("lookup", '{"key": "abc"}', "bcd"),
        ("slow_echo", '{"text": "hi"}', "hi"),
        ("scale", '{"x": 1.5, "times": 3}', "4.5"),
        ("nope", "{}", "error: unknown tool 'nope'; available: ['boom', 'lookup', 'scale', 'slow_echo']"),
        ("lookup", "{bad", "error: invalid JSON in tool arguments (Expecting property name"),
        ("lookup", "[1]", "error: tool arguments must be a JSON object, got list"),
        ("lookup", '{"word": "x"}', "error: TypeError: lookup() got an unexpected keyword argument 'word'"),
        ("boom", '{"text": "x"}', "error: RuntimeError: kaput"),
    ],
)
def test_call_tool_turns_every_failure_into_a_reply(name, arguments, reply):
    tools = {fn.__name__: fn for fn in (lookup, slow_echo, scale, boom)}
    assert asyncio.run(call_tool(tools, name, arguments)).startswith(reply)


def test_harness_runs_offline_without_a_container():
    assert not LocalChatHarness.NEEDS_CONTAINER and not LocalChatHarness.EXECUTES_CODE
    assert LocalChatHarness.SUPPORTS_RESUME and LocalChatHarness.APPENDS_SYSTEM_PROMPT


def test_rollouts_of_one_event_loop_share_one_http_pool():
    """Every rollout's model client reuses the loop's pool (building one is ~25 ms of CPU for its
    SSL context); a new loop (or a closed pool) gets a new one."""
    import asyncio

    from jaxrl.envs.harness import shared_http_client

    async def twice():
        return shared_http_client(), shared_http_client()

    a, b = asyncio.run(twice())
    assert a is b
    c, _ = asyncio.run(twice())
    assert c is not a

    async def after_close():
        first = shared_http_client()
        await first.aclose()
        return first, shared_http_client()

    closed, fresh = asyncio.run(after_close())
    assert closed.is_closed and fresh is not closed and not fresh.is_closed

"""The scripted model the env-server tests run against, and their shared helpers."""

from __future__ import annotations

import asyncio
import re
import time

from jaxrl.envs import lookup, reverse_text

SAMPLING = {"temperature": 0.6, "max_tokens": 256}
TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "%s"}}\n</tool_call>'


def policy(messages: list[dict]) -> str:
    """Solves every built-in task; a user message with "FAIL" errors, with "SLOW" stalls 4 s."""
    system, last = messages[0]["content"], messages[-1]["content"]
    if "FAIL" in last:
        raise RuntimeError("scripted engine failure")
    if "SLOW" in last:
        time.sleep(4)
    if system == reverse_text.SYSTEM_PROMPT:
        return last[::-1]
    if system.startswith(reverse_text.SYSTEM_PROMPT):  # reverse_duel: the first seat wins
        return last[::-1] if "first seat" in system else last
    if system.startswith(lookup.SYSTEM_PROMPT):
        if "<tool_response>" in last:
            return " ".join(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last))
        return "\n".join(TOOL_CALL % key for key in re.findall(r"'(\w+)'", last))
    names = [line for m in messages if m["role"] == "user" for line in m["content"].splitlines()[1:]]
    return "\n".join(sorted(names))


async def gather(*aws):
    """`asyncio.gather` inside the running loop (outside one it binds the wrong loop)."""
    return await asyncio.gather(*aws)

"""Render a chat template a request supplied, in a child process with a time and memory budget.

A request-supplied template is code: jinja2's sandbox keeps it from touching the host, but not
from looping for minutes (``range(500)`` nested three deep) or building a 300 MB string
(``'a' * 314572800``) on the server's event loop. So such templates (accepted only when
``inference.server.allow_request_chat_template`` is on, as vLLM's
``--trust-request-chat-template``) render in a fresh ``python -I`` process running this file:
CPU time and address space are capped with ``setrlimit``, the parent kills it at the wall-clock
budget, and output beyond ``max_chars`` stops the render. The wall-clock budget starts once the
child has started and imported jinja2 (it says so with one byte): on a loaded host the start-up
alone can take over a second, and that is not the template's time (``STARTUP_S`` bounds it). The environment matches what
``transformers`` gives chat templates (immutable sandbox, ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, the ``tojson`` filter, ``raise_exception`` and ``strftime_now``).

This file imports only the standard library and jinja2 at module level (the child starts in
~0.1 s); ``render_in_sandbox`` is the parent side.
"""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from datetime import datetime
from typing import Any

MEMORY_BYTES = 512 << 20  # address space of the child: python + jinja2 (~25 MB) + the rendered prompt
STARTUP_S = 30.0  # the child's own start-up (python -I + jinja2: ~0.1 s on a quiet host)
_READY = b"R"


class TemplateBudgetError(Exception):
    """The template failed, ran out of time or memory, or rendered too much: a client error."""


def _render(template: str, context: dict[str, Any], max_chars: int) -> str:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    parts, size = [], 0
    for chunk in env.from_string(template).generate(**context):
        size += len(chunk)
        if size > max_chars:
            raise TemplateBudgetError(f"the rendered prompt exceeds {max_chars} characters")
        parts.append(chunk)
    return "".join(parts)


def _child() -> None:
    import resource

    import jinja2.sandbox  # noqa: F401  imported before the parent's clock starts

    sys.stdout.buffer.write(_READY)
    sys.stdout.buffer.flush()
    job = json.loads(sys.stdin.read())
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    cpu = int(job["timeout_s"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    try:
        out = {"text": _render(job["template"], job["context"], job["max_chars"])}
    except MemoryError:
        out = {"error": "the template ran out of memory"}
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(out))


async def render_in_sandbox(
    template: str, context: dict[str, Any], *, timeout_s: float, max_chars: int
) -> str:
    """The rendered template; raises ``TemplateBudgetError`` naming what went wrong."""
    job = json.dumps(
        {"template": template, "context": context, "max_chars": max_chars, "timeout_s": timeout_s}
    )
    with warnings.catch_warnings():  # JAX warns on any fork; this one execs straight away
        warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", __file__,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    try:
        reader: asyncio.StreamReader = proc.stdout  # type: ignore[assignment]  # a PIPE: never None
        try:
            ready = await asyncio.wait_for(reader.readexactly(len(_READY)), STARTUP_S)
        except TimeoutError:
            raise TemplateBudgetError(f"the template sandbox did not start within {STARTUP_S:g} s") from None
        except asyncio.IncompleteReadError:
            ready = b""
        if ready != _READY:
            raise TemplateBudgetError(f"the template sandbox failed to start (exit code {proc.returncode})")
        try:
            stdout, _ = await asyncio.wait_for(proc.communicate(job.encode()), timeout_s)
        except TimeoutError:
            raise TemplateBudgetError(f"rendering the chat template took longer than {timeout_s:g} s") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    try:
        out = json.loads(stdout)
    except json.JSONDecodeError:
        raise TemplateBudgetError(
            f"rendering the chat template exceeded its budget (exit code {proc.returncode})"
        ) from None
    if "error" in out:
        raise TemplateBudgetError(out["error"])
    return out["text"]


if __name__ == "__main__":
    _child()

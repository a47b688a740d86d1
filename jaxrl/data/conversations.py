"""The user's own SFT conversations: ``[data] path`` -> validated (messages, tools) examples.

``path`` is a JSONL file, a directory of ``*.jsonl`` / ``*.parquet`` files (read in name order),
or a Hugging Face dataset id (``org/name``, fetched with ``huggingface_hub`` into the HF cache,
``HF_HUB_OFFLINE`` honoured, ``data.revision`` pinning it). Each row is OpenAI chat shape::

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ..., "tool_calls": [...]}, ...],
     "tools": [{"type": "function", "function": {"name": ..., "parameters": {...}}}, ...]}

or TRL's prompt-completion shape, ``{"prompt": ..., "completion": ...}``, each side a list of
messages (conversational) or a string (a user turn and the assistant's reply), so a dataset made
for TRL's SFTTrainer trains as it is.

Every row is checked here, before training starts: a bad row fails the run with its file and
line (row) number, or, with ``data.skip_bad_rows``, is skipped and counted (the count and the
first few reasons are logged and returned).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

Example = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # (messages, tool specs)


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_ToolCall] | None = None

    @model_validator(mode="after")
    def _has_body(self) -> _Message:
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs `content` (or `tool_calls`)")
        return self


class _Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: dict[str, Any]

    @model_validator(mode="after")
    def _named(self) -> _Tool:
        if not isinstance(self.function.get("name"), str) or not self.function["name"]:
            raise ValueError("a tool needs function.name")
        return self


class Row(BaseModel):
    """One SFT conversation; at least one assistant message (the loss is on assistant tokens)."""

    model_config = ConfigDict(extra="allow")
    messages: list[_Message] = Field(min_length=1)
    tools: list[_Tool] = []

    @model_validator(mode="before")
    @classmethod
    def _prompt_completion(cls, data: Any) -> Any:
        """TRL's ``prompt`` / ``completion`` row as ``messages`` (prompt first)."""
        if not isinstance(data, dict) or "messages" in data:
            return data
        if "prompt" not in data or "completion" not in data:
            raise ValueError(
                "a row needs `messages` (OpenAI chat shape) or `prompt` and `completion` (TRL's shape); "
                f"this one has {sorted(data) or 'no keys'}"
            )
        rest = {k: v for k, v in data.items() if k not in ("prompt", "completion")}
        return rest | {"messages": _turns(data["prompt"], "user") + _turns(data["completion"], "assistant")}

    @model_validator(mode="after")
    def _trains_something(self) -> Row:
        if not any(m.role == "assistant" for m in self.messages):
            raise ValueError("no assistant message: nothing to train on")
        return self

    def example(self) -> Example:
        messages = [m.model_dump(exclude_none=True) for m in self.messages]
        for m in messages:
            m.setdefault("content", "")
        return messages, [t.model_dump() for t in self.tools]


def _turns(side: Any, role: str) -> Any:
    """One side of a prompt-completion row as messages: a string is one ``role`` message."""
    return [{"role": role, "content": side}] if isinstance(side, str) else side


@dataclass
class Loaded:
    examples: list[Example]
    sources: list[str]
    """``file:line`` of each example (for errors that surface later, e.g. while rendering)."""
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)


def load_conversations(
    path: str,
    *,
    revision: str | None = None,
    skip_bad_rows: bool = False,
    check: Callable[[Example], Any] | None = None,
    field: str = "data.path",
) -> Loaded:
    """Every valid row of ``path`` (see the module docstring); raises ValueError on the first bad row
    unless ``skip_bad_rows``; errors name the config ``field`` that set ``path``. ``check`` (e.g. rendering the row with the run's renderer) runs on
    every row that validates; whatever it raises makes the row bad, with its file and line."""
    out = Loaded([], [])
    for source, raw in _rows(_local(path, revision)):
        try:
            if isinstance(raw, str):  # a line that is not JSON: `raw` says why
                raise ValueError(raw)
            row = Row.model_validate(raw)
            if check is not None:
                check(row.example())
        except Exception as e:  # noqa: BLE001 - any failure of a row is that row's error, with its place
            reason = f"{source}: {_reason(e)}"
            if not skip_bad_rows:
                raise ValueError(
                    f"{field}: bad row at {reason}; fix that row, or set data.skip_bad_rows = true to skip such rows"
                ) from None
            out.skipped += 1
            if len(out.reasons) < 5:
                out.reasons.append(reason)
            continue
        out.examples.append(row.example())
        out.sources.append(source)
    if out.skipped:
        logger.warning("data.path: skipped %d bad rows, e.g. %s", out.skipped, "; ".join(out.reasons))
    if not out.examples:
        raise ValueError(f"{field} = {path!r}: no usable conversations ({out.skipped} bad rows)")
    return out


def _reason(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'row'}: {err['msg']}" for err in e.errors()[:3])
    return str(e)


def _local(path: str, revision: str | None) -> Path:
    p = Path(path).expanduser()
    if p.exists():
        return p
    from jaxrl.models.hub import fetch_snapshot, is_hub_id

    if not is_hub_id(path):
        raise FileNotFoundError(f"data.path = {path!r}: no such file or directory, and not a Hugging Face dataset id")
    return fetch_snapshot(path, revision, repo_type="dataset", allow_patterns=["*.jsonl", "*.parquet", "**/*.jsonl", "**/*.parquet"], field="data.path")


def _rows(p: Path) -> Iterator[tuple[str, Any]]:
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".parquet"))
    if not files:
        raise FileNotFoundError(f"data.path = {str(p)!r}: no *.jsonl or *.parquet files there")
    for f in files:
        if f.suffix == ".parquet":
            yield from _parquet_rows(f)
            continue
        with f.open(encoding="utf-8") as lines:
            for i, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{f}:{i}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{f}:{i}", f"not JSON ({e.msg} at column {e.colno})"


def _parquet_rows(f: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"data.path: reading {f} needs pyarrow (`pip install pyarrow`)") from None
    for i, row in enumerate(pq.read_table(f).to_pylist(), 1):
        yield f"{f}:row {i}", row

"""Echo: GRPO plus cross-entropy on what the environment says back (DESIGN contract 5).

In each branch, the non-sampled message nodes after the first model response whose role is
enabled (tool output, user feedback, system notes) are observations the policy can learn to
predict. Their content tokens (the renderer's `is_content`; the whole node span where a
node has no attribution, never chat-template scaffold otherwise) get `ce_w = alpha` of their
role and `rl_w = 0`. An optional user filter, called once per trace, narrows the selection.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from jaxrl.orchestrator.algo.base import AlgoConfigBase
from jaxrl.orchestrator.algo.grpo import GRPO, GRPOConfig
from jaxrl.orchestrator.traces import Branch


class RoleEcho(AlgoConfigBase):
    alpha: float = Field(gt=0.0)
    """CE weight of each selected content token of this role."""


class ToolEcho(RoleEcho):
    tool_names: list[str] | None = None
    """Only outputs of these tools (None: every tool)."""


class EchoRoles(AlgoConfigBase):
    system: RoleEcho | None = None
    """System messages inserted after the first model response."""
    user: RoleEcho | None = None
    """User turns after the first model response (e.g. feedback)."""
    tool: ToolEcho | None = None
    """Tool outputs."""


class EchoFilter(AlgoConfigBase):
    import_path: str
    """`pkg.module:function` (or `pkg.module.function`), called once per trace as
    `function(trace, branches, **kwargs)` with the trace (wire dict) and its trainable
    `Branch`es; returns one bool list per branch, of the branch's length: False drops a
    token from the echo selection (a filter narrows, never widens)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the filter."""


class EchoConfig(GRPOConfig):
    type: Literal["echo"] = "echo"  # type: ignore[assignment]
    roles: EchoRoles = Field(default_factory=EchoRoles)
    """Per-role CE weights; unset roles are off."""
    filter: EchoFilter | None = None
    """Optional selection filter."""

    @model_validator(mode="after")
    def _some_role(self) -> EchoConfig:
        if not any((self.roles.system, self.roles.user, self.roles.tool)):
            raise ValueError(
                "echo: no role is enabled, so echo would equal grpo; set e.g. roles.tool.alpha = 0.1 "
                "(or use type = 'grpo')"
            )
        return self


def import_object(path: str) -> Callable[..., Any]:
    module, _, name = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module:
        raise ValueError(f"echo filter import_path {path!r} must be 'pkg.module:function'")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise TypeError(f"echo filter import_path {path!r} does not name a function")
    return fn


class Echo(GRPO):
    def __init__(self, config: EchoConfig) -> None:
        super().__init__(config)
        self.config: EchoConfig = config
        roles = config.roles
        self.alpha = {
            role: c.alpha
            for role, c in (("system", roles.system), ("user", roles.user), ("tool", roles.tool))
            if c
        }
        self.tool_names = (
            set(roles.tool.tool_names) if roles.tool and roles.tool.tool_names is not None else None
        )
        self.filter = import_object(config.filter.import_path) if config.filter else None

    def _filter_masks(self, trace: dict, branches: list[Branch]) -> list[np.ndarray]:
        assert self.filter is not None and self.config.filter is not None
        masks = self.filter(trace, branches, **self.config.filter.kwargs)
        path = self.config.filter.import_path
        if not isinstance(masks, list | tuple):
            raise TypeError(f"echo filter {path!r} must return a list of masks, got {type(masks).__name__}")
        if len(masks) != len(branches):
            got = len(masks)
            raise ValueError(
                f"echo filter {path!r} must return one mask per trainable branch: got {got}, expected {len(branches)}"
            )
        out = []
        for i, (mask, branch) in enumerate(zip(masks, branches)):
            arr = np.asarray(mask)
            if arr.shape != (len(branch),) or not (arr.dtype == bool or np.isin(arr, (0, 1)).all()):
                raise ValueError(
                    f"echo filter {path!r}: mask {i} must be {len(branch)} bools (the branch's length), "
                    f"got shape {arr.shape} dtype {arr.dtype}"
                )
            out.append(arr.astype(bool))
        return out

    def _selected(self, span) -> float:
        if span.sampled or span.role not in self.alpha:
            return 0.0
        if span.role == "tool" and self.tool_names is not None and span.tool_name not in self.tool_names:
            return 0.0
        return self.alpha[span.role]

    def ce_weights(self, trace: dict, branches: list[Branch]) -> list[np.ndarray | None]:
        keep = self._filter_masks(trace, branches) if self.filter else [None] * len(branches)
        out: list[np.ndarray | None] = []
        for branch, mask in zip(branches, keep):
            ce_w = np.zeros(len(branch), np.float32)
            seen_response = False
            for span in branch.spans:
                alpha = self._selected(span) if seen_response else 0.0
                if alpha:
                    ce_w[span.start : span.end] = alpha * branch.is_content[span.start : span.end]
                seen_response = seen_response or span.sampled
            if mask is not None:
                ce_w *= mask
            out.append(ce_w if ce_w.any() else None)
        return out

"""Echo: GRPO plus cross-entropy on what the environment says back (DESIGN contract 5).

In each branch, the non-sampled message nodes after the first model response whose role is
enabled (tool output, user feedback, system notes, assistant turns the policy did not sample)
are observations the policy can learn to predict. Their content tokens (the renderer's
`is_content`; the whole node span where a node has no attribution, never chat-template
scaffold otherwise) are *selected*: they get `ce_w = alpha` of their role and `rl_w = 0`. The
`assistant` role also selects the policy's own sampled tokens, so `assistant.alpha = 0` takes
them out of RL (an echo-only run) and a positive alpha trains them by CE instead of RL. An
optional user filter, called once per trace, narrows the selection; a filter that raises fails
that rollout (a failed-rollout record with the error), never the step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator

from jaxrl.imports import resolve_import_path
from jaxrl.orchestrator.algo.base import AlgoConfigBase, LossComponent
from jaxrl.orchestrator.algo.grpo import GRPO, GRPOConfig, Selection
from jaxrl.orchestrator.traces import Branch, NodeSpan

ROLES = ("system", "user", "assistant", "tool")


class RoleEcho(AlgoConfigBase):
    alpha: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    """CE weight of each selected token of this role (0: selected, so out of RL, but untrained)."""


class ToolEcho(RoleEcho):
    tool_names: list[str] | None = Field(None, min_length=1)
    """Only outputs of these tools (None: every tool; an empty list would select nothing)."""


class EchoRoles(AlgoConfigBase):
    system: RoleEcho | None = None
    """System messages inserted after the first model response."""
    user: RoleEcho | None = None
    """User turns after the first model response (e.g. feedback)."""
    assistant: RoleEcho | None = None
    """Assistant turns: the policy's own sampled tokens and, after the first response, the
    content of assistant messages it did not sample."""
    tool: ToolEcho | None = None
    """Tool outputs."""


FILTER_FIELD = "algo.filter.import_path"
"""The field a bad filter path's error names (resolved at config time)."""


def takes_branches(fn: Callable[..., Any], kwargs: dict[str, Any], path: str) -> bool:
    """Whether `fn(..., **kwargs)` is jaxrl's `(trace, branches)` form (else prime-rl's `(trace)`)."""
    signature = inspect.signature(fn)
    for two, args in ((True, (None, None)), (False, (None,))):
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            continue
        return two
    raise ValueError(
        f"echo filter {path!r} must take (trace, **kwargs) as prime-rl's filters do, or "
        f"(trace, branches, **kwargs); got {signature} with kwargs {sorted(kwargs)}"
    )


class EchoFilter(AlgoConfigBase):
    import_path: str
    """`pkg.module:function` (or `pkg.module.function`), called once per trace with
    `**kwargs`, in either form: prime-rl's `function(trace)` with the verifiers `Trace`, or
    `function(trace, branches)` with the trace's wire dict and its trainable `Branch`es. It
    returns one bool list per trainable branch, of the branch's length: False drops a token
    from the echo selection (a filter narrows, never widens)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments for the filter."""

    @model_validator(mode="after")
    def _importable(self) -> EchoFilter:
        takes_branches(resolve_import_path(self.import_path, FILTER_FIELD), self.kwargs, self.import_path)
        return self


class EchoConfig(GRPOConfig):
    type: Literal["echo"] = "echo"  # type: ignore[assignment]
    loss_components: ClassVar[frozenset[LossComponent]] = frozenset({"rl", "ce"})
    roles: EchoRoles = Field(default_factory=EchoRoles)
    """Per-role CE weights; unset roles are off."""
    filter: EchoFilter | None = None
    """Optional selection filter."""

    @model_validator(mode="after")
    def _some_role(self) -> EchoConfig:
        if not any(getattr(self.roles, role) for role in ROLES):
            raise ValueError(
                "echo: no role is enabled, so echo would equal grpo; set e.g. roles.tool.alpha = 0.1 "
                "(or use type = 'grpo')"
            )
        return self


class Echo(GRPO):
    def __init__(self, config: EchoConfig) -> None:
        super().__init__(config)
        self.config: EchoConfig = config
        self.alpha = {role: c.alpha for role in ROLES if (c := getattr(config.roles, role)) is not None}
        tool = config.roles.tool
        self.tool_names = set(tool.tool_names) if tool and tool.tool_names is not None else None
        self.filter = None
        if config.filter is not None:
            fn = resolve_import_path(config.filter.import_path, FILTER_FIELD)
            self.filter = fn, takes_branches(fn, config.filter.kwargs, config.filter.import_path)

    def _filter_masks(self, trace: dict, branches: list[Branch]) -> list[np.ndarray]:
        assert self.filter is not None and self.config.filter is not None
        fn, with_branches = self.filter
        kwargs = self.config.filter.kwargs
        if with_branches:
            masks = fn(trace, branches, **kwargs)
        else:
            from verifiers.v1 import WireTrace

            masks = fn(WireTrace.model_validate(trace), **kwargs)
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

    def _span_selected(self, branch: Branch, span: NodeSpan, after_response: bool) -> np.ndarray | None:
        """The selected tokens of one node span (a bool slice), or None."""
        if span.role not in self.alpha:
            return None
        if span.sampled:  # the policy's own tokens: only the assistant role selects them
            return branch.sampled_mask[span.start : span.end] if span.role == "assistant" else None
        if not after_response:
            return None
        if span.role == "tool" and self.tool_names is not None and span.tool_name not in self.tool_names:
            return None
        return branch.is_content[span.start : span.end]

    def echo(self, trace: dict, branches: list[Branch]) -> list[Selection | None]:
        keep = self._filter_masks(trace, branches) if self.filter else [None] * len(branches)
        out: list[Selection | None] = []
        for branch, mask in zip(branches, keep):
            ce_w = np.zeros(len(branch), np.float32)
            selected = np.zeros(len(branch), bool)
            seen_response = False
            for span in branch.spans:
                chosen = self._span_selected(branch, span, seen_response)
                if chosen is not None:
                    selected[span.start : span.end] |= chosen
                    ce_w[span.start : span.end] = np.where(chosen, self.alpha[span.role], 0.0)
                seen_response = seen_response or span.sampled
            if mask is not None:
                selected &= mask
                ce_w *= mask
            out.append((ce_w, selected) if selected.any() else None)
        return out

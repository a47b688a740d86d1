"""Traces -> branches -> training samples, on the plain-dict wire form of verifiers traces.

A verifiers v1 trace is a message graph: `trace["nodes"][i]` holds one message and only the
tokens that message adds (`token_ids`, `mask` = sampled by the policy, `logprobs` = one per
sampled token, `is_content` = the renderer's body-vs-scaffold attribution, possibly empty)
plus a `parent` link. A branch is one root-to-leaf path; concatenating its nodes' tokens
gives exactly the sequence the model saw, so each trainable branch becomes one
`TrainingSample` (DESIGN contract 4). Branches share nodes (the prompt, and everything before a
fork): each node is *owned* by the first trainable branch that contains it (leaf order, as
prime-rl), and only its owner trains its tokens; later branches carry it as context. So a
shared node counts once in every loss component and its token counts, however many branches
pass through it, and a branch with no sampled token of its own yields no sample.

Everything here works on plain dicts — `Episode.model_dump(mode="python")`, the msgpack wire
form with full-precision log-probs (the JSON record form rounds them) — so it is tested with
hand-built traces and never imports verifiers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxrl.training_sample import TrainingSample


@dataclass(frozen=True)
class NodeSpan:
    """Where one message node sits in a branch, and what it is."""

    node: int
    """Index into `trace["nodes"]`."""
    role: str
    start: int
    end: int
    sampled: bool
    """True iff a model call produced this message."""
    tool_name: str | None
    """For a tool message: the tool that produced it (its `name`, else the issuing call's)."""
    attributed: bool
    """Whether the renderer attributed content tokens for this node (`is_content` present)."""


@dataclass
class Branch:
    """One linear token sequence of a trace, with per-token provenance."""

    index: int
    token_ids: np.ndarray  # int32[L]
    sampled_mask: np.ndarray  # bool[L]
    logprobs: np.ndarray  # float32[L], 0 off the sampled tokens
    is_content: np.ndarray  # bool[L]; True over a whole node span that has no attribution
    spans: list[NodeSpan]
    trainable: bool
    """verifiers' trainable flag (a dangling compaction attempt is not) and a sampled token in a
    node this branch owns."""
    owned: np.ndarray
    """bool[L]: tokens of the nodes this branch owns (it is the first trainable branch holding
    them); weights elsewhere are zeroed so a shared node trains once."""
    routed_experts: np.ndarray | None = None
    """[L, n_moe_layers, k]: the experts the engine routed each token to (MoE engines asked for
    them; verifiers attaches each node's slice), None unless every node of the branch has its own."""
    versions: np.ndarray | None = None
    """int32[L]: the policy version that sampled each sampled token where the engine reported it
    (``attach_token_versions``), -1 elsewhere; None when no node of the branch carries any."""

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_sampled(self) -> int:
        return int(self.sampled_mask.sum())


def _leaves(nodes: Sequence[Mapping]) -> list[int]:
    parents = {n["parent"] for n in nodes if n.get("parent") is not None}
    return [i for i in range(len(nodes)) if i not in parents]


def _path(nodes: Sequence[Mapping], leaf: int) -> list[int]:
    path: list[int] = []
    current: int | None = leaf
    while current is not None:
        parent = nodes[current].get("parent")
        if parent is not None and not 0 <= parent < current:
            raise ValueError(f"trace node {current}: parent {parent} must index an earlier node")
        path.append(current)
        current = parent
    return path[::-1]


def _node_arrays(node: Mapping, nid: int) -> tuple[list[int], list[bool], list[float], list[bool]]:
    token_ids = list(node.get("token_ids") or [])
    mask = list(node.get("mask") or [])
    logprobs = list(node.get("logprobs") or [])
    is_content = list(node.get("is_content") or [])
    n = len(token_ids)
    if len(mask) != n:
        raise ValueError(f"trace node {nid}: mask has {len(mask)} entries for {n} token_ids")
    if is_content and len(is_content) != n:
        raise ValueError(f"trace node {nid}: is_content has {len(is_content)} entries for {n} token_ids")
    if len(logprobs) != sum(mask):
        raise ValueError(
            f"trace node {nid}: {len(logprobs)} logprobs for {sum(mask)} sampled tokens "
            "(the engine must return one logprob per sampled token)"
        )
    return token_ids, mask, logprobs, is_content


def _node_routing(node: Mapping, nid: int) -> np.ndarray | None:
    """A node's ``routed_experts``: verifiers' raw-bytes ``__nd__`` dict on the msgpack wire (or
    an array), one row per token; None when absent."""
    value = node.get("routed_experts")
    if value is None:
        return None
    if isinstance(value, Mapping):
        if not value.get("__nd__") or not isinstance(value.get("data"), bytes | bytearray | memoryview):
            return None  # the JSON record form drops the bytes: nothing to replay
        value = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    arr = np.asarray(value)
    n = len(node.get("token_ids") or [])
    if arr.ndim != 3 or arr.shape[0] != n:
        raise ValueError(f"trace node {nid}: routed_experts has shape {list(arr.shape)} for {n} token_ids")
    return arr


def _branch_routing(nodes: Sequence[Mapping], path: list[int]) -> np.ndarray | None:
    """The branch's routing rows, when every node with tokens carries its own (as verifiers'
    ``Trace.routed_experts``: partial routing is none)."""
    parts = [_node_routing(nodes[nid], nid) for nid in path if nodes[nid].get("token_ids")]
    if not parts or any(p is None for p in parts) or len({p.shape[1:] for p in parts}) != 1:
        return None
    return np.concatenate(parts)


def _tool_name(node: Mapping, call_names: Mapping[str, str]) -> str | None:
    message = node["message"]
    if message.get("role") != "tool":
        return None
    return message.get("name") or call_names.get(message.get("tool_call_id", ""))


def trace_branches(trace: Mapping[str, Any]) -> list[Branch]:
    """Every root-to-leaf branch of a trace, in leaf order (as verifiers' `Trace.branches`)."""
    nodes = trace.get("nodes") or []
    accepted_compactions = {
        link["node"]
        for n in nodes
        for link in n.get("semantic_parents") or []
        if link.get("type") == "compaction"
    }
    branches = []
    for index, leaf in enumerate(_leaves(nodes)):
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        versions: list[int] = []
        content: list[bool] = []
        spans: list[NodeSpan] = []
        call_names: dict[str, str] = {}
        for nid in _path(nodes, leaf):
            node = nodes[nid]
            t, m, lp, c = _node_arrays(node, nid)
            start = len(ids)
            ids += t
            mask += m
            it = iter(lp)
            logprobs += [next(it) if s else 0.0 for s in m]
            node_versions = iter(node.get("token_versions") or [-1] * len(lp))
            versions += [next(node_versions) if s else -1 for s in m]
            content += c if c else [True] * len(t)
            message = node["message"]
            spans.append(
                NodeSpan(
                    node=nid,
                    role=message["role"],
                    start=start,
                    end=len(ids),
                    sampled=bool(node.get("sampled", False)),
                    tool_name=_tool_name(node, call_names),
                    attributed=bool(c),
                )
            )
            for call in message.get("tool_calls") or []:
                call_names[call["id"]] = call["name"]
        compaction_attempt = any(
            link.get("type") == "compaction_attempt" for link in nodes[leaf].get("semantic_parents") or []
        )
        sampled = np.asarray(mask, dtype=bool)
        branches.append(
            Branch(
                index=index,
                token_ids=np.asarray(ids, dtype=np.int32),
                sampled_mask=sampled,
                logprobs=np.asarray(logprobs, dtype=np.float32),
                is_content=np.asarray(content, dtype=bool),
                spans=spans,
                trainable=bool(sampled.any()) and (not compaction_attempt or leaf in accepted_compactions),
                owned=np.zeros(len(ids), dtype=bool),
                routed_experts=_branch_routing(nodes, _path(nodes, leaf)),
                versions=np.asarray(versions, np.int32) if any(v >= 0 for v in versions) else None,
            )
        )
    _assign_ownership(branches)
    return branches


def _assign_ownership(branches: list[Branch]) -> None:
    """Give each node to the first trainable branch holding it; a branch left with no sampled
    token of its own is not trainable (its sampled nodes were all trained by earlier branches)."""
    owned_nodes: set[int] = set()
    for branch in branches:
        if not branch.trainable:
            continue
        for span in branch.spans:
            if span.node not in owned_nodes:
                branch.owned[span.start : span.end] = True
        if not (branch.owned & branch.sampled_mask).any():
            branch.trainable = False
            branch.owned[:] = False
            continue
        owned_nodes.update(span.node for span in branch.spans)


def trace_reward(trace: Mapping[str, Any]) -> float:
    """The trace's total reward: the weighted sum of its scored rewards (as `Trace.reward`)."""
    return float(sum(r["score"] * r.get("weight", 1.0) for r in (trace.get("rewards") or {}).values() if r))


TRUNCATING_STOPS = frozenset({"max_output_tokens", "max_total_tokens", "max_input_tokens"})
"""verifiers' ``stop_condition`` values of a trace cut off by a token limit (its ``max_turns``
is a turn budget: every answer there ended on its own, so it is no truncation here)."""


def trace_truncated(trace: Mapping[str, Any]) -> bool:
    """Whether the trace's answer was cut off by a length limit: its last model call that did not
    fail finished with ``finish_reason == "length"`` (the engine hit ``max_tokens``), or verifiers
    stopped it at a token limit (``TRUNCATING_STOPS``). DAPO's overlong filter drops these from
    the loss: a cut answer's reward says nothing about the answer it would have given."""
    if trace.get("stop_condition") in TRUNCATING_STOPS:
        return True
    calls = [c for c in trace.get("calls") or [] if c and not c.get("error")]
    return bool(calls) and calls[-1].get("finish_reason") == "length"


def trace_error(trace: Mapping[str, Any]) -> str | None:
    """`"Type: message"` of the trace's last error when it failed, else None."""
    if trace.get("ok", False):
        return None
    errors = trace.get("errors") or []
    if not errors:
        return f"trace {trace.get('id')} did not complete (stop: {trace.get('stop_condition')})"
    return f"{errors[-1]['type']}: {errors[-1]['message']}"


def episode_error(episode: Mapping[str, Any]) -> str | None:
    """The first failure of an episode: its own errors, else its first failed trace's."""
    errors = episode.get("errors") or []
    if errors:
        return f"{errors[-1]['type']}: {errors[-1]['message']}"
    for trace in episode.get("traces") or []:
        if (error := trace_error(trace)) is not None:
            return error
    if not episode.get("traces"):
        return "episode produced no trace"
    return None


def episode_traceback(episode: Mapping[str, Any] | None) -> str | None:
    """The traceback verifiers recorded with an episode's first failure (a reward, tool or
    harness that raised), where it kept one; None otherwise."""
    if not episode:
        return None
    failed = (t.get("errors") or [] for t in episode.get("traces") or [] if not t.get("ok", False))
    errors = episode.get("errors") or next(failed, [])  # the error episode_error names
    return errors[-1].get("traceback") if errors else None


def attach_token_versions(rollout: Rollout, answers_of: Callable[[str], list[list[int]] | None]) -> int:
    """Put the engine's per-token policy versions on each trace's sampled nodes, as
    ``node["token_versions"]`` (one per sampled token, the layout of ``logprobs``), from
    ``answers_of(trace id)``: the versions of each generate answer of that session, in order
    (``RolloutBackend.token_versions``). A trace whose answers do not match its sampled nodes one
    to one (count and lengths) is left as it is: its tokens keep the rollout's dispatch version.
    Returns the number of nodes annotated."""
    annotated = 0
    for trace in rollout.traces:
        answers = answers_of(str(trace.get("id")))
        sampled = [n for n in trace.get("nodes") or [] if any(n.get("mask") or [])]
        if not answers or len(answers) != len(sampled):
            continue
        if any(len(a) != sum(n["mask"]) for a, n in zip(answers, sampled)):
            continue
        for node, versions in zip(sampled, answers):
            node["token_versions"] = list(versions)
        annotated += len(sampled)
    return annotated


@dataclass
class Rollout:
    """One run of one task on an env server: its episode, or the error that replaced it.

    Failed runs (env errors, provider errors, timeouts, a dead server) are kept as records
    with `error` set; algorithms leave them out of baselines and samples.
    """

    env: str
    group_id: str
    task: dict
    """The task's wire data (what was dispatched)."""
    episode: dict | None
    """The episode in wire form (`WireEpisode.model_dump(mode="python")`); None if the run raised."""
    error: str | None = None
    policy_version: int = 0
    """Policy version at dispatch: the oldest policy that can have sampled this rollout."""
    temperature: float = 1.0
    """Sampling temperature of the run (fans out to every sampled token)."""
    seed: int | None = None
    """Sampling seed sent with every model request of the run (None: the engine chose one)."""
    metadata: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def traces(self) -> list[dict]:
        return list(self.episode["traces"]) if self.episode else []

    @property
    def trainable_traces(self) -> list[dict]:
        """Traces whose tokens train the policy (verifiers' `agent.trainable`)."""
        return [t for t in self.traces if (t.get("agent") or {}).get("trainable", True)]

    @property
    def reward(self) -> float:
        """Mean reward of the trainable traces (one trace for single-agent envs); 0 if none."""
        traces = self.trainable_traces
        return sum(trace_reward(t) for t in traces) / len(traces) if traces else 0.0

    def conversation(self) -> tuple[list[dict], list[dict]]:
        """(prompt, completion) of the first trainable trace as ``{"role", "content"}`` messages:
        the messages before the policy's first sampled one, and from it on."""
        traces = self.trainable_traces
        if not traces:
            return [], []
        nodes = traces[0].get("nodes") or []
        messages = [{"role": n["message"].get("role"), "content": n["message"].get("content")} for n in nodes]
        first = next((i for i, n in enumerate(nodes) if n.get("sampled")), len(nodes))
        return messages[:first], messages[first:]

    def to_record(self) -> dict:
        """A flat JSON-safe record for rollouts.jsonl; the raw episode (token ids, log-probs,
        every trace; raw routing/sampling-mask bytes dropped) is under ``episode``."""
        prompt, completion = self.conversation()
        return {
            "env": self.env,
            "prompt": prompt,
            "completion": completion,
            "reward": self.reward,
            "seed": self.seed,
            "error": self.error,
            **({"traceback": tb} if self.error and (tb := episode_traceback(self.episode)) else {}),
            "group_id": self.group_id,
            "policy_version": self.policy_version,
            "temperature": self.temperature,
            "task": self.task,
            "episode": _json_safe(self.episode),
            **({"metadata": self.metadata} if self.metadata else {}),
        }


def _json_safe(value: Any) -> Any:
    """Drop raw tensors (`__nd__` byte dicts, bytes) that only the msgpack wire can carry."""
    if isinstance(value, Mapping):
        if value.get("__nd__"):
            return None
        return {k: _json_safe(v) for k, v in value.items() if not isinstance(v, bytes)}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def branch_sample(
    branch: Branch,
    rollout: Rollout,
    *,
    advantage: float,
    rl_w: np.ndarray | None = None,
    ce_w: np.ndarray | None = None,
    ref_kl_w: np.ndarray | None = None,
    metadata: dict | None = None,
) -> TrainingSample:
    """The training sample of one branch: rl_w defaults to the sampled mask, ce_w and ref_kl_w to
    0; all are zeroed outside the tokens the branch owns (a shared node trains once)."""
    n = len(branch)
    rl_w = branch.sampled_mask.astype(np.float32) if rl_w is None else rl_w
    ce_w = np.zeros(n, np.float32) if ce_w is None else ce_w
    return TrainingSample(
        token_ids=branch.token_ids,
        sampled_mask=branch.sampled_mask,
        logprobs=branch.logprobs,
        rl_w=np.where(branch.owned, rl_w, 0.0).astype(np.float32),
        ce_w=np.where(branch.owned, ce_w, 0.0).astype(np.float32),
        ref_kl_w=None if ref_kl_w is None else np.where(branch.owned, ref_kl_w, 0.0).astype(np.float32),
        temperature=rollout.temperature,
        advantage=float(advantage),
        policy_version=rollout.policy_version,
        routed_experts=branch.routed_experts,
        token_versions=None if branch.versions is None else np.where(branch.versions >= 0, branch.versions, rollout.policy_version),
        metadata={
            "env": rollout.env,
            "group_id": rollout.group_id,
            "task_idx": rollout.task.get("idx"),
            "reward": rollout.reward,
            "branch": branch.index,
            **(metadata or {}),
        },
    )

"""Hand-built verifiers traces in wire form (plain dicts), for tests that need no server."""

from __future__ import annotations

from jaxrl.orchestrator.traces import Rollout

WIRE = {"task": {"type": "Task", "data": {"idx": 0}}, "agent": {"trainable": True, "config": {}}}
"""Fields a verifiers `WireTrace` needs beside the nodes (so prime-rl-form filters get one)."""


def node(role, tokens, *, parent, sampled=False, mask=None, logprobs=(), is_content=(), **message) -> dict:
    return {
        "parent": parent,
        "message": {"role": role, **message},
        "sampled": sampled,
        "token_ids": list(tokens),
        "mask": list(mask) if mask is not None else [False] * len(tokens),
        "logprobs": list(logprobs),
        "is_content": list(is_content),
    }


def tool_trace() -> dict:
    """system, user, assistant(tool call), tool, user (unattributed), assistant; plus a fork.

    Branch 0 = nodes 0-5 (23 tokens), branch 1 = nodes 0, 1, 6 (10 tokens).
    """
    F, T = False, True
    nodes = [
        node("system", [1, 2, 3, 4], parent=None, is_content=[F, T, T, F], content="sys"),
        node("user", [5, 6, 7, 8], parent=0, is_content=[F, T, T, F], content="ask"),
        node(
            "assistant",
            [9, 10, 11, 12, 13],
            parent=1,
            sampled=True,
            mask=[F, F, T, T, T],
            logprobs=[-0.1, -0.2, -0.3],
            is_content=[F, F, T, T, T],
            content=None,
            tool_calls=[{"id": "c1", "name": "lookup", "arguments": "{}"}],
        ),
        node("tool", [14, 15, 16, 17], parent=2, is_content=[F, T, T, F], content="out", tool_call_id="c1"),
        node("user", [18, 19, 20], parent=3, content="more"),
        node(
            "assistant",
            [21, 22, 23],
            parent=4,
            sampled=True,
            mask=[F, T, T],
            logprobs=[-0.4, -0.5],
            is_content=[F, T, T],
            content="done",
        ),
        node(
            "assistant",
            [30, 31],
            parent=1,
            sampled=True,
            mask=[F, T],
            logprobs=[-0.9],
            is_content=[F, T],
            content="fork",
        ),
    ]
    return {"id": "t-tool", "ok": True, "errors": [], **WIRE, "nodes": nodes}


def forked_trace() -> dict:
    """A fork *after* a sampled node: both branches contain assistant node 2 (sampled).

    nodes: 0 user [1,2,3] | 1 assistant [4,5,6] sampled (mask F,T,T) | 2 tool [7,8] (content 7,8)
    | 3 assistant [9,10] sampled (F,T) ; fork from node 1: 4 tool [11,12] | 5 assistant [13,14] (F,T).
    Branch 0 = nodes 0,1,2,3 (10 tokens); branch 1 = nodes 0,1,4,5 (10 tokens).
    """
    F, T = False, True
    nodes = [
        node("user", [1, 2, 3], parent=None, content="q"),
        node("assistant", [4, 5, 6], parent=0, sampled=True, mask=[F, T, T], logprobs=[-0.1, -0.2], content="a"),
        node("tool", [7, 8], parent=1, content="t1", tool_call_id="c1"),
        node("assistant", [9, 10], parent=2, sampled=True, mask=[F, T], logprobs=[-0.3], content="b"),
        node("tool", [11, 12], parent=1, content="t2", tool_call_id="c2"),
        node("assistant", [13, 14], parent=4, sampled=True, mask=[F, T], logprobs=[-0.4], content="c"),
    ]
    return {"id": "t-fork", "ok": True, "errors": [], **WIRE, "nodes": nodes}


def single_turn_trace(n_sampled: int, *, reward: float, trace_id: str = "t") -> dict:
    """system [1,2], user [3,4], assistant: 1 scaffold token + `n_sampled` sampled tokens."""
    nodes = [
        node("system", [1, 2], parent=None, content="s"),
        node("user", [3, 4], parent=0, content="u"),
        node(
            "assistant",
            [5] + [100 + i for i in range(n_sampled)],
            parent=1,
            sampled=True,
            mask=[False] + [True] * n_sampled,
            logprobs=[-0.5] * n_sampled,
            content="a",
        ),
    ]
    return {
        "id": trace_id,
        "ok": True,
        "errors": [],
        **WIRE,
        "nodes": nodes,
        "rewards": {"r": {"score": reward, "weight": 1.0}},
    }


def rollout(
    trace: dict | None, *, reward: float | None = None, error: str | None = None, group: str = "g"
) -> Rollout:
    if trace is not None and reward is not None:
        trace = {**trace, "rewards": {"r": {"score": reward, "weight": 1.0}}}
    episode = None if trace is None else {"errors": [], "traces": [trace]}
    return Rollout(
        env="e",
        group_id=group,
        task={"idx": 0},
        episode=episode,
        error=error,
        temperature=0.7,
        policy_version=3,
    )


def episode_rollout(traces: list[dict], *, idx: int = 0, env: str = "e", group: str = "g") -> Rollout:
    """A multi-agent rollout: several traces (seats) in one episode."""
    return Rollout(
        env=env, group_id=group, task={"idx": idx}, episode={"errors": [], "traces": traces},
        temperature=1.0, policy_version=1,
    )


def seat(role: str, reward: float, *, n_sampled: int = 2, trainable: bool = True) -> dict:
    """One agent's trace in a multi-agent episode (a single-turn reply)."""
    trace = single_turn_trace(n_sampled, reward=reward, trace_id=f"t-{role}")
    trace["agent"] = {"name": role, "trainable": trainable, "config": {}}
    return trace

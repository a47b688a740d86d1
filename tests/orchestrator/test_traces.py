"""Trace (wire dicts) -> branches -> samples, with exact expectations."""

from __future__ import annotations

import numpy as np
import pytest
from trace_builders import forked_trace, node, rollout, single_turn_trace, tool_trace

from jaxrl.orchestrator.traces import branch_sample, episode_error, trace_branches, trace_reward

F, T = False, True


def test_branches_walk_each_leaf_to_its_root():
    b0, b1 = trace_branches(tool_trace())
    assert [s.node for s in b0.spans] == [0, 1, 2, 3, 4, 5]
    assert [s.node for s in b1.spans] == [0, 1, 6]
    np.testing.assert_array_equal(b0.token_ids, np.arange(1, 24))
    np.testing.assert_array_equal(b1.token_ids, [1, 2, 3, 4, 5, 6, 7, 8, 30, 31])
    assert b0.token_ids.dtype == np.int32 and b0.trainable and b1.trainable


def test_sampled_mask_and_logprobs_spread_onto_sampled_positions():
    b0, b1 = trace_branches(tool_trace())
    assert np.flatnonzero(b0.sampled_mask).tolist() == [10, 11, 12, 21, 22]
    expected = np.zeros(23, np.float32)
    expected[[10, 11, 12, 21, 22]] = [-0.1, -0.2, -0.3, -0.4, -0.5]
    np.testing.assert_array_equal(b0.logprobs, expected)
    assert b1.logprobs.tolist() == pytest.approx([0] * 9 + [-0.9])


def test_content_attribution_with_whole_span_fallback():
    b0, _ = trace_branches(tool_trace())
    assert b0.is_content.tolist() == [F, T, T, F, F, T, T, F, F, F, T, T, T, F, T, T, F, T, T, T, F, T, T]
    spans = {s.node: s for s in b0.spans}
    assert (spans[3].role, spans[3].start, spans[3].end, spans[3].tool_name) == ("tool", 13, 17, "lookup")
    assert spans[4].attributed is False and spans[3].attributed is True
    assert spans[2].sampled and not spans[3].sampled


def test_tool_name_prefers_the_message_name():
    trace = tool_trace()
    trace["nodes"][3]["message"]["name"] = "search"
    assert trace_branches(trace)[0].spans[3].tool_name == "search"


def test_branch_without_sampled_tokens_is_not_trainable():
    trace = {"nodes": [node("system", [1, 2], parent=None), node("user", [3], parent=0)]}
    (branch,) = trace_branches(trace)
    assert not branch.trainable


def test_dangling_compaction_attempt_is_not_trainable():
    trace = tool_trace()
    trace["nodes"][6]["semantic_parents"] = [{"node": 2, "type": "compaction_attempt"}]
    assert [b.trainable for b in trace_branches(trace)] == [True, False]
    trace["nodes"][5]["semantic_parents"] = [{"node": 6, "type": "compaction"}]
    assert [b.trainable for b in trace_branches(trace)] == [True, True]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mask", [False, True], "mask has 2 entries for 5 token_ids"),
        ("logprobs", [-0.1], "1 logprobs for 3 sampled tokens"),
        ("is_content", [True], "is_content has 1 entries for 5 token_ids"),
    ],
)
def test_malformed_nodes_raise_naming_the_node(field, value, message):
    trace = tool_trace()
    trace["nodes"][2][field] = value
    with pytest.raises(ValueError, match=f"trace node 2: {message}"):
        trace_branches(trace)


def test_parent_must_be_an_earlier_node():
    trace = tool_trace()
    trace["nodes"][1]["parent"] = 4
    with pytest.raises(ValueError, match="trace node 1: parent 4 must index an earlier node"):
        trace_branches(trace)


def test_reward_and_errors():
    trace = {"rewards": {"a": {"score": 0.5, "weight": 2.0}, "b": {"score": 1.0, "weight": 0.25}, "c": None}}
    assert trace_reward(trace) == pytest.approx(1.25)
    ok = {"ok": True, "errors": []}
    failed = {"ok": False, "errors": [{"type": "ProviderError", "message": "engine 500"}]}
    assert episode_error({"errors": [], "traces": [ok]}) is None
    assert episode_error({"errors": [], "traces": [ok, failed]}) == "ProviderError: engine 500"
    assert episode_error({"errors": [{"type": "EnvError", "message": "x"}], "traces": []}) == "EnvError: x"
    assert episode_error({"errors": [], "traces": []}) == "episode produced no trace"


def test_rollout_reward_uses_trainable_traces_only():
    user_side = {**single_turn_trace(1, reward=0.0), "agent": {"trainable": False}}
    r = rollout(single_turn_trace(2, reward=0.75))
    r.episode["traces"].append(user_side)
    assert r.reward == pytest.approx(0.75)
    assert len(r.trainable_traces) == 1


def test_branch_sample_carries_temperature_version_and_metadata():
    r = rollout(single_turn_trace(3, reward=1.0))
    (branch,) = trace_branches(r.traces[0])
    sample = branch_sample(branch, r, advantage=0.25)
    assert (
        sample.temperature == pytest.approx(0.7) and sample.policy_version == 3 and sample.advantage == 0.25
    )
    assert sample.rl_w.tolist() == [0, 0, 0, 0, 0, 1, 1, 1] and not sample.ce_w.any()
    assert sample.logprobs.tolist() == pytest.approx([0, 0, 0, 0, 0, -0.5, -0.5, -0.5])
    assert sample.metadata == {"env": "e", "group_id": "g", "task_idx": 0, "reward": 1.0, "branch": 0}


def test_rollout_record_drops_raw_tensors():
    r = rollout(single_turn_trace(1, reward=1.0))
    r.episode["traces"][0]["nodes"][2]["routed_experts"] = {"__nd__": True, "data": b"\x00", "dtype": "uint8"}
    record = r.to_record()
    assert record["episode"]["traces"][0]["nodes"][2]["routed_experts"] is None
    assert record["reward"] == 1.0 and record["error"] is None and record["policy_version"] == 3
    assert record["prompt"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert record["completion"] == [{"role": "assistant", "content": "a"}]


def test_a_node_is_owned_by_the_first_trainable_branch_holding_it():
    b0, b1 = trace_branches(forked_trace())
    assert b0.owned.all()  # every node of branch 0 is first seen there
    # branch 1 shares nodes 0 (user) and 1 (sampled assistant): it owns only nodes 4 and 5
    assert np.flatnonzero(b1.owned).tolist() == [6, 7, 8, 9]
    assert b1.trainable and np.flatnonzero(b1.sampled_mask).tolist() == [4, 5, 9]


def test_a_branch_whose_sampled_nodes_are_all_shared_is_not_trainable():
    trace = forked_trace()
    del trace["nodes"][5]  # branch 1 now ends at the tool node 4: nodes 0, 1, 4
    b0, b1 = trace_branches(trace)
    assert b0.trainable and not b1.trainable and not b1.owned.any()


def test_branch_sample_carries_the_nodes_routed_experts():
    """verifiers' per-node ``__nd__`` routing slices join into the sample's [L, layers, k]; a node
    without its own slice leaves the branch without routing (partial routing is none)."""
    trace = single_turn_trace(3, reward=1.0)
    rows = np.arange(8 * 2 * 2, dtype=np.uint8).reshape(8, 2, 2)
    for nid, (a, b) in enumerate([(0, 2), (2, 4), (4, 8)]):
        part = rows[a:b]
        trace["nodes"][nid]["routed_experts"] = {"__nd__": True, "dtype": "uint8", "shape": list(part.shape), "data": part.tobytes()}
    r = rollout(trace)
    (branch,) = trace_branches(r.traces[0])
    np.testing.assert_array_equal(branch_sample(branch, r, advantage=1.0).routed_experts, rows)
    trace["nodes"][1]["routed_experts"] = None
    assert trace_branches(trace)[0].routed_experts is None
    trace["nodes"][1]["routed_experts"] = {"__nd__": True, "dtype": "uint8", "shape": [3, 2, 2], "data": bytes(12)}
    with pytest.raises(ValueError, match="trace node 1: routed_experts has shape"):
        trace_branches(trace)

"""Algorithms on hand-built groups, with exact numbers."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
from trace_builders import episode_rollout, forked_trace, rollout, seat, single_turn_trace, tool_trace

from jaxrl.orchestrator.algo import (
    EchoConfig,
    GRPOConfig,
    MaxRLConfig,
    OPDConfig,
    RAEConfig,
    SFTConfig,
    make_algorithm,
)
from jaxrl.orchestrator.config import EnvConfig
from jaxrl.trainer.packing import component_counts, pack

TOOL_CE = {14: 0.1, 15: 0.1}  # tool node 3 spans 13..17; content at 14, 15
USER_CE = {17: 0.2, 18: 0.2, 19: 0.2}  # user node 4 spans 17..20, no attribution: whole span


def ce_of(sample) -> dict[int, float]:
    return {int(i): pytest.approx(float(sample.ce_w[i])) for i in np.flatnonzero(sample.ce_w)}


def tool_group(rewards=(1.0, 0.0)):
    return [rollout(tool_trace(), reward=r) for r in rewards]


def test_grpo_advantage_is_reward_minus_group_mean():
    group = [rollout(single_turn_trace(2, reward=r)) for r in (1.0, 0.5, 0.0)]
    algo = make_algorithm(GRPOConfig())
    assert algo.advantages(group) == pytest.approx([0.5, 0.0, -0.5])
    samples = algo.samples(group)
    assert [s.advantage for s in samples] == pytest.approx([0.5, 0.0, -0.5])
    for s in samples:
        assert s.rl_w.tolist() == [0, 0, 0, 0, 0, 1, 1] and not s.ce_w.any()
        assert s.temperature == pytest.approx(0.7) and s.policy_version == 3


def test_grpo_std_normalize_divides_by_group_spread():
    group = [rollout(single_turn_trace(2, reward=r)) for r in (1.0, 0.5, 0.0)]
    algo = make_algorithm(GRPOConfig(std_normalize=True))
    std = np.std([1.0, 0.5, 0.0])
    assert algo.advantages(group) == pytest.approx([0.5 / std, 0.0, -0.5 / std], rel=1e-5)
    # A low-spread group gets the same weight as a wide one; equal rewards stay all-zero.
    narrow = [rollout(single_turn_trace(2, reward=r)) for r in (0.91, 0.9, 0.89)]
    assert algo.advantages(narrow) == pytest.approx(algo.advantages(group), rel=1e-3)
    equal = [rollout(single_turn_trace(2, reward=0.3)) for _ in range(3)]
    assert algo.advantages(equal) == pytest.approx([0, 0, 0]) and algo.samples(equal) == []


def test_grpo_length_penalty_is_prime_rl_linear_form():
    # prime-rl's own case (tests/unit/orchestrator/test_advantage.py): equal rewards, output
    # lengths 10/20/30, only the output term: penalty = 1 * 0.25 * [1/3, 2/3, 1].
    out_only = {"num_output_tokens_weight": 0.25, "num_input_tokens_weight": 0.0, "num_turns_weight": 0.0}
    algo = make_algorithm(GRPOConfig(length_penalty=out_only))
    group = [rollout(single_turn_trace(n, reward=1.0)) for n in (10, 20, 30)]
    assert algo.advantages(group) == pytest.approx([1 / 12, 0.0, -1 / 12], abs=1e-12)
    # Rewards [1, 1, 0]: the cut is scaled by the pass rate 2/3: shaped = r - 2/3 * 0.25 * [1/3, 2/3, 1].
    group = [rollout(single_turn_trace(n, reward=r)) for n, r in ((10, 1.0), (20, 1.0), (30, 0.0))]
    shaped = np.array([1.0, 1.0, 0.0]) - (2 / 3) * 0.25 * np.array([1 / 3, 2 / 3, 1.0])
    assert algo.advantages(group) == pytest.approx((shaped - shaped.mean()).tolist(), abs=1e-12)
    assert algo.advantages(group) == pytest.approx([7 / 18, 1 / 3, -13 / 18], abs=1e-12)


def test_grpo_length_penalty_input_and_turn_terms():
    # Input tokens = everything not sampled (4 prompt tokens + 1 scaffold in single_turn_trace);
    # a two-turn trace (tool_trace) has more of both. Terms normalise by the group max.
    lp = {"num_output_tokens_weight": 0.0, "num_input_tokens_weight": 0.5, "num_turns_weight": 0.0}
    group = [rollout(single_turn_trace(5, reward=1.0)), rollout(tool_trace(), reward=1.0)]
    # tool_trace: 7 nodes, 25 tokens, 6 sampled -> 19 input tokens; single_turn: 5 input tokens.
    adv = make_algorithm(GRPOConfig(length_penalty=lp)).advantages(group)
    shaped = 1.0 - 0.5 * np.array([5 / 19, 1.0])
    assert adv == pytest.approx((shaped - shaped.mean()).tolist(), abs=1e-12)
    turns = {"num_output_tokens_weight": 0.0, "num_input_tokens_weight": 0.0, "num_turns_weight": 0.3}
    adv = make_algorithm(GRPOConfig(length_penalty=turns)).advantages(group)  # 1 turn vs 3
    shaped = 1.0 - 0.3 * np.array([1 / 3, 1.0])
    assert adv == pytest.approx((shaped - shaped.mean()).tolist(), abs=1e-12)


def test_grpo_length_penalty_defaults_and_migration():
    lp = GRPOConfig.model_validate({"length_penalty": {}}).length_penalty
    assert (lp.num_output_tokens_weight, lp.num_input_tokens_weight, lp.num_turns_weight) == (0.25, 0.1, 0.1)
    with pytest.raises(pydantic.ValidationError, match=r"num_output_tokens_weight"):
        GRPOConfig.model_validate({"length_penalty": 0.01})
    with pytest.raises(pydantic.ValidationError, match="finite"):
        GRPOConfig.model_validate({"length_penalty": {"num_turns_weight": float("inf")}})
    with pytest.raises(pydantic.ValidationError, match="greater than or equal"):
        GRPOConfig.model_validate({"length_penalty": {"num_output_tokens_weight": -0.1}})


def test_max_rl_normalises_by_the_group_mean():
    algo = make_algorithm(MaxRLConfig())
    one_of_four = [rollout(single_turn_trace(2, reward=r)) for r in (1.0, 0.0, 0.0, 0.0)]
    assert algo.advantages(one_of_four) == pytest.approx([3.0, -1.0, -1.0, -1.0], abs=1e-12)
    assert [s.advantage for s in algo.samples(one_of_four)] == pytest.approx([3.0, -1.0, -1.0, -1.0])
    two_of_four = [rollout(single_turn_trace(2, reward=r)) for r in (1.0, 1.0, 0.0, 0.0)]
    assert algo.advantages(two_of_four) == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-12)
    # No success: no signal (not a division by zero); all successes centre to zero.
    assert algo.advantages([rollout(single_turn_trace(2, reward=0.0))] * 2) == [0.0, 0.0]
    assert algo.samples([rollout(single_turn_trace(2, reward=1.0))] * 2) == []
    # A failed rollout stays out of the mean: mean of (1, 0, 0) is 1/3.
    failed = [*one_of_four[:3], rollout(None, error="ProviderError: 500")]
    assert algo.advantages(failed) == pytest.approx([2.0, -1.0, -1.0], abs=1e-12)


def test_grpo_group_with_equal_rewards_trains_no_rl_tokens():
    group = [rollout(single_turn_trace(2, reward=0.3)) for _ in range(3)]
    algo = make_algorithm(GRPOConfig())
    assert algo.advantages(group) == pytest.approx([0, 0, 0])
    assert algo.samples(group) == []


def test_failed_rollouts_leave_the_baseline_and_give_no_samples():
    group = [
        rollout(single_turn_trace(2, reward=1.0)),
        rollout(single_turn_trace(2, reward=0.0)),
        rollout(None, error="ProviderError: engine 500"),
    ]
    algo = make_algorithm(GRPOConfig())
    assert algo.advantages(group) == pytest.approx([0.5, -0.5])  # one per member; the failed one has none
    assert len(algo.samples(group)) == 2
    assert algo.samples([group[2]]) == []


def test_grpo_makes_one_sample_per_trainable_branch():
    samples = make_algorithm(GRPOConfig()).samples(tool_group())
    assert [len(s) for s in samples] == [23, 10, 23, 10]
    assert [s.metadata["branch"] for s in samples] == [0, 1, 0, 1]


def test_a_shared_branch_node_is_trained_once():
    """forked_trace: both branches hold sampled node 1 (positions 4, 5); only branch 0 trains it.
    Per rollout: 4 RL tokens (4, 5, 9 | 9), not 6; the trainer's counts agree."""
    group = [rollout(forked_trace(), reward=r) for r in (1.0, 0.0)]
    samples = make_algorithm(EchoConfig(roles={"tool": {"alpha": 0.1}})).samples(group)
    assert [np.flatnonzero(s.rl_w).tolist() for s in samples] == [[4, 5, 9], [9], [4, 5, 9], [9]]
    assert [ce_of(s) for s in samples] == [{6: 0.1, 7: 0.1}] * 4  # each branch's own tool node
    batch = pack(samples, seq_len=32)
    assert component_counts(batch) == {"rl": 8.0, "ce": 8.0, "ref_kl": 0.0}  # was rl 12 with the node in both samples
    sft = make_algorithm(SFTConfig()).samples(group)
    assert [np.flatnonzero(s.ce_w).tolist() for s in sft] == [[4, 5, 9], [9], [4, 5, 9], [9]]


def test_echo_selects_content_of_enabled_roles_after_the_first_response():
    config = EchoConfig(roles={"tool": {"alpha": 0.1}, "user": {"alpha": 0.2}})
    b0, b1, *_ = make_algorithm(config).samples(tool_group())
    # the first user turn (before any response) and all scaffold stay out; unattributed user: whole span
    assert ce_of(b0) == {**TOOL_CE, **USER_CE}
    assert not b0.rl_w[list(TOOL_CE) + list(USER_CE)].any()
    assert np.flatnonzero(b0.rl_w).tolist() == [10, 11, 12, 21, 22]
    assert not b1.ce_w.any()  # nothing follows the fork's response


def test_echo_unset_roles_are_off():
    b0, *_ = make_algorithm(EchoConfig(roles={"tool": {"alpha": 0.1}})).samples(tool_group())
    assert ce_of(b0) == TOOL_CE


def test_echo_tool_names_allow_list():
    allowed = EchoConfig(roles={"tool": {"alpha": 0.1, "tool_names": ["lookup"]}})
    other = EchoConfig(roles={"tool": {"alpha": 0.1, "tool_names": ["search"]}})
    assert ce_of(make_algorithm(allowed).samples(tool_group())[0]) == TOOL_CE
    assert not make_algorithm(other).samples(tool_group())[0].ce_w.any()


def test_echo_keeps_ce_when_the_group_has_no_rl_signal():
    samples = make_algorithm(EchoConfig(roles={"tool": {"alpha": 0.1}})).samples(tool_group((0.5, 0.5)))
    assert len(samples) == 2  # the forks carry neither RL nor CE tokens
    for s in samples:
        assert not s.rl_w.any() and ce_of(s) == TOOL_CE


def keep_first_content_token(trace, branches, skip=0):
    return [[i != 14 + skip for i in range(len(b))] for b in branches]


def wrong_count(trace, branches):
    return [[True] * len(branches[0])]


def wrong_length(trace, branches):
    return [[True] * (len(b) - 1) for b in branches]


def raises(trace, branches):
    raise RuntimeError("boom")


def raises_on_a_win(trace, branches):
    if trace["rewards"]["r"]["score"] == 1.0:
        raise RuntimeError("boom")
    return [[True] * len(b) for b in branches]


def three_args(trace, branches, extra):
    return []


def prime_rl_form(trace, drop=14):
    """prime-rl's filter signature: fn(trace) with the verifiers Trace, masks per trainable branch."""
    return [[t != drop for t in branch.token_ids] for branch in trace.branches]


def test_echo_filter_narrows_the_selection():
    config = EchoConfig(
        roles={"tool": {"alpha": 0.1}}, filter={"import_path": f"{__name__}:keep_first_content_token"}
    )
    assert ce_of(make_algorithm(config).samples(tool_group())[0]) == {15: 0.1}
    widen = EchoConfig(
        roles={"tool": {"alpha": 0.1}},
        filter={"import_path": f"{__name__}:keep_first_content_token", "kwargs": {"skip": 2}},
    )
    assert ce_of(make_algorithm(widen).samples(tool_group())[0]) == TOOL_CE  # token 16 was never selected


def test_echo_filter_in_prime_rl_form_gets_the_verifiers_trace():
    # Token id 14 sits at position 13... tool content is ids 15, 16 at positions 14, 15: drop id 15.
    config = EchoConfig(
        roles={"tool": {"alpha": 0.1}},
        filter={"import_path": f"{__name__}:prime_rl_form", "kwargs": {"drop": 15}},
    )
    assert ce_of(make_algorithm(config).samples(tool_group())[0]) == {15: 0.1}


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("wrong_count", "must return one mask per trainable branch: got 1, expected 2"),
        ("wrong_length", "mask 0 must be 23 bools"),
        ("raises", "RuntimeError: boom"),
    ],
)
def test_echo_filter_failure_fails_the_rollout_not_the_step(fn, message):
    config = EchoConfig(roles={"tool": {"alpha": 0.1}}, filter={"import_path": f"{__name__}:{fn}"})
    group = tool_group()
    assert make_algorithm(config).samples(group) == []  # no exception
    assert [r.error.startswith("echo: ") and message in r.error for r in group] == [True, True]


def test_a_raising_filter_fails_only_its_rollout():
    config = EchoConfig(roles={"tool": {"alpha": 0.1}}, filter={"import_path": f"{__name__}:raises_on_a_win"})
    group = tool_group((1.0, 0.0, 0.5))
    samples = make_algorithm(config).samples(group)
    assert group[0].error == "echo: RuntimeError: boom" and group[1].ok and group[2].ok
    # the failed rollout leaves the baseline: mean of (0.0, 0.5)
    assert [s.advantage for s in samples] == pytest.approx([-0.25, -0.25, 0.25, 0.25])
    assert all(ce_of(s) == TOOL_CE for s in samples[::2])


def test_echo_filter_signature_is_checked_at_config_time():
    with pytest.raises(pydantic.ValidationError, match="must take"):
        EchoConfig(roles={"tool": {}}, filter={"import_path": f"{__name__}:three_args"})
    with pytest.raises(pydantic.ValidationError, match="cannot import"):
        EchoConfig(roles={"tool": {}}, filter={"import_path": "no_such_pkg:fn"})


def test_echo_role_options():
    config = EchoConfig(roles={"tool": {}})
    assert config.roles.tool.alpha == 1.0  # default alpha 1.0
    for bad, needle in (
        ({"tool": {"tool_names": []}}, "at least 1 item"),
        ({"tool": {"alpha": float("nan")}}, "finite"),
        ({"user": {"alpha": float("inf")}}, "finite"),
        ({"user": {"alpha": -0.1}}, "greater than or equal"),
    ):
        with pytest.raises(pydantic.ValidationError, match=needle):
            EchoConfig(roles=bad)


def test_echo_assistant_alpha_zero_removes_rl_on_assistant_tokens():
    # tool echo at 0.1 plus assistant at alpha 0: the policy's sampled tokens leave RL entirely.
    config = EchoConfig(roles={"tool": {"alpha": 0.1}, "assistant": {"alpha": 0.0}})
    b0, *_ = make_algorithm(config).samples(tool_group())
    assert not b0.rl_w.any() and ce_of(b0) == TOOL_CE
    # assistant alpha 0.5: the sampled tokens train by CE at 0.5 instead of RL.
    config = EchoConfig(roles={"assistant": {"alpha": 0.5}})
    b0, b1, *_ = make_algorithm(config).samples(tool_group())
    assert not b0.rl_w.any() and ce_of(b0) == {i: 0.5 for i in (10, 11, 12, 21, 22)}
    assert ce_of(b1) == {9: 0.5}


def test_echo_config_needs_a_role():
    with pytest.raises(pydantic.ValidationError, match="no role is enabled"):
        EchoConfig()


def test_opd_routes_every_sampled_token_to_ref_kl_whatever_the_reward():
    group = [rollout(forked_trace(), reward=r) for r in (1.0, 1.0)] + [rollout(None, error="E: x")]
    samples = make_algorithm(OPDConfig(teacher={"name": "t-dir"})).samples(group)
    assert [np.flatnonzero(s.ref_kl_w).tolist() for s in samples] == [[4, 5, 9], [9], [4, 5, 9], [9]]
    assert all(not s.rl_w.any() and not s.ce_w.any() and s.advantage == 0 for s in samples)
    assert all(s.needs_reference and s.metadata["teacher"] == "t-dir" for s in samples)
    with pytest.raises(pydantic.ValidationError, match="teacher"):
        OPDConfig()


def test_sft_trains_ce_on_sampled_tokens():
    group = [rollout(single_turn_trace(2, reward=r)) for r in (1.0, 0.2)]
    samples = make_algorithm(SFTConfig()).samples(group)
    assert len(samples) == 2
    for s in samples:
        assert s.ce_w.tolist() == [0, 0, 0, 0, 0, 1, 1] and not s.rl_w.any() and s.advantage == 0
    kept = make_algorithm(SFTConfig(min_reward=0.5)).samples(group)
    assert [s.metadata["reward"] for s in kept] == [1.0]


def test_algo_is_chosen_by_type_per_env():
    env = EnvConfig(
        id="lookup", algo={"type": "echo", "roles": {"tool": {"alpha": 0.1, "tool_names": ["lookup"]}}}
    )
    assert isinstance(env.algo, EchoConfig) and env.algo.roles.tool.tool_names == ["lookup"]
    assert isinstance(EnvConfig(id="lookup").algo, GRPOConfig)
    assert isinstance(EnvConfig(id="lookup", algo={"type": "sft"}).algo, SFTConfig)
    with pytest.raises(pydantic.ValidationError):
        EnvConfig(id="lookup", algo={"type": "ppo"})
    with pytest.raises(pydantic.ValidationError):
        EnvConfig(id="lookup", algo={"type": "grpo", "alpha": 1.0})


def debate(pro: float, con: float, *, idx: int = 0, judge: float = 5.0):
    return episode_rollout([seat("pro", pro), seat("con", con), seat("judge", judge, trainable=False)], idx=idx)


def test_zero_sum_members_get_their_own_credit_and_the_judge_none():
    """Before: one advantage per rollout from the mean of its seats (0 in a zero-sum game), so
    nothing trained. Now each seat is a member: +1/-1 around the group baseline 0; the judge
    (not trainable) is neither in the baseline (its 5.0 would move it) nor in any sample."""
    group = [debate(1.0, -1.0), debate(-1.0, 1.0)]
    assert [r.reward for r in group] == [0.0, 0.0]
    algo = make_algorithm(GRPOConfig())
    assert algo.advantages(group) == pytest.approx([1.0, -1.0, -1.0, 1.0])
    samples = algo.samples(group)
    assert [(s.metadata["role"], s.advantage) for s in samples] == [
        ("pro", 1.0), ("con", -1.0), ("pro", -1.0), ("con", 1.0)
    ]
    assert all(s.rl_w.any() for s in samples) and [s.metadata["reward"] for s in samples] == [1, -1, -1, 1]


def test_rae_baselines_per_env_example_and_role():
    algo = make_algorithm(RAEConfig(decay=0.9))
    # first sight of a key: baseline = that key's mean in the group (pro 0.5, con -0.5)
    assert algo.advantages([debate(1.0, -1.0), debate(0.0, 0.0)]) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert algo.baselines[("e", "0", "pro")] == pytest.approx(0.5)
    # next group of task 0: scored against 0.5 / -0.5, then b <- 0.9 b + 0.1 mean
    assert algo.advantages([debate(1.0, -1.0), debate(1.0, -1.0)]) == pytest.approx([0.5, -0.5, 0.5, -0.5])
    assert algo.baselines[("e", "0", "pro")] == pytest.approx(0.9 * 0.5 + 0.1 * 1.0)
    assert algo.baselines[("e", "0", "con")] == pytest.approx(0.9 * -0.5 + 0.1 * -1.0)
    # another task starts its own baselines; the judge never gets one
    assert algo.advantages([debate(1.0, -1.0, idx=7)]) == pytest.approx([0.0, 0.0])
    assert {k[2] for k in algo.baselines} == {"pro", "con"}
    # order of members within a group does not matter
    a, b = make_algorithm(RAEConfig()), make_algorithm(RAEConfig())
    g = [debate(1.0, -1.0), debate(0.0, 1.0), debate(1.0, 0.0)]
    a.advantages(g), b.advantages(g[::-1])
    assert a.baselines == pytest.approx(b.baselines)
    assert a.advantages([debate(1.0, 0.0)]) == pytest.approx(b.advantages([debate(1.0, 0.0)]))


def test_every_algorithm_declares_its_loss_components() -> None:
    """The run reads components, not algorithm names (jaxrl.rl.unused_metrics, load_teachers)."""
    import typing

    from jaxrl.orchestrator.algo import AlgoConfig

    declared = {c.model_fields["type"].default: c.loss_components for c in typing.get_args(typing.get_args(AlgoConfig)[0])}
    assert declared == {"grpo": {"rl"}, "max_rl": {"rl"}, "rae": {"rl"}, "echo": {"rl", "ce"}, "opd": {"ref_kl"},
                        "sft": {"ce"}}  # fmt: skip

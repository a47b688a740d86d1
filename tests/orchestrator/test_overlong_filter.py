"""DAPO's overlong filtering: members cut at the length limit get no RL weight (so no gradient),
stay in their group's baseline, and are counted in ``overlong_filtered_frac``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trace_builders import rollout, single_turn_trace

from jaxrl.orchestrator.algo import GRPOConfig, make_algorithm
from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.orchestrator import Group
from jaxrl.orchestrator.traces import trace_truncated
from jaxrl.trainer.loss import LossConfig, loss_sums
from jaxrl.trainer.packing import pack

STOP, LENGTH = {"finish_reason": "stop"}, {"finish_reason": "length"}


@pytest.mark.parametrize(
    ("extra", "cut"),
    [
        ({"calls": [STOP, LENGTH]}, True),  # the last answer hit max_tokens
        ({"calls": [LENGTH, STOP]}, False),  # an earlier turn was cut, the last one ended itself
        (
            {"calls": [LENGTH, {"finish_reason": None, "error": {"type": "ProviderError"}}]},
            True,
        ),  # failed calls skipped
        ({"calls": [STOP], "stop_condition": "max_output_tokens"}, True),
        ({"calls": [STOP], "stop_condition": "max_total_tokens"}, True),
        ({"calls": [STOP], "stop_condition": "max_turns"}, False),  # a turn budget, not a cut answer
        ({}, False),  # no calls recorded
    ],
)
def test_trace_truncated(extra, cut):
    assert trace_truncated({**single_turn_trace(3, reward=0.0), **extra}) is cut


def _group() -> list:
    """Rewards 1.0, 0.0 and 0.2; the last member was cut at the length limit."""
    traces = [
        {**single_turn_trace(3, reward=1.0, trace_id="a"), "calls": [STOP]},
        {**single_turn_trace(3, reward=0.0, trace_id="b"), "calls": [STOP]},
        {**single_turn_trace(3, reward=0.2, trace_id="cut"), "calls": [STOP, LENGTH]},
    ]
    return [rollout(t) for t in traces]


def _token_grads(samples) -> dict[str, np.ndarray]:
    """d loss / d logp on each sample's RL tokens (logp = logq + 0.05, kl_tau 0), by trace id."""
    batch = pack(samples, seq_len=len(samples[0]))  # equal lengths: row i holds sample i
    logq = jnp.asarray(batch.logq)
    mask = jnp.asarray(batch.loss_mask)
    args = [jnp.asarray(x) for x in (batch.advantages, batch.rl_w, batch.ce_w)]
    f = lambda lp: loss_sums(lp, logq, *args, mask, LossConfig(kl_tau=0.0))["rl_loss_sum"]
    grad = np.asarray(jax.grad(f)(logq + 0.05))
    return {s.metadata["trace_id"]: grad[i][batch.rl_w[i] != 0] for i, s in enumerate(samples)}


def test_a_truncated_member_has_no_gradient_and_stays_in_the_baseline():
    want_adv = {"a": 0.6, "b": -0.4, "cut": -0.2}  # rewards minus their mean 0.4, the cut one included
    off = make_algorithm(GRPOConfig()).samples(_group())
    on = make_algorithm(GRPOConfig(overlong_filter=True)).samples(_group())
    for samples in (off, on):
        for s in samples:
            assert s.advantage == pytest.approx(want_adv[s.metadata["trace_id"]])
    g_off, g_on = _token_grads(off), _token_grads(on)
    # Off: all three train (3 RL tokens each, gradient -A * r per token).
    assert sorted(g_off) == ["a", "b", "cut"]
    for tid, g in g_off.items():
        assert g.shape == (3,)
        np.testing.assert_allclose(g, -want_adv[tid] * np.exp(0.05), rtol=1e-5)
    # On: the cut member has no RL weight, so no sample and no gradient; the others are unchanged.
    assert sorted(g_on) == ["a", "b"]
    for tid, g in g_on.items():
        np.testing.assert_array_equal(g, g_off[tid])
        assert np.all(g != 0)


def test_the_filtered_fraction_is_a_batch_metric():
    for cfg, filtered in ((GRPOConfig(), 0.0), (GRPOConfig(overlong_filter=True), 1 / 3)):
        group = Group(env="e", step=1, rollouts=_group(), dispatch_version=0, seconds=0.0)
        batch = build_batch([group], {"e": make_algorithm(cfg)}, step=1)
        assert batch.metrics["truncated_frac"] == pytest.approx(1 / 3)
        assert batch.metrics["overlong_filtered_frac"] == pytest.approx(filtered)
        assert len(batch.samples) == 3 - 3 * filtered


def test_overlong_filter_is_a_bool_and_defaults_off():
    assert GRPOConfig().overlong_filter is False
    with pytest.raises(ValueError, match="overlong_filter"):
        GRPOConfig(overlong_filter="sometimes")

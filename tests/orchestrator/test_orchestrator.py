"""The orchestrator's batch production: a real env server process and a scripted endpoint."""

from __future__ import annotations

import time

import pytest

from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.orchestrator.orchestrator import Orchestrator, rollout_seeds

# Starts process trees of its own: one such module at a time (conftest).
pytestmark = pytest.mark.usefixtures("one_process_tree_at_a_time")


@pytest.mark.slow  # an env server per test: the slow tier
def test_resample_while_the_producer_waits_ahead_does_not_deadlock(endpoint, output_dir) -> None:
    """With max_async_level = 1 the producer runs ahead to step 3 and waits there for policy
    version 1; a resample of step 1 (no learning signal) must rewind it, not leave the trainer
    waiting for step 1's batch forever (a hang seen in RL runs before the fix)."""
    cfg = OrchestratorConfig(
        batch_size=2, group_size=2, max_async_level=1, train={"env": [{"id": "reverse_text"}]}
    )
    orch = Orchestrator(cfg, endpoint, output_dir=output_dir, seed=0, policy_version=lambda: 0)
    try:
        orch.start()
        batch = build_batch(orch.next_batch(1, timeout=120), orch.algorithms, 1)
        assert not batch.has_signal  # the scripted model solves every task: equal rewards
        orch.next_batch(2, timeout=120)
        deadline = time.monotonic() + 60
        while orch._next_step != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert orch._next_step == 3, "the producer should be waiting at step 3 for policy version 1"
        orch.request_more(1)
        again = orch.next_batch(1, timeout=120)
        assert len(again) == orch.groups_per_step and all(g.step == 1 for g in again)
    finally:
        orch.close()


def test_rollouts_are_seeded_by_draw_and_evals_reuse_their_seeds(engine, endpoint, output_dir) -> None:
    """Train rollouts sample with seeds fixed by (run seed, task draw, sample), so a run does not
    depend on request arrival order; every eval reuses its seeds (common random numbers)."""
    cfg = OrchestratorConfig(
        batch_size=4,
        group_size=2,
        max_async_level=0,
        train={"env": [{"id": "reverse_text"}]},
        eval={"num_tasks": 2, "k": 3},
    )
    orch = Orchestrator(cfg, endpoint, output_dir=output_dir, seed=3, policy_version=lambda: 0)
    try:
        orch.start()
        train = [r for g in orch.next_batch(1, timeout=120) for r in g.rollouts]
        _, first = orch.evaluate()
        _, second = orch.evaluate()
    finally:
        orch.close()
    expected_train = {s for draw in (0, 1) for s in rollout_seeds(3, "train", draw, n=2)}
    assert {r.seed for r in train} == expected_train and len(expected_train) == 4
    assert sorted(r.seed for r in first) == sorted(r.seed for r in second)
    assert len({r.seed for r in first}) == 6 and not {r.seed for r in first} & expected_train
    assert rollout_seeds(4, "train", 0, n=2) != rollout_seeds(3, "train", 0, n=2)
    sent = {req["body"]["sampling_params"].get("seed") for req in engine.requests}
    assert expected_train | {r.seed for r in first} <= sent  # the seed reaches the engine


@pytest.mark.slow  # an env server per test: the slow tier
def test_env_server_dying_past_max_restarts_stops_next_batch(endpoint, output_dir) -> None:
    """A dead env server is restarted up to max_restarts; once more, next_batch raises
    EnvServerDead naming the env and its log (the RL loop then checkpoints and exits 1)."""
    import os
    import signal

    import pytest

    from jaxrl.orchestrator.env_process import EnvServerDead

    env = {"id": "reverse_text", "max_restarts": 0}
    cfg = OrchestratorConfig(batch_size=2, group_size=2, max_async_level=0, train={"env": [env]})
    version = [0]
    orch = Orchestrator(cfg, endpoint, output_dir=output_dir, seed=0, policy_version=lambda: version[0])
    try:
        orch.start()
        orch.next_batch(1, timeout=120)
        (server,) = orch.train_servers
        os.kill(server.process.proc.pid, signal.SIGKILL)
        server.process.proc.wait()
        version[0] = 1  # on-policy: step 2's rollouts start only now, against the dead server
        with pytest.raises(EnvServerDead, match=f"(?s)'reverse_text' died.*{server.log_path}"):
            orch.next_batch(2, timeout=120)
    finally:
        orch.close()


@pytest.mark.slow  # an env server per test: the slow tier
def test_per_env_sampling_and_ratio_mixing(engine, endpoint, output_dir) -> None:
    """Env `a` samples at its own temperature and max tokens; `b` inherits the split's. Ratio 3:1
    gives three groups of `a` to one of `b` in a batch of four groups."""
    cfg = OrchestratorConfig(
        batch_size=8, group_size=2, max_async_level=0,
        train={
            "sampling": {"temperature": 1.0, "max_completion_tokens": 20},
            "env": [
                {"id": "reverse_text", "name": "a", "ratio": 3.0,
                 "sampling": {"temperature": 0.5, "max_completion_tokens": 7}},
                {"id": "reverse_text", "name": "b"},
            ],
        },
    )
    start = len(engine.requests)
    orch = Orchestrator(cfg, endpoint, output_dir=output_dir, seed=0, policy_version=lambda: 0)
    try:
        orch.start()
        groups = orch.next_batch(1, timeout=120)
    finally:
        orch.close()
    assert sorted(g.env for g in groups) == ["a", "a", "a", "b"]
    assert {(g.env, r.temperature) for g in groups for r in g.rollouts} == {("a", 0.5), ("b", 1.0)}
    sent = {(q["body"]["sampling_params"]["temperature"], q["body"]["sampling_params"]["max_tokens"])
            for q in engine.requests[start:]}
    assert sent == {(0.5, 7), (1.0, 20)}

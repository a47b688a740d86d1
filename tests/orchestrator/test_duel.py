"""reverse_duel through a real env server: two seats of one policy, zero-sum rewards, and
per-member credit gives both seats gradient (one shared rollout advantage would give none)."""

from __future__ import annotations

import numpy as np
import pytest
from scripted import SAMPLING, gather

from jaxrl.envs.common import similarity
from jaxrl.orchestrator.algo import GRPOConfig, make_algorithm
from jaxrl.orchestrator.config import EnvConfig
from jaxrl.orchestrator.env_server import start_env_servers
from jaxrl.orchestrator.env_tasks import task_data

pytestmark = pytest.mark.slow


def test_both_seats_of_a_zero_sum_duel_get_gradient(loop, engine, endpoint, output_dir):
    (server,) = loop.run_until_complete(
        start_env_servers([EnvConfig(id="reverse_duel", args={"num_tasks": 2})], output_dir=output_dir, kind="train")
    )
    try:
        task = task_data(next(iter(server.taskset())))
        group = loop.run_until_complete(server.run_group(task, endpoint, SAMPLING, 2, policy_version=1))
    finally:
        loop.run_until_complete(gather(server.aclose()))
    assert [r.error for r in group] == [None, None]
    margin = 1.0 - similarity(task["prompt"], task["answer"])  # scripted: first seat reverses, second echoes
    assert margin > 0
    for r in group:
        rewards = {t["agent"]["name"]: sum(x["score"] for x in t["rewards"].values()) for t in r.traces}
        assert rewards == pytest.approx({"first": margin, "second": -margin})
        assert r.reward == pytest.approx(0.0)  # the old rollout-level credit: nothing to learn
    # GRPO over the four members: baseline 0, so +-margin, and both seats' tokens train
    samples = make_algorithm(GRPOConfig()).samples(group)
    assert [(s.metadata["role"], round(s.advantage, 6)) for s in samples] == [
        ("first", round(margin, 6)), ("second", round(-margin, 6))
    ] * 2
    assert all(np.any(s.rl_w) for s in samples)

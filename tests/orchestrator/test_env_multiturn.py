"""A multi-turn env with a scripted user, served by a real verifiers `EnvServerPool` (two
worker processes) against the scripted model endpoint (fake_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
from scripted import SAMPLING, gather

from jaxrl.envs import alphabet_sort
from jaxrl.orchestrator.algo import EchoConfig, make_algorithm
from jaxrl.orchestrator.config import EnvConfig
from jaxrl.orchestrator.env_server import EnvServer
from jaxrl.orchestrator.env_tasks import task_data
from jaxrl.orchestrator.traces import attach_token_versions, branch_sample, trace_branches

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(loop, output_dir):
    config = EnvConfig(
        id="alphabet_sort",
        name="sort",
        pool_size=2,
        args={"split": "eval", "num_tasks": 10, "min_turns": 3, "max_turns": 3},
    )
    server = EnvServer(config, output_dir=output_dir, kind="eval")
    loop.run_until_complete(server.start())
    yield server
    loop.run_until_complete(server.aclose())


def test_scripted_user_turns_extend_one_branch(loop, server, engine, endpoint, tokenizer):
    tasks = [task_data(t) for t in server.taskset().take(2)]
    groups = loop.run_until_complete(gather(*(server.run_group(t, endpoint, SAMPLING, 2) for t in tasks)))
    for task, group in zip(tasks, groups):
        assert [r.error for r in group] == [None, None] and [r.reward for r in group] == [1.0, 1.0]
        trace = group[0].traces[0]
        assert trace["metrics"]["turns_correct"] == 1.0
        roles = [n["message"]["role"] for n in trace["nodes"]]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
        (branch,) = trace_branches(trace)  # bridged turns extend one token sequence
        # echo on user turns: the follow-ups' bodies, not the opening prompt, not the scaffold
        (sample, _) = make_algorithm(EchoConfig(roles={"user": {"alpha": 0.5}})).samples(group)
        follow_ups = [alphabet_sort.follow_up_message(names) for names in task["turns"][1:]]
        assert tokenizer.decode(sample.token_ids[sample.ce_w > 0]) == "".join(follow_ups)
        np.testing.assert_array_equal(sample.token_ids, branch.token_ids)
        replies = alphabet_sort.AlphabetSortData(turns=task["turns"]).expected()
        # one byte token per character of each reply, plus its <|im_end|>
        assert sample.sampled_mask.sum() == sum(len("\n".join(r)) + 1 for r in replies)
    # Per-token versions: the answers the engine gave each session (the trace id, sent as
    # X-Session-ID), in order, land on the trace's sampled nodes (here turn t "sampled at" 10 + t).
    rollout = groups[0][0]
    session = rollout.traces[0]["id"]
    answers = [r["answer"] for r in engine.requests if r["headers"].get("x-session-id") == session]
    assert len(answers) == 3 and attach_token_versions(rollout, lambda s: [[10 + t] * len(a) for t, a in enumerate(answers)] if s == session else None) == 3  # fmt: skip
    sample = branch_sample(trace_branches(rollout.traces[0])[0], rollout, advantage=0.0)
    turns = [10 + t for t, a in enumerate(answers) for _ in a]
    np.testing.assert_array_equal(sample.versions()[sample.sampled_mask], turns)
    assert (sample.versions()[~sample.sampled_mask] == rollout.policy_version).all()


def test_pool_shuts_down_with_its_workers(loop, server, output_dir):
    proc = server.process.proc
    loop.run_until_complete(server.aclose())
    assert proc.poll() == 0
    log = (output_dir / "logs" / "envs" / "eval" / "sort.log").read_text()
    assert "workers=2/2" in log and "EnvServerPool down" in log
    assert log.count("EnvServer down") == 2 and "Fatal Python error" not in log


def test_elastic_pool_grows_with_load_and_rollouts_stay_correct(loop, endpoint, tmp_path):
    """verifiers' elastic EnvServerPool: one worker at start, another once rollouts in flight
    reach 90% of workers * worker_capacity, up to pool_size (verifiers 0.4 never shrinks it)."""
    config = EnvConfig(
        id="alphabet_sort", name="sort", pool_size=3, elastic=True, worker_capacity=1,
        args={"split": "eval", "num_tasks": 10, "min_turns": 2, "max_turns": 2},
    )  # fmt: skip
    server = EnvServer(config, output_dir=tmp_path, kind="eval")
    loop.run_until_complete(server.start())
    try:
        log_path = tmp_path / "logs" / "envs" / "eval" / "sort.log"
        assert "workers=1/3" in log_path.read_text()  # elastic: one worker to begin with
        tasks = [task_data(t) for t in server.taskset().take(3)]
        groups = loop.run_until_complete(gather(*(server.run_group(t, endpoint, SAMPLING, 2) for t in tasks)))
        assert [[r.error for r in g] for g in groups] == [[None, None]] * 3
        assert [[r.reward for r in g] for g in groups] == [[1.0, 1.0]] * 3
    finally:
        loop.run_until_complete(server.aclose())
    log = log_path.read_text()
    assert "elastic=True" in log and "scaled up to 2/3" in log, log[-3000:]
    assert "scaled up to 4/" not in log  # capped at pool_size

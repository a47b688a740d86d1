"""Failed rollouts are counted and reported per step, across resamples (a real env server
process and a scripted endpoint): a step whose first batch failed and was resampled reports
those failures in ``rollouts_failed``, in one log line with the first error; a step whose
every rollout fails stops with a message that says so, with the error and the env's log."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
from fake_engine import FakeEngine

from jaxrl.endpoint import ModelEndpoint
from jaxrl.orchestrator.batch import BatchFailed, collect_batch
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.orchestrator.orchestrator import Orchestrator

# Starts process trees of its own: one such module at a time (conftest).
pytestmark = pytest.mark.usefixtures("one_process_tree_at_a_time")


class FlakyPolicy:
    """The first ``fail`` calls raise (a provider error); then, per prompt, every other reply is
    the exact reversal and the rest are wrong: each group of two has a reward spread."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls, self.per_prompt, self.lock = fail, 0, Counter(), threading.Lock()

    def __call__(self, messages: list[dict]) -> str:
        text = messages[-1]["content"]
        with self.lock:
            self.calls += 1
            if self.calls <= self.fail:
                raise RuntimeError("harness could not start")
            self.per_prompt[text] += 1
            good = self.per_prompt[text] % 2
        return text[::-1] if good else "x"


def _collect(orch: Orchestrator, step: int, written: list[dict]):
    return collect_batch(
        lambda: orch.next_batch(step, timeout=120), lambda: orch.request_more(step), orch.algorithms, step,
        max_resample=2, write=written.extend, env_logs=orch.env_logs(),
    )  # fmt: skip


@pytest.mark.parametrize("fail", [4, pytest.param(10**6, marks=pytest.mark.slow)])  # an env server each
def test_failed_rollouts_are_counted_across_resamples(fail, tokenizer_dir, tmp_path, caplog) -> None:
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_async_level=0, train={"env": [{"id": "reverse_text"}]})
    with FakeEngine(tokenizer_dir, FlakyPolicy(fail)) as engine:
        endpoint = ModelEndpoint(base_url=engine.base_url, model=engine.model, tokenizer_dir=tokenizer_dir)
        orch = Orchestrator(cfg, endpoint, output_dir=tmp_path, seed=0, policy_version=lambda: 0)
        written: list[dict] = []
        try:
            orch.start()
            with caplog.at_level(logging.DEBUG):
                if fail > 4:  # every rollout fails: the error says so, not "no learning signal"
                    with pytest.raises(BatchFailed) as e:
                        _collect(orch, 1, written)
                    message = str(e.value)
                    assert "every rollout failed (12 in 3 batches)" in message, message
                    assert "harness could not start" in message and str(orch.env_logs()["reverse_text"]) in message
                    assert "learning signal" not in message
                    return
                batch = _collect(orch, 1, written)
        finally:
            orch.close()
    assert batch.has_signal and batch.metrics["rollouts_failed"] == 4.0  # the resampled batch's failures count
    assert batch.metrics["resampled_batches"] == 1.0 and batch.metrics["rollouts_failed_frac"] == 0.5
    assert [r["fate"] for r in written] == ["failed"] * 4 and all(r["resampled"] for r in written)
    summaries = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "rollout" in r.getMessage()]
    assert len(summaries) == 1, summaries  # one line for the step, not one per failed rollout
    assert "step 1: 4 of 8 rollouts failed (2 batches)" in summaries[0] and "harness could not start" in summaries[0]


@pytest.mark.slow  # a killed and restarted env server: the slow tier
def test_a_dead_env_server_is_restarted_and_its_failed_rollouts_counted(tokenizer_dir, tmp_path) -> None:
    """The env server dies with the step's 4 rollouts in flight: they fail, the batch is
    resampled on the restarted server, and the step reports the 4 failures (it read 0)."""
    import signal
    import time

    policy = FlakyPolicy(0)
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_async_level=0, train={"env": [{"id": "reverse_text"}]})
    def slow(messages: list[dict]) -> str:
        time.sleep(3)  # keeps the rollouts in flight while the server is killed
        return policy(messages)

    with FakeEngine(tokenizer_dir, slow) as engine:
        endpoint = ModelEndpoint(base_url=engine.base_url, model=engine.model, tokenizer_dir=tokenizer_dir)
        orch = Orchestrator(cfg, endpoint, output_dir=tmp_path, seed=0, policy_version=lambda: 0)
        written: list[dict] = []
        try:
            orch.start()
            deadline = time.monotonic() + 120
            while len(engine.requests) < 4:  # every rollout of step 1 is waiting on the model
                assert time.monotonic() < deadline
                time.sleep(0.05)
            server = orch.train_servers[0]
            server.process.proc.send_signal(signal.SIGKILL)
            batch = _collect(orch, 1, written)
            assert server.restarts == 1
        finally:
            orch.close()
    assert batch.has_signal and batch.metrics["rollouts_failed"] == 4.0 and batch.metrics["resampled_batches"] == 1.0
    assert [r["fate"] for r in written] == ["failed"] * 4 and all("died" in r["error"] for r in written)

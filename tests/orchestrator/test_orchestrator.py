"""The orchestrator's batch production: a real env server process and a scripted endpoint."""

from __future__ import annotations

import time

from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.orchestrator.orchestrator import Orchestrator


def test_resample_while_the_producer_waits_ahead_does_not_deadlock(endpoint, output_dir) -> None:
    """With max_async_level = 1 the producer runs ahead to step 3 and waits there for policy
    version 1; a resample of step 1 (no learning signal) must rewind it, not leave the trainer
    waiting for step 1's batch forever (a hang seen in RL runs before the fix)."""
    cfg = OrchestratorConfig(batch_size=2, group_size=2, max_async_level=1, train={"env": [{"id": "reverse_text"}]})
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

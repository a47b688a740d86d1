"""DAPO's dynamic sampling (a real env server process and a scripted endpoint): groups whose
rewards are all equal are dropped and refilled, up to ``max_refills`` rounds; and DAPO's soft
overlong shaping of rewards."""

from __future__ import annotations

import threading

import numpy as np
import pydantic
import pytest
from fake_engine import FakeEngine

from jaxrl.endpoint import ModelEndpoint
from jaxrl.orchestrator.algo.grpo import OverlongShaping
from jaxrl.orchestrator.batch import collect_batch
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.orchestrator.orchestrator import Orchestrator


class FirstPromptsFlat:
    """The first ``flat`` distinct prompts always get the same wrong reply (a group with equal
    rewards); later prompts alternate the exact reversal and a wrong reply (a reward spread)."""

    def __init__(self, flat: int) -> None:
        self.flat, self.seen, self.calls, self.lock = flat, [], {}, threading.Lock()

    def __call__(self, messages: list[dict]) -> str:
        text = messages[-1]["content"]
        with self.lock:
            if text not in self.seen:
                self.seen.append(text)
            self.calls[text] = self.calls.get(text, 0) + 1
            flat = self.seen.index(text) < self.flat
            good = self.calls[text] % 2
        return "x" if flat or not good else text[::-1]


def _run(tokenizer_dir, tmp_path, *, flat: int, max_refills: int):
    cfg = OrchestratorConfig(
        batch_size=4, group_size=2, max_async_level=0, train={"env": [{"id": "reverse_text"}]},
        dynamic_sampling={"max_refills": max_refills},
    )  # fmt: skip
    with FakeEngine(tokenizer_dir, FirstPromptsFlat(flat)) as engine:
        endpoint = ModelEndpoint(base_url=engine.base_url, model=engine.model, tokenizer_dir=tokenizer_dir)
        orch = Orchestrator(cfg, endpoint, output_dir=tmp_path, seed=0, policy_version=lambda: 0)
        written: list[dict] = []
        try:
            orch.start()
            batch = collect_batch(
                lambda n=None: orch.next_batch(1, timeout=120, n=n), lambda n=None: orch.request_more(1, n),
                orch.algorithms, 1, max_resample=2, write=written.extend, dynamic=cfg.dynamic_sampling,
            )  # fmt: skip
        finally:
            orch.close()
    return batch, written


@pytest.mark.slow  # an env server per test: the slow tier
def test_equal_reward_groups_are_dropped_and_refilled(tokenizer_dir, tmp_path) -> None:
    batch, written = _run(tokenizer_dir, tmp_path, flat=2, max_refills=4)
    assert written == []  # no resample
    m = batch.metrics
    assert (m["dynamic_dropped_groups"], m["dynamic_refills"], m["dynamic_missing_groups"]) == (2.0, 1.0, 0.0)
    dropped = [r for r in batch.records if r.get("dropped")]
    assert len(dropped) == 4 and {r["fate"] for r in dropped} == {"no_signal"}
    trained = [r for r in batch.records if not r.get("dropped")]
    assert len(trained) == 4 and {r["fate"] for r in trained} == {"trained"}
    assert len({s.metadata["group_id"] for s in batch.samples}) == 2  # two full groups with signal
    assert m["rollouts"] == 4.0  # reward and rollout metrics describe what is trained


@pytest.mark.slow  # an env server per test: the slow tier
def test_refills_stop_at_the_cap(tokenizer_dir, tmp_path) -> None:
    """Four flat prompts and one refill round: the first try keeps nothing (written, resampled);
    the resample's two new prompts have signal."""
    batch, written = _run(tokenizer_dir, tmp_path, flat=4, max_refills=1)
    assert len(written) == 8 and all(r["dropped"] and r["resampled"] for r in written)
    assert batch.metrics["resampled_batches"] == 1.0 and batch.has_signal
    assert batch.metrics["dynamic_dropped_groups"] == 0.0


def test_overlong_shaping_matches_dapo() -> None:
    """L_max 10, L_c 4: no penalty up to 6 tokens, linear to -penalty at 10, -penalty beyond."""
    shaping = OverlongShaping(max_tokens=10, buffer=4, penalty=0.5)
    lengths = np.array([0, 6, 7, 8, 10, 11, 500])
    want = 0.5 * np.array([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    np.testing.assert_allclose(shaping.shaping(lengths), want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_tokens": 8, "buffer": 8}, "buffer = 8 must be below"), ({"max_tokens": 8, "buffer": 0}, "buffer"),
     ({"max_tokens": 8, "buffer": 2, "penalty": -1}, "penalty")],
)  # fmt: skip
def test_overlong_bounds(kwargs, message) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        OverlongShaping(**kwargs)


def test_dynamic_sampling_bounds() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_refills"):
        OrchestratorConfig(batch_size=4, group_size=2, dynamic_sampling={"max_refills": -1})

"""The learning-rate schedule: a warmed-up run's first update trains (issue 42, item 7)."""

from __future__ import annotations

import pytest

from jaxrl.trainer.optim import OptimConfig, make_schedule


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_first_update_is_not_zero(schedule: str) -> None:
    """optax's ``linear_schedule(0, lr, n)`` is 0 at count 0: every warmed-up run's step 1 was
    wasted. The warm-up is now ``lr * k / (warmup_steps + 1)`` for updates k = 1..warmup_steps,
    then the peak."""
    s = make_schedule(OptimConfig(lr=1.0, warmup_steps=3, schedule=schedule), total_steps=10)
    assert [round(float(s(i)), 6) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert float(s(9)) <= 1.0


def test_no_warmup_starts_at_peak() -> None:
    s = make_schedule(OptimConfig(lr=2.0, warmup_steps=0, schedule="constant"), total_steps=5)
    assert [float(s(i)) for i in range(3)] == [2.0, 2.0, 2.0]

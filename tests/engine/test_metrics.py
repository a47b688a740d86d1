"""The engine's rate window: tokens/s over recent engine steps, 0 once the engine goes idle."""

from __future__ import annotations

import pytest

from jaxrl.engine.metrics import RateWindow


def test_rate_window_measures_recent_rate_and_forgets_old_steps() -> None:
    w = RateWindow(window_s=10.0)
    assert w.rate(now=0.0) == 0.0
    for t in range(31):  # 100 tokens/s for 30 s
        w.add(100 * t, now=float(t))
    assert w.rate(now=30.0) == pytest.approx(100.0)
    w.add(3100, now=31.0)  # then 100 tokens in one step, then silence
    assert w.rate(now=31.0) == pytest.approx(100.0)
    assert w.rate(now=35.0) == pytest.approx(1100 / 15)  # from the last step before the window
    assert w.rate(now=50.0) == 0.0
    assert len(w._points) <= 13  # old steps are dropped

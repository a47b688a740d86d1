"""What the engine reports about itself (``Engine.metrics``, ``GET /metrics``, the RL loop's
``engine/...`` keys): load, throughput, prefix-cache reuse and compiles.

Why a view of its own: the scheduler's counters are cumulative totals; operators and the RL
loop want rates and ratios (tokens/s now, share of prompt tokens served from the prefix cache)
and want to see a compile happening after start-up (it means a bucket the warm-up missed).
"""

from __future__ import annotations

import time
from collections import deque

from pydantic import BaseModel


class RateWindow:
    """A counter's rate over the last ``window_s`` seconds, from samples taken at engine steps."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._points: deque[tuple[float, int]] = deque()

    def add(self, total: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._points.append((now, total))
        while len(self._points) > 2 and self._points[1][0] < now - self.window_s:
            self._points.popleft()

    def rate(self, now: float | None = None) -> float:
        """Counter increase per second between the oldest sample in the window and ``now``
        (0 when nothing happened in the window)."""
        now = time.monotonic() if now is None else now
        points = [p for p in self._points if p[0] >= now - self.window_s]
        if not points:
            return 0.0
        start = self._points[0] if self._points[0][0] < points[0][0] else points[0]
        span = now - start[0]
        return (points[-1][1] - start[1]) / span if span > 0 else 0.0


class EngineMetrics(BaseModel):
    """One snapshot of the engine (``GET /metrics`` answers it as JSON)."""

    waiting: int
    """Requests queued for a KV cache row (not yet admitted)."""
    running: int
    """Sequences holding a KV cache row (prefilling or decoding)."""
    policy_version: int
    generated_tokens: int
    """Completion tokens sampled since start-up."""
    tokens_per_s: float
    """Completion tokens sampled per second over the last ``RateWindow.window_s`` seconds."""
    prompt_tokens: int
    """Prompt tokens of admitted requests since start-up."""
    cached_prompt_tokens: int
    """... of which were served from the prefix cache (not recomputed)."""
    prefix_hit_rate: float
    """cached_prompt_tokens / prompt_tokens (0 before any request)."""
    shared_prefix_positions: int
    """Cached positions that calls read from one row shared by several (copies of one prompt
    prefill: a GRPO group, a system prompt) instead of each row's own copy (the CPU kernel uses
    it; summed over calls, once per call not per step)."""
    kv_cache_bytes: int
    """The KV cache's size (keys and values, every layer, all ``max_seqs`` rows, summed over
    devices): allocated once at start-up, so it is what the engine holds whatever the load."""
    kv_bytes_per_sequence: int
    """... of which one sequence (one row of ``max_model_len`` positions) takes."""
    kv_tokens_in_use: int
    """Positions the running sequences have written (prompt + completion so far); at most
    ``running * max_model_len``."""
    prefill_calls: int
    decode_calls: int
    compiles: int
    """Device programs compiled so far; after a complete warm-up it stays at ``program_bound``."""
    program_bound: int
    warmup_s: float | None
    """Seconds the start-up warm-up took (None: no warm-up ran)."""
    step_s: float
    """Seconds the engine thread spent in engine steps since start-up (the rest it was idle)."""
    device_s: float
    """... of which inside device calls (prefill, decode, row copies) until their results were
    back on the host; ``step_s - device_s`` is host work: scheduling, batch building, reading
    tokens out, completing requests. Where rollouts wait on the engine, this split says which."""
    prefill_s: float
    """... of ``device_s``, in prefill calls."""
    decode_s: float
    """... of ``device_s``, in decode calls."""

"""What the engine reports about itself (``Engine.metrics``; the server's ``GET /metrics``, in
Prometheus text, and ``GET /metrics.json``; the RL loop's ``engine/...`` keys): load,
throughput, prefix-cache reuse, compiles, finished requests and their latencies.

Why a view of its own: the scheduler's counters are cumulative totals; operators and the RL
loop want rates and ratios (tokens/s now, share of prompt tokens served from the prefix cache)
and want to see a compile happening after start-up (it means a bucket the warm-up missed).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence

from pydantic import BaseModel, Field

LATENCY_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histograms' buckets: vLLM's time-to-first-token
buckets, so dashboards built for vLLM read ours the same."""


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


class Histogram(BaseModel):
    """A latency histogram's snapshot: ``counts[i]`` observations were <= ``buckets[i]`` and above
    the bucket before (not cumulative); ``count - sum(counts)`` were above the last bound."""

    buckets: list[float]
    counts: list[int]
    sum: float
    count: int


class LatencyHistogram:
    """Observations in ``LATENCY_BUCKETS_S`` buckets, thread-safe (the engine thread observes,
    the HTTP thread reads): cumulative since start-up, as Prometheus histograms are."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS_S):
        self.buckets = tuple(buckets)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            if i < len(self._counts):
                self._counts[i] += 1
            self._sum += seconds
            self._count += 1

    def snapshot(self) -> Histogram:
        with self._lock:
            return Histogram(buckets=list(self.buckets), counts=list(self._counts), sum=self._sum, count=self._count)


class RequestStats:
    """Per-request outcomes the engine counts as requests finish: how each finished and how long
    it waited for its first token and for all of them (from ``Engine.submit``)."""

    def __init__(self) -> None:
        self.time_to_first_token = LatencyHistogram()
        self.e2e_latency = LatencyHistogram()
        self._finished: Counter[str] = Counter()
        self._lock = threading.Lock()

    def finished(self, reason: str, seconds: float | None = None) -> None:
        """One request ended: "stop" | "length" | "abort" | "error" (the engine step failed)."""
        with self._lock:
            self._finished[reason] += 1
        if seconds is not None:
            self.e2e_latency.observe(seconds)

    def finished_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._finished)


class EngineMetrics(BaseModel):
    """One snapshot of the engine (``GET /metrics.json`` answers it as JSON; ``GET /metrics``
    renders it as Prometheus text, ``jaxrl.serving.prometheus``)."""

    waiting: int
    """Requests queued for a KV cache row (not yet admitted)."""
    running: int
    """Sequences holding a KV cache row (prefilling or decoding)."""
    max_seqs: int
    """KV cache rows: at most this many sequences run at once (``inference.max_seqs``)."""
    max_model_len: int
    quantization: str = "none"
    """How the projections are served (``inference.backend.quantization``): an external
    trainer's direct transfer sends them already in this form."""
    policy_version: int
    weight_update_failures: int = 0
    """Weight pulls by manifest that failed since start-up (the weights served stayed; the
    trainer sends the next version whole, and the server catches up then)."""
    last_weight_update_error: str | None = None
    """... the last one's error, naming the trainer endpoint and the param."""
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
    finished_requests: dict[str, int] = Field(default_factory=dict)
    """Requests ended since start-up, by how: "stop", "length", "abort" (cancelled, client gone,
    shutdown) and "error" (failed with an engine step)."""
    time_to_first_token: Histogram | None = None
    """Seconds from submit to the first completion token sampled, per request that got one."""
    e2e_latency: Histogram | None = None
    """Seconds from submit to the request's end, per request ended (every reason but "error")."""

"""``GET /metrics`` in Prometheus text exposition: what vLLM serves there and every scraper reads.

The engine's snapshot (``Engine.metrics``, the same one ``GET /metrics.json`` answers) is read at
scrape time by one collector, so nothing on the request path updates a metric twice; only the
HTTP answers are counted as they go (``HttpCounter``). Each server has its own
``CollectorRegistry`` (``registry``), never prometheus_client's global one: two servers in one
process (the tests, an RL run's embedded server beside another) keep separate counts.

Names follow vLLM where it has the same quantity (so its dashboards and autoscalers work
unchanged), ``jaxrl:`` where it has none; every sample carries ``model_name`` as vLLM's do:

=====================================  ========  ==============================================
vllm:num_requests_running              gauge     sequences holding a KV cache row
vllm:num_requests_waiting              gauge     requests queued for a row
vllm:kv_cache_usage_perc               gauge     rows in use / ``max_seqs`` (0-1): rows, not
                                                 tokens, are what admission waits for here
vllm:prompt_tokens_total               counter   prompt tokens of admitted requests
vllm:generation_tokens_total           counter   completion tokens sampled
vllm:prefix_cache_queries_total        counter   prompt tokens looked up in the prefix cache
vllm:prefix_cache_hits_total           counter   ... of which were served from it
vllm:request_success_total             counter   requests ended, label ``finished_reason``
                                                 (stop, length, abort)
vllm:time_to_first_token_seconds       histogram submit -> first completion token
vllm:e2e_request_latency_seconds       histogram submit -> request ended
jaxrl:request_errors_total             counter   requests failed with an engine step
jaxrl:http_requests_total              counter   HTTP answers, labels ``route``, ``status``
jaxrl:policy_version                   gauge     the weights version served
jaxrl:weight_update_failures_total     counter   weight pulls that failed (the served weights stayed)
jaxrl:kv_cache_tokens_in_use           gauge     positions the running sequences wrote
jaxrl:kv_cache_bytes                   gauge     the KV cache's size (allocated at start-up)
jaxrl:compiled_programs                gauge     device programs compiled so far
jaxrl:program_bound                    gauge     ... the most there can be (all, after warm-up)
jaxrl:warmup_seconds                   gauge     the start-up warm-up's seconds (if one ran)
jaxrl:engine_step_seconds_total        counter   engine thread time in steps
jaxrl:device_seconds_total             counter   ... of which in device calls, label ``call``
                                                 (prefill, decode, other)
=====================================  ========  ==============================================
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from jaxrl.engine.metrics import EngineMetrics, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The ``Content-Type`` of ``GET /metrics``: text exposition format 0.0.4, which every Prometheus
reads (prometheus_client 0.22+'s ``CONTENT_TYPE_LATEST`` says 1.0.0, which Prometheus 2 does not
know; our names are all legacy-valid, so the body is the same)."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class EngineCollector(Collector):
    """The engine's snapshot as metric families (see the module docstring), read per scrape."""

    def __init__(self, snapshot: Callable[[], EngineMetrics], model_name: str):
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        m = self.snapshot()
        label = ["model_name"]
        name = [self.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=label)
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=label)
            family.add_metric(name, value)
            return family

        yield gauge("vllm:num_requests_running", "Sequences holding a KV cache row.", m.running)
        yield gauge("vllm:num_requests_waiting", "Requests queued for a KV cache row.", m.waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV cache rows in use / max_seqs (1 = full).", m.running / max(m.max_seqs, 1)
        )
        yield counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", m.prompt_tokens)
        yield counter("vllm:generation_tokens", "Completion tokens sampled.", m.generated_tokens)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m.prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", m.cached_prompt_tokens)
        finished = CounterMetricFamily(
            "vllm:request_success", "Requests ended, by finish reason.", labels=[*label, "finished_reason"]
        )
        for reason in ("stop", "length", "abort"):
            finished.add_metric([*name, reason], m.finished_requests.get(reason, 0))
        yield finished
        yield counter(
            "jaxrl:request_errors", "Requests failed with an engine step.", m.finished_requests.get("error", 0)
        )
        yield self._histogram(
            "vllm:time_to_first_token_seconds", "Seconds from submit to the first token.", m.time_to_first_token
        )
        yield self._histogram(
            "vllm:e2e_request_latency_seconds", "Seconds from submit to the request's end.", m.e2e_latency
        )
        yield gauge("jaxrl:policy_version", "The weights version served.", m.policy_version)
        yield counter(
            "jaxrl:weight_update_failures", "Weight pulls that failed (the served weights stayed).",
            m.weight_update_failures,
        )  # fmt: skip
        yield gauge("jaxrl:kv_cache_tokens_in_use", "Positions the running sequences wrote.", m.kv_tokens_in_use)
        yield gauge("jaxrl:kv_cache_bytes", "The KV cache's size, allocated at start-up.", m.kv_cache_bytes)
        yield gauge("jaxrl:compiled_programs", "Device programs compiled so far.", m.compiles)
        yield gauge("jaxrl:program_bound", "The most device programs this layout compiles.", m.program_bound)
        if m.warmup_s is not None:
            yield gauge("jaxrl:warmup_seconds", "Seconds the start-up warm-up took.", m.warmup_s)
        yield counter("jaxrl:engine_step_seconds", "Engine thread seconds in steps.", m.step_s)
        device = CounterMetricFamily(
            "jaxrl:device_seconds", "Seconds in device calls, by call.", labels=[*label, "call"]
        )
        other = max(m.device_s - m.prefill_s - m.decode_s, 0.0)
        for call, seconds in (("prefill", m.prefill_s), ("decode", m.decode_s), ("other", other)):
            device.add_metric([*name, call], seconds)
        yield device

    def _histogram(self, metric: str, doc: str, h: Histogram | None) -> HistogramMetricFamily:
        family = HistogramMetricFamily(metric, doc, labels=["model_name"])
        h = h or Histogram(buckets=[], counts=[], sum=0.0, count=0)
        cumulative, buckets = 0, []
        for bound, n in zip(h.buckets, h.counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", h.count))
        family.add_metric([self.model_name], buckets, h.sum)
        return family


class HttpCounter:
    """ASGI middleware counting every HTTP answer by route and status (a plain ASGI wrapper, not
    Starlette's ``BaseHTTPMiddleware``, which would buffer streamed answers and hide a client's
    disconnect from the handlers that abort its requests). Paths that are no route count as
    ``route="other"``, so a scanner cannot grow the label set."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry, routes: frozenset[str]):
        self.app = app
        self.routes = routes
        self.counter = Counter(
            "jaxrl:http_requests", "HTTP answers, by route and status.", ["route", "status"], registry=registry
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in self.routes else "other"

        async def counted(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def registry(snapshot: Callable[[], EngineMetrics], model_name: str) -> CollectorRegistry:
    """A registry of its own for one server, holding its engine's collector."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(snapshot, model_name))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    """``reg``'s metrics in the text format (``CONTENT_TYPE``)."""
    return generate_latest(reg)

"""The embedded rollout engine: continuous batching over a KV cache with the trainer's decoder.

One background thread runs engine steps; callers (HTTP handlers, the trainer, tests) submit
requests from any thread and get ``concurrent.futures.Future``s. As vLLM's engine core, the
engine only wires two collaborators, each with one job:

- the ``Scheduler`` (``scheduler``): requests, KV cache rows, prefix reuse (``prefix_cache``)
  and which sequences run in which call; pure host-side bookkeeping;
- the ``ModelRunner`` (``runner``): the weights and their version, the KV cache, the token
  counts, the compiled programs and the device calls.

Each step reads schedule -> execute -> update:

1. takes new requests and aborts, and swaps in pending weights when ``weight_update`` allows;
2. the scheduler admits waiting requests into free rows (row copies for reused prefixes);
3. one prefill batch (prompt chunks; a prompt that completes samples its first token): the
   scheduler plans it, the runner runs it, the scheduler takes the sampled tokens back;
4. the same for ``decode_steps`` decode steps of every sequence past prefill, in one device
   call (``decode_steps_idle`` when no request waits to join).

Weight updates (``weight_update`` = "drain": admission pauses and requests in flight finish on
the old weights first; "immediate": at the next step, requests in flight continue on the new
weights) are placed on the runner's shardings in the caller's thread and swapped in between
steps only; cached prefixes are dropped on every swap (their keys/values came from the old
weights); every completion records the version that sampled each token.

A failed step is a bug, not bad input: the requests in flight fail with the error, the
scheduler and the runner reset (empty rows, no cached prefixes; donated buffers the failed
call consumed rebuilt), and the engine keeps serving. When even that fails, every request
fails and the engine reports itself unhealthy (``jaxrl.serve`` then exits for a supervisor to
restart).

Penalties (``sampling.apply_penalties``) read per-row token counts kept on device beside the
cache (``sampling.TokenCounts``: int32 + bool ``[max_seqs, vocab]``, e.g. 194 MB at 256 rows of
a 152k vocabulary): decode counts each token it feeds back, and a penalised request's row is
reset (its prompt's tokens marked) when it is admitted, whatever prefix it reuses.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.engine import weights
from jaxrl.engine.config import EngineConfig
from jaxrl.engine.metrics import EngineMetrics, RateWindow, RequestStats
from jaxrl.engine.requests import Completion, Request, Sequence, TokenDelta
from jaxrl.engine.runner import ModelRunner
from jaxrl.engine.scheduler import DecodePlan, PrefillPlan, Scheduler, SchedulerStats
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.setup import DTYPES
from jaxrl.parallel.rules import check_expert_parallel
from jaxrl.weight_transfer import Manifest

log = logging.getLogger(__name__)


class StaleVersion(ValueError):
    """A weight update's version is not above the version served or already pending."""


@dataclass
class _Update:
    """Weights waiting to be swapped in, and the callers waiting for it."""

    state: Any
    version: int
    waiters: list[threading.Event] = field(default_factory=list)


class Engine:
    """Continuous-batching generation with the trainer's ``Decoder``; see the module docstring.

    The engine serves a copy of ``model``'s weights on its own shardings (``mesh``: tensor
    parallel over its "tensor" axis; default: ``config.tensor_parallel`` devices), so the trainer
    may keep training (and donating) its own arrays; later hand-offs go through
    ``update_weights_from_state``.
    """

    def __init__(self, model: Decoder, config: EngineConfig, *, mesh: Mesh | None = None):
        arch = model.arch
        config = config.with_model_len(arch.max_position_embeddings)
        if config.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"inference.max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({arch.max_position_embeddings}); lower it"
            )
        self.config = config
        self.arch = arch
        check_expert_parallel(
            getattr(arch, "num_experts", 0), config.expert_parallel, field="inference.backend.expert_parallel"
        )
        if mesh is None:
            mesh = weights.serving_mesh(config.tensor_parallel, expert_parallel=config.expert_parallel)
        self.mesh = mesh
        self.runner = ModelRunner(model, config, mesh)
        self.scheduler = Scheduler(config)
        self._rng = np.random.default_rng(config.seed)
        self._lock = threading.Condition()
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._futures: dict[str, Future[Completion]] = {}
        self._pending: _Update | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._exit_now = False
        self._error: BaseException | None = None
        self._generated = RateWindow()
        self.requests = RequestStats()
        """How requests ended and their latencies (``metrics()``: ``finished_requests``, histograms)."""
        self._step_s = 0.0  # engine steps (device calls inside them: ``runner.device_s``)
        self._pull_failures = 0  # manifest pulls that failed (the weights served stayed)
        self._last_pull_error: str | None = None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        config: EngineConfig,
        *,
        dtype: str = "float32",
        mesh: Mesh | None = None,
    ) -> Engine:
        """Load a Hugging Face model directory straight into the engine's shardings."""
        if dtype not in DTYPES:
            raise ValueError(f"model dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
        dt = DTYPES[dtype]
        if mesh is None:
            mesh = weights.serving_mesh(config.tensor_parallel, expert_parallel=config.expert_parallel)
        model = load_decoder(model_dir, param_dtype=dt, dtype=dt, sharding_fn=weights.param_sharding_fn(mesh))
        return cls(model, config, mesh=mesh)

    # -- public state ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.runner.version

    @property
    def params(self) -> nnx.State:
        """The weights being served (read-only: the engine may swap them at any step), in the
        layout its programs take (``Kernels.serving_weights``: packed for the CPU backend on one
        CPU device)."""
        return self.runner.state

    @property
    def kernels(self) -> Kernels:
        """The kernel choice the engine's programs were built with."""
        return self.runner.kernels

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def max_logprobs(self) -> int:
        """Most top log-probs a request may ask for per token (``max_logprobs``, at most the vocabulary)."""
        return self.runner.layout.top_logprobs

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def stats(self) -> SchedulerStats:
        """Scheduler counters: prompt / cached / computed / generated tokens, calls, row copies."""
        return self.scheduler.stats

    @property
    def healthy(self) -> bool:
        return self._error is None

    def compiled_programs(self) -> int:
        """Device programs compiled so far for this engine's layout (<= ``config.program_bound()``)."""
        return self.runner.compiled_programs()

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every program of the configured buckets (``config.program_bound()`` of them)
        before serving, so no request waits on a compile; returns the seconds it took.
        ``progress`` (default: this module's logger at info) gets a line per program compiled."""
        if self._thread is not None:
            raise RuntimeError("Engine.warmup: call it before start()")
        seconds = self.runner.warmup(progress or log.info)
        log.info("engine warm-up: %d programs compiled in %.1f s", self.compiled_programs(), seconds)
        return seconds

    def metrics(self) -> EngineMetrics:
        """A snapshot of load, throughput, prefix reuse and compiles (safe from any thread)."""
        stats, runner = self.scheduler.stats, self.runner
        with self._lock:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            running = len(self.scheduler.running)
            in_use = sum(seq.position for seq in self.scheduler.running)
        kv_bytes = runner.kv_cache_bytes
        device_s = runner.device_s
        return EngineMetrics(
            waiting=waiting,
            running=running,
            policy_version=runner.version,
            generated_tokens=stats.generated_tokens,
            tokens_per_s=round(self._generated.rate(), 1),
            prompt_tokens=stats.prompt_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
            prefix_hit_rate=stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
            shared_prefix_positions=stats.shared_prefix_positions,
            max_seqs=self.config.max_seqs,
            max_model_len=self.max_model_len,
            quantization=self.config.quantization,
            weight_update_failures=self._pull_failures,
            last_weight_update_error=self._last_pull_error,
            kv_cache_bytes=kv_bytes,
            kv_bytes_per_sequence=kv_bytes // self.config.max_seqs,
            kv_tokens_in_use=in_use,
            prefill_calls=stats.prefill_calls,
            decode_calls=stats.decode_calls,
            compiles=self.compiled_programs(),
            program_bound=self.config.program_bound(),
            warmup_s=runner.warmup_s,
            step_s=round(self._step_s, 3),
            device_s=round(sum(device_s.values()), 3),
            prefill_s=round(device_s["prefill"], 3),
            decode_s=round(device_s["decode"], 3),
            finished_requests=self.requests.finished_counts(),
            time_to_first_token=self.requests.time_to_first_token.snapshot(),
            e2e_latency=self.requests.e2e_latency.snapshot(),
        )

    # -- requests --------------------------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise ValueError naming the problem when the engine cannot serve ``request``."""
        n = len(request.prompt)
        if n == 0:
            raise ValueError("prompt is empty: token_ids must hold at least one token")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, max_model_len is {self.max_model_len}: the prompt must be "
                f"shorter than max_model_len to leave room for at least one generated token"
            )
        ids = np.asarray(request.prompt)
        if ids.dtype.kind not in "iu":
            raise ValueError("token_ids must be integers")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if len(bad):
            raise ValueError(
                f"token_ids[{bad[0]}] = {ids[bad[0]]} is outside the vocabulary [0, {self.vocab_size})"
            )
        for t in request.params.stop_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"stop_token_ids: {t} is outside the vocabulary [0, {self.vocab_size})")
        if request.params.top_logprobs > self.max_logprobs:
            raise ValueError(
                f"top_logprobs: at most {self.max_logprobs} on this engine (inference.backend.max_logprobs); "
                f"asked for {request.params.top_logprobs}"
            )

    def submit(self, request: Request) -> Future[Completion]:
        """Queue a request (thread-safe); raises ValueError on a request the engine cannot serve."""
        self.validate(request)
        future: Future[Completion] = Future()
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"engine failed: {self._error!r}")
            if self._stopping:
                raise RuntimeError("engine is shutting down")
            if request.request_id in self._futures:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            seed = request.params.seed if request.params.seed is not None else int(self._rng.integers(2**63))
            self._inbox.append(Sequence(request, seed, self.max_model_len))
            self._futures[request.request_id] = future
            self._lock.notify_all()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request; its future completes with finish_reason "abort" (no-op when unknown)."""
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify_all()

    def generate(self, requests: list[Request], timeout: float | None = None) -> list[Completion]:
        """Run ``requests`` to completion (in this thread when the engine thread is not running)."""
        futures = [self.submit(r) for r in requests]
        if self._thread is None:
            while not all(f.done() for f in futures):
                self.step()
        return [f.result(timeout) for f in futures]

    # -- weight updates --------------------------------------------------------------------

    def update_weights_from_state(
        self, state: nnx.State | Decoder, *, version: int | None = None, wait: bool = True
    ) -> int:
        """Hand new weights (the trainer's params pytree, any sharding) to the engine.

        The copy to the engine's shardings happens in the calling thread; the swap happens
        between engine steps (see ``EngineConfig.weight_update``). Returns the policy version
        served after the swap when ``wait``, else the version the update will have.
        """
        return self._enqueue_update(self.runner.place(state), version, wait)

    def update_weights_from_path(self, path: str | Path, *, version: int | None = None, wait: bool = True) -> int:
        """Load a Hugging Face model directory (same architecture) as the new weights."""
        return self._enqueue_update(self.runner.load(path), version, wait)

    def update_weights_from_manifest(
        self, manifest: Manifest, *, version: int | None = None, timeout_s: float = 300.0, wait: bool = True
    ) -> int:
        """Pull the version ``manifest`` describes from the trainer processes' publishers
        (``jaxrl.weight_transfer``) onto the engine's shardings in the calling thread, within
        ``timeout_s``, then swap it in as ``update_weights_from_state`` does. A failed pull raises
        ``PullError`` naming the endpoint and the param; the engine keeps serving its weights and
        counts it (``metrics()``: ``weight_update_failures``, ``last_weight_update_error``)."""
        try:
            state = self.runner.pull(manifest, timeout_s=timeout_s)
        except Exception as e:
            with self._lock:
                self._pull_failures += 1
                self._last_pull_error = f"version {manifest.version}: {type(e).__name__}: {e}"[:1000]
            raise
        return self._enqueue_update(state, version, wait)

    def _enqueue_update(self, state: Any, version: int | None, wait: bool) -> int:
        done = threading.Event()
        with self._lock:
            latest = self._pending.version if self._pending else self.runner.version
            if version is None:
                version = latest + 1
            if version <= latest:
                raise StaleVersion(f"weight update version {version} must be greater than {latest}")
            if self._pending is None:
                self._pending = _Update(state, version, [done])
            else:
                self._pending.state, self._pending.version = state, version
                self._pending.waiters.append(done)
            self._lock.notify_all()
        if not wait:
            return version
        if self._thread is None:
            while not done.is_set():
                self.step()
        done.wait()
        if self._error is not None:
            raise RuntimeError(f"engine failed: {self._error!r}")
        return self.runner.version

    def _maybe_swap_weights(self) -> bool:
        """Apply a pending update when the policy allows; True while admission must pause."""
        if self._pending is None:  # read without the lock: an update set meanwhile applies next step
            return False
        # The device order before the engine's own lock (a colocated swap is a command every
        # process sees in order; the main thread may hold that order and then take this lock).
        with self.runner.device_order(), self._lock:
            update = self._pending
            if update is None:
                return False
            if self.config.weight_update == "drain" and self.scheduler.running:
                return True
            self._pending = None
            self.runner.swap(update.state, update.version)
        self.scheduler.rows.invalidate_warm()
        for w in update.waiters:
            w.set()
        return False

    # -- the loop --------------------------------------------------------------------------

    def start(self) -> None:
        """Run engine steps in a background thread until ``stop``."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxrl-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let those in flight finish (up to ``timeout`` s), abort the rest."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            with self._lock:
                self._exit_now = True
                self._lock.notify_all()
            thread.join()
            self._thread = None
        self._abort_all()
        self._maybe_swap_weights()  # nothing runs any more: a pending update applies now
        self._stopping = self._exit_now = False

    def _has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self._pending or not self.scheduler.idle)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._has_work() and not self._stopping:
                    self._lock.wait()
                if self._exit_now or (self._stopping and not self._has_work()):
                    return
            try:
                self.step()
            except Exception as exc:  # a bug, not bad input: fail the requests in flight, keep serving
                log.exception("engine step failed; failing the requests in flight")
                try:
                    self._recover(exc)
                except Exception:  # cannot serve on: fail everything, report unhealthy (the server exits)
                    log.exception("engine could not recover from a failed step; stopping")
                    self._fail(exc)
                    return

    def step(self) -> None:
        """One engine step (called by the engine thread, or directly when it is not running)."""
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError("Engine.step: the engine thread is running; submit requests instead")
        t0 = time.perf_counter()
        try:
            self._step()
        finally:
            self._step_s += time.perf_counter() - t0

    def _step(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for seq in inbox:
            self.scheduler.add(seq)
        for rid in aborts:
            seq = self.scheduler.abort(rid)
            if seq is not None:
                self._deliver([seq])
        paused = self._maybe_swap_weights()
        if not paused:
            for src, dst in self.scheduler.admit():
                self.runner.copy_row(src, dst)
            for seq in self.scheduler.admitted:
                if seq.params.penalized:
                    self.runner.reset_counts(seq.row, seq.prompt)
        prefill = self.scheduler.plan_prefill()
        if prefill is not None:
            self._run_prefill(prefill)
        decode = self.scheduler.plan_decode(self._decode_steps_now())
        if decode is not None:
            self._run_decode(decode)
        self._generated.add(self.scheduler.stats.generated_tokens)

    def _decode_steps_now(self) -> int:
        """``decode_steps_idle`` when no request waits to join (none queued, in the inbox or
        prefilling) and a running sequence needs that many more tokens, else ``decode_steps``."""
        counts = self.config.decode_step_counts()
        short, idle = counts[0], counts[-1]
        if idle == short or self.scheduler.waiting or self._inbox or self._pending:
            return short
        running = self.scheduler.running
        if any(s.prefilling for s in running) or max((s.max_new - len(s.tokens) for s in running), default=0) < idle:
            return short
        return idle

    def _run_prefill(self, plan: PrefillPlan) -> None:
        tokens, logprobs, top, experts = self.runner.prefill(plan)
        marks = [len(seq.tokens) for seq in plan.seqs]
        done = self.scheduler.finish_prefill(plan, tokens, logprobs, self.runner.version, experts, top)
        now = time.monotonic()
        for seq, mark in zip(plan.seqs, marks):
            if mark == 0 and seq.tokens:  # its prompt completed: the first token was just sampled
                self.requests.time_to_first_token.observe(now - seq.arrival)
        self._stream(plan.seqs, marks)
        self._deliver(done)

    def _run_decode(self, plan: DecodePlan) -> None:
        tokens, logprobs, top, experts = self.runner.decode(plan)
        marks = [len(seq.tokens) for seq in plan.seqs]
        done = self.scheduler.finish_decode(plan, tokens, logprobs, self.runner.version, experts, top)
        self._stream(plan.seqs, marks)
        self._deliver(done)

    @staticmethod
    def _stream(seqs: list[Sequence], marks: list[int]) -> None:
        """Hand each streaming request (``Request.on_tokens``) the tokens this device call sampled
        for it (those past ``marks``), before any of them completes."""
        for seq, mark in zip(seqs, marks):
            on_tokens = seq.request.on_tokens
            if on_tokens is None or len(seq.tokens) == mark:
                continue
            try:
                on_tokens(TokenDelta(seq.tokens[mark:], seq.logprobs[mark:], seq.versions[mark:], seq.top[mark:]))
            except Exception:  # the reader's bug: its request goes on, the others are untouched
                log.exception("on_tokens of request %s failed", seq.request.request_id)

    def _deliver(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            with self._lock:
                future = self._futures.pop(seq.request.request_id, None)
            if future is not None:
                self.requests.finished(seq.finish_reason or "abort", time.monotonic() - seq.arrival)
                try:
                    future.set_result(seq.completion(self.runner.version))
                except InvalidStateError:  # cancelled by the caller meanwhile
                    pass

    # -- failures --------------------------------------------------------------------------

    def _abort_all(self) -> None:
        """Finish every request still queued or running with finish_reason "abort"."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            self.scheduler.add(seq)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self.scheduler.abort(seq.request.request_id)
            self._deliver([seq])

    def _recover(self, exc: BaseException) -> None:
        """After a failed step: fail the requests the scheduler holds (the one that broke the
        step cannot be told from the others of its batch) with ``exc``, then reset the scheduler
        and the runner. Requests submitted since the step began stay queued."""
        with self._lock:
            queued = {seq.request.request_id for seq in self._inbox}
            failed = {rid: f for rid, f in self._futures.items() if rid not in queued}
            for rid in failed:
                del self._futures[rid]
            self._aborts.clear()
        for f in failed.values():
            self.requests.finished("error")
            if not f.done():
                f.set_exception(RuntimeError(f"engine step failed: {exc!r}"))
        self.scheduler.reset()
        self.runner.reset()

    def _fail(self, exc: BaseException) -> None:
        """Recovery failed too: fail every request and update, and report unhealthy."""
        with self._lock:
            self._error = exc
            futures, self._futures = self._futures, {}
            pending, self._pending = self._pending, None
        for f in futures.values():
            self.requests.finished("error")
            if not f.done():
                f.set_exception(exc)
        for w in pending.waiters if pending else []:
            w.set()

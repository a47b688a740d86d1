"""The embedded rollout engine: continuous batching over a KV cache with the trainer's decoder.

One background thread runs engine steps; callers (HTTP handlers, the trainer, tests) submit
requests from any thread and get ``concurrent.futures.Future``s. Each step:

1. takes new requests and aborts, and applies a pending weight update when allowed;
2. admits waiting requests into free KV cache rows, reusing cached prefixes (``scheduler``);
3. runs one prefill batch (prompt chunks; a prompt that completes samples its first token);
4. runs ``decode_steps`` decode steps for every sequence past prefill, in one device call
   (``decode_steps_idle`` when no request waits to join).

Its jobs live in four modules, as vLLM splits its engine core from the model runner: the
device programs and the cache layout (``programs``), this loop (here), weight swaps
(``weight_swap``) and recovery from a failed step (``recovery``).

Penalties (``sampling.apply_penalties``) read per-row token counts kept on device beside the
cache (``sampling.TokenCounts``: int32 + bool ``[max_seqs, vocab]``, e.g. 194 MB at 256 rows of
a 152k vocabulary): decode counts each token it feeds back, and a penalised request's row is
reset (its prompt's tokens marked) when it is admitted, whatever prefix it reuses.

Weight updates take effect between steps only (``weight_swap``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.engine import weights as W
from jaxrl.engine.config import EngineConfig
from jaxrl.engine.metrics import EngineMetrics, RateWindow
from jaxrl.engine.programs import DTYPES, EngineLayout, engine_programs
from jaxrl.engine.recovery import Recovery
from jaxrl.engine.scheduler import (
    Completion,
    DecodePlan,
    PrefillPlan,
    Request,
    Scheduler,
    SchedulerStats,
    Sequence,
    TokenDelta,
)
from jaxrl.engine.weight_swap import WeightSwaps, _Update
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.decoder import Decoder, KVCache
from jaxrl.models.hf_io import load_decoder
from jaxrl.parallel.rules import check_expert_parallel

log = logging.getLogger(__name__)


class Engine(WeightSwaps, Recovery):
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
        check_expert_parallel(getattr(arch, "num_experts", 0), config.expert_parallel, field="inference.expert_parallel")
        self.mesh = mesh if mesh is not None else W.serving_mesh(config.tensor_parallel, expert_parallel=config.expert_parallel)
        mesh = self.mesh
        self._sharding_fn = W.param_sharding_fn(mesh)
        graphdef, state = nnx.split(model)
        self._param_shardings = W.state_shardings(state, self._sharding_fn)
        # Updates are placed like this (the model's stacked layout) and then served as ``_served``.
        self._stacked = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, self._param_shardings
        )
        self._param_dtype = jax.tree.leaves(state)[0].dtype
        self._compute_dtype = model.dtype
        self.kernels = Kernels.create(config.kernels, field="inference.kernels", mesh=mesh)
        # Always a copy: the caller (the trainer) may donate or overwrite its arrays later.
        self._state: nnx.State = self._served(W.place_state(state, state, self._param_shardings))
        layout = EngineLayout.create(arch, config, model.dtype, mesh)
        self._cache = KVCache(
            *(W.zeros_like_sharded(layout.cache_shape, layout.cache_dtype, layout.cache_sharding) for _ in range(2))
        )
        self._counts = layout.zero_counts()
        self._inputs = layout.inputs
        self._layout = layout
        programs = engine_programs(graphdef, layout, self.kernels)
        self._prefill_fn, self._decode_fn, self._copy_fn, self._reset_fn, self._traces = programs

        self._sched = Scheduler(config)
        self._rng = np.random.default_rng(config.seed)
        self._version = 0
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
        self._warmup_s: float | None = None
        self._step_s = 0.0  # engine steps, and inside them device calls (``EngineMetrics``)
        self._device_s = {"prefill": 0.0, "decode": 0.0, "copy": 0.0}

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
        mesh = mesh if mesh is not None else W.serving_mesh(config.tensor_parallel, expert_parallel=config.expert_parallel)
        model = load_decoder(model_dir, param_dtype=dt, dtype=dt, sharding_fn=W.param_sharding_fn(mesh))
        return cls(model, config, mesh=mesh)

    # -- public state ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def params(self) -> nnx.State:
        """The weights being served (read-only: the engine may swap them at any step), in the
        layout its programs take (``Kernels.serving_weights``: packed for the CPU backend on one
        CPU device)."""
        return self._state

    def _served(self, placed: nnx.State) -> Any:
        return self.kernels.serving_weights(placed, self._compute_dtype)

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def stats(self) -> SchedulerStats:
        """Scheduler counters: prompt / cached / computed / generated tokens, calls, row copies."""
        return self._sched.stats

    @property
    def healthy(self) -> bool:
        return self._error is None

    def compiled_programs(self) -> int:
        """Device programs compiled so far for this engine's layout (<= ``config.program_bound()``)."""
        return self._traces.count

    def warmup(self) -> float:
        """Compile every program of the configured buckets (``config.program_bound()`` of them)
        before serving, so no request waits on a compile; returns the seconds it took.

        Programs are lowered and compiled ahead of time (nothing runs; the compiled executables
        land in jit's caches, so the first real call of each shape dispatches straight away),
        several at once on hosts with more cores: XLA compiles outside the GIL.
        """
        if self._thread is not None:
            raise RuntimeError("Engine.warmup: call it before start()")
        t0 = time.perf_counter()
        cfg, layout = self.config, self._layout
        jobs = [
            partial(self._prefill_fn.lower, self._state, self._cache, self._counts, *layout.prefill_inputs(batch, width))
            for batch, width in cfg.prefill_shapes()
        ]
        jobs += [
            partial(self._decode_fn.lower, steps, self._state, self._cache, self._counts, *layout.decode_inputs(batch))
            for steps, batch in cfg.decode_shapes()
        ]
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.inputs)
        jobs.append(partial(self._copy_fn.lower, self._cache, index, index))
        jobs.append(partial(self._reset_fn.lower, self._counts, *layout.reset_inputs()))
        workers = max(1, min(len(os.sched_getaffinity(0)), 8))
        with ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-warmup") as pool:
            list(pool.map(lambda lower: lower().compile(), jobs))
        self._warmup_s = time.perf_counter() - t0
        log.info("engine warm-up: %d programs compiled in %.1f s", self.compiled_programs(), self._warmup_s)
        return self._warmup_s

    def metrics(self) -> EngineMetrics:
        """A snapshot of load, throughput, prefix reuse and compiles (safe from any thread)."""
        stats = self._sched.stats
        with self._lock:
            waiting = len(self._inbox) + len(self._sched.waiting)
            running = len(self._sched.running)
            in_use = sum(seq.position for seq in self._sched.running)
        kv_bytes = sum(int(x.size) * x.dtype.itemsize for x in (self._cache.k, self._cache.v))
        return EngineMetrics(
            waiting=waiting,
            running=running,
            policy_version=self._version,
            generated_tokens=stats.generated_tokens,
            tokens_per_s=round(self._generated.rate(), 1),
            prompt_tokens=stats.prompt_tokens,
            cached_prompt_tokens=stats.cached_prompt_tokens,
            prefix_hit_rate=stats.cached_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
            shared_prefix_positions=stats.shared_prefix_positions,
            kv_cache_bytes=kv_bytes,
            kv_bytes_per_sequence=kv_bytes // self.config.max_seqs,
            kv_tokens_in_use=in_use,
            prefill_calls=stats.prefill_calls,
            decode_calls=stats.decode_calls,
            compiles=self.compiled_programs(),
            program_bound=self.config.program_bound(),
            warmup_s=self._warmup_s,
            step_s=round(self._step_s, 3),
            device_s=round(sum(self._device_s.values()), 3),
            prefill_s=round(self._device_s["prefill"], 3),
            decode_s=round(self._device_s["decode"], 3),
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
        return bool(self._inbox or self._aborts or self._pending or not self._sched.idle)

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
            self._sched.add(seq)
        for rid in aborts:
            seq = self._sched.abort(rid)
            if seq is not None:
                self._deliver([seq])
        paused = self._maybe_swap_weights()
        if not paused:
            for src, dst in self._sched.admit():
                with self._device_timer("copy"):
                    self._cache = self._copy_fn(self._cache, *self._put((np.int32(src), np.int32(dst))))
            for seq in self._sched.admitted:
                if seq.params.penalized:
                    self._reset_counts(seq)
        prefill = self._sched.plan_prefill()
        if prefill is not None:
            self._run_prefill(prefill)
        decode = self._sched.plan_decode(self._decode_steps_now())
        if decode is not None:
            self._run_decode(decode)
        self._generated.add(self._sched.stats.generated_tokens)

    def _decode_steps_now(self) -> int:
        """``decode_steps_idle`` when no request waits to join (none queued, in the inbox or
        prefilling) and a running sequence needs that many more tokens, else ``decode_steps``."""
        counts = self.config.decode_step_counts()
        short, idle = counts[0], counts[-1]
        if idle == short or self._sched.waiting or self._inbox or self._pending:
            return short
        running = self._sched.running
        if any(s.prefilling for s in running) or max((s.max_new - len(s.tokens) for s in running), default=0) < idle:
            return short
        return idle

    def _put(self, arrays: Any) -> Any:
        return jax.device_put(arrays, self._inputs)

    @contextlib.contextmanager
    def _device_timer(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._device_s[kind] += time.perf_counter() - t0

    def _reset_counts(self, seq: Sequence) -> None:
        """Zero the generated-token counts of ``seq``'s row and mark its prompt's tokens."""
        mask = np.zeros(self.vocab_size, np.bool_)
        mask[seq.prompt] = True
        with self._device_timer("copy"):
            self._counts = self._reset_fn(self._counts, *self._put((np.int32(seq.row), mask)))

    def _run_prefill(self, plan: PrefillPlan) -> None:
        with self._device_timer("prefill"):
            args = self._put((plan.tokens, plan.positions, plan.rows, plan.last, plan.sampling))
            self._cache, tokens, logprobs, experts = self._prefill_fn(self._state, self._cache, self._counts, *args)
            tokens, logprobs, experts = jax.device_get((tokens, logprobs, experts))
        marks = [len(seq.tokens) for seq in plan.seqs]
        done = self._sched.finish_prefill(plan, tokens, logprobs, self._version, experts)
        self._stream(plan.seqs, marks)
        self._deliver(done)

    def _run_decode(self, plan: DecodePlan) -> None:
        with self._device_timer("decode"):
            args = self._put((plan.tokens, plan.positions, plan.rows, plan.sampling, (plan.share_rows, plan.share_lens)))
            self._cache, self._counts, tokens, logprobs, experts = self._decode_fn(
                plan.steps, self._state, self._cache, self._counts, *args
            )
            tokens, logprobs, experts = jax.device_get((tokens, logprobs, experts))
        marks = [len(seq.tokens) for seq in plan.seqs]
        done = self._sched.finish_decode(plan, tokens, logprobs, self._version, experts)
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
                on_tokens(TokenDelta(seq.tokens[mark:], seq.logprobs[mark:], seq.versions[mark:]))
            except Exception:  # the reader's bug: its request goes on, the others are untouched
                log.exception("on_tokens of request %s failed", seq.request.request_id)

    def _deliver(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            with self._lock:
                future = self._futures.pop(seq.request.request_id, None)
            if future is not None:
                try:
                    future.set_result(seq.completion(self._version))
                except InvalidStateError:  # cancelled by the caller meanwhile
                    pass

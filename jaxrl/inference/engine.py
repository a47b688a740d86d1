"""The embedded rollout engine: continuous batching over a KV cache with the trainer's decoder.

One background thread runs engine steps; callers (HTTP handlers, the trainer, tests) submit
requests from any thread and get ``concurrent.futures.Future``s. Each step:

1. takes new requests and aborts, and applies a pending weight update when allowed;
2. admits waiting requests into free KV cache rows, reusing cached prefixes (``scheduler``);
3. runs one prefill batch (prompt chunks; a prompt that completes samples its first token);
4. runs ``decode_steps`` decode steps for every sequence past prefill, in one device call
   (``decode_steps_idle`` when no request waits to join).

Device programs are compiled per shape bucket (``InferenceConfig.program_bound``): batch and
prompt-chunk sizes, never cache lengths. Decode reads and writes the KV cache in place
(donated): the reference attention (``jaxrl.models.decoder.cached_attention``) reads each block
of rows up to its furthest position, the decode kernel (TPU) each row's live blocks; nothing is
copied per call.

Penalties (``sampling.apply_penalties``) read per-row token counts kept on device beside the
cache (``sampling.TokenCounts``: int32 + bool ``[max_seqs, vocab]``, e.g. 194 MB at 256 rows of
a 152k vocabulary): decode counts each token it feeds back, and a penalised request's row is
reset (its prompt's tokens marked) when it is admitted, whatever prefix it reuses.

Weight updates take effect between steps only (``weight_update`` = "drain": requests in flight
finish on the old weights first; "immediate": at the next step). The policy version counter
starts at 0 and every completion records the version(s) that sampled it. Cached prefixes are
dropped on every update: their keys/values came from the old weights.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.inference import weights as W
from jaxrl.inference.config import InferenceConfig
from jaxrl.inference.engine_metrics import EngineMetrics, RateWindow
from jaxrl.inference.sampling import SamplingBatch, TokenCounts, penalize, sample
from jaxrl.inference.scheduler import (
    Completion,
    DecodePlan,
    PrefillPlan,
    Request,
    Scheduler,
    SchedulerStats,
    Sequence,
)
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.decoder import Decoder, KVCache
from jaxrl.models.hf_io import load_decoder

log = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _prefill(graphdef, state, cache, counts, tokens, positions, rows, last, sampling, *, kernels):  # type: ignore[no-untyped-def]
    """One batch of prompt chunks. ``kernels`` gives the projections of the served layout; the
    attention is the reference on every backend (``Kernels.cached_attention`` takes one-token
    steps only)."""
    model, kernels = kernels.bind(graphdef, state)
    hidden, cache = model(tokens, positions, cache=cache, cache_rows=rows, kernels=kernels)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = penalize(model.logits_f32(h_last, kernels), counts, rows, sampling)
    next_tokens, logprobs = sample(logits, sampling)
    return cache, next_tokens, logprobs


def _decode(graphdef, steps, state, cache, counts, tokens, positions, rows, sampling, shared, *, kernels):  # type: ignore[no-untyped-def]
    """``steps`` decode steps over the whole cache, read and written in place (donated).
    ``counts`` (``TokenCounts``, donated too) counts each fed token (the one sampled last) as
    generated before the step samples, for the penalties.

    Attention by ``kernels`` (``inference.kernels``): the decode kernel (TPU) reads each row's
    live blocks, the reference (``cached_attention``) each block of rows up to its furthest
    position. Padding entries have a row index out of range (their writes are dropped,
    what they read is discarded) and position 0. ``shared``: ``DecodePlan``'s share rows/lengths,
    handed to the kernels (``Kernels.bind``).
    """
    model, kernels = kernels.bind(graphdef, state, shared)

    def body(carry, _):  # type: ignore[no-untyped-def]
        cache, counts, tok, pos, index = carry
        counts = counts.count(rows, tok)
        hidden, cache = model(tok[:, None], pos[:, None], cache=cache, cache_rows=rows, kernels=kernels)
        logits = penalize(model.logits_f32(hidden[:, 0], kernels), counts, rows, sampling)
        new, logp = sample(logits, replace(sampling, draw_position=index))
        return (cache, counts, new, pos + 1, index + 1), (new, logp)

    carry = (cache, counts, tokens, positions, sampling.draw_position)
    (cache, counts, *_), (new_tokens, logprobs) = jax.lax.scan(body, carry, None, length=steps)
    return cache, counts, new_tokens, logprobs


def _reset_counts(counts: TokenCounts, row: jax.Array, prompt_mask: jax.Array) -> TokenCounts:
    return counts.reset(row, prompt_mask)


def _copy_row(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    return KVCache(cache.k.at[:, dst].set(cache.k[:, src]), cache.v.at[:, dst].set(cache.v[:, src]))


class _TraceCounter:
    """Counts traces of the engine's programs; under ``jax.jit`` each trace is one compile.

    Why not jit's own ``_cache_size()``: that counts dispatch fast-path entries, which also
    split on the calling thread's JAX context (seen in CI: a program called from the engine
    thread and the main thread counted twice), not only on distinct programs.
    """

    def __init__(self) -> None:
        self.count = 0

    def wrap(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            self.count += 1  # runs at trace time only
            return fn(*args, **kwargs)

        return traced


@dataclass(frozen=True)
class EngineLayout:
    """Where and in what shapes the engine's state lives: the KV cache (``max_seqs`` rows of
    ``max_model_len`` positions) and the host-fed inputs of each program, on ``mesh``.

    Needs no weights, so ``jaxrl.aot`` describes the engine's programs from it alone.
    """

    mesh: Mesh | None
    cache_shape: tuple[int, ...]
    cache_dtype: Any
    cache_sharding: Any
    counts_shape: tuple[int, int]  # (max_seqs, vocab): ``TokenCounts`` of the penalties
    inputs: Any  # sharding of host-fed inputs and of the token counts (replicated)
    key: tuple  # every shape the programs compile for (keys the program cache)

    @classmethod
    def create(cls, arch: Any, config: InferenceConfig, compute_dtype: Any, mesh: Mesh | None) -> EngineLayout:
        cache_dtype = compute_dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        shape = KVCache.shape(arch, config.max_seqs, config.max_model_len)
        key = (shape, str(jnp.dtype(cache_dtype)), tuple(config.decode_buckets()))
        key += tuple(map(tuple, (config.prefill_lengths(), config.prefill_batches(), config.decode_step_counts())))
        counts = (config.max_seqs, arch.vocab_size)
        return cls(mesh, shape, cache_dtype, W.cache_sharding(mesh, shape), counts, W.replicated(mesh), key + counts)

    def abstract_cache(self) -> KVCache:
        one = jax.ShapeDtypeStruct(self.cache_shape, self.cache_dtype, sharding=self.cache_sharding)
        return KVCache(one, one)

    def abstract_counts(self) -> TokenCounts:
        return TokenCounts(self._abstract(self.counts_shape, jnp.int32), self._abstract(self.counts_shape, jnp.bool_))

    def zero_counts(self) -> TokenCounts:
        return TokenCounts(*(W.zeros_like_sharded(self.counts_shape, dt, self.inputs) for dt in (jnp.int32, jnp.bool_)))

    def reset_inputs(self) -> tuple[Any, ...]:
        """Abstract (row, prompt_mask) of a token-counts reset."""
        return self._abstract((), jnp.int32), self._abstract(self.counts_shape[1:], jnp.bool_)

    def _abstract(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.inputs)

    def _sampling(self, batch: int) -> SamplingBatch:
        f32, i32 = jnp.float32, jnp.int32
        a = self._abstract
        return SamplingBatch(
            a((batch,), f32), a((batch,), f32), a((batch,), i32), a((batch, 2), jnp.uint32), a((batch,), i32),
            a((batch,), f32), a((batch,), f32), a((batch,), f32),
        )

    def prefill_inputs(self, batch: int, length: int) -> tuple[Any, ...]:
        """Abstract (tokens, positions, rows, last, sampling) of a prefill call."""
        i32 = jnp.int32
        a = self._abstract
        return a((batch, length), i32), a((batch, length), i32), a((batch,), i32), a((batch,), i32), self._sampling(batch)

    def decode_inputs(self, batch: int) -> tuple[Any, ...]:
        """Abstract (tokens, positions, rows, sampling, (share_rows, share_lens)) of a decode call."""
        a = self._abstract
        i32 = jnp.int32
        shared = (a((batch,), i32), a((batch,), i32))
        return a((batch,), i32), a((batch,), i32), a((batch,), i32), self._sampling(batch), shared


class EnginePrograms(NamedTuple):
    prefill: Any
    decode: Any  # takes its number of steps as its first (static) argument
    copy: Any  # one KV cache row to another (prefix reuse)
    reset: Any  # one row of the token counts (a penalised request's admission)
    traces: _TraceCounter


@functools.cache
def engine_programs(graphdef: nnx.GraphDef, layout: EngineLayout, kernels: Kernels) -> EnginePrograms:
    """The engine's jitted programs, shared by engines of the same model, shardings and shape
    layout (tests and benchmarks build several engines; each jit object has its own cache)."""
    traces = _TraceCounter()
    cache_sh, inputs_sh = layout.cache_sharding, layout.inputs
    cache_out = KVCache(cache_sh, cache_sh)
    counts_out = TokenCounts(inputs_sh, inputs_sh)
    prefill = jax.jit(
        traces.wrap(partial(_prefill, graphdef, kernels=kernels)),
        donate_argnums=(1,),
        out_shardings=(cache_out, inputs_sh, inputs_sh),
    )
    decode = jax.jit(
        traces.wrap(partial(_decode, graphdef, kernels=kernels)),
        static_argnums=(0,),  # steps
        donate_argnums=(2, 3),
        out_shardings=(cache_out, counts_out, inputs_sh, inputs_sh),
    )
    copy = jax.jit(traces.wrap(_copy_row), donate_argnums=(0,), out_shardings=cache_out)
    reset = jax.jit(traces.wrap(_reset_counts), donate_argnums=(0,), out_shardings=counts_out)
    return EnginePrograms(prefill, decode, copy, reset, traces)


class StaleVersion(ValueError):
    """A weight update's version is not above the version served or already pending."""


@dataclass
class _Update:
    state: nnx.State
    version: int
    waiters: list[threading.Event] = field(default_factory=list)


class Engine:
    """Continuous-batching generation with the trainer's ``Decoder``; see the module docstring.

    The engine serves a copy of ``model``'s weights on its own shardings (``mesh``: tensor
    parallel over its "tensor" axis; default: ``config.tensor_parallel`` devices), so the trainer
    may keep training (and donating) its own arrays; later hand-offs go through
    ``update_weights_from_state``.
    """

    def __init__(self, model: Decoder, config: InferenceConfig, *, mesh: Mesh | None = None):
        arch = model.arch
        config = config.with_model_len(arch.max_position_embeddings)
        if config.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"inference.max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({arch.max_position_embeddings}); lower it"
            )
        self.config = config
        self.arch = arch
        self.mesh = mesh if mesh is not None else W.serving_mesh(config.tensor_parallel)
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
        config: InferenceConfig,
        *,
        dtype: str = "float32",
        mesh: Mesh | None = None,
    ) -> Engine:
        """Load a Hugging Face model directory straight into the engine's shardings."""
        if dtype not in _DTYPES:
            raise ValueError(f"model dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        dt = _DTYPES[dtype]
        mesh = mesh if mesh is not None else W.serving_mesh(config.tensor_parallel)
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

    # -- weights ---------------------------------------------------------------------------

    def update_weights_from_state(
        self, state: nnx.State | Decoder, *, version: int | None = None, wait: bool = True
    ) -> int:
        """Hand new weights (the trainer's params pytree, any sharding) to the engine.

        The copy to the engine's shardings happens in the calling thread; the swap happens
        between engine steps (see ``InferenceConfig.weight_update``). Returns the policy version
        served after the swap when ``wait``, else the version the update will have.
        """
        placed = W.place_state(state, self._stacked, self._param_shardings)
        return self._enqueue_update(self._served(placed), version, wait)

    def update_weights_from_path(
        self, path: str | Path, *, version: int | None = None, wait: bool = True
    ) -> int:
        """Load a Hugging Face model directory (same architecture) as the new weights."""
        model = load_decoder(
            path, param_dtype=self._param_dtype, dtype=self._compute_dtype, sharding_fn=self._sharding_fn
        )
        if model.arch != self.arch:
            raise ValueError(f"update_weights: {path} holds a different architecture than the served model")
        return self._enqueue_update(self._served(nnx.state(model)), version, wait)

    def _enqueue_update(self, state: nnx.State, version: int | None, wait: bool) -> int:
        done = threading.Event()
        with self._lock:
            latest = self._pending.version if self._pending else self._version
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
        return self._version

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

    def _abort_all(self) -> None:
        """Finish every request still queued or running with finish_reason "abort"."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            self._sched.add(seq)
        for seq in [*self._sched.waiting, *self._sched.running]:
            self._sched.abort(seq.request.request_id)
            self._deliver([seq])

    def _recover(self, exc: BaseException) -> None:
        """After a failed step: fail the requests the scheduler holds (the one that broke the
        step cannot be told from the others of its batch) with ``exc``, start the scheduler over
        (empty rows, no cached prefixes) and rebuild the KV cache if the failed call consumed it
        (donation). Requests submitted since the step began stay queued."""
        with self._lock:
            queued = {seq.request.request_id for seq in self._inbox}
            failed = {rid: f for rid, f in self._futures.items() if rid not in queued}
            for rid in failed:
                del self._futures[rid]
            self._aborts.clear()
        for f in failed.values():
            if not f.done():
                f.set_exception(RuntimeError(f"engine step failed: {exc!r}"))
        stats = self._sched.stats
        self._sched = Scheduler(self.config)
        self._sched.stats = stats
        old = (self._cache.k, self._cache.v)
        if any(a.is_deleted() for a in old):
            self._cache = KVCache(*(W.zeros_like_sharded(a.shape, a.dtype, a.sharding) for a in old))
        if any(a.is_deleted() for a in (self._counts.output, self._counts.prompt)):
            self._counts = self._layout.zero_counts()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            futures, self._futures = self._futures, {}
            pending, self._pending = self._pending, None
        for f in futures.values():
            if not f.done():
                f.set_exception(exc)
        for w in pending.waiters if pending else []:
            w.set()

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

    def _maybe_swap_weights(self) -> bool:
        """Apply a pending update when the policy allows; True while admission must pause."""
        with self._lock:
            update = self._pending
            if update is None:
                return False
            if self.config.weight_update == "drain" and self._sched.running:
                return True
            self._pending = None
            self._state, self._version = update.state, update.version
        self._sched.rows.invalidate_warm()
        for w in update.waiters:
            w.set()
        return False

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
            self._cache, tokens, logprobs = self._prefill_fn(self._state, self._cache, self._counts, *args)
            tokens, logprobs = jax.device_get((tokens, logprobs))
        self._deliver(self._sched.finish_prefill(plan, tokens, logprobs, self._version))

    def _run_decode(self, plan: DecodePlan) -> None:
        with self._device_timer("decode"):
            args = self._put((plan.tokens, plan.positions, plan.rows, plan.sampling, (plan.share_rows, plan.share_lens)))
            self._cache, self._counts, tokens, logprobs = self._decode_fn(plan.steps, self._state, self._cache, self._counts, *args)
            tokens, logprobs = jax.device_get((tokens, logprobs))
        self._deliver(self._sched.finish_decode(plan, tokens, logprobs, self._version))

    def _deliver(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            with self._lock:
                future = self._futures.pop(seq.request.request_id, None)
            if future is not None:
                try:
                    future.set_result(seq.completion(self._version))
                except InvalidStateError:  # cancelled by the caller meanwhile
                    pass

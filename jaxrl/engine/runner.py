"""The model runner: everything the engine keeps on device, and the calls that use it.

It owns the served weights (on the engine's own shardings, in the layout the programs take)
and their policy version, the KV cache, the per-row token counts of the penalties, the
compiled programs (``programs.engine_programs``) and the time spent in device calls. It knows
nothing of requests: the scheduler's plans come in, sampled tokens go out. As vLLM keeps its
model runner apart from the scheduler, so that weight hand-off, cache layout and kernels
change here alone.

Weight swaps (DESIGN contract 6, ``weight_update``): new weights are placed on the runner's
shardings in the caller's thread (``place`` / ``load`` / ``pull``), and ``swap`` installs them, called by
the engine between steps only.

Colocated across processes (``jaxrl.engine.lockstep``): on process 0 ``lockstep`` is set, and
each device call is first sent to the other processes, which repeat it on their own runner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.engine import weights
from jaxrl.engine.config import EngineConfig
from jaxrl.engine.lockstep import Leader
from jaxrl.engine.programs import EngineLayout, engine_programs
from jaxrl.engine.scheduler import DecodePlan, PrefillPlan
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.quantize import abstract_quantized, cast_projections, cast_to, quantization_of, quantize_state
from jaxrl.weight_transfer import HostBufferPool, Manifest, pull_weights
from jaxrl.weight_transfer.manifest import param_path

log = logging.getLogger(__name__)

DeviceOutputs = tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray], np.ndarray]
"""Sampled tokens, their log-probs, the top log-probs (ids, log-probs; zeros in a batch where no
request asks) and the experts each fed token used (host arrays)."""


class ModelRunner:
    """Weights, KV cache, token counts and programs of one engine; see the module docstring.

    The runner serves a copy of ``model``'s weights on ``mesh`` (the caller, the trainer, may
    keep training and donating its own arrays).
    """

    def __init__(self, model: Decoder, config: EngineConfig, mesh: Mesh):
        self.config = config
        self.arch = model.arch
        self.mesh = mesh
        self._sharding_fn = weights.param_sharding_fn(mesh)
        graphdef, state = nnx.split(model)
        self.param_shardings = weights.state_shardings(state, self._sharding_fn)
        # Updates are placed like this (the model's stacked layout) and then served as ``_served``.
        self._stacked = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, self.param_shardings
        )
        self._param_dtype = jax.tree.leaves(state)[0].dtype
        self._compute_dtype = model.dtype
        self.kernels = Kernels.create(config.kernels, field="inference.backend.kernels", mesh=mesh)
        # Always a copy: the caller (the trainer) may donate or overwrite its arrays later.
        self.state: nnx.State = self._served(weights.place_state(state, state, self.param_shardings))
        self.version = 0
        # The last state pulled by manifest, as (lineage, manifest version, arrays): the only base a
        # delta manifest is applied over. Any other source of weights (place, load) forgets it.
        self._pulled: tuple[str, int, Any] | None = None
        self._pulled_lock = threading.Lock()
        self._host_buffers = HostBufferPool()  # pulls reuse the host memory of versions no longer served
        self.layout = EngineLayout.create(self.arch, config, model.dtype, mesh)
        self.cache = KVCache(*(self._zero_cache() for _ in range(2)))
        self.counts = self.layout.zero_counts()
        self._prefill_fn, self._decode_fn, self._copy_fn, self._reset_fn, self._traces = engine_programs(
            graphdef, self.layout, self.kernels
        )
        self.warmup_s: float | None = None
        self.device_s = {"prefill": 0.0, "decode": 0.0, "copy": 0.0}
        self.lockstep: Leader | None = None
        """Set on process 0 of a colocated engine: every device call is sent to the others first."""

    def device_order(self) -> contextlib.AbstractContextManager[Any]:
        """Held while this runner's device calls must not interleave with another thread's
        (colocated: the order every process issues programs in); a no-op in one process."""
        return self.lockstep.lock if self.lockstep is not None else contextlib.nullcontext()

    def _mirrored(self, name: str, *args: Any) -> contextlib.AbstractContextManager[Any]:
        """Process 0 of a colocated engine: send this call (plans without their sequences) first."""
        if self.lockstep is None:
            return contextlib.nullcontext()
        return self.lockstep.command(name, *(_arrays_only(a) if isinstance(a, (PrefillPlan, DecodePlan)) else a for a in args))

    def _zero_cache(self) -> jax.Array:
        layout = self.layout
        return weights.zeros_like_sharded(layout.cache_shape, layout.cache_dtype, layout.cache_sharding)

    # -- weights ---------------------------------------------------------------------------

    def _served(self, placed: nnx.State) -> Any:
        """The layout the programs take: 8-bit projections (``inference.backend.quantization``),
        else the kernels' (``Kernels.serving_weights``), projections in
        ``Kernels.projection_storage``'s dtype."""
        if self.config.quantization != "none":
            return quantize_state(placed, self.config.quantization)
        if (storage := self.kernels.projection_storage(self._compute_dtype)) is not None:
            placed = cast_projections(placed, storage)
        return self.kernels.serving_weights(placed, self._compute_dtype)

    def place(self, state: nnx.State | Decoder) -> Any:
        """New weights (the trainer's params pytree, any sharding) copied onto the runner's
        shardings, ready for ``swap``."""
        self._forget_pulled()
        return self._served(weights.place_state(state, self._stacked, self.param_shardings))

    def load(self, path: str | Path) -> Any:
        """A Hugging Face model directory (same architecture) loaded as new weights, ready for ``swap``."""
        self._forget_pulled()
        model = load_decoder(
            path, param_dtype=self._param_dtype, dtype=self._compute_dtype, sharding_fn=self._sharding_fn
        )
        if model.arch != self.arch:
            raise ValueError(f"update_weights: {path} holds a different architecture than the served model")
        return self._served(nnx.state(model))

    def pull(self, manifest: Manifest, *, timeout_s: float) -> Any:
        """The version ``manifest`` describes pulled from the trainer's publishers
        (``jaxrl.weight_transfer``) straight onto the runner's shardings, in the manifest's
        dtypes, then cast to the served dtypes as ``place`` does; ready for ``swap``. Raises
        ``PullError`` (naming the endpoint and the param) when any piece fails or the deadline
        passes: nothing is swapped then.

        A delta manifest is applied over the last state pulled when that is exactly its base
        (same lineage, version ``manifest.base_version``); otherwise the version is pulled whole.
        That state is kept for the next delta: the served state itself when the manifest's dtypes
        are the served ones (no extra memory), else one more copy in the manifest's dtypes.

        A manifest of 8-bit projections (``values`` + ``scale`` per weight: the trainer quantized
        them for this server's ``quantization``) is pulled into the served form itself: no
        quantize pass here, half a bfloat16 version's bytes on the wire. Its format must be this
        server's; a manifest in full precision is quantized here as ``place`` does."""
        with self._pulled_lock:
            lineage, have, previous = self._pulled or (None, None, None)
        dtypes = {p.path: jnp.dtype(p.dtype) for p in manifest.params}
        kind = quantization_of(dtypes)
        if kind != "none" and kind != self.config.quantization:
            raise ValueError(
                f"the trainer sent {kind} weights but this server serves quantization = "
                f'"{self.config.quantization}" (inference.backend.quantization): serve {kind}, or send '
                "full-precision weights"
            )
        template = self._stacked if kind == "none" else abstract_quantized(self._stacked, kind)
        target = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(
                x.shape, dtypes.get(param_path(path), x.dtype), sharding=x.sharding
            ),
            template,
        )
        pulled = pull_weights(
            manifest, target, timeout_s=timeout_s, previous=previous, have_version=have, have_lineage=lineage,
            buffers=self._host_buffers,
        )  # fmt: skip
        with self._pulled_lock:
            if self._pulled is None or self._pulled[0] != manifest.lineage or self._pulled[1] < manifest.version:
                self._pulled = (manifest.lineage, manifest.version, pulled)
        if kind != "none":  # the served form already; a leaf in another dtype than served is cast
            return jax.tree.map(
                lambda x, t: x if x.dtype == t.dtype else cast_to(x, t.dtype), pulled, template
            )
        if all(p.dtype == x.dtype for p, x in zip(jax.tree.leaves(pulled), jax.tree.leaves(self._stacked))):
            return self._served(pulled)  # already fresh buffers on the runner's shardings
        return self._served(weights.place_state(pulled, self._stacked, self.param_shardings))

    def _forget_pulled(self) -> None:
        with self._pulled_lock:
            self._pulled = None

    def swap(self, state: Any, version: int) -> None:
        """Serve ``state`` (from ``place`` / ``load``) as policy ``version`` from the next call on."""
        with self._mirrored("swap", version):
            self.state, self.version = state, version

    # -- programs --------------------------------------------------------------------------

    def compiled_programs(self) -> int:
        """Device programs compiled so far for this layout (<= ``config.program_bound()``)."""
        return self._traces.count

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile every program of the configured buckets ahead of time; returns the seconds.

        Nothing runs: the compiled executables land in jit's caches, so the first real call of
        each shape dispatches straight away. Several compile at once on hosts with more cores
        (XLA compiles outside the GIL). ``progress`` gets one line per program as it finishes
        (its name, shapes, how many of how many, its seconds): on a big model the warm-up takes
        minutes, and a silent process looks hung.
        """
        t0 = time.perf_counter()
        cfg, layout = self.config, self.layout
        jobs = [
            (f"prefill batch={batch} width={width}",
             partial(self._prefill_fn.lower, self.state, self.cache, self.counts, *layout.prefill_inputs(batch, width)))
            for batch, width in cfg.prefill_shapes()
        ]  # fmt: skip
        jobs += [
            (f"decode steps={steps} batch={batch}",
             partial(self._decode_fn.lower, steps, self.state, self.cache, self.counts, *layout.decode_inputs(batch)))
            for steps, batch in cfg.decode_shapes()
        ]  # fmt: skip
        index = jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.inputs)
        jobs.append(("row copy", partial(self._copy_fn.lower, self.cache, index, index)))
        jobs.append(("token-count reset", partial(self._reset_fn.lower, self.counts, *layout.reset_inputs())))
        workers = max(1, min(len(os.sched_getaffinity(0)), 8))
        done = iter(range(1, len(jobs) + 1))
        lock = threading.Lock()
        if progress is not None:
            progress(f"warm-up: compiling {len(jobs)} programs ({workers} at a time)")

        def compile_one(job: tuple[str, Callable[[], Any]]) -> None:
            name, lower = job
            start = time.perf_counter()
            lower().compile()
            if progress is not None:
                with lock:
                    progress(f"compiled {name} ({next(done)}/{len(jobs)}) in {time.perf_counter() - start:.1f} s")

        with ThreadPoolExecutor(workers, thread_name_prefix="jaxrl-warmup") as pool:
            list(pool.map(compile_one, jobs))
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    # -- device calls ----------------------------------------------------------------------

    def _put(self, arrays: Any) -> Any:
        return jax.device_put(arrays, self.layout.inputs)

    @contextlib.contextmanager
    def _timer(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.device_s[kind] += time.perf_counter() - t0

    def copy_row(self, src: int, dst: int) -> None:
        """Copy KV cache row ``src`` onto ``dst`` (prefix reuse)."""
        with self._mirrored("copy_row", src, dst), self._timer("copy"):
            self.cache = self._copy_fn(self.cache, *self._put((np.int32(src), np.int32(dst))))

    def reset_counts(self, row: int, prompt: np.ndarray) -> None:
        """Zero the generated-token counts of ``row`` and mark ``prompt``'s tokens (a penalised
        request's admission)."""
        mask = np.zeros(self.arch.vocab_size, np.bool_)
        mask[prompt] = True
        with self._mirrored("reset_counts", row, prompt), self._timer("copy"):
            self.counts = self._reset_fn(self.counts, *self._put((np.int32(row), mask)))

    def prefill(self, plan: PrefillPlan) -> DeviceOutputs:
        with self._mirrored("prefill", plan), self._timer("prefill"):
            args = self._put((plan.tokens, plan.positions, plan.rows, plan.last, plan.sampling))
            self.cache, tokens, logprobs, top, experts = self._prefill_fn(self.state, self.cache, self.counts, *args)
            return jax.device_get((tokens, logprobs, top, experts))

    def decode(self, plan: DecodePlan) -> DeviceOutputs:
        with self._mirrored("decode", plan), self._timer("decode"):
            args = self._put((plan.tokens, plan.positions, plan.rows, plan.sampling, (plan.share_rows, plan.share_lens)))
            self.cache, self.counts, tokens, logprobs, top, experts = self._decode_fn(
                plan.steps, self.state, self.cache, self.counts, *args
            )
            return jax.device_get((tokens, logprobs, top, experts))

    def reset(self) -> None:
        """After a failed device call: rebuild the buffers it consumed (donation)."""
        with self._mirrored("reset"):
            self._rebuild_consumed()

    def _rebuild_consumed(self) -> None:
        if any(a.is_deleted() for a in (self.cache.k, self.cache.v)):
            self.cache = KVCache(*(self._zero_cache() for _ in range(2)))
        if any(a.is_deleted() for a in (self.counts.output, self.counts.prompt)):
            self.counts = self.layout.zero_counts()

    @property
    def kv_cache_bytes(self) -> int:
        return sum(int(x.size) * x.dtype.itemsize for x in (self.cache.k, self.cache.v))


def _arrays_only(plan: PrefillPlan | DecodePlan) -> PrefillPlan | DecodePlan:
    """``plan`` without its sequences (requests, callbacks): what another process needs to repeat it."""
    return dataclasses.replace(plan, seqs=[])

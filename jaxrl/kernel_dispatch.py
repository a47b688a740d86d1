"""Which implementation of the hot spots runs: the pure-JAX references, the Pallas kernels, or a
platform's serving kernels.

The model is the same on every platform; a kernel or a weight layout is chosen here, behind one
call per site, never by parameters of the decoder. The call sites: the trainer's fused log-probs
(``jaxrl.trainer.step``), and in the decoder its training attention over packed segments, its
attention over the engine's KV cache, its projections, embedding lookup and logits. Each asks a
``Kernels`` object, made once at start-up from ``trainer.kernels`` / ``inference.backend.kernels``, and gets
back a function, or None for "keep your own reference" (so this module imports neither the
trainer nor the engine, which must not depend on each other). A mixture-of-experts model's
sparse layers ask for their expert MLP (``Kernels.expert_mlp``): the reference is
``jaxrl_kernels.moe.expert_mlp_reference`` (tokens sorted by expert, a grouped matmul, no capacity
drop), whose grouped matmul is XLA's ragged dot; CPU and GPU ("auto" and "reference" alike) swap
in ``moe.tiled_gmm``, because XLA lowers the ragged dot there as a masked dense dot against every
local expert (E times the FLOPs and E copies of the tokens in memory: XLA:CPU has no ragged dot,
and XLA:GPU's ``RaggedDotRewriter`` expands it the same way, jaxlib 0.10.2; compiled for 8 H100s,
Qwen3-30B-A3B's SFT micro-step needed 193 GiB of scratch per GPU that way, 45.5 tiled); TPU
("auto", "pallas") runs it with Pallas Megablox's grouped matmul (``jaxrl_kernels.megablox``,
tiled per shape within VMEM), "pallas_interpret" the same kernel interpreted. Under a mesh the
expert MLP runs per shard (``jaxrl_kernels.moe_parallel``): experts split over an "expert" mesh
axis, tokens all-gathered to them and reduce-scattered back:

* ``"auto"``: what ``jaxrl_kernels.select`` picks for the platform. TPU: the Pallas kernels. GPU
  (CUDA): the training attention by cuDNN's fused flash attention
  (``jaxrl_kernels.cudnn_attention``: causal mask type plus our segment mask as a bias, since
  JAX's public cuDNN API has no segment ids; float32 or shapes cuDNN rejects keep the reference),
  and the references for the rest: decode attention, because the engine's cache is one
  [layers, rows, kv_heads, len, head_dim] array read in place by row and layer, which cuDNN's
  call (contiguous per-row K/V) would copy out per step, and a one-token decode step is
  bandwidth-bound, which XLA's fused chunked reference already is; log-probs, because the
  reference is two GEMMs per vocabulary block and a fused reduction, which XLA hands to cuBLAS,
  and our Pallas kernel is Mosaic (TPU) only. CPU: the references, except the engine's decode: the CPU serving backend
  (``jaxrl_kernels.cpu_serving``: attention over the KV cache by a C++ kernel that makes one pass
  over the cache where XLA:CPU makes three, and on one device projections by a C++ matmul on
  weights packed once per update), imported on first use on a CPU only, built once per machine;
  the references where no C++ compiler is found or the backend is not installed.
* ``"reference"``: always the pure-JAX references (the decoder's own attention and
  ``jaxrl.trainer.logprobs.token_logprobs``), bit for bit what runs without this module.
* ``"pallas"``: always the compiled kernels; an error at start-up where they cannot run.
* ``"pallas_interpret"``: the kernels in Pallas interpret mode, on any backend; slow, for tests
  (it is how CPU tests run the wired path).

The engine serves weights in the layout ``Kernels.serving_weights`` gives (the model's own, or the
CPU backend's packed one) and, inside each program, ``Kernels.bind`` turns them back into the
model plus a ``Kernels`` that carries that program's serving inputs (packed weights, the
scheduler's shared-prefix hints): the engine passes them opaquely, the decoder never sees them.

A Pallas call is opaque to XLA's partitioner, so under a mesh each kernel runs per shard inside
``jax.shard_map``: rows over the batch axes, heads over "tensor" when both the query and the kv
heads divide by it (so each shard keeps whole grouped-query groups); the vocabulary stays whole
(the log-prob needs the full softmax), so ``lm_head`` is gathered into the kernel as the
reference's matmul gathers it. Axes that do not divide stay unsplit, as ``logical_to_spec``
decides everywhere else.

Context parallelism (a "context" mesh axis > 1: each row's sequence split over it) wraps the
training attention in Ulysses all-to-alls (DeepSpeed-Ulysses, arXiv 2309.14509): each device
trades its sequence chunk of every head for the whole sequence of 1/context of the heads, runs
the same square attention kernel as without context parallelism (Pallas, cuDNN or the reference,
segment ids all-gathered), and trades back. Why Ulysses and not ring attention: every kernel we
have runs unchanged on whole sequences with packed segment ids (a ring needs a kernel variant
with a query offset and an online-softmax merge across steps), and its traffic per device falls
with the context size (all-to-alls of q, k, v, out) where a ring's does not. Its limit is heads:
the query heads of a tensor shard must divide by the context size (checked at build,
``jaxrl.trainer.step.check_context_parallel``); KV heads that do not divide are repeated up to a
multiple that does (grouped-query attention keeps each query head on its own KV head), at the
cost of that repeat in the all-to-all.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from types import ModuleType
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from jaxrl_kernels import cudnn_attention, megablox, select
from jaxrl_kernels.attention import (
    blocked_segment_attention_reference,
    segment_attention,
    tpu_segment_attention,
)
from jaxrl_kernels.decode_attention import decode_attention
from jaxrl_kernels.logprobs import logprobs as pallas_logprobs
from jaxrl_kernels.moe import expert_mlp_reference, tiled_gmm
from jaxrl_kernels.moe_parallel import sharded_expert_mlp

from jaxrl.parallel.rules import EXPERT_AXIS, SEQ_AXIS, logical_to_spec

log = logging.getLogger(__name__)

KernelChoice = Literal["auto", "reference", "pallas", "pallas_interpret"]
Impl = Literal["reference", "pallas", "pallas_interpret", "cudnn"]

# Attention of (q, k, v) -> out with everything else (segments, lengths) already bound.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# Decode attention of (q, k cache, v cache, layer) -> out, reading the whole caches in place.
CacheAttend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# A projection of x by one or several weights that multiply it: x -> [x @ w for each weight].
Project = Callable[[jax.Array], list[jax.Array]]
# (hidden [N, D], lm_head [D, V], targets [N], temperature [N], *, block_size) -> (logp, entropy).
LogprobsFn = Callable[..., tuple[jax.Array, jax.Array]]
# (x [N, D], expert_ids [N, k], gates [N, k], w_gate, w_up [E, D, F], w_down [E, F, D]) -> [N, D].
ExpertMlp = Callable[..., jax.Array]


def resolve(choice: KernelChoice, platform: str, *, field: str) -> Impl:
    """The implementation ``choice`` means on ``platform``; a ValueError naming ``field`` when the
    compiled kernels are asked for where they cannot run."""
    if choice == "auto":
        if select.use_pallas(platform):
            return "pallas"
        return "cudnn" if select.use_cudnn(platform) else "reference"
    if choice == "pallas" and not select.use_pallas(platform):
        raise ValueError(
            f'{field} = "pallas" needs a backend the Pallas kernels compile for '
            f"({', '.join(sorted(select.PALLAS_PLATFORMS))}), but this run is on {platform!r}; "
            f'set {field} = "auto" (references here, kernels on TPU), "reference", or '
            f'"pallas_interpret" (the kernels in interpret mode: slow, for tests)'
        )
    if choice not in ("reference", "pallas", "pallas_interpret"):
        raise ValueError(
            f'{field} must be one of "auto", "reference", "pallas", "pallas_interpret"; got {choice!r}'
        )
    return choice


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


CPU_SERVING = "jaxrl_kernels.cpu_serving"
# Platforms whose XLA lowers jax.lax.ragged_dot as a masked dense dot over every expert
# (see the module docstring): the expert MLP runs moe.tiled_gmm there.
DENSE_RAGGED_DOT_PLATFORMS = ("cpu", "gpu", "cuda", "rocm")
# Platforms where a while loop's every trip waits on the host (``Kernels.loops_sync_host``).
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@functools.cache
def cpu_serving() -> ModuleType | None:
    """The CPU serving backend, imported on first use (only where "auto" runs on a CPU); None
    where it is not installed (a project without ``kernels/cpu_*`` runs the references)."""
    if importlib.util.find_spec(CPU_SERVING) is None:
        return None
    return importlib.import_module(CPU_SERVING)


@dataclass(frozen=True)
class Serving:
    """One engine program's serving inputs, bound into its ``Kernels`` (``Kernels.bind``): the
    backend's weights (``cpu_serving.ServingWeights``; None for the model's own layout) and the
    scheduler's note that positions < share_lens[b] of a query's cache row equal those of row
    share_rows[b] (copies of one prefill; a kernel may read them there, the others ignore it,
    which gives the same values)."""

    weights: Any = None
    shared: tuple[jax.Array, jax.Array] | None = None


@dataclass(frozen=True)
class Kernels:
    """A resolved kernel choice, and the mesh its Pallas calls run per shard on (None: unsharded).

    Hashable, so it can key compiled programs (the engine caches programs per layout); ``serving``
    (traced arrays of one program, ``bind``) takes no part in equality or hashing.
    """

    impl: Impl = "reference"
    mesh: Mesh | None = None
    cpu: bool = False  # "auto" on CPU: the CPU serving backend where it builds
    tpu: bool = False  # the engine stores its projections in the compute dtype (``projection_storage``)
    loops_sync_host: bool = False
    """Each trip of a while loop costs a host round trip (XLA:GPU copies the loop's predicate back
    per trip), so the reference cached attention walks the cache as one block of rows (one
    dynamic-trip loop per layer) instead of blocks of ``ROW_BLOCK`` (a loop per block: a CPU
    measure, where loops are free). The first H200 run (Qwen3-0.6B, 128 + 128 tokens) decoded 1349
    tok/s at batch 32 and 1451 at 128, a step's time growing with its 8 and 32 blocks x 28 layers
    of loops."""
    serving: Serving | None = field(default=None, compare=False, repr=False)

    @classmethod
    def create(cls, choice: KernelChoice, *, field: str, mesh: Mesh | None = None) -> Kernels:
        """Resolve ``choice`` for ``mesh``'s platform (JAX's default backend without a mesh)."""
        platform = mesh.devices.flat[0].platform if mesh is not None else select.current_platform()
        return cls(resolve(choice, platform, field=field), mesh, cpu=choice == "auto" and platform == "cpu",
                   tpu=platform == "tpu", loops_sync_host=platform.lower() in GPU_PLATFORMS)

    # -- the engine's weights ------------------------------------------------------------------

    def _cpu_backend(self) -> ModuleType | None:
        return cpu_serving() if self.cpu else None

    def projection_storage(self, compute_dtype: Any) -> Any:
        """The dtype the engine stores its projections in (``quantize.cast_projections``), None
        to keep them in the parameters' dtype. On TPU the compute dtype: XLA:TPU otherwise
        converts every layer's weights once per program call, outside the layer loop, a full
        copy as temporaries. Not on CPU / GPU: there XLA drops a float32 -> bfloat16 -> float32
        round trip (excess precision) and the dots read the float32 weights, as the trainer's
        do; stored in bfloat16, the engine's log-probs would move off the trainer's."""
        return compute_dtype if self.tpu else None

    def serving_weights(self, state: nnx.State, compute_dtype: Any) -> Any:
        """The layout the engine serves ``state`` in (its programs' ``bind`` takes it back): the
        CPU backend's packed projections on a one-device float32 CPU engine where the C++ matmul
        builds (under a mesh XLA partitions the dots instead), else ``state`` itself."""
        backend = self._cpu_backend()
        f32 = jnp.dtype(compute_dtype) == jnp.float32 and all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))
        if backend is None or self.mesh is not None or not f32 or not backend.matmul_available():
            return state
        return backend.pack(state)

    def bind(
        self, graphdef: nnx.GraphDef, served: Any, shared: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[Any, Kernels]:
        """Inside an engine program: the model from ``served`` (``serving_weights``' layout), and
        these kernels carrying that program's serving inputs (``Serving``) for the decoder's
        call sites. ``shared``: (share_rows, share_lens) [B] of a decode step (the scheduler's)."""
        backend = self._cpu_backend()
        weights = None
        if backend is not None:
            served, weights = backend.unpack(served)
        return nnx.merge(graphdef, served), replace(self, serving=Serving(weights, shared))

    @property
    def context_parallel(self) -> bool:
        """Sequences are split over a "context" mesh axis (the Ulysses path of the attention)."""
        return self.mesh is not None and self.mesh.shape.get(SEQ_AXIS, 1) > 1

    @property
    def reference(self) -> bool:
        """No Pallas kernel at any call site (the references, or cuDNN attention and references)."""
        return self.impl in ("reference", "cudnn")

    @property
    def _interpret(self) -> bool:
        return self.impl == "pallas_interpret"

    # -- sharding ------------------------------------------------------------------------------

    def _axes(self, logical: str, *sizes: int) -> str | tuple[str, ...] | None:
        """Mesh axes for a dimension shared by arrays of these ``sizes`` (None unless all divide)."""
        assert self.mesh is not None
        entries = {logical_to_spec((logical,), (s,), self.mesh)[0] for s in sizes}
        return entries.pop() if len(entries) == 1 else None

    def _per_shard(self, fn: Callable, in_specs: tuple, out_specs: object) -> Callable:
        if self.mesh is None:
            return fn
        # check_vma off: pallas_call has no varying-axes rule; the specs above say it all.
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    # -- the call sites ------------------------------------------------------------------

    def token_logprobs(self) -> LogprobsFn | None:
        """A drop-in for ``jaxrl.trainer.logprobs.token_logprobs`` (same arguments; its
        ``block_size``, the reference's vocabulary block, is ignored: the kernel keeps its own
        VMEM-sized tiles); None means that reference."""
        if self.reference:
            return None

        def fused(
            hidden: jax.Array,
            lm_head: jax.Array,
            targets: jax.Array,
            temperature: jax.Array,
            *,
            block_size: int,
        ) -> tuple[jax.Array, jax.Array]:
            del block_size
            fn = partial(pallas_logprobs, interpret=self._interpret)
            if self.mesh is not None:
                rows = self._axes("tokens", hidden.shape[0])
                specs = (PartitionSpec(rows, None), PartitionSpec(), PartitionSpec(rows), PartitionSpec(rows))
                fn = self._per_shard(fn, specs, (PartitionSpec(rows), PartitionSpec(rows)))
            return fn(hidden, lm_head, targets, temperature)

        return fused

    def training_attention(self, segment_ids: jax.Array, query: jax.ShapeDtypeStruct) -> Attend | None:
        """Causal attention within ``segment_ids`` [B, T] for the decoder's training forward, of
        queries like ``query`` [B, T, heads, head_dim]; None means the decoder's own (reference)
        attention: for the references, and on GPU for what cuDNN does not take (float32, see
        ``cudnn_attention.unsupported``; logged once per reason)."""
        context = self.mesh.shape[SEQ_AXIS] if self.context_parallel else 1
        inner: Callable[..., jax.Array] | None
        if self.impl == "cudnn":
            reason = cudnn_attention.unsupported(query)
            if reason is not None:
                _log_once(f"training attention: the XLA reference ({reason})")
            inner = cudnn_attention.cudnn_segment_attention if reason is None else None
        elif self.reference:
            inner = None
        else:
            inner = tpu_segment_attention if self.impl == "pallas" else partial(segment_attention, interpret=True)
        if inner is None:
            if context == 1:
                return None
            inner = blocked_segment_attention_reference  # the decoder's semantics, on whole sequences

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            if self.mesh is None:
                return inner(q, k, v, segment_ids)
            rows = self._axes("batch", q.shape[0])
            heads = self._axes("q_heads", q.shape[2], k.shape[2])
            seq = SEQ_AXIS if context > 1 else None
            qkv = PartitionSpec(rows, seq, heads, None)
            specs = (qkv, qkv, qkv, PartitionSpec(rows, seq))
            fn = inner if context == 1 else partial(_ulysses, inner, context=context)
            return self._per_shard(fn, specs, qkv)(q, k, v, segment_ids)

        return attend

    def cached_attention(self, positions: jax.Array, rows: jax.Array) -> CacheAttend | None:
        """Attention over the whole KV cache, read in place: query ``b, t`` (q [B, T, H, Dh]) at
        ``positions[b, t]`` sees positions <= its own of cache row ``rows[b]`` in ``layer`` of the
        caches [layers, rows, K, S, Dh]. None (the decoder's own attention) for the references and
        for prefill chunks (T > 1) everywhere: the Pallas kernel takes one-token steps only, and on
        CPU XLA's batched matmuls beat the C++ kernel's per-query dot products from 16-token chunks
        up (measured, one core, 800 cached positions: 16 rows x 16 tokens 28 vs 35 ms, 4 x 128 37
        vs 69 ms). The CPU kernel reads shared prefixes from one row (``Serving.shared``).

        Under a mesh, heads split over "tensor" as in training; cache rows are never split (the
        serving rules replicate them), as a query's row may be any row of the cache.
        """
        if positions.shape[1] != 1:
            return None
        if self.reference:
            backend = self._cpu_backend()
            if backend is None or not backend.attention_available():
                return None
            inner = backend.cached_attention
            index = positions
            shared = self.serving.shared if self.serving is not None else None
            extra = () if shared is None else shared
        else:

            def inner(q, k, v, layer, rows, lengths):  # type: ignore[no-untyped-def]
                return decode_attention(q[:, 0], k, v, lengths, rows=rows, layer=layer, interpret=self._interpret)[:, None]

            index = positions[:, 0] + 1  # the kernel's lengths
            extra = ()

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, layer: jax.Array) -> jax.Array:
            fn = inner
            if self.mesh is not None:
                heads = self._axes("q_heads", q.shape[2], k.shape[2])
                qs, cache_spec = PartitionSpec(None, None, heads, None), PartitionSpec(None, None, heads)
                specs = (qs, cache_spec, cache_spec, *[PartitionSpec()] * (3 + len(extra)))
                fn = self._per_shard(inner, specs, qs)
            return fn(q, k, v, layer, rows, index, *extra)

        return attend

    def expert_mlp(self) -> ExpertMlp | None:
        """The sparse layers' routed-expert MLP, with ``jaxrl_kernels.moe.expert_mlp_reference``'s
        arguments; None means that reference (grouped matmul = XLA's ragged dot). On CPU and GPU
        the reference with ``tiled_gmm`` (same result, without XLA's every-expert dense
        lowering of the ragged dot on both), whatever the choice: no kernel runs there, only a
        better pure-JAX form of the same product. On TPU the reference with Megablox's grouped
        matmul; "pallas_interpret" that kernel interpreted, on any backend.

        Under a mesh with an "expert" axis, or for the Pallas kernel (opaque to XLA's
        partitioner), it runs per shard (``moe_parallel.sharded_expert_mlp``): tokens over the
        mesh axes "tokens" maps them to where they divide, experts over "expert"."""
        platform = self.mesh.devices.flat[0].platform if self.mesh is not None else select.current_platform()
        local: ExpertMlp | None = None
        if not self.reference:
            local = partial(expert_mlp_reference, gmm=partial(megablox.gmm, interpret=self._interpret))
        elif platform.lower() in DENSE_RAGGED_DOT_PLATFORMS:
            local = partial(expert_mlp_reference, gmm=tiled_gmm)
        if self.mesh is None or (self.mesh.shape.get(EXPERT_AXIS, 1) == 1 and self.reference):
            return local
        inner = local or expert_mlp_reference

        def per_shard(
            x: jax.Array, expert_ids: jax.Array, gates: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
        ) -> jax.Array:
            mesh = self.mesh
            assert mesh is not None
            fn = sharded_expert_mlp(inner, mesh, logical_to_spec(("tokens",), (x.shape[0],), mesh)[0])
            return fn(x, expert_ids, gates, w_gate, w_up, w_down)

        return per_shard

    # -- projections (serving layouts) ---------------------------------------------------------

    def _weights(self) -> Any:
        return self.serving.weights if self.serving is not None else None

    def projection(self, names: tuple[str, ...], layer: jax.Array) -> Project | None:
        """``x [..., K] -> [x @ w[layer] for w in names]`` (float32) for weights ``names`` that
        multiply the same input, read from the serving layout; None: the decoder's own dot."""
        weights = self._weights()
        return weights.projection(names, layer) if weights is not None else None

    def embedding(self) -> Callable[[jax.Array], jax.Array] | None:
        """``tokens -> embedding rows`` from the serving layout (a tied table kept once, as the
        packed output projection); None: the decoder's own lookup."""
        weights = self._weights()
        return weights.embedding() if weights is not None else None

    def logits(self) -> Callable[[jax.Array], jax.Array] | None:
        """``hidden [..., D] -> float32 logits [..., V]`` from the serving layout; None: the
        decoder's own ``logits_f32``."""
        weights = self._weights()
        return weights.logits if weights is not None else None


def _ulysses(inner: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, context: int) -> jax.Array:
    """Per shard: q [B, T/c, H, D], k/v [B, T/c, K, D], seg [B, T/c] (this device's sequence
    chunk) -> ``inner`` on [B, T, H/c, D] (whole sequences, 1/c of the heads) -> back to chunks.
    KV heads are first repeated up to a multiple of c (each copy next to its original, so query
    head j still meets KV head j // group)."""
    kv = k.shape[2]
    repeat = math.lcm(kv, context) // kv
    if repeat > 1:
        k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)

    def to_heads(x: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(x, SEQ_AXIS, split_axis=2, concat_axis=1, tiled=True)

    out = inner(to_heads(q), to_heads(k), to_heads(v), jax.lax.all_gather(seg, SEQ_AXIS, axis=1, tiled=True))
    return jax.lax.all_to_all(out, SEQ_AXIS, split_axis=1, concat_axis=2, tiled=True)

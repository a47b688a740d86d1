"""Which implementation of the hot spots runs: the pure-JAX references or the Pallas kernels.

Three call sites can take a kernel from ``kernels/``: the trainer's fused log-probs
(``jaxrl.trainer.step``), the decoder's training attention over packed segments, and its
one-token decode attention over the engine's KV cache. Each asks a ``Kernels`` object, made once
at start-up from ``trainer.kernels`` / ``inference.kernels``, and gets back a function, or None
for "keep your own reference" (so this module imports neither the trainer nor the engine, which
must not depend on each other):

* ``"auto"``: the Pallas kernels where ``jaxrl_kernels.select`` says they run (TPU), the references
  elsewhere, except the engine's decode on CPU: attention over the KV cache by the C++ kernel
  ``jaxrl_kernels.cpu_cached_attention`` (one pass over the cache where XLA:CPU makes three) and, on
  one device, projections by ``jaxrl_kernels.cpu_matmul`` (``packs_matmul_weights``); both built
  once per machine, the references where no C++ compiler is found.
* ``"reference"``: always the pure-JAX references (the decoder's own attention and
  ``jaxrl.trainer.logprobs.token_logprobs``), bit for bit what runs without this module.
* ``"pallas"``: always the compiled kernels; an error at start-up where they cannot run.
* ``"pallas_interpret"``: the kernels in Pallas interpret mode, on any backend; slow, for tests
  (it is how CPU tests run the wired path).

A Pallas call is opaque to XLA's partitioner, so under a mesh each kernel runs per shard inside
``jax.shard_map``: rows over the batch axes, heads over "tensor" when both the query and the kv
heads divide by it (so each shard keeps whole grouped-query groups); the vocabulary stays whole
(the log-prob needs the full softmax), so ``lm_head`` is gathered into the kernel as the
reference's matmul gathers it. Axes that do not divide stay unsplit, as ``logical_to_spec``
decides everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxrl.parallel.rules import logical_to_spec
from jaxrl_kernels import cpu_cached_attention as cpu_kernel
from jaxrl_kernels import cpu_matmul
from jaxrl_kernels import select
from jaxrl_kernels.attention import segment_attention, tpu_segment_attention
from jaxrl_kernels.decode_attention import decode_attention
from jaxrl_kernels.logprobs import logprobs as pallas_logprobs

KernelChoice = Literal["auto", "reference", "pallas", "pallas_interpret"]
Impl = Literal["reference", "pallas", "pallas_interpret"]

# Attention of (q, k, v) -> out with everything else (segments, lengths) already bound.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# Decode attention of (q, k cache, v cache, layer) -> out, reading the whole caches in place.
CacheAttend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# (hidden [N, D], lm_head [D, V], targets [N], temperature [N], *, block_size) -> (logp, entropy).
LogprobsFn = Callable[..., tuple[jax.Array, jax.Array]]


def resolve(choice: KernelChoice, platform: str, *, field: str) -> Impl:
    """The implementation ``choice`` means on ``platform``; a ValueError naming ``field`` when the
    compiled kernels are asked for where they cannot run."""
    if choice == "auto":
        return "pallas" if select.use_pallas(platform) else "reference"
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


@dataclass(frozen=True)
class Kernels:
    """A resolved kernel choice, and the mesh its Pallas calls run per shard on (None: unsharded).

    Hashable, so it can key compiled programs (the engine caches programs per layout).
    """

    impl: Impl = "reference"
    mesh: Mesh | None = None
    cpu_attention: bool = False  # "auto" on CPU: KV-cache attention by the C++ kernel where it builds

    @classmethod
    def create(cls, choice: KernelChoice, *, field: str, mesh: Mesh | None = None) -> Kernels:
        """Resolve ``choice`` for ``mesh``'s platform (JAX's default backend without a mesh)."""
        platform = mesh.devices.flat[0].platform if mesh is not None else select.current_platform()
        return cls(resolve(choice, platform, field=field), mesh, cpu_attention=choice == "auto" and platform == "cpu")

    def packs_matmul_weights(self) -> bool:
        """Whether the engine's decode projections run on the CPU matmul kernel
        (``jaxrl_kernels.cpu_matmul``: weights packed once per update): "auto" on a one-device CPU
        engine, where the kernel builds. Under a mesh XLA partitions the dots instead."""
        return self.cpu_attention and self.mesh is None and cpu_matmul.load() is not None

    @property
    def reference(self) -> bool:
        return self.impl == "reference"

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

    # -- the three call sites ------------------------------------------------------------------

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
                rows = self._axes("batch", hidden.shape[0])
                specs = (PartitionSpec(rows, None), PartitionSpec(), PartitionSpec(rows), PartitionSpec(rows))
                fn = self._per_shard(fn, specs, (PartitionSpec(rows), PartitionSpec(rows)))
            return fn(hidden, lm_head, targets, temperature)

        return fused

    def training_attention(self, segment_ids: jax.Array) -> Attend | None:
        """Causal attention within ``segment_ids`` [B, T] for the decoder's training forward;
        None means the decoder's own (reference) attention."""
        if self.reference:
            return None
        inner = tpu_segment_attention if self.impl == "pallas" else partial(segment_attention, interpret=True)

        def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            if self.mesh is None:
                return inner(q, k, v, segment_ids)
            rows = self._axes("batch", q.shape[0])
            heads = self._axes("q_heads", q.shape[2], k.shape[2])
            qkv = PartitionSpec(rows, None, heads, None)
            specs = (qkv, qkv, qkv, PartitionSpec(rows, None))
            return self._per_shard(inner, specs, qkv)(q, k, v, segment_ids)

        return attend

    def cached_attention(
        self, positions: jax.Array, rows: jax.Array, shared: tuple[jax.Array, jax.Array] | None = None
    ) -> CacheAttend | None:
        """Attention over the whole KV cache, read in place: query ``b, t`` (q [B, T, H, Dh]) at
        ``positions[b, t]`` sees positions <= its own of cache row ``rows[b]`` in ``layer`` of the
        caches [layers, rows, K, S, Dh]. The Pallas kernel takes one-token steps (T = 1; prefill
        chunks keep the decoder's own attention), the CPU kernel any T. None (the decoder's own
        attention) for the references.

        ``shared`` (share_rows, share_lens) [B]: the engine's note that positions < share_lens[b]
        of row ``rows[b]`` equal those of row ``share_rows[b]`` (copies of one prefill). The CPU
        kernel reads them there (one copy for many rows stays in cache); the others ignore it,
        which gives the same values.

        Under a mesh, heads split over "tensor" as in training; cache rows are never split (the
        serving rules replicate them), as a query's row may be any row of the cache.
        """
        if self.reference:
            if not (self.cpu_attention and cpu_kernel.load() is not None):
                return None
            inner = cpu_kernel.cpu_cached_attention
            index = positions
            extra = () if shared is None else shared
        elif positions.shape[1] != 1:
            return None
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

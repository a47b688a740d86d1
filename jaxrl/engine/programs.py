"""The engine's model runner side: its device programs and the layout of the state they run on.

``EngineLayout`` says where and in what shapes the KV cache, the penalties' token counts and the
host-fed inputs live (no weights needed, so ``jaxrl.aot`` describes the programs from it alone);
``engine_programs`` jits the prefill, decode, row-copy and counts-reset programs for one layout
(as vLLM's model runner owns the compiled forward and the cache, apart from the engine core's
loop in ``jaxrl.engine.engine``).

Device programs are compiled per shape bucket (``EngineConfig.program_bound``): batch and
prompt-chunk sizes, never cache lengths. Decode reads and writes the KV cache in place
(donated): the reference attention (``jaxrl.models.layers.cached_attention``) reads each block
of rows up to its furthest position, the decode kernel (TPU) each row's live blocks; nothing is
copied per call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.engine import weights
from jaxrl.engine.config import EngineConfig
from jaxrl.engine.token_sampling import SamplingBatch, TokenCounts, penalize, sample_with_top
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.quantize import dequantize_state
from jaxrl.models.setup import DTYPES


def _prefill(graphdef, state, cache, counts, tokens, positions, rows, last, sampling, *, kernels, top):  # type: ignore[no-untyped-def]
    """One batch of prompt chunks. ``kernels`` gives the projections of the served layout; the
    attention is the reference on every backend (``Kernels.cached_attention`` takes one-token
    steps only). ``top``: top log-probs output per token (``sample_with_top``). 8-bit
    projections (``jaxrl.models.quantize``) are dequantized here, where XLA fuses it into their dots."""
    model, kernels = kernels.bind(graphdef, dequantize_state(state))
    hidden, cache, experts = _forward(model, tokens, positions, cache, rows, kernels)
    h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    logits = penalize(model.logits_f32(h_last, kernels), counts, rows, sampling)
    next_tokens, logprobs, top_ids, top_logprobs = sample_with_top(logits, sampling, top)
    return cache, next_tokens, logprobs, (top_ids, top_logprobs), experts


def routing_dtype(num_experts: int) -> Any:
    """The compact host dtype of routing records: uint8 up to 256 experts, else uint16 (what
    vLLM and verifiers carry)."""
    return jnp.uint8 if num_experts <= 256 else jnp.uint16


def _forward(model, tokens, positions, cache, rows, kernels):  # type: ignore[no-untyped-def]
    """The cached forward; for a mixture-of-experts model also each token's experts per sparse
    layer (``[B, T, n_moe_layers, k]`` in ``routing_dtype``: routing replay records them), for a
    dense model an empty ``[B, T, 0, 0]``."""
    arch = model.arch
    if not arch.is_moe:
        hidden, cache = model(tokens, positions, cache=cache, cache_rows=rows, kernels=kernels)
        return hidden, cache, jnp.zeros((*tokens.shape, 0, 0), jnp.uint8)
    hidden, cache, aux = model(tokens, positions, cache=cache, cache_rows=rows, kernels=kernels, with_moe_aux=True)
    return hidden, cache, aux.experts.astype(routing_dtype(arch.num_experts))


def _decode(graphdef, steps, state, cache, counts, tokens, positions, rows, sampling, shared, *, kernels, top):  # type: ignore[no-untyped-def]
    """``steps`` decode steps over the whole cache, read and written in place (donated).
    ``counts`` (``TokenCounts``, donated too) counts each fed token (the one sampled last) as
    generated before the step samples, for the penalties.

    Attention by ``kernels`` (``inference.backend.kernels``): the decode kernel (TPU) reads each row's
    live blocks, the reference (``cached_attention``) each block of rows up to its furthest
    position. Padding entries have a row index out of range (their writes are dropped,
    what they read is discarded) and position 0. ``shared``: ``DecodePlan``'s share rows/lengths,
    handed to the kernels (``Kernels.bind``).
    """
    model, kernels = kernels.bind(graphdef, dequantize_state(state), shared)

    def body(carry, _):  # type: ignore[no-untyped-def]
        cache, counts, tok, pos, index = carry
        counts = counts.count(rows, tok)
        hidden, cache, experts = _forward(model, tok[:, None], pos[:, None], cache, rows, kernels)
        logits = penalize(model.logits_f32(hidden[:, 0], kernels), counts, rows, sampling)
        new, logp, top_ids, top_logp = sample_with_top(logits, replace(sampling, draw_position=index), top)
        return (cache, counts, new, pos + 1, index + 1), (new, logp, (top_ids, top_logp), experts[:, 0])

    carry = (cache, counts, tokens, positions, sampling.draw_position)
    (cache, counts, *_), (new_tokens, logprobs, tops, experts) = jax.lax.scan(body, carry, None, length=steps)
    return cache, counts, new_tokens, logprobs, tops, experts


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
    top_logprobs: int  # top log-probs every program outputs per token (``max_logprobs``, at most the vocab)
    quantization: str  # the served projections' format ("none", "int8", "fp8": ``jaxrl.models.quantize``)
    inputs: Any  # sharding of host-fed inputs and of the token counts (replicated)
    key: tuple  # every shape the programs compile for (keys the program cache)

    @classmethod
    def create(cls, arch: Any, config: EngineConfig, compute_dtype: Any, mesh: Mesh | None) -> EngineLayout:
        cache_dtype = compute_dtype if config.kv_cache_dtype == "auto" else DTYPES[config.kv_cache_dtype]
        shape = KVCache.shape(arch, config.max_seqs, config.max_model_len)
        key = (shape, str(jnp.dtype(cache_dtype)), tuple(config.decode_buckets()))
        key += tuple(map(tuple, (config.prefill_lengths(), config.prefill_batches(), config.decode_step_counts())))
        counts = (config.max_seqs, arch.vocab_size)
        top = min(config.max_logprobs, arch.vocab_size)
        sharding = weights.cache_sharding(mesh, shape)
        return cls(mesh, shape, cache_dtype, sharding, counts, top, config.quantization, weights.replicated(mesh),
                   key + counts + (top, config.quantization))  # fmt: skip

    def abstract_cache(self) -> KVCache:
        one = jax.ShapeDtypeStruct(self.cache_shape, self.cache_dtype, sharding=self.cache_sharding)
        return KVCache(one, one)

    def abstract_counts(self) -> TokenCounts:
        return TokenCounts(self._abstract(self.counts_shape, jnp.int32), self._abstract(self.counts_shape, jnp.bool_))

    def zero_counts(self) -> TokenCounts:
        return TokenCounts(*(weights.zeros_like_sharded(self.counts_shape, dt, self.inputs) for dt in (jnp.int32, jnp.bool_)))

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
            a((batch,), f32), a((batch,), f32), a((batch,), f32), a((batch,), i32),
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
        traces.wrap(partial(_prefill, graphdef, kernels=kernels, top=layout.top_logprobs)),
        donate_argnums=(1,),
        out_shardings=(cache_out, inputs_sh, inputs_sh, (inputs_sh, inputs_sh), inputs_sh),
    )
    decode = jax.jit(
        traces.wrap(partial(_decode, graphdef, kernels=kernels, top=layout.top_logprobs)),
        static_argnums=(0,),  # steps
        donate_argnums=(2, 3),
        out_shardings=(cache_out, counts_out, inputs_sh, inputs_sh, (inputs_sh, inputs_sh), inputs_sh),
    )
    copy = jax.jit(traces.wrap(_copy_row), donate_argnums=(0,), out_shardings=cache_out)
    reset = jax.jit(traces.wrap(_reset_counts), donate_argnums=(0,), out_shardings=counts_out)
    return EnginePrograms(prefill, decode, copy, reset, traces)

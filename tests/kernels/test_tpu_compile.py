"""The kernels compile for real TPU generations at Qwen3 sizes, within VMEM, copying nothing big.

``test_tpu_lowering`` stops at Pallas's TPU lowering; here libtpu's compile-only client
(``jax.experimental.topologies``; no TPU needed) runs the whole Mosaic and XLA compile for v5e
and v6e chips, which is where VMEM limits (``CompileTimeScopedVmemOom``) and layout copies show
up, and ``memory_analysis()`` gives each program's temporaries per chip. Kernels are traced under
a mesh of the target's devices, as ``jaxrl.kernel_dispatch`` runs them, so they size their blocks
for that chip. Shapes: Qwen3-0.6B (D 1024, 16 q / 8 kv heads of 128) and Qwen3-8B (D 4096, 32 /
8), vocabulary 151936, bfloat16 unless named. Skipped when libtpu is absent (the ``tpu`` extra).
"""

from __future__ import annotations

import importlib.util
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("TPU compiles need libtpu: pip install -e '.[tpu]'", allow_module_level=True)

# Compile-only use touches no TPU, so several processes (pytest workers, other runs on the host)
# may load libtpu at once; without this, all but the first fail on libtpu's lockfile.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxrl_kernels.attention import segment_attention, tpu_segment_attention
from jaxrl_kernels.decode_attention import decode_attention
from jaxrl_kernels.logprobs import logprobs

from jaxrl.engine import weights
from jaxrl.engine.programs import _decode, _prefill
from jaxrl.engine.token_sampling import SamplingBatch, SamplingParams, TokenCounts
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.arch import ModelArch
from jaxrl.models.decoder import Decoder
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.quantize import cast_projections

GENERATIONS = ["v5e:2x2", "v6e:2x2"]
VOCAB = 151936
QWEN3 = {"0.6B": (1024, 16), "8B": (4096, 32)}  # (hidden, query heads); 8 kv heads of 128
KV_HEADS, HEAD_DIM = 8, 128
BF16 = jnp.bfloat16


@pytest.fixture(scope="module", params=GENERATIONS)
def topology(request) -> list:
    """The named topology's (compile-only) devices."""
    return list(topologies.get_topology_desc(platform="tpu", topology_name=request.param).devices)


@pytest.fixture(scope="module")
def chip(topology) -> Mesh:
    """A one-chip mesh (what ``shard_map`` gives each kernel call)."""
    return Mesh(np.array(topology[:1]), ("x",))


def _compile(mesh: Mesh, fn, *shapes):
    """Compile ``fn`` for ``mesh``'s chip from (shape, dtype) pairs; its memory analysis."""
    sharding = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(*args).compile().memory_analysis()


def _grad(fn, argnums):
    def loss(*args):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(fn(*args)))

    return jax.grad(loss, argnums=argnums)


@pytest.mark.parametrize(
    "size, dtype", [("0.6B", BF16), ("8B", BF16), ("0.6B", jnp.float32)], ids=["0.6B", "8B", "0.6B-f32"]
)
def test_logprobs_forward_and_backward_fit(chip, size, dtype) -> None:
    """On main this failed with CompileTimeScopedVmemOom (8B on both chips, f32 on v5e)."""
    if dtype == jnp.float32 and chip.devices.flat[0].device_kind != "TPU v5 lite":
        pytest.skip("float32 inputs: v5e, the chip it failed on, is enough (compiles take seconds)")
    d, n = QWEN3[size][0], 1024
    shapes = [((n, d), dtype), ((d, VOCAB), dtype), ((n,), jnp.int32), ((n,), jnp.float32)]
    mem = _compile(chip, _grad(logprobs, (0, 1, 3)), *shapes)
    # Never [N, V] logits, nor a copy of lm_head: temporaries well under lm_head's size.
    assert mem.temp_size_in_bytes < 0.1 * d * VOCAB * jnp.dtype(dtype).itemsize


@pytest.mark.parametrize("size", ["0.6B", "8B"])
def test_training_attention_forward_and_backward_fit(chip, size) -> None:
    """What ``kernels = "auto"`` runs on TPU (splash here: T is a multiple of 128)."""
    t, heads = 4096, QWEN3[size][1]
    q, kv = ((1, t, heads, HEAD_DIM), BF16), ((1, t, KV_HEADS, HEAD_DIM), BF16)
    mem = _compile(chip, _grad(tpu_segment_attention, (0, 1, 2)), q, kv, kv, ((1, t), jnp.int32))
    q_bytes = t * heads * HEAD_DIM * 2
    assert mem.temp_size_in_bytes < 16 * q_bytes  # a [T, T] score matrix per head would be 64x


def test_segment_attention_kernel_fits(chip) -> None:
    """Our kernel (T not a multiple of 128, where splash does not apply)."""
    t, heads = 4000, QWEN3["8B"][1]
    q, kv = ((1, t, heads, HEAD_DIM), BF16), ((1, t, KV_HEADS, HEAD_DIM), BF16)
    mem = _compile(chip, _grad(segment_attention, (0, 1, 2)), q, kv, kv, ((1, t), jnp.int32))
    assert mem.temp_size_in_bytes < 16 * t * heads * HEAD_DIM * 2


@pytest.mark.parametrize("size", ["0.6B", "8B"])
def test_decode_attention_reads_the_cache_in_place(chip, size) -> None:
    """32 rows x 4096 positions x 2 layers. On main (a [B, S, K, Dh] cache viewed as
    [B, S, K * Dh]) the kernel's operands were a relayout copy of all of K and V."""
    layers, rows, s, heads = 2, 32, 4096, QWEN3[size][1]
    cache = ((layers, rows, KV_HEADS, s, HEAD_DIM), BF16)
    i32 = ((rows,), jnp.int32)
    fn = lambda q, k, v, n, r, l: decode_attention(q, k, v, n, rows=r, layer=l)
    mem = _compile(chip, fn, ((rows, heads, HEAD_DIM), BF16), cache, cache, i32, i32, ((), jnp.int32))
    cache_bytes = 2 * np.prod(cache[0]) * 2
    assert mem.temp_size_in_bytes < 0.1 * cache_bytes


def _small_engine(topology, *, layers: int = 2, hidden: int = 512, param_dtype=BF16, cache_len: int = 4096):
    """A small TPU-aligned model's abstract engine state, tensor-parallel over the chips' kv
    heads: (graphdef, weights, cache of 32 rows x ``cache_len`` positions, token counts, mesh,
    cache bytes per chip)."""
    arch = ModelArch(
        model_type="qwen3", vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
        num_heads=8, num_kv_heads=4, head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=1e6,
        rope_scaling=None, qk_norm=True, qkv_bias=False, tie_word_embeddings=False,
        max_position_embeddings=4096,
    )  # fmt: skip
    mesh = Mesh(np.array(topology), ("tensor",))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(arch, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=BF16)))
    shard = weights.param_sharding_fn(mesh)
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard(weights.param_name(p), x.shape)), state
    )
    shape = KVCache.shape(arch, ROWS, cache_len)
    cache_sh = weights.cache_sharding(mesh, shape)
    cache = KVCache(*(jax.ShapeDtypeStruct(shape, BF16, sharding=cache_sh) for _ in range(2)))
    rep = weights.replicated(mesh)
    vocab = (ROWS, arch.vocab_size)
    counts = TokenCounts(jax.ShapeDtypeStruct(vocab, jnp.int32, sharding=rep), jax.ShapeDtypeStruct(vocab, jnp.bool_, sharding=rep))
    return graphdef, state, cache, counts, mesh, 2 * np.prod(shape) * 2 / mesh.size


ROWS = 32


def _sampling(batch: int, sharding) -> SamplingBatch:
    host = SamplingBatch.host([SamplingParams()] * batch, [0] * batch, [0] * batch, batch)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), host)


def test_engine_decode_program_copies_no_cache(topology) -> None:
    """The engine's whole decode program (4 steps: cache writes, decode kernel, sampling):
    temporaries per chip stay under 10% of its cache. On main the window gather alone was a
    copy of the live cache."""
    graphdef, state, cache, counts, mesh, cache_bytes_per_chip = _small_engine(topology)
    rep = weights.replicated(mesh)
    ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32, sharding=rep)
    decode = jax.jit(partial(_decode, graphdef, 4, kernels=Kernels("pallas", mesh), top=20), donate_argnums=(1, 2))
    mem = decode.lower(state, cache, counts, ids, ids, ids, _sampling(ROWS, rep), (ids, ids)).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.1 * cache_bytes_per_chip


def test_engine_prefill_program_copies_no_cache(topology) -> None:
    """The engine's prefill program (8 prompt chunks of 512: cache writes, the reference cached
    attention, sampling): temporaries per chip under 25% of its cache. Before, the attention's
    per-row cache reads were a gather for which XLA re-laid the whole cache and copied it back:
    temporaries 2x the cache (the Qwen3-8B recipe's prefill did not fit an 8-chip v6e)."""
    graphdef, state, cache, counts, mesh, cache_bytes_per_chip = _small_engine(topology)
    rep = weights.replicated(mesh)
    batch, length = 8, 512
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=rep)
    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    prefill = jax.jit(partial(_prefill, graphdef, kernels=Kernels("pallas", mesh), top=20), donate_argnums=(1,))
    mem = prefill.lower(state, cache, counts, tokens, tokens, rows, rows, _sampling(batch, rep)).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.25 * cache_bytes_per_chip


def test_engine_decode_serves_float32_params_without_a_per_call_weight_copy() -> None:
    """float32 parameters, bfloat16 compute (the trainer's precision): through
    ``Kernels.projection_storage`` a TPU engine stores its projections in bfloat16, and the decode
    program's temporaries hold no copy of them. Served as float32, XLA:TPU converted every
    layer's stacked weights once per call outside the layer loop (this model: 43 MB of
    temporaries per chip against 3.5; Qwen3-8B on v5p-32 2.10 GiB against 0.62)."""
    topology = list(topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices)
    graphdef, state, cache, counts, mesh, _ = _small_engine(topology, layers=4, hidden=2048, param_dtype=jnp.float32, cache_len=1024)
    kernels = Kernels.create("auto", field="inference.backend.kernels", mesh=mesh)
    served = cast_projections(state, kernels.projection_storage(BF16))  # as ModelRunner._served
    projections = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    bf16_copy = sum(np.prod(x.shape) * 2 for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
                    if weights.param_name(p) in projections) / mesh.size  # fmt: skip
    rep = weights.replicated(mesh)
    ids = jax.ShapeDtypeStruct((ROWS,), jnp.int32, sharding=rep)
    decode = jax.jit(partial(_decode, graphdef, 4, kernels=kernels, top=20), donate_argnums=(1, 2))
    mem = decode.lower(served, cache, counts, ids, ids, ids, _sampling(ROWS, rep), (ids, ids)).compile().memory_analysis()
    assert mem.temp_size_in_bytes < 0.2 * bf16_copy

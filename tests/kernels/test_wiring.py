"""The Pallas kernels wired into the trainer and the engine give what the references give.

``kernels = "pallas_interpret"`` runs the same call sites the TPU runs (fused log-probs, segment
attention per shard under ``shard_map``, decode attention over the engine's KV cache), in
interpret mode on the 8-device CPU mesh. Each case compiles once (interpret mode is slow);
shapes are tiny, rows are packed with several segments each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_samples, tiny_model
from jax import export

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.kernel_dispatch import Kernels, resolve
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.sharding import shard_params
from jaxrl.parallel.mesh import MeshConfig, batch_sharding, make_mesh
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.packing import component_counts, pack
from jaxrl.trainer.step import Trainer, micro_batch_loss

SEQ_LEN = 32
# XLA:CPU's backend optimisations take ~3/4 of each train-step compile here and change nothing
# these tests check (both sides of every comparison compile with the same options).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _batch():
    samples = random_samples(30, seed=1, max_len=14)
    batch = pack(samples, SEQ_LEN, rows_multiple=8)
    segments = batch.segment_ids.max(axis=1)
    assert batch.num_rows == 8 and (segments >= 2).all(), "every row must pack several samples"
    counts = {k: jnp.float32(v) for k, v in component_counts(batch).items()}
    return {k: jnp.asarray(v) for k, v in batch.as_dict().items()}, counts


def _loss_and_grads(graphdef, cfg, kernels, *args):
    """(loss, grads) of ``micro_batch_loss`` and the jaxpr they were compiled from."""
    fn = jax.value_and_grad(lambda p, mb, c: micro_batch_loss(p, graphdef, mb, c, cfg, kernels)[0])
    traced = jax.jit(fn).trace(*args)
    return traced.lower().compile(compiler_options=FAST_COMPILE)(*args), str(traced.jaxpr)


@pytest.fixture(scope="module")
def reference():
    """Loss and gradients of the reference path, unsharded (sharded == unsharded is
    tests/trainer/test_step.py's invariant)."""
    cfg = TrainerConfig(seq_len=SEQ_LEN, seq_len_buckets=[SEQ_LEN], kernels="reference")
    graphdef, params = nnx.split(tiny_model(vocab=64))
    mb, counts = _batch()
    (loss, grads), _ = _loss_and_grads(graphdef, cfg, Kernels("reference"), params, mb, counts)
    return cfg, graphdef, params, mb, counts, float(loss), grads


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_kernel_loss_and_grads_equal_reference(reference, mesh_shape) -> None:
    cfg, graphdef, params, mb, counts, want_loss, want_grads = reference
    mesh = make_mesh(MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]))
    kernels = Kernels.create("pallas_interpret", field="trainer.kernels", mesh=mesh)
    params = shard_params(params, mesh)
    mb = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in mb.items()}
    (loss, grads), jaxpr = _loss_and_grads(graphdef, cfg, kernels, params, mb, counts)
    # The wired path really runs: log-prob fwd + 2 bwd, attention fwd + dq + dkv, all per shard.
    assert jaxpr.count("pallas_call") >= 6 and "shard_map" in jaxpr
    assert abs(float(loss) - want_loss) <= 1e-5
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(
            np.asarray(b), np.asarray(a), atol=1e-5, err_msg=jax.tree_util.keystr(path)
        )


def test_trainer_resolves_kernels_for_its_mesh() -> None:
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = TrainerConfig(seq_len=SEQ_LEN, seq_len_buckets=[SEQ_LEN], kernels="pallas_interpret")
    assert Trainer(tiny_model(vocab=64), cfg, mesh).kernels == Kernels("pallas_interpret", mesh)
    auto = Trainer(tiny_model(vocab=64), cfg.model_copy(update={"kernels": "auto"}), mesh).kernels
    assert auto.reference  # CPU: the references, so nothing else changes speed or results


def test_pallas_on_a_backend_without_the_kernels_fails_at_startup() -> None:
    mesh = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
    cfg = TrainerConfig(seq_len=SEQ_LEN, seq_len_buckets=[SEQ_LEN], kernels="pallas")
    with pytest.raises(ValueError, match=r'trainer\.kernels = "pallas".*\'cpu\'.*"auto"'):
        Trainer(tiny_model(vocab=64), cfg, mesh)
    with pytest.raises(ValueError, match=r'inference\.backend\.kernels = "pallas"'):
        Engine(tiny_model(vocab=64), EngineConfig(max_model_len=64, kernels="pallas"))
    with pytest.raises(ValueError, match="kernels"):
        EngineConfig(kernels="triton")
    assert resolve("pallas", "tpu", field="x") == "pallas"
    assert resolve("auto", "tpu", field="x") == "pallas"
    assert resolve("auto", "gpu", field="x") == "cudnn"
    assert resolve("pallas_interpret", "cpu", field="x") == "pallas_interpret"


def test_decoder_takes_the_decode_kernel_for_one_token_steps_only() -> None:
    model = tiny_model(vocab=64)
    cache = KVCache.zeros(model.arch, rows=2, max_len=16)
    kernels = Kernels("pallas_interpret")

    def trace(t: int) -> str:
        tokens = jnp.zeros((2, t), jnp.int32)
        return str(jax.make_jaxpr(lambda: model(tokens, tokens + 3, cache=cache, kernels=kernels))())

    assert trace(1).count("pallas_call") == 1  # one layer body, scanned
    assert "pallas_call" not in trace(4)  # prefill chunks keep the decoder's attention


def test_gpu_reference_decode_walks_the_cache_as_one_block_of_rows() -> None:
    """On GPU (each while-loop trip a host round trip) the reference cached attention runs one
    dynamic-trip loop per layer for the whole batch, not one per ``ROW_BLOCK`` rows; same values.
    Checked on the CPU with the platform flag set: what Kernels.create sets for a GPU mesh."""
    from jaxrl.models.layers import ROW_BLOCK

    rows = 4 * ROW_BLOCK
    model = tiny_model(vocab=64)
    cache = KVCache.zeros(model.arch, rows=rows, max_len=300)
    cache = KVCache(jax.random.normal(jax.random.key(0), cache.k.shape), jax.random.normal(jax.random.key(1), cache.v.shape))
    tokens = jnp.arange(rows, dtype=jnp.int32)[:, None] % 64
    positions = jnp.arange(rows, dtype=jnp.int32)[:, None] * 17 + 3  # ragged: 3 to 258, up to three chunks

    def step(kernels: Kernels):
        return lambda: model(tokens, positions, cache=cache, kernels=kernels)[0]

    gpu, cpu = Kernels("cudnn", loops_sync_host=True), Kernels("reference")
    assert gpu.loops_sync_host and not cpu.loops_sync_host and gpu.reference
    # One cache walk in the scanned layer body vs one walk per block of rows.
    assert str(jax.make_jaxpr(step(gpu))()).count("while[") == 1
    assert str(jax.make_jaxpr(step(cpu))()).count("while[") == rows // ROW_BLOCK
    np.testing.assert_allclose(jax.jit(step(gpu))(), jax.jit(step(cpu))(), atol=2e-5, rtol=2e-5)


def test_pallas_paths_lower_for_tpu(reference) -> None:
    """``kernels = "pallas"`` (what "auto" picks on TPU): the train step's loss + grads and a decode
    step lower for TPU with each kernel a Mosaic call (``jax.export``; no TPU needed, nothing runs)."""
    cfg, graphdef, params, mb, counts, _, _ = reference
    kernels = Kernels("pallas")
    grad = jax.grad(lambda p, mb, c: micro_batch_loss(p, graphdef, mb, c, cfg, kernels)[0])
    # log-prob forward + 2 backward kernels; attention forward, dq, dk/dv (in the layer scans)
    assert _tpu_custom_calls(grad, params, mb, counts) == 6

    model = nnx.merge(graphdef, params)
    cache = KVCache.zeros(model.arch, rows=2, max_len=16)
    step = lambda tokens, positions: model(tokens, positions, cache=cache, kernels=kernels)[0]
    tokens = jnp.zeros((2, 1), jnp.int32)
    assert _tpu_custom_calls(step, tokens, tokens + 5) == 1


def _tpu_custom_calls(fn, *args) -> int:
    module = export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    return module.count("custom_call @tpu_custom_call(")


def _engine_outputs(kernels: str, tensor_parallel: int):
    cfg = EngineConfig(
        max_model_len=64,
        max_seqs=4,
        max_batched_tokens=32,
        decode_steps=3,
        decode_batch_buckets=[4],
        prefill_len_buckets=[16],
        prefill_batch_buckets=[2],
        tensor_parallel=tensor_parallel,
        kernels=kernels,
    )
    engine = Engine(tiny_model(vocab=64, max_position_embeddings=64), cfg)
    assert engine.kernels == Kernels(resolve(kernels, "cpu", field="x"), engine.mesh, cpu=kernels == "auto")
    rng = np.random.default_rng(0)
    # Prompts of 3 to 30 tokens (some prefilled in two chunks); rows finish at different steps.
    prompts = [rng.integers(0, 64, n).tolist() for n in (3, 17, 30, 8)]
    # Two more sharing the 30-token prompt's first 24 tokens: copies of its row, read from one.
    prompts += [prompts[2][:24] + rng.integers(0, 64, n).tolist() for n in (2, 5)]
    reqs = [Request(p, SamplingParams(max_tokens=m, temperature=0.0)) for p, m in zip(prompts, (9, 7, 9, 5, 6, 4))]
    outputs = [(o.token_ids, np.asarray(o.logprobs)) for o in engine.generate(reqs)]
    return outputs, engine.stats.shared_prefix_positions


def test_engine_decode_kernel_gives_the_reference_tokens_and_logprobs() -> None:
    """Greedy decoding: same tokens, log-probs within 1e-5; the kernel engine is tensor-parallel
    over 2 devices (heads split per shard), the reference one on a single device."""
    want, _ = _engine_outputs("reference", 1)
    got, _ = _engine_outputs("pallas_interpret", 2)
    for (want_tokens, want_logp), (tokens, logp) in zip(want, got):
        assert tokens == want_tokens
        np.testing.assert_allclose(logp, want_logp, atol=1e-5)
    assert any(len(set(t)) > 1 for t, _ in want), "degenerate completions would hide a mismatch"


def test_engine_cpu_attention_kernel_gives_the_reference_tokens_and_logprobs() -> None:
    """``kernels = "auto"`` on CPU decodes with the C++ kernel (per shard of a 2-device
    tensor-parallel engine), reading shared prompt prefixes from one row: the reference's greedy
    tokens, log-probs within 1e-5."""
    want, _ = _engine_outputs("reference", 1)
    got, shared = _engine_outputs("auto", 2)
    assert shared > 0
    for (want_tokens, want_logp), (tokens, logp) in zip(want, got):
        assert tokens == want_tokens
        np.testing.assert_allclose(logp, want_logp, atol=1e-5)

"""Context parallelism (a "context" mesh axis: each row's sequence split over devices, Ulysses
attention): log-probs, loss and gradients equal one device's on packed rows of several sequences,
KV heads that do not divide the context size included; memory per device falls as context grows;
shapes it cannot split fail at build naming trainer.mesh.context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import micro_batch_run as _run
from helpers import random_samples, tiny_model
from jax.sharding import PartitionSpec

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.sharding import shard_params
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.step import Trainer, micro_batch_loss, micro_batch_shapes


@pytest.mark.parametrize(("mesh_kw", "kv_heads"), [
    ({"fsdp": 2, "context": 4}, 2),  # 2 KV heads over 4: repeated to 4
    pytest.param({"fsdp": 2, "context": 2, "tensor": 2}, 2, marks=pytest.mark.slow),  # heads over tensor, then over context
])  # fmt: skip
def test_context_parallel_equals_one_device(mesh_kw, kv_heads) -> None:
    cfg = TrainerConfig(seq_len=64)
    samples = random_samples(14, seed=4, max_len=30)
    model = tiny_model(vocab=64, num_kv_heads=kv_heads)
    want = _run(model, samples, cfg)
    mesh = make_mesh(MeshConfig(data=1, **mesh_kw))
    assert mesh.shape["context"] == mesh_kw["context"]
    got = _run(model, samples, cfg, mesh)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1] == pytest.approx(want[1], rel=1e-5)
    for a, b in zip(jax.tree.leaves(want[2]), jax.tree.leaves(got[2]), strict=True):
        scale = max(float(np.abs(np.asarray(a)).max()), 1e-6)
        assert float(np.abs(np.asarray(b) - np.asarray(a)).max()) <= 1e-5 * scale + 1e-7


@pytest.mark.slow  # compiles at four context lengths: the slow tier
def test_memory_per_device_falls_as_context_grows() -> None:
    """Same global batch (2 rows x 512 tokens), 2-way fsdp, context 1 vs 4: the compiled
    micro-step's temporaries per device shrink about as the sequence is split (measured: 86.7 MB
    -> 21.1 MB, with 36.7 MB at context 2). The token inputs arrive split over context and the
    attention trades the sequence for heads by all-to-alls (no all-gather of whole rows)."""
    temps = {}
    model = tiny_model(vocab=64, hidden_size=256, intermediate_size=1024, num_heads=4, num_kv_heads=4, head_dim=16)
    graphdef, params = nnx.split(model)
    for context in (1, 4):
        mesh = make_mesh(MeshConfig(fsdp=2, context=context), devices=jax.devices()[: 2 * context])
        cfg = TrainerConfig(seq_len=512, micro_batch_rows=2)
        kernels = Kernels.create("reference", field="trainer.kernels", mesh=mesh)
        counts = {k: jnp.float32(1) for k in ("rl", "ce", "ref_kl")}
        grad = jax.jit(jax.grad(lambda p, b: micro_batch_loss(p, graphdef, b, counts, cfg, kernels)[0]))
        shapes = micro_batch_shapes(mesh, 2, 512)
        assert shapes["tokens"].sharding.spec == PartitionSpec(("data", "fsdp", "expert"), "context" if context > 1 else None)
        compiled = grad.lower(shard_params(params, mesh), shapes).compile()
        temps[context] = compiled.memory_analysis().temp_size_in_bytes
        assert ("all-to-all" in compiled.as_text()) == (context > 1)
    assert temps[4] < 0.35 * temps[1], temps


def test_shapes_context_parallelism_cannot_split_fail_at_build() -> None:
    mesh = make_mesh(MeshConfig(fsdp=2, context=4))
    with pytest.raises(ValueError, match=r"trainer.mesh.context = 4: trainer.seq_len_buckets \[18\]"):
        Trainer(tiny_model(vocab=64), TrainerConfig(seq_len=72, seq_len_buckets=[18, 72], micro_batch_rows=2), mesh)
    with pytest.raises(ValueError, match=r"trainer.mesh.context = 4: the model's 2 query heads"):
        Trainer(tiny_model(vocab=64, num_heads=2, num_kv_heads=2), TrainerConfig(seq_len=64, micro_batch_rows=2), mesh)

"""Train-step invariants on tiny models: sharded == single device, packed == unpacked,
micro-batched == one batch; and the loss actually falls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_samples, tiny_model

from jaxrl.models.sharding import param_sharding_fn, shard_params
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer import loss as L
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.packing import component_counts, pack
from jaxrl.trainer.step import Trainer, micro_batch_loss


def _loss_and_grads(model, samples, cfg, mesh_shape=None, seq_len=64, rows=8):
    graphdef, params = nnx.split(model)
    batch = pack(samples, seq_len, rows_multiple=rows)
    counts = {k: jnp.float32(v) for k, v in component_counts(batch).items()}
    mb = {k: jnp.asarray(v) for k, v in batch.as_dict().items()}
    if mesh_shape is not None:
        mesh = make_mesh(MeshConfig(data=mesh_shape[0], fsdp=mesh_shape[1], tensor=mesh_shape[2]))
        params = shard_params(params, mesh)
        from jaxrl.parallel.mesh import batch_sharding

        mb = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in mb.items()}
    fn = jax.jit(jax.value_and_grad(lambda p, b, c: micro_batch_loss(p, graphdef, b, c, cfg), has_aux=True))
    (loss, _), grads = fn(params, mb, counts)
    return float(loss), grads


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (1, 8, 1), (2, 2, 2)])
def test_sharded_loss_and_grads_equal_single_device(mesh_shape) -> None:
    cfg = TrainerConfig(seq_len=64)
    samples = random_samples(12, seed=1)
    model = tiny_model(vocab=64)
    want_loss, want_grads = _loss_and_grads(model, samples, cfg)
    got_loss, got_grads = _loss_and_grads(model, samples, cfg, mesh_shape)
    assert abs(got_loss - want_loss) <= 1e-5
    for a, b in zip(jax.tree.leaves(want_grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5)


def test_packed_equals_unpacked() -> None:
    """Each sample alone in its own row gives the same loss and gradients as packed rows."""
    cfg = TrainerConfig(seq_len=64)
    samples = random_samples(10, seed=2)
    model = tiny_model(vocab=64)
    packed_loss, packed_grads = _loss_and_grads(model, samples, cfg, seq_len=64, rows=1)
    # seq_len 20 = the longest sample: first-fit then puts (almost) every sample alone.
    alone_loss, alone_grads = _loss_and_grads(model, samples, cfg, seq_len=20, rows=1)
    assert pack(samples, 64).num_rows < pack(samples, 20).num_rows
    assert abs(packed_loss - alone_loss) <= 1e-5
    for a, b in zip(jax.tree.leaves(packed_grads), jax.tree.leaves(alone_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_micro_batched_step_equals_single_batch() -> None:
    """Gradient accumulation is exact: 1 micro-batch of 8 rows == 4 of 2 rows (same update)."""
    samples = random_samples(24, seed=3)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    results = []
    for rows in (8, 2):
        cfg = TrainerConfig(seq_len=32, seq_len_buckets=[32], micro_batch_rows=rows, steps=2)
        trainer = Trainer(tiny_model(vocab=64), cfg, mesh)
        m = trainer.train_step(samples)
        results.append((m, trainer.params))
    (m1, p1), (m2, p2) = results
    for key in ("rl_loss", "ce_loss", "rl_tokens", "ce_tokens", "grad_norm", "mismatch_kl", "entropy"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_sharded_trainer_state_stays_sharded_and_loss_falls() -> None:
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = TrainerConfig(seq_len=32, seq_len_buckets=[32], micro_batch_rows=4, steps=10)
    cfg.optim.lr = 2e-2
    model = tiny_model(vocab=64)
    graphdef, params = nnx.split(model)
    trainer = Trainer(nnx.merge(graphdef, shard_params(params, mesh)), cfg, mesh)
    rng = np.random.default_rng(0)
    from jaxrl.training_sample import TrainingSample

    seqs = [np.tile(rng.integers(0, 64, 4), 5) for _ in range(8)]  # learnable repeats
    samples = [TrainingSample.sft(s, np.ones(len(s))) for s in seqs]
    losses = [trainer.train_step(samples)["ce_loss"] for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0]
    wq = trainer.params["wq"][...]
    assert not wq.sharding.is_fully_replicated
    assert wq.sharding.is_equivalent_to(param_sharding_fn(mesh)("wq", wq.shape), wq.ndim)


def test_empty_components_give_zero_loss_and_finite_grads() -> None:
    from jaxrl.training_sample import TrainingSample

    cfg = TrainerConfig(seq_len=32)
    s = TrainingSample(
        token_ids=np.arange(6), sampled_mask=np.zeros(6, bool), logprobs=np.zeros(6),
        rl_w=np.zeros(6), ce_w=np.zeros(6),
    )
    loss, grads = _loss_and_grads(tiny_model(vocab=64), [s], cfg, seq_len=32, rows=1)
    assert loss == 0.0
    assert all(np.all(np.asarray(g) == 0) for g in jax.tree.leaves(grads))
    assert L.COMPONENTS == ("rl", "ce", "ref_kl")

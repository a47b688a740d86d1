"""The OPD teacher: it scores packed, sharded samples exactly as one unpacked forward does,
and distilling towards it closes the policy-teacher gap (the ref-KL component learns)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.sharding import shard_params
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.step import Trainer, packed_logprobs
from jaxrl.trainer.teacher import Teacher
from jaxrl.training_sample import TrainingSample


def opd_samples(n: int, seed: int = 0) -> list[TrainingSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(6, 20))
        sampled = np.arange(length) >= 3  # a 3-token prompt, then the policy's tokens
        out.append(
            TrainingSample(
                token_ids=rng.integers(0, 64, length), sampled_mask=sampled, logprobs=np.zeros(length),
                rl_w=np.zeros(length), ce_w=np.zeros(length), ref_kl_w=sampled.astype(np.float32),
                temperature=float(rng.choice([0.7, 1.0])),
            )
        )
    return out


def alone(model, sample: TrainingSample, width: int = 24) -> np.ndarray:
    """The model's log-probs of one sample alone in a row (padded to a fixed width: one compile)."""
    n = len(sample)
    pad = lambda x, fill=0: np.concatenate([x, np.full(width - n, fill, x.dtype)])[None]
    mb = {
        "tokens": pad(sample.token_ids), "positions": pad(np.arange(n, dtype=np.int32)),
        "segment_ids": pad(np.ones(n, np.int32)), "temperature": pad(np.full(n, sample.temperature, np.float32), 1),
    }
    logp = _alone_logprobs(*nnx.split(model), mb)[0]
    return np.concatenate([[0.0], np.asarray(logp)[: n - 1]])


@jax.jit
def _alone_logprobs(graphdef, params, mb):
    return packed_logprobs(nnx.merge(graphdef, params), mb, Kernels.create("reference", field="k"), 4096)[0]


def sharded_trainer(steps: int = 1, lr: float = 1e-3, one_device: bool = False) -> Trainer:
    mesh = (
        make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
        if one_device
        else make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    )
    cfg = TrainerConfig(seq_len=32, seq_len_buckets=[32], micro_batch_rows=4, steps=steps)
    cfg.optim.lr = lr
    graphdef, params = nnx.split(tiny_model(seed=0, vocab=64))
    return Trainer(nnx.merge(graphdef, shard_params(params, mesh)), cfg, mesh)


def test_teacher_scores_packed_sharded_samples_like_one_forward_each():
    trainer = sharded_trainer()
    teacher_model = tiny_model(seed=1, vocab=64)
    graphdef, params = nnx.split(teacher_model)
    teacher = Teacher(nnx.merge(graphdef, shard_params(params, trainer.mesh)), trainer)
    samples = opd_samples(9)
    teacher.score(samples)
    for s in samples:
        np.testing.assert_allclose(s.logr, alone(teacher_model, s), atol=2e-5)
        assert s.logr[0] == 0.0 and not s.needs_reference


@pytest.mark.slow  # a learning run: the slow tier
def test_distilling_towards_the_teacher_closes_the_gap():
    """On-policy samples (logq = the policy's own log-probs), teacher = another random model:
    5 OPD steps shrink mean |logp - logr| on the distilled tokens."""
    trainer = sharded_trainer(steps=5, lr=1e-2, one_device=True)  # sharding: the test above
    graphdef, params = nnx.split(tiny_model(seed=1, vocab=64))
    teacher = Teacher(nnx.merge(graphdef, shard_params(params, trainer.mesh)), trainer)
    samples = opd_samples(16, seed=2)
    teacher.score(samples)
    logr = [s.logr.copy() for s in samples]

    def gap() -> float:
        Teacher(trainer.model(), trainer).score(samples)  # the policy's own log-probs, into logr
        g = np.mean(np.concatenate([np.abs(s.logr - r)[s.ref_kl_w > 0] for s, r in zip(samples, logr)]))
        for s, r in zip(samples, logr):
            s.logprobs = np.where(s.sampled_mask, s.logr, 0.0)  # on-policy logq for the next step
            s.logr = r
        return float(g)

    gaps, metrics = [gap()], []
    for _ in range(5):
        metrics.append(trainer.train_step(samples))
        gaps.append(gap())
    before, after = gaps[0], gaps[-1]
    print("gap |logp - logr| by step:", [round(g, 4) for g in gaps])
    assert metrics[0]["ref_kl_tokens"] == sum(int(s.ref_kl_w[1:].sum()) for s in samples)
    assert metrics[0]["rl_tokens"] == 0 and metrics[0]["ce_tokens"] == 0
    assert after < 0.7 * before, (before, after)
    assert np.isfinite(metrics[-1]["teacher_kl"])


def test_a_step_refuses_unscored_ref_kl_samples():
    import pytest

    with pytest.raises(ValueError, match="carry no teacher log-probs"):
        sharded_trainer().train_step(opd_samples(2))

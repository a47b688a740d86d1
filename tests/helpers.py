"""Shared test builders: tiny models and samples (deterministic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.arch import ModelArch
from jaxrl.models.decoder import Decoder
from jaxrl.models.sharding import shard_params
from jaxrl.parallel.mesh import batch_sharding
from jaxrl.trainer.packing import component_counts, pack
from jaxrl.trainer.step import micro_batch_loss, packed_logprobs
from jaxrl.training_sample import TrainingSample


def tiny_arch(vocab: int = 64, **kw) -> ModelArch:
    base = dict(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        qk_norm=True,
        qkv_bias=False,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    base.update(kw)
    return ModelArch(**base)


def tiny_model(seed: int = 0, **kw) -> Decoder:
    return Decoder(tiny_arch(**kw), rngs=nnx.Rngs(seed))


def random_samples(n: int, seed: int = 0, vocab: int = 64, min_len: int = 3, max_len: int = 20) -> list[TrainingSample]:
    """Mixed RL / CE samples with random lengths, logprobs and advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(min_len, max_len + 1))
        sampled = rng.random(L) < 0.6
        sampled[0] = False
        ce = (~sampled) & (rng.random(L) < 0.5)
        out.append(
            TrainingSample(
                token_ids=rng.integers(0, vocab, L),
                sampled_mask=sampled,
                logprobs=np.where(sampled, -rng.random(L) * 3 - 0.5, 0.0),
                rl_w=sampled.astype(np.float32),
                ce_w=ce * 0.5,
                temperature=float(rng.choice([0.7, 1.0])),
                advantage=float(rng.normal()),
            )
        )
    return out


def wait_for_serve_url(proc, timeout_s: float = 60.0) -> str:  # type: ignore[no-untyped-def]
    """The URL a `python -m jaxrl.serve` child announces ("serving NAME at URL"), once it answers
    /health; fails with the child's output if it exits first."""
    import time

    import httpx

    lines: list[str] = []
    while not lines or "serving" not in lines[-1]:
        lines.append(proc.stdout.readline())
        assert lines[-1] or proc.poll() is None, "jaxrl.serve exited before serving:\n" + "".join(lines)
    url = lines[-1].rsplit(" at ", 1)[1].split()[0]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return url
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, f"{url}/health did not answer in {timeout_s} s"
        time.sleep(0.1)


def micro_batch_run(model, samples, cfg, mesh=None, seq_len=64, rows=4):
    """One packed micro-batch through the trainer's programs (reference kernels), on ``mesh``
    or one device: (log-probs, loss, gradients), for the parallelism-equals-one-device tests."""
    graphdef, params = nnx.split(model)
    batch = pack(samples, seq_len, rows_multiple=rows)
    assert batch.segment_ids.max() >= 3  # several sequences share a row
    counts = {k: jnp.float32(v) for k, v in component_counts(batch).items()}
    mb = {k: jnp.asarray(v) for k, v in batch.as_dict().items()}
    kernels = Kernels.create("reference", field="trainer.kernels", mesh=mesh)
    if mesh is not None:
        params = shard_params(params, mesh)
        mb = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in mb.items()}
    logp = jax.jit(lambda p, b: packed_logprobs(nnx.merge(graphdef, p), b, kernels, cfg.vocab_block)[0])(params, mb)
    fn = jax.jit(jax.value_and_grad(lambda p, b, c: micro_batch_loss(p, graphdef, b, c, cfg, kernels), has_aux=True))
    (loss, _), grads = fn(params, mb, counts)
    return np.asarray(logp), float(loss), grads

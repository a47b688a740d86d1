"""Fixtures for the engine, serving and rollout tests: a tiny random Qwen3 checkpoint, its tokenizer, configs
(each of tests/engine, tests/serving and tests/rollout imports them in its conftest.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.engine.config import EngineConfig
from jaxrl.models.decoder import Decoder
from jaxrl.models.tiny import qwen3_config, save_random_checkpoint
from jaxrl.models.tokenizer import build_tokenizer

VOCAB = 272  # the byte tokenizer has 265 tokens; the model may have more rows, as real ones do
PAD_TO = 128  # scoring row length (= the test engines' max_model_len)


def make_qwen3(out_dir: Path, seed: int = 0) -> Path:
    """Written by transformers itself (by jaxrl's own initialisation where torch is missing)."""
    cfg = qwen3_config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=1024,
    )
    # larger logits than the default init, so sampling is not near-uniform
    save_random_checkpoint(out_dir, cfg, seed=seed, embed_scale=3.0)
    return out_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def tiny_config(**overrides) -> EngineConfig:
    """One bucket each (compiles are slow on a shared CPU); chunked prefill and padding still run."""
    base = {
        "max_model_len": 128,
        "max_seqs": 4,
        "max_batched_tokens": 64,
        "decode_steps": 3,
        "decode_batch_buckets": [4],
        "prefill_len_buckets": [32],
        "prefill_batch_buckets": [2],
        "min_prefix_reuse": 4,
    }
    return EngineConfig(**{**base, **overrides})


@functools.cache
def _scorer(graphdef: nnx.GraphDef) -> Callable:
    """Jitted full forward + ``token_logprobs`` over a padded row (one compile per model)."""
    from jaxrl.trainer.logprobs import token_logprobs

    def fn(state: nnx.State, tokens: jax.Array, temperature: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, state)
        hidden, _ = model(tokens[None], jnp.arange(tokens.shape[0])[None])
        logp, _ = token_logprobs(hidden[0, :-1], model.lm_head_weight(), tokens[1:], temperature)
        return logp

    return jax.jit(fn)


def trainer_logprobs(
    model: Decoder, prompt: list[int], completion: list[int], temperature: float
) -> np.ndarray:
    """Score ``completion`` as the trainer does: full forward of prompt + completion, then
    ``token_logprobs`` (temperature 0 = greedy is scored at 1.0). Padding at the end of the
    row does not change earlier positions (causal attention)."""
    graphdef, state = nnx.split(model)
    seq = prompt + completion
    tokens = np.zeros(PAD_TO, np.int32)
    tokens[: len(seq)] = seq
    temp = np.full(PAD_TO - 1, temperature if temperature > 0 else 1.0, np.float32)
    logp = np.asarray(_scorer(graphdef)(state, tokens, temp))
    return logp[len(prompt) - 1 : len(seq) - 1]


def mismatch_kl(logp: np.ndarray, logq: np.ndarray) -> float:
    """Mean of ratio - log_ratio - 1 (the trainer's mismatch-KL metric)."""
    r = np.asarray(logp, np.float64) - np.asarray(logq, np.float64)
    return float(np.mean(np.exp(r) - r - 1))


@pytest.fixture(scope="session")
def make_config():
    return tiny_config


@pytest.fixture(scope="session")
def score():
    return trainer_logprobs


@pytest.fixture(scope="session")
def kl():
    return mismatch_kl


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as ``model_dir``, different weights (a later policy)."""
    return make_qwen3(tmp_path_factory.mktemp("qwen3_other"), seed=1)

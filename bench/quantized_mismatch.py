"""Sampled-token log-probs of the engine with 8-bit projections vs the trainer's (JSON lines).

For each model and each ``[inference.backend] quantization`` ("none", "int8", "fp8"): tokens
sampled at temperature 1 by the engine, scored by the trainer's log-prob path on the model's
own weights; ``mismatch_stats`` (mean / max |delta log p|, KL(engine || trainer) as k1 and k3,
importance-ratio extremes). Models: the reverse_text SFT export (float32, the main job's policy;
skipped when ``outputs/reverse_text/sft/hf`` is missing) and a random model of Qwen3-0.6B's
shape in bfloat16 (float32 master weights, bfloat16 compute, as RL runs on an accelerator).

    python bench/quantized_mismatch.py [--prompts 8] [--new 24] [--no-qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def engine_config(prompt_len: int, n: int, new: int, quantization: str):
    from jaxrl.engine.config import EngineConfig

    return EngineConfig(
        max_model_len=prompt_len + new + 8, max_seqs=n, max_batched_tokens=n * prompt_len, decode_batch_buckets=[n],
        prefill_len_buckets=[prompt_len], prefill_batch_buckets=[n], decode_steps=4, quantization=quantization,
    )  # fmt: skip


def measure(name: str, trainer_model, engine_model, prompts: list[list[int]], new: int) -> None:
    from jaxrl.devicecheck.mismatch import sampled_vs_trainer

    width = max(len(p) for p in prompts)
    for q in ("none", "int8", "fp8"):
        stats = sampled_vs_trainer(trainer_model, engine_model, engine_config(width, len(prompts), new, q), prompts, new)
        print(json.dumps({"bench": "quantized_mismatch", "model": name, "quantization": q, **stats}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--no-qwen3-0.6b", dest="no_qwen3", action="store_true")
    a = p.parse_args()
    rng = np.random.default_rng(0)

    reverse = Path("outputs/reverse_text/sft/hf")
    if reverse.is_dir():
        from transformers import AutoTokenizer

        from jaxrl.envs.common import WORDS
        from jaxrl.envs.reverse_text import SYSTEM_PROMPT
        from jaxrl.models.hf_io import load_decoder

        model = load_decoder(reverse)
        tok = AutoTokenizer.from_pretrained(reverse)
        texts = [" ".join(rng.choice(WORDS, 2)) for _ in range(a.prompts)]
        prompts = [list(tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": t}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
                   for t in texts]  # fmt: skip
        measure("reverse_text_sft", model, model, prompts, a.new)
    else:
        print(json.dumps({"bench": "quantized_mismatch", "model": "reverse_text_sft", "skipped": f"no {reverse}"}))

    if not a.no_qwen3:
        from jaxrl.devicecheck.common import qwen3_0_6b, random_decoder

        arch = qwen3_0_6b(max_len=4096)
        trainer = random_decoder(arch, param_dtype=jnp.float32, dtype=jnp.bfloat16)
        graphdef, state = nnx.split(trainer)
        engine_model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
        prompts = [rng.integers(0, arch["vocab_size"], 32).tolist() for _ in range(a.prompts)]
        measure("random_qwen3_0.6b_bf16", trainer, engine_model, prompts, a.new)

if __name__ == "__main__":
    main()

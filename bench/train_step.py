"""Train-step throughput: jaxrl vs transformers (torch CPU), same shapes, batch and dtype.

Prints JSON lines: the measured float32 matmul peak, each side's tokens/s and MFU, and the
ratio. The model is Qwen3-shaped (~100M parameters by default). Run on a quiet machine:

    python bench/train_step.py [--hidden 768 --layers 12 --rows 4 --seq 512 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def qwen3_config(a: argparse.Namespace) -> dict:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.hidden // a.heads,
        max_position_embeddings=a.seq, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ).to_dict()


def bench_jaxrl(a: argparse.Namespace, hf_config: dict, tokens: np.ndarray, peak: float) -> dict:
    import jax.numpy as jnp

    from jaxrl.models.setup import init_decoder
    from jaxrl.parallel.mesh import MeshConfig, make_mesh
    from jaxrl.samples import TrainingSample
    from jaxrl.trainer.config import TrainerConfig
    from jaxrl.trainer.step import Trainer

    mesh = make_mesh(MeshConfig(fsdp=1, num_devices=1))
    model = init_decoder(hf_config, mesh, seed=0, param_dtype=jnp.float32, dtype=jnp.float32)
    model.remat = False
    cfg = TrainerConfig(seq_len=a.seq, seq_len_buckets=[a.seq], micro_batch_rows=a.rows, steps=a.steps + 1)
    trainer = Trainer(model, cfg, mesh, peak_flops=peak)
    samples = [TrainingSample.sft(t, np.ones(len(t))) for t in tokens]
    trainer.train_step(samples)  # compile
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        m = trainer.train_step(samples)
        times.append(time.perf_counter() - t0)
    best = min(times)
    n_tok = tokens.size
    return {"tokens_per_s": n_tok / best, "step_s": best, "loss": m["ce_loss"]}


def bench_torch(a: argparse.Namespace, hf_config: dict, tokens: np.ndarray) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config.from_dict(hf_config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    ids = torch.tensor(tokens, dtype=torch.long)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    best = min(times)
    return {"tokens_per_s": tokens.size / best, "step_s": best, "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip-torch", action="store_true")
    a = p.parse_args()

    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.trainer.flops import measure_matmul_peak

    hf_config = qwen3_config(a)
    arch = arch_from_hf_config(hf_config)
    peak = measure_matmul_peak(2048)
    print(json.dumps({"bench": "matmul_peak", "flops_per_s": peak, "dtype": "float32"}))
    tokens = np.random.default_rng(0).integers(0, a.vocab, (a.rows, a.seq))
    flops_tok = arch.flops_per_token(a.seq)
    common = {"params": arch.num_params(), "rows": a.rows, "seq": a.seq, "dtype": "float32"}
    ours = bench_jaxrl(a, hf_config, tokens, peak)
    ours["mfu"] = ours["tokens_per_s"] * flops_tok / peak
    print(json.dumps({"bench": "train_step", "impl": "jaxrl", **common, **ours}))
    if a.skip_torch:
        return
    ref = bench_torch(a, hf_config, tokens)
    ref["mfu"] = ref["tokens_per_s"] * flops_tok / peak
    print(json.dumps({"bench": "train_step", "impl": "transformers", **common, **ref}))
    print(json.dumps({"bench": "train_step_ratio", "jaxrl_over_transformers": ours["tokens_per_s"] / ref["tokens_per_s"]}))


if __name__ == "__main__":
    main()

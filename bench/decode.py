"""Decode throughput of the embedded engine vs transformers ``generate`` (same weights, same run),
and vs a vLLM server when ``JAXRL_VLLM`` names a vLLM venv's python (scripts/install_vllm_cpu.sh).

    python bench/decode.py [--batches 1 8 32] [--prompt-len 32] [--new-tokens 128] [--no-vllm]

A random Qwen3-shaped model (~5M parameters) is written to a temporary HF directory; the engine
loads it (float32) and transformers loads the same files (torch, CPU). Both generate greedily,
``new_tokens`` tokens per sequence with no stop token, from the same prompts; the time includes
prefill. Prints one JSON line per batch size: output tokens/s of both, their ratio, and the
fraction of the memory-bandwidth bound the engine reaches (every decode step must read all
weights and the KV cache; the host's bandwidth is measured in the same run with a large copy).
The vLLM column (``vllm_tok_s``) sends the batch as concurrent token-in/token-out requests to
``/inference/v1/generate`` of one server started for the whole run (float32, greedy,
``ignore_eos``), timed from first request to last response, as the engine is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from tiny_qwen3 import save_tiny_qwen3  # bench/ is on sys.path when run as a script

from jaxrl.devicecheck.speed import engine_decode_s, hf_generate_tok_s


def host_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a large numpy copy (read + write counted)."""
    src = np.ones(nbytes // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def make_model(out: Path, args: argparse.Namespace) -> int:
    max_len = args.prompt_len + args.new_tokens + 64
    return save_tiny_qwen3(out, vocab=args.vocab, hidden=args.hidden, layers=args.layers, max_len=max_len)


def bench_engine(model_dir: Path, prompts: np.ndarray, args: argparse.Namespace) -> tuple[float, float]:
    from jaxrl.engine.config import EngineConfig
    from jaxrl.engine.engine import Engine

    batch = len(prompts)
    cfg = EngineConfig(
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_seqs=batch,
        max_batched_tokens=batch * args.prompt_len,
        decode_steps=args.decode_steps,
        decode_steps_idle=args.decode_steps_idle,
        decode_batch_buckets=[batch],
        prefill_len_buckets=[args.prompt_len],
        prefill_batch_buckets=[batch],
    )
    engine = Engine.from_pretrained(model_dir, cfg)
    dt = engine_decode_s(engine, prompts, args.new_tokens, args.repeats)  # as the device check times it
    return batch * args.new_tokens / dt, dt


def bench_hf(model_dir: Path, prompts: np.ndarray, args: argparse.Namespace) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    return hf_generate_tok_s(model, prompts, args.new_tokens, args.repeats)


class VLLMPeer:
    """A vLLM server on the benchmark's model (jaxrl's vLLM backend launches it)."""

    def __init__(self, model_dir: Path, tmp: Path, args: argparse.Namespace):
        from jaxrl.models.hf_io import load_decoder
        from jaxrl.models.tokenizer import build_tokenizer
        from jaxrl.rollout.config import InferenceConfig
        from jaxrl.rollout.vllm import VLLMBackend

        max_len = args.prompt_len + args.new_tokens + 8
        cfg = InferenceConfig(
            backend={"type": "vllm", "extra_args": ["--skip-tokenizer-init"]},
            max_model_len=max_len,
            max_seqs=max(args.batches),
            max_batched_tokens=max(max_len, max(args.batches) * args.prompt_len),
            # (--skip-tokenizer-init: random prompts use the whole model vocabulary; the stand-in
            # tokenizer knows fewer ids.)
            server={"port": 0},
        )
        hf_config = json.loads((model_dir / "config.json").read_text())
        self.backend = VLLMBackend(
            load_decoder(model_dir),
            hf_config,
            cfg,
            output_dir=tmp / "vllm",
            tokenizer_dir=build_tokenizer(tmp / "tokenizer"),
            model_name="bench",
        )
        self.backend.start()
        self.args = args

    def tok_s(self, prompts: np.ndarray) -> float:
        import asyncio

        import httpx

        params = {
            "max_tokens": self.args.new_tokens,
            "min_tokens": self.args.new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }

        async def batch(client: httpx.AsyncClient) -> float:
            async def one(p: np.ndarray) -> int:
                body = {"model": "bench", "token_ids": p.tolist(), "sampling_params": params}
                resp = await client.post(f"{self.backend.upstream}/inference/v1/generate", json=body)
                resp.raise_for_status()
                return len(resp.json()["choices"][0]["token_ids"])

            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            dt = time.perf_counter() - t0
            assert all(c == self.args.new_tokens for c in counts), counts
            return dt

        async def run() -> float:
            async with httpx.AsyncClient(timeout=600) as client:
                await batch(client)  # warm-up
                return statistics.median([await batch(client) for _ in range(self.args.repeats)])

        return len(prompts) * self.args.new_tokens / asyncio.run(run())

    def stop(self) -> None:
        self.backend.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--decode-steps-idle", type=int, default=16, help="inference.backend.decode_steps_idle")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measure; the median is reported")
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM column even when JAXRL_VLLM is set")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    bandwidth = host_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        n_params = make_model(model_dir, args)
        vllm = (
            VLLMPeer(model_dir, Path(tmp), args)
            if os.environ.get("JAXRL_VLLM") and not args.no_vllm
            else None
        )
        header = {"host_bandwidth_gb_s": round(bandwidth / 1e9, 2), "params": n_params}
        if vllm is not None:
            header["vllm_startup_s"] = round(vllm.backend.startup_s, 1)
        print(json.dumps(header), flush=True)
        rng = np.random.default_rng(0)
        try:
            for batch in args.batches:
                prompts = rng.integers(0, args.vocab, (batch, args.prompt_len))
                bench_batch(model_dir, prompts, args, n_params, bandwidth, vllm)
        finally:
            if vllm is not None:
                vllm.stop()


def bench_batch(
    model_dir: Path,
    prompts: np.ndarray,
    args: argparse.Namespace,
    n_params: int,
    bandwidth: float,
    vllm: VLLMPeer | None,
) -> None:
    batch = len(prompts)
    engine_tok_s, engine_s = bench_engine(model_dir, prompts, args)
    hf_tok_s = bench_hf(model_dir, prompts, args)
    # Bandwidth bound of decode: each step reads all weights (fp32) and the KV cache.
    kv_per_token = args.layers * 2 * 2 * (args.hidden // 4) * 4  # layers x (k, v) x kv_heads x head_dim x 4 B
    mean_len = args.prompt_len + args.new_tokens / 2
    step_bytes = n_params * 4 + batch * mean_len * kv_per_token
    bound_tok_s = batch * bandwidth / step_bytes
    row = {
        "batch": batch,
        "engine_tok_s": round(engine_tok_s, 1),
        "hf_generate_tok_s": round(hf_tok_s, 1),
        "ratio": round(engine_tok_s / hf_tok_s, 2),
        "bandwidth_bound_tok_s": round(bound_tok_s, 1),
        "fraction_of_bound": round(engine_tok_s / bound_tok_s, 3),
        "engine_s": round(engine_s, 3),
        "decode_steps": args.decode_steps,
        "decode_steps_idle": args.decode_steps_idle,
    }
    if vllm is not None:
        vllm_tok_s = vllm.tok_s(prompts)
        row |= {"vllm_tok_s": round(vllm_tok_s, 1), "engine_vs_vllm": round(engine_tok_s / vllm_tok_s, 2)}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

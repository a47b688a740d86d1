"""Train-step throughput: jaxrl vs transformers (torch CPU), same shapes, batch and dtype.

Prints JSON lines: the measured float32 matmul peak, each side's tokens/s and MFU, and the
ratio. The model is Qwen3-shaped (~100M parameters by default). Both sides run in one process
with the same number of threads (every core the process may use), after their compile/warm-up
step, and their timed steps alternate in pairs (jaxrl x2, torch x2, matmul peak, jaxrl x2, ...),
so a machine shared with other work slows both alike; best and median step times are reported,
with the load average. MFU is against the best float32 matmul rate measured between the steps.

Large temporary buffers are page-faulted afresh on every step by both frameworks (glibc hands
big allocations back to the kernel); on a 2-core VM that costs ~0.75 s of kernel time per GB.
By default the bench re-executes itself with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` so glibc
backs them with transparent huge pages (both sides benefit); ``--no-hugepages`` measures
without. Run on a quiet machine:

    python bench/train_step.py [--hidden 768 --layers 12 --rows 4 --seq 512 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HUGEPAGES = "glibc.malloc.hugetlb=1"


def qwen3_config(a: argparse.Namespace) -> dict:
    from jaxrl.models.tiny import qwen3_config

    return qwen3_config(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_layers=a.layers,
        num_heads=a.heads, num_kv_heads=a.kv_heads, max_position_embeddings=a.seq,
    ).to_dict()


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(times: list[float], n_tok: int, flops_tok: float, peak: float) -> dict:
    best = min(times)
    return {
        "tokens_per_s": n_tok / best,
        "tokens_per_s_median": n_tok / statistics.median(times),
        "step_s": best,
        "mfu": n_tok * flops_tok / best / peak,
    }


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
    p.add_argument("--steps", type=int, default=3, help="rounds of two timed steps per side (after a warm-up step)")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--no-hugepages", action="store_true", help="leave glibc's allocator as configured")
    a = p.parse_args()

    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not a.no_hugepages and HUGEPAGES not in tunables and sys.platform.startswith("linux"):
        env = dict(os.environ, GLIBC_TUNABLES=":".join(t for t in (tunables, HUGEPAGES) if t))
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    import jax
    import torch

    from jaxrl.devicecheck.speed import jaxrl_trainer, torch_train_step
    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.trainer.flops import measure_matmul_peak
    from jaxrl.training_sample import TrainingSample

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads)
    hf_config = qwen3_config(a)
    arch = arch_from_hf_config(hf_config)
    tokens = np.random.default_rng(0).integers(0, a.vocab, (a.rows, a.seq))
    flops_tok = arch.flops_per_token(a.seq)
    load_before = os.getloadavg()[0]

    # Both sides are built as the device check builds them (jaxrl.devicecheck.speed).
    trainer = jaxrl_trainer(hf_config, rows=a.rows, seq=a.seq, steps=2 * a.steps + 2, dtype="float32", remat="none")
    samples = [TrainingSample.sft(t, np.ones(len(t))) for t in tokens]
    first_loss = trainer.train_step(samples)["ce_loss"]  # compile / warm-up
    sides = {"jaxrl": lambda: timed(lambda: trainer.train_step(samples))}
    free_torch = None
    if not a.skip_torch:
        sides["transformers"], free_torch = torch_train_step(hf_config, tokens, "cpu", lr=1e-4)
        sides["transformers"]()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in sides}
    peaks = [measure_matmul_peak(2048)]
    for _ in range(a.steps):
        for name, step in sides.items():
            # Two steps in a row: the second finds the allocator as its own last step left it,
            # as in a real run, rather than as the other framework left it.
            times[name] += [step(), step()]
        peaks.append(measure_matmul_peak(2048, repeats=3))
    peak = max(peaks)

    common = {
        "params": arch.num_params(), "rows": a.rows, "seq": a.seq, "layers": a.layers, "dtype": "float32",
        "threads": threads, "hugepages": HUGEPAGES in os.environ.get("GLIBC_TUNABLES", ""),
    }
    print(json.dumps({"bench": "matmul_peak", "flops_per_s": peak, "dtype": "float32", "backend": jax.default_backend()}))
    results = {}
    for name in sides:
        results[name] = summary(times[name], tokens.size, flops_tok, peak)
        first = {"first_loss": first_loss} if name == "jaxrl" else {}
        print(json.dumps({"bench": "train_step", "impl": name, **common, **results[name], **first}))
    load = {"load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0]}
    if "transformers" in results:
        ratio = results["jaxrl"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]
        print(json.dumps({"bench": "train_step_ratio", "jaxrl_over_transformers": ratio, **load}))
    else:
        print(json.dumps({"bench": "load", **load}))
    if free_torch is not None:
        free_torch()


if __name__ == "__main__":
    main()

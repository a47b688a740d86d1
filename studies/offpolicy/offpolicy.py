"""Off-policy objectives under a deliberately mismatched sampler: paired short runs (JSON lines).

A tiny reverse_text model is warm-started by SFT once; then each objective (``--methods``) trains
``--steps`` RL steps per seed at ``max_async_level`` 2, with the trainer scoring every sample at a
temperature jittered by a seeded factor in ``[1 - jitter, 1 + jitter]`` while the engine sampled at
the env's temperature: a controlled trainer/sampler mismatch (``logp`` and ``logq`` come from
different distributions), the cheapest on CPU. Held-out reward (same eval seeds before and after,
``[orchestrator.eval]``) and the step's ratio metrics are printed per run:

    python studies/offpolicy/offpolicy.py --steps 10 --seeds 0 1 --methods dppo gspo tis mis

``--recipe DIR`` runs the recipe-sized version instead: configs/reverse_text/rl.toml as shipped
(512 rollouts = 32 tasks x 16 per step, lr 5e-4, the README's ~1M model) from the SFT export in DIR
(the main job's ``outputs/reverse_text/sft/hf``), with only ``max_async_level`` 2, the loss, the
seed, the step count and the eval interval changed:

    python studies/offpolicy/offpolicy.py --recipe outputs/reverse_text/sft/hf --steps 20 --seeds 0 1

The jitter is injected here, in the benchmark, by wrapping the sample builder the GRPO family
uses; nothing in jaxrl carries such a knob.
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

LOSSES = {
    "dppo": {},
    "gspo": {"type": "gspo"},
    "tis": {"type": "tis", "tis_level": "sequence", "tis_cap": 2.0},
    "mis": {"mis": {"level": "geometric", "low": 0.5, "high": 2.0}},
    "cispo": {"type": "cispo"},
    "ppo": {"type": "ppo"},
}
SCRATCH = {"hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
           "head_dim": 32, "max_position_embeddings": 256}  # fmt: skip
KEYS = ("ratio_mean", "ratio_max", "seq_ratio_max", "mismatch_kl", "masked_high_frac", "masked_low_frac",
        "clipped_frac", "mis_rejected_frac", "stale_lag2_frac", "reward_mean")  # fmt: skip


def jitter_temperatures(jitter: float, seed: int) -> None:
    """Score each GRPO-family sample at ``T * U(1 - jitter, 1 + jitter)`` (seeded per run; the
    draws follow the order groups finish, so runs are paired in distribution, not draw by draw)."""
    from jaxrl.orchestrator import traces
    from jaxrl.orchestrator.algo import grpo

    rng = np.random.default_rng(seed)
    build = traces.branch_sample

    def jittered(*args, **kw):  # type: ignore[no-untyped-def]
        sample = build(*args, **kw)
        sample.temperature = float(sample.temperature * rng.uniform(1 - jitter, 1 + jitter))
        return sample

    grpo.branch_sample = jittered


def warm_start(root: Path) -> Path:
    from jaxrl.cli import build_config
    from jaxrl.sft import run_sft

    cfg = build_config({
        "output_dir": str(root / "sft"), "model": {"scratch": SCRATCH},
        "data": {"taskset": "reverse_text", "num_examples": 512, "batch_size": 16},
        "trainer": {"steps": 40, "seq_len": 128, "micro_batch_rows": 8, "mesh": {"num_devices": 1},
                    "optim": {"lr": 5e-3, "warmup_steps": 5}},
        "log": {"progress": False},
    }, [])  # fmt: skip
    return Path(run_sft(cfg)["export"])


RECIPE = Path(__file__).resolve().parents[2] / "configs" / "reverse_text" / "rl.toml"


def recipe_config(model: Path, out: Path, method: str, seed: int, steps: int, eval_interval: int) -> dict:
    """configs/reverse_text/rl.toml with the warm start given, async level 2 and the method's loss."""
    from jaxrl.config import read_toml

    data = read_toml(RECIPE)
    data.pop("warmstart", None)
    data["output_dir"], data["seed"], data["model"] = str(out), seed, {"name": str(model)}
    data["trainer"] = {**data["trainer"], "steps": steps, "loss": LOSSES[method]}
    data["trainer"].pop("resume", None)
    data["orchestrator"] = {**data["orchestrator"], "max_async_level": 2}
    data["orchestrator"]["eval"] = {**data["orchestrator"]["eval"], "interval": eval_interval}
    data["inference"] = {**data.get("inference", {}), "server": {"port": 0}}
    data["ckpt"] = {"interval": steps}
    data["log"] = {"progress": False}
    return data


def run(model: Path, out: Path, method: str, seed: int, steps: int, recipe: bool = False) -> dict:
    from jaxrl.cli import build_config
    from jaxrl.metrics import read_metrics
    from jaxrl.rl import run_rl

    if recipe:
        return finish(run_rl, build_config(recipe_config(model, out, method, seed, steps, 10), []), out,
                      method, seed, steps, read_metrics)
    sampling = {"max_completion_tokens": 16, "temperature": 1.0}
    cfg = build_config({
        "output_dir": str(out), "seed": seed, "model": {"name": str(model)},
        "trainer": {"steps": steps, "seq_len": 128, "micro_batch_rows": 8, "mesh": {"num_devices": 1},
                    "optim": {"lr": 5e-4, "schedule": "constant", "weight_decay": 0.0}, "loss": LOSSES[method]},
        "inference": {"server": {"port": 0}, "max_model_len": 128, "max_seqs": 16,
                      "backend": {"type": "embedded", "prefill_len_buckets": [64, 128], "prefill_batch_buckets": [4]}},
        "orchestrator": {"batch_size": 64, "group_size": 8, "max_async_level": 2,
                         "train": {"sampling": sampling, "env": [{"id": "reverse_text"}]},
                         "eval": {"interval": steps, "num_tasks": 32, "k": 4, "sampling": sampling}},
        "log": {"progress": False},
    }, [])  # fmt: skip
    return finish(run_rl, cfg, out, method, seed, steps, read_metrics)


def finish(run_rl, cfg, out: Path, method: str, seed: int, steps: int, read_metrics) -> dict:  # type: ignore[no-untyped-def]
    """Run one configured RL job; its held-out curve and the step-mean ratio metrics as a row."""
    t0 = time.perf_counter()
    run_rl(cfg)
    rows = read_metrics(out / "metrics.jsonl")
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    train = [r for r in rows if "train/ratio_mean" in r]
    mean = {k: statistics.mean(r[f"train/{k}"] for r in train) for k in KEYS}
    return {"method": method, "seed": seed, "steps": steps, "eval_before": evals[0], "eval_after": evals[-1],
            "eval_gain": evals[-1] - evals[0], "evals": evals, "wall_s": round(time.perf_counter() - t0, 1),
            "load_avg_1m": os.getloadavg()[0], **{f"mean_{k}": v for k, v in mean.items()}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--methods", nargs="+", default=["dppo", "gspo", "tis", "mis"], choices=sorted(LOSSES))
    p.add_argument("--jitter", type=float, default=0.3, help="temperature jitter of the trainer's scoring")
    p.add_argument("--recipe", type=Path, default=None,
                   help="the main job's SFT export: run configs/reverse_text/rl.toml at its size from it")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.recipe.resolve() if args.recipe else warm_start(root)
        for seed in args.seeds:
            for method in args.methods:
                jitter_temperatures(args.jitter, seed=seed)
                row = run(model, root / f"{method}-{seed}", method, seed, args.steps, recipe=args.recipe is not None)
                print(json.dumps({"jitter": args.jitter, "recipe": args.recipe is not None, **row}), flush=True)


if __name__ == "__main__":
    main()

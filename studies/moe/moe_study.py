"""Does a mixture-of-experts policy learn like the dense one? The reverse_text main job, dense and MoE.

    python studies/moe/moe_study.py --root outputs/moe_study [--rl-steps 20 --seeds 0 --sft-steps 200]
    python studies/moe/moe_study.py --root outputs/moe_study --report-only

Both models are built by ``configs/reverse_text/sft.toml`` as shipped, from scratch: the dense one
its ``[model.scratch]`` (hidden 128, MLP 384, 4 layers), the MoE one the same with every MLP 12
experts of width 190, 2 per token (``[model.scratch] num_experts``): the same active parameter
count (828,800 per layer's MLP and router; ``jaxrl.models.tiny.REVERSE_TEXT_MOE``). Each SFT export
then runs ``configs/reverse_text/rl.toml`` as shipped but for ``--rl-steps`` steps and an eval every
5: the dense model, the MoE model with ``[trainer] moe_routing = "replay"``, and with
``"recompute"``. With one run seed all three start from the same task order and rollout seeds
and are evaluated on the same held-out (task, seed) samples, so differences are paired.

Prints one JSON line per run (held-out reward per eval step and its paired gain over step 0,
``studies/learning/eval_curves.curve``; step means of ``mismatch_kl``, ``routing_changed_frac``,
``router_entropy`` and ``expert_load_max_mean``), then each MoE arm minus dense at every eval step.
Finished runs (``result.json``) are not run again, so the script can be resumed. ``--png`` plots the
curves (``studies/learning/eval_curves.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "studies" / "learning"))
MOE_SCRATCH = {"num_experts": 12, "num_experts_per_tok": 2, "moe_intermediate_size": 190}
ARMS = {"dense": ("dense", None), "moe_replay": ("moe", "replay"), "moe_recompute": ("moe", "recompute")}
STEP_KEYS = ("mismatch_kl", "routing_changed_frac", "router_entropy", "expert_load_max_mean")


def sft(root: Path, model: str, steps: int) -> Path:
    """The SFT warm start of ``model`` ("dense" | "moe"): configs/reverse_text/sft.toml."""
    from jaxrl.cli import build_config
    from jaxrl.config import read_toml
    from jaxrl.sft import run_sft

    out = root / model / "sft"
    export = out / "hf"
    if (out / "result.json").exists():
        return export
    data = read_toml(REPO / "configs" / "reverse_text" / "sft.toml")
    data["output_dir"] = str(out)
    if model == "moe":
        data["model"]["scratch"] = {**data["model"]["scratch"], **MOE_SCRATCH}
    data["trainer"] = {**data["trainer"], "steps": steps}
    data["log"] = {"progress": False}
    return Path(run_sft(build_config(data, []))["export"])


def rl(root: Path, arm: str, model_dir: Path, seed: int, steps: int, smoke: bool = False) -> Path:
    """configs/reverse_text/rl.toml from ``model_dir``, ``steps`` steps, an eval every 5."""
    from jaxrl.cli import build_config
    from jaxrl.config import read_toml
    from jaxrl.rl import run_rl

    out = root / arm / f"rl_seed{seed}"
    if (out / "result.json").exists():
        return out
    data = read_toml(REPO / "configs" / "reverse_text" / "rl.toml")
    data.pop("warmstart", None)
    data["output_dir"], data["seed"], data["model"] = str(out), seed, {"name": str(model_dir)}
    data["trainer"] = {**data["trainer"], "steps": steps}
    if ARMS[arm][1] is not None:
        data["trainer"]["moe_routing"] = ARMS[arm][1]
    data["orchestrator"]["eval"] = {**data["orchestrator"]["eval"], "interval": 5}
    if smoke:  # the wiring only: a few rollouts
        data["orchestrator"] |= {"batch_size": 16, "group_size": 4}
        data["orchestrator"]["eval"] |= {"interval": 1, "num_tasks": 4, "k": 2}
    data["inference"] = {**data.get("inference", {}), "server": {"port": 0}}
    data["ckpt"] = {"interval": steps}
    data["log"] = {"progress": False}
    run_rl(build_config(data, []))
    return out


def report(root: Path, seeds: list[int]) -> list[dict]:
    from eval_curves import curve, eval_rewards

    from jaxrl.metrics import read_metrics

    rows = []
    for seed in seeds:
        dense = root / "dense" / f"rl_seed{seed}"
        base = eval_rewards(dense) if (dense / "result.json").exists() else None
        for arm in ARMS:
            run = root / arm / f"rl_seed{seed}"
            if not (run / "result.json").exists():
                continue
            train = [r for r in read_metrics(run / "metrics.jsonl") if "train/mismatch_kl" in r]
            means = {k: statistics.mean(r[f"train/{k}"] for r in train) for k in STEP_KEYS if f"train/{k}" in train[0]}
            row = {"arm": arm, "seed": seed, "curve": curve(run, None if arm == "dense" else base), **{f"mean_{k}": v for k, v in means.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("outputs/moe_study"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rl-steps", type=int, default=20)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="wiring check: 16 rollouts per step, 4 eval tasks")
    args = parser.parse_args()
    if not args.report_only:
        exports = {m: sft(args.root, m, args.sft_steps) for m in sorted({ARMS[a][0] for a in args.arms})}
        for seed in args.seeds:
            for arm in args.arms:
                rl(args.root, arm, exports[ARMS[arm][0]], seed, args.rl_steps, args.smoke)
    report(args.root, args.seeds)
    if args.png is not None:
        import subprocess

        runs = [f"{args.root / a / f'rl_seed{s}'}={a} seed {s}" for s in args.seeds for a in args.arms]
        subprocess.run([sys.executable, str(REPO / "studies" / "learning" / "eval_curves.py"), *runs, "--png", str(args.png)], check=True)


if __name__ == "__main__":
    main()

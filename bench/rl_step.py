"""Wall time per RL step of the reverse_text recipe, split into rollout wait / scoring /
train / weight sync (JSON lines). Uses the recipe's SFT export as the policy, running the
warm start first when it is missing.

    python bench/rl_step.py [--steps 6] [--config configs/reverse_text/rl.toml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

KEYS = ("time/rollout_wait_s", "time/scoring_s", "time/train_s", "time/weight_sync_s", "time/step_s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/reverse_text/rl.toml")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()

    from jaxrl.cli import load_config
    from jaxrl.metrics import read_metrics
    from jaxrl.train import run

    with tempfile.TemporaryDirectory() as out:
        cfg, _ = load_config(["--config", a.config, "--trainer.steps", str(a.steps), "--output_dir", out,
                              "--log.progress", "false", "--ckpt.interval", "0"])
        cfg.orchestrator.eval = None
        run(cfg)
        rows = [r for r in read_metrics(f"{out}/metrics.jsonl") if "time/step_s" in r]
    steady = rows[1:] or rows  # the first step includes compilation
    for r in rows:
        print(json.dumps({"bench": "rl_step", "step": r["step"], **{k: r[k] for k in KEYS}, "train/reward_mean": r["train/reward_mean"]}))
    summary = {k.split("/")[1]: statistics.mean(r[k] for r in steady) for k in KEYS}
    total = summary["step_s"]
    print(json.dumps({"bench": "rl_step_mean", "steps_averaged": len(steady), **summary,
                      **{f"{k}_frac": v / total for k, v in summary.items() if k != "step_s"}}))


if __name__ == "__main__":
    main()

"""Held-out eval curves of finished RL runs, paired sample by sample, as JSON lines and a PNG.

    python studies/learning/eval_curves.py RUN_DIR[=LABEL] ... [--base RUN_DIR] [--png curves.png] [--y reward|gain]

For every run: the eval reward at each eval step and its gain over the run's own step-0 eval,
taken sample by sample over the same (task, sampling seed) pairs (the orchestrator reuses eval
seeds, so every eval of a run, and of every run with the same run seed and eval size, scores the
same samples) with its paired standard error. ``--base``: also each run minus the base run at
the same step, paired the same way. The PNG plots reward against step with ±1 paired-SE bars.
Used for the reverse_text recipe study in docs/learning.md; it only reads ``rollouts.jsonl``.
``studies/learning/learning.py`` pairs its tables with the same two functions.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

Samples = dict[int, float]
"""{sampling seed: reward}: every eval sample of a run has its own sampling seed."""


def eval_rewards(run: Path) -> dict[int, Samples]:
    """step -> {sampling seed: reward} of every held-out eval sample of a run."""
    by_step: dict[int, Samples] = defaultdict(dict)
    with (run / "rollouts.jsonl").open() as f:
        for line in f:
            r = json.loads(line)
            if r["split"] == "eval":
                by_step[r["step"]][r["seed"]] = r["reward"]
    return dict(sorted(by_step.items()))


def paired(a: Samples, b: Samples) -> dict[str, float]:
    """Mean of ``a - b`` over the same samples, its standard error and the sample count."""
    seeds = a.keys() & b.keys()
    if len(seeds) < 2 or not len(seeds) == len(a) == len(b):
        raise ValueError("evals are not paired: the runs scored different (task, seed) samples")
    d = [a[s] - b[s] for s in seeds]
    return {"diff": statistics.mean(d), "se": statistics.stdev(d) / math.sqrt(len(d)), "n": len(d)}


def curve(run: Path, base: dict[int, Samples] | None = None) -> list[dict]:
    """One row per eval step: reward, paired gain over step 0 (and over ``base`` at that step)."""
    evals = eval_rewards(run)
    if 0 not in evals:
        raise ValueError(f"{run}: no step-0 eval in rollouts.jsonl")
    rows = []
    for step, samples in evals.items():
        gain = paired(samples, evals[0])
        row = {"step": step, "reward": statistics.mean(samples.values()), "n": gain["n"],
               "gain": gain["diff"], "gain_se": gain["se"]}
        if base is not None and step in base:
            vs = paired(samples, base[step])
            row["vs_base"], row["vs_base_se"] = vs["diff"], vs["se"]
        rows.append(row)
    return rows


def plot(curves: dict[str, list[dict]], png: Path, title: str, y: str = "reward") -> None:
    """Reward (or, ``y="gain"``, gain over step 0: runs from different warm starts) per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, rows in curves.items():
        ax.errorbar([r["step"] for r in rows], [r[y] for r in rows],
                    yerr=[r["gain_se"] for r in rows], marker="o", capsize=3, label=label)
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out {'gain over step 0' if y == 'gain' else 'reward'} (paired SE bars)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run output_dir, optionally =LABEL")
    p.add_argument("--base", type=Path, help="run to pair every run against, step by step")
    p.add_argument("--png", type=Path, help="write the curves here")
    p.add_argument("--title", default="held-out reward")
    p.add_argument("--y", choices=["reward", "gain"], default="reward", help="what the PNG plots")
    a = p.parse_args()
    base = eval_rewards(a.base) if a.base else None
    curves = {}
    for spec in a.runs:
        path, _, label = spec.partition("=")
        rows = curve(Path(path), base)
        curves[label or Path(path).name] = rows
        for row in rows:
            print(json.dumps({"bench": "eval_curves", "run": label or path, **row}))
    if a.png:
        plot(curves, a.png, a.title, a.y)


if __name__ == "__main__":
    main()

"""Learning evidence for the algorithms beyond GRPO, on CPU-sized runs of the shipped recipes.

    python studies/learning/learning.py [--scale small|medium|curve|smoke] [--lookup-seeds 0 1 2] [--reverse-seeds 0 1]
    python studies/learning/learning.py --scale curve --only lookup --png docs/img/lookup_echo_vs_grpo.png   # docs/learning.md
    python studies/learning/learning.py --report-only      # re-read finished runs, print the tables

Each run is ``python -m jaxrl.train`` on a recipe in ``configs/`` with a smaller budget merged
over it (steps, batch, eval size: ``BUDGETS``), its merged config written beside its outputs.
Runs that finished (``result.json``) are not run again, so the script can be resumed.

Pairing (as ``tests/e2e/test_rl.py``): a run seed fixes the task order and every rollout's
sampling seed (``orchestrator.rollout_seeds``), and evals reuse their seeds, so with the same
run seed two algorithms start from identical rollouts and are evaluated on identical held-out
(task, seed) samples; differences are taken sample by sample (paired standard errors).

1. lookup (tool env), ``configs/lookup/{grpo,echo}.toml`` from one SFT warm start, each run seed:
   the held-out learning curve of echo and of GRPO (every eval step: ``--scale curve`` evals every
   5 steps), the first step each reaches a held-out reward of 0.5, echo - GRPO paired at every
   eval step, and the NLL of tool-output tokens (echo's CE target): the trainer's per-step
   ``ce_nll_mean`` on fresh rollouts, and a held-out score of the SFT, GRPO and echo models on the
   same tool-output tokens (the step-0 eval rollouts, identical for both runs of a seed). The
   curves go to a PNG (``--png``).
2. reverse_text, ``configs/reverse_text/{rl,maxrl,opd}.toml``, each run seed: held-out reward
   before (the SFT warm start) and after. OPD's teacher is the same SFT continued to the end of
   its 300-step schedule (``sft.toml`` stops at 200 on purpose), produced here first; its
   held-out reward on the same eval samples is measured too.

Prints one JSON line per run and per comparison, then a markdown table (docs/learning.md).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

import tomli_w
from eval_curves import eval_rewards, paired  # studies/learning/ is on sys.path when run as a script

from jaxrl.cli import deep_merge, resolve_recipe_paths

ROOT = Path(__file__).resolve().parents[2]  # studies/learning/ -> the repository root
QUIET = {"log": {"progress": False}, "ckpt": {"interval": 0}}

# Budgets merged over the recipes. "small" fits ~70 min of 2 shared CPU cores; "smoke" checks
# the pipeline in a few minutes and measures nothing.
BUDGETS: dict[str, dict[str, dict[str, Any]]] = {
    "small": {
        "lookup_sft": {},  # the recipe as it is (200 steps)
        # lookup evals are greedy (T = 0): one sample per task, so every eval sample is independent
        "lookup": {"trainer": {"steps": 10}, "log": {"rollout_episodes": True},
                   "orchestrator": {"eval": {"interval": 10, "num_tasks": 64, "k": 1}}},
        "reverse": {"trainer": {"steps": 20}, "orchestrator": {"eval": {"interval": 20, "num_tasks": 64, "k": 4}}},
    },
    # "medium": the lookup comparison at twice the steps (the "small" rewards were too low to compare).
    "medium": {
        "lookup_sft": {},
        "lookup": {"trainer": {"steps": 20}, "log": {"rollout_episodes": True},
                   "orchestrator": {"eval": {"interval": 20, "num_tasks": 64, "k": 1}}},
        "reverse": {"trainer": {"steps": 40}, "orchestrator": {"eval": {"interval": 40, "num_tasks": 64, "k": 4}}},
    },
    # "curve": the lookup learning curves (issue 24): eval every 5 steps on 64 held-out tasks, greedy.
    "curve": {
        "lookup_sft": {},
        "lookup": {"log": {"rollout_episodes": True}},  # the recipes as they are: 20 steps, eval every 5
        "reverse": {"trainer": {"steps": 20}, "orchestrator": {"eval": {"interval": 20, "num_tasks": 64, "k": 4}}},
    },
    "smoke": {
        "lookup_sft": {"trainer": {"steps": 30}},  # enough to make some tool calls
        "lookup": {"trainer": {"steps": 2}, "log": {"rollout_episodes": True},
                   "orchestrator": {"eval": {"interval": 1, "num_tasks": 4, "k": 1}}},
        "reverse": {"trainer": {"steps": 2}, "orchestrator": {"batch_size": 16, "eval": {"interval": 2, "num_tasks": 4, "k": 2}}},
    },
}
REVERSE_ALGOS = {"grpo": "configs/reverse_text/rl.toml", "max_rl": "configs/reverse_text/maxrl.toml",
                 "opd": "configs/reverse_text/opd.toml"}
LOOKUP_ALGOS = {"grpo": "configs/lookup/grpo.toml", "echo": "configs/lookup/echo.toml"}


def log(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def train(config: str, out: Path, over: dict[str, Any], *, resume: bool = False) -> Path:
    """One ``python -m jaxrl.train`` run of ``config`` with ``over`` merged in; skipped when done."""
    if (out / "result.json").exists() and json.loads((out / "result.json").read_text()).get("stopped_by") is None:
        return out
    out.mkdir(parents=True, exist_ok=True)
    recipe = resolve_recipe_paths(tomllib.loads((ROOT / config).read_text()), (ROOT / config).parent)  # copied elsewhere
    merged = deep_merge(deep_merge(recipe, QUIET), over)
    merged["output_dir"] = str(out)
    cfg_file = out / "bench_config.toml"
    cfg_file.write_text(tomli_w.dumps(merged))
    cmd = [sys.executable, "-m", "jaxrl.train", "--config", str(cfg_file), "--resume" if resume else "--overwrite"]
    log(f"run {out.name}: {config}")
    t0 = time.monotonic()
    with (out / "train.log").open("w") as f:
        rc = subprocess.run(cmd, check=False, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{config} -> {out} failed (exit {rc}); see {out / 'train.log'}")
    log(f"done {out.name} in {time.monotonic() - t0:.0f} s")
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def emit(row: dict[str, Any]) -> dict[str, Any]:
    print(json.dumps({"bench": "learning", **row}), flush=True)
    return row


# ---- reverse_text: MaxRL and OPD vs GRPO from the SFT warm start ---------------------------------------------


def reverse_runs(root: Path, budget: dict[str, Any], seeds: list[int]) -> dict[str, Path]:
    warm = ROOT / "outputs/reverse_text/sft"
    if not (warm / "hf" / "model.safetensors").exists():
        train("configs/reverse_text/sft.toml", warm, {})
    teacher = root.parent / "reverse_teacher"  # one per machine: every scale distills the same teacher
    if not (teacher / "result.json").exists() or json.loads((teacher / "result.json").read_text())["steps"] != 300:
        shutil.rmtree(teacher, ignore_errors=True)
        shutil.copytree(warm, teacher)  # its step-200 checkpoint: continue to the end of the schedule
        (teacher / "result.json").unlink()
        train("configs/reverse_text/sft.toml", teacher, {"trainer": {"steps": 300}, "ckpt": {"interval": 100}},
              resume=True)
    runs = {}
    for seed in seeds:
        # The teacher on the same eval samples (one GRPO step; its step-0 eval is the teacher's).
        runs[f"teacher/s{seed}"] = train(REVERSE_ALGOS["grpo"], root / f"reverse_teacher_eval_s{seed}", deep_merge(
            budget, {"seed": seed, "model": {"name": str(teacher / "hf")}, "trainer": {"steps": 1}}))
        for algo, config in REVERSE_ALGOS.items():
            over = deep_merge(budget, {"seed": seed})
            if algo == "opd":
                over = deep_merge(over, {"orchestrator": {"train": {"env": [
                    {"id": "reverse_text", "algo": {"type": "opd", "teacher": {"name": str(teacher / "hf")}}}]}}})
            runs[f"{algo}/s{seed}"] = train(config, root / f"reverse_{algo}_s{seed}", over)
    return runs


def reverse_report(runs: dict[str, Path]) -> list[dict[str, Any]]:
    rows = []
    seeds = sorted({int(k.split("/s")[1]) for k in runs})
    for seed in seeds:
        base = eval_rewards(runs[f"grpo/s{seed}"])
        before = base[0]
        final = max(base)
        teacher = eval_rewards(runs[f"teacher/s{seed}"])[0]
        rows.append(emit({"env": "reverse_text", "algo": "teacher (SFT 300 steps)", "seed": seed,
                          "before": statistics.mean(before.values()), "after": statistics.mean(teacher.values()),
                          "gain": paired(teacher, before)}))
        for algo in REVERSE_ALGOS:
            ev = eval_rewards(runs[f"{algo}/s{seed}"])
            start, end = ev[0], ev[max(ev)]
            assert start == before, f"{algo} s{seed}: step-0 evals differ from GRPO's (not paired)"
            row = {"env": "reverse_text", "algo": algo, "seed": seed, "steps": max(ev),
                   "before": statistics.mean(start.values()), "after": statistics.mean(end.values()),
                   "gain": paired(end, start)}
            if algo != "grpo":
                row["vs_grpo"] = paired(end, base[final])
            rows.append(emit(row | opd_metrics(runs[f"{algo}/s{seed}"])))
    return rows


def opd_metrics(out: Path) -> dict[str, Any]:
    """Teacher KL (mean logp - logr over distilled tokens) at the first and last step of an OPD run."""
    train_rows = [r for r in _metrics(out) if r.get("ref_kl_tokens", 0) > 0]
    if not train_rows:
        return {}
    return {"teacher_kl_first": train_rows[0]["teacher_kl"], "teacher_kl_last": train_rows[-1]["teacher_kl"]}


def _metrics(out: Path) -> list[dict[str, Any]]:
    """A run's metrics rows, train metrics by their plain names (``train/ce_tokens`` -> ``ce_tokens``)."""
    from jaxrl.metrics import read_metrics

    return [{k.removeprefix("train/"): v for k, v in r.items()} for r in read_metrics(out / "metrics.jsonl")]


# ---- lookup: echo vs GRPO --------------------------------------------------------------------------------------


def lookup_runs(root: Path, budget: dict[str, Any], sft_budget: dict[str, Any], seeds: list[int]) -> dict[str, Path]:
    warm = train("configs/lookup/sft.toml", root / "lookup_sft", sft_budget)
    runs = {}
    for seed in seeds:
        for algo, config in LOOKUP_ALGOS.items():
            over = deep_merge(budget, {"seed": seed, "model": {"name": str(warm / "hf")}})
            runs[f"{algo}/s{seed}"] = train(config, root / f"lookup_{algo}_s{seed}", over)
    return runs


def lookup_report(root: Path, runs: dict[str, Path]) -> list[dict[str, Any]]:
    """Per run seed: both learning curves (held-out reward at every eval step), steps to reach
    ``HALF``, echo - GRPO paired at every eval step, and the tool-output NLLs; then all seeds."""
    from tool_nll import tool_output_nll  # studies/learning/ is on sys.path when run as a script

    rows = []
    seeds = sorted({int(k.split("/s")[1]) for k in runs})
    pooled: dict[str, dict[int, dict[tuple[int, int], float]]] = {a: defaultdict(dict) for a in LOOKUP_ALGOS}
    for seed in seeds:
        ev = {algo: eval_rewards(runs[f"{algo}/s{seed}"]) for algo in LOOKUP_ALGOS}
        grpo, echo = ev["grpo"], ev["echo"]
        assert grpo[0] == echo[0], f"s{seed}: step-0 evals differ (not paired)"
        steps = sorted(grpo.keys() & echo.keys())
        for algo, by_step in ev.items():
            for step in steps:
                pooled[algo][step] |= {(seed, s): v for s, v in by_step[step].items()}
        first_half, second_half = train_tool_nll(runs[f"echo/s{seed}"])
        held_out = tool_output_nll(
            runs[f"echo/s{seed}"], {"sft": root / "lookup_sft" / "hf", "grpo": runs[f"grpo/s{seed}"] / "hf",
                                    "echo": runs[f"echo/s{seed}"] / "hf"})
        rows.append(emit({
            "env": "lookup", "seed": seed, "steps": steps[-1],
            **{f"{algo}_curve": {step: statistics.mean(by_step[step].values()) for step in steps} for algo, by_step in ev.items()},
            **{f"{algo}_steps_to_half": steps_to(by_step, steps) for algo, by_step in ev.items()},
            "echo_vs_grpo": {step: paired(echo[step], grpo[step]) for step in steps[1:]},
            **{f"{algo}_copies": {step: copy_rates(runs[f"{algo}/s{seed}"], step) for step in steps}
               for algo in LOOKUP_ALGOS},
            "train_tool_nll_first_half": first_half, "train_tool_nll_second_half": second_half,
            "heldout_tool_nll": held_out}))
    per_seed = list(rows)
    steps = sorted(pooled["grpo"])
    rows.append(emit({
        "env": "lookup", "seed": "all", "steps": steps[-1],
        **{f"{algo}_curve": {step: mean_se([r[f"{algo}_curve"][step] for r in per_seed]) for step in steps}
           for algo in LOOKUP_ALGOS},
        "echo_vs_grpo": {step: paired(pooled["echo"][step], pooled["grpo"][step]) for step in steps[1:]},
        "echo_vs_grpo_across_seeds": {step: mean_se([r["echo_vs_grpo"][step]["diff"] for r in per_seed]) for step in steps[1:]},
        "heldout_tool_nll_echo_minus_grpo": mean_se([r["heldout_tool_nll"]["echo"] - r["heldout_tool_nll"]["grpo"]
                                                     for r in per_seed])}))
    return rows


def copy_rates(out: Path, step: int) -> dict[str, float]:
    """Where a lookup policy stands on the two copies the task needs, over a run's held-out evals at
    ``step``: the share of samples that call the tool at all, whose first call names the asked key
    exactly (copied from the prompt), and whose reply equals the first tool output exactly (copied
    from the tool)."""
    called = key = answer = n = 0
    for line in (out / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] != "eval" or r["step"] != step or r["episode"] is None:
            continue
        n += 1
        messages = [node.get("message", {}) for node in r["episode"]["traces"][0]["nodes"]]
        calls = [c for m in messages for c in (m.get("tool_calls") or [])]
        tools = [m.get("content") for m in messages if m.get("role") == "tool"]
        called += bool(calls)
        try:
            key += bool(calls) and json.loads(calls[0]["arguments"]).get("key") == r["episode"]["task"]["data"]["keys"][0]
        except (json.JSONDecodeError, AttributeError):  # the model wrote broken arguments
            pass
        answer += bool(tools) and messages[-1].get("role") == "assistant" and messages[-1].get("content") == tools[0]
    return {"called": called / n, "key_copied": key / n, "answer_is_tool_output": answer / n}


HALF = 0.5
"""The held-out reward the lookup curves are timed to (issue 24: "steps to reach 0.5")."""


def steps_to(by_step: dict[int, dict[int, float]], steps: list[int], level: float = HALF) -> int | None:
    """The first eval step whose mean held-out reward is at least ``level`` (None: never reached)."""
    return next((s for s in steps if statistics.mean(by_step[s].values()) >= level), None)


def lookup_plot(rows: list[dict[str, Any]], png: Path) -> None:
    """The held-out learning curves of both methods (a thin line per run seed, the seed mean thick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    colors = {"grpo": "tab:blue", "echo": "tab:orange"}
    for r in rows:
        for algo, color in colors.items():
            curve = r[f"{algo}_curve"]
            steps = sorted(curve)
            if r["seed"] == "all":
                means = [curve[s][0] for s in steps]
                ax.plot(steps, means, color=color, lw=2.5, marker="o", label=f"{algo} (mean of {len(rows) - 1} seeds)")
            else:
                ax.plot(steps, [curve[s] for s in steps], color=color, lw=0.8, alpha=0.45)
    ax.axhline(HALF, color="gray", ls="--", lw=0.8)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out reward (greedy)")
    ax.set_ylim(0, 1)
    ax.set_title("lookup: echo vs GRPO from one SFT warm start")
    ax.legend(loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)
    log(f"wrote {png}")


def train_tool_nll(out: Path) -> tuple[float, float]:
    """The trainer's tool-output NLL (``ce_nll_mean``: fresh rollouts, before that step's update),
    token-weighted over the first and the second half of an echo run's steps."""
    rows = [r for r in _metrics(out) if "ce_tokens" in r]  # train steps (the step-0 eval row has none)
    rows = [r for r in rows if r["ce_tokens"]]  # a step whose rollouts called no tool has no tool tokens (NaN mean)
    half = len(rows) // 2

    def weighted(part: list[dict[str, Any]]) -> float:
        n = sum(r["ce_tokens"] for r in part)
        return sum(r["ce_nll_mean"] * r["ce_tokens"] for r in part) / n if n else math.nan

    return weighted(rows[:half]), weighted(rows[half:])


# ---- table -----------------------------------------------------------------------------------------------------


def fmt(p: dict[str, float] | None) -> str:
    return "" if p is None else f"{p['diff']:+.3f} ± {p['se']:.3f}"


def table(reverse: list[dict[str, Any]], lookup: list[dict[str, Any]]) -> str:
    lines = []
    if reverse:
        lines += ["| reverse_text | run seed | steps | held-out before | after | gain (paired ± SE) | vs GRPO (paired ± SE) | teacher KL first → last |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in reverse:
            kl = f"{r['teacher_kl_first']:.3f} → {r['teacher_kl_last']:.3f}" if "teacher_kl_first" in r else ""
            lines.append(f"| {r['algo']} | {r['seed']} | {r.get('steps', '')} | {r['before']:.3f} | {r['after']:.3f} | "
                         f"{fmt(r['gain'])} | {fmt(r.get('vs_grpo'))} | {kl} |")
    if lookup:
        summary = lookup[-1]
        steps = sorted(summary["grpo_curve"])
        lines += ["", "| lookup held-out reward | run seed | " + " | ".join(f"step {s}" for s in steps) + " | steps to 0.5 |",
                  "|---|---|" + "---|" * (len(steps) + 1)]
        for algo in LOOKUP_ALGOS:
            for r in lookup[:-1]:
                reach = r[f"{algo}_steps_to_half"]
                lines.append(f"| {algo} | {r['seed']} | " + " | ".join(f"{r[f'{algo}_curve'][s]:.3f}" for s in steps)
                             + f" | {'> ' + str(steps[-1]) if reach is None else reach} |")
            lines.append(f"| {algo} | mean ± SE | " + " | ".join(
                f"{summary[f'{algo}_curve'][s][0]:.3f} ± {summary[f'{algo}_curve'][s][1]:.3f}" for s in steps) + " | |")
        lines += ["", "| step | echo - GRPO, pooled over seeds (paired ± SE) | echo - GRPO, across the seeds' means (± SE) |",
                  "|---|---|---|"]
        for s in steps[1:]:
            m, se = summary["echo_vs_grpo_across_seeds"][s]
            lines.append(f"| {s} | {fmt(summary['echo_vs_grpo'][s])} (n = {summary['echo_vs_grpo'][s]['n']}) | {m:+.3f} ± {se:.3f} |")
        lines += ["", "| run seed | echo train tool NLL, first → second half of the steps | held-out tool NLL SFT / GRPO / echo (tokens) |",
                  "|---|---|---|"]
        for r in lookup[:-1]:
            h = r["heldout_tool_nll"]
            lines.append(f"| {r['seed']} | {r['train_tool_nll_first_half']:.3f} → {r['train_tool_nll_second_half']:.3f} | "
                         f"{h['sft']:.3f} / {h['grpo']:.3f} / {h['echo']:.3f} ({h['tokens']}) |")
        m, se = summary["heldout_tool_nll_echo_minus_grpo"]
        lines.append(f"| all | | echo - GRPO: {m:+.3f} ± {se:.3f} |")
        lines += ["", "| run seed | held-out share: calls the tool / call names the key exactly / reply = tool output, SFT (step 0) | GRPO (last step) | echo (last step) |",
                  "|---|---|---|---|"]
        for r in lookup[:-1]:
            last = r["steps"]
            c = lambda x: f"{x['called']:.2f} / {x['key_copied']:.2f} / {x['answer_is_tool_output']:.2f}"
            lines.append(f"| {r['seed']} | {c(r['grpo_copies'][0])} | {c(r['grpo_copies'][last])} | {c(r['echo_copies'][last])} |")
    return "\n".join(lines)


def finished(by_seed: dict[int, dict[str, Path]]) -> dict[str, Path]:
    """The runs of every seed whose runs have all finished, keyed ``algo/s<seed>``."""
    return {f"{k}/s{s}": d for s, runs in by_seed.items() if all((d / "result.json").exists() for d in runs.values())
            for k, d in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", choices=sorted(BUDGETS), default="small")
    p.add_argument("--lookup-seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--reverse-seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--only", choices=["lookup", "reverse"], default=None)
    p.add_argument("--out", default=None, help="default outputs/bench_learning/<scale>")
    p.add_argument("--report-only", action="store_true", help="read finished runs; start none")
    p.add_argument("--png", default=None, help="where the lookup curves go (default <out>/lookup_echo_vs_grpo.png)")
    a = p.parse_args()
    root = Path(a.out or ROOT / "outputs" / "bench_learning" / a.scale).resolve()
    budget = BUDGETS[a.scale]
    reverse_seeds = [] if a.only == "lookup" else a.reverse_seeds
    lookup_seeds = [] if a.only == "reverse" else a.lookup_seeds
    if a.report_only:
        rev = finished({s: {k: root / (f"reverse_teacher_eval_s{s}" if k == "teacher" else f"reverse_{k}_s{s}")
                            for k in ("teacher", *REVERSE_ALGOS)} for s in reverse_seeds})
        look = finished({s: {k: root / f"lookup_{k}_s{s}" for k in LOOKUP_ALGOS} for s in lookup_seeds})
    else:
        rev = reverse_runs(root, budget["reverse"], reverse_seeds) if reverse_seeds else {}
        look = lookup_runs(root, budget["lookup"], budget["lookup_sft"], lookup_seeds) if lookup_seeds else {}
    lookup_rows = lookup_report(root, look) if look else []
    if lookup_rows:
        lookup_plot(lookup_rows, Path(a.png) if a.png else root / "lookup_echo_vs_grpo.png")
    print(table(reverse_report(rev) if rev else [], lookup_rows))


if __name__ == "__main__":
    main()

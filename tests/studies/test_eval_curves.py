"""studies/learning/eval_curves.py pairs eval samples by (prompt, sampling seed): gains over step 0 and over a
base run are taken sample by sample, and unpaired evals are refused instead of compared."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "studies" / "learning"))  # as `python studies/learning/eval_curves.py` has it

from eval_curves import curve, eval_rewards, paired


def write_run(run: Path, rewards: dict[int, list[float]], seeds: list[int] | None = None) -> Path:
    """A rollouts.jsonl with one eval sample per reward (prompts p0, p1, ...; seeds 100, 101, ...)
    and a train record that must be ignored."""
    run.mkdir(parents=True)
    lines = [{"split": "train", "step": 1, "prompt": [], "seed": 7, "reward": 99.0}]
    for step, rs in rewards.items():
        for i, r in enumerate(rs):
            seed = (seeds or list(range(100, 100 + len(rs))))[i]
            lines.append({"split": "eval", "step": step, "prompt": [{"role": "user", "content": f"p{i}"}],
                          "seed": seed, "reward": r})
    (run / "rollouts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


def test_gain_is_paired_sample_by_sample(tmp_path: Path) -> None:
    run = write_run(tmp_path / "a", {0: [0.1, 0.5, 0.9], 10: [0.2, 0.7, 0.9]})
    rows = curve(run)
    assert [r["step"] for r in rows] == [0, 10]
    d = [0.1, 0.2, 0.0]
    assert rows[1]["reward"] == pytest.approx(0.6)
    assert rows[1]["gain"] == pytest.approx(0.1)
    sd = math.sqrt(sum((x - 0.1) ** 2 for x in d) / 2)
    assert rows[1]["gain_se"] == pytest.approx(sd / math.sqrt(3))
    assert rows[0]["gain"] == 0.0 and rows[0]["n"] == 3


def test_base_run_paired_at_the_same_step(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", {0: [0.1, 0.5, 0.9], 10: [0.3, 0.6, 0.9]})
    b = write_run(tmp_path / "b", {0: [0.1, 0.5, 0.9], 10: [0.2, 0.6, 0.7]})
    rows = curve(a, eval_rewards(b))
    assert rows[1]["vs_base"] == pytest.approx(0.1)


def test_unpaired_evals_are_refused(tmp_path: Path) -> None:
    a = eval_rewards(write_run(tmp_path / "a", {0: [0.1, 0.5, 0.9]}))
    b = eval_rewards(write_run(tmp_path / "b", {0: [0.1, 0.5, 0.9]}, seeds=[1, 2, 3]))
    with pytest.raises(ValueError, match="not paired"):
        paired(a[0], b[0])


def test_cli_prints_rows_and_writes_png(tmp_path: Path) -> None:
    run = write_run(tmp_path / "a", {0: [0.1, 0.5, 0.9], 10: [0.2, 0.7, 0.9]})
    png = tmp_path / "c.png"
    out = subprocess.run([sys.executable, "studies/learning/eval_curves.py", f"{run}=mine", "--png", str(png), "--y", "gain"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(x) for x in out.splitlines()]
    assert [(r["run"], r["step"]) for r in rows] == [("mine", 0), ("mine", 10)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""bench/accelerator.py --smoke runs as a user runs it (``python bench/accelerator.py``, in its
own process, on the CPU) so the prepared accelerator run cannot rot: every check and benchmark
prints its line, every correctness check passes, and the summary table lists them. No timing is
asserted (the numbers depend on the machine)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # as `python bench/accelerator.py` has it

from accelerator_common import mfu, peak_flops  # noqa: E402
HAS_TORCH = importlib.util.find_spec("torch") is not None  # the Python 3.12 CI end runs without it
CHECKS = ("logits_vs_transformers", "engine_vs_trainer", "bf16_loss_grads", "kernel_training_attention",
          "kernel_cached_attention", "kernel_logprobs")


def test_smoke_run_prints_every_line_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "lines.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine has (conftest sets 8 virtual ones)
    proc = subprocess.run(
        [sys.executable, "bench/accelerator.py", "--smoke", "--out", str(out), "--budget-s", "3600"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    printed = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert printed == lines  # --out holds exactly what was printed

    assert lines[0]["platform"] == "cpu" and lines[0]["mode"] == "smoke" and lines[0]["peak_bf16_tflops"] is None
    checks = {line["check"]: line for line in lines if "check" in line}
    assert set(checks) == set(CHECKS)
    assert all(line["ok"] is True for line in checks.values()), checks
    # What runs on the CPU is compared, not skipped: only the training attention has no kernel
    # here (and, without torch, the transformers reference).
    skipped = [name for name, line in checks.items() if "skipped" in line]
    expected = ["kernel_training_attention"] if HAS_TORCH else ["logits_vs_transformers", "kernel_training_attention"]
    assert skipped == expected
    if HAS_TORCH:
        assert checks["logits_vs_transformers"]["scaled_err"] <= checks["logits_vs_transformers"]["tol"]
    assert checks["engine_vs_trainer"]["greedy_exact_argmax"] is True

    benches = [line for line in lines if "bench" in line]
    assert not [line for line in benches if "error" in line], benches
    train = {line["impl"]: line for line in benches if line["bench"] == "train_step"}
    assert set(train) == {"jaxrl", "transformers"}
    assert train["jaxrl"]["tokens_per_s"] > 0 and train["jaxrl"]["mfu"] is None  # no peak for a CPU
    decode = [line for line in benches if line["bench"] == "decode"]
    assert [line["batch"] for line in decode] == [1, 4]
    assert all(line["engine_tok_s"] > 0 for line in decode)
    if HAS_TORCH:
        assert train["transformers"]["jaxrl_over_transformers"] > 0
        assert all(line["hf_generate_tok_s"] > 0 for line in decode)
    else:
        assert train["transformers"]["skipped"] == "torch is not importable"
        assert all(line["hf_generate_skipped"] == "torch is not importable" for line in decode)
    steps = [line for line in benches if line["bench"] == "rl_step"]
    assert [line["step"] for line in steps] == [1, 2, 3, 4, 5]
    (rl,) = [line for line in benches if line["bench"] == "rl_run"]
    for key in ("rollout_wait_s", "train_s", "weight_sync_s", "step_s"):
        assert rl[key] >= 0, key

    # The summary table names every line once per line.
    names = [line.get("check") or line.get("bench") for line in lines[1:]]
    table_rows = [row.split("│")[1].strip() for row in proc.stdout.splitlines() if row.startswith("│")]
    assert [r for r in table_rows if r][1:] == names


def test_unknown_only_name_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/accelerator.py", "--only", "train_step,nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "--only: unknown name(s) nope" in proc.stderr


def test_peak_flops_by_device_kind_and_mfu() -> None:
    """jax's device_kind strings map to datasheet dense bf16 peaks; anything else has none."""
    tera = 1e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989 * tera
    assert peak_flops("NVIDIA H200") == 989 * tera
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312 * tera
    assert peak_flops("NVIDIA L4") == 121 * tera
    assert peak_flops("TPU v5 lite") == 197 * tera
    assert peak_flops("TPU v6 lite") == 918 * tera
    assert peak_flops("TPU v5p") == 459 * tera
    assert peak_flops("TPU v4") == 275 * tera
    assert peak_flops("cpu") is None and peak_flops("NVIDIA GeForce RTX 4090") is None
    assert mfu(params=10**9, tokens=1000, seconds=1.0, peak=6e12) == 1.0
    assert mfu(params=10**9, tokens=1000, seconds=1.0, peak=None) is None


def test_a_failed_check_fails_the_run(tmp_path: Path) -> None:
    """Only checks decide the exit code: a check with ok false fails it, a skipped check or a
    benchmark with an error does not (its line says so)."""
    from accelerator import Report

    report = Report(str(tmp_path / "lines.jsonl"))
    report.emit({"check": "a", "ok": True})
    report.emit({"check": "b", "ok": True, "skipped": "why"})
    report.emit({"bench": "c", "error": "RuntimeError: x"})
    assert report.failed == []
    report.emit({"check": "d", "ok": False, "error": "ValueError: y"})
    report.close()
    assert report.failed == ["d"]
    assert len((tmp_path / "lines.jsonl").read_text().splitlines()) == 4

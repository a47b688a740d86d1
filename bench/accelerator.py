"""One prepared run of the correctness checks and benchmarks on whatever accelerator jax sees.

    python bench/accelerator.py [--smoke] [--out FILE.jsonl] [--skip-torch] [--only NAME ...]
                                [--budget-s 480]

Correctness (lines ``{"check": name, "ok": bool, ...}``; any ``ok: false`` makes the exit code 1):

* ``logits_vs_transformers``: decoder logits vs transformers on the same weights (torch on the
  same device where it sees it, else torch on the CPU; skipped with a reason without torch);
* ``engine_vs_trainer``: the engine's greedy tokens and log-probs vs the trainer's token
  log-probs of one forward;
* ``bf16_loss_grads``: loss and gradients with bfloat16 compute on the device vs float32 on the CPU;
* ``kernel_training_attention`` / ``kernel_cached_attention`` / ``kernel_logprobs``: each of
  ``jaxrl/kernel_dispatch.py``'s choices for this platform vs its pure-JAX reference.

Speed (lines ``{"bench": name, ...}``):

* ``train_step``: tokens/s and MFU of the train step (Qwen3-0.6B architecture from
  ``jaxrl/models/presets.py``, random weights, bfloat16 compute, 4 x 4096 tokens, remat "auto") vs
  transformers + torch on the same device;
* ``decode``: engine tokens/s at batch 1 / 32 / 128 vs transformers ``generate``;
* ``rl_run``: a 5-step reverse_text RL run (configs/reverse_text/rl.toml on a tiny random model)
  with its step split (rollout wait / train / weight sync) from metrics.jsonl.

MFU = 6 * params * tokens / time / peak, with the peak of the device kind from
``accelerator_common.PEAK_BF16_TFLOPS`` (null for a device not in the table, and on CPU). Targets
(on H100/H200): train step MFU >= 35% and >= 1.3x transformers; decode at batch 32 >= 3x
``generate``. ``--smoke`` runs every check and bench on tiny shapes (CPU-friendly; the test
suite runs it, tests/bench/test_accelerator_smoke.py). A summary table of every line ends the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

# jax must not take the whole device up front: torch runs beside it (before the jax imports).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from accelerator_checks import CHECKS  # noqa: E402 - bench/ is on sys.path when run as a script
from accelerator_common import detect_device, full_shapes, smoke_shapes  # noqa: E402
from accelerator_speed import BENCHES  # noqa: E402

NAMES = (*CHECKS, *BENCHES)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU-friendly, about a minute)")
    p.add_argument("--out", metavar="FILE.jsonl", help="also write every line here")
    p.add_argument("--skip-torch", action="store_true", help="no transformers/torch references or baselines")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only these (repeat or comma-separate): {', '.join(NAMES)}")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="skip what has not started once this many seconds have passed (default 480: 8 minutes)")
    a = p.parse_args(argv)
    only = [n for item in a.only for n in item.split(",") if n]
    if unknown := sorted(set(only) - set(NAMES)):
        p.error(f"--only: unknown name(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    a.only = only
    return a


class Report:
    """Prints each line as JSON (and to ``--out``) as it comes, and keeps it for the table."""

    def __init__(self, out: str | None):
        self.lines: list[dict[str, Any]] = []
        self.file = open(out, "w") if out else None  # noqa: SIM115 - closed in close()

    def emit(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, default=float)
        print(text, flush=True)
        if self.file:
            self.file.write(text + "\n")
            self.file.flush()
        self.lines.append(line)

    def close(self) -> None:
        if self.file:
            self.file.close()

    @property
    def failed(self) -> list[str]:
        return [line["check"] for line in self.lines if "check" in line and line["ok"] is False]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def table(lines: list[dict[str, Any]], device: str, wall: float) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"bench/accelerator.py on {device} ({wall:.0f} s)", show_lines=False)
    t.add_column("line")
    t.add_column("status")
    t.add_column("numbers", overflow="fold")
    for line in lines:
        name = line.get("check") or line.get("bench") or "device"
        status = ""
        if "check" in line:
            status = "skip" if "skipped" in line else ("ok" if line["ok"] else "FAIL")
        elif "error" in line:
            status = "error"
        elif line.get("meets_target") is not None:
            status = "target met" if line["meets_target"] else "below target"
        elif "skipped" in line:
            status = "skip"
        rest = {k: v for k, v in line.items() if k not in ("check", "bench", "ok")}
        t.add_row(str(name), status, escape(", ".join(f"{k}={_fmt(v)}" for k, v in rest.items())))
    Console(width=200).print(t)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = time.perf_counter()
    dev = detect_device(a.skip_torch)
    shapes = smoke_shapes() if a.smoke else full_shapes()
    report = Report(a.out)
    report.emit({"device": dev.kind, "mode": "smoke" if a.smoke else "full", **dev.describe()})
    try:
        for name, fn in {**CHECKS, **BENCHES}.items():
            if a.only and name not in a.only:
                continue
            key = "check" if name in CHECKS else "bench"
            if time.perf_counter() - t0 > a.budget_s:
                report.emit({key: name, **({"ok": True} if key == "check" else {}),
                             "skipped": f"--budget-s {a.budget_s:.0f} spent"})
                continue
            started = time.perf_counter()
            try:
                lines = fn(dev, shapes)
            except Exception as e:  # noqa: BLE001 - one failure must not hide the other measures
                traceback.print_exc(file=sys.stderr)
                lines = [{key: name, **({"ok": False} if key == "check" else {}),
                          "error": f"{type(e).__name__}: {str(e)[:400]}"}]
            lines[-1]["wall_s"] = time.perf_counter() - started
            for line in lines:
                report.emit(line)
    finally:
        report.close()
    table(report.lines, dev.kind, time.perf_counter() - t0)
    if report.failed:
        print(f"FAILED checks: {', '.join(report.failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

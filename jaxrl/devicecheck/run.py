"""One prepared run of the correctness checks and benchmarks on whatever accelerator jax sees.

    python -m jaxrl.devicecheck [--smoke] [--out DIR] [--skip-torch] [--only NAME ...] [--profile]
                                [--budget-s 840] [--measure-s S]

Runs from an installed jaxrl (no repository checkout needed). The first line names the installed
versions; then one JSON line per number, written to DIR/lines-<UTC time>.jsonl (flushed and
fsynced) the moment it is measured, so a crash, an out-of-memory or a killed run loses nothing
already taken. Each measure has a deadline (``DEADLINES``, ``--measure-s``; never past
``--budget-s`` from the start): past it, a line ``{"timed_out": true}`` is written at once and the
run moves on to the next measure. jax's persistent compile cache lives in DIR/compile-cache, so a
second run (or the same run after a kill) skips the compiles. ``--profile`` keeps a
``jax.profiler`` trace of one train step per train measure in DIR/profile-<time>-<measure>.

Correctness (``{"check": name, "ok": bool, ...}``; a failed or timed-out check exits 1):

* ``logits_vs_transformers``: decoder logits vs transformers on the same weights (torch on the
  same device where it sees it, else torch on the CPU; skipped with a reason without torch);
* ``engine_vs_trainer``: the engine's greedy tokens and log-probs vs the trainer's token
  log-probs of one forward (float32, ``highest`` matmul precision);
* ``bf16_loss_grads``: loss and gradients with bfloat16 compute on the device vs float32 on the CPU;
* ``kernel_training_attention`` / ``kernel_cached_attention`` / ``kernel_logprobs``: each of
  ``jaxrl/kernel_dispatch.py``'s choices for this platform vs its pure-JAX reference.

Numbers (``{"bench": name, ...}``):

* ``logprob_mismatch_bf16`` / ``_int8`` / ``_fp8``: the bfloat16 engine's sampled-token
  log-probs vs the trainer's (mean / max |delta|, the KL RL sees, importance-ratio extremes), with
  its projections unquantized, in int8 and in fp8;
* ``train_remat_none`` / ``_dots`` / ``_full``: train step tokens/s, MFU (6N + attention) and HFU
  (plus what the policy recomputes) at Qwen3-0.6B x 4 x 4096 tokens, beside transformers + torch at
  the same setting (gradient checkpointing for "full" only);
* ``decode``: engine tokens/s at batch 1 / 32 / 128, the share of peak HBM bandwidth reached, vs
  transformers ``generate``; ``decode_quantized``: the same at the largest batch with int8 / fp8
  projections;
* ``rl_run``: five reverse_text GRPO steps on a random model of Qwen3-0.6B's shape, the step split
  (rollout wait / train / weight sync) per step and averaged.

Peaks per device kind: ``common.DEVICE_PEAKS``. Targets (on H100/H200): train step MFU >= 35% and
>= 1.3x transformers; decode at batch 32 >= 3x ``generate``. ``--smoke`` runs every measure on tiny
shapes (the CPU: ~2 min of CPU time; tests/test_devicecheck.py and scripts/rehearse_offline_install.sh
run it). A summary table of every line ends the run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

# jax must not take the whole device up front: torch runs beside it (before the jax imports).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # after the environment above

from jaxrl.devicecheck.checks import CHECKS
from jaxrl.devicecheck.common import detect_device, full_shapes, smoke_shapes
from jaxrl.devicecheck.mismatch import MISMATCH
from jaxrl.devicecheck.speed import BENCHES

Measure = Callable[..., Iterable[dict[str, Any]]]
MEASURES: dict[str, tuple[str, Measure]] = {
    **{name: ("check", fn) for name, fn in CHECKS.items()},
    **{name: ("bench", fn) for name, fn in MISMATCH.items()},
    **{name: ("bench", fn) for name, fn in BENCHES.items()},
}
# Seconds per measure on an accelerator (compiles of the 0.6B programs included); 14 minutes in all.
DEADLINES = {"train_remat_none": 180.0, "train_remat_dots": 180.0, "train_remat_full": 180.0, "decode": 240.0,
             "decode_quantized": 180.0,
             "rl_run": 300.0}
DEFAULT_DEADLINE = 120.0
VERSIONED = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "libtpu",
             "flax", "optax", "orbax-checkpoint", "tensorstore", "transformers", "torch", "huggingface-hub",
             "safetensors", "tokenizers", "numpy", "jaxrl")


def versions() -> dict[str, str | None]:
    """Installed versions of what the numbers depend on (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxrl.devicecheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (~2 min of CPU time)")
    p.add_argument("--out", type=Path, default=Path("devicecheck-out"), metavar="DIR",
                   help="folder for lines-<time>.jsonl, compile-cache/ and profiles (default ./devicecheck-out)")
    p.add_argument("--skip-torch", action="store_true", help="no transformers/torch references or baselines")
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help=f"run only these (repeat or comma-separate): {', '.join(MEASURES)}")
    p.add_argument("--profile", action="store_true", help="keep a jax.profiler trace of one step per train measure")
    p.add_argument("--budget-s", type=float, default=840.0,
                   help="no measure runs past this many seconds from the start (default 840: 14 minutes)")
    p.add_argument("--measure-s", type=float, default=None,
                   help=f"deadline of every measure (default: {DEFAULT_DEADLINE:.0f} s, longer for the benches)")
    a = p.parse_args(argv)
    only = [n for item in a.only for n in item.split(",") if n]
    if unknown := sorted(set(only) - set(MEASURES)):
        p.error(f"--only: unknown name(s) {', '.join(unknown)}; choose from {', '.join(MEASURES)}")
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if a.measure_s is not None and a.measure_s <= 0:
        p.error("--measure-s must be > 0")
    if a.out.exists() and not a.out.is_dir():
        p.error(f"--out {a.out}: exists and is not a folder; name a folder")
    a.only = only
    return a


class Report:
    """Writes each line as JSON to stdout and to the lines file the moment it comes (flush +
    fsync: on disk even if the process dies next), and keeps it for the table. Thread-safe: the
    deadline watchdog writes from its own thread."""

    def __init__(self, path: Path | None):
        self.lines: list[dict[str, Any]] = []
        self.path = path
        self.file = open(path, "x") if path else None
        self._lock = threading.Lock()

    def emit(self, line: dict[str, Any]) -> None:
        text = json.dumps(line, default=float)
        with self._lock:
            print(text, flush=True)
            if self.file:
                self.file.write(text + "\n")
                self.file.flush()
                os.fsync(self.file.fileno())
            self.lines.append(line)

    def close(self) -> None:
        if self.file:
            self.file.close()

    @property
    def failed(self) -> list[str]:
        """Checks that did not pass: ok false, or timed out before saying."""
        return [line["check"] for line in self.lines if "check" in line and line.get("ok") is not True]


class MeasureTimeout(Exception):
    """Raised in the main thread when a measure's deadline passes (its line is already written)."""


class Deadline:
    """Runs one measure against a deadline. A watchdog thread fires at the deadline: it writes
    the measure's ``timed_out`` line at once (so it is on disk even if the device never returns)
    and raises ``MeasureTimeout`` in the main thread, which takes effect when the main thread next
    runs Python (a device call in flight finishes first; a hung one is for the outer ``timeout``)."""

    def __init__(self, report: Report, key: str, name: str, seconds: float):
        self.report, self.key, self.name, self.seconds = report, key, name, seconds
        self.main = threading.get_ident()
        self.lock = threading.Lock()
        self.done = self.fired = False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        with self.lock:
            if self.done:
                return
            self.fired = True
            self.report.emit({self.key: self.name, **({"ok": None} if self.key == "check" else {}),
                              "timed_out": True, "deadline_s": round(self.seconds, 1)})
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main), ctypes.py_object(MeasureTimeout))

    def __enter__(self) -> Self:
        self.timer.start()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        with self.lock:
            self.done = True
            self.timer.cancel()
            if self.fired:  # clear an exception not delivered yet; swallow one that was
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main), None)
        return typ is MeasureTimeout


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

    t = Table(title=f"jaxrl.devicecheck on {device} ({wall:.0f} s)", show_lines=False)
    t.add_column("line")
    t.add_column("status")
    t.add_column("numbers", overflow="fold")
    for line in lines:
        name = line.get("check") or line.get("bench") or ("versions" if "versions" in line else "device")
        status = ""
        if line.get("timed_out"):
            status = "timed out"
        elif "check" in line:
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


def _run_measure(report: Report, key: str, name: str, fn: Measure, deadline: float, **kwargs: Any) -> None:
    started = time.perf_counter()
    with Deadline(report, key, name, deadline) as guard:
        try:
            for line in fn(**kwargs):
                if guard.fired:
                    break
                report.emit({**line, "measure_s": round(time.perf_counter() - started, 3)})
        except MeasureTimeout:
            raise
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            if not guard.fired:
                report.emit({key: name, **({"ok": False} if key == "check" else {}),
                             "error": f"{type(e).__name__}: {str(e)[:400]}",
                             "measure_s": round(time.perf_counter() - started, 3)})


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    t0 = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    a.out.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(a.out / "compile-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    report = Report(a.out / f"lines-{stamp}.jsonl")
    print(f"writing {report.path}", file=sys.stderr, flush=True)
    report.emit({"versions": versions()})
    dev = detect_device(a.skip_torch)
    shapes = smoke_shapes() if a.smoke else full_shapes()
    report.emit({"device": dev.kind, "mode": "smoke" if a.smoke else "full", **dev.describe()})
    try:
        for name, (key, fn) in MEASURES.items():
            if a.only and name not in a.only:
                continue
            left = a.budget_s - (time.perf_counter() - t0)
            if left <= 0:
                report.emit({key: name, **({"ok": None} if key == "check" else {}),
                             "skipped": f"--budget-s {a.budget_s:.0f} spent"})
                continue
            deadline = min(left, a.measure_s or DEADLINES.get(name, DEFAULT_DEADLINE))
            kwargs: dict[str, Any] = {"dev": dev, "shapes": shapes}
            if a.profile and name.startswith("train_remat_"):
                kwargs["profile_dir"] = a.out / f"profile-{stamp}-{name}"
            try:
                _run_measure(report, key, name, fn, deadline, **kwargs)
            except MeasureTimeout:  # delivered while the measure was already closing: its line is written
                pass
    finally:
        report.close()
    table(report.lines, dev.kind, time.perf_counter() - t0)
    print(f"lines: {report.path}", file=sys.stderr)
    if report.failed:
        print(f"FAILED or unfinished checks: {', '.join(report.failed)}", file=sys.stderr)
        return 1
    return 0

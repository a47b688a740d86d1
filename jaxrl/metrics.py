"""Run metrics: ``<output_dir>/metrics.jsonl`` (one object per step, with ``step``), a rich
progress bar (off a terminal: a plain line with elapsed time and ETA), optional W&B /
TensorBoard, and a PNG plot, refreshed at each eval and at the end. Only process 0 writes."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from jaxrl.parallel.distributed import is_main_process

if TYPE_CHECKING:
    from jaxrl.config import WandbConfig

# Columns of the W&B sample tables (a flat rollouts.jsonl record's readable fields).
SAMPLE_COLUMNS = ("step", "env", "prompt", "completion", "reward", "fate")

# One naming scheme for every logged metric: `train/...` (the optimizer step and the batch it
# trained on), `eval/...` (held out), `time/...` (seconds), `engine/...` (the rollout backend's
# own view), `samples/...` (W&B rollout tables). Components return plain names ("ce_loss");
# `scoped` files them under `train/` when the run logs them, so every output (metrics.jsonl,
# the progress line, W&B, TensorBoard, the plot) uses the same names.
NAMESPACES = ("train", "eval", "time", "engine", "samples")


def scoped(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` with every key not already under a namespace moved under ``train/``."""
    return {(k if k.split("/", 1)[0] in NAMESPACES and "/" in k else f"train/{k}"): v for k, v in metrics.items()}


# The off-policy corrections at work (docs/off-policy.md, Metrics): the share of RL tokens whose
# importance ratio the loss masked (trust region / PPO clip), clipped (cispo / tis), held at the
# dual-clip floor or rejected (MIS), and how stale the batch was (the largest policy lag, the
# share the staleness rule dropped). Every RL step logs them all; a correction the loss does not
# have, or that did not act this step, is 0 and left off the line (metrics.jsonl keeps it).
_OFF_POLICY_KEYS = (
    "train/masked_high_frac", "train/masked_low_frac", "train/clipped_frac", "train/dual_clipped_frac",
    "train/mis_rejected_frac", "train/policy_lag_max", "train/stale_dropped_frac",
)  # fmt: skip

# Shown on the progress bar / plain progress line when present in a row, in this order (the
# live bar keeps as many as fit the terminal, from the left).
_BAR_KEYS = (
    "train/reward_mean", "train/ce_loss", "eval/ce_loss", "train/rl_loss", "train/mismatch_kl", "train/grad_norm",
    "train/rollouts_failed", *_OFF_POLICY_KEYS,
    "train/tokens_per_s", "time/rollout_wait_s", "time/train_s", "time/step_s",
)  # fmt: skip


def progress_fields(metrics: dict[str, Any]) -> str:
    """``key=value`` for the row's headline metrics (eval averages included), in a fixed order;
    the off-policy ones only where nonzero."""
    shown = [k for k in _BAR_KEYS if k in metrics and not (k in _OFF_POLICY_KEYS and metrics[k] == 0)]
    keys = shown + sorted(k for k in metrics if k.startswith("eval/") and "/avg@" in k)
    return " ".join(f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics[k], (int, float)))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def truncate_jsonl(path: str | Path, max_step: int) -> int:
    """Keep the records of ``path`` up to ``max_step`` (a resumed run's checkpoint step): a run
    killed after its last checkpoint left later steps (and maybe half a line) that the resumed
    run writes again. Rewritten atomically; returns the number of lines dropped."""
    p = Path(path)
    if not p.exists():
        return 0
    kept, dropped = [], 0
    for line in p.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            dropped += bool(line.strip())
            continue
        if isinstance(row, dict) and row.get("step", 0) <= max_step:
            kept.append(line)
        else:
            dropped += 1
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(p)
    return dropped


def ema(values: list[float], decay: float = 0.9) -> list[float]:
    """Exponential moving average, bias-corrected (the first points are not pulled to 0)."""
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc, weight = decay * acc + (1 - decay) * v, decay * weight + (1 - decay)
        out.append(acc / weight)
    return out


# Train metric -> (its held-out eval metric, that metric's standard error or None): drawn on one panel.
_HELD_OUT = {"train/reward_mean": ("eval/reward_mean", "eval/reward_se"), "train/ce_loss": ("eval/ce_loss", None)}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def plot_metrics(
    rows: list[dict[str, Any]], keys: list[str], out: str | Path, title: str = ""
) -> Path | None:
    """One panel per key that has finite values; returns the PNG path (None if nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {}
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        if pts:
            series[k] = pts
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for ax, (k, pts) in zip(axes[0], series.items()):
        steps, values = [p[0] for p in pts], [p[1] for p in pts]
        if k in _HELD_OUT:  # the train metric, smoothed, with the held-out eval on the same axis
            ax.plot(steps, values, color="C0", alpha=0.3, label="train (per step)")
            ax.plot(steps, ema(values), color="C0", label="train (EMA 0.9)")
            mean_key, se_key = _HELD_OUT[k]
            evals = [(r["step"], r[mean_key], r.get(se_key, 0.0) if se_key else 0.0) for r in rows if _finite(r.get(mean_key))]
            if evals:
                se = [e[2] if _finite(e[2]) else 0.0 for e in evals]
                ax.errorbar([e[0] for e in evals], [e[1] for e in evals], yerr=se, color="C1", marker="o",
                            capsize=3, label="eval (± SE)" if se_key else "eval (held out)")  # fmt: skip
            ax.legend(fontsize="small")
        else:
            ax.plot(steps, values, marker="." if len(pts) < 50 else None)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


_BAR_WIDTH = 20


class _Fields(ProgressColumn):
    """The headline metrics, cut to the width the step count, bar and times leave: on a narrow
    terminal rich would otherwise shrink every column, and the step count and ETA go first."""

    def __init__(self, reserved: int) -> None:
        super().__init__()
        self.reserved = reserved
        self.console: Console | None = None

    def render(self, task: Task) -> Text:
        width = (self.console.width if self.console is not None else 80) - self.reserved
        text = Text(task.description, no_wrap=True, overflow="ellipsis")
        text.truncate(max(width, 0), overflow="ellipsis")
        return text


def progress_bar(total_steps: int, console: Console | None = None) -> Progress:
    """The live progress line: ``step N/M``, a bar, elapsed, ETA, then as many headline metrics
    as fit on one line of the terminal (the first four always fit; the metrics never do at 80
    columns)."""
    fields = _Fields(reserved=len("step") + 2 * len(str(total_steps)) + 1 + _BAR_WIDTH + 2 * len("0:00:00") + 5)
    bar = Progress(
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(bar_width=_BAR_WIDTH),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        fields,
        console=console,
    )
    fields.console = bar.console
    return bar


def _clock(seconds: float) -> str:
    """``H:MM:SS``."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class MetricsLogger:
    def __init__(
        self,
        output_dir: str | Path,
        total_steps: int,
        *,
        start_step: int = 0,
        progress: bool = True,
        plot_keys: tuple[str, ...] = (),
        interval: int = 1,
        wandb: WandbConfig | None = None,
        wandb_run_id: str | None = None,
        tensorboard: bool = False,
        run_config: dict[str, Any] | None = None,
        title: str = "",
    ):
        self.main = is_main_process()
        self.dir = Path(output_dir)
        self.path = self.dir / "metrics.jsonl"
        self.plot_keys, self.title = plot_keys, title
        self.total_steps, self.interval = total_steps, interval
        self._progress: Progress | None = None
        self._wandb = self._tb = None
        self._start_step, self._t0 = start_step, time.monotonic()  # for the plain line's elapsed time and ETA
        if not self.main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if start_step == 0:
            self.path.write_text("")
        if progress and sys.stdout.isatty():  # elsewhere a redrawn bar is one unreadable line
            self._progress = progress_bar(total_steps)
            self._progress.start()
            self._task = self._progress.add_task("", total=total_steps, completed=start_step)
        self._wandb_samples = wandb.samples if wandb else 0
        if wandb is not None:
            try:
                import wandb as wandb_lib  # optional dependency, only when asked for
            except ImportError as e:
                raise ImportError("[log.wandb] is set but wandb is not installed: pip install 'jaxrl[wandb]'") from e
            self._wandb = wandb_lib.init(
                project=wandb.project, entity=wandb.entity, name=wandb.name, tags=wandb.tags, mode=wandb.mode,
                config=run_config, dir=str(self.dir), id=wandb_run_id, resume="must" if wandb_run_id else None,
            )  # fmt: skip
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional dependency, only when asked for

            self._tb = SummaryWriter(str(self.dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write one step's metrics (``scoped``: the names every output uses) and return them."""
        metrics = scoped(metrics)
        if not self.main:
            return metrics
        row = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=progress_fields(metrics))
        elif step % self.interval == 0 or step == self.total_steps:
            print(f"[jaxrl] step {step}/{self.total_steps} {self._timing(step)} {progress_fields(metrics)}", flush=True)
        if self.plot_keys and any(k.startswith("eval/") for k in metrics):  # a run read mid-way has its plot
            plot_metrics(read_metrics(self.path), list(self.plot_keys), self.dir / "metrics.png", self.title)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        return metrics

    def _timing(self, step: int) -> str:
        """``elapsed 0:01:23 eta 0:10:00``: this process's time so far, and the rest at its mean pace."""
        elapsed = time.monotonic() - self._t0
        done = step - self._start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else None
        return f"elapsed {_clock(elapsed)} eta {_clock(eta) if eta is not None else '?'}"

    @property
    def wandb_run_id(self) -> str | None:
        """The W&B run's id (kept in checkpoints: `--resume` continues that run), None without W&B."""
        return self._wandb.id if self._wandb is not None else None

    def log_samples(self, step: int, split: str, records: list[dict[str, Any]]) -> None:
        """The first `[log.wandb] samples` rollout records of a step as the `samples/<split>` table."""
        if self._wandb is None or not self._wandb_samples or not records:
            return
        import wandb

        rows = [[json.dumps(r.get(c), default=str) if c in ("prompt", "completion") else r.get(c) for c in SAMPLE_COLUMNS]
                for r in records[: self._wandb_samples]]  # fmt: skip
        self._wandb.log({f"samples/{split}": wandb.Table(columns=list(SAMPLE_COLUMNS), data=rows)}, step=step)

    def close(self, title: str | None = None) -> Path | None:
        if not self.main:
            return None
        if self._progress is not None:
            self._progress.stop()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        if not self.plot_keys or not self.path.exists():
            return None
        return plot_metrics(read_metrics(self.path), list(self.plot_keys), self.dir / "metrics.png", title or self.title)

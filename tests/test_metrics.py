"""Run output: metrics / rollouts logs."""

from __future__ import annotations

import json
import re

from jaxrl.metrics import truncate_jsonl


def test_truncate_jsonl_keeps_records_up_to_the_checkpoint(tmp_path) -> None:
    log = tmp_path / "rollouts.jsonl"
    rows = [{"step": s, "fate": "trained"} for s in (0, 1, 2, 3, 3)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "fa')
    assert truncate_jsonl(log, 2) == 3
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]
    assert truncate_jsonl(tmp_path / "missing.jsonl", 2) == 0


def test_off_a_terminal_progress_is_a_plain_line_every_interval_steps(tmp_path, capsys) -> None:
    from jaxrl.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 5, progress=True, interval=2)  # pytest's stdout is no terminal
    for step in range(1, 6):
        logger.log(step, {"ce_loss": 1.0 / step, "grad_norm": 0.5, "eval/lookup/avg@4": 0.25, "note": "x"})
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    clock = r"elapsed \d+:\d\d:\d\d eta (\d+:\d\d:\d\d)"  # off a terminal (kubectl logs) the line carries the time
    assert [re.sub(clock, "T", line) for line in lines] == [
        f"[jaxrl] step {s}/5 T train/ce_loss={1.0 / s:.4g} train/grad_norm=0.5 eval/lookup/avg@4=0.25" for s in (2, 4, 5)
    ]
    assert re.search(clock, lines[-1]).group(1) == "0:00:00"  # the last step: nothing left
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_one_naming_scheme_files_plain_names_under_train() -> None:
    from jaxrl.metrics import scoped

    got = scoped({"ce_loss": 1, "reward/lookup": 2, "time/train_s": 3, "eval/ce_loss": 4, "engine/compiles": 5, "train/lr": 6})
    assert got == {"train/ce_loss": 1, "train/reward/lookup": 2, "time/train_s": 3, "eval/ce_loss": 4,
                   "engine/compiles": 5, "train/lr": 6}  # fmt: skip


def test_plot_puts_eval_with_its_standard_error_on_the_train_reward_panel(tmp_path) -> None:
    from jaxrl.metrics import ema, plot_metrics

    assert ema([1.0, 1.0, 1.0]) == [1.0, 1.0, 1.0]  # bias-corrected: no pull towards 0
    rows = [{"step": s, "train/reward_mean": 0.5 + 0.01 * s, "train/rl_loss": 0.1} for s in range(1, 11)]
    rows[-1] |= {"eval/reward_mean": 0.6, "eval/reward_se": 0.02}
    out = plot_metrics(rows, ["train/reward_mean", "train/rl_loss"], tmp_path / "m.png", "RL")
    assert out is not None and out.stat().st_size > 0


def test_wandb_is_off_by_default_and_its_config_is_checked() -> None:
    import importlib.util

    import pydantic
    import pytest

    from jaxrl.config import LogConfig

    assert LogConfig().wandb is None
    good = {"wandb": {"project": "p", "entity": "e", "name": "n", "tags": ["a"], "mode": "offline"}}
    if importlib.util.find_spec("wandb") is None:
        # `.[test]` alone (the README's install) has no wandb: the run is refused at load, naming the extra.
        with pytest.raises(pydantic.ValidationError, match=r"wandb is not installed: pip install -e \"\.\[wandb\]\""):
            LogConfig.model_validate(good)
    else:
        cfg = LogConfig.model_validate(good)
        assert cfg.wandb.tags == ["a"] and cfg.wandb.mode == "offline"
    for bad in ({"project": ""}, {"project": "p", "mode": "sometimes"}, {"project": "p", "samples": -1}):
        with pytest.raises(pydantic.ValidationError):
            LogConfig.model_validate({"wandb": bad})


def test_wandb_offline_run_logs_metrics_and_sample_tables_and_resumes_by_id(tmp_path, monkeypatch) -> None:
    """A real offline W&B run (no network): metrics and a samples table go into its run files, and
    a logger given the stored run id continues that run instead of starting another."""
    import pytest

    wandb = pytest.importorskip("wandb")
    from jaxrl.config import WandbConfig
    from jaxrl.metrics import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = WandbConfig(project="jaxrl-test", name="t", tags=["ci"], mode="offline", samples=2)
    logger = MetricsLogger(tmp_path, 2, progress=False, wandb=cfg, run_config={"x": 1})
    run_id = logger.wandb_run_id
    assert run_id
    records = [{"step": 1, "env": "e", "prompt": [{"role": "user", "content": f"p{i}"}], "completion": [], "reward": i,
                "fate": "trained"} for i in range(3)]  # fmt: skip
    logger.log_samples(1, "train", records)
    logger.log(1, {"ce_loss": 0.5})
    logger.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    table = json.loads(next((runs[0] / "files" / "media" / "table" / "samples").glob("train_*.table.json")).read_text())
    assert table["columns"] == ["step", "env", "prompt", "completion", "reward", "fate"] and len(table["data"]) == 2

    resumed = MetricsLogger(tmp_path, 2, start_step=1, progress=False, wandb=cfg, wandb_run_id=run_id)
    assert resumed.wandb_run_id == run_id
    resumed.log(2, {"ce_loss": 0.4})
    resumed.close()
    assert wandb.run is None


def test_rollout_log_sends_train_and_eval_samples_to_wandb(tmp_path, monkeypatch) -> None:
    import pytest

    pytest.importorskip("wandb")
    from jaxrl.config import WandbConfig
    from jaxrl.metrics import MetricsLogger
    from jaxrl.rl import RolloutLog

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, 1, progress=False, wandb=WandbConfig(project="p", mode="offline"))
    log = RolloutLog(tmp_path / "rollouts.jsonl", append=False, logger=logger)
    log.write([{"step": 0, "split": "eval", "fate": "eval", "reward": 1.0}])
    log.write([{"step": 1, "split": "train", "fate": "trained", "reward": 0.0}] * 3)
    logger.close()
    tables = sorted(p.name.split("_")[0] for p in (tmp_path / "wandb").rglob("*.table.json"))
    assert tables == ["eval", "train"]
    assert len((tmp_path / "rollouts.jsonl").read_text().splitlines()) == 4


def test_a_cpu_run_does_not_start_libtpu() -> None:
    """With the tpu extra installed (as CI installs it), a CPU host's run output starts with the
    run's own lines, not libtpu's TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES warnings."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run(
        [sys.executable, "-c", "import jaxrl, jax; print(jax.devices()[0].platform)"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == "cpu"
    assert "TPU_ACCELERATOR_TYPE" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr, out.stderr


def test_the_plot_is_refreshed_at_each_eval_not_only_at_the_end(tmp_path) -> None:
    from jaxrl.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, 4, progress=False, plot_keys=("train/ce_loss",))
    logger.log(1, {"ce_loss": 1.0})
    assert not (tmp_path / "metrics.png").exists()
    logger.log(2, {"ce_loss": 0.5, "eval/ce_loss": 0.7})
    assert (tmp_path / "metrics.png").stat().st_size > 0  # a run read mid-way (kubectl cp) has its plot
    logger.close()


def test_metrics_zero_by_construction_are_not_logged() -> None:
    from jaxrl.orchestrator.config import OrchestratorConfig
    from jaxrl.rl import unused_metrics

    def unused(*algos: str) -> tuple[str, ...]:
        extra = {"opd": {"teacher": {"name": "t/t"}}, "echo": {"roles": {"user": {"alpha": 0.1}}}}
        envs = [{"id": "reverse_text", "name": f"e{i}", "algo": {"type": a, **extra.get(a, {})}} for i, a in enumerate(algos)]
        return unused_metrics(OrchestratorConfig(batch_size=8, group_size=8, train={"env": envs}))

    assert unused("grpo") == ("ce_", "ref_kl_", "teacher_kl")
    assert unused("grpo", "echo") == ("ref_kl_", "teacher_kl") and unused("opd") == ("ce_",)
    assert unused("sft", "opd") == ()


def test_the_live_progress_line_keeps_step_count_and_eta_at_100_and_200_columns() -> None:
    """rich shrank every column of a line too wide for the terminal: at 100 columns the step
    count became "s…" and the ETA vanished. The metrics are cut instead, to one line."""
    import io

    from rich.console import Console

    from jaxrl.metrics import progress_bar, progress_fields

    fields = progress_fields({
        "train/reward_mean": 0.59, "train/rl_loss": 0.0123, "train/mismatch_kl": 1.2e-5, "train/grad_norm": 0.43,
        "train/rollouts_failed": 0, "train/tokens_per_s": 12340.0, "time/rollout_wait_s": 3.2, "time/step_s": 16.2,
    })  # fmt: skip
    for width in (100, 200):
        out = io.StringIO()
        console = Console(file=out, width=width, color_system=None)
        bar = progress_bar(40, console=console)
        bar.update(bar.add_task("", total=40, completed=3), description=fields)
        console.print(bar.make_tasks_table(bar.tasks))
        lines = out.getvalue().splitlines()
        assert len(lines) == 1 and len(lines[0]) <= width, lines
        assert re.match(r"step\s+3/40 .* \d:\d\d:\d\d [-\d]:[-\d]{2}:[-\d]{2} train/reward_mean=0\.59", lines[0]), lines[0]
    assert lines[0].endswith("…")  # 200 columns do not hold every metric: cut, not wrapped


def test_the_rl_progress_line_shows_the_off_policy_corrections_at_work(tmp_path, capsys) -> None:
    """The importance-ratio mask / clip / reject shares and the staleness, on the plain progress
    line of an RL step where the loss's correction acted (nonzero); never on an SFT step's, and a
    correction that did nothing (0, as every one but its objective's always is) stays off."""
    import jax.numpy as jnp

    from jaxrl.metrics import _OFF_POLICY_KEYS, MetricsLogger
    from jaxrl.orchestrator.batch import build_batch
    from jaxrl.trainer.loss.sums import LossSums
    from jaxrl.trainer.loss.sums import metrics as loss_metrics

    # the names are those an RL step logs: the loss's metrics and the batch's
    zeros = {k: jnp.zeros(()) for k in LossSums.__annotations__}
    step_metrics = {k: float(v) for k, v in loss_metrics(zeros).items()}
    step_metrics |= build_batch([], {}, step=1).metrics
    assert {k.removeprefix("train/") for k in _OFF_POLICY_KEYS} <= set(step_metrics)

    logger = MetricsLogger(tmp_path, 3, progress=True, interval=1)
    logger.log(1, {"ce_loss": 0.5})  # SFT: none of them
    logger.log(2, step_metrics | {"reward_mean": 0.5})  # RL, every correction idle
    acted = {"masked_high_frac": 0.031, "mis_rejected_frac": 0.0025, "policy_lag_max": 1.0}
    logger.log(3, step_metrics | {"reward_mean": 0.5, "tokens_per_s": 1234.0} | acted)
    logger.close()
    clock = r"elapsed \d+:\d\d:\d\d eta \d+:\d\d:\d\d "
    sft, idle, rl = (re.sub(clock, "", x).split(" ", 3)[3] for x in capsys.readouterr().out.splitlines())
    assert sft == "train/ce_loss=0.5"
    assert not any(k in idle for k in _OFF_POLICY_KEYS), idle
    shown = {k: v for k, v in (f.split("=") for f in rl.split()) if k in _OFF_POLICY_KEYS}
    assert shown == {
        "train/masked_high_frac": "0.031", "train/mis_rejected_frac": "0.0025", "train/policy_lag_max": "1",
    }  # fmt: skip
    keys = ("rollouts_failed", "masked_high_frac", "policy_lag_max", "tokens_per_s")
    order = [rl.index(f"train/{k}=") for k in keys]
    assert order == sorted(order), rl  # after the failures, before the timings

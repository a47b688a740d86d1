"""Run output: metrics / rollouts logs."""

from __future__ import annotations

import json

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
    assert lines == [
        f"[jaxrl] step {s}/5 ce_loss={1.0 / s:.4g} grad_norm=0.5 eval/lookup/avg@4=0.25" for s in (2, 4, 5)
    ]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_plot_puts_eval_with_its_standard_error_on_the_train_reward_panel(tmp_path) -> None:
    from jaxrl.metrics import ema, plot_metrics

    assert ema([1.0, 1.0, 1.0]) == [1.0, 1.0, 1.0]  # bias-corrected: no pull towards 0
    rows = [{"step": s, "reward_mean": 0.5 + 0.01 * s, "rl_loss": 0.1} for s in range(1, 11)]
    rows[-1] |= {"eval_reward_mean": 0.6, "eval_reward_se": 0.02}
    out = plot_metrics(rows, ["reward_mean", "rl_loss"], tmp_path / "m.png", "RL")
    assert out is not None and out.stat().st_size > 0

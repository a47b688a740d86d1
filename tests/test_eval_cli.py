"""``python -m jaxrl.eval``: a trained model directory evaluated on the config's eval envs
(real engine, real verifiers env server), results written once; config errors are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w
from test_train_cli import TINY

from jaxrl.eval import main as eval_main
from jaxrl.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ["--inference.max_model_len", "128", "--inference.max_seqs", "8", "--inference.backend.warmup", "false",
          "--inference.backend.prefill_len_buckets", "[64]", "--inference.backend.prefill_batch_buckets", "[8]",
          "--inference.backend.decode_batch_buckets", "[8]"]  # fmt: skip


@pytest.mark.slow
def test_eval_a_trained_model_on_the_eval_split(tmp_path, capsys) -> None:
    sft = tmp_path / "sft.toml"
    sft.write_text(tomli_w.dumps(TINY | {"output_dir": str(tmp_path / "sft"), "trainer": TINY["trainer"] | {"steps": 1}}))
    assert train_main(["--config", str(sft)]) == 0
    evalcfg = tmp_path / "eval.toml"
    evalcfg.write_text(tomli_w.dumps({
        "output_dir": str(tmp_path / "run"),
        "model": {"name": str(tmp_path / "sft" / "hf")},
        "orchestrator": {"batch_size": 4, "group_size": 2, "train": {"env": [{"id": "reverse-text"}],
                                                                     "sampling": {"max_completion_tokens": 8}},
                         "eval": {"interval": 0, "num_tasks": 3, "k": 2, "sampling": {"max_completion_tokens": 8}}},
    }))  # fmt: skip
    cmd = [sys.executable, "-m", "jaxrl.eval", "--config", str(evalcfg), *ENGINE]  # as a user runs it
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/reverse-text/avg@2 = " in proc.stdout
    # Progress between the engine's start and the results (issue 42 item 9).
    assert "[jaxrl] eval: engine ready in " in proc.stdout and "sampling 3 tasks x 2 of the train envs" in proc.stdout
    assert "[jaxrl] eval: 6 rollouts in " in proc.stdout
    out = tmp_path / "run" / "eval"
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == str(tmp_path / "sft" / "hf")
    metrics = results["metrics"]
    assert metrics["eval/reverse-text/failed"] == 0 and 0.0 <= metrics["eval/reverse-text/avg@2"] <= 1.0
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 and {r["fate"] for r in records} == {"eval"}
    capsys.readouterr()
    assert eval_main(["--config", str(evalcfg), *ENGINE]) == 2  # never replaces an earlier eval silently
    assert "already holds an eval" in capsys.readouterr().err


def test_eval_config_errors_are_one_line(tmp_path, capsys) -> None:
    cfg = tmp_path / "x.toml"
    cfg.write_text(tomli_w.dumps({"model": {"name": str(tmp_path)}, "data": {"taskset": "reverse_text"}}))
    assert eval_main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: [orchestrator.eval] is not set") and len(err.splitlines()) == 1, err


def test_eval_does_not_offer_resume_and_refuses_it(tmp_path, capsys) -> None:
    """``--resume`` is a training flag: eval's --help does not list it, and given anyway (even
    with a config that would otherwise run, or as prime-rl's --ckpt.resume) it fails with one line
    naming why, before any work; it is never accepted and ignored. ``--overwrite`` stays offered."""
    with pytest.raises(SystemExit) as e:
        eval_main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--resume" not in out and "--overwrite" in out and "--dry-run" in out
    cfg = tmp_path / "x.toml"
    cfg.write_text(tomli_w.dumps({
        "model": {"name": str(tmp_path)}, "inference": {"max_model_len": 512},
        "orchestrator": {"train": {"env": [{"id": "reverse-text"}]}, "eval": {"interval": 0}},
    }))  # fmt: skip
    assert eval_main(["--config", str(cfg), "--dry-run"]) == 0  # the config itself is fine
    capsys.readouterr()
    for flag in ("--resume", "--ckpt.resume", "--resume=true"):
        assert eval_main(["--config", str(cfg), "--dry-run", flag]) == 2, flag
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --resume: continues a training run") and len(err.splitlines()) == 1, err
        assert "nothing to resume" in err

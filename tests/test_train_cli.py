"""The training entry point refuses what would destroy or mix runs, before any work, and every
error it reports is one line (exit 2 for a config the run cannot start with).

Each test here once failed: a typo in `--model.name` ran the RL recipe's SFT warm start into a
finished SFT run's directory; a rerun without `--resume` truncated metrics.jsonl beside the old
checkpoints; an unknown hub id crashed after config.json was written; a damaged checkpoint's
error embedded a TensorStore dump; `[log.wandb]` without wandb died after the model was built."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from jaxrl.cli import build_config, load_config
from jaxrl.train import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.toml"))
TINY = {
    "model": {"scratch": {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 1,
                          "num_kv_heads": 1, "head_dim": 32, "max_position_embeddings": 128}},
    "data": {"taskset": "reverse_text", "num_examples": 16, "batch_size": 4, "eval_interval": 0},
    "trainer": {"steps": 2, "seq_len": 128, "micro_batch_rows": 4, "mesh": {"num_devices": 1}},
    "ckpt": {"interval": 1},
    "log": {"progress": False, "plot": False},
}  # fmt: skip


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_model_name_typo_never_runs_the_warm_start(tmp_path, monkeypatch, capsys) -> None:
    """The warm start runs only for the model it exports; a typo is one line, exit 2, and the
    finished SFT run in the warm start's output_dir is untouched (with and without --dry-run)."""
    shutil.copytree(ROOT / "configs" / "reverse_text", tmp_path / "configs" / "reverse_text")
    monkeypatch.chdir(tmp_path)
    sft = tmp_path / "outputs" / "reverse_text" / "sft"
    sft.mkdir(parents=True)
    (sft / "metrics.jsonl").write_text('{"step": 200}\n')
    rl = ["--config", "configs/reverse_text/rl.toml", "--output_dir", str(tmp_path / "rl")]
    for extra in (["--dry-run"], []):
        assert main(rl + ["--model.name", "outputs/reverse_text/sft/hff", *extra]) == 2
        err = _error_line(capsys)
        assert "model.name" in err and "outputs/reverse_text/sft/hf)" in err, err
    assert sorted(p.name for p in sft.iterdir()) == ["metrics.jsonl"] and not (tmp_path / "rl").exists()
    cfg, _ = load_config(rl)  # the recipe's own export: the warm start applies
    assert cfg.warmstart_export() == Path("outputs/reverse_text/sft/hf")


def test_rerun_into_a_used_output_dir_needs_resume_or_overwrite(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(tomli_w.dumps({**TINY, "output_dir": str(out)}))
    assert main(["@", str(cfg)]) == 0  # prime-rl's form of --config
    first = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["--config", str(cfg), "--trainer.steps", "3"]) == 2
    err = _error_line(capsys)
    assert "--resume" in err and "--overwrite" in err and str(out) in err
    assert (out / "metrics.jsonl").read_text() == first  # nothing touched
    assert main(["--config", str(cfg), "--resume", "--overwrite"]) == 2 and "pass one" in _error_line(capsys)
    (out / "notes.txt").write_text("mine")  # not a run's: --overwrite leaves it
    assert main(["--config", str(cfg), "--overwrite", "--trainer.steps", "1", "--ckpt.interval", "5"]) == 0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and sorted(p.name for p in (out / "checkpoints").iterdir()) == ["1"]  # no step 2 left
    assert (out / "notes.txt").read_text() == "mine"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "my.toml").write_text("")  # a directory with no run in it is no run to mix with
    from jaxrl.train import claim_output_dir

    claim_output_dir(load_config(["--output_dir", str(fresh)])[0], resume=False, overwrite=False)


def test_a_damaged_checkpoint_is_one_line_with_the_details_in_a_log(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(tomli_w.dumps({**TINY, "output_dir": str(out)}))
    assert main(["--config", str(cfg), "--trainer.steps", "1"]) == 0
    for f in (out / "checkpoints" / "1").rglob("*"):
        if f.is_file() and "meta" not in f.name:
            f.write_bytes(b"\0garbage")
    capsys.readouterr()
    assert main(["--config", str(cfg), "--resume"]) == 1
    err = _error_line(capsys)
    assert "cannot be restored" in err and "resume_error.log" in err and len(err) < 800, err
    assert (out / "logs" / "resume_error.log").stat().st_size > len(err)


def test_an_unknown_hub_id_is_a_config_error_before_anything_is_written(tmp_path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxrl.train", "--model.name", "nobody-jaxrl/no-such-model", "--output_dir", str(out)]
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nobody-jaxrl/no-such-model" in lines[0], proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize(("argv", "needle"), [
    (["--trainer.steps", "-1"], "trainer.steps: Input should be greater than or equal to 1 (got '-1')"),
    (["--trainer.step", "3"], "did you mean --trainer.steps?"),
    (["--max_steps", "3"], "`max_steps` was renamed to `trainer.steps`"),
    (["--orchestrator.rollouts_per_example", "4"], "renamed to `orchestrator.group_size`"),
])  # fmt: skip
def test_cli_errors_are_one_line_naming_the_fix(argv, needle, capsys) -> None:
    assert main([*argv, "--dry-run"]) == 2
    assert needle in _error_line(capsys)


def test_a_toml_typo_gets_a_did_you_mean() -> None:
    with pytest.raises(ValueError, match=r"trainer.stepz: unknown field; did you mean trainer.steps\?"):
        build_config({"trainer": {"stepz": 3}}, [])


@pytest.mark.parametrize(("log", "module", "extra"), [
    ({"wandb": {"project": "p"}}, "wandb", "wandb"),
    ({"tensorboard": True}, "tensorboardX", "tensorboard"),
])  # fmt: skip
def test_optional_loggers_are_checked_at_config_time(log, module, extra, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ValueError, match=f'pip install -e ".\\[{extra}\\]"'):
        build_config({"log": log}, [])


@pytest.mark.parametrize("recipe", RECIPES)
def test_dry_run_prints_toml_that_reloads_to_the_same_config(recipe, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["--config", recipe, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert tomllib.loads(printed)["output_dir"]
    saved = tmp_path / "saved.toml"
    saved.write_text(printed)
    assert main(["--config", str(saved), "--dry-run"]) == 0
    assert capsys.readouterr().out == printed


def test_help_lists_every_field_and_serve_only_its_own(capsys) -> None:
    from jaxrl.serve import main as serve_main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.steps int" in out and "--overwrite" in out and "--orchestrator.max_async_level" in out
    assert "Rollouts per optimizer step" in out and "(default: 64)" in out  # docstring and default
    with pytest.raises(SystemExit):
        serve_main(["--help"])
    out = capsys.readouterr().out
    assert "--inference.server.port" in out and "--model.name" in out and "--trainer.steps" not in out
    assert "--model.scratch" not in out  # serve refuses a scratch model: not offered either
    assert serve_main(["--model.scratch.hidden_size", "32", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --model.scratch.hidden_size: jaxrl.serve serves a model directory or hub id (--model.name), not a scratch model"


def test_the_training_server_takes_a_free_port_and_serve_keeps_8000(tmp_path, capsys) -> None:
    from jaxrl.serve import main as serve_main

    cfg, _ = load_config([])
    assert cfg.inference.server.port == 0  # two runs on one machine never collide
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 64}')
    assert serve_main(["--model.name", str(model), "--dry-run"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["inference"]["server"]["port"] == 8000
    assert serve_main(["--model.name", str(model), "--inference.server.port", "0", "--dry-run"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["inference"]["server"]["port"] == 0


@pytest.mark.parametrize("module", ["jaxrl.sft", "jaxrl.rl"])
def test_library_modules_run_as_scripts_fail_naming_the_entry_point(module: str) -> None:
    """``python -m jaxrl.sft`` once printed nothing and exited 0: a script checking exit codes
    believed training ran. It fails at once (before jax is imported) naming jaxrl.train."""
    cmd = [sys.executable, "-m", module, "--config", "x.toml"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"{module} is a library module; run training with: python -m jaxrl.train --config ")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("recipe", [  # the long-context recipe builds 32k-token tasks: the slow tier
    pytest.param(r, marks=[pytest.mark.slow] if "long" in r else []) for r in RECIPES
    if "rl" in r or "echo" in r or "grpo" in r or "opd" in r or "debate" in r or "maxrl" in r
])  # fmt: skip
def test_every_rl_recipes_envs_load_before_the_run(recipe, monkeypatch) -> None:
    """What a run checks before the engine warms up (module, taskset, every seat's harness)
    holds for every shipped RL recipe's train and eval envs."""
    from jaxrl.orchestrator.orchestrator import check_envs

    monkeypatch.chdir(ROOT)
    cfg, _ = load_config(["--config", recipe])
    if cfg.orchestrator is None:
        pytest.skip("not an RL recipe")
    check_envs(cfg.orchestrator)


@pytest.mark.slow  # two SFT runs: the slow tier
def test_one_bad_sft_row_is_one_line_exit_2_and_the_fixed_rerun_runs(tmp_path, capsys) -> None:
    """It was a 20-line traceback, exit 1, and an output_dir the fixed rerun refused."""
    import json

    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]}
    bad = {"messages": [{"role": "user", "content": "abc"}, {"role": "robot", "content": "cba"}]}
    data.write_text("".join(json.dumps(r) + "\n" for r in (good, good, bad, good)))
    cfg = tmp_path / "sft.toml"
    tiny = TINY | {"data": {"path": str(data), "batch_size": 2, "eval_interval": 0}, "output_dir": str(tmp_path / "out")}
    cfg.write_text(tomli_w.dumps(tiny | {"trainer": TINY["trainer"] | {"steps": 1}}))
    assert main(["--config", str(cfg)]) == 2
    err = _error_line(capsys)
    assert f"data.path: bad row at {data}:3: messages.1.role: " in err and "fix that row" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    data.write_text("".join(json.dumps(r) + "\n" for r in (good, good, good, good)))
    assert main(["--config", str(cfg)]) == 0  # no --overwrite needed: the failed start left nothing


@pytest.mark.slow
def test_ctrl_c_exits_130_with_a_checkpoint_and_resume_finishes(tmp_path) -> None:
    """Ctrl-C (SIGINT) used to exit 0 printing "done: 7 steps"."""
    import signal
    import time

    cfg = tmp_path / "sft.toml"
    cfg.write_text(tomli_w.dumps(TINY | {"output_dir": str(tmp_path / "out"), "trainer": TINY["trainer"] | {"steps": 400},
                                         "ckpt": {"interval": 0}}))  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "jaxrl.train", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step in 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    line = next(x for x in err.splitlines() if "interrupted at step" in x)
    step = int(line.split("interrupted at step ")[1].split()[0])
    assert 2 <= step < 400 and line.endswith("rerun with --resume"), line
    assert (tmp_path / "out" / "checkpoints" / str(step)).is_dir()
    cfg.write_text(cfg.read_text().replace("steps = 400", f"steps = {step + 1}"))
    assert main(["--config", str(cfg), "--resume"]) == 0

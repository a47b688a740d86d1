"""A prime-rl user's habits on jaxrl's command line and in its TOML: kebab-case flags, bare
boolean flags, `--ckpt.resume`, hub-style env ids, `[monitors.wandb]` and prime-rl's train
`source` entries. Each was refused with an error that did not say what to write instead."""

from __future__ import annotations

import pytest

from jaxrl.cli import build_config, load_config, parse_args, prime_rl_flags

RL = ["--config", "configs/reverse_text/rl.toml", "--model.name", "Qwen/Qwen3-0.6B"]


def test_kebab_case_flags_are_the_same_fields(monkeypatch) -> None:
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    cfg, flags = load_config([*RL, "--inference.max-model-len", "96", "--output-dir", "outputs/x", "--dry-run"])
    assert cfg.inference.max_model_len == 96 and cfg.output_dir == "outputs/x" and flags.dry_run
    cfg, _ = load_config([*RL, "--trainer.optim.lr=3e-4"])  # `=` form; values are never rewritten
    assert cfg.trainer.optim.lr == 3e-4
    assert prime_rl_flags(["--model.name", "my-org/my-model"]) == ["--model.name", "my-org/my-model"]


def test_bare_boolean_flags_mean_true_and_ckpt_resume_is_resume() -> None:
    assert prime_rl_flags(["--log.tensorboard", "--log.plot", "false", "--ckpt.async-save"]) == [
        "--log.tensorboard", "true", "--log.plot", "false", "--ckpt.async_save", "true"]  # fmt: skip
    cfg = build_config({}, prime_rl_flags(["--log.rollout-episodes", "--trainer.steps", "3"]))
    assert cfg.log.rollout_episodes is True and cfg.trainer.steps == 3
    flags, rest = parse_args(["--ckpt.resume", "--trainer.steps", "3"])
    assert flags.resume and rest == ["--trainer.steps", "3"]
    with pytest.raises(ValueError, match=r"--trainer\.steps"):  # a bare non-boolean stays an error
        build_config({}, prime_rl_flags(["--trainer.steps"]))


def test_monitors_wandb_names_log_wandb_in_toml_and_on_the_cli() -> None:
    with pytest.raises(ValueError, match=r"`monitors` was renamed to `\[log.wandb\]"):
        build_config({"monitors": {"wandb": {"project": "p"}}}, [])
    with pytest.raises(ValueError, match=r"--monitors.wandb.project: .*`\[log.wandb\]"):
        build_config({}, ["--monitors.wandb.project", "p"])


def test_train_source_entries_point_at_env_entries_and_their_fields() -> None:
    with pytest.raises(ValueError) as e:
        build_config({"orchestrator": {"train": {"source": [{"id": "reverse_text"}]}}}, [])
    assert "`orchestrator.train.source` was renamed to `[[orchestrator.train.env]]` (one entry per env: `id`" in str(e.value)


def test_hub_style_env_ids_name_the_built_ins() -> None:
    from jaxrl.envs import check_env_id, plugin_id

    assert plugin_id("reverse-text") == plugin_id("reverse_text") == ("jaxrl_reverse_text", "jaxrl.envs.reverse_text")
    check_env_id("alphabet-sort")
    with pytest.raises(ValueError, match="unknown env id 'reverse-txt'"):
        check_env_id("reverse-txt")

"""Config: every recipe validates (--dry-run), overrides win, bad input names the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxrl.cli import build_config, load_config
from jaxrl.train import main

ROOT = Path(__file__).resolve().parents[1]  # every recipe's --dry-run: tests/test_train_cli.py


def test_cli_overrides_beat_toml(tmp_path) -> None:
    cfg_file = tmp_path / "x.toml"
    cfg_file.write_text('output_dir = "a"\n[trainer]\nsteps = 7\n[trainer.optim]\nlr = 0.1\n')
    cfg, flags = load_config(["--config", str(cfg_file), "--trainer.optim.lr", "1e-5", "--output_dir", "b"])
    assert (cfg.trainer.steps, cfg.trainer.optim.lr, cfg.output_dir) == (7, 1e-5, "b")
    assert not flags.dry_run and cfg.mode == "sft"


@pytest.mark.parametrize(
    "toml, overrides, needle",
    [
        ("[trainer]\nstepz = 3\n", [], "trainer.stepz"),
        ("[trainer]\nsteps = -1\n", [], "trainer.steps"),
        ("", ["--trainer.optim.lrr", "1"], "--trainer.optim.lrr"),
        ('[trainer.loss]\ncustom = "no_such_pkg.fn"\n', [], "loss.custom"),
        ('[model]\nname = "x"\n[model.scratch]\n', [], "model"),
        ("[trainer.mesh]\ndata = -1\nfsdp = -1\n", [], None),
    ],
)
def test_bad_fields_fail_before_work_naming_the_field(toml, overrides, needle, tmp_path) -> None:
    from jaxrl.config import read_toml

    f = tmp_path / "bad.toml"
    f.write_text(toml)
    if needle is None:  # a mesh error surfaces when the mesh is built; checked here directly
        cfg = build_config(read_toml(f), overrides)
        with pytest.raises(ValueError, match="at most one"):
            cfg.trainer.mesh.resolve(8)
        return
    with pytest.raises(ValueError) as e:
        build_config(read_toml(f), overrides)
    assert needle in str(e.value)


def test_main_reports_bad_config_with_exit_2(tmp_path, capsys) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[trainer]\nsteps = 'many'\n")
    assert main(["--config", str(f)]) == 2
    assert "trainer.steps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, value",
    [
        ("train.sampling.top_k", "2147483648"),  # once passed and killed the engine thread mid-run
        ("train.sampling.top_k", "-2"),
        ("train.sampling.temperature", "nan"),
        ("train.sampling.temperature", "inf"),
        ("train.sampling.top_p", "1e-46"),  # rounds to 0 in float32
        ("train.sampling.max_completion_tokens", "0"),
        ("train.sampling.max_completion_tokens", "256"),  # no room for a prompt in max_model_len 256
        ("eval.sampling.top_k", "2147483648"),
        ("eval.sampling.temperature", "-1"),
    ],
)
def test_rl_sampling_values_are_range_checked(override, value, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError) as e:
        load_config(["--config", "configs/reverse_text/rl.toml", f"--orchestrator.{override}", value])
    assert override.rsplit(".", 1)[-1] in str(e.value)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["--orchestrator.train.sampling.temperature", "0"], "orchestrator.train.sampling.temperature = 0 "),
        # 0 < T < 1e-5: the engine samples greedily (log-probs at T = 1) while the trainer would
        # rescore at T, so it is refused like 0, by the same threshold.
        (["--orchestrator.train.sampling.temperature", "5e-6"], "orchestrator.train.sampling.temperature = 5e-06 "),
        (['--orchestrator.train.env=[{"id": "reverse_text", "sampling": {"temperature": 0}}]'],
         "orchestrator.train.env[0].sampling.temperature = 0 "),
    ],
)  # fmt: skip
def test_a_split_that_trains_refuses_greedy_temperatures_in_one_line(overrides, field, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    with pytest.raises(ValueError) as e:
        load_config(["--config", "configs/reverse_text/rl.toml", *overrides])
    msg = str(e.value)
    assert field in msg and "greedy tokens have no log-prob to train on" in msg and "\n" not in msg


def test_eval_splits_may_sample_greedily_and_the_threshold_is_shared(monkeypatch) -> None:
    import numpy as np

    from jaxrl.engine.token_sampling import SamplingParams
    from jaxrl.sampling_contract import GREEDY_BELOW, is_greedy
    from jaxrl.training_sample import TrainingSample

    monkeypatch.chdir(ROOT)
    cfg, _ = load_config(["--config", "configs/reverse_text/rl.toml", "--orchestrator.eval.sampling.temperature", "0"])
    assert cfg.orchestrator.eval.sampling.temperature == 0 and cfg.orchestrator.train.sampling.temperature >= GREEDY_BELOW
    for t in (0.0, GREEDY_BELOW / 2, GREEDY_BELOW, 0.7):
        assert SamplingParams(temperature=t).greedy == is_greedy(t) == (t < GREEDY_BELOW)
    ones = np.ones(3)
    assert TrainingSample([1, 2, 3], ones, ones, ones, ones, temperature=GREEDY_BELOW).temperature == GREEDY_BELOW
    with pytest.raises(ValueError, match=r"TrainingSample.temperature = 5e-06 samples greedily"):
        TrainingSample([1, 2, 3], ones, ones, ones, ones, temperature=GREEDY_BELOW / 2)


PRIME_RL_TOML = """
max_steps = 20
[model]
name = "x"
[orchestrator]
batch_size = 16
rollouts_per_example = 4
[orchestrator.sampling]
max_tokens = 12
[[orchestrator.env]]
id = "reverse_text"
num_workers = 2
[orchestrator.eval]
num_examples = 10
[[orchestrator.eval.source]]
id = "reverse_text"
"""


def test_prime_rl_keys_fail_naming_their_jaxrl_names() -> None:
    import tomllib

    with pytest.raises(ValueError) as e:
        build_config(tomllib.loads(PRIME_RL_TOML), [])
    message = str(e.value)
    for needle in (
        "`max_steps` was renamed to `trainer.steps`",
        "`orchestrator.sampling` was renamed to `[orchestrator.train.sampling]`",
        "`orchestrator.sampling.max_tokens` was renamed to `max_completion_tokens`",
        "`orchestrator.env` was renamed to `[[orchestrator.train.env]]`",
        "`orchestrator.env[0].num_workers` was renamed to `pool_size`",
        "`orchestrator.rollouts_per_example` was renamed to `orchestrator.group_size`",
        "`orchestrator.eval.num_examples` was renamed to `orchestrator.eval.num_tasks`",
        "`orchestrator.eval.source` was renamed to `[[orchestrator.eval.env]]`",
    ):
        assert needle in message
    assert "extra inputs" not in message.lower()


def test_prime_rl_keys_fail_in_each_model_too() -> None:
    import pydantic

    from jaxrl.orchestrator.config import EnvConfig, SamplingConfig

    with pytest.raises(pydantic.ValidationError, match="`num_workers` was renamed to `pool_size`"):
        EnvConfig(id="reverse_text", num_workers=2)
    with pytest.raises(pydantic.ValidationError, match="`max_tokens` was renamed to `max_completion_tokens`"):
        SamplingConfig(max_tokens=3)


def test_per_env_sampling_inherits_unset_fields_and_ratio_is_checked() -> None:
    import pydantic

    from jaxrl.orchestrator.config import TrainSplitConfig

    split = TrainSplitConfig(
        sampling={"temperature": 0.9, "max_completion_tokens": 50, "top_p": 0.8},
        env=[{"id": "reverse_text", "sampling": {"temperature": 0.3}}],
    )
    resolved = split.sampling_for(split.env[0])
    assert (resolved.temperature, resolved.max_completion_tokens, resolved.top_p) == (0.3, 50, 0.8)
    for bad, needle in (({"ratio": 0}, "ratio"), ({"ratio": float("nan")}, "ratio"),
                        ({"sampling": {"max_completion_tokens": 0}}, "max_completion_tokens"),
                        ({"sampling": {"max_tokens": 5}}, "renamed to `max_completion_tokens`")):
        with pytest.raises(pydantic.ValidationError, match=needle):
            TrainSplitConfig(env=[{"id": "reverse_text", **bad}])


def test_max_model_len_defaults_to_the_models_context(tmp_path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    cfg, _ = load_config(["--model.name", str(model)])
    assert cfg.inference.max_model_len == 512  # the README's serve command on a 512-token model
    cfg, _ = load_config(["--model.name", str(model), "--inference.max_model_len", "128"])
    assert cfg.inference.max_model_len == 128
    cfg, _ = load_config([])  # scratch model
    assert cfg.inference.max_model_len == cfg.model.scratch.max_position_embeddings


def test_help_names_the_flags_and_configs_merge_left_to_right(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "python -m jaxrl.train" in out and all(f in out for f in ("--config", "--dry-run", "--resume"))
    base, over = tmp_path / "base.toml", tmp_path / "over.toml"
    base.write_text('output_dir = "a"\n[trainer]\nsteps = 7\n[trainer.optim]\nlr = 0.1\n')
    over.write_text("[trainer.optim]\nlr = 0.2\n")
    cfg, _ = load_config(["--config", str(base), "--config", str(over), "--trainer.steps", "9"])
    assert (cfg.output_dir, cfg.trainer.steps, cfg.trainer.optim.lr) == ("a", 9, 0.2)


@pytest.mark.parametrize(("over", "needle"), [
    ({"elastic": True}, "set pool_size >= 2"),
    ({"elastic": True, "pool_size": 2, "address": "tcp://127.0.0.1:5555"}, "not one at `address`"),
    ({"pool_size": 2, "worker_capacity": 0}, "worker_capacity"),
])  # fmt: skip
def test_elastic_env_pool_is_checked(over, needle) -> None:
    import pydantic

    from jaxrl.orchestrator.config import EnvConfig

    with pytest.raises(pydantic.ValidationError, match=needle):
        EnvConfig(id="reverse_text", **over)
    assert EnvConfig(id="reverse_text", pool_size=4, elastic=True).worker_capacity == 128


def test_a_backend_chosen_on_the_command_line_replaces_the_files() -> None:
    """`jaxrl.serve --config rl.toml --inference.backend embedded` (GKE's rollout pods) serves a
    recipe whose trainer reads from external servers: the file's external settings are dropped
    because the command line chose another backend; without that choice they stay refused."""
    toml = {"inference": {"external": {"request_timeout_s": 60}}}
    cfg = build_config(toml, ["--inference.backend", "embedded"])
    assert cfg.inference.backend.type == "embedded"
    external = build_config(toml, ["--inference.backend", "external", "--inference.base_url", "http://127.0.0.1:8000"])
    assert external.inference.backend.request_timeout_s == 60
    with pytest.raises(ValueError, match='settings of the "external" backend, but the backend is "embedded"'):
        build_config(toml, [])
    old_shape = {"inference": {"backend": "external", "base_url": "http://127.0.0.1:8000", "external": {"request_timeout_s": 60}}}
    assert build_config(old_shape, ["--inference.backend", "embedded"]).inference.backend.type == "embedded"


def test_the_embedded_engines_settings_live_under_its_backend_and_the_old_spelling_reads(tmp_path, capsys) -> None:
    """`[inference] decode_steps = 8` (and its flag) reads as `[inference.backend] decode_steps = 8`,
    saying so in one line on stderr; under the vllm or external backend it is refused naming the
    field (never accepted and ignored); the shared sizes stay in [inference]."""
    new = build_config({"inference": {"max_seqs": 8, "backend": {"type": "embedded", "decode_steps": 8}}}, [])
    capsys.readouterr()
    old = build_config({"inference": {"max_seqs": 8, "decode_steps": 8}}, [])
    assert old.inference == new.inference and new.inference.backend.decode_steps == 8
    assert capsys.readouterr().err == (
        "[jaxrl] config: inference.decode_steps is now inference.backend.decode_steps (read as that)\n"
    )
    f = tmp_path / "x.toml"
    f.write_text("[inference.backend]\ntype = \"embedded\"\ndecode_steps = 2\n")
    cfg, _ = load_config(["--config", str(f), "--inference.decode-steps", "8", "--inference.tensor-parallel=1"])
    assert cfg.inference.backend.decode_steps == 8  # the command line wins, in either spelling
    assert "--inference.decode_steps is now --inference.backend.decode_steps" in capsys.readouterr().err
    assert build_config({}, ["--inference.backend.warmup", "false"]).inference.backend.warmup is False
    engine = cfg.inference.engine_config()  # what the embedded engine is built with: both parts
    assert (engine.decode_steps, engine.max_seqs) == (8, cfg.inference.max_seqs)
    external = {"backend": "external", "base_url": "http://127.0.0.1:8000"}
    for toml, args, field in [
        ({"inference": {"backend": "vllm", "decode_steps": 8}}, [], "inference.decode_steps"),
        ({"inference": {"backend": {"type": "vllm", "kernels": "reference"}}}, [], "inference.backend.kernels"),
        ({"inference": external}, ["--inference.tensor_parallel", "2"], "inference.backend.tensor_parallel"),
        ({"inference": external}, ["--inference.backend.warmup", "false"], "inference.backend.warmup"),
    ]:
        with pytest.raises(ValueError, match=f'{field}: a setting of the embedded engine; the backend is "'):
            build_config(toml, args)
    with pytest.raises(ValueError, match="inference.decode_steps and inference.backend.decode_steps are both set"):
        build_config({"inference": {"decode_steps": 4, "backend": {"decode_steps": 8}}}, [])


def test_a_recipes_engine_settings_serve_its_rollout_servers_and_leave_its_trainer() -> None:
    """One recipe for GKE's trainer (`--inference.backend external`) and its `jaxrl.serve` rollout
    servers (`--inference.backend embedded`): the servers read its engine settings, in either
    spelling; the trainer's external backend drops them with the file's backend."""
    for inference in ({"tensor_parallel": 2, "prefill_len_buckets": [64]},
                      {"backend": {"type": "embedded", "tensor_parallel": 2, "prefill_len_buckets": [64]}}):  # fmt: skip
        serve = build_config({"inference": inference}, ["--inference.backend", "embedded"])
        assert (serve.inference.backend.tensor_parallel, serve.inference.backend.prefill_len_buckets) == (2, [64])
        trainer = build_config({"inference": inference}, ["--inference.backend", "external", "--inference.base_url",
                                                          "http://127.0.0.1:8000"])  # fmt: skip
        assert trainer.inference.backend.type == "external"


def test_checks_the_run_made_at_start_fail_at_load(capsys) -> None:
    """Routing replay with the vllm backend fails while the config loads (`--dry-run` catches it),
    with the message the run used to give after building the trainer."""
    args = ["--config", str(ROOT / "configs/reverse_text/rl.toml"), "--trainer.moe_routing", "replay",
            "--inference.backend", "vllm", "--dry-run"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert ('trainer.moe_routing = "replay" needs routing from the rollout backend; the vllm backend does not '
            'return it: use inference.backend.type = "embedded" (or "external" jaxrl servers) or moe_routing = '
            '"recompute"') in err  # fmt: skip

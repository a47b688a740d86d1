"""SFT end to end on CPU: the loss falls, artifacts are written, the export loads in
transformers, and a resumed run reproduces the uninterrupted one step for step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import transformers

from jaxrl.cli import build_config
from jaxrl.metrics import NAMESPACES, read_metrics
from jaxrl.sft import run_sft

TINY = {
    "model": {"scratch": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2,
                          "num_kv_heads": 1, "head_dim": 32, "max_position_embeddings": 256}},
    "data": {"taskset": "reverse_text", "num_examples": 256, "batch_size": 16, "eval_examples": 16},
    "trainer": {"seq_len": 256, "micro_batch_rows": 8, "optim": {"lr": 3e-3, "warmup_steps": 3},
                "mesh": {"num_devices": 1}},
    "log": {"progress": False},
}


def tiny_cfg(out, **over):
    from jaxrl.cli import deep_merge

    return build_config(deep_merge(TINY, {"output_dir": str(out), **over}), [])


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> tuple[Path, dict]:
    """One 40-step SFT run, read by the two tests below."""
    tmp_path = tmp_path_factory.mktemp("sft")
    cfg = tiny_cfg(tmp_path / "run", trainer={"steps": 40}, data={"eval_interval": 25})
    return tmp_path, run_sft(cfg)


@pytest.mark.slow
def test_sft_loss_falls_and_exports_a_transformers_model(sft_run) -> None:
    tmp_path, result = sft_run
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(r["time/train_s"] > 0 and "step_time_s" not in r for r in rows)  # one name, one meaning
    assert all(k == "step" or k.split("/", 1)[0] in NAMESPACES for r in rows for k in r)  # one naming scheme
    first, last = np.mean([r["train/ce_loss"] for r in rows[:3]]), np.mean([r["train/ce_loss"] for r in rows[-3:]])
    assert last < 0.5 * first, (first, last)
    # Held-out eval at every eval_interval steps and the last: the same 16 eval-split conversations each time.
    evals = {r["step"]: r for r in rows if "eval/ce_loss" in r}
    assert sorted(evals) == [25, 40]
    assert evals[25]["eval/ce_tokens"] == evals[40]["eval/ce_tokens"] > 16
    assert 0 < evals[40]["eval/ce_loss"] < 0.5 * first, (first, evals)
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0
    assert result["export"] == str(tmp_path / "run" / "hf")
    assert transformers.AutoConfig.from_pretrained(result["export"]).num_hidden_layers > 0
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 40


@pytest.mark.slow
def test_the_sft_export_runs_in_transformers(sft_run) -> None:
    torch = pytest.importorskip("torch")
    _, result = sft_run
    hf = transformers.AutoModelForCausalLM.from_pretrained(result["export"]).eval()
    tok = transformers.AutoTokenizer.from_pretrained(result["export"])
    ids = tok.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(hf(torch.tensor([ids])).logits).all()


def test_resume_reproduces_uninterrupted_run(tmp_path) -> None:
    """On an fsdp 2 mesh: orbax restores sharded params, optimizer state and data position."""
    mesh = {"data": 1, "fsdp": 2, "num_devices": 2}
    optim = {"schedule": "constant", "warmup_steps": 0}
    # No held-out eval and no plot: neither is under test here (each is a compile / a render per run).
    data = {"taskset": "reverse_text", "num_examples": 64, "batch_size": 8, "eval_interval": 0}
    log = {"progress": False, "plot": False}
    over = {"trainer": {"steps": 4, "seq_len": 128, "optim": optim, "mesh": mesh}, "ckpt": {"interval": 2}, "data": data, "log": log}
    run_sft(tiny_cfg(tmp_path / "full", **over))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    # What a hard kill after step 3 leaves: the uninterrupted run's files up to its step-2
    # checkpoint, step 3's metrics line and half of step 4's (a run of its own to step 2 would
    # write the same files: its steps are the same computation).
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full" / "checkpoints", part / "checkpoints", ignore=shutil.ignore_patterns("4"))
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == ["2"]
    lines = (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()[:2]
    (part / "metrics.jsonl").write_text("\n".join(lines) + "\n" + json.dumps({"step": 3, "ce_loss": 0.0}) + '\n{"step": 4, "ce_lo')
    run_sft(tiny_cfg(tmp_path / "part", **over), resume=True)
    part = read_metrics(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in part] == list(range(1, 5))
    for a, b in zip(full, part):
        assert a["train/ce_loss"] == pytest.approx(b["train/ce_loss"], rel=1e-6, abs=1e-6), a["step"]
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5), a["step"]


def test_heldout_conversations_are_never_trained_on() -> None:
    from jaxrl.data.sft import reference_conversations

    train = reference_conversations("reverse_text", {}, 256, 0)
    held_out = reference_conversations("reverse_text", {}, 64, 0, split="eval")
    train_prompts = {json.dumps(messages[:-1]) for messages, _ in train}
    held_out_prompts = {json.dumps(messages[:-1]) for messages, _ in held_out}
    assert len(held_out_prompts) == 64 and not train_prompts & held_out_prompts


def test_wandb_run_id_is_checkpointed_and_resumed(tmp_path, monkeypatch) -> None:
    """[log.wandb] (offline, a real wandb run): the checkpoint holds the run id and --resume continues it."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data = {"num_examples": 32, "batch_size": 4, "eval_interval": 0}
    log = {"progress": False, "plot": False, "wandb": {"project": "jaxrl-test", "mode": "offline"}}
    over = {"ckpt": {"interval": 1}, "data": data, "log": log}
    run_sft(tiny_cfg(tmp_path / "run", trainer={"steps": 1}, **over))
    run_sft(tiny_cfg(tmp_path / "run", trainer={"steps": 2}, **over), resume=True)
    ids = {p.name.rsplit("-", 1)[1] for p in (tmp_path / "run" / "wandb").glob("offline-run-*")}
    dirs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and len(ids) == 1, dirs


@pytest.mark.slow
def test_resume_refuses_another_lora_config(tmp_path) -> None:
    """A LoRA checkpoint resumed as full fine-tuning (or with another rank) fails before any
    restore, naming ``[trainer.lora]`` both ways; the same LoRA config resumes."""
    from jaxrl.preemption import RunAborted

    over = {"trainer": {"steps": 2, "lora": {"rank": 2, "alpha": 4}}, "ckpt": {"interval": 1},
            "data": {"taskset": "reverse_text", "num_examples": 32, "batch_size": 4}}  # fmt: skip
    run_sft(tiny_cfg(tmp_path / "run", **over))
    with pytest.raises(RunAborted, match=r"trained with \[trainer.lora\] = .*'rank': 2.*this config has off"):
        run_sft(tiny_cfg(tmp_path / "run", **{**over, "trainer": {"steps": 3}}), resume=True)
    with pytest.raises(RunAborted, match=r"'rank': 2.*'rank': 4"):
        run_sft(tiny_cfg(tmp_path / "run", **{**over, "trainer": {"steps": 3, "lora": {"rank": 4, "alpha": 4}}}), resume=True)
    result = run_sft(tiny_cfg(tmp_path / "run", **{**over, "trainer": {"steps": 3, "lora": {"rank": 2, "alpha": 4}}}), resume=True)
    assert result["steps"] == 3

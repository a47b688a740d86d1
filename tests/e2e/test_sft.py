"""SFT end to end on CPU: the loss falls, artifacts are written, the export loads in
transformers, and a resumed run reproduces the uninterrupted one step for step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from jaxrl.config import build_config
from jaxrl.metrics import read_metrics
from jaxrl.sft import run_sft

TINY = {
    "model": {"scratch": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 2,
                          "num_kv_heads": 1, "head_dim": 32, "max_position_embeddings": 256}},
    "data": {"taskset": "reverse_text", "num_examples": 256, "batch_size": 16},
    "trainer": {"seq_len": 256, "micro_batch_rows": 8, "optim": {"lr": 3e-3, "warmup_steps": 3},
                "mesh": {"num_devices": 1}},
    "log": {"progress": False},
}


def tiny_cfg(out, **over):
    from jaxrl.config import deep_merge

    return build_config(deep_merge(TINY, {"output_dir": str(out), **over}), [])


def test_sft_loss_falls_and_exports_a_transformers_model(tmp_path) -> None:
    cfg = tiny_cfg(tmp_path / "run", trainer={"steps": 40})
    result = run_sft(cfg)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 41))
    first, last = np.mean([r["ce_loss"] for r in rows[:3]]), np.mean([r["ce_loss"] for r in rows[-3:]])
    assert last < 0.5 * first, (first, last)
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0
    export = tmp_path / "run" / "hf"
    assert result["export"] == str(export)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    tok = transformers.AutoTokenizer.from_pretrained(export)
    ids = tok.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(hf(torch.tensor([ids])).logits).all()
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 40


def test_resume_reproduces_uninterrupted_run(tmp_path) -> None:
    """On a (2, 2, 2) mesh: orbax restores sharded params, optimizer state and data position."""
    mesh = {"data": 2, "fsdp": 2, "tensor": 2, "num_devices": 8}
    optim = {"schedule": "constant", "warmup_steps": 0}
    data = {"taskset": "reverse_text", "num_examples": 64, "batch_size": 8}
    over = {"trainer": {"steps": 4, "optim": optim, "mesh": mesh}, "ckpt": {"interval": 2}, "data": data}
    run_sft(tiny_cfg(tmp_path / "full", **over))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    half = {"trainer": {"steps": 2, "optim": optim, "mesh": mesh}, "ckpt": {"interval": 2}, "data": data}
    run_sft(tiny_cfg(tmp_path / "part", **half))
    with (tmp_path / "part" / "metrics.jsonl").open("a") as f:  # what a hard kill after step 3 leaves
        f.write(json.dumps({"step": 3, "ce_loss": 0.0}) + '\n{"step": 4, "ce_lo')
    run_sft(tiny_cfg(tmp_path / "part", **over), resume=True)
    part = read_metrics(tmp_path / "part" / "metrics.jsonl")
    assert [r["step"] for r in part] == list(range(1, 5))
    for a, b in zip(full, part):
        assert a["ce_loss"] == pytest.approx(b["ce_loss"], rel=1e-6, abs=1e-6), a["step"]
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), a["step"]

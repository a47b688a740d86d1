"""RL on a multi-host trainer with no rollout servers of its own: the embedded engine colocated
over both processes (``jaxrl.rollout.colocated``), every part real: ``python -m jaxrl.train`` as
2 processes x 4 CPU devices (one (fsdp=4, tensor=2) trainer mesh and one (data=4, tensor=2)
engine mesh, each spanning both), a verifiers env server (reverse_text) spawned by process 0.

1. The same 3 GRPO steps as 1 process x 8 devices (the engine there on 2 of them): the same
   rollouts (every rollout samples with a seed fixed by run seed, task draw and sample, and
   ``max_async_level = 0`` samples step s from step s - 1's weights) and the same training
   metrics; each step once in metrics.jsonl, process 1 logs none; weights swap in place (no
   weight files anywhere).
2. ``--resume`` to step 4 in the 2-process layout: the resumed weights are placed on the
   colocated engine before it serves, and the step continues the run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
from external_servers import (
    ROLLOUT_KEYS,
    SIZES,
    TRAIN_KEYS,
    free_port,
    launch,
    run_to_end,
    tiny_grpo,
    train_cmd,
)
from families import build_family_model

from jaxrl.metrics import read_metrics

pytestmark = pytest.mark.slow
MESH = {"data": 1, "fsdp": 4, "tensor": 2}


def colocated_toml(path: Path, model_dir: Path, out: Path, *, steps: int) -> Path:
    run = tiny_grpo(steps, MESH)
    cfg = {
        "output_dir": str(out),
        "seed": 0,
        "model": {"name": str(model_dir)},
        "trainer": run["trainer"],
        "inference": {**SIZES, "server": {"port": 0},
                      "backend": {"type": "embedded", "tensor_parallel": 2, "prefill_len_buckets": [128, 256],
                                  "prefill_batch_buckets": [4], "decode_batch_buckets": [8],
                                  "colocated_timeout_s": 120}},
        "orchestrator": run["orchestrator"],
        "ckpt": {"interval": 1},
        "log": {"progress": False, "plot": False},
    }  # fmt: skip
    path.write_text(tomli_w.dumps(cfg))
    return path


def two_processes(config: Path, tmp_path: Path, tag: str, *more: str) -> None:
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"{tag}{i}.log" for i in range(2)]
    dist = ("--distributed.enabled", "true", "--distributed.coordinator_address", coordinator,
            "--distributed.num_processes", "2")  # fmt: skip
    procs = [launch(train_cmd(config, *more, *dist, "--distributed.process_id", str(i)), 4, logs[i]) for i in range(2)]
    run_to_end(procs, logs)


def test_colocated_two_processes_match_one_and_resume(tmp_path: Path) -> None:
    model_dir = build_family_model(tmp_path / "model", "qwen3")
    ref, multi = tmp_path / "ref", tmp_path / "multi"
    config = colocated_toml(tmp_path / "ref.toml", model_dir, ref, steps=3)
    run_to_end([launch(train_cmd(config), 8, tmp_path / "ref.log")], [tmp_path / "ref.log"])
    two_processes(colocated_toml(tmp_path / "multi.toml", model_dir, multi, steps=3), tmp_path, "p")

    want, got = read_metrics(ref / "metrics.jsonl"), read_metrics(multi / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3] and [r["train/policy_version"] for r in got] == [1.0, 2.0, 3.0]
    for a, b in zip(want, got, strict=True):
        for key in ROLLOUT_KEYS:
            assert b[key] == a[key], (a["step"], key)
        for key in TRAIN_KEYS:  # reduction order across processes: see test_rl_external
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (a["step"], key)
    assert (tmp_path / "p1.log").read_text().count("[jaxrl] step") == 0
    assert not list(multi.rglob("rollout_weights")) and json.loads((multi / "result.json").read_text())["steps"] == 3

    # Preempted after step 3 (the run ended there; its checkpoint is step 3's): resume to step 4.
    two_processes(colocated_toml(tmp_path / "multi.toml", model_dir, multi, steps=4), tmp_path, "r", "--resume")
    rows = read_metrics(multi / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["train/policy_version"] == 4.0
    assert rows[-1]["train/rollouts_failed"] == 0

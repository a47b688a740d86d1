"""Echo end to end on the lookup tool env: real env server, real engine over HTTP, trainer.

A tiny SFT warm start learns to call the tool; then (1) echo puts CE weight exactly on the
content of `lookup` tool outputs (nothing else: no scaffold, no prompt, no model tokens),
and (2) an echo RL run lowers the NLL of those tokens, while plain GRPO trains none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxrl.config import build_config, deep_merge
from jaxrl.envs.lookup import lookup
from jaxrl.metrics import read_metrics
from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.orchestrator import Orchestrator
from jaxrl.rl import run_rl, start_engine
from jaxrl.run_common import TrainingRun
from jaxrl.sft import run_sft

SCRATCH = {"hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
           "head_dim": 32, "max_position_embeddings": 1024}
ENV = {"id": "lookup", "args": {"max_keys": 1, "max_len": 4}}


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lookup_sft")
    cfg = build_config({
        "output_dir": str(out),
        "model": {"scratch": SCRATCH},
        "data": {"taskset": "lookup", "taskset_args": ENV["args"], "num_examples": 256, "batch_size": 8},
        "trainer": {"steps": 40, "seq_len": 1024, "seq_len_buckets": [1024], "micro_batch_rows": 8,
                    "mesh": {"num_devices": 1}, "optim": {"lr": 5e-3, "warmup_steps": 5}},
        "log": {"progress": False},
    }, [])
    return Path(run_sft(cfg)["export"])


def rl_config(model: Path, out: Path, algo: dict, steps: int = 5) -> dict:
    return {
        "output_dir": str(out),
        "model": {"name": str(model)},
        "trainer": {"steps": steps, "seq_len": 1024, "seq_len_buckets": [1024], "micro_batch_rows": 8,
                    "mesh": {"num_devices": 1}, "optim": {"lr": 1e-3, "schedule": "constant", "weight_decay": 0.0}},
        "inference": {"max_model_len": 1024, "max_seqs": 16, "prefill_len_buckets": [64, 512],
                      "prefill_batch_buckets": [4], "decode_len_buckets": [1024]},
        "orchestrator": {
            "batch_size": 16, "group_size": 4,
            "train": {"sampling": {"max_completion_tokens": 40, "temperature": 1.0},
                      "env": [deep_merge(ENV, {"algo": algo})]},
        },
        "log": {"progress": False},
    }


ECHO = {"type": "echo", "roles": {"tool": {"alpha": 0.1, "tool_names": ["lookup"]}}}


def test_echo_weights_exactly_the_tool_output_bodies(warm_start, tmp_path) -> None:
    cfg = build_config(rl_config(warm_start, tmp_path / "run", ECHO), [])
    run = TrainingRun(cfg, plot_keys=())
    engine, server, endpoint = start_engine(run)
    orch = Orchestrator(cfg.orchestrator, endpoint, output_dir=run.out, seed=0, policy_version=lambda: engine.policy_version)
    try:
        orch.start()
        batch = build_batch(orch.next_batch(1), orch.algorithms, 1)
    finally:
        orch.close()
        server.stop()
        engine.stop()
    tok = AutoTokenizer.from_pretrained(warm_start)
    for record in batch.records:
        assert record["fate"] != "failed", record["error"]
    tool_nodes = [
        node["message"]["content"]
        for record in batch.records
        for trace in record["episode"]["traces"]
        for node in trace["nodes"]
        if node["message"]["role"] == "tool"
    ]
    assert len(tool_nodes) >= 4, "the warm start should call the tool in most rollouts"
    echoed = []
    for sample in batch.samples:
        ids, ce = sample.token_ids, sample.ce_w
        assert set(np.unique(ce)) <= {0.0, np.float32(0.1)}
        assert not (ce.astype(bool) & sample.sampled_mask).any(), "echo weight on a model token"
        assert (sample.rl_w[ce > 0] == 0).all()
        # Every maximal run of echo tokens is one tool output body, right after its scaffold.
        runs = np.split(np.arange(len(ids)), np.where(np.diff(ce > 0))[0] + 1)
        for r in (r for r in runs if ce[r[0]] > 0):
            assert tok.decode(ids[max(r[0] - 20, 0) : r[0]]).endswith("<tool_response>\n")
            echoed.append(tok.decode(ids[r]))
    assert sorted(echoed) == sorted(tool_nodes)
    assert all(text == lookup(text.translate(_UNSHIFT)) for text in echoed)


_UNSHIFT = str.maketrans("bcdefghijklmnopqrstuvwxyza", "abcdefghijklmnopqrstuvwxyz")


def test_echo_lowers_tool_output_nll_and_grpo_trains_no_ce(warm_start, tmp_path) -> None:
    run_rl(build_config(rl_config(warm_start, tmp_path / "echo", ECHO, steps=5), []))
    echo = read_metrics(tmp_path / "echo" / "metrics.jsonl")
    assert all(r["ce_tokens"] > 0 for r in echo)
    assert echo[-1]["ce_nll_mean"] < 0.8 * echo[0]["ce_nll_mean"], [r["ce_nll_mean"] for r in echo]
    run_rl(build_config(rl_config(warm_start, tmp_path / "grpo", {"type": "grpo"}, steps=2), []))
    grpo = read_metrics(tmp_path / "grpo" / "metrics.jsonl")
    assert all(r["ce_tokens"] == 0 for r in grpo)

"""Long-context RL end to end on CPU: 2 GRPO steps on `needle` (two facts buried in a ~8.3k-token
document, asked one per turn) with the trainer's sequence split over 4 devices (context parallelism, Ulysses
attention) x 2-way fsdp, the embedded engine prefilling each prompt in 512-token chunks, a real
verifiers env server. Small on purpose (2 layers, 4 tasks x 2 samples): it checks that every
part holds at this length, not that the model learns."""

from __future__ import annotations

import json

import pytest

from jaxrl.cli import build_config
from jaxrl.metrics import read_metrics
from jaxrl.rl import run_rl

SEQ = 8704  # >= the longest sample; it and its default buckets (/4, /2) divide by the context size


@pytest.mark.slow
def test_two_rl_steps_on_8k_token_samples_with_context_parallelism(tmp_path) -> None:
    out = tmp_path / "rl"
    cfg = build_config({
        "output_dir": str(out),
        "model": {"scratch": {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
                              "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": SEQ}},
        "trainer": {"steps": 2, "seq_len": SEQ, "micro_batch_rows": 2, "remat": "full",
                    "mesh": {"fsdp": 2, "context": 4}, "optim": {"lr": 1e-4}},
        "inference": {"server": {"port": 0}, "max_model_len": SEQ, "max_seqs": 4,
                      "backend": {"type": "embedded", "prefill_len_buckets": [512], "prefill_batch_buckets": [1]}},
        "orchestrator": {
            "batch_size": 4, "group_size": 2, "max_async_level": 0,
            "train": {"sampling": {"max_completion_tokens": 6, "temperature": 1.0},
                      "env": [{"id": "needle", "args": {"context_words": 1500, "questions": 2}}]},
        },
        "log": {"progress": False},
    }, [])  # fmt: skip
    run_rl(cfg)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # A group whose two rewards are equal trains nothing (GRPO's zero advantage): 2 or 4 samples.
    assert all(r["train/rollouts_failed"] == 0 and r["train/samples"] in (2, 4) for r in rows)
    # Each sample is >= 8k tokens: the trainer's (unpadded) tokens per step over its samples.
    assert all(r["train/tokens"] / r["train/samples"] >= 8192 for r in rows), rows[-1]
    assert all(r["train/policy_lag_max"] == 0 and r["train/mismatch_kl"] < 1e-4 for r in rows), rows[-1]
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) >= 8 and all(r["fate"] != "failed" for r in records)
    # Multi-turn: the scripted user asked the second question after the first reply (unless the
    # first reply ran to the context limit, which 6 tokens past an 8.4k prompt does not).
    turns = [[m["role"] for m in r["completion"]] for r in records]
    assert all(t == ["assistant", "user", "assistant"] for t in turns), turns[:2]

"""Echo end to end on the lookup tool env: real env server process, real engine over HTTP on
loopback, the orchestrator thread and the trainer.

A tiny SFT warm start learns the tool-call format (not the codes); one echo RL run follows.
Its rollouts (``rollouts.jsonl``, every token of every trace) are re-scored offline to check
that echo put CE weight exactly on the bodies of `lookup` tool outputs — nothing on model
tokens, chat scaffold or the prompt — that a config naming another tool selects nothing, that
plain GRPO selects nothing, and that the trainer trained exactly those tokens (its per-step
``ce_tokens``). The same run must lower the NLL of those tokens.

Keys are fixed at 3 letters: the tiny warm start then learns where a key ends, so most
rollouts make a well-formed call (copying the key is not needed: any call returns a code).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxrl.cli import build_config
from jaxrl.metrics import read_metrics
from jaxrl.orchestrator.algo import EchoConfig, GRPOConfig, make_algorithm
from jaxrl.orchestrator.traces import Rollout
from jaxrl.rl import run_rl
from jaxrl.sft import run_sft

pytestmark = pytest.mark.slow  # an end-to-end run: the slow tier

SCRATCH = {"hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
           "head_dim": 32, "max_position_embeddings": 1024}
ENV_ARGS = {"max_keys": 1, "min_len": 3, "max_len": 3}
ALPHA = 0.1
ECHO = {"type": "echo", "roles": {"tool": {"alpha": ALPHA, "tool_names": ["lookup"]}}}
STEPS = 5


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lookup_sft")
    cfg = build_config({
        "output_dir": str(out),
        "model": {"scratch": SCRATCH},
        "data": {"taskset": "lookup", "taskset_args": ENV_ARGS, "num_examples": 256, "batch_size": 2},
        "trainer": {"steps": 100, "seq_len": 1024, "seq_len_buckets": [1024], "micro_batch_rows": 2,
                    "mesh": {"num_devices": 1}, "optim": {"lr": 1e-2, "warmup_steps": 5, "schedule": "constant"}},
        "log": {"progress": False},
    }, [])
    return Path(run_sft(cfg)["export"])


@pytest.fixture(scope="module")
def echo_run(warm_start, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lookup_echo")
    run_rl(build_config({
        "output_dir": str(out),
        "model": {"name": str(warm_start)},
        "trainer": {"steps": STEPS, "seq_len": 1024, "seq_len_buckets": [1024], "micro_batch_rows": 8,
                    "mesh": {"num_devices": 1},
                    "optim": {"lr": 3e-4, "schedule": "constant", "weight_decay": 0.0}},
        "inference": {"server": {"port": 0}, "max_model_len": 1024, "max_seqs": 16,
                      "backend": {"type": "embedded", "prefill_len_buckets": [64, 512], "prefill_batch_buckets": [4],
                                  "decode_batch_buckets": [16]}},
        "orchestrator": {
            "batch_size": 16, "group_size": 4,
            # A call with a 3-letter key is 51 tokens; 0.7 keeps the tiny model's format intact.
            "train": {"sampling": {"max_completion_tokens": 64, "temperature": 0.7},
                      "env": [{"id": "lookup", "args": ENV_ARGS, "algo": ECHO}]},
        },
        "log": {"progress": False, "rollout_episodes": True},  # re-scored offline below
    }, []))
    return out


def trained_groups(out: Path) -> dict[int, list[list[Rollout]]]:
    """Per step, the groups the trainer got (records of resampled batches left out)."""
    groups: dict[int, dict[str, list[Rollout]]] = defaultdict(lambda: defaultdict(list))
    for line in (out / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert r["fate"] != "failed", r["error"]
        if r["fate"] in ("trained", "no_signal") and not r.get("resampled"):
            rollout = Rollout(r["env"], r["group_id"], r["task"], r["episode"], r["error"], r["policy_version"],
                              r["temperature"])
            groups[r["step"]][r["group_id"]].append(rollout)
    return {step: list(by_id.values()) for step, by_id in groups.items()}


def tool_outputs(rollout: Rollout) -> list[tuple[str, str]]:
    """(name, body) of every tool output: the tiny model sometimes misspells the tool
    ("loookup"); verifiers answers such a call too, under the name called."""
    return [(n["message"].get("name"), n["message"]["content"])
            for t in rollout.traces for n in t["nodes"] if n["message"]["role"] == "tool"]  # fmt: skip


def ce_runs(ce_w: np.ndarray) -> list[np.ndarray]:
    """Maximal runs of positions with CE weight."""
    runs = np.split(np.arange(len(ce_w)), np.where(np.diff(ce_w > 0))[0] + 1)
    return [r for r in runs if ce_w[r[0]] > 0]


def test_echo_weights_exactly_the_allowed_tool_output_bodies(echo_run, warm_start) -> None:
    tok = AutoTokenizer.from_pretrained(warm_start)
    echo = make_algorithm(EchoConfig.model_validate(ECHO))
    every_tool = make_algorithm(EchoConfig.model_validate({"type": "echo", "roles": {"tool": {"alpha": ALPHA}}}))
    other_tool = make_algorithm(EchoConfig.model_validate(
        {"type": "echo", "roles": {"tool": {"alpha": ALPHA, "tool_names": ["search"]}}}))
    grpo = make_algorithm(GRPOConfig())
    metrics = {r["step"]: r for r in read_metrics(echo_run / "metrics.jsonl")}
    by_step = trained_groups(echo_run)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    calls = 0
    for step, groups in by_step.items():
        ce_tokens = 0
        for group in groups:
            samples = echo.samples(group)
            outputs = [out for r in group for out in tool_outputs(r)]
            every = [s.ce_w for s in every_tool.samples(group)]
            if all(name == "lookup" for name, _ in outputs):  # the allow-list changes nothing
                assert [s.ce_w.tolist() for s in samples] == [ce.tolist() for ce in every]
            else:  # a misspelt tool's output: only the config without an allow-list selects it
                assert sum(int((s.ce_w > 0).sum()) for s in samples) < sum(int((ce > 0).sum()) for ce in every)
            # Another tool's allow-list, and plain GRPO, select nothing on the same rollouts.
            assert all(not s.ce_w.any() for s in other_tool.samples(group) + grpo.samples(group))
            expected = [body for name, body in outputs if name == "lookup"]
            calls += len(expected)
            echoed = []
            for sample in samples:
                ce = sample.ce_w
                assert set(np.unique(ce).tolist()) <= {0.0, np.float32(ALPHA)}
                assert not (ce > 0)[sample.sampled_mask].any(), "echo weight on a model token"
                assert (sample.rl_w[ce > 0] == 0).all()
                ce_tokens += int((ce[1:] > 0).sum())
                for run in ce_runs(ce):  # one tool-output body, inside its scaffold, nothing more
                    assert tok.decode(sample.token_ids[: run[0]]).endswith("<|im_start|>user\n<tool_response>\n")
                    assert tok.decode(sample.token_ids[run[-1] + 1 :]).startswith("\n</tool_response><|im_end|>")
                    echoed.append(tok.decode(sample.token_ids[run]))
            assert sorted(echoed) == sorted(expected), (step, echoed, expected)
        # The trainer trained exactly the tokens echo selected.
        assert metrics[step]["train/ce_tokens"] == ce_tokens, (step, metrics[step]["train/ce_tokens"], ce_tokens)
    # Seen 17-45 calls in 80 rollouts (rollout order, and so sampling seeds, varies per run).
    assert calls >= 2 * STEPS, f"the warm start made only {calls} tool calls in {16 * STEPS} rollouts"


def test_echo_lowers_tool_output_nll(echo_run) -> None:
    rows = read_metrics(echo_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["train/ce_tokens"] > 0 for r in rows)
    nll = [r["train/ce_nll_mean"] for r in rows]
    assert nll[-1] < 0.8 * nll[0], nll

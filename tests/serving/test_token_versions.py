"""Per-token policy versions from the engine to the loss: an immediate weight update in the
middle of a long answer, over the real HTTP server (``X-Session-ID`` as verifiers' train client
sends it), onto the trace's sampled nodes, into the training sample, packing and the staleness
rule and metrics, which count tokens, not samples."""

from __future__ import annotations

import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from jaxrl.engine.engine import Engine
from jaxrl.models.hf_io import load_decoder
from jaxrl.orchestrator.traces import Rollout, attach_token_versions, branch_sample, trace_branches
from jaxrl.serving.server import EngineServer
from jaxrl.serving.session_versions import SessionVersions
from jaxrl.trainer.loss import LossConfig, combine, loss_sums
from jaxrl.trainer.packing import component_counts, pack


def test_session_versions_keep_each_answer_in_order_bounded_and_taken_once() -> None:
    record = SessionVersions(max_sessions=2)
    record.record("a", [3, 3, 4, 4, 4])
    record.record("a", [4])
    record.record("b", [7])
    record.record("c", [8, 9])  # a third session: "a", the oldest, is forgotten
    assert record.take("a") is None
    assert record.take("c") == [[8, 9]]
    assert record.take("c") is None  # taken once
    record.record("d", [1, 1, 2, 1])
    assert record.take("d") == [[1, 1, 2, 1]]


def _node(role: str, ids: list[int], sampled: bool, logprobs: list[float] | None = None) -> dict:
    """A trace node as verifiers' wire form has it (only the fields jaxrl reads)."""
    return {
        "message": {"role": role, "content": ""},
        "token_ids": ids,
        "mask": [sampled] * len(ids),
        "logprobs": logprobs or [],
        "sampled": sampled,
        "parent": None,
    }


@pytest.mark.slow
def test_an_immediate_update_mid_answer_reaches_the_sample_per_token(
    model_dir, other_model_dir, tokenizer_dir, make_config, monkeypatch
) -> None:
    engine = Engine.from_pretrained(model_dir, make_config(max_model_len=256, weight_update="immediate", decode_steps=1))
    server = EngineServer(engine, AutoTokenizer.from_pretrained(tokenizer_dir), model_name="tiny")
    server.start()
    headers = {"X-Session-ID": "trace-1"}
    prompt, follow_up = [5, 6, 7, 8], [9, 10]
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            answers: dict[str, dict] = {}
            body = {"token_ids": prompt, "sampling_params": {"max_tokens": 150, "ignore_eos": True, "logprobs": 1, "seed": 1}}

            def first_turn() -> None:
                answers["first"] = client.post("/inference/v1/generate", json=body, headers=headers).json()

            new_weights = nnx.state(load_decoder(other_model_dir))
            gate, decode = threading.Event(), engine._run_decode

            def held(plan):  # type: ignore[no-untyped-def]
                decode(plan)  # the engine waits after each decode call until the update is queued
                gate.wait(60)

            monkeypatch.setattr(engine, "_run_decode", held)
            thread = threading.Thread(target=first_turn)
            thread.start()
            deadline = time.monotonic() + 60
            while engine.stats.generated_tokens < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            assert engine.update_weights_from_state(new_weights, wait=False) == 1  # mid-answer
            gate.set()
            thread.join()
            first = answers["first"]["choices"][0]
            second_prompt = prompt + first["token_ids"] + follow_up
            body = {"token_ids": second_prompt, "sampling_params": {"max_tokens": 4, "ignore_eos": True, "logprobs": 1}}
            second = client.post("/inference/v1/generate", json=body, headers=headers).json()["choices"][0]
    finally:
        server.stop()
    versions = first["token_versions"]
    switch = versions.index(1)
    assert switch == 2 and versions == [0] * switch + [1] * (150 - switch)  # prefill's token + one decode
    assert second["token_versions"] == [1] * 4

    lp = lambda choice: [e["logprob"] for e in choice["logprobs"]["content"]]
    nodes = [
        _node("user", prompt, False),
        _node("assistant", first["token_ids"], True, lp(first)),
        _node("user", follow_up, False),
        _node("assistant", second["token_ids"], True, lp(second)),
    ]
    for i, node in enumerate(nodes[1:]):
        node["parent"] = i
    rollout = Rollout(env="e", group_id="g", task={}, episode={"traces": [{"id": "trace-1", "nodes": nodes}]})
    assert attach_token_versions(rollout, server.session_versions.take) == 2
    sample = branch_sample(trace_branches(rollout.traces[0])[0], rollout, advantage=1.0)
    n = len(prompt)
    assert sample.policy_version == 0  # dispatched at version 0 ...
    np.testing.assert_array_equal(sample.versions()[n : n + 150], versions)  # ... each token as sampled
    np.testing.assert_array_equal(sample.versions()[-4:], [1, 1, 1, 1])
    assert (sample.versions()[: n] == 0).all()

    batch = pack([sample], seq_len=256)
    drop_stale = LossConfig(staleness={"max_lag": 0, "mode": "drop"})
    counts = component_counts(batch, drop_stale, trainer_version=1)
    assert counts["rl"] == (150 - switch) + 4  # the tokens sampled at version 0 drop, one by one
    assert component_counts(batch)["rl"] == 154
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    sums = loss_sums(
        f32(batch.logq), f32(batch.logq), f32(batch.advantages), f32(batch.rl_w), f32(batch.ce_w),
        jnp.asarray(batch.loss_mask), drop_stale, segment_ids=jnp.asarray(batch.segment_ids),
        policy_version=jnp.asarray(batch.policy_version), trainer_version=1,
    )  # fmt: skip
    metrics = combine(sums)[1]
    np.testing.assert_allclose(float(metrics["stale_lag1_frac"]), switch / 154, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["stale_lag0_frac"]), (154 - switch) / 154, rtol=1e-6)

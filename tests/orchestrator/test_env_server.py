"""Real env server processes (verifiers `serve_env`) against a real HTTP model endpoint.

The endpoint is a scripted test double of the model (fake_engine.py); everything between —
the spawned env servers, ZeroMQ, verifiers' train client, the Qwen3 renderer, the in-process
harness, scoring — is the real thing. One set of servers serves the whole module.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

import numpy as np
import pytest
from fake_engine import logprob_at
from scripted import SAMPLING, gather

from jaxrl.envs import lookup, reverse_text
from jaxrl.orchestrator.algo import EchoConfig, GRPOConfig, SFTConfig, make_algorithm
from jaxrl.orchestrator.config import EnvConfig
from jaxrl.orchestrator.env_process import EnvServerDead
from jaxrl.orchestrator.env_server import EnvServer, start_env_servers
from jaxrl.orchestrator.env_tasks import task_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(loop, output_dir) -> dict[str, EnvServer]:
    configs = [
        EnvConfig(id="reverse_text", args={"num_tasks": 4}),
        EnvConfig(id="lookup", args={"num_tasks": 20, "max_keys": 2}),
    ]
    started = loop.run_until_complete(start_env_servers(configs, output_dir=output_dir, kind="train"))
    yield {s.name: s for s in started}
    loop.run_until_complete(gather(*(s.aclose() for s in started)))


def test_reverse_text_group_end_to_end(loop, servers, engine, endpoint, tokenizer):
    server = servers["reverse_text"]
    task = task_data(next(iter(server.taskset())))
    group = loop.run_until_complete(server.run_group(task, endpoint, SAMPLING, 3, policy_version=7))
    assert [r.error for r in group] == [None] * 3 and [r.reward for r in group] == [1.0] * 3
    assert len({r.group_id for r in group}) == 1 and {r.policy_version for r in group} == {7}

    # what reached the engine: one generate call per rollout, keyed by the trace id
    trace_ids = {r.traces[0]["id"] for r in group}
    calls = [req for req in engine.requests if req["headers"].get("x-session-id") in trace_ids]
    assert Counter(req["headers"]["x-session-id"] for req in calls) == Counter(trace_ids)
    params = calls[0]["body"]["sampling_params"]
    assert calls[0]["body"]["model"] == "tiny"
    assert (params["temperature"], params["max_tokens"], params["logprobs"]) == (0.6, 256, 1)
    assert params["stop_token_ids"] == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    assert make_algorithm(GRPOConfig()).samples(group) == []  # equal rewards: no RL signal
    (sample, *_) = make_algorithm(SFTConfig()).samples(group)
    text = tokenizer.decode(sample.token_ids)
    assert text.endswith(
        f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        f"<think>\n\n</think>\n\n{task['answer']}<|im_end|>"
    )
    sampled = np.flatnonzero(sample.sampled_mask)
    assert tokenizer.decode(sample.token_ids[sampled]) == task["answer"] + "<|im_end|>"
    np.testing.assert_allclose(
        sample.logprobs[sampled], [logprob_at(i) for i in range(len(sampled))], rtol=1e-6
    )
    assert not sample.logprobs[~sample.sampled_mask].any()
    assert sample.temperature == pytest.approx(0.6) and sample.policy_version == 7


def test_lookup_tool_calls_and_echo_on_tool_output(loop, servers, endpoint, tokenizer):
    server = servers["lookup"]
    task = task_data(next(t for t in server.taskset() if len(t.data.keys) == 2))
    group = loop.run_until_complete(server.run_group(task, endpoint, SAMPLING, 2))
    assert [r.error for r in group] == [None, None] and [r.reward for r in group] == [1.0, 1.0]
    trace = group[0].traces[0]
    assert [n["message"]["role"] for n in trace["nodes"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    assert [n["message"]["content"] for n in trace["nodes"][3:5]] == [lookup.lookup(k) for k in task["keys"]]

    echo = EchoConfig(roles={"tool": {"alpha": 0.1, "tool_names": ["lookup"]}})
    samples = make_algorithm(echo).samples(group)
    assert len(samples) == 2
    for s in samples:
        selected = s.ce_w > 0
        assert tokenizer.decode(s.token_ids[selected]) == "".join(lookup.lookup(k) for k in task["keys"])
        assert np.allclose(s.ce_w[selected], 0.1) and not s.rl_w.any()  # equal rewards: CE only
    other_tool = EchoConfig(roles={"tool": {"alpha": 0.1, "tool_names": ["search"]}})
    assert make_algorithm(other_tool).samples(group) == []


def test_failures_come_back_as_records(loop, servers, endpoint):
    server = servers["reverse_text"]
    failing = {"prompt": "FAIL now", "system_prompt": reverse_text.SYSTEM_PROMPT, "answer": "won LIAF"}
    (rollout,) = loop.run_until_complete(server.run_group(failing, endpoint, SAMPLING, 1))
    assert rollout.error.startswith("ProviderError") and rollout.episode is not None
    assert make_algorithm(SFTConfig()).samples([rollout]) == []

    slow = {"prompt": "SLOW now", "system_prompt": reverse_text.SYSTEM_PROMPT, "answer": "won WOLS"}
    server.config = server.config.model_copy(update={"rollout_timeout": 1.0})
    try:
        rollout = loop.run_until_complete(server.run(slow, endpoint, SAMPLING))
    finally:
        server.config = server.config.model_copy(update={"rollout_timeout": None})
    assert rollout.error == "TimeoutError: rollout on env 'reverse_text' exceeded 1s (rollout_timeout)"
    assert rollout.episode is None


def test_attach_to_a_running_server(loop, servers, endpoint):
    address = servers["reverse_text"].address
    attached = EnvServer(EnvConfig(id="reverse_text", address=address))
    task = task_data(next(iter(attached.taskset())))
    try:
        rollout = loop.run_until_complete(attached.run(task, endpoint, SAMPLING))
    finally:
        loop.run_until_complete(attached.aclose())
    assert rollout.error is None and rollout.reward == 1.0
    assert servers["reverse_text"].process.proc is not None and servers["reverse_text"].process.proc.poll() is None


def test_bad_configs_fail_before_anything_runs(loop, tmp_path):
    with pytest.raises(ValueError, match="unknown env id 'no_such_env'"):
        EnvConfig(id="no_such_env")
    with pytest.raises(ValueError, match="extra"):
        EnvConfig(id="reverse_text", pool=2)
    with pytest.raises(ValueError, match="(?s)env 'reverse_text' \\(id 'reverse_text'\\).*num_taskz"):
        EnvServer(EnvConfig(id="reverse_text", args={"num_taskz": 3}), output_dir=tmp_path)
    with pytest.raises(ValueError) as bad_arg:  # a bad env arg is one line naming the field and the value
        EnvServer(EnvConfig(id="lookup", args={"alphabet_size": 30}), output_dir=tmp_path)
    assert str(bad_arg.value) == (
        "env 'lookup' (id 'lookup'): taskset.alphabet_size: Input should be less than or equal to 26 (got 30)")
    with pytest.raises(ValueError, match="names must be unique"):
        loop.run_until_complete(
            start_env_servers(
                [EnvConfig(id="lookup"), EnvConfig(id="lookup")], output_dir=tmp_path, kind="eval"
            )
        )
    assert not (tmp_path / "logs").exists()


def test_dead_server_is_a_failed_record_and_shutdown_is_clean(loop, servers, endpoint, output_dir):
    for name in ("reverse_text", "lookup"):
        assert (output_dir / "logs" / "envs" / "train" / f"{name}.log").stat().st_size > 0
    victim = servers["lookup"]
    os.kill(victim.process.proc.pid, signal.SIGKILL)
    task = task_data(next(iter(victim.taskset())))
    rollout = loop.run_until_complete(victim.run(task, endpoint, SAMPLING))
    assert rollout.error.startswith("EnvServerError: env server 'lookup' died (exit code -9)")

    # The next rollout restarts it (logged, counted) and runs; past max_restarts the run must stop.
    first = victim.process.proc
    rollout = loop.run_until_complete(victim.run(task, endpoint, SAMPLING))
    assert victim.restarts == 1 and victim.process.proc is not first and victim.process.proc.poll() is None
    assert rollout.error is None, rollout.error
    victim.config = victim.config.model_copy(update={"max_restarts": 1})
    os.kill(victim.process.proc.pid, signal.SIGKILL)
    victim.process.proc.wait()
    with pytest.raises(
        EnvServerDead, match=f"(?s)env server 'lookup' died.*max_restarts = 1.*{victim.log_path}"
    ):
        loop.run_until_complete(victim.run(task, endpoint, SAMPLING))

    procs = [s.process.proc for s in servers.values()]
    loop.run_until_complete(gather(*(s.aclose() for s in servers.values())))
    assert all(p.poll() is not None for p in procs)
    assert "EnvServer down" in (output_dir / "logs" / "envs" / "train" / "reverse_text.log").read_text()

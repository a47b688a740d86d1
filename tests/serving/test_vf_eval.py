"""verifiers' own CLI, ``vf-eval``, against jaxrl's server with no changes on either side: the
command docs/serving.md gives, run as a real process on a built-in env under the id jaxrl installs
for verifiers' CLI (`jaxrl-reverse-text`: the top-level module vf_envs/jaxrl_reverse_text.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from jaxrl.engine.engine import Engine
from jaxrl.serving.server import EngineServer


@pytest.mark.slow
def test_vf_eval_runs_against_the_server(model_dir, tokenizer_dir, make_config, tmp_path) -> None:
    engine = Engine.from_pretrained(model_dir, make_config(max_model_len=512))
    server = EngineServer(engine, AutoTokenizer.from_pretrained(tokenizer_dir), model_name="tiny")
    server.start()
    try:
        cmd = [
            str(Path(sys.executable).parent / "vf-eval"), "jaxrl-reverse-text", "-n", "2", "-r", "1",
            "--client.base-url", f"{server.url}/v1", "--no-push", "--env.agent.runtime.type", "subprocess",
            "-o", str(tmp_path / "out"),
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop("PRIME_API_KEY", None)  # no key needed: the server is on loopback
        done = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (traces,) = (tmp_path / "out").glob("*/traces.jsonl")
    episodes = [json.loads(line) for line in traces.read_text().splitlines()]
    assert len(episodes) == 2 and all(e["ok"] and not e["errors"] for e in episodes)
    assert all(e["num_output_tokens"] > 0 for e in episodes)
    assert engine.stats.generated_tokens >= sum(e["num_output_tokens"] for e in episodes)  # sampled here

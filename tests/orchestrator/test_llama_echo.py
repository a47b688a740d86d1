"""Echo attribution on a Llama 3 tool conversation, end to end through a real env server.

A Llama 3 tokenizer with the real Llama 3.2 chat template (tests/families.py), the run's
renderer resolved by ``[model] renderer = "auto"`` (``llama-3``), a real verifiers env
server running the lookup tool env, and a scripted Llama-format model over HTTP. The trace's
``is_content`` comes from the renderers Llama 3 renderer, so echo selects exactly the tool
output bodies (JSON-quoted in the ipython turn, as the template writes them): not the
``<|start_header_id|>ipython<|end_header_id|>`` scaffold, not ``<|eot_id|>``.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from fake_engine import FakeEngine
from families import build_family_tokenizer
from scripted import SAMPLING, gather
from transformers import AutoTokenizer

from jaxrl.endpoint import ModelEndpoint
from jaxrl.envs import lookup
from jaxrl.models.renderer import resolve_renderer
from jaxrl.orchestrator.algo import EchoConfig, make_algorithm
from jaxrl.orchestrator.config import EnvConfig
from jaxrl.orchestrator.env_server import start_env_servers
from jaxrl.orchestrator.env_tasks import task_data

pytestmark = pytest.mark.slow

_TURN = re.compile(r"<\|start_header_id\|>(\w+)<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.DOTALL)


def parse_llama3(text: str) -> list[dict]:
    return [{"role": r, "content": c} for r, c in _TURN.findall(text)]


def llama_policy(messages: list[dict]) -> str:
    """Calls lookup for the asked word (Llama 3's JSON call format), then answers with its output."""
    if messages[-1]["role"] == "ipython":
        return json.loads(messages[-1]["content"])
    (key,) = re.findall(r"'(\w+)'", messages[-1]["content"])
    return json.dumps({"name": "lookup", "parameters": {"key": key}})


def test_echo_selects_llama3_tool_output_bodies(loop, tmp_path) -> None:
    tok_dir = build_family_tokenizer(tmp_path / "llama3", "llama3")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    renderer = resolve_renderer("auto", {}, model_name=None, hf_config={"model_type": "llama"}, tokenizer=tok)
    assert renderer["name"] == "llama-3"
    (server,) = loop.run_until_complete(
        start_env_servers([EnvConfig(id="lookup", args={"num_tasks": 4})], output_dir=tmp_path, kind="train")
    )
    try:
        with FakeEngine(str(tok_dir), llama_policy, parse=parse_llama3, end_token="<|eot_id|>") as engine:
            endpoint = ModelEndpoint(base_url=engine.base_url, model=engine.model, tokenizer_dir=str(tok_dir), renderer=renderer)
            task = task_data(next(iter(server.taskset())))
            group = loop.run_until_complete(server.run_group(task, endpoint, SAMPLING, 2))
    finally:
        loop.run_until_complete(gather(server.aclose()))
    assert [r.error for r in group] == [None, None] and [r.reward for r in group] == [1.0, 1.0]
    nodes = group[0].traces[0]["nodes"]
    assert [n["message"]["role"] for n in nodes] == ["system", "user", "assistant", "tool", "assistant"]
    assert "<|start_header_id|>ipython<|end_header_id|>" in tok.decode(nodes[3]["token_ids"])

    echo = EchoConfig(roles={"tool": {"alpha": 0.1, "tool_names": ["lookup"]}})
    samples = make_algorithm(echo).samples(group)
    assert len(samples) == 2
    (key,) = task["keys"]
    for s in samples:
        selected = s.ce_w > 0
        assert tok.decode(s.token_ids[selected]) == json.dumps(lookup.lookup(key))
        assert np.allclose(s.ce_w[selected], 0.1) and not s.rl_w.any()

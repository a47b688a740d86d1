"""Qwen3, Qwen3-MoE, Qwen2.5 and Llama 3 checkpoints, each with its real chat template, through SFT and RL.

Per family (tiny random checkpoint, tests/families.py): ``[model] renderer = "auto"`` picks
the family's renderer from config.json; SFT rendering (the run's grain pipeline) gives the
family's chat-template tokens with the loss on exactly the assistant's sampled tokens; one
GRPO step runs through a real verifiers env server whose prompts (rendered by the same renderer
on the env-server side) are, token for token, what the family's own chat template produces.
"""

from __future__ import annotations

import json

import pytest
from families import FAMILIES, build_family_model
from transformers import AutoTokenizer

from jaxrl.cli import build_config
from jaxrl.data.sft import reference_conversations, sft_dataset
from jaxrl.metrics import read_metrics
from jaxrl.models.renderer import model_renderer
from jaxrl.rl import run_rl

pytestmark = pytest.mark.slow

TRAINER = {"seq_len": 256, "seq_len_buckets": [256], "micro_batch_rows": 4, "mesh": {"num_devices": 1},
           "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"}}  # fmt: skip
TEMPLATE_KWARGS = {"qwen3": {"enable_thinking": False}, "qwen3_moe": {"enable_thinking": False}, "qwen2.5": {},
                   "llama3": {"date_string": "26 Jul 2024"}}  # fmt: skip


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_sft_and_rl_step_use_its_chat_template(family, tmp_path) -> None:
    model = build_family_model(tmp_path / "model", family)
    tok = AutoTokenizer.from_pretrained(model)

    cfg = build_config({"model": {"name": str(model)}}, [])
    spec = model_renderer(cfg.model, json.loads((model / "config.json").read_text()), tok)
    assert spec["name"] == FAMILIES[family]["renderer"]
    conversations = reference_conversations("reverse_text", {}, 1, seed=0)
    (sample,) = sft_dataset(conversations, str(model), spec, batch_size=1, seed=0)[0]
    messages, _ = conversations[0]
    text = tok.apply_chat_template(messages, tokenize=False, **TEMPLATE_KWARGS[family])
    assert list(sample.token_ids) == tok.encode(text, add_special_tokens=False)
    # The loss covers the answer and its end of turn, nothing of the prompt. Qwen3's renderer
    # also marks the (deterministic) empty think block; the template-verbatim Qwen2.5 renderer
    # the newline after <|im_end|>.
    qwen3 = ("<think>\n\n</think>\n\n", "")
    before, after = {"qwen3": qwen3, "qwen3_moe": qwen3, "qwen2.5": ("", "\n"), "llama3": ("", "")}[family]
    trained = tok.decode(sample.token_ids[sample.ce_w > 0])
    assert trained == before + messages[-1]["content"] + tok.eos_token + after

    rl_out = tmp_path / "rl"
    run_rl(build_config({
        "output_dir": str(rl_out), "model": {"name": str(model)},
        "trainer": TRAINER | {"steps": 1},
        "inference": {"server": {"port": 0}, "max_model_len": 256, "max_seqs": 8,
                      "backend": {"type": "embedded", "prefill_len_buckets": [128, 256], "prefill_batch_buckets": [4],
                                  "decode_batch_buckets": [8]}},
        "orchestrator": {"batch_size": 8, "group_size": 4, "max_resample": 3,
                         "train": {"sampling": {"max_completion_tokens": 8, "temperature": 1.0},
                                   "env": [{"id": "reverse_text", "args": {"seed": 3}}]}},
        "log": {"progress": False, "plot": False, "rollout_episodes": True},
    }, []))  # fmt: skip
    (rl_metrics,) = read_metrics(rl_out / "metrics.jsonl")
    assert rl_metrics["step"] == 1 and rl_metrics["train/rl_tokens"] > 0 and rl_metrics["train/policy_version"] == 1.0

    # The env server rendered every prompt exactly as the family's own chat template does.
    record = json.loads((rl_out / "rollouts.jsonl").read_text().splitlines()[0])
    nodes = record["episode"]["traces"][0]["nodes"]
    assert [n["sampled"] for n in nodes] == [False, False, True]  # system, user, the model's turn
    messages = [{"role": n["message"]["role"], "content": n["message"]["content"]} for n in nodes[:2]]
    turn = nodes[2]  # its leading unsampled tokens are the generation prompt's assistant header
    prompt = nodes[0]["token_ids"] + nodes[1]["token_ids"] + turn["token_ids"][: turn["mask"].index(True)]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **TEMPLATE_KWARGS[family])
    assert prompt == tok.encode(text, add_special_tokens=False)

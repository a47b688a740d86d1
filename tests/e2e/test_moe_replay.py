"""Routing replay end to end: a tiny Qwen3-MoE through 2 GRPO steps on the real HTTP server and
a real verifiers env server, with ``[trainer] moe_routing = "replay"``: the engine's server
returns each token's experts, verifiers puts them on the trace, the trainer routes with them."""

from __future__ import annotations

import pytest
import transformers
from families import build_family_tokenizer

from jaxrl.cli import build_config
from jaxrl.metrics import read_metrics
from jaxrl.rl import run_rl

pytestmark = pytest.mark.slow


def test_rl_with_routing_replay(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    model = build_family_tokenizer(tmp_path / "model", "qwen3")
    tok = transformers.AutoTokenizer.from_pretrained(model)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(model)
    out = tmp_path / "rl"
    run_rl(build_config({
        "output_dir": str(out), "model": {"name": str(model), "renderer": "qwen3"},
        "trainer": {"steps": 2, "seq_len": 256, "seq_len_buckets": [256], "micro_batch_rows": 4, "moe_routing": "replay",
                    "mesh": {"num_devices": 1}, "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"}},
        "inference": {"server": {"port": 0}, "max_model_len": 256, "max_seqs": 8,
                      "backend": {"type": "embedded", "prefill_len_buckets": [128, 256], "prefill_batch_buckets": [4],
                                  "decode_batch_buckets": [8]}},
        "orchestrator": {"batch_size": 8, "group_size": 4, "max_resample": 3,
                         "train": {"sampling": {"max_completion_tokens": 8, "temperature": 1.0},
                                   "env": [{"id": "reverse_text", "args": {"seed": 3}}]}},
        "log": {"progress": False, "plot": False},
    }, []))  # fmt: skip
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["train/rl_tokens"] > 0
        assert 0.0 <= r["train/routing_changed_frac"] <= 1.0  # the trainer router's drift from the engine
        assert 0.0 < r["train/router_entropy"] and r["train/expert_load_max_mean"] >= 1.0
    # on-policy step 1: the trainer scores the engine's tokens with the engine's routing (fp32),
    # and its own float32 router agrees with the engine's everywhere
    assert rows[0]["train/mismatch_kl"] <= 1e-6
    assert rows[0]["train/routing_changed_frac"] == 0.0

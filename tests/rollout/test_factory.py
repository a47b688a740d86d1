"""What needs the loaded model is decided where the backend is built, never by rewriting the
run's config: the embedded server returns every token's experts when the trainer replays an MoE
model's routing (``jaxrl.rollout.factory``)."""

from __future__ import annotations

import json

import pytest
from flax import nnx

from jaxrl.config import ModelConfig
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.tiny import qwen3_moe_config, save_random_checkpoint
from jaxrl.rollout.config import InferenceConfig
from jaxrl.rollout.factory import start_rollout_backend


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    cfg = qwen3_moe_config(vocab_size=272, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, max_position_embeddings=64)  # fmt: skip
    save_random_checkpoint(out, cfg, seed=0)
    return out


@pytest.mark.parametrize(("moe", "moe_routing", "returned"), [
    (True, None, True),  # replay is the default for an MoE model on the embedded backend
    (True, "recompute", False),
    (False, None, False),
])  # fmt: skip
def test_the_embedded_server_returns_routed_experts_when_the_trainer_replays_them(
    moe, moe_routing, returned, moe_dir, model_dir, tokenizer_dir, tmp_path
) -> None:
    directory = moe_dir if moe else model_dir
    model = load_decoder(directory)
    inference = InferenceConfig.model_validate({
        "max_model_len": 64, "max_seqs": 2, "max_batched_tokens": 32, "server": {"port": 0},
        "backend": {"type": "embedded", "warmup": False, "prefill_len_buckets": [32], "prefill_batch_buckets": [1],
                    "decode_batch_buckets": [2]},
    })  # fmt: skip
    backend = start_rollout_backend(
        model, nnx.state(model), version=0, hf_config=json.loads((directory / "config.json").read_text()),
        inference=inference, model_config=ModelConfig(name=str(directory)), output_dir=tmp_path,
        tokenizer_dir=tokenizer_dir, renderer=None, moe_routing=moe_routing,
    )  # fmt: skip
    try:
        assert backend.server.completion.return_routed_experts is returned
        assert inference.server.return_routed_experts is False  # the run's config is left as it was
    finally:
        backend.stop()

"""The engine on a tiny random Qwen3-MoE: greedy tokens equal transformers' ``generate``, and the
sampled log-probs equal the trainer's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.tiny import qwen3_moe_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Three layers, the middle one sparse (decoder_sparse_step 2): dense MLP, experts, dense MLP,
    so the engine's packed dense projections are addressed by the dense layers' own stack index."""
    cfg = qwen3_moe_config(
        vocab_size=272, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, decoder_sparse_step=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # peaky logits (as engine_fixtures), decisive routers
        model.get_input_embeddings().weight.mul_(3.0)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(50.0)
    out = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(out)
    return out


def test_greedy_tokens_match_transformers_generate(moe_dir, make_config, score, kl) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).float().eval()
    engine = Engine.from_pretrained(moe_dir, make_config())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 265, int(n)).tolist() for n in (5, 40, 17, 9, 33)]  # 5 requests, 4 rows
    outs = engine.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=16)) for p in prompts])
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
        assert out.token_ids == want[0, len(prompt) :].tolist()
    # Sampled tokens' log-probs are the trainer's (its forward, the reference expert dispatch).
    model = load_decoder(moe_dir)
    assert model.arch.moe_layers == (1,) and model.arch.dense_layers == (0, 2)
    sampled = engine.generate([Request(p, SamplingParams(temperature=1.0, max_tokens=12, seed=i)) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, sampled, strict=True):
        logp = score(model, prompt, out.token_ids, 1.0)
        assert np.abs(logp - np.asarray(out.logprobs)).max() < 1e-5 and kl(logp, out.logprobs) <= 1e-6


@pytest.mark.slow  # the MoE sharded invariants run in the slow tier
def test_expert_parallel_engine_greedy_tokens_match_generate(moe_dir, make_config) -> None:
    """inference.backend.expert_parallel = 2: each device holds 4 of the 8 experts (the expert MLP sums
    the two devices' shares), and greedy decoding is still exactly transformers' (as the
    one-device engine is, above); an expert count the axis cannot split fails at load."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_dir).float().eval()
    engine = Engine.from_pretrained(moe_dir, make_config(expert_parallel=2))
    assert dict(engine.mesh.shape) == {"expert": 2, "tensor": 1}
    experts = [sh.spec for path, sh in jax.tree_util.tree_leaves_with_path(engine.runner.param_shardings)
               if "moe_gate" in jax.tree_util.keystr(path)]  # fmt: skip
    assert experts and all(tuple(s)[:2] == (None, "expert") for s in experts)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 265, int(n)).tolist() for n in (7, 30, 12)]
    outs = engine.generate([Request(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in prompts])
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert out.token_ids == want[0, len(prompt) :].tolist()
    with pytest.raises(ValueError, match="inference.backend.expert_parallel = 3 does not divide the model's 8 experts"):
        Engine.from_pretrained(moe_dir, make_config(expert_parallel=3))

"""Routing replay on a tiny Qwen3-MoE: the engine records each token's experts (prompt and
completion, prefix reuse included), and the trainer replaying them scores the engine's tokens
at float precision, at most as far off as recomputing the routing (measured beside it)."""

from __future__ import annotations

import base64
import json

import jax
import numpy as np
import pytest

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.hf_io import load_decoder
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.serving.server import EngineServer
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.step import Trainer
from jaxrl.training_sample import TrainingSample

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

LAYERS, SPARSE, K, EXPERTS = 3, (0, 2), 2, 8  # layer 1 dense (mlp_only_layers)


def make_tiny_moe(out_dir) -> None:
    """A random transformers Qwen3-MoE (router at its default, near-uniform init: many top-k
    near-ties, where engine and trainer numerics can disagree)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=272, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS, num_experts_per_tok=K,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256, tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().eval().save_pretrained(out_dir)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_moe")
    make_tiny_moe(out)
    return out


@pytest.fixture(scope="module")
def engine(moe_dir, make_config):
    return Engine.from_pretrained(moe_dir, make_config(max_seqs=4))


@pytest.fixture(scope="module")
def completions(engine):
    """Four sampled completions: two share a prompt (the second reuses the first's cached
    prefix, so its prompt's routing comes from the copied row), one is a next turn."""
    rng = np.random.default_rng(0)
    p1, p2 = rng.integers(0, 265, 40).tolist(), rng.integers(0, 265, 9).tolist()
    reqs = [Request(p, SamplingParams(max_tokens=12, seed=i)) for i, p in enumerate([p1, p1, p2])]
    first = engine.generate(reqs)
    follow = Request(p2 + first[2].token_ids + [5, 6, 7], SamplingParams(max_tokens=12, seed=9))
    out = first + engine.generate([follow])
    assert engine.stats.cached_prompt_tokens > 0  # prefix reuse ran
    return [r.prompt for r in [*reqs, follow]], out


@pytest.mark.slow  # MoE engine runs: the slow tier
def test_engine_records_every_fed_token(completions, moe_dir) -> None:
    """Prompt + completion - 1 rows (the last token is never fed), compact dtype, and each row
    equals the experts a full forward of the whole sequence picks (exact, fp32)."""
    prompts, outs = completions
    model = load_decoder(moe_dir)
    for prompt, c in zip(prompts, outs):
        seq = np.asarray(prompt + c.token_ids)
        assert c.routed_experts.dtype == np.uint8
        assert c.routed_experts.shape == (len(seq) - 1, len(SPARSE), K)
        _, _, aux = model(seq[None], np.arange(len(seq))[None], with_moe_aux=True)
        want = np.sort(np.asarray(aux.experts)[0, :-1], -1)
        same = np.mean(np.all(np.sort(c.routed_experts, -1) == want, -1))
        assert same >= 0.99, same  # near-ties may flip a rare one: that is what replay is for


def _samples(prompts, outs) -> list[TrainingSample]:
    samples = []
    for prompt, c in zip(prompts, outs):
        n = len(prompt) + len(c.token_ids)
        sampled = np.zeros(n, bool)
        sampled[len(prompt) :] = True
        logq = np.zeros(n, np.float32)
        logq[len(prompt) :] = c.logprobs
        routing = np.concatenate([c.routed_experts, c.routed_experts[-1:]])  # placeholder last row
        samples.append(
            TrainingSample(
                np.asarray(prompt + c.token_ids), sampled, logq, sampled.astype(np.float32), np.zeros(n, np.float32),
                advantage=1.0, routed_experts=routing,
            )
        )
    return samples


@pytest.mark.slow  # two engines and a trainer per mode: the slow tier
def test_replay_mismatch_is_float_precision_and_at_most_recompute(completions, moe_dir) -> None:
    """One train step's metrics (scored before the update) under each mode: replay's mismatch KL
    is ~0 and (float32 on both sides, on-policy) the trainer's own router agrees with the engine's;
    recompute's is measured beside it."""
    prompts, outs = completions
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    result = {}
    for mode in ("replay", "recompute"):
        cfg = TrainerConfig(seq_len=128, micro_batch_rows=2, moe_routing=mode)
        metrics = Trainer(load_decoder(moe_dir), cfg, mesh).train_step(_samples(prompts, outs))
        result[mode] = {k: metrics[k] for k in ("mismatch_kl", "routing_changed_frac", "router_entropy", "expert_load_max_mean")}
    print(json.dumps(result))
    assert result["replay"]["routing_changed_frac"] == 0.0
    assert result["replay"]["mismatch_kl"] <= 1e-6
    assert result["replay"]["mismatch_kl"] <= result["recompute"]["mismatch_kl"] + 1e-9
    assert 0 < result["replay"]["router_entropy"] <= np.log(EXPERTS) + 1e-5
    assert result["replay"]["expert_load_max_mean"] >= 1.0


def test_generate_returns_routed_experts_as_vllm_does(engine, completions, tokenizer_dir) -> None:
    """Over real HTTP: with ``inference.server.return_routed_experts`` every generate choice
    carries base64 ``routed_experts`` (what renderers / verifiers parse) equal to the engine's
    record from ``routed_experts_prompt_start`` on; a start past the prompt is a 400 naming it."""
    import httpx
    from transformers import AutoTokenizer

    prompts, outs = completions
    srv = EngineServer(engine, AutoTokenizer.from_pretrained(tokenizer_dir), return_routed_experts=True)
    srv.start()
    try:
        body = {"token_ids": prompts[0], "sampling_params": {"max_tokens": 12, "seed": 0, "routed_experts_prompt_start": 5}}
        r = httpx.post(srv.url + "/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert b'"routed_experts":{"data":"' in r.content  # the prefix renderers splices on
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == outs[0].token_ids
        rx = choice["routed_experts"]
        arr = np.frombuffer(base64.b64decode(rx["data"]), np.dtype(rx["dtype"])).reshape(rx["shape"])
        assert rx["start"] == 5 and arr.shape == (len(prompts[0]) + 12 - 1 - 5, len(SPARSE), K)
        np.testing.assert_array_equal(arr, outs[0].routed_experts[5:])
        off = {"token_ids": prompts[0], "sampling_params": {"max_tokens": 2, "return_routed_experts": False}}
        assert "routed_experts" not in httpx.post(srv.url + "/inference/v1/generate", json=off, timeout=120).json()["choices"][0]
        bad = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "routed_experts_prompt_start": 3}}
        r = httpx.post(srv.url + "/inference/v1/generate", json=bad, timeout=120)
        assert r.status_code == 400 and "routed_experts_prompt_start" in r.text
    finally:
        srv.stop()


def test_dense_model_refuses_routing(model_dir, make_config, tokenizer_dir) -> None:
    """A dense model has no experts: the server flag fails at start, in one line naming it."""
    from transformers import AutoTokenizer

    dense = Engine.from_pretrained(model_dir, make_config())
    with pytest.raises(ValueError, match="return_routed_experts = true needs a mixture-of-experts model"):
        EngineServer(dense, AutoTokenizer.from_pretrained(tokenizer_dir), return_routed_experts=True)


def test_replay_config_errors_are_one_line(model_dir, moe_dir, completions) -> None:
    """Replay on a dense model fails at build; replay with RL samples lacking routing fails at the
    step, naming the fix."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match='moe_routing = "replay" needs a mixture-of-experts model; this one is dense'):
        Trainer(load_decoder(model_dir), TrainerConfig(seq_len=128, moe_routing="replay"), mesh)
    samples = _samples(*completions)
    samples[0].routed_experts = None
    trainer = Trainer(load_decoder(moe_dir), TrainerConfig(seq_len=128, micro_batch_rows=2, moe_routing="replay"), mesh)
    with pytest.raises(ValueError, match="1 of 4 RL samples carry no routed_experts"):
        trainer.pack(samples)
    samples[1].routed_experts = samples[1].routed_experts + EXPERTS
    with pytest.raises(ValueError, match=r"routed_experts holds ids outside \[0, 8\)"):
        trainer.pack(samples)


def test_external_servers_must_return_routing_under_replay(engine, moe_dir, tokenizer_dir, tmp_path) -> None:
    """``trainer.moe_routing = "replay"`` with external servers: a server started without
    ``return_routed_experts`` is refused when the backend starts (one line naming both fixes),
    not at the first rollout; one started with it is taken and pushed the trainer's weights."""
    from transformers import AutoTokenizer

    from jaxrl.rollout.config import InferenceConfig
    from jaxrl.rollout.external import ExternalBackend

    model = load_decoder(moe_dir)
    hf_config = json.loads((moe_dir / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for returns_routing in (False, True):
        srv = EngineServer(engine, tok, return_routed_experts=returns_routing)
        srv.start()
        cfg = InferenceConfig(
            backend="external", base_url=[srv.url + "/v1"], server={"port": 0},
            external={"request_timeout_s": 60, "startup_timeout_s": 30, "weight_transfer": "files"},
        )  # fmt: skip
        backend = ExternalBackend(model, hf_config, cfg, output_dir=tmp_path / str(returns_routing),
                                  tokenizer_dir=tokenizer_dir, replay_routing=True)  # fmt: skip
        try:
            if returns_routing:
                backend.start(version=0)
                assert backend.policy_version == 0  # the trainer's version 0, now served
            else:
                with pytest.raises(ValueError, match=r"returns no routed_experts.*return_routed_experts true.*recompute"):
                    backend.start(version=0)
        finally:
            backend.stop()
            srv.stop()

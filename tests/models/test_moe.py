"""Qwen3-MoE: logit parity with transformers, both checkpoint layouts, export round trip, bad
configs, and routing in / out of the decoder (routing replay's contract)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.arch import arch_from_hf_config
from jaxrl.models.hf_io import SafetensorsDir, export_hf, load_decoder
from jaxrl.models.kv_cache import KVCache

torch = pytest.importorskip("torch")

VOCAB = 97
CONFIGS = {
    "topk_raw": {"norm_topk_prob": False},
    "topk_normalised": {"norm_topk_prob": True},
    # layers 0 and 2 dense (sparse step 2), layer 3 dense (mlp_only_layers): runs d, s, d d
    "mixed": {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
}


def moe_config(**kw) -> transformers.Qwen3MoeConfig:
    base = dict(  # noqa: C408
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def make_moe(out_dir, *, fused: bool = False, **kw) -> transformers.PreTrainedModel:
    """A random transformers Qwen3-MoE, saved; routers scaled up so each token's top k is decisive
    (a near-uniform router would hide a routing bug behind near-equal expert mixtures)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(50.0)
    model.save_pretrained(out_dir, save_original_format=not fused)
    return model


def _forward(model, tokens, **kw):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return model(jnp.asarray(tokens), positions, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, tmp_path) -> None:
    hf = make_moe(tmp_path, **CONFIGS[name])
    ours = load_decoder(tmp_path)
    assert ours.arch.is_moe and ours.arch.num_experts == 6
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 20))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    for kernels in (None, Kernels.create("auto", field="trainer.kernels")):  # ragged_dot and CPU tiled_gmm
        hidden, _ = _forward(ours, tokens, kernels=kernels)
        assert np.abs(np.asarray(ours.logits(hidden)) - want).max() <= 1e-4


def test_load_balance_loss_matches_transformers(tmp_path) -> None:
    hf = make_moe(tmp_path, norm_topk_prob=True, output_router_logits=True)
    ours = load_decoder(tmp_path)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 16))
    mask = np.ones((2, 16), np.int64)
    mask[1, 11:] = 0  # padding: segment id 0 on our side
    with torch.no_grad():
        want = float(hf(torch.tensor(tokens), attention_mask=torch.tensor(mask)).aux_loss)  # before the coefficient
    # Right padding leaves the real tokens' outputs alone in both models (causal attention).
    _, _, aux = _forward(ours, tokens, segment_ids=jnp.asarray(mask), with_moe_aux=True)
    assert float(aux.load_balance_loss) == pytest.approx(want, rel=1e-5)
    assert float(aux.expert_counts.sum()) == (16 + 11) * 2 * 4  # valid tokens x k x sparse layers


def test_fused_expert_layout_loads_like_per_expert(tmp_path) -> None:
    """transformers 5's fused layout (``save_original_format=False``) loads to the same model."""
    make_moe(tmp_path / "per_expert", norm_topk_prob=True)
    make_moe(tmp_path / "fused", fused=True, norm_topk_prob=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in SafetensorsDir(tmp_path / "fused")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in SafetensorsDir(tmp_path / "per_expert")
    a, b = load_decoder(tmp_path / "per_expert"), load_decoder(tmp_path / "fused")
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_export_round_trip(tmp_path) -> None:
    """Export writes the per-expert names the source had, bit for bit, and transformers loads it."""
    make_moe(tmp_path / "hf", **CONFIGS["mixed"])
    model = load_decoder(tmp_path / "hf")
    export_hf(model, tmp_path / "out", json.loads((tmp_path / "hf" / "config.json").read_text()))
    src, back = SafetensorsDir(tmp_path / "hf"), SafetensorsDir(tmp_path / "out")
    assert set(src.weight_map) == set(back.weight_map)
    for name in src.weight_map:
        np.testing.assert_array_equal(src.get(name), back.get(name))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM" and reloaded.config.mlp_only_layers == [3]


def test_cached_forward_matches_full_forward_and_reports_the_same_experts(tmp_path) -> None:
    make_moe(tmp_path, **CONFIGS["mixed"])
    model = load_decoder(tmp_path)
    seq = np.random.default_rng(2).integers(0, VOCAB, (1, 10))
    full, _, aux = _forward(model, seq, with_moe_aux=True)
    graphdef, state = nnx.split(model)

    @jax.jit  # one compile for the four decode steps
    def cached(state, tokens, positions, cache):  # type: ignore[no-untyped-def]
        m = nnx.merge(graphdef, state)
        return m(tokens, positions, cache=cache, cache_rows=jnp.array([1]), with_moe_aux=True)

    cache = KVCache.zeros(model.arch, rows=2, max_len=16)
    h, cache, first = cached(state, jnp.asarray(seq[:, :6]), jnp.arange(6)[None], cache)
    hs, experts = [h], [first.experts]
    for t in range(6, 10):
        h, cache, step = cached(state, jnp.asarray(seq[:, t : t + 1]), jnp.array([[t]]), cache)
        hs.append(h)
        experts.append(step.experts)
    np.testing.assert_allclose(np.concatenate(hs, axis=1), np.asarray(full), atol=1e-5)
    np.testing.assert_array_equal(np.concatenate(experts, axis=1), np.asarray(aux.experts))


@pytest.mark.slow  # a training run per mode: the slow tier
def test_forced_routing_replays_changes_and_trains_the_router(tmp_path) -> None:
    """Routing replay: the recorded experts reproduce the logits; other experts change them;
    under forced routing the loss still has a gradient on every sparse layer's router."""
    make_moe(tmp_path, **CONFIGS["topk_normalised"])
    model = load_decoder(tmp_path)
    tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 12))
    hidden, _, aux = _forward(model, tokens, with_moe_aux=True)
    assert aux.experts.shape == (2, 12, 4, 2) and aux.router_entropy.shape == (2, 12, 4)
    replayed, _ = _forward(model, tokens, routing=aux.experts)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    shifted = (aux.experts + 1) % model.arch.num_experts  # every token to other experts
    other, _ = _forward(model, tokens, routing=shifted)
    assert np.abs(np.asarray(other) - np.asarray(hidden)).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(aux.router_choice), np.asarray(aux.experts))
    # forced: the experts used are the forced ones; the router's own pick is reported beside them
    # (the first sparse layer sees the same input, so its own choice is the unforced one)
    _, _, forced_aux = _forward(model, tokens, routing=shifted, with_moe_aux=True)
    np.testing.assert_array_equal(np.asarray(forced_aux.experts), np.asarray(shifted))
    np.testing.assert_array_equal(np.asarray(forced_aux.router_choice)[:, :, 0], np.asarray(aux.experts)[:, :, 0])

    graphdef, state = nnx.split(model)

    def loss(state: nnx.State) -> jax.Array:
        m = nnx.merge(graphdef, state)
        h, _ = _forward(m, tokens, routing=shifted)
        return jnp.mean(m.logits(h)[..., 0] ** 2)

    grads = jax.grad(loss)(state)
    router = np.asarray(grads["router"][...])
    assert router.shape[0] == 4 and all(np.abs(router[i]).max() > 0 for i in range(4))


def test_bad_routing_shape_fails_with_one_line(tmp_path) -> None:
    make_moe(tmp_path)
    model = load_decoder(tmp_path)
    tokens = np.zeros((1, 5), np.int32)
    with pytest.raises(ValueError, match=re.escape("routing must be int [B, T, n_moe_layers, k] = [1, 5, 4, 2]")):
        _forward(model, tokens, routing=jnp.zeros((1, 5, 4, 3), jnp.int32))


BASE = {"model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16,
        "num_experts": 6, "num_experts_per_tok": 2}  # fmt: skip


@pytest.mark.parametrize(("change", "needle"), [
    ({"num_experts_per_tok": 7}, "num_experts_per_tok = 7 must be in [1, num_experts = 6]"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok = 0 must be in [1, num_experts = 6]"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size = 0 must be >= 1"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0 must be >= 1"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers = [4] must list distinct layer indices in [0, 4)"),
    ({"mlp_only_layers": [1, 1]}, "mlp_only_layers = [1, 1] must list distinct"),
    ({"num_experts": -1}, "num_experts = -1 must be >= 0"),
    ({"router_aux_loss_coef": float("nan")}, "router_aux_loss_coef = nan must be a finite number >= 0"),
    ({"shared_expert_intermediate_size": 64}, "shared experts are not supported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported for qwen3_moe"),
])  # fmt: skip
def test_bad_moe_config_fails_at_load_naming_the_field(change, needle) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)) as err:
        arch_from_hf_config({**BASE, **change})
    assert "\n" not in str(err.value)


def test_config_fields_and_active_parameter_count() -> None:
    """transformers 5 writes num_experts as num_local_experts; both read. Active parameters count
    k experts (and the router), all parameters every expert."""
    cfg = moe_config(num_experts=8, decoder_sparse_step=2).to_dict()
    assert "num_local_experts" in cfg
    arch = arch_from_hf_config(cfg)
    assert arch.num_experts == 8 and arch.moe_layers == (1, 3) and arch.dense_layers == (0, 2)
    expert = 3 * 32 * 16
    assert arch.num_params() - arch.num_active_params() == 2 * (8 - 2) * expert
    dense = arch_from_hf_config({**cfg, "num_local_experts": 0})
    assert not dense.is_moe and dense.num_params() - arch.num_active_params() == 2 * (3 * 32 * 48 - 2 * expert - 32 * 8)


def test_scratch_moe_twin_of_the_main_job_has_its_active_parameter_count() -> None:
    """``[model.scratch] num_experts = 12``: the main job's model with 12 experts, 2 per token, of the
    width that keeps the active parameters equal (190); MoE fields without experts fail in one line."""
    from jaxrl.cli import build_config
    from jaxrl.models.setup import scratch_hf_config
    from jaxrl.models.tiny import REVERSE_TEXT_MOE

    dense = build_config({"model": {"scratch": {}}}, []).model.scratch
    moe = build_config({"model": {"scratch": {"num_experts": 12}}}, []).model.scratch
    assert (moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (2, 190, True)
    assert moe.moe_intermediate_size == REVERSE_TEXT_MOE["moe_intermediate_size"]
    a, b = (arch_from_hf_config(scratch_hf_config(s, vocab_size=320)) for s in (dense, moe))
    assert b.model_type == "qwen3_moe" and b.num_active_params() == a.num_params() and b.num_params() > 4 * a.num_params()
    for bad, needle in [
        ({"num_experts_per_tok": 2}, "num_experts_per_tok set but num_experts = 0"),
        ({"num_experts": 13}, "no expert width gives the active parameters of intermediate_size = 384"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok = 5 must be <= num_experts = 4"),
    ]:
        with pytest.raises(ValueError, match=re.escape(needle)):
            build_config({"model": {"scratch": bad}}, [])


@pytest.mark.slow  # the MoE sharded invariants run in the slow tier (the dense ones in the fast tier)
def test_sharded_moe_loss_and_gradients_equal_one_device() -> None:
    """Expert weights under the data x fsdp x tensor rules (experts whole, embed over fsdp, each
    expert's width over tensor): loss and every gradient as on one device, a mixed model, with the
    load-balance loss in the objective so the router gets both gradients."""
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.sharding import shard_params
    from jaxrl.models.tiny import qwen3_moe_config
    from jaxrl.parallel.mesh import MeshConfig, make_mesh

    cfg = qwen3_moe_config(vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=2)  # fmt: skip
    graphdef, state = nnx.split(Decoder(arch_from_hf_config(cfg.to_dict()), rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (4, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)

    def run(mesh):  # type: ignore[no-untyped-def]
        kernels = Kernels.create("auto", field="trainer.kernels", mesh=mesh)

        def loss(state):  # type: ignore[no-untyped-def]
            m = nnx.merge(graphdef, state)
            hidden, _, aux = m(tokens, positions, kernels=kernels, with_moe_aux=True)
            return jnp.mean(m.logits(hidden) ** 2) + 0.01 * aux.load_balance_loss

        return jax.jit(jax.value_and_grad(loss))(state if mesh is None else shard_params(state, mesh))

    (want, want_g), (got, got_g) = run(None), run(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), jax.devices()[:8]))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(got_g), strict=True):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(a).max()) + 1e-9

"""Logit parity with transformers (torch CPU) and HF round trips, per model family."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxrl.models.hf_io import SafetensorsDir, export_hf, load_decoder

torch = pytest.importorskip("torch")  # every test compares with (or builds its checkpoint in) torch

FAMILIES = {
    "qwen3": dict(
        cls="Qwen3Config", head_dim=16, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
    ),
    "llama": dict(
        cls="LlamaConfig",
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # Long-context scalings as the checkpoints ship them (max_position_embeddings 128 = 2 x 64).
    # theta 100 and an original length of 64 put YaRN's ramp across dimensions 0..5 of 8.
    "qwen3_yarn": dict(
        cls="Qwen3Config", head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0, "original_max_position_embeddings": 64},
    ),
    "qwen2_yarn_explicit": dict(
        cls="Qwen2Config", tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0, "original_max_position_embeddings": 64,
                         "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0},
    ),
    "llama_linear": dict(
        cls="LlamaConfig", head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    ),
}  # fmt: skip


def make_hf_model(family: str, out_dir, *, sharded: bool = False) -> transformers.PreTrainedModel:
    spec = dict(FAMILIES[family])
    cfg_cls = getattr(transformers, spec.pop("cls"))
    cfg = cfg_cls(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **spec,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # non-trivial norms and biases so every weight is tested
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir, max_shard_size="20KB" if sharded else "1GB")
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family: str, tmp_path) -> None:
    hf = make_hf_model(family, tmp_path)
    ours = load_decoder(tmp_path)
    rng = np.random.default_rng(0)
    length = 96 if "_" in family else 24  # the scaled ones past their original 64 positions
    tokens = rng.integers(0, 97, size=(2, length))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(length), (2, length))
    hidden, _ = ours(jnp.asarray(tokens), jnp.asarray(positions))
    got = np.asarray(ours.logits(hidden))
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize(("rope", "needle"), [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_parameters.rope_type 'dynamic' is not supported (NTK-dynamic"),
    ({"rope_type": "longrope", "factor": 2.0}, "supported: 'default', 'linear', 'llama3', 'yarn'"),
    ({"rope_type": "linear"}, "rope_type 'linear' needs factor"),
    ({"rope_type": "yarn", "factor": -1.0}, "rope_parameters.factor must be > 0"),
])  # fmt: skip
def test_unsupported_or_incomplete_rope_scaling_fails_at_load_naming_the_field(rope, needle) -> None:
    from jaxrl.models.arch import arch_from_hf_config

    cfg = {"model_type": "qwen3", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 128, "rope_parameters": {"rope_theta": 1e6, **rope}}  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(needle)):
        arch_from_hf_config(cfg)


def test_legacy_rope_scaling_field_is_read_like_rope_parameters() -> None:
    """Older config.json files carry ``rope_scaling`` (with ``type``) and a top-level rope_theta."""
    from jaxrl.models.arch import arch_from_hf_config

    base = {"model_type": "qwen2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 131072, "rope_theta": 1e6}  # fmt: skip
    legacy = arch_from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    new = arch_from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                           "original_max_position_embeddings": 32768}})  # fmt: skip
    assert legacy == new and new.rope_attention_scale() == pytest.approx(0.1 * np.log(4.0) + 1)
    assert not np.allclose(new.inv_freq(), arch_from_hf_config(base).inv_freq())


def test_sharded_index_load_and_roundtrip(tmp_path) -> None:
    make_hf_model("llama", tmp_path / "hf", sharded=True)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    model = load_decoder(tmp_path / "hf")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    export_hf(model, tmp_path / "out", hf_cfg, max_shard_bytes=30_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    src, back = SafetensorsDir(tmp_path / "hf"), SafetensorsDir(tmp_path / "out")
    assert set(src.weight_map) == set(back.weight_map)
    for name in src.weight_map:
        np.testing.assert_array_equal(src.get(name), back.get(name))
    again = load_decoder(tmp_path / "out")
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.tie_word_embeddings is False


def test_packed_segments_do_not_attend_across(tmp_path) -> None:
    """Two samples packed in one row give the logits each gives alone (positions restart)."""
    make_hf_model("qwen3", tmp_path)
    model = load_decoder(tmp_path)
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 97, 7), rng.integers(0, 97, 5)
    packed = np.concatenate([a, b])[None]
    positions = np.concatenate([np.arange(7), np.arange(5)])[None]
    segments = np.array([[1] * 7 + [2] * 5])
    hidden, _ = model(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments))
    got = np.asarray(model.logits(hidden))[0]
    for seq, sl in ((a, slice(0, 7)), (b, slice(7, 12))):
        h, _ = model(jnp.asarray(seq[None]), jnp.arange(len(seq))[None])
        np.testing.assert_allclose(got[sl], np.asarray(model.logits(h))[0], atol=1e-5)


def test_kv_cache_decode_matches_full_forward(tmp_path) -> None:
    """Prefill + token-by-token decode through the cache equals one full forward."""
    from jaxrl.models.kv_cache import KVCache

    make_hf_model("qwen2", tmp_path)
    model = load_decoder(tmp_path)
    seq = np.random.default_rng(2).integers(0, 97, 10)
    full, _ = model(jnp.asarray(seq[None]), jnp.arange(10)[None])
    want = np.asarray(model.logits(full))[0]
    cache = KVCache.zeros(model.arch, rows=3, max_len=16)
    row = jnp.array([1])
    h, cache = model(jnp.asarray(seq[None, :6]), jnp.arange(6)[None], cache=cache, cache_rows=row)
    got = [np.asarray(model.logits(h))[0]]
    for t in range(6, 10):
        h, cache = model(jnp.asarray(seq[None, t : t + 1]), jnp.array([[t]]), cache=cache, cache_rows=row)
        got.append(np.asarray(model.logits(h))[0])
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5)

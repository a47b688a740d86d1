"""LoRA adapters exported in PEFT format: ``PeftModel.from_pretrained(base, adapter_dir)`` gives
the logits of the merged export (transformers) and of jaxrl's own merged model."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors.numpy import load_file

from jaxrl.models.hf_io import export_hf, load_decoder
from jaxrl.models.sharding import param_sharding_fn
from jaxrl.models.tiny import qwen3_config, save_random_checkpoint
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer.lora import TARGETS, LoraConfig, adapter_shapes, adapter_shardings, merged
from jaxrl.trainer.peft_export import export_peft_adapter

# The reference: PEFT loads the exported adapter onto a transformers model.
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

VOCAB = 97


def _tiny_hf(out_dir, family: str) -> None:
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    cfg = transformers.LlamaConfig(**common)
    if family == "qwen3":
        cfg = qwen3_config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        )  # fmt: skip
    save_random_checkpoint(out_dir, cfg, seed=0)


def _trained_adapters(model, lora_cfg: LoraConfig, mesh) -> dict:
    """Adapters as training leaves them (B nonzero), seeded, sharded as ``init_adapters`` shards
    them; made on the host (no per-weight compiles)."""
    rng = np.random.default_rng(7)
    state = nnx.state(model)
    out = {}
    for name, shardings in adapter_shardings(state, lora_cfg, mesh).items():
        a_shape, b_shape = adapter_shapes(name, tuple(state[name][...].shape), lora_cfg.rank)
        a = rng.normal(size=a_shape) / np.sqrt(np.prod(a_shape[1:-1]))
        b = 0.05 * rng.normal(size=b_shape)
        out[name] = {"a": jax.device_put(a.astype(np.float32), shardings["a"]),
                     "b": jax.device_put(b.astype(np.float32), shardings["b"])}  # fmt: skip
    return out


def _jax_logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(jnp.asarray(tokens), jnp.asarray(positions))
    return np.asarray(model.logits(hidden))


def _torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize(("family", "targets"), [
    ("qwen3", list(TARGETS)),
    ("qwen3", ["o_proj", "q_proj", "down_proj"]),  # a subset, out of TARGETS' order
    ("llama", list(TARGETS)),
])  # fmt: skip
def test_peft_adapter_matches_the_merged_model(tmp_path, family, targets) -> None:
    _tiny_hf(tmp_path / "src", family)
    hf_config = json.loads((tmp_path / "src" / "config.json").read_text())
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))  # sharded adapters are gathered
    model = load_decoder(tmp_path / "src", sharding_fn=param_sharding_fn(mesh))
    lora_cfg = LoraConfig(rank=4, alpha=12, target_modules=targets, seed=1)
    adapters = _trained_adapters(model, lora_cfg, mesh)
    assert not adapters["wq" if "q_proj" in targets else "wo"]["a"].sharding.is_fully_replicated

    export_hf(model, tmp_path / "base", hf_config)
    out = export_peft_adapter(adapters, lora_cfg, model.arch, tmp_path / "adapter",
                              base_model_name_or_path=str(tmp_path / "base"))  # fmt: skip
    graphdef, state = nnx.split(model)
    merged_model = nnx.merge(graphdef, jax.jit(merged, static_argnums=2)(state, adapters, lora_cfg.scale))
    export_hf(merged_model, tmp_path / "merged", hf_config)

    # The files: PEFT's config, and only the targeted modules' A [r, in] and B [out, r].
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 12, False)
    assert sorted(config["target_modules"]) == sorted(targets)
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    tensors = load_file(out / "adapter_model.safetensors")
    assert len(tensors) == 2 * 2 * len(targets)  # layers x (A, B) x modules
    assert {k.split(".")[-3] for k in tensors} == set(targets)
    q = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"
    if "q_proj" in targets:
        assert tensors[q.format("A")].shape == (4, 64) and tensors[q.format("B")].shape == (4 * 16, 4)
    o = "base_model.model.model.layers.0.self_attn.o_proj.lora_{}.weight"
    assert tensors[o.format("A")].shape == (4, 4 * 16) and tensors[o.format("B")].shape == (64, 4)

    # PEFT loads every tensor (none missing, none left over) ...
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16))
    base_logits = _torch_logits(base_hf, tokens)
    peft_model = peft.PeftModel.from_pretrained(base_hf, out).eval()
    loaded = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert sorted(loaded) == sorted(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(loaded[k].numpy(), v)
    # ... and base + adapter is the merged model, in transformers and in jaxrl.
    got = _torch_logits(peft_model, tokens)
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    want_hf = _torch_logits(merged_hf, tokens)
    want_jax = _jax_logits(merged_model, tokens)
    assert np.abs(got - want_hf).max() <= 1e-4
    assert np.abs(got - want_jax).max() <= 1e-4
    assert np.abs(got - base_logits).max() > 1e-2  # the adapters matter


def test_adapters_must_match_target_modules(tmp_path) -> None:
    _tiny_hf(tmp_path / "src", "qwen3")
    mesh = make_mesh(MeshConfig(num_devices=1))
    model = load_decoder(tmp_path / "src")
    adapters = _trained_adapters(model, LoraConfig(rank=2, target_modules=["q_proj"]), mesh)
    with pytest.raises(ValueError, match="do not match target_modules"):
        export_peft_adapter(
            adapters, LoraConfig(rank=2, target_modules=["q_proj", "v_proj"]), model.arch, tmp_path / "a"
        )

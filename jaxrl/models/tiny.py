"""The one way jaxrl, its tests and its benchmarks describe a Qwen3-shaped model (dense, or
Qwen3-MoE) and write a random checkpoint of it.

The config is transformers' own ``Qwen3Config`` (so every loader, ours, transformers' and
vLLM's, reads the same file); the random weights are written by transformers too, which needs
torch (a test/benchmark dependency only: ``save_random_checkpoint`` imports it lazily). Where
torch is not installed (the Python 3.12 test environment), jaxrl's own initialisation writes the
checkpoint instead, in the same format, so tests that need only a checkpoint still run there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig

# The reverse_text main job's dense model (configs/reverse_text/sft.toml [model.scratch]) and its
# mixture-of-experts twin with the same ACTIVE parameter count (for the learning comparison):
# 12 experts, 2 per token, each 190 wide: 2 * 3 * 128 * 190 + the router's 128 * 12 = 3 * 128 * 384,
# so a token runs exactly as many weights as in the dense MLP (``ModelArch.num_active_params``).
REVERSE_TEXT_DENSE = {"hidden_size": 128, "intermediate_size": 384, "num_layers": 4, "num_heads": 4,
                      "num_kv_heads": 2, "head_dim": 32}  # fmt: skip
REVERSE_TEXT_MOE = {**REVERSE_TEXT_DENSE, "num_experts": 12, "num_experts_per_tok": 2, "moe_intermediate_size": 190}


def qwen3_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    rope_theta: float = 1e6,
    config_class: type[PretrainedConfig] | None = None,
    **extra: Any,
) -> Qwen3Config:
    """A Qwen3 config; ``head_dim`` defaults to hidden / heads and the MLP to 3 x hidden.
    ``extra`` passes any other ``Qwen3Config`` field (token ids, ``rms_norm_eps``, ...).
    ``architectures`` is always set: loaders that dispatch on it (vLLM) treat a config without
    it as an embedding model. ``config_class``: the transformers class to build (Qwen3-MoE's
    adds its expert fields through ``extra``)."""
    from transformers import Qwen3Config

    extra.setdefault("architectures", ["Qwen3ForCausalLM"])
    return (config_class or Qwen3Config)(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        **extra,
    )


def qwen3_moe_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    num_experts: int,
    num_experts_per_tok: int,
    moe_intermediate_size: int,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: tuple[int, ...] = (),
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    rope_theta: float = 1e6,
    **extra: Any,
) -> Qwen3MoeConfig:
    """A Qwen3-MoE config (transformers' ``Qwen3MoeConfig``): ``qwen3_config``'s fields plus the
    experts. ``norm_topk_prob`` defaults to True, as the released Qwen3-MoE checkpoints set it
    (transformers' own default is False); ``intermediate_size`` (the dense layers' MLP, used only
    with ``decoder_sparse_step`` > 1 or ``mlp_only_layers``) defaults to 3 x hidden."""
    from transformers import Qwen3MoeConfig

    extra.setdefault("architectures", ["Qwen3MoeForCausalLM"])
    return qwen3_config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_theta=rope_theta, config_class=Qwen3MoeConfig, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=list(mlp_only_layers), **extra,
    )


def save_random_checkpoint(
    out_dir: str | Path, config: PretrainedConfig, *, seed: int = 0, embed_scale: float = 1.0
) -> int:
    """Writes a seeded random model of ``config`` to ``out_dir`` in float32 (HF safetensors) and
    returns its parameter count. ``embed_scale`` > 1 makes logits peakier than the default
    initialisation, so sampled outputs depend on the weights. transformers (torch) writes it;
    without torch, jaxrl's decoder initialisation and ``export_hf`` do (other random values)."""
    try:
        import torch
    except ImportError:
        return _save_with_jaxrl(out_dir, config, seed=seed, embed_scale=embed_scale)
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    if embed_scale != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(embed_scale)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def _save_with_jaxrl(out_dir: str | Path, config: PretrainedConfig, *, seed: int, embed_scale: float) -> int:
    import jax
    from flax import nnx

    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.hf_io import export_hf

    hf_config = config.to_dict()
    model = Decoder(arch_from_hf_config(hf_config), rngs=nnx.Rngs(seed))
    model.embed.value = model.embed.value * embed_scale
    export_hf(model, out_dir, hf_config)
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

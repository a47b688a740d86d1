"""Architectures of released checkpoints, for planning without their weights.

``jaxrl.aot`` compiles a run's programs from ``config.json`` alone; when a recipe's ``[model]
name`` has not been downloaded yet, the config of the checkpoint it names (by the directory's
last component, e.g. ``models/Qwen3-8B``) comes from here. The values are those of the
checkpoints' published ``config.json`` files; a downloaded ``config.json`` always wins.
"""

from __future__ import annotations

from typing import Any

# name -> (hidden, intermediate, layers, heads, kv_heads, tie_word_embeddings)
_QWEN3 = {
    "Qwen3-0.6B": (1024, 3072, 28, 16, 8, True),
    "Qwen3-1.7B": (2048, 6144, 28, 16, 8, True),
    "Qwen3-4B": (2560, 9728, 36, 32, 8, True),
    "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
    "Qwen3-14B": (5120, 17408, 40, 40, 8, False),
    "Qwen3-32B": (5120, 25600, 64, 64, 8, False),
}

# Qwen3-MoE: name -> (hidden, layers, heads, kv_heads, experts, experts per token, expert width)
# (every layer sparse, norm_topk_prob true, untied, as the released config.json files have them).
_QWEN3_MOE = {
    "Qwen3-30B-A3B": (2048, 48, 32, 4, 128, 8, 768),
    "Qwen3-235B-A22B": (4096, 94, 64, 4, 128, 8, 1536),
}

PRESETS = (*_QWEN3, *_QWEN3_MOE)


def preset_heads(name: str) -> tuple[int, int] | None:
    """(attention heads, KV heads) of the released checkpoint ``name`` (as ``preset_hf_config``
    matches it); None when it is not one of ``PRESETS``. Needs nothing beyond the standard
    library, so ``launch/gke/render.py`` can size vLLM's tensor parallelism from it."""
    key = name.rstrip("/").split("/")[-1]
    if key in _QWEN3_MOE:
        return _QWEN3_MOE[key][2], _QWEN3_MOE[key][3]
    return (_QWEN3[key][3], _QWEN3[key][4]) if key in _QWEN3 else None


def with_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """``cfg`` (an HF config dict) cut to its first ``layers`` layers, its per-layer lists with
    it: transformers >= 5.17 refuses a config whose ``layer_types`` outnumber its layers (the
    first H200 device check failed on that)."""
    if not 0 < layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"with_layers: {layers} layers of {cfg['num_hidden_layers']}")
    out = {**cfg, "num_hidden_layers": layers}
    if "max_window_layers" in out:
        out["max_window_layers"] = min(out["max_window_layers"], layers)
    if "layer_types" in out:
        out["layer_types"] = list(out["layer_types"][:layers])
    return out


def preset_hf_config(name: str) -> dict[str, Any] | None:
    """config.json of the released checkpoint ``name`` ("Qwen3-8B", "Qwen/Qwen3-8B" or a path
    ending in it); None when it is not one of ``PRESETS``."""
    key = name.rstrip("/").split("/")[-1]
    if key in _QWEN3_MOE:
        return _qwen3_moe_preset(key)
    if key not in _QWEN3:
        return None
    from jaxrl.models.tiny import qwen3_config

    d, f, layers, heads, kv, tie = _QWEN3[key]
    return qwen3_config(
        vocab_size=151936,
        hidden_size=d,
        intermediate_size=f,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        rope_theta=1000000.0,
        bos_token_id=151643,
        eos_token_id=151645,
    ).to_dict()


def _qwen3_moe_preset(key: str) -> dict[str, Any]:
    from jaxrl.models.tiny import qwen3_moe_config

    d, layers, heads, kv, experts, top_k, width = _QWEN3_MOE[key]
    return qwen3_moe_config(
        vocab_size=151936,
        hidden_size=d,
        intermediate_size=3 * d,  # unused: every layer is sparse (the released configs say 6144 / 12288)
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=128,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        bos_token_id=151643,
        eos_token_id=151645,
    ).to_dict()

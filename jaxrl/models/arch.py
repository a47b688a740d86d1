"""Decoder architecture read from a Hugging Face ``config.json``.

One frozen description covers the three families we serve: Qwen3 (q/k RMSNorm), Llama 3
(RoPE frequency scaling) and Qwen2.5 (bias on q/k/v). Everything is read from the config;
family defaults are never assumed (transformers 5 keeps RoPE settings in ``rope_parameters``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_MODEL_TYPES = ("qwen3", "llama", "qwen2")


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # llama3-style scaling, as sorted items
    qk_norm: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (fwd + bwd = 3x forward): 6 * matmul params + attention."""
        d, hd = self.hidden_size, self.head_dim
        matmul_params = self.num_layers * (
            d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * self.intermediate_size
        ) + d * self.vocab_size
        attn = self.num_layers * 2 * 2 * self.num_heads * hd * seq_len / 2  # causal: half the scores
        return 6.0 * matmul_params + 3.0 * attn

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, with Llama-3 frequency scaling when configured."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_scaling is None:
            return inv.astype(np.float32)
        sc = dict(self.rope_scaling)
        factor = float(sc["factor"])
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    params = cfg.get("rope_parameters") or {}
    legacy = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"config.json rope type {rope_type!r} is not supported; supported: 'default', 'llama3'"
        )
    src = params if "factor" in params else legacy
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), tuple(sorted((k, src[k]) for k in keys if k in src))


def arch_from_hf_config(cfg: dict[str, Any] | Any) -> ModelArch:
    """Build a ``ModelArch`` from a config dict or a ``transformers.PretrainedConfig``."""
    if not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope_settings(cfg)
    if model_type != "qwen2" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError("config.json attention_bias/mlp_bias = true is not supported for Llama/Qwen3")
    return ModelArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=model_type == "qwen3",
        qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
    )


def load_arch(model_dir: str | Path) -> ModelArch:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"[model] name: no config.json in {model_dir!s}; point it at a HF model directory")
    return arch_from_hf_config(json.loads(path.read_text()))

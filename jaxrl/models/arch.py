"""Decoder architecture read from a Hugging Face ``config.json``.

One frozen description covers the three families we serve: Qwen3 (q/k RMSNorm), Llama 3
(RoPE frequency scaling) and Qwen2.5 (bias on q/k/v). Everything is read from the config;
family defaults are never assumed (transformers 5 keeps RoPE settings in ``rope_parameters``).

RoPE scalings: the ones these families' checkpoints ship with — "default", "linear", "llama3"
(Llama 3.1+) and "yarn" (Qwen3 / Qwen2.5 beyond 32k) — computed as transformers'
``modeling_rope_utils`` does. "dynamic" (NTK) is refused: its frequencies change with the batch's
length, so one compiled program cannot serve every length; "longrope" and "proportional" belong to
other families.
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
    rope_scaling: tuple[tuple[str, Any], ...] | None  # rope_type + its parameters, as sorted items
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
        """RoPE inverse frequencies, with the configured scaling ("linear", "llama3", "yarn")."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_scaling is None:
            return inv.astype(np.float32)
        sc = dict(self.rope_scaling)
        if sc["rope_type"] == "linear":
            return (inv / float(sc["factor"])).astype(np.float32)
        if sc["rope_type"] == "yarn":
            return _yarn_inv_freq(inv, self.head_dim, self.rope_theta, sc).astype(np.float32)
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

    def rope_attention_scale(self) -> float:
        """The factor YaRN multiplies cos/sin by (its attention temperature); 1 for the rest."""
        if self.rope_scaling is None or dict(self.rope_scaling)["rope_type"] != "yarn":
            return 1.0
        sc = dict(self.rope_scaling)
        if sc.get("attention_factor") is not None:
            return float(sc["attention_factor"])
        factor, mscale, mscale_all_dim = float(sc["factor"]), sc.get("mscale"), sc.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        return _yarn_mscale(factor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv: np.ndarray, dim: int, base: float, sc: dict[str, Any]) -> np.ndarray:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by ``factor``, keep the high ones,
    with a linear ramp between the dimensions that turn ``beta_slow`` and ``beta_fast`` times over
    the original context (transformers' ``_compute_yarn_parameters``)."""
    factor, old_len = float(sc["factor"]), float(sc["original_max_position_embeddings"])
    beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate


# Per scaling: (required, optional) parameter names, as transformers spells them.
_ROPE_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "original_max_position_embeddings"), ("low_freq_factor", "high_freq_factor")),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """``rope_theta`` and the scaling from ``rope_parameters`` (transformers 5) or the legacy
    ``rope_scaling`` / top-level fields (older checkpoints' config.json), checked here at load."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type not in _ROPE_PARAMS:
        why = " (NTK-dynamic changes frequencies with each batch's length; use 'yarn')" if rope_type == "dynamic" else ""
        raise ValueError(
            f"config.json rope_parameters.rope_type {rope_type!r} is not supported{why}; "
            f"supported: 'default', {', '.join(repr(t) for t in _ROPE_PARAMS)}"
        )
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("config.json partial_rotary_factor != 1 is not supported (Qwen3 / Llama 3 / Qwen2.5 rotate whole heads)")
    src = params if "factor" in params else legacy
    src = {**src, **({"original_max_position_embeddings": cfg["original_max_position_embeddings"]}
                     if "original_max_position_embeddings" in cfg else {})}  # fmt: skip
    required, optional = _ROPE_PARAMS[rope_type]
    if rope_type == "yarn":  # transformers' defaults: the model's length is the original one
        src.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
        if src.get("factor") is None and src.get("original_max_position_embeddings"):
            src["factor"] = float(cfg["max_position_embeddings"]) / float(src["original_max_position_embeddings"])
    missing = [k for k in required if src.get(k) is None]
    if missing:
        raise ValueError(f"config.json rope_parameters: rope_type {rope_type!r} needs {', '.join(missing)}")
    if float(src["factor"]) <= 0:
        raise ValueError(f"config.json rope_parameters.factor must be > 0, got {src['factor']!r}")
    items = [("rope_type", rope_type)] + [(k, src[k]) for k in (*required, *optional) if src.get(k) is not None]
    return float(theta), tuple(sorted(items))


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

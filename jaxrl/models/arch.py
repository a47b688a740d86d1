"""Decoder architecture read from a Hugging Face ``config.json``.

One frozen description covers the families we serve: Qwen3 (q/k RMSNorm), Qwen3-MoE (Qwen3
with top-k routed experts in place of the MLP on its sparse layers), Llama 3 (RoPE frequency
scaling) and Qwen2.5 (bias on q/k/v). Everything is read from the config; family defaults are
never assumed (transformers 5 keeps RoPE settings in ``rope_parameters``, and writes Qwen3-MoE's
``num_experts`` as ``num_local_experts``).

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

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "llama", "qwen2")


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
    # Mixture of experts (Qwen3-MoE; transformers' ``Qwen3MoeConfig`` names). num_experts = 0: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the sparse (routed-experts) layers, as transformers' ``Qwen3MoeDecoderLayer``
        decides: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
        if self.num_experts <= 0:
            return ()
        step, dense = self.decoder_sparse_step, set(self.mlp_only_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense and (i + 1) % step == 0)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a dense MLP (every layer of a dense model)."""
        sparse = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def layer_runs(self) -> tuple[tuple[bool, int, int, int], ...]:
        """The layers as contiguous runs of one kind: ``(sparse, start, stop, first)`` where
        ``first`` indexes the run's first layer in its kind's weight stack (the dense MLPs' or
        the experts'). The decoder scans each run; a dense model is one run."""
        sparse = set(self.moe_layers)
        runs: list[tuple[bool, int, int, int]] = []
        seen = {True: 0, False: 0}
        for i in range(self.num_layers):
            kind = i in sparse
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], i + 1, runs[-1][3])
            else:
                runs.append((kind, i, i + 1, seen[kind]))
            seen[kind] += 1
        return tuple(runs)

    def _params(self, experts: int) -> int:
        """Parameter count with ``experts`` experts' MLPs per sparse layer (embedding counted
        once when tied)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        mlp = len(self.dense_layers) * 3 * d * f
        mlp += len(self.moe_layers) * (experts * 3 * d * self.moe_intermediate_size + d * self.num_experts)
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * (attn + 2 * d) + mlp + d + head

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied; every expert counted)."""
        return self._params(self.num_experts)

    def num_active_params(self) -> int:
        """Parameters one token uses: ``num_params`` with ``num_experts_per_tok`` experts per
        sparse layer (the router counted whole); equal to ``num_params`` for a dense model."""
        return self._params(self.num_experts_per_tok)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (fwd + bwd = 3x forward): 6 * active matmul params + attention."""
        d, hd = self.hidden_size, self.head_dim
        mlp = len(self.dense_layers) * 3 * d * self.intermediate_size + len(self.moe_layers) * (
            self.num_experts_per_tok * 3 * d * self.moe_intermediate_size + d * self.num_experts
        )
        matmul_params = self.num_layers * d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + mlp + d * self.vocab_size
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
    num_layers = int(cfg["num_hidden_layers"])
    moe = _moe_settings(cfg, num_layers) if model_type == "qwen3_moe" else {}
    return ModelArch(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        **moe,
    )


def _moe_settings(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert fields, range-checked at load (one line naming the field). transformers
    5 writes ``num_experts`` as ``num_local_experts``; either is read."""
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    width = int(cfg.get("moe_intermediate_size") or 0)
    step = 1 if cfg.get("decoder_sparse_step") is None else int(cfg["decoder_sparse_step"])
    dense = cfg.get("mlp_only_layers") or []
    coef = float(cfg.get("router_aux_loss_coef") or 0.0)
    if experts < 0:
        raise ValueError(f"config.json num_experts = {experts} must be >= 0 (0: every layer a dense MLP)")
    if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
        raise ValueError("config.json shared experts are not supported (Qwen3-MoE has none; Qwen2-MoE is not served)")
    if str(cfg.get("hidden_act", "silu")) != "silu":
        raise ValueError(f"config.json hidden_act = {cfg.get('hidden_act')!r} is not supported for qwen3_moe (silu only)")
    if experts > 0:
        if not 1 <= top_k <= experts:
            raise ValueError(
                f"config.json num_experts_per_tok = {top_k} must be in [1, num_experts = {experts}]"
            )
        if width < 1:
            raise ValueError(f"config.json moe_intermediate_size = {width} must be >= 1")
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step = {step} must be >= 1")
    bad = [i for i in dense if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < num_layers]
    if bad or len(set(dense)) != len(dense):
        raise ValueError(
            f"config.json mlp_only_layers = {dense!r} must list distinct layer indices in [0, {num_layers})"
        )
    if not math.isfinite(coef) or coef < 0:
        raise ValueError(f"config.json router_aux_loss_coef = {coef!r} must be a finite number >= 0")
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k if experts else 0,
        "moe_intermediate_size": width if experts else 0,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(sorted(dense)),
        "router_aux_loss_coef": coef,
    }


def load_arch(model_dir: str | Path) -> ModelArch:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"[model] name: no config.json in {model_dir!s}; point it at a HF model directory")
    return arch_from_hf_config(json.loads(path.read_text()))

"""LoRA: low-rank adapters on the attention and MLP projections, the base weights frozen.

Each targeted weight ``W`` (stacked over layers, ``[L, *in, *out]`` as the decoder stores it)
gets ``A`` ``[L, *in, r]`` (random, seeded) and ``B`` ``[L, r, *out]`` (zeros, so step 0 is the
base model exactly); the model the loss sees uses ``W + (alpha / r) * A @ B``. Only the adapters
are trained: the optimizer state holds them alone, the gradient accumulator is adapter-sized,
and the base weights are never updated (bit-identical after any number of steps).

The training forward merges each layer's adapters into that layer's weights inside the
decoder's layer scan (``Decoder.__call__(lora=LayerAdapters(...))``): the layer then runs the
decoder's ordinary matmuls (and Pallas kernels) on merged weights, sharded as the base weights
are, and only one layer's merged weights (and, backwards, one layer's weight gradient) exist at
a time, for a rank-r matmul per weight and layer (recomputed in the backward pass under remat).
Merging the stacked weights up front instead held a merged copy of every adapted weight and its
gradient per micro-step (Qwen3-8B, rank 16, v5e-8, 16 rows of 2048 tokens: 13.68 -> 8.96 GiB
per chip in ``jaxrl.aot``; 4096 tokens 17.67 -> 11.12 GiB, now fitting). A separate low-rank path
in every projection (as PEFT or qwix do) would save even the per-layer copy but duplicate the
decoder's forward. ``merged`` (the whole model at once) gives the weights that serve rollouts
and that ``export_hf`` writes: engines and Hugging Face see an ordinary model.

Adapters are sharded by the same logical-axis rules as the weights they adapt (the rank axis
replicated), so an FSDP/tensor-parallel mesh never holds an unsharded copy of either.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxrl.models.decoder import PARAM_LOGICAL_AXES, param_name
from jaxrl.models.layers import lora_merge
from jaxrl.parallel.rules import LOGICAL_RULES, logical_to_spec

# Hugging Face module name -> (decoder weight, number of input axes after the layer axis).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("wq", 1),
    "k_proj": ("wk", 1),
    "v_proj": ("wv", 1),
    "o_proj": ("wo", 2),
    "gate_proj": ("w_gate", 1),
    "up_proj": ("w_up", 1),
    "down_proj": ("w_down", 1),
}
RANK_AXIS = "lora_rank"
_RULES = {**LOGICAL_RULES, RANK_AXIS: ()}  # the rank axis is small: replicated


class LoraConfig(BaseModel):
    """``[trainer.lora]``: train low-rank adapters instead of the full weights (prime-rl's and
    PEFT's names: ``rank``, ``alpha``, ``target_modules``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    rank: int = Field(16, ge=1, le=4096)
    """Adapter rank r."""
    alpha: float = Field(32.0, gt=0, le=1e6, allow_inf_nan=False)
    """Scale numerator: the update is ``(alpha / rank) * A @ B``."""
    target_modules: list[str] = Field(default_factory=lambda: list(TARGETS))
    """Projections that get adapters, by Hugging Face name (default: all seven)."""
    seed: int = Field(0, ge=0)
    """Seed of the random ``A`` initialisation."""

    @field_validator("target_modules")
    @classmethod
    def _known_targets(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in TARGETS]
        if unknown or not value:
            raise ValueError(
                f"target_modules {value!r}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                f"known: {', '.join(TARGETS)}"
            )
        if len(set(value)) != len(value):
            raise ValueError(f"target_modules {value!r} names a module twice")
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _split(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of a stacked weight ``[L, *in, *out]``."""
    n_in = dict(TARGETS.values())[name]
    return tuple(shape[1 : 1 + n_in]), tuple(shape[1 + n_in :])


def adapter_axes(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Logical axes of (A, B) for weight ``name``: A keeps W's input axes, B its output axes."""
    axes = PARAM_LOGICAL_AXES[name]
    n_in = dict(TARGETS.values())[name]
    return (axes[0], *axes[1 : 1 + n_in], RANK_AXIS), (axes[0], RANK_AXIS, *axes[1 + n_in :])


def _weights(params: nnx.State, cfg: LoraConfig) -> dict[str, Any]:
    """The targeted weights of ``params`` (arrays or shapes), by decoder weight name."""
    names = {TARGETS[m][0] for m in cfg.target_modules}
    found: dict[str, Any] = {}
    jax.tree_util.tree_map_with_path(lambda p, x: found.__setitem__(param_name(p), x), params)
    missing = [m for m in cfg.target_modules if TARGETS[m][0] not in found]
    if missing:  # a mixture-of-experts model whose every layer is sparse has no dense MLP
        raise ValueError(
            f"trainer.lora.target_modules: this model has no {', '.join(missing)} (its MLPs are routed experts, "
            "which LoRA does not adapt); target the attention projections (q_proj, k_proj, v_proj, o_proj)"
        )
    return {n: found[n] for n in sorted(names)}


def adapter_shardings(params: nnx.State, cfg: LoraConfig, mesh: Mesh) -> dict[str, dict[str, NamedSharding]]:
    out = {}
    for name, w in _weights(params, cfg).items():
        a_shape, b_shape = adapter_shapes(name, tuple(w.shape), cfg.rank)
        a_axes, b_axes = adapter_axes(name)
        out[name] = {
            "a": NamedSharding(mesh, logical_to_spec(a_axes, a_shape, mesh, _RULES)),
            "b": NamedSharding(mesh, logical_to_spec(b_axes, b_shape, mesh, _RULES)),
        }
    return out


def adapter_shapes(name: str, shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ins, outs = _split(name, shape)
    return (shape[0], *ins, rank), (shape[0], rank, *outs)


def init_adapters(params: nnx.State, cfg: LoraConfig, mesh: Mesh) -> dict[str, dict[str, jax.Array]]:
    """Adapters for ``params``: A ~ N(0, 1/fan_in) (seeded), B = 0, in the weights' dtype, sharded."""
    weights = _weights(params, cfg)
    shardings = adapter_shardings(params, cfg, mesh)
    keys = jax.random.split(jax.random.key(cfg.seed), len(weights))
    out = {}
    for key, (name, w) in zip(keys, weights.items(), strict=True):
        a_shape, b_shape = adapter_shapes(name, tuple(w.shape), cfg.rank)
        fan_in = math.prod(a_shape[1:-1])

        def make(key=key, a_shape=a_shape, b_shape=b_shape, dtype=w.dtype, fan_in=fan_in):  # type: ignore[no-untyped-def]
            return {
                "a": (jax.random.normal(key, a_shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype),
                "b": jnp.zeros(b_shape, dtype),
            }

        out[name] = jax.jit(make, out_shardings=shardings[name])()
    return out


def merged(params: nnx.State, adapters: dict[str, dict[str, jax.Array]], scale: float) -> nnx.State:
    """``params`` with ``W + scale * A @ B`` in place of every adapted weight (a new state)."""

    def merge(path: Any, w: jax.Array) -> jax.Array:
        ad = adapters.get(param_name(path))
        if ad is None:
            return w
        return jax.vmap(lambda w_l, a_l, b_l: lora_merge(w_l, a_l, b_l, scale))(w, ad["a"], ad["b"])  # per layer

    return jax.tree_util.tree_map_with_path(merge, params)

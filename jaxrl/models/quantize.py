"""8-bit serving weights: the engine's projections stored as int8 or fp8 with one scale per
output channel, dequantized inside each engine program (``[inference.backend] quantization``).

Decode reads every weight every step; stored in 8 bits, the weights take half a bf16 copy's memory
(more KV cache fits) and, once the dequantize runs per layer inside the layer loop, half the bytes a
decode step reads. The trainer keeps its own
precision: quantization happens on device each time weights are placed or swapped in
(``Kernels.serving_weights``), and the mismatch it adds to the sampled tokens' log-probs is what
the off-policy corrections (TIS / MIS / IcePop, ``[trainer.loss]``) are for.

Which weights: the attention and MLP projections (``wq wk wv wo w_gate w_up w_down`` and the
experts' ``moe_gate moe_up moe_down``), scaled per output channel: the maximum magnitude over
each weight's contracting axes (its input: ``embed``, or ``q_heads x head_dim`` for ``wo``,
``mlp`` / ``moe_mlp`` for the down projections) maps to 127 (int8, round to nearest) or 448
(float8_e4m3fn, its largest finite value). The embedding, the LM head, norms, biases and the
router stay in the model's dtype: the LM head sets every log-prob directly, and the others are
small.

The engine's runner serves this form (``ModelRunner._served``) and its programs dequantize at
their start (``values * scale`` in the model's parameter dtype: the pure-JAX reference). XLA:TPU
materializes that copy (in the compute dtype) once per program call, outside the decode-steps
loop, so today a decode step reads the copy (docs/quantization.md: 1.8 GiB of temporaries per
chip for Qwen3-8B at tensor 8); dequantizing per layer inside the layer loop is the next step. Not qwix (Google's JAX quantization library):
its post-training mode swaps a model's parameters for its own array types inside the nnx graph,
which every path that moves our serving weights by parameter path and dtype (resharding, direct
transfer, deltas, the CPU packed layout) would have to learn; one pytree leaf type in the served
state changes none of them. Quantized matmul kernels (int8 x int8 on TPU) belong behind the
kernel-dispatch seam when measured to pay.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.models.decoder import PARAM_LOGICAL_AXES, param_name

Quantization = Literal["none", "int8", "fp8"]

CONTRACTING: dict[str, tuple[str, ...]] = {
    "wq": ("embed",), "wk": ("embed",), "wv": ("embed",), "wo": ("q_heads", "head_dim"),
    "w_gate": ("embed",), "w_up": ("embed",), "w_down": ("mlp",),
    "moe_gate": ("embed",), "moe_up": ("embed",), "moe_down": ("moe_mlp",),
}  # fmt: skip
"""The weights stored in 8 bits, each with the logical axes its matmul contracts over."""

QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@struct.dataclass
class QArray:
    """One quantized weight: ``values`` (int8 / float8_e4m3fn, the weight's shape) and ``scale``
    (float32, 1 on the contracting axes): the weight is ``values * scale``."""

    values: jax.Array
    scale: jax.Array

    def dequantize(self, dtype: Any) -> jax.Array:
        return self.values.astype(dtype) * self.scale.astype(dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def quantize_state(state: Any, kind: Quantization) -> Any:
    """``state`` (the model's parameters, any sharding) with each weight of ``CONTRACTING`` as a
    ``QArray`` of ``kind``; every other leaf unchanged. Identity for "none"."""
    if kind == "none":
        return state

    def one(path: tuple[Any, ...], x: Any) -> Any:
        name = param_name(path)
        if name not in CONTRACTING or not hasattr(x, "ndim") or x.ndim != len(PARAM_LOGICAL_AXES[name]):
            return x
        axes = PARAM_LOGICAL_AXES[name]
        return quantize_array(x, tuple(axes.index(a) for a in CONTRACTING[name]), kind)

    return jax.tree_util.tree_map_with_path(one, state)


def cast_projections(state: Any, dtype: Any) -> Any:
    """``state`` with each weight of ``CONTRACTING`` in ``dtype`` (the engine's compute dtype)
    where it is stored wider; every other leaf unchanged. Arrays are cast on device in their own
    sharding; ``jax.ShapeDtypeStruct`` leaves (ahead-of-time compiles) get the new dtype.

    Why (TPU, ``Kernels.projection_storage``): the model multiplies by ``w.astype(compute dtype)``,
    so the values are the same, but a float32 weight inside an engine program made XLA:TPU
    convert every layer's stacked weights to bfloat16 once per call, outside the layer loop: a
    full bfloat16 copy of the projections as temporaries and one more read-and-write of them per
    decode call (Qwen3-8B decode on v5p-32: 2.10 -> 0.62 GiB of temporaries per chip, weights
    3.8 -> 2.2 GiB). The embedding, the LM head (the log-probs read it in float32), norms, biases
    and the router keep their dtype."""
    dtype = jnp.dtype(dtype)

    def one(path: tuple[Any, ...], x: Any) -> Any:
        name = param_name(path)
        if (name not in CONTRACTING or not jnp.issubdtype(x.dtype, jnp.floating)
                or jnp.dtype(x.dtype).itemsize <= dtype.itemsize):  # fmt: skip
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return cast_to(x, dtype)

    return jax.tree_util.tree_map_with_path(one, state)


def dequantize_state(state: Any, dtype: Any = None) -> Any:
    """The model's parameters back from ``quantize_state``'s form (inside a program), in
    ``dtype``, default the dtype of its other floating leaves (the model's parameter dtype, as
    unquantized serving weights have); ``state`` itself when nothing is quantized."""
    is_q = lambda x: isinstance(x, QArray)
    leaves = jax.tree.leaves(state, is_leaf=is_q)
    if not any(is_q(x) for x in leaves):
        return state
    if dtype is None:
        floats = [x.dtype for x in leaves if not is_q(x) and jnp.issubdtype(x.dtype, jnp.floating)]
        dtype = floats[0] if floats else jnp.float32
    return jax.tree.map(lambda x: x.dequantize(dtype) if is_q(x) else x, state, is_leaf=is_q)


def is_quantized(state: Any) -> bool:
    return any(isinstance(x, QArray) for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QArray)))


def abstract_quantized(state: Any, kind: Quantization) -> Any:
    """``quantize_state``'s output as shapes (``jax.ShapeDtypeStruct`` leaves with shardings) for
    an abstract ``state`` whose leaves carry shardings: what ahead-of-time compiles of the
    engine's programs take, and the target of a quantized weight pull. A scale is replicated
    over its weight's contracting axes."""
    if kind == "none":
        return state

    def one(path: tuple[Any, ...], x: Any) -> Any:
        name = param_name(path)
        if name not in CONTRACTING or len(x.shape) != len(PARAM_LOGICAL_AXES[name]):
            return x
        axes = [PARAM_LOGICAL_AXES[name].index(a) for a in CONTRACTING[name]]
        shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        scale_sharding = x.sharding  # one device: the same
        if isinstance(x.sharding, NamedSharding):
            spec = list(x.sharding.spec) + [None] * (len(x.shape) - len(x.sharding.spec))
            scale_sharding = NamedSharding(x.sharding.mesh, PartitionSpec(*(None if i in axes else s for i, s in enumerate(spec))))
        return QArray(jax.ShapeDtypeStruct(x.shape, STORAGE[kind], sharding=x.sharding),
                      jax.ShapeDtypeStruct(shape, jnp.float32, sharding=scale_sharding))  # fmt: skip

    return jax.tree_util.tree_map_with_path(one, state)


def quantize_param(path: str, x: jax.Array, dtype: Any, kind: Quantization) -> jax.Array | dict[str, jax.Array]:
    """One trainer param (``path``: its state path, "layers/wq") as a server of ``kind`` serves
    it, computed on device in the param's sharding: cast to ``dtype`` (the servers' parameter
    dtype) and, for a weight of ``CONTRACTING``, quantized from that cast, ``{"values", "scale"}``
    (the fields of ``QArray``). Exactly what the server's own ``quantize_state`` makes of the
    cast weights: the external backend's direct transfer sends this form
    (``weight_transfer.Publisher(prepare=...)``) so half the bytes travel."""
    cast = x if x.dtype == jnp.dtype(dtype) else cast_to(x, jnp.dtype(dtype))
    name = path.rsplit("/", 1)[-1]
    axes = PARAM_LOGICAL_AXES.get(name, ())
    if kind == "none" or name not in CONTRACTING or x.ndim != len(axes):
        return cast
    q = quantize_array(cast, tuple(axes.index(a) for a in CONTRACTING[name]), kind)
    return {"values": q.values, "scale": q.scale}


def quantization_of(dtypes: dict[str, Any]) -> Quantization:
    """The format of a served state described by path -> dtype (a weight-transfer manifest):
    "int8" / "fp8" when its ``CONTRACTING`` weights travel as ``.../values`` in that storage
    dtype, "none" when none does; mixed formats are an error."""
    names = {jnp.dtype(v).name: k for k, v in STORAGE.items()}
    kinds = {names.get(jnp.dtype(d).name) for p, d in dtypes.items() if p.endswith("/values")}
    if None in kinds or len(kinds) > 1:
        raise ValueError(f"quantized weights in more than one format, or not 8-bit: {sorted(map(str, kinds))}")
    return kinds.pop() if kinds else "none"


@functools.partial(jax.jit, static_argnums=1)
def cast_to(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` in ``dtype`` on device, in its own sharding (an elementwise program keeps it)."""
    return x.astype(dtype)


def quantize_array(x: jax.Array, axes: tuple[int, ...], kind: Quantization) -> QArray:
    """``x`` in ``kind`` with one scale per slice over ``axes`` (absmax -> the format's largest value)."""
    return _quantize(x, axes, kind)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(x: jax.Array, axes: tuple[int, ...], kind: str) -> QArray:
    w = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX[kind], 1.0)
    y = w / scale
    if kind == "int8":
        values = jnp.clip(jnp.round(y), -QMAX[kind], QMAX[kind]).astype(jnp.int8)
    else:  # |y| <= 448 by construction: the cast rounds to the nearest e4m3 value, never to inf/nan
        values = jnp.clip(y, -QMAX[kind], QMAX[kind]).astype(STORAGE[kind])
    return QArray(values, scale)

"""Where the engine's weights and KV cache live, and how new weights are handed over.

The engine shards by the decoder's logical axis names with the trainer's rules table
(``jaxrl.parallel.rules``, applied by ``jaxrl.models.sharding``): on the serving mesh, whose
only axis is "tensor", that is tensor parallelism over heads, MLP and vocabulary (a dimension
not divisible by the axis size stays replicated). Without a mesh everything sits on one device.

A weight update from the trainer is one batched ``jax.device_put`` of the whole parameter
pytree to the engine's shardings (whatever the trainer's sharding or mesh), always into fresh
buffers, so the trainer may donate or overwrite its own arrays afterwards; then a cast to the
engine's dtypes when they differ. No files are written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.models import sharding
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import param_name
from kernels.cpu_matmul import PackedWeight

ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]

def serving_mesh(tensor_parallel: int, devices: list[Any] | None = None) -> Mesh | None:
    """A 1-D "tensor" mesh over the first ``tensor_parallel`` of ``devices`` (default: JAX's),
    None for one device."""
    if tensor_parallel == 1:
        return None
    devices = jax.devices() if devices is None else devices
    if tensor_parallel > len(devices):
        raise ValueError(
            f"inference.tensor_parallel = {tensor_parallel} but only {len(devices)} devices are visible"
        )
    return Mesh(np.array(devices[:tensor_parallel]), ("tensor",))


def param_sharding_fn(mesh: Mesh | None) -> ShardingFn:
    """``(weight name, shape) -> sharding`` for ``load_decoder(sharding_fn=...)``."""
    if mesh is None:
        single = SingleDeviceSharding(jax.devices()[0])
        return lambda name, shape: single
    return sharding.param_sharding_fn(mesh)


def cache_sharding(mesh: Mesh | None, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return sharding.cache_sharding(mesh, shape)


def replicated(mesh: Mesh | None) -> jax.sharding.Sharding:
    """Sharding of small host-fed inputs (token ids, positions, sampling settings)."""
    if mesh is None:
        return SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(state: nnx.State, sharding_fn: ShardingFn) -> Any:
    """A pytree of shardings shaped like ``state``."""
    return jax.tree_util.tree_map_with_path(lambda p, x: sharding_fn(param_name(p), tuple(x.shape)), state)


def as_state(weights: nnx.State | Decoder) -> nnx.State:
    return nnx.state(weights) if isinstance(weights, Decoder) else weights


def place_state(new: nnx.State | Decoder, like: nnx.State, shardings: Any) -> nnx.State:
    """``new`` moved to ``shardings`` (fresh buffers) and cast to the dtypes of ``like``.

    ``new`` must have the same weights as ``like`` (matched by path: metadata such as the
    trainer's sharding annotations does not matter) with the same shapes.
    """
    new_leaves = {
        jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(as_state(new))[0]
    }
    like_flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = [jax.tree_util.keystr(p) for p, _ in like_flat]
    missing, extra = sorted(set(names) - set(new_leaves)), sorted(set(new_leaves) - set(names))
    if missing or extra:
        raise ValueError(
            f"weight update: state does not match the engine's model (missing {missing}, unexpected {extra})"
        )
    for name, (_, ref) in zip(names, like_flat):
        if tuple(new_leaves[name].shape) != tuple(ref.shape):
            raise ValueError(
                f"weight update: {name} has shape {tuple(new_leaves[name].shape)}, engine expects {tuple(ref.shape)}"
            )
    leaves = [new_leaves[n] for n in names]
    flat_shardings = treedef.flatten_up_to(shardings)
    placed = jax.device_put(leaves, flat_shardings, may_alias=False)
    dtypes = [ref.dtype for _, ref in like_flat]
    if any(x.dtype != d for x, d in zip(placed, dtypes)):
        placed = _cast(placed, dtypes, flat_shardings)
    return jax.tree_util.tree_unflatten(treedef, placed)


def _cast(leaves: list[jax.Array], dtypes: list[Any], shardings: list[Any]) -> list[jax.Array]:
    return _cast_fn(tuple(dtypes), tuple(shardings))(leaves)


@functools.cache
def _cast_fn(
    dtypes: tuple[Any, ...], shardings: tuple[Any, ...]
) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """One jitted cast per layout (compiled once, not at every update)."""
    return jax.jit(
        lambda xs: [x.astype(d) for x, d in zip(xs, dtypes)], out_shardings=list(shardings), donate_argnums=0
    )


def zeros_like_sharded(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A zero array created directly in its sharding (no host copy)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def split_layers(
    state: nnx.State, names: Sequence[str], packed: Mapping[str, int] | None = None, head: str | None = None
) -> nnx.State:
    """``state`` in the engine's "unrolled" layout (``InferenceConfig.layer_loop``): each stacked
    layer weight in ``names`` (leading axis = layers) replaced by a tuple of per-layer arrays,
    each on its stacked sharding less the layer axis.

    For the CPU matmul kernel (``kernels.cpu_matmul``; one device, float32): ``packed`` {name: K}
    names the layer weights to pack as ``PackedWeight``s, and ``head`` ("lm_head", or "embed"
    when tied) the output projection to pack ([D, V]: a tied embedding's transpose; its rows are
    then read from the panels, so it is still kept once). Fresh buffers; the stacked arrays are
    freed once the caller drops them."""
    wanted, packed = set(names), dict(packed or {})

    def split(path: Any, x: jax.Array) -> Any:
        name = param_name(path)
        if name == head:
            return PackedWeight.pack(x.T if name == "embed" else x, x.shape[1 if name == "embed" else 0])
        if name not in wanted:
            return x
        if name in packed:
            return tuple(PackedWeight.pack(x[i], packed[name]) for i in range(x.shape[0]))
        return tuple(_layer(x, i) for i in range(x.shape[0]))

    return jax.tree_util.tree_map_with_path(split, state)


def _layer(x: jax.Array | jax.ShapeDtypeStruct, i: int) -> jax.Array | jax.ShapeDtypeStruct:
    """Layer ``i`` of a stacked weight; of an abstract one (``jaxrl.aot``), its shape and
    sharding less the layer axis."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return x[i]
    sharding = x.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)


def _served_leaf(x: Any) -> bool:
    return isinstance(x, (tuple, PackedWeight))


def _model_value(name: str, x: Any) -> jax.Array:
    """A served leaf back in the model's own layout."""
    if isinstance(x, tuple):
        return jnp.stack([w.unpack() if isinstance(w, PackedWeight) else w for w in x])
    if isinstance(x, PackedWeight):
        return x.unpack().T if name == "embed" else x.unpack()
    return x


def serving_model(
    graphdef: nnx.GraphDef, state: nnx.State
) -> tuple[Decoder, list[dict[str, Any]] | None, PackedWeight | None]:
    """Inside an engine program: the model, its layer weights as separate arrays (or
    ``PackedWeight``s) when ``state`` is in the ``split_layers`` layout (else None), and the
    packed output projection (else None). The model's own weights are rebuilt from the served
    ones: XLA drops that as dead code, as the forward reads the served ones only
    (``Decoder.__call__(layers=..., head=...)``)."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_served_leaf)[0]
    served = {param_name(p): x for p, x in flat if _served_leaf(x)}
    if not served:
        return nnx.merge(graphdef, state), None, None
    model_state = jax.tree_util.tree_map_with_path(
        lambda p, x: _model_value(param_name(p), x), state, is_leaf=_served_leaf
    )
    model = nnx.merge(graphdef, model_state)
    split = {n: x for n, x in served.items() if isinstance(x, tuple)}
    layers = [{n: xs[i] for n, xs in split.items()} for i in range(model.arch.num_layers)] if split else None
    head = next((x for x in served.values() if isinstance(x, PackedWeight)), None)
    return model, layers, head

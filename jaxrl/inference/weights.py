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
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.models import sharding
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import param_name
from jaxrl_kernels.cpu_matmul import PackedInto, PackedWeight

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


def pack_for_cpu(state: nnx.State, groups: Mapping[tuple[str, ...], int], head: str | None) -> nnx.State:
    """``state`` with the layer projections in ``groups`` ({names: K}, ``Decoder.
    matmul_weights``) packed for the CPU matmul kernel (``jaxrl_kernels.cpu_matmul``; one device,
    float32): each group is one ``PackedWeight`` in place of its first weight, the others
    ``PackedInto`` it. ``head`` ("lm_head", or "embed" when tied) is the output projection,
    packed as [D, V] (a tied table as its transpose, its rows then read from the panels: still
    kept once). Fresh buffers; the plain arrays are freed once the caller drops them."""
    values = {param_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    packed: dict[str, Any] = {}
    for names, k in groups.items():
        packed[names[0]] = PackedWeight.pack({n: values[n] for n in names}, k)
        packed.update({n: PackedInto(names[0]) for n in names[1:]})
    if head is not None:
        mat = values[head].T if head == "embed" else values[head]  # [D, V]
        packed[head] = PackedWeight.pack({head: mat[None]}, mat.shape[0])
    return jax.tree_util.tree_map_with_path(lambda p, x: packed.get(param_name(p), x), state)


def _is_packed(x: Any) -> bool:
    return isinstance(x, (PackedWeight, PackedInto))


def serving_model(
    graphdef: nnx.GraphDef, state: nnx.State
) -> tuple[Decoder, dict[str, PackedWeight] | None, PackedWeight | None]:
    """Inside an engine program: the model, its packed layer projections ({first name: packed
    group}) when ``state`` is in the ``pack_for_cpu`` layout (else None), and the packed output
    projection (else None). The model's own weights are rebuilt from the packed ones: XLA drops
    that as dead code, as the forward reads the packed ones only (``Decoder.__call__(packed=...,
    head=...)``)."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_packed)[0]
    groups = {param_name(p): x for p, x in flat if isinstance(x, PackedWeight)}
    if not groups:
        return nnx.merge(graphdef, state), None, None
    unpacked = {n: v for g in groups.values() for n, v in g.unpack().items()}
    for name in ("embed", "lm_head"):
        if name in groups:  # packed as [1, D, V]
            unpacked[name] = unpacked[name][0].T if name == "embed" else unpacked[name][0]
    model_state = jax.tree_util.tree_map_with_path(
        lambda p, x: unpacked[param_name(p)] if _is_packed(x) else x, state, is_leaf=_is_packed
    )
    head = groups.pop("embed", None) or groups.pop("lm_head", None)
    return nnx.merge(graphdef, model_state), groups, head

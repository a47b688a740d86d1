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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.models import sharding
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import param_name

ShardingFn = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]

def serving_mesh(tensor_parallel: int, devices: list[Any] | None = None, expert_parallel: int = 1) -> Mesh | None:
    """An ("expert", "tensor") mesh over the first ``expert_parallel * tensor_parallel`` of
    ``devices`` (default: JAX's), None for one device."""
    size = expert_parallel * tensor_parallel
    if size == 1:
        return None
    devices = jax.devices() if devices is None else devices
    if size > len(devices):
        raise ValueError(
            f"inference.backend.expert_parallel * tensor_parallel = {expert_parallel} * {tensor_parallel} "
            f"but only {len(devices)} devices are visible"
        )
    return Mesh(np.array(devices[:size]).reshape(expert_parallel, tensor_parallel), ("expert", "tensor"))


def colocated_mesh(tensor_parallel: int, expert_parallel: int = 1, devices: list[Any] | None = None) -> Mesh:
    """The mesh of an engine colocated with a multi-process trainer: every device of every
    process (each process must take part in each engine program: ``jaxrl.engine.lockstep``), as
    ("replica", "expert", "tensor") with ``replica`` = devices / (expert * tensor). Weights and
    the KV cache are split over expert and tensor and repeated over replica (no rule names that
    axis: ``jaxrl.parallel.rules``); every replica group computes every row. Why not split the
    cache's rows over it ("data"): each decode step reads any row, so XLA then all-gathers the
    whole cache every step (the compiled Qwen3-8B decode on v5p-32 held 10.9 GiB of temporaries
    per chip that way, 2 GiB without), a cost per step far above the memory it saves at rest. A
    data-parallel engine (rows pinned to groups, each group its own batch) is what splits them."""
    devices = jax.devices() if devices is None else devices
    size = expert_parallel * tensor_parallel
    if len(devices) % size:
        raise ValueError(
            f"inference.backend.expert_parallel * tensor_parallel = {expert_parallel} * {tensor_parallel} "
            f"does not divide the {len(devices)} devices of the colocated engine; use a divisor of {len(devices)}"
        )
    grid = np.array(devices).reshape(len(devices) // size, expert_parallel, tensor_parallel)
    return Mesh(grid, ("replica", "expert", "tensor"))


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

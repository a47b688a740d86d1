"""Device mesh (data, fsdp, tensor) and the one table mapping logical axes to mesh axes.

Layers name their axes (``jaxrl.models.decoder.PARAM_LOGICAL_AXES``); this module alone decides
where those names live on the mesh, as MaxText and Levanter do. An axis whose size does not
divide by its mesh axes is replicated instead (e.g. 2 KV heads on a tensor axis of 4), so any
mesh shape is valid for any model; the cost is memory, never correctness.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from pydantic import BaseModel, ConfigDict, Field

from jaxrl.models.decoder import PARAM_LOGICAL_AXES, param_name

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axes. Parameters are sharded FSDP-style on ``embed`` and
# Megatron-style on heads / mlp / vocab; activations' batch goes over data and fsdp.
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": (),
    "layers": (),
    "norm": (),
    "batch": BATCH_AXES,
    "cache_rows": BATCH_AXES,
    "cache_len": (),
}


class MeshConfig(BaseModel):
    """Mesh shape. -1 on one axis takes all remaining devices."""

    model_config = ConfigDict(extra="forbid")
    data: int = Field(1, description="Pure data-parallel replicas.")
    fsdp: int = Field(-1, description="Fully-sharded data parallel (parameters sharded on embed).")
    tensor: int = Field(1, description="Tensor parallel (heads, mlp, vocab).")
    num_devices: int | None = Field(
        None, ge=1, description="Use only the first N devices (default: all), e.g. to leave some to the engine."
    )

    def resolve(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError("trainer.mesh: at most one of data/fsdp/tensor may be -1")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"trainer.mesh: sizes must be positive or -1, got {sizes}")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"trainer.mesh: {num_devices} devices do not divide by {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"trainer.mesh: data*fsdp*tensor = {math.prod(sizes)} but {num_devices} devices are "
                "visible; set one axis to -1 or make the product match"
            )
        return sizes[0], sizes[1], sizes[2]


def make_mesh(cfg: MeshConfig, devices: list[Any] | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    if cfg.num_devices is not None:
        if cfg.num_devices > len(devices):
            raise ValueError(f"trainer.mesh.num_devices = {cfg.num_devices} but only {len(devices)} devices exist")
        devices = devices[: cfg.num_devices]
    shape = cfg.resolve(len(devices))
    grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_to_spec(
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: Mapping[str, tuple[str, ...]] = LOGICAL_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array with logical ``axes``; non-dividing axes are replicated."""
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axes = tuple(a for a in rules[name] if a not in used and mesh.shape[a] > 1)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if not mesh_axes or size % n:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def param_sharding_fn(mesh: Mesh) -> Callable[[str, tuple[int, ...]], NamedSharding]:
    """(weight name, shape) -> NamedSharding, for ``load_decoder`` and ``shard_params``."""

    def fn(name: str, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, logical_to_spec(PARAM_LOGICAL_AXES[name], shape, mesh))

    return fn


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp), everything else replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Place a parameter state on ``mesh`` by the logical-axis rules (one batched device_put)."""
    fn = param_sharding_fn(mesh)
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: fn(param_name(p), x.shape), params)
    return jax.device_put(params, shardings)

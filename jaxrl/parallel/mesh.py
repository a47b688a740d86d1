"""The training device mesh (data, fsdp, expert, context, tensor) and the shardings of its host-fed inputs.

Where each logical axis lives on it is ``jaxrl.parallel.rules`` (shared with the serving mesh).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from pydantic import BaseModel, ConfigDict, Field

from jaxrl.parallel.rules import BATCH_AXES, MESH_AXES, SEQ_AXIS


class MeshConfig(BaseModel):
    """Mesh shape. -1 on one axis takes all remaining devices."""

    model_config = ConfigDict(extra="forbid")
    data: int = Field(1, description="Pure data-parallel replicas.")
    fsdp: int = Field(-1, description="Fully-sharded data parallel (parameters sharded on embed).")
    expert: int = Field(
        1,
        ge=1,
        description="Expert parallel: a mixture-of-experts model's experts split over this many devices "
        "(each holds num_experts / expert of them; tokens are all-gathered to them and the results "
        "reduce-scattered back). Outside the expert layers the axis is data-parallel: "
        "trainer.micro_batch_rows must divide by data*fsdp*expert. The experts must divide by it.",
    )
    context: int = Field(
        1,
        ge=1,
        description="Context parallel: each sequence split over this many devices (Ulysses attention: "
        "an all-to-all from sequence to heads around each attention call). Needs trainer.seq_len and "
        "its buckets, and the query heads per tensor shard, to divide by it.",
    )
    tensor: int = Field(1, description="Tensor parallel (heads, mlp, vocab).")
    num_devices: int | None = Field(
        None, ge=1, description="Use only the first N devices (default: all), e.g. to leave some to the engine."
    )

    def resolve(self, num_devices: int) -> tuple[int, int, int, int, int]:
        """(data, fsdp, expert, context, tensor) sizes for ``num_devices`` devices."""
        sizes = [self.data, self.fsdp, self.expert, self.context, self.tensor]
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
                f"trainer.mesh: data*fsdp*expert*context*tensor = {math.prod(sizes)} but {num_devices} devices are "
                "visible; set one axis to -1 or make the product match"
            )
        return sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]


def make_mesh(cfg: MeshConfig, devices: list[Any] | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    if cfg.num_devices is not None:
        if cfg.num_devices > len(devices):
            raise ValueError(f"trainer.mesh.num_devices = {cfg.num_devices} but only {len(devices)} devices exist")
        devices = devices[: cfg.num_devices]
    shape = cfg.resolve(len(devices))
    grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp, expert), the sequence (dimension 1) over context, the rest replicated."""
    seq = [SEQ_AXIS if mesh.shape.get(SEQ_AXIS, 1) > 1 else None][: max(ndim - 1, 0)]
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *seq, *([None] * (ndim - 1 - len(seq)))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

"""The one table mapping logical axis names to mesh axes, for every mesh jaxrl builds.

Layers and caches name their axes (``jaxrl.models.decoder.PARAM_LOGICAL_AXES``,
``CACHE_LOGICAL_AXES``); this module alone decides where those names live, as MaxText and
Levanter do. The training mesh has axes (data, fsdp, expert, context, tensor), the serving mesh (expert, tensor):
a rule's mesh axes that a mesh lacks (or has at size 1) are skipped, so the same table shards
parameters FSDP + tensor-parallel for training and tensor-parallel for serving. A dimension
whose size does not divide by its mesh axes is replicated instead (e.g. 2 KV heads on a tensor
axis of 4), so any mesh shape is valid for any model; the cost is memory, never correctness.

This package knows axis *names* only: it never imports the model (``jaxrl.models.sharding``
applies these rules to the decoder's weights).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh, PartitionSpec

# "context" sits next to "tensor" (the fastest links): it carries all-to-alls every layer;
# "expert" next to them: it carries the mixture-of-experts layers' all-gather / reduce-scatter.
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")
# The expert axis is also a data axis: outside the expert MLPs its devices hold different rows
# (MaxText's ici_expert_parallelism), so no layer runs the same rows twice.
BATCH_AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"
SEQ_AXIS = "context"

# Logical axis -> mesh axes. Parameters are sharded FSDP-style on ``embed`` (over fsdp, expert
# and context: a context-parallel or expert-parallel group holds one copy of the dense weights
# between its devices, as MaxText's does) and Megatron-style on heads / mlp / vocab; experts'
# weights over "expert" by expert (their embed then over fsdp and context only: a mesh axis is
# used once per array). Activations' batch goes over data, fsdp and expert, their sequence over
# context; KV cache rows over data and fsdp only (an engine query may read any cache row, so the
# serving mesh's expert axis never splits them); "tokens" is a flattened [rows * seq].
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "vocab": ("tensor",),
    "embed": ("fsdp", EXPERT_AXIS, "context"),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "head_dim": (),
    "layers": (),
    "norm": (),
    "batch": BATCH_AXES,
    "seq": (SEQ_AXIS,),
    "tokens": (*BATCH_AXES, SEQ_AXIS),
    "cache_rows": ("data", "fsdp"),
    "experts": (EXPERT_AXIS,),
    "moe_mlp": ("tensor",),  # each expert's hidden width, Megatron-style like "mlp"
    "cache_len": (),
}


def logical_to_spec(
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: Mapping[str, tuple[str, ...]] = LOGICAL_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array with logical ``axes`` on ``mesh``; a mesh axis is used at most
    once, axes the mesh lacks are skipped, and non-dividing dimensions are replicated."""
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axes = tuple(a for a in rules[name] if a not in used and mesh.shape.get(a, 1) > 1)
        n = math.prod(mesh.shape[a] for a in mesh_axes)
        if not mesh_axes or size % n:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*spec)


def check_expert_parallel(num_experts: int, expert: int, *, field: str) -> None:
    """One line naming ``field`` unless ``num_experts`` experts split evenly over an expert axis
    of ``expert`` devices (each device holds whole experts; 0 experts is a dense model, which
    has nothing to split over the axis)."""
    if expert == 1:
        return
    if num_experts == 0:
        raise ValueError(
            f"{field} = {expert} but the model is dense (no experts); set it to 1 and use fsdp/data instead"
        )
    if num_experts % expert:
        raise ValueError(
            f"{field} = {expert} does not divide the model's {num_experts} experts; "
            f"use a divisor of {num_experts}"
        )

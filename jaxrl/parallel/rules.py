"""The one table mapping logical axis names to mesh axes, for every mesh jaxrl builds.

Layers and caches name their axes (``jaxrl.models.decoder.PARAM_LOGICAL_AXES``,
``CACHE_LOGICAL_AXES``); this module alone decides where those names live, as MaxText and
Levanter do. The training mesh has axes (data, fsdp, context, tensor), the serving mesh only "tensor":
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

# "context" sits next to "tensor" (the fastest links): it carries all-to-alls every layer.
MESH_AXES = ("data", "fsdp", "context", "tensor")
BATCH_AXES = ("data", "fsdp")
SEQ_AXIS = "context"

# Logical axis -> mesh axes. Parameters are sharded FSDP-style on ``embed`` (over fsdp and
# context: a context-parallel group holds one copy of the weights between its devices, as
# MaxText's does) and Megatron-style on heads / mlp / vocab; activations' batch and KV cache
# rows go over data and fsdp, their sequence over context; "tokens" is a flattened [rows * seq].
LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "vocab": ("tensor",),
    "embed": ("fsdp", "context"),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "experts": (),  # MoE experts: whole on every device until an expert mesh axis holds them
    "moe_mlp": ("tensor",),  # each expert's hidden width, Megatron-style like "mlp"
    "head_dim": (),
    "layers": (),
    "norm": (),
    "batch": BATCH_AXES,
    "seq": (SEQ_AXIS,),
    "tokens": (*BATCH_AXES, SEQ_AXIS),
    "cache_rows": BATCH_AXES,
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

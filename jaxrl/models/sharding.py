"""The decoder's weights and KV cache placed by the logical-axis rules (``jaxrl.parallel.rules``).

One function per placement, for any mesh (the trainer's (data, fsdp, tensor) mesh or the
engine's "tensor" mesh): the rules decide, the decoder's tables name the axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxrl.models.decoder import PARAM_LOGICAL_AXES, param_name
from jaxrl.models.kv_cache import CACHE_LOGICAL_AXES
from jaxrl.parallel.rules import logical_to_spec

ShardingFn = Callable[[str, tuple[int, ...]], NamedSharding]


def param_sharding_fn(mesh: Mesh) -> ShardingFn:
    """(weight name, shape) -> NamedSharding, for ``load_decoder`` and ``shard_params``."""

    def fn(name: str, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, logical_to_spec(PARAM_LOGICAL_AXES[name], tuple(shape), mesh))

    return fn


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """A pytree of shardings shaped like the parameter ``state`` (arrays or abstract shapes)."""
    fn = param_sharding_fn(mesh)
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(param_name(p), tuple(x.shape)), state)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Place a parameter state on ``mesh`` by the logical-axis rules (one batched device_put)."""
    return jax.device_put(params, state_shardings(params, mesh))


def cache_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of a KV cache array ([layers, rows, kv_heads, max_len, head_dim])."""
    return NamedSharding(mesh, logical_to_spec(CACHE_LOGICAL_AXES, tuple(shape), mesh))

"""The KV cache the engine decodes against: its layout, its logical axes, its constructor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl.models.arch import ModelArch

# Logical axes of the KV cache arrays [layers, rows, kv_heads, max_len, head_dim].
CACHE_LOGICAL_AXES = ("layers", "cache_rows", "kv_heads", "cache_len", "head_dim")


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    """Keys and values for ``rows`` sequences, written at each token's absolute position.

    Heads-major, ``[layers, rows, kv_heads, max_len, head_dim]``: one (layer, row, kv head) is a
    contiguous ``[max_len, head_dim]`` matrix, the tile TPU's layout and the decode kernel
    (``jaxrl_kernels.decode_attention``) read in place; a positions-major layout would need a relayout
    copy of the whole cache per decode step there. A token whose position is >= ``max_len`` is
    not written (scatter mode "drop"): the engine gives padding tokens such a position.
    """

    k: jax.Array  # [layers, rows, kv_heads, max_len, head_dim]
    v: jax.Array

    @staticmethod
    def shape(arch: ModelArch, rows: int, max_len: int) -> tuple[int, int, int, int, int]:
        return (arch.num_layers, rows, arch.num_kv_heads, max_len, arch.head_dim)

    @classmethod
    def zeros(cls, arch: ModelArch, rows: int, max_len: int, dtype: Any = jnp.float32) -> "KVCache":
        shape = cls.shape(arch, rows, max_len)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

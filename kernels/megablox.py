"""TPU grouped matmul for the mixture-of-experts layers: Pallas Megablox, tiled for the chip.

``jax.experimental.pallas.ops.tpu.megablox.gmm`` (with its custom VJP: a transposed ``gmm`` for
the input gradient, ``tgmm`` for the experts' weight gradient) multiplies rows sorted by expert
by their expert's matrix, visiting only the [tm, tk] x [tk, tn] tiles that hold rows of a group:
about ``m + E * tm`` rows of work where XLA's dense fallback does ``m * E``. Its tiling is ours to
choose, and it asks Mosaic for no VMEM beyond the default scoped limit (16 MiB on v5e and v5p),
so tiles are picked here per (m, k, n), as ``tpu_budget`` does for our own kernels: the least
roofline time among tilings whose double-buffered blocks and accumulator fit that limit, for
every call of the forward and backward pass (``MegabloxTiling`` is the lookup Megablox calls with
each call's shape). ``tm``, the rows per tile, is fixed per layer call: the rows are padded to a
multiple of it before the kernel (Megablox needs whole row tiles), and it is about the rows per
expert, so a group wastes at most one partly filled tile.

``gmm(lhs, rhs, group_sizes)`` has the signature of ``jaxrl_kernels.moe.ragged_dot`` (the
reference's grouped matmul), so ``expert_mlp_reference(..., gmm=gmm)`` is the TPU expert MLP.
Imports nothing from ``jaxrl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
from jaxrl_kernels.tpu_budget import MAX_TILE_ELEMENTS, UNKNOWN, Chip, best_blocks, target_chip

# Rows per tile: a multiple of 16 (bfloat16 packs 16 rows per vreg), at most 512.
_ROW_TILES = (16, 32, 64, 128, 256, 512)
# Column tiles are multiples of the 128-lane vreg width, or the whole dimension.
_COL_TILES = (128, 256, 384, 512, 768, 1024, 1536, 2048)


def row_tile(rows: int, groups: int) -> int:
    """Rows per tile for ``rows`` sorted rows over ``groups`` experts: the largest tile in
    ``_ROW_TILES`` not above the mean rows per expert (a partly filled tile per group is the
    padding cost; a smaller tile re-reads the expert's weights once more per extra tile)."""
    per_group = max(rows // max(groups, 1), 1)
    fitting = [t for t in _ROW_TILES if t <= per_group]
    return fitting[-1] if fitting else _ROW_TILES[0]


def _col_candidates(dim: int) -> list[int]:
    """Tiles that divide ``dim`` into whole lane-aligned blocks, or ``dim`` itself."""
    return sorted({t for t in _COL_TILES if t <= dim and dim % t == 0} | {dim})


@dataclass(frozen=True)
class MegabloxTiling:
    """Megablox's tiling lookup: ``(m, k, n) -> (tm, tk, tn)`` for each of its calls (the forward
    ``gmm``, the backward's transposed ``gmm`` and ``tgmm``), sized for ``chip`` (hashable: it is
    a static argument of the kernels' custom VJP)."""

    tm: int
    groups: int
    in_bytes: int
    out_bytes: int
    chip: Chip = UNKNOWN

    def vmem(self, tk: int, tn: int) -> int:
        """Estimated VMEM of the larger of ``gmm``'s and ``tgmm``'s tiles: both inputs and the
        output double-buffered, plus the float32 accumulator."""
        tm = self.tm
        gmm = 2 * (tm * tk + tk * tn) * self.in_bytes + 2 * tm * tn * self.out_bytes + tm * tn * 4
        tgmm = 2 * (tm * tk + tm * tn) * self.in_bytes + 2 * tk * tn * self.out_bytes + tk * tn * 4
        return max(gmm, tgmm)

    def seconds(self, m: int, k: int, n: int, tk: int, tn: int) -> float:
        """Roofline time of one call: row tiles (one partial tile per group at most) times the
        k and n tiles; rows are read once per n tile, each tile's expert block once per row tile."""
        row_tiles = m // self.tm + self.groups - 1
        k_tiles, n_tiles = -(-k // tk), -(-n // tn)
        flops = 2.0 * row_tiles * self.tm * k * n
        hbm = m * k * self.in_bytes * n_tiles + row_tiles * k * n * self.in_bytes + m * n * self.out_bytes
        return self.chip.seconds(flops, hbm, row_tiles * k_tiles * n_tiles, min(self.tm, tk, tn))

    def __call__(self, m: int, k: int, n: int) -> tuple[int, int, int]:
        # Megablox gives no VMEM request to Mosaic: the default scoped limit (16 MiB on v5e and
        # v5p) is what the tiles get, which UNKNOWN's budget is sized for.
        budget = min(self.chip.block_budget, UNKNOWN.block_budget)
        tk, tn = best_blocks(
            _col_candidates(k),
            [t for t in _col_candidates(n) if self.tm * t <= MAX_TILE_ELEMENTS] or [min(_col_candidates(n))],
            self.vmem,
            partial(self.seconds, m, k, n),
            budget,
        )
        return self.tm, tk, tn


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``lhs`` [M, K] (rows sorted by group) times its group's ``rhs`` [G, K, N] -> [M, N] in
    ``lhs.dtype`` (accumulated in float32), by Megablox; differentiable. ``interpret``: Pallas
    interpret mode (any backend; for tests)."""
    m = lhs.shape[0]
    groups = rhs.shape[0]
    # Rows past the groups' total (the other shards' rows under expert parallelism) are left
    # unwritten by the kernel in both passes: masked on the way in (so their input gradient is
    # zero, not whatever the memory held) and on the way out.
    computed = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
    lhs = jnp.where(computed, lhs, jnp.zeros((), lhs.dtype))
    tm = row_tile(m, groups)
    padded = -(-m // tm) * tm
    if padded != m:  # Megablox needs whole row tiles; rows past the groups' total are not computed
        lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
    dtype = jnp.dtype(lhs.dtype)
    tiling = MegabloxTiling(
        tm, groups, dtype.itemsize, dtype.itemsize, UNKNOWN if interpret else target_chip()
    )
    out = megablox.gmm(
        lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), dtype, tiling, None, None, False, interpret
    )
    return jnp.where(computed, out[:m], jnp.zeros((), out.dtype))

"""What the TPU a kernel is compiled for offers: VMEM to size blocks by, and a roofline to rank them.

Mosaic gives each kernel a *scoped* VMEM limit (16 MiB by default on v4, v5e and v5p, 32 MiB on
v6e) far below the physical VMEM (128 MiB per core on v5e and v6e, 64 MiB on v5p). Blocks sized
for one generation fail on another with ``CompileTimeScopedVmemOom``, so each kernel picks its
blocks at trace time for the chip it is being compiled for, and asks for the VMEM they need
(``vmem_limit_bytes``).

The chip comes from Pallas's ``get_tpu_info``: the mesh being traced under (``shard_map``,
``jax.set_mesh``; this is how compile-only topologies from ``jax.experimental.topologies`` are
seen) or JAX's default device. When neither is a TPU (CPU interpret mode; a lowering with
explicit shardings but no mesh context), ``UNKNOWN`` sizes blocks to fit the smallest default
scoped limit, so the kernels compile for any generation, only with smaller tiles.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from typing import Any

from jax.experimental.pallas import tpu as pltpu

MiB = 1 << 20
# Per grid step, Mosaic's pipeline costs about this much beyond the step's DMA and compute.
STEP_OVERHEAD_S = 0.35e-6
# Share of the chip's VMEM a kernel may ask for (the rest stays for XLA's own fusions), and
# share of that request its blocks may fill by our estimate (the estimate omits Mosaic's
# internal scratch and relayout temporaries).
_REQUEST_SHARE = 0.75
_ESTIMATE_SHARE = 0.75


@dataclass(frozen=True)
class Chip:
    """The compile target as the kernels see it."""

    name: str  # "v5e", "v6e", "v5p", ... or "unknown"
    vmem_limit: int | None  # bytes to request from Mosaic (None: keep the compiler's default)
    block_budget: int  # bytes a kernel's blocks, buffers and scratch may take, by our estimate
    flops: float  # bf16 matmul FLOP/s of one kernel instance (a core, or a megacore pair)
    hbm_bw: float  # HBM bytes/s of the same
    mxu: int  # systolic array width: a matmul dimension narrower than this wastes the rest

    def seconds(self, flops: float, hbm_bytes: float, steps: int, narrowest: int) -> float:
        """Roofline time of a kernel whose matmuls have ``narrowest`` as their smallest tile
        dimension: the slower of compute and HBM traffic, plus per-step overhead."""
        compute = flops / self.flops * max(1.0, self.mxu / narrowest)
        return max(compute, hbm_bytes / self.hbm_bw) + steps * STEP_OVERHEAD_S


# Fits the default 16 MiB scoped limit of every generation; v5e's speeds rank the candidates.
UNKNOWN = Chip("unknown", None, 12 * MiB, 1.97e14, 8.2e11, 128)


def target_chip() -> Chip:
    """The TPU being compiled for (see the module docstring), or ``UNKNOWN``."""
    try:
        info = pltpu.get_tpu_info()
    except (ValueError, RuntimeError):  # not a TPU: CPU, GPU, or no mesh context
        return UNKNOWN
    cores = info.num_cores  # a megacore device (v4, v5p) runs "parallel" grid axes on both cores
    request = int(info.vmem_capacity_bytes * _REQUEST_SHARE) // MiB * MiB
    return Chip(
        str(info.chip_version),
        request,
        int(request * _ESTIMATE_SHARE),
        float(info.bf16_ops_per_second * cores),
        float(info.mem_bw_bytes_per_second * cores),
        info.mxu_column_size,
    )


def compiler_params(chip: Chip, *semantics: str) -> pltpu.CompilerParams:
    """Grid-axis semantics ("parallel" axes may be split across cores; "arbitrary" ones carry a
    reduction in scratch and run in order) and the chip's VMEM request. Ignored in interpret mode."""
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=chip.vmem_limit)


# Largest [rows, cols] tile a kernel body computes on at once. Mosaic unrolls vector code over
# the tile's vregs, so compile time (and instruction memory) grows with its area: the fused
# log-prob kernels took 4 s of CPU to compile at 256 x 256 tiles, 16 s at 512 x 512 and 50 s at
# 1024 x 1024 (v5e, D 4096), with no roofline gain past the HBM/compute balance point.
MAX_TILE_ELEMENTS = 512 * 256


def best_blocks(candidates_a, candidates_b, vmem, seconds, budget: int) -> tuple[int, int]:
    """The (a, b) pair with the least estimated ``seconds(a, b)`` among those whose estimated
    ``vmem(a, b)`` fits ``budget`` and whose tile is at most ``MAX_TILE_ELEMENTS``; ties go to
    the smaller footprint. Raises when none fits."""
    pairs = [(a, b) for a, b in product(candidates_a, candidates_b) if a * b <= MAX_TILE_ELEMENTS]
    fits = [(seconds(a, b), vmem(a, b), a, b) for a, b in pairs]
    fits = [f for f in fits if f[1] <= budget]
    if not fits:
        raise ValueError(f"no block sizes fit the kernel's VMEM budget of {budget / MiB:.1f} MiB")
    return min(fits)[2:]


def compiled_kernel_vmem(compiled: Any) -> list[tuple[str, int]]:
    """(op name, VMEM bytes) of each Mosaic kernel in a compiled XLA:TPU executable, as the
    compiler allotted it (``used_scoped_memory_configs`` of each ``tpu_custom_call``)."""
    found = []
    for line in compiled.as_text().splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        used = re.search(r'"used_scoped_memory_configs":\[([^\]]*)\]', line)
        name = re.search(r'op_name="([^"]*)"', line)
        size = sum(int(x) for x in re.findall(r'"size":"(\d+)"', used.group(1))) if used else 0
        found.append((name.group(1) if name else "?", size))
    return found

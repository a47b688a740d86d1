"""TPU topologies by name ("v5e:2x4", "v5p:2x2x4") as compile-only devices, with their HBM.

libtpu's compile-only client describes a slice's devices without any TPU attached, so a CPU
host compiles real TPU programs (Mosaic kernels included) and reads their per-chip memory.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

GIB = 1024**3

# HBM per chip, by generation (public TPU specs).
HBM_PER_CHIP: dict[str, int] = {"v4": 32 * GIB, "v5e": 16 * GIB, "v5p": 95 * GIB, "v6e": 32 * GIB}

INSTALL_HINT = 'pip install -e ".[tpu]"  (brings libtpu, the TPU compiler, matching jax)'


@dataclass(frozen=True)
class Topology:
    name: str  # e.g. "v5e:2x4"
    generation: str  # "v5e"
    devices: tuple[Any, ...]
    hbm_per_device: int  # bytes of HBM one JAX device owns

    @property
    def num_devices(self) -> int:
        return len(self.devices)


def compile_only_env() -> None:
    """Environment for compile-only use, set before JAX starts a backend: JAX itself on CPU
    (the compile-only client needs no TPU, and must not grab one a job is using), and libtpu
    allowed to load beside another process that holds it (its lockfile would refuse)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask on a build host


def get_topology(name: str) -> Topology:
    """Devices of the TPU topology ``name``; ValueError naming the fix for an unknown generation,
    a malformed or unknown topology, or a missing libtpu."""
    gen, _, dims = name.partition(":")
    if gen not in HBM_PER_CHIP or not dims:
        raise ValueError(
            f"--topology {name!r}: expected <generation>:<chips per dimension>, e.g. v5e:2x4, v6e:2x4, "
            f"v5p:2x2x4, v4:2x2x1; generations known here: {', '.join(HBM_PER_CHIP)}"
        )
    try:
        chips = math.prod(int(x) for x in dims.split("x"))
    except ValueError:
        raise ValueError(f"--topology {name!r}: chip counts must be integers separated by 'x' (e.g. v5e:2x4)") from None
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"--topology {name}: compiling for TPU needs libtpu, which is not installed: {INSTALL_HINT}")
    compile_only_env()
    from jax.experimental import topologies

    try:
        devices = tuple(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except Exception as e:  # libtpu's own error (an unknown shape) or its failure to load
        raise ValueError(
            f"--topology {name!r}: libtpu cannot describe it ({str(e).strip().splitlines()[0]}); "
            f"use a slice shape of that generation (e.g. v5e:2x2, v5e:2x4, v5e:4x4, v6e:2x4, v5p:2x2x4). "
            f"If libtpu failed to load: {INSTALL_HINT}"
        ) from None
    # v4 exposes each chip's two TensorCores as two devices: they share the chip's HBM.
    per_chip = max(1, len(devices) // chips)
    return Topology(name, gen, devices, HBM_PER_CHIP[gen] // per_chip)

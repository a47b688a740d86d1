"""TPU topologies by name ("v5e:2x4", "v5p:2x2x4") and NVIDIA GPUs ("gpu:h100", "gpu:h100x8") as
compile-only devices, with their memory.

libtpu's compile-only client describes a slice's devices without any TPU attached, so a CPU
host compiles real TPU programs (Mosaic kernels included) and reads their per-chip memory.
The CUDA PJRT plugin (``pip install -e ".[cuda]"``) does the same for GPUs given a GPU target
description (XLA's ``GpuTargetConfigProto``, the fields of XLA's own
``xla/backends/gpu/target_config/specs/*.txtpb``): XLA compiles for that GPU with no GPU or
driver present (checked on a CPU host with jax-cuda12-plugin 0.10.2: an H100 train step with
cuDNN's fused attention compiles and reports its memory).
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
GPU_INSTALL_HINT = 'pip install -e ".[cuda]"  (brings the CUDA PJRT plugin, the GPU compiler, matching jax)'

# GPU targets (XLA GpuTargetConfigProto, text format): the fields XLA's compiler reads, from
# XLA's spec file for the GPU (h100_sxm.txtpb); memory in bytes as the device reports it.
GPU_TARGETS: dict[str, str] = {
    "h100": """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84942979072 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
""",
}
GPU_MEMORY = {"h100": 84942979072}


# The most chips one host of a TPU generation has (v5e / v6e: an 8-chip VM; larger slices, and
# every v4 / v5p slice, have 4 chips per host).
MAX_CHIPS_PER_HOST: dict[str, int] = {"v4": 4, "v5e": 8, "v5p": 4, "v6e": 8}


@dataclass(frozen=True)
class Topology:
    name: str  # e.g. "v5e:2x4"
    generation: str  # "v5e"
    devices: tuple[Any, ...]
    hbm_per_device: int  # bytes of HBM one JAX device owns

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def hosts(self) -> int:
        """Hosts (trainer processes) of the slice, from its generation and chip count as GKE
        provisions them (``v5p:2x2x4``: 16 chips, 4 hosts; ``v6e:2x4``: one 8-chip host), else
        as the compile-only devices say (their ``process_index``; libtpu's ``v6e:2x4`` reports 2,
        which is not how a v6e-8 VM runs). A multi-host slice runs RL's embedded engine colocated
        over every device."""
        _, _, dims = self.name.partition(":")
        per_host = MAX_CHIPS_PER_HOST.get(self.generation)
        try:
            chips = math.prod(int(x) for x in dims.split("x"))
        except ValueError:  # "gpu:h100x8" and the like: one host
            return 1
        if per_host is None:
            return len({getattr(d, "process_index", 0) for d in self.devices}) or 1
        return 1 if chips <= per_host else -(-chips // 4)


def compile_only_env() -> None:
    """Environment for compile-only use, set before JAX starts a backend: JAX itself on CPU
    (the compile-only client needs no TPU, and must not grab one a job is using), and libtpu
    allowed to load beside another process that holds it (its lockfile would refuse)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask on a build host


def get_topology(name: str) -> Topology:
    """Devices of the TPU topology ``name`` (or GPUs, "gpu:<model>[x<count>]"); ValueError naming
    the fix for an unknown generation, a malformed or unknown topology, or a missing compiler."""
    gen, _, dims = name.partition(":")
    if gen == "gpu":
        return _gpu_topology(name, dims)
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


def _cuda_plugin_installed() -> bool:
    return any(importlib.util.find_spec(p) is not None for p in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


def _gpu_topology(name: str, spec: str) -> Topology:
    """``count`` compile-only GPUs of ``model`` ("h100x8": 8 H100s on one host)."""
    model, _, count = spec.partition("x")
    if model not in GPU_TARGETS or (count and not count.isdigit()):
        raise ValueError(
            f"--topology {name!r}: expected gpu:<model>[x<GPUs>], e.g. gpu:h100, gpu:h100x8; "
            f"models known here: {', '.join(GPU_TARGETS)}"
        )
    if not _cuda_plugin_installed():
        raise RuntimeError(f"--topology {name}: compiling for GPU needs the CUDA PJRT plugin, which is not installed: {GPU_INSTALL_HINT}")
    compile_only_env()
    from jax.experimental import topologies

    n = int(count or 1)
    devices = tuple(
        topologies.get_topology_desc(platform="cuda", topology=f"1x1x{n}", target_config=GPU_TARGETS[model]).devices
    )
    return Topology(name, f"gpu:{model}", devices, GPU_MEMORY[model])

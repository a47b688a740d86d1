"""Which implementation to run on which platform: one table, so callers never guess.

Our Pallas kernels are written for TPU (Mosaic): VMEM scratch accumulators, a reduction grid
axis marked ``"arbitrary"``, scalar prefetch. Triton (GPU) lowering supports none of those, and
the kernels have not been run on a GPU, so on GPU the training attention is cuDNN's fused flash
attention (``cudnn_attention``, NVIDIA only) and the rest the pure-JAX references (XLA fuses them
well there); on CPU the Pallas kernels exist only in interpret mode, which is slow and used for
testing. Change the table here, not at the call sites.
"""

from __future__ import annotations

import jax

PALLAS_PLATFORMS = frozenset({"tpu"})
# JAX names CUDA devices "gpu" (``device.platform``, ``jax.default_backend()``); "cuda" is the
# lowering platform's name (``jax.export``, compile-only topologies). ROCm has no cuDNN.
CUDNN_PLATFORMS = frozenset({"gpu", "cuda"})


def current_platform() -> str:
    """The platform of JAX's default backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
    return jax.default_backend()


def use_pallas(platform: str | None = None) -> bool:
    """True where the compiled Pallas kernels should run (TPU), False elsewhere (CPU, GPU).

    ``platform`` defaults to JAX's default backend; pass one to decide for a mesh's devices
    (``mesh.devices.flat[0].platform``).
    """
    return (platform or current_platform()).lower() in PALLAS_PLATFORMS


def use_cudnn(platform: str | None = None) -> bool:
    """True where cuDNN's fused attention should run (NVIDIA GPUs)."""
    return (platform or current_platform()).lower() in CUDNN_PLATFORMS

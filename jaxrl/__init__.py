"""jaxrl: JAX/TPU-native reinforcement learning for large language models."""

import os

__version__ = "0.1.0"

_CPU_DOT_FLAG = "--xla_cpu_experimental_ynn_fusion_type=dot"


def _fast_cpu_matmuls() -> None:
    """Route XLA:CPU's float32 dots through YNNPACK unless XLA_FLAGS already says otherwise.

    Measured on this project's 2-core hosts (2026-11, 2048^3 float32 matmul): 128 -> 142 GFLOP/s
    on a quiet host, 57 -> 121 on a busy one; bench/train_step.py (4 layers, quiet host) went
    from 199 to 278 tok/s. Set here, at import, because XLA reads its flags when JAX creates the
    CPU backend (the first computation); only the CPU backend reads this flag.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_CPU_DOT_FLAG}".strip()


_fast_cpu_matmuls()

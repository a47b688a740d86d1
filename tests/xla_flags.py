"""The XLA flags of the test suite and of the processes its tests start.

Compiles dominate the suite's time: at LLVM's -O0, without its expensive passes, XLA:CPU
compiles the tiny models' programs about a third faster (trainer + engine tests: 118 s -> 80 s
on a 2-core host), and they still run in moments. Tests check what programs compute, never how
fast they run; the README's main job and the benchmarks keep XLA's defaults."""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def cpu_devices(n: int) -> str:
    """XLA_FLAGS for a process with ``n`` virtual CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}"

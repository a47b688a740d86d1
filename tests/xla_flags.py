"""The XLA flags of the test suite and of the processes its tests start.

Compiles dominate the suite's time: at LLVM's -O0, without its expensive passes, XLA:CPU
compiles the tiny models' programs about a third faster (trainer + engine tests: 118 s -> 80 s
on a 2-core host), and they still run in moments. The suite runs in two pytest-xdist workers on
the host's cores, so each process's XLA runs its kernels on one thread (Eigen's pool would spin
on cores the other worker needs): trainer + engine tests 182 s in one process, 138 s in two with
the pool, 127 s in two without it (2026-11-29). Tests check what programs compute, never how fast
they run; the README's main job and the benchmarks keep XLA's defaults."""

FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_multi_thread_eigen=false"
)


def cpu_devices(n: int) -> str:
    """XLA_FLAGS for a process with ``n`` virtual CPU devices."""
    return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}"

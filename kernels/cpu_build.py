"""Builds and registers the C++ XLA FFI kernels for CPU (``cpu_*.cc`` beside this file).

Each source is compiled once per machine with the system C++ compiler (``$CXX`` or ``c++``,
``-O3 -march=native``) against the FFI headers jaxlib ships, into a cache directory
(``$JAXRL_KERNEL_CACHE``, default ``~/.cache/jaxrl/kernels``) keyed by the source, the flags, the
compiler, the jaxlib version and the CPU; later processes load the cached library. Where there
is no compiler or the build fails, ``CppKernel.load()`` returns None with the reason logged once,
and callers keep their pure-JAX reference: a missing toolchain costs speed, never a run.

Why not a pre-built wheel: ``-march=native`` is what makes these kernels fast (the widest FMA
the host has), and the FFI ABI is jaxlib's; a build on the machine that runs them gets both.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax

log = logging.getLogger(__name__)

# -ffp-contract=fast: multiply-adds become FMAs (ISO C++ modes otherwise keep them separate).
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def default_compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@dataclass(frozen=True)
class CppKernel:
    """One FFI handler: ``source`` (a file beside this module) exports ``symbol``, registered
    with XLA:CPU as ``target``."""

    source: str
    symbol: str
    target: str

    @property
    def path(self) -> Path:
        return Path(__file__).with_name(self.source)

    def library_path(self, compiler: str) -> Path:
        key = hashlib.sha256()
        for part in (self.path.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), jax.__version__.encode()):
            key.update(part)
        key.update(_cpu_model().encode())
        cache = Path(os.environ.get("JAXRL_KERNEL_CACHE", Path.home() / ".cache" / "jaxrl" / "kernels"))
        return cache / f"{self.path.stem}-{key.hexdigest()[:16]}.so"

    def _build(self, compiler: str, out: Path) -> None:
        """Compile to a temporary file beside ``out``, then rename: concurrent builders never
        load a half-written library."""
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(self.path), "-o", tmp]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
            os.replace(tmp, out)
        finally:
            Path(tmp).unlink(missing_ok=True)

    def load(self) -> str | None:
        """Build (once per machine) and register the kernel with the default compiler; the FFI
        target name, or None (reason logged once) where it cannot be built."""
        return _load(self)

    def build_and_register(self, compiler: str | None) -> str | None:
        """``load()`` with this compiler (uncached: tests use it to check the fallback)."""
        if compiler is None:
            log.warning("no C++ compiler ($CXX, c++, g++): %s is not built, the pure-JAX reference runs", self.source)
            return None
        path = self.library_path(compiler)
        try:
            if not path.exists():
                t0 = time.perf_counter()
                self._build(compiler, path)
                log.info("built %s in %.1f s: %s", self.source, time.perf_counter() - t0, path)
            lib = ctypes.cdll.LoadLibrary(str(path))
            jax.ffi.register_ffi_target(self.target, jax.ffi.pycapsule(getattr(lib, self.symbol)), platform="cpu")
        except Exception as e:  # any failure to build or load costs speed, never the run
            detail = getattr(e, "stderr", "") or ""
            log.warning("%s unavailable (%s %s): the pure-JAX reference runs", self.source, e, detail[-2000:])
            return None
        return self.target


@functools.cache
def _load(kernel: CppKernel) -> str | None:
    return kernel.build_and_register(default_compiler())

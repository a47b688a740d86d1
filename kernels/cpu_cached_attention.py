"""Attention over the KV cache on XLA:CPU (decode steps and prefill chunks): a C++ XLA FFI kernel
(``cpu_cached_attention.cc``).

Why: the pure-JAX reference (``jaxrl.models.decoder.cached_attention``) is memory-bound and
XLA:CPU reads the cache about three times per step (a gathered copy of each chunk, then the
products); the kernel reads each live key and value once. See the .cc file for the semantics,
which are the reference's (tests compare the two).

The source is compiled once per machine with the system C++ compiler (``$CXX`` or ``c++``,
``-O3 -march=native``) against the FFI headers jaxlib ships, into a cache directory
(``$JAXRL_KERNEL_CACHE``, default ``~/.cache/jaxrl/kernels``) keyed by the source, the flags, the
jaxlib version and the CPU; later processes load the cached library. Where there is no compiler
or the build fails, ``load()`` returns None with the reason logged once, and callers keep the
reference: a missing toolchain costs speed, never a run.
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
from pathlib import Path

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_cached_attention.cc")
TARGET = "jaxrl_cpu_cached_attention"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _library_path(compiler: str) -> Path:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), jax.__version__.encode()):
        key.update(part)
    key.update(_cpu_model().encode())
    cache = Path(os.environ.get("JAXRL_KERNEL_CACHE", Path.home() / ".cache" / "jaxrl" / "kernels"))
    return cache / f"cpu_cached_attention-{key.hexdigest()[:16]}.so"


def _build(compiler: str, out: Path) -> None:
    """Compile to a temporary file beside ``out``, then rename: concurrent builders never load
    a half-written library."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def load() -> str | None:
    """Build (once per machine) and register the kernel; the FFI target name, or None (reason
    logged once) where it cannot be built."""
    return build_and_register(os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++"))


def build_and_register(compiler: str | None) -> str | None:
    """``load()`` with this compiler (uncached: tests use it to check the fallback)."""
    if compiler is None:
        log.warning("no C++ compiler ($CXX, c++, g++): CPU cached attention uses the pure-JAX reference")
        return None
    path = _library_path(compiler)
    try:
        if not path.exists():
            t0 = time.perf_counter()
            _build(compiler, path)
            log.info("built the CPU cached-attention kernel in %.1f s: %s", time.perf_counter() - t0, path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxrlCpuCachedAttention), platform="cpu")
    except Exception as e:  # any failure to build or load costs speed, never the run
        detail = getattr(e, "stderr", "") or ""
        log.warning("CPU cached-attention kernel unavailable (%s %s): using the pure-JAX reference", e, detail[-2000:])
        return None
    return TARGET


def cpu_cached_attention(
    q: jax.Array,
    kc: jax.Array,
    vc: jax.Array,
    layer: jax.Array,
    rows: jax.Array,
    positions: jax.Array,
    share_rows: jax.Array | None = None,
    share_lens: jax.Array | None = None,
) -> jax.Array:
    """``cached_attention``'s result (q [B, T, H, D] at ``positions`` [B, T] over cache row
    ``rows[b]`` of ``layer`` in the caches [L, R, K, S, D], float32 or bfloat16), from the C++
    kernel; ``load()`` must have returned a target. Padding rows and positions give zeros.

    ``share_rows`` / ``share_lens`` [B] (optional): positions < ``share_lens[b]`` of row
    ``rows[b]`` hold the same keys and values as row ``share_rows[b]``, and are read there (one
    copy shared by many rows stays in cache); the caller guarantees the values are equal, so the
    result is the same bit for bit."""
    target = load()
    assert target is not None, "cpu_cached_attention needs load() to succeed"
    if share_rows is None or share_lens is None:
        share_rows = share_lens = jnp.zeros(rows.shape, jnp.int32)
    out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32),
        kc,
        vc,
        jnp.asarray(layer, jnp.int32),
        rows.astype(jnp.int32),
        positions.astype(jnp.int32),
        share_rows.astype(jnp.int32),
        share_lens.astype(jnp.int32),
    )
    return out.astype(q.dtype)

"""Decode-step projections on XLA:CPU: a C++ XLA FFI matmul (``cpu_matmul.cc``) on weights packed
once into column panels.

Why: a decode step multiplies one row per sequence by every weight matrix, and XLA:CPU runs such
small-batch dots on one core at a third of its peak (see the .cc file for the measurements). The
engine packs each layer's projection weights once per weight update (``PackedWeight.pack``) and
the decoder's serving forward multiplies through ``PackedWeight.matmul``. ``x @ w`` is the
semantics; the tests compare the two.

Built and registered by ``kernels.cpu_build``; where it cannot be built, ``load()`` returns None
and the engine keeps plain weights and XLA's dots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from kernels.cpu_build import CppKernel

KERNEL = CppKernel("cpu_matmul.cc", "JaxrlCpuMatmul", "jaxrl_cpu_matmul")
PANEL = 32  # the kernel's panel width (kNr)

# Floats of x per kernel call (1 MiB, half a core's L2 on the hosts measured): every panel
# re-reads x, so longer inputs (prefill chunks) go through in row blocks of this size, each one
# call that streams the weight once.
X_BLOCK_FLOATS = 2**18


def load() -> str | None:
    """The FFI target name once built and registered, or None (reason logged once)."""
    return KERNEL.load()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A projection weight ``w`` [K, N] (stored as ``shape``, e.g. [D, heads, head_dim]) packed
    for the kernel: ``panels`` [ceil(N / 32), K, 32], zero-padded, each panel one contiguous
    block the kernel streams front to back."""

    panels: jax.Array
    shape: tuple[int, ...] = field(metadata={"static": True})  # the weight as the model stores it
    n: int = field(metadata={"static": True})  # columns of the [K, N] matrix

    @classmethod
    def pack(cls, w: jax.Array, k: int) -> PackedWeight:
        """``w`` (any shape whose leading axes multiply to ``k``; the rest is N) packed."""
        mat = w.reshape(k, -1)
        n = mat.shape[1]
        p = -(-n // PANEL)
        panels = jnp.pad(mat, ((0, 0), (0, p * PANEL - n))).reshape(k, p, PANEL).transpose(1, 0, 2)
        return cls(panels, tuple(w.shape), n)

    def unpack(self) -> jax.Array:
        """The weight in its stored shape (a copy)."""
        p, k, _ = self.panels.shape
        return self.panels.transpose(1, 0, 2).reshape(k, p * PANEL)[:, : self.n].reshape(self.shape)

    def matmul(self, x: jax.Array) -> jax.Array:
        """``x [..., K] @ w`` in float32, by the kernel."""
        target = load()
        assert target is not None, "PackedWeight.matmul needs load() to succeed"
        k = self.panels.shape[1]
        rows = x.reshape(-1, k).astype(jnp.float32)
        block = max(X_BLOCK_FLOATS // k, 8)
        call = lambda r: jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((r.shape[0], self.n), jnp.float32))(r, self.panels)  # noqa: E731
        out = jnp.concatenate([call(rows[i : i + block]) for i in range(0, rows.shape[0], block)] or [call(rows)])
        return out.reshape(*x.shape[:-1], self.n)

    def columns(self, index: jax.Array) -> jax.Array:
        """``w[:, index]`` as [..., K] vectors (a tied embedding's rows, read from its packed
        transpose: the embedding is kept once, as the output projection's panels)."""
        return self.panels[index // PANEL, :, index % PANEL]

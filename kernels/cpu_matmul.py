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
    """A stack of L projection weights, each [K, N] (stored by the model as ``shape``, e.g.
    [L, D, heads, head_dim]), packed for the kernel: ``panels`` [L, ceil(N / 32), K, 32],
    zero-padded, each panel one contiguous block the kernel streams front to back. ``index``:
    the layer a multiplication uses (``at``; a traced scalar inside a layer scan), 0 if unset."""

    panels: jax.Array
    shape: tuple[int, ...] = field(metadata={"static": True})  # the weights as the model stores them
    n: int = field(metadata={"static": True})  # columns of each [K, N] matrix
    index: jax.Array | None = None

    @classmethod
    def pack(cls, w: jax.Array, k: int) -> PackedWeight:
        """``w`` [L, ...]: L matrices, each of whose leading axes (after L) multiply to ``k``."""
        layers = w.shape[0]
        mat = w.reshape(layers, k, -1)
        n = mat.shape[2]
        p = -(-n // PANEL)
        padded = jnp.pad(mat, ((0, 0), (0, 0), (0, p * PANEL - n)))
        return cls(padded.reshape(layers, k, p, PANEL).transpose(0, 2, 1, 3), tuple(w.shape), n)

    def unpack(self) -> jax.Array:
        """The weights in their stored shape (a copy)."""
        layers, p, k, _ = self.panels.shape
        return self.panels.transpose(0, 2, 1, 3).reshape(layers, k, p * PANEL)[..., : self.n].reshape(self.shape)

    def at(self, index: jax.Array | int) -> PackedWeight:
        """The same stack, multiplying with layer ``index``."""
        return PackedWeight(self.panels, self.shape, self.n, jnp.asarray(index, jnp.int32))

    def matmul(self, x: jax.Array) -> jax.Array:
        """``x [..., K] @ w[index]`` in float32, by the kernel (which reads the layer in place)."""
        target = load()
        assert target is not None, "PackedWeight.matmul needs load() to succeed"
        k = self.panels.shape[2]
        rows = x.reshape(-1, k).astype(jnp.float32)
        index = jnp.int32(0) if self.index is None else self.index
        block = max(X_BLOCK_FLOATS // k, 8)

        def call(r: jax.Array) -> jax.Array:
            out = jax.ShapeDtypeStruct((r.shape[0], self.n), jnp.float32)
            return jax.ffi.ffi_call(target, out)(r, self.panels, index)

        out = jnp.concatenate([call(rows[i : i + block]) for i in range(0, rows.shape[0], block)] or [call(rows)])
        return out.reshape(*x.shape[:-1], self.n)

    def columns(self, index: jax.Array) -> jax.Array:
        """Columns ``index`` of layer 0 as [..., K] vectors (a tied embedding's rows, read from
        its packed transpose: the embedding is kept once, as the output projection's panels)."""
        return self.panels[0, index // PANEL, :, index % PANEL]

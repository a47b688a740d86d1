"""Decode-step projections on XLA:CPU: a C++ XLA FFI matmul (``cpu_matmul.cc``) on weights packed
once into column panels.

Why: a decode step multiplies one row per sequence by every weight matrix, and XLA:CPU runs such
small-batch dots on one core at a third of its peak (see the .cc file for the measurements). The
engine packs each layer's projection weights once per weight update (``PackedWeight.pack``, laid
out by ``cpu_serving``) and the decoder's serving forward multiplies through ``PackedWeight.matmul``
(handed to it by ``jaxrl.kernel_dispatch``). ``x @ w`` is the
semantics; the tests compare the two.

Built and registered by ``jaxrl_kernels.cpu_build``; where it cannot be built, ``load()`` returns None
and the engine keeps plain weights and XLA's dots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels.cpu_build import CppKernel

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
    """Stacks of L projection weights that multiply the same input (``names``: e.g. q, k and v),
    each [K, N_i] per layer, packed side by side for the kernel: ``panels`` [L, ceil(N / 32), K,
    32] with N = sum(``parts``), zero-padded, each panel one contiguous block the kernel streams
    front to back. One call computes every part (fewer, larger calls: vLLM's merged QKV and
    gate-up projections). ``shapes``: each part as the model stores it (e.g. [L, D, heads,
    head_dim]). ``index``: the layer a multiplication uses (``at``: a traced scalar inside the
    layer scan), 0 if unset."""

    panels: jax.Array
    names: tuple[str, ...] = field(metadata={"static": True})
    shapes: tuple[tuple[int, ...], ...] = field(metadata={"static": True})
    parts: tuple[int, ...] = field(metadata={"static": True})  # N of each part
    index: jax.Array | None = None

    @classmethod
    def pack(cls, ws: dict[str, jax.Array], k: int) -> PackedWeight:
        """``ws`` {name: [L, ...]}: stacks whose axes after L multiply to ``k`` x N_i."""
        mats = [w.reshape(w.shape[0], k, -1) for w in ws.values()]
        mat = jnp.concatenate(mats, axis=2) if len(mats) > 1 else mats[0]
        layers, _, n = mat.shape
        p = -(-n // PANEL)
        padded = jnp.pad(mat, ((0, 0), (0, 0), (0, p * PANEL - n)))
        panels = padded.reshape(layers, k, p, PANEL).transpose(0, 2, 1, 3)
        return cls(panels, tuple(ws), tuple(tuple(w.shape) for w in ws.values()), tuple(m.shape[2] for m in mats))

    @property
    def n(self) -> int:
        return sum(self.parts)

    def unpack(self) -> dict[str, jax.Array]:
        """Each part in its stored shape (copies)."""
        layers, p, k, _ = self.panels.shape
        mat = self.panels.transpose(0, 2, 1, 3).reshape(layers, k, p * PANEL)
        ends = np.cumsum(self.parts)
        return {n: mat[..., e - c : e].reshape(s) for n, s, c, e in zip(self.names, self.shapes, self.parts, ends)}

    def at(self, index: jax.Array | int) -> PackedWeight:
        """The same stacks, multiplying with layer ``index``."""
        return PackedWeight(self.panels, self.names, self.shapes, self.parts, jnp.asarray(index, jnp.int32))

    def matmul(self, x: jax.Array) -> list[jax.Array]:
        """``x [..., K] @ w_i[index]`` for every part, in float32, by one kernel call (per row
        block; the kernel reads the layer in place)."""
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
        out = out.reshape(*x.shape[:-1], self.n)
        return jnp.split(out, np.cumsum(self.parts)[:-1].tolist(), axis=-1) if len(self.parts) > 1 else [out]

    def columns(self, index: jax.Array) -> jax.Array:
        """Columns ``index`` of layer 0 as [..., K] vectors (a tied embedding's rows, read from
        its packed transpose: the embedding is kept once, as the output projection's panels)."""
        return self.panels[0, index // PANEL, :, index % PANEL]

"""Mixture-of-experts routing and expert dispatch (pure JAX): the reference every platform's
expert kernel must match.

``route`` is Qwen3-MoE's top-k router (transformers' ``Qwen3MoeTopKRouter``): softmax over the
router logits in float32, the k largest probabilities, renormalised to sum to 1 when
``norm_topk_prob``. Given ``forced`` expert ids (routing replay, "R3"), those experts are used
instead of the top k, and their gates are still this router's probabilities at those ids, so the
router keeps its gradient.

``expert_mlp_reference`` runs each token through its k experts with no capacity limit (no token
is ever dropped, so it is exact): the ``N * k`` (token, expert) pairs are sorted by expert, each
expert's SwiGLU MLP runs on its contiguous group of rows by a grouped matmul, and the rows are
unsorted and summed with their gates. The grouped matmul ``gmm(lhs [M, D], rhs [E, D, F],
group_sizes [E]) -> [M, F]`` is a parameter:

* ``jax.lax.ragged_dot`` (the default): XLA's ragged dot. XLA:CPU has no native form; jax
  lowers it there as a dense dot of every row against every expert, masked, E times the FLOPs
  (measured: 26x a dense matmul of the same rows at E = 8). XLA:GPU does the same (its
  ``RaggedDotRewriter``, jaxlib 0.10.2: an [E, M, D] select then a dense dot, compiled for H100).
* ``tiled_gmm``: the same product in tiles of rows that each belong to one expert (groups
  padded to the tile), as a batched matmul over tiles: about ``M + E * tile`` rows of work.
  What CPU and GPU run (``jaxrl.kernel_dispatch.Kernels.expert_mlp``); TPU runs Megablox.

Imports nothing from ``jaxrl``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# (lhs [M, D], rhs [E, D, F], group_sizes int32 [E]) -> [M, F]; rows of lhs sorted by group.
GroupedMatmul = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def route(
    h: jax.Array, router_w: jax.Array, k: int, norm_topk_prob: bool, forced: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing of tokens ``h`` [N, D] by ``router_w`` [D, E].

    Returns ``(expert_ids int32 [N, k], gates float32 [N, k], router_probs float32 [N, E])``.
    ``forced`` (int [N, k]): use these experts (ids in [0, E), checked by the caller) with gates
    gathered from this router's probabilities, so the router still receives gradients.
    The router runs in float32 whatever the compute dtype: a bf16 near-tie flipping a token's
    expert between the engine and the trainer is exactly the mismatch routing replay exists for.
    """
    logits = jnp.dot(h.astype(jnp.float32), router_w.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    if forced is None:
        gates, ids = jax.lax.top_k(probs, k)
    else:
        ids = forced.astype(jnp.int32)
        gates = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), gates, probs


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """XLA's ragged dot (the reference grouped matmul), accumulating in float32."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile of ``tiled_gmm`` for ``rows`` sorted rows over ``groups`` groups: about one
    tile per group (so padding adds at most ~``rows`` rows), a power of two in [8, 128]. A
    one-token-per-sequence decode step of 32 rows x 8 experts gets 8-row tiles; a 4096-row
    training micro-batch 128-row tiles (1.25x the rows at E = 8)."""
    per_group = max(rows // max(groups, 1), 1)
    return int(min(128, max(8, 1 << (per_group.bit_length() - 1))))


def tiled_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tile: int | None = None) -> jax.Array:
    """``ragged_dot`` as a batched matmul over row tiles that each belong to one group.

    Each group's rows are placed at the start of its own run of whole tiles (gathered, so the
    backward pass is a scatter-add, never a dense mask), each tile multiplies its group's
    matrix, and the rows are read back from their padded places. Static shapes: there are
    ``ceil(M / tile) + E`` tiles (the most the padding can need); tiles past the last group are
    zero rows. Work: that many tiles of ``tile`` rows, plus a copy of one group's matrix per tile.
    """
    m, d = lhs.shape
    e = rhs.shape[0]
    tile = tile or tile_rows(m, e)
    n_tiles = -(-m // tile) + e
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # first sorted row of each group
    padded = -(-sizes // tile) * tile
    padded_ends = jnp.cumsum(padded)
    padded_starts = padded_ends - padded
    # Padded slot p -> its group, its rank in the group, the sorted row it holds (if any).
    slot = jnp.arange(n_tiles * tile, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(padded_ends, slot, side="right"), e - 1).astype(jnp.int32)
    rank = slot - padded_starts[group]
    valid = rank < sizes[group]
    source = jnp.where(valid, starts[group] + rank, 0)
    x = jnp.where(valid[:, None], lhs[source], jnp.zeros((), lhs.dtype)).reshape(n_tiles, tile, d)
    tile_group = group[::tile]
    out = jnp.einsum("tbd,tdf->tbf", x, rhs[tile_group], preferred_element_type=jnp.float32)
    out = out.reshape(n_tiles * tile, -1)
    # Sorted row i -> its padded slot.
    row = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"), e - 1)
    return out[padded_starts[row_group] + row - starts[row_group]].astype(lhs.dtype)


def expert_mlp_reference(
    x: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    gmm: GroupedMatmul = ragged_dot,
) -> jax.Array:
    """``sum_j weights[n, j] * MLP_{expert_ids[n, j]}(x[n])`` for tokens ``x`` [N, D], with the
    SwiGLU MLP of expert e ``(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]`` (w_gate, w_up
    [E, D, F], w_down [E, F, D]). No capacity: every (token, expert) pair is computed."""
    n, d = x.shape
    k = expert_ids.shape[-1]
    e = w_gate.shape[0]
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[order // k]
    hidden = jax.nn.silu(gmm(xs, w_gate, sizes)) * gmm(xs, w_up, sizes)
    ys = gmm(hidden, w_down, sizes)
    back = ys[jnp.argsort(order)].reshape(n, k, d)  # unsorted: pair (n, j) at [n, j]
    out = jnp.einsum("nk,nkd->nd", weights.astype(jnp.float32), back.astype(jnp.float32))
    return out.astype(x.dtype)

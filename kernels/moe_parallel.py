"""The expert MLP under a device mesh: each device of the "expert" axis holds whole experts.

A grouped matmul (Megablox, ragged dot, ``moe.tiled_gmm``) multiplies rows by *local* expert
matrices, and a Pallas call is opaque to XLA's partitioner, so under a mesh the expert MLP runs
per shard inside ``jax.shard_map``:

* tokens ``x`` [N, D] (with their expert ids and gates) enter split over the mesh's token axes;
* each device holds ``E / expert`` experts (``w_gate``/``w_up``/``w_down`` split on their experts
  dimension over "expert"; their embed and hidden dimensions are gathered whole into the call,
  as FSDP gathers a dense layer's weights);
* when the tokens are split over "expert" too (training: the axis is data-parallel outside these
  layers), each device all-gathers the tokens of its expert group, runs its experts on the
  (token, expert) pairs routed to them (the others are sorted past the groups and not computed:
  no capacity, nothing dropped), and a reduce-scatter sums every token's k expert outputs back
  onto the device that owns the token. That is exact: each pair is computed once, on the device
  holding its expert, and the sum is the one ``expert_mlp_reference`` takes (in another order).
* when they are not (the engine: its rows are whole on every device), each device computes its
  experts' share of every token and a psum adds the shares.

Why all-gather + reduce-scatter and not all-to-all dispatch: with no capacity factor the number
of rows each expert shard receives is data-dependent, and an all-to-all needs static sizes (a
capacity, which drops tokens, or a worst case of every pair to one shard). The gather moves
``expert`` times a device's tokens, a cost that is small next to the expert weights' own
FSDP traffic at the sizes we run (Qwen3-30B-A3B: D 2048 per token against 2048 x 768 per expert).

Imports nothing from ``jaxrl``: the caller passes the mesh and the axis names.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

# (x [N, D], expert_ids [N, k], gates [N, k], w_gate, w_up [E, D, F], w_down [E, F, D]) -> [N, D].
ExpertMlp = Callable[..., jax.Array]

EXPERT_AXIS = "expert"


def _local(local_mlp: ExpertMlp, axis: str | None) -> ExpertMlp:
    """``local_mlp`` on this device's experts only: pairs routed elsewhere get id ``E_local``
    (sorted past the groups, which the grouped matmul does not compute; the reference's
    ``bincount(length=E_local)`` drops them) and gate 0."""

    def run(x, expert_ids, gates, w_gate, w_up, w_down):  # type: ignore[no-untyped-def]
        e_local = w_gate.shape[0]
        first = jax.lax.axis_index(axis) * e_local if axis is not None else 0
        local = expert_ids - first
        here = (local >= 0) & (local < e_local)
        ids = jnp.where(here, local, e_local)
        return local_mlp(x, ids, jnp.where(here, gates, jnp.zeros((), gates.dtype)), w_gate, w_up, w_down)

    return run


def sharded_expert_mlp(
    local_mlp: ExpertMlp, mesh: Mesh, token_axes: str | tuple[str, ...] | None
) -> ExpertMlp:
    """``local_mlp`` (``expert_mlp_reference``'s arguments) run per shard of ``mesh``: tokens
    split over ``token_axes`` (``logical_to_spec``'s entry for them; None: whole), experts over
    the mesh's "expert" axis where it has one of size > 1 (see the module docstring)."""
    ep = mesh.shape.get(EXPERT_AXIS, 1)
    axis = EXPERT_AXIS if ep > 1 else None
    tokens = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes or ())
    gather = axis is not None and axis in tokens
    run = _local(local_mlp, axis)

    def body(x, expert_ids, gates, w_gate, w_up, w_down):  # type: ignore[no-untyped-def]
        if gather:
            x, expert_ids, gates = (
                jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (x, expert_ids, gates)
            )
        out = run(x, expert_ids, gates, w_gate, w_up, w_down)
        if gather:
            return jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, axis) if axis is not None else out

    rows = PartitionSpec(token_axes, None)
    experts = PartitionSpec(axis, None, None)
    # check_vma off: pallas_call (Megablox) has no varying-axes rule; the specs say it all.
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, rows, rows, experts, experts, experts),
        out_specs=rows,
        check_vma=False,
    )

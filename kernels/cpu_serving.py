"""The engine's CPU serving backend: what ``jaxrl.kernel_dispatch`` runs for ``inference.backend.kernels =
"auto"`` on a CPU, and the weight layout it needs.

* Decode projections by the C++ matmul (``cpu_matmul``) on weights packed once per weight update
  (``pack``), each group of weights that multiply the same input packed side by side (``GROUPS``;
  one call computes q, k and v, another gate and up: vLLM's merged projections).
* The output projection packed too; a tied embedding is kept once, as that projection's panels,
  and its rows (the embedding lookup) are read from them.
* Attention over the KV cache by ``cpu_cached_attention`` for one-token decode steps, reading
  prefix positions that several cache rows share from one row (the scheduler's hint).

Nothing in the model knows any of this: the decoder asks ``Kernels`` for a projection, an
embedding lookup, the logits and the cached attention, and gets this module's functions or None
(its own references). ``kernel_dispatch`` imports this module only when "auto" resolves on a CPU,
and treats it as absent when it is not installed: deleting ``kernels/cpu_*`` leaves the
references everywhere. Imports nothing from ``jaxrl``: a state is any pytree whose weights are
keyed by the decoder's weight names (an ``nnx.State``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax

from jaxrl_kernels import cpu_cached_attention, cpu_matmul
from jaxrl_kernels.cpu_matmul import PackedWeight

State = TypeVar("State")

# The decoder's layer projections, grouped by the input they multiply, each with the number of
# its weights' leading axes (after ``layers``) that the product contracts: ``wq`` [L, D, heads,
# head_dim] is [D, heads * head_dim] (1), ``wo`` [L, heads, head_dim, D] is [heads * head_dim, D]
# (2). The decoder asks for its projections by these name tuples (``Kernels.projection``); a
# tuple not listed here keeps XLA's dot.
GROUPS: dict[tuple[str, ...], int] = {("wq", "wk", "wv"): 1, ("wo",): 2, ("w_gate", "w_up"): 1, ("w_down",): 1}


def matmul_available() -> bool:
    """Whether the C++ matmul built (once per machine; where not, the reason is logged)."""
    return cpu_matmul.load() is not None


def attention_available() -> bool:
    """Whether the C++ cached attention built."""
    return cpu_cached_attention.load() is not None


def _name(path: tuple[Any, ...]) -> str:
    """The weight's name (the last dict key of its path in the state)."""
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


@jax.tree_util.register_static
@dataclass(frozen=True)
class PackedInto:
    """Stands for a weight packed into another's ``PackedWeight`` (``name``: the first of its
    ``names``), in the served state."""

    name: str


def _is_packed(x: Any) -> bool:
    return isinstance(x, (PackedWeight, PackedInto))


def pack(state: State) -> State:
    """``state`` with the layer projections of ``GROUPS`` packed (float32, one device): each group
    one ``PackedWeight`` in place of its first weight, the others ``PackedInto`` it; and the
    output projection (``lm_head``, or the tied ``embed`` as its transpose [D, V]) packed, still
    kept once. Fresh buffers; the plain arrays are freed once the caller drops them."""
    values = {_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    packed: dict[str, Any] = {}
    for names, contracted in GROUPS.items():
        if names[0] not in values:  # a mixture-of-experts model with no dense MLP layer
            continue
        k = 1
        for size in values[names[0]].shape[1 : 1 + contracted]:
            k *= size
        packed[names[0]] = PackedWeight.pack({n: values[n] for n in names}, k)
        packed.update({n: PackedInto(names[0]) for n in names[1:]})
    head = "lm_head" if "lm_head" in values else "embed"
    mat = values[head].T if head == "embed" else values[head]  # [D, V]
    packed[head] = PackedWeight.pack({head: mat[None]}, mat.shape[0])
    return jax.tree_util.tree_map_with_path(lambda p, x: packed.get(_name(p), x), state)


def is_packed(state: Any) -> bool:
    return any(isinstance(x, PackedWeight) for x in jax.tree.leaves(state, is_leaf=_is_packed))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ServingWeights:
    """The packed weights of one engine program (``unpack``), which ``Kernels`` hands the decoder
    as its projections, embedding lookup and logits. ``groups``: first name of a ``GROUPS`` entry
    -> its packed stacks; ``head``: the output projection [D, V]; ``tied``: ``head`` holds the
    embedding (its rows are read from it)."""

    groups: dict[str, PackedWeight]
    head: PackedWeight
    tied: bool = field(metadata={"static": True})

    def projection(self, names: tuple[str, ...], layer: jax.Array) -> Callable[[jax.Array], list[jax.Array]] | None:
        """``x -> [x @ w[layer] for w in names]`` (float32) by one kernel call; None where
        ``names`` is not a packed group."""
        packed = self.groups.get(names[0])
        if packed is None or packed.names != names:
            return None
        return packed.at(layer).matmul

    def embedding(self) -> Callable[[jax.Array], jax.Array] | None:
        return self.head.columns if self.tied else None

    def logits(self, hidden: jax.Array) -> jax.Array:
        return self.head.matmul(hidden)[0]


def unpack(state: State) -> tuple[State, ServingWeights | None]:
    """Inside an engine program: ``state`` with every weight in the model's own layout (for
    ``nnx.merge``), and the packed weights (None when ``state`` is not packed). The rebuilt
    weights are dead code once the decoder reads the packed ones (JAX drops them: jit removes
    unused values, scan inputs included)."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_packed)[0]
    groups = {_name(p): x for p, x in flat if isinstance(x, PackedWeight)}
    if not groups:
        return state, None
    plain = {n: v for g in groups.values() for n, v in g.unpack().items()}
    tied = "embed" in groups
    for name in ("embed", "lm_head"):
        if name in groups:  # packed as [1, D, V]
            plain[name] = plain[name][0].T if name == "embed" else plain[name][0]
    model_state = jax.tree_util.tree_map_with_path(
        lambda p, x: plain[_name(p)] if _is_packed(x) else x, state, is_leaf=_is_packed
    )
    head = groups.pop("embed" if tied else "lm_head")
    return model_state, ServingWeights(groups, head, tied)


# The C++ attention over the KV cache (any number of query tokens; ``Kernels`` gives it the
# one-token decode steps).
cached_attention = cpu_cached_attention.cpu_cached_attention

"""The decoder shared by the trainer and the rollout engine (Qwen3 / Qwen3-MoE / Llama 3 / Qwen2.5).

Layer weights are stacked on a leading ``layers`` axis and the forward is a ``lax.scan`` over
them: one layer body is compiled, whatever the depth. Every weight has logical axis names
(``PARAM_LOGICAL_AXES``); ``jaxrl.parallel`` maps those names to mesh axes in one place.

Mixture of experts (``arch.is_moe``): a sparse layer's MLP is a router and routed experts
(``jaxrl_kernels.moe``; the platform's expert kernel by ``Kernels.expert_mlp``). The dense MLP
weights are stacked over the dense layers only and the experts' over the sparse layers only, so a
model that mixes the two kinds (``decoder_sparse_step`` > 1, ``mlp_only_layers``) is scanned as
contiguous runs of one kind (``ModelArch.layer_runs``): exact, one compiled body per run. A dense
model is one run, the program it always was. The forward can take each token's experts
(``routing``, routing replay) and return the experts it used with router statistics (``MoeAux``).

The same ``__call__`` serves training (packed rows, attention restricted by ``segment_ids``)
and inference (a KV cache addressed by cache row and absolute position), so trainer and
sampler log-probs come from one implementation of the math.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jaxrl_kernels.moe import expert_mlp_reference, route

from jaxrl.models.arch import ModelArch
from jaxrl.models.kv_cache import KVCache
from jaxrl.models.layers import (
    CAUSAL_BLOCK,
    ROW_BLOCK,
    apply_rope,
    attention,
    cached_attention,
    dense,
    lora_merge,
    packed_causal_mask,
    rms_norm,
    rope_tables,
)

if TYPE_CHECKING:
    from jaxrl.kernel_dispatch import Kernels

# Logical axes of every weight, keyed by the weight's attribute name.
PARAM_LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "attn_norm": ("layers", "norm"),
    "mlp_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "q_heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "q_heads", "head_dim", "embed"),
    "bq": ("layers", "q_heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    # Mixture of experts: "layers" here is the sparse layers' stack (``ModelArch.moe_layers``).
    "router": ("layers", "embed", "experts"),
    "moe_gate": ("layers", "experts", "embed", "moe_mlp"),
    "moe_up": ("layers", "experts", "embed", "moe_mlp"),
    "moe_down": ("layers", "experts", "moe_mlp", "embed"),
}
DENSE_MLP = ("w_gate", "w_up", "w_down")  # stacked over ``ModelArch.dense_layers``
EXPERT_WEIGHTS = ("router", "moe_gate", "moe_up", "moe_down")  # stacked over ``ModelArch.moe_layers``

# What the backward pass keeps of each layer's forward (``jax.checkpoint`` on the scanned layer):
# "none" keeps every activation (fastest, most memory: at Qwen3-0.6B x 4 rows x 4096 tokens about
# 53 GB per chip), "full" keeps only the layer inputs and recomputes the rest (~1/3 more FLOPs),
# "save_dots" keeps the projections' matmul outputs and recomputes norms, RoPE, attention and
# activations (between the two).
RematPolicy = Literal["none", "full", "save_dots"]
REMAT_POLICIES: dict[str, Any] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def param_name(path: tuple[Any, ...]) -> str:
    """The weight's attribute name (a ``PARAM_LOGICAL_AXES`` key) from a state tree path."""
    return [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)][-1]


@jax.tree_util.register_dataclass
@dataclass
class MoeAux:
    """What the sparse layers did, from ``Decoder.__call__(..., with_moe_aux=True)``.

    ``experts`` int32 [B, T, n_moe_layers, k]: the experts each token used (what routing replay
    records and feeds back as ``routing``); ``router_entropy`` f32 [B, T, n_moe_layers]: the
    entropy of each token's router distribution; ``expert_counts`` f32 [n_moe_layers, E]: the
    (token, expert) assignments per expert over tokens whose segment id is > 0 (expert load);
    ``load_balance_loss`` f32 scalar: transformers' ``load_balancing_loss_func`` (Switch
    Transformer) over those tokens, from the experts used: ``E * sum_e f_e * P_e`` with ``f_e``
    the share of assignments and ``P_e`` the mean router probability of expert e, each averaged
    over the sparse layers. Not multiplied by ``router_aux_loss_coef``.
    ``router_choice`` int32 [B, T, n_moe_layers, k]: the experts this router would pick itself
    (its top-k): equal to ``experts`` unless routing was forced, and under routing replay what
    shows how far the trainer's router has drifted from the engine's choices.
    """

    experts: jax.Array
    router_entropy: jax.Array
    expert_counts: jax.Array
    load_balance_loss: jax.Array
    router_choice: jax.Array


def _rows(v: jax.Array, *, lo: int, n: int) -> jax.Array:
    return v[lo : lo + n]


def _moe_aux(arch: ModelArch, parts: list[Any], b: int, t: int, n_valid: jax.Array) -> MoeAux:
    """``MoeAux`` from the sparse runs' stacked per-layer outputs (layer-major)."""
    k, e = max(arch.num_experts_per_tok, 1), max(arch.num_experts, 1)
    if not parts:  # a dense model
        zeros = jnp.zeros((b, t, 0), jnp.float32)
        none = jnp.zeros((b, t, 0, k), jnp.int32)
        return MoeAux(none, zeros, jnp.zeros((0, e), jnp.float32), jnp.float32(0), none)
    ids, entropy, counts, prob_sum, own = (jnp.concatenate(xs) for xs in zip(*parts, strict=True))
    rows = jnp.maximum(n_valid, 1.0) * counts.shape[0]
    share = jnp.sum(counts, axis=0) / rows
    mean_prob = jnp.sum(prob_sum, axis=0) / rows
    return MoeAux(
        experts=jnp.moveaxis(ids, 0, 2),
        router_entropy=jnp.moveaxis(entropy, 0, 2),
        expert_counts=counts,
        load_balance_loss=arch.num_experts * jnp.sum(share * mean_prob),
        router_choice=jnp.moveaxis(own, 0, 2),
    )


@jax.tree_util.register_dataclass
@dataclass
class LayerAdapters:
    """LoRA adapters (decoder weight name -> ``{"a": [L, *in, r], "b": [L, r, *out]}``) that the
    training forward merges into each layer's weights inside its layer scan: one layer's merged
    weights live at a time (and, in the backward pass, one layer's weight gradient), where
    merging the stacked weights up front holds a merged copy of every adapted weight plus its
    gradient (3.5 GiB each per chip for Qwen3-8B in fp32 over 8 chips)."""

    adapters: dict[str, dict[str, jax.Array]]
    scale: float = dataclass_field(metadata={"static": True})


class Decoder(nnx.Module):
    """Decoder-only transformer; ``__call__`` returns final-norm hidden states (not logits).

    Returning hidden states lets the loss compute log-probs in vocabulary blocks without ever
    materialising ``[tokens, vocab]`` logits; ``logits`` exists for inference and tests.
    """

    def __init__(
        self,
        arch: ModelArch,
        *,
        rngs: nnx.Rngs,
        param_dtype: Any = jnp.float32,
        dtype: Any = jnp.float32,
        remat: RematPolicy = "none",
    ):
        self.arch = arch
        self.dtype = dtype
        self.remat = remat
        L, D, F, V = arch.num_layers, arch.hidden_size, arch.intermediate_size, arch.vocab_size
        H, K, Dh = arch.num_heads, arch.num_kv_heads, arch.head_dim
        init = nnx.initializers.normal(0.02)

        def param(shape: tuple[int, ...], kind: str = "normal") -> nnx.Param:
            if kind == "ones":
                return nnx.Param(jnp.ones(shape, param_dtype))
            if kind == "zeros":
                return nnx.Param(jnp.zeros(shape, param_dtype))
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        self.embed = param((V, D))
        self.attn_norm = param((L, D), "ones")
        self.mlp_norm = param((L, D), "ones")
        self.wq = param((L, D, H, Dh))
        self.wk = param((L, D, K, Dh))
        self.wv = param((L, D, K, Dh))
        self.wo = param((L, H, Dh, D))
        if arch.qkv_bias:
            self.bq = param((L, H, Dh), "zeros")
            self.bk = param((L, K, Dh), "zeros")
            self.bv = param((L, K, Dh), "zeros")
        if arch.qk_norm:
            self.q_norm = param((L, Dh), "ones")
            self.k_norm = param((L, Dh), "ones")
        dense = len(arch.dense_layers)
        if dense:
            self.w_gate = param((dense, D, F))
            self.w_up = param((dense, D, F))
            self.w_down = param((dense, F, D))
        self.final_norm = param((D,), "ones")
        if not arch.tie_word_embeddings:
            self.lm_head = param((D, V))
        if arch.is_moe:
            S, E, Fe = len(arch.moe_layers), arch.num_experts, arch.moe_intermediate_size
            self.router = param((S, D, E))
            self.moe_gate = param((S, E, D, Fe))
            self.moe_up = param((S, E, D, Fe))
            self.moe_down = param((S, E, Fe, D))

    def _layer_weights(self) -> dict[str, jax.Array]:
        names = ["attn_norm", "mlp_norm", "wq", "wk", "wv", "wo"]
        if self.arch.dense_layers:
            names += list(DENSE_MLP)
        if self.arch.qkv_bias:
            names += ["bq", "bk", "bv"]
        if self.arch.qk_norm:
            names += ["q_norm", "k_norm"]
        if self.arch.is_moe:
            names += list(EXPERT_WEIGHTS)
        return {n: getattr(self, n)[...] for n in names}

    def lm_head_weight(self) -> jax.Array:
        """[D, V] output projection (the transposed embedding when tied)."""
        return self.embed[...].T if self.arch.tie_word_embeddings else self.lm_head[...]

    def logits_f32(self, hidden: jax.Array, kernels: Kernels | None = None) -> jax.Array:
        """``hidden [..., D] @ lm_head`` in float32 (the trainer's log-prob math), for sampling.
        A tied embedding is contracted on its own axis ([V, D]), never transposed: XLA:CPU copied
        the transposed table once per decode call (1 ms of a 7 ms step at 8192 x 256).
        ``kernels`` may hand in the same product from a serving layout (``Kernels.logits``)."""
        fn = kernels.logits() if kernels is not None else None
        if fn is not None:
            return fn(hidden)
        h = hidden.astype(jnp.float32)
        if self.arch.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", h, self.embed[...].astype(jnp.float32))
        return jnp.dot(h, self.lm_head[...].astype(jnp.float32))

    def logits(self, hidden: jax.Array) -> jax.Array:
        w = self.lm_head_weight().astype(hidden.dtype)
        return jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_rows: jax.Array | None = None,
        kernels: Kernels | None = None,
        lora: LayerAdapters | None = None,
        routing: jax.Array | None = None,
        with_moe_aux: bool = False,
    ) -> tuple[jax.Array, KVCache | None] | tuple[jax.Array, KVCache | None, MoeAux]:
        """tokens, positions, segment_ids: int [B, T].

        Without a cache, attention is causal within each segment. With a cache, row b writes
        its keys/values into cache row ``cache_rows[b]`` at ``positions[b, t]`` and attends to
        every cached position <= its own (the engine guarantees those are this sequence's).
        ``kernels`` (``jaxrl.kernel_dispatch``) may swap in an attention, a projection, the
        embedding lookup, the expert MLP with the same semantics (default: ours); the engine's
        kernels also carry its serving layout, which the decoder never sees.
        ``lora`` (training forward only): adapters merged into each layer's weights in the scan.
        ``routing`` (MoE only) int [B, T, n_moe_layers, k]: each token's experts per sparse layer,
        ids in [0, num_experts) (``check_routing``), used instead of the router's top k; the gates
        still come from this router (routing replay). ``with_moe_aux``: also return ``MoeAux``
        (``(hidden, cache, aux)``; without it ``(hidden, cache)``).
        """
        arch = self.arch
        b, t = tokens.shape
        if routing is not None:
            want = (b, t, len(arch.moe_layers), arch.num_experts_per_tok)
            if not arch.is_moe or tuple(routing.shape) != want:
                raise ValueError(f"routing must be int [B, T, n_moe_layers, k] = {list(want)}, got {list(routing.shape)}")
            routing = jnp.moveaxis(routing, 2, 0)  # sparse-layer-major, as the expert weights
        valid = None
        if with_moe_aux:
            valid = jnp.ones((b, t), bool) if segment_ids is None else segment_ids > 0
        lookup = kernels.embedding() if kernels is not None else None
        # Rows first, then the cast: cast first, the whole table was converted (and, loop-invariant
        # over an engine program's decode steps, materialized once per call on TPU).
        x = lookup(tokens).astype(self.dtype) if lookup is not None else self.embed[...][tokens].astype(self.dtype)
        cos, sin = rope_tables(positions, jnp.asarray(arch.inv_freq()), arch.rope_attention_scale())
        weights = self._layer_weights()
        mlp = partial(self._mlp, kernels=kernels, valid=valid, with_aux=with_moe_aux)
        if cache is None:
            seg = jnp.ones_like(tokens) if segment_ids is None else segment_ids
            mask = packed_causal_mask(seg)
            query = jax.ShapeDtypeStruct((*tokens.shape, arch.num_heads, arch.head_dim), self.dtype)
            kernel = kernels.training_attention(seg, query) if kernels is not None else None

            def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
                if kernel is not None:  # a kernel with the same semantics (jaxrl.kernel_dispatch)
                    return kernel(q, k, v)
                return attention(q, k, v, mask, causal_block=CAUSAL_BLOCK)

            def body(carry, xs, *, sparse: bool, mlp_offset: int):  # type: ignore[no-untyped-def]
                h, layer = carry
                w, adapters, forced = xs
                if lora is not None:
                    w = {
                        n: lora_merge(v, adapters[n]["a"], adapters[n]["b"], lora.scale) if n in adapters else v
                        for n, v in w.items()
                    }
                project = self._projector(w, kernels, layer, layer + mlp_offset if mlp_offset else layer)
                h, aux = mlp(self._block(h, w, cos, sin, attend, project), w, project, sparse=sparse, forced=forced)
                return (h, layer + 1), aux

            adapters = {} if lora is None else lora.adapters
            (h, _), parts = self._scan_runs(body, (x, jnp.int32(0)), weights, adapters, routing)
        else:
            assert lora is None, "the cached (serving) forward runs merged weights"
            rows = jnp.arange(tokens.shape[0]) if cache_rows is None else cache_rows
            kernel = kernels.cached_attention(positions, rows) if kernels is not None else None
            row_block = None if kernels is not None and kernels.loops_sync_host else ROW_BLOCK

            def body(carry, xs, *, sparse: bool, mlp_offset: int):  # type: ignore[no-untyped-def]
                h, kc, vc, layer = carry
                w, _, forced = xs

                def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
                    nonlocal kc, vc
                    # One head_dim vector per (token, kv head): a scatter whose update window is
                    # head_dim alone leaves XLA's TPU layout for the cache heads-major (a
                    # [kv_heads, head_dim] window would make it re-lay the cache positions-major
                    # and copy it back for the decode kernel, per step).
                    heads = jnp.arange(k.shape[2])[None, None, :]
                    idx = (layer, rows[:, None, None], heads, positions[:, :, None])
                    kc = kc.at[idx].set(k.astype(kc.dtype), mode="drop")
                    vc = vc.at[idx].set(v.astype(vc.dtype), mode="drop")
                    if kernel is not None:  # reads the whole cache in place
                        return kernel(q, kc, vc, layer)
                    return cached_attention(q, kc, vc, layer, rows, positions, row_block=row_block)

                project = self._projector(w, kernels, layer, layer + mlp_offset if mlp_offset else layer)
                h, aux = mlp(self._block(h, w, cos, sin, attend, project), w, project, sparse=sparse, forced=forced)
                return (h, kc, vc, layer + 1), aux

            (h, kc, vc, _), parts = self._scan_runs(body, (x, cache.k, cache.v, jnp.int32(0)), weights, {}, routing)
            cache = KVCache(kc, vc)
        hidden = rms_norm(h, self.final_norm[...], arch.rms_norm_eps)
        if not with_moe_aux:
            return hidden, cache
        n_valid = jnp.sum(valid.astype(jnp.float32))
        return hidden, cache, _moe_aux(arch, parts, b, t, n_valid)

    def _scan_runs(self, body, carry, weights, adapters, routing):  # type: ignore[no-untyped-def]
        """``lax.scan`` of ``body`` over the layers, one scan per run of one kind
        (``ModelArch.layer_runs``; a dense model is one run over the whole stacks). Each run gets
        its layers' slice of every stack (all layers' weights, the dense MLPs', the experts', the
        adapters and the forced routing), and the layer counter in ``carry`` (its last element)
        runs on. Returns the final carry and the sparse runs' stacked per-layer outputs."""
        parts = []
        for sparse, start, stop, first in self.arch.layer_runs():

            def cut(name: str, value: Any, *, sparse=sparse, start=start, stop=stop, first=first) -> Any:
                lo = first if name in DENSE_MLP or name in EXPERT_WEIGHTS else start
                whole = lo == 0 and stop - start == jax.tree.leaves(value)[0].shape[0]
                return value if whole else jax.tree.map(partial(_rows, lo=lo, n=stop - start), value)

            def ours(name: str, *, sparse=sparse) -> bool:
                return name not in (DENSE_MLP if sparse else EXPERT_WEIGHTS)

            w = {n: cut(n, v) for n, v in weights.items() if ours(n)}
            ad = {n: cut(n, v) for n, v in adapters.items() if ours(n)}
            forced = cut("router", routing) if sparse and routing is not None else None
            fn = partial(body, sparse=sparse, mlp_offset=first - start)
            if self.remat != "none":
                fn = jax.checkpoint(fn, prevent_cse=False, policy=REMAT_POLICIES[self.remat])
            carry, ys = jax.lax.scan(fn, carry, (w, ad, forced))
            if sparse and ys is not None:
                parts.append(ys)
        return carry, parts

    def _projector(
        self, w: dict[str, jax.Array], kernels: Kernels | None, layer: jax.Array, mlp_layer: jax.Array
    ) -> Callable[[jax.Array, tuple[str, ...]], list[jax.Array]]:
        """``(h, names) -> [h @ w[name] for name in names]`` for weights that multiply the same
        input (head weights stored [D, heads, head_dim] are one [D, heads * head_dim] matmul), from
        ``kernels`` where it has a projection for ``names`` (``Kernels.projection``), else ``dense``.
        A kernel reads layer ``layer`` of its own copy of the weights (``mlp_layer`` of the dense
        MLPs' stack for those): its projected weights in ``w`` are then unused (the engine's
        rebuild of them is dropped as dead code)."""
        dt = self.dtype

        def project(h: jax.Array, names: tuple[str, ...]) -> list[jax.Array]:
            index = mlp_layer if names[0] in DENSE_MLP else layer
            fn = kernels.projection(names, index) if kernels is not None else None
            if fn is not None:
                return [y.astype(dt) for y in fn(h)]
            return [dense(h, w[n].astype(dt).reshape(h.shape[-1], -1)) for n in names]

        return project

    def _block(self, x, w, cos, sin, attend, project):  # type: ignore[no-untyped-def]
        """One layer's attention half; ``attend(q, k, v)`` is the attention (and, with a cache,
        its writes), ``project(h, names)`` the projections (``_projector``)."""
        arch, dt = self.arch, self.dtype
        eps = arch.rms_norm_eps
        b, t, _ = x.shape
        H, K, Dh = arch.num_heads, arch.num_kv_heads, arch.head_dim
        h = rms_norm(x, w["attn_norm"], eps)
        q, k, v = project(h, ("wq", "wk", "wv"))
        q, k, v = q.reshape(b, t, H, Dh), k.reshape(b, t, K, Dh), v.reshape(b, t, K, Dh)
        if arch.qkv_bias:
            q, k, v = q + w["bq"].astype(dt), k + w["bk"].astype(dt), v + w["bv"].astype(dt)
        if arch.qk_norm:
            q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = attend(q, k, v)
        return x + project(attn.reshape(b, t, H * Dh), ("wo",))[0]

    def _mlp(self, x, w, project, *, sparse, forced, kernels, valid, with_aux):  # type: ignore[no-untyped-def]
        """One layer's MLP half: the dense SwiGLU MLP, or (``sparse``) the router and routed
        experts, which also return their per-layer statistics when ``with_aux`` (else None)."""
        arch, dt = self.arch, self.dtype
        h = rms_norm(x, w["mlp_norm"], arch.rms_norm_eps)
        if not sparse:
            gate, up = project(h, ("w_gate", "w_up"))
            return x + project(jax.nn.silu(gate) * up, ("w_down",))[0], None
        b, t, d = x.shape
        k = arch.num_experts_per_tok
        flat = h.reshape(b * t, d)
        ids, gates, probs = route(
            flat, w["router"], k, arch.norm_topk_prob, None if forced is None else forced.reshape(b * t, k)
        )
        experts = kernels.expert_mlp() if kernels is not None else None
        y = (experts or expert_mlp_reference)(
            flat, ids, gates, w["moe_gate"].astype(dt), w["moe_up"].astype(dt), w["moe_down"].astype(dt)
        )
        out = x + y.reshape(b, t, d).astype(dt)
        if not with_aux:
            return out, None
        m = valid.reshape(-1).astype(jnp.float32)
        counts = jnp.zeros(arch.num_experts, jnp.float32).at[ids.reshape(-1)].add(jnp.repeat(m, k))
        prob_sum = jnp.sum(probs * m[:, None], axis=0)
        entropy = -jnp.sum(jax.scipy.special.xlogy(probs, probs), axis=-1)
        own = ids if forced is None else jax.lax.top_k(probs, k)[1]
        return out, (ids.reshape(b, t, k), entropy.reshape(b, t), counts, prob_sum, own.reshape(b, t, k))

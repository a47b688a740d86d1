"""Mixture-of-experts routing in the trainer: routing replay's inputs and the router metrics.

Why replay ("R3"): the engine and the trainer compute a token's router logits with different
kernels, batch shapes and often dtypes, so a token near a top-k tie goes to different experts
in the two; its log-prob then differs by far more than float noise and the importance ratios of
the RL loss drift (Megatron-LM issue 4168: 3 of 3 GRPO runs on Qwen3-30B-A3B collapsed without
it). Under ``[trainer] moe_routing = "replay"`` each token uses the experts the engine used
(``TrainingSample.routed_experts``), with gates from the trainer's own router (it keeps its
gradient); under ``"recompute"`` the trainer's router chooses.

Per-step metrics (``moe_sums`` per micro-batch, summed, then ``moe_metrics``):
``router_entropy`` (mean over real tokens and sparse layers of the router distribution's
entropy), ``expert_load_max_mean`` (per sparse layer, the busiest expert's (token, expert)
assignments over the mean expert's, averaged over layers; 1 = perfectly balanced),
``routing_changed_frac`` (share of (token, sparse layer) pairs whose expert set the trainer's
own router picks differs from the engine's: under recompute the experts the trainer used, under
replay the ones it would have used had it not replayed, i.e. how often replay overrides it;
over tokens that carry engine routing and predict a next token) and ``moe_aux_loss``
(transformers' load-balancing loss, whatever its coefficient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models.decoder import MoeAux

MOE_SUMS = ("moe_entropy_sum", "moe_token_layers", "moe_changed_sum", "moe_routed_token_layers", "moe_aux_loss_sum", "moe_calls")


def moe_sums(aux: MoeAux, segment_ids: jax.Array, routing: jax.Array | None) -> dict[str, jax.Array]:
    """One micro-batch's router sums. ``routing`` [B, T, n_moe_layers, k]: the engine's experts
    (the batch's ``routing``; rows of tokens without engine routing hold -1)."""
    valid = (segment_ids > 0)[..., None].astype(jnp.float32)  # [B, T, 1]
    layers = aux.router_entropy.shape[-1]
    out = {
        "moe_entropy_sum": jnp.sum(aux.router_entropy * valid),
        "moe_token_layers": jnp.sum(valid) * layers,
        "moe_expert_load": aux.expert_counts,
        "moe_aux_loss_sum": aux.load_balance_loss,
        "moe_calls": jnp.float32(1.0),
    }
    if routing is None:
        out |= {"moe_changed_sum": jnp.float32(0.0), "moe_routed_token_layers": jnp.float32(0.0)}
        return out
    used = jnp.sort(aux.router_choice, axis=-1)
    engine = jnp.sort(routing.astype(jnp.int32), axis=-1)
    # Tokens that predict a next token of their own sample (a sample's last token has no
    # forward in the engine: its routing row is a placeholder) and carry the engine's routing.
    predicts = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (0, 1))) & (segment_ids > 0)
    has = predicts[..., None] & (routing[..., 0] >= 0)  # [B, T, L]
    changed = jnp.any(used != engine, axis=-1) & has
    out |= {"moe_changed_sum": jnp.sum(changed.astype(jnp.float32)), "moe_routed_token_layers": jnp.sum(has.astype(jnp.float32))}
    return out


def moe_metrics(total: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-step router metrics from the step's summed ``moe_sums`` (empty when the model is dense)."""
    if "moe_calls" not in total:
        return {}
    load = total["moe_expert_load"]  # [n_moe_layers, E]
    ratio = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-9)
    div = lambda a, b: a / jnp.maximum(b, 1.0)
    return {
        "router_entropy": div(total["moe_entropy_sum"], total["moe_token_layers"]),
        "expert_load_max_mean": jnp.mean(ratio),
        "routing_changed_frac": div(total["moe_changed_sum"], total["moe_routed_token_layers"]),
        "moe_aux_loss": div(total["moe_aux_loss_sum"], total["moe_calls"]),
    }


def check_routing(routing: np.ndarray, n_layers: int, k: int, num_experts: int, what: str) -> np.ndarray:
    """``routing`` as int [L, n_layers, k] with ids in [0, num_experts), or one line naming the problem."""
    arr = np.asarray(routing)
    if arr.ndim != 3 or arr.shape[1:] != (n_layers, k):
        raise ValueError(
            f"{what}: routed_experts has shape {list(arr.shape)}; this model routes [tokens, {n_layers}, {k}] "
            "(sparse layers, experts per token): the rollout was served by a different model"
        )
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: routed_experts must be integer expert ids, got {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
        raise ValueError(f"{what}: routed_experts holds ids outside [0, {num_experts}) (the model has {num_experts} experts)")
    return arr

"""Optimizer: optax AdamW with linear warmup, cosine (or constant) decay and global-norm clipping."""

from __future__ import annotations

from typing import Any, Literal

import jax
import optax
from pydantic import BaseModel, ConfigDict, Field

from jaxrl.models.decoder import param_name


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.01, ge=0)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = Field(1.0, description="Global-norm clip; <= 0 disables clipping.")
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Updates of linear warm-up from lr 0 (optax's linear_schedule, as transformers' "
        "warm-up): update 1 runs at lr 0 and trains nothing, the peak comes at update warmup_steps + 1. "
        "0: the peak lr from update 1.",
    )
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    schedule_steps: int | None = Field(
        None,
        ge=1,
        description="Length of the warmup + cosine schedule; default trainer.steps. Longer than the run "
        "stops part-way along a longer schedule (e.g. a warm start that leaves room for RL to improve).",
    )


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 over ``warmup_steps`` updates, then cosine decay or constant.

    The warm-up starts at 0, as optax's ``linear_schedule`` and transformers'
    ``get_linear_schedule_with_warmup`` do, so update 1 of a warmed-up run is at lr 0. Kept on
    purpose: the shipped SFT warm start (configs/reverse_text/sft.toml) stops mid-curve at step
    200, and starting the warm-up one step higher moved its held-out reward from ~0.59 to 0.86
    (the plateau broke earlier; CI's rehearsal, 2026-11-29), leaving the main job's RL nothing to
    show. A recipe that wants update 1 to train sets ``warmup_steps = 0``."""
    warmup = optax.linear_schedule(0.0 if cfg.warmup_steps else cfg.lr, cfg.lr, max(cfg.warmup_steps, 1))
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        decay = max(total_steps - cfg.warmup_steps, 1)
        after = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)
    return optax.join_schedules([warmup, after], [cfg.warmup_steps])


NO_DECAY = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "bq", "bk", "bv")


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: never on norm scales or biases."""
    return jax.tree_util.tree_map_with_path(lambda p, _: param_name(p) not in NO_DECAY, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(cfg, cfg.schedule_steps or total_steps)
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts), schedule

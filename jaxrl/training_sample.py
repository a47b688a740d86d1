"""The training sample: the one type the orchestrator hands to the trainer (DESIGN contract 4).

It lives outside both packages so that neither depends on the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

from jaxrl.sampling_contract import check_trainable_temperature

LossComponent = Literal["rl", "ce", "ref_kl"]
"""The trainer's loss components (DESIGN contract 3); a sample weights component ``c`` per token
with its ``{c}_w`` stream (``rl_w``, ``ce_w``, ``ref_kl_w``)."""
COMPONENTS: tuple[LossComponent, ...] = get_args(LossComponent)


@dataclass
class TrainingSample:
    """One linear token sequence (a trainable branch of a trace, or an SFT example).

    Per-token arrays all have the sample's length L. The first token has no prediction and
    is never in any loss, whatever its weights say.
    """

    token_ids: np.ndarray  # int32[L]
    sampled_mask: np.ndarray  # bool[L]: True where the policy sampled the token
    logprobs: np.ndarray  # float32[L]: inference logprob on sampled tokens, 0 elsewhere
    rl_w: np.ndarray  # float32[L]: weight in the RL component (defaults to sampled_mask)
    ce_w: np.ndarray  # float32[L]: weight in the CE component (SFT / echo)
    temperature: float = 1.0
    advantage: float = 0.0
    policy_version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)  # env, group_id, reward, errors...
    ref_kl_w: np.ndarray | None = None  # float32[L]: weight in the ref-KL component (OPD); None: zeros
    logr: np.ndarray | None = None
    """float32[L]: the reference (teacher) log-prob of each token at the sample's temperature,
    0 where ref_kl_w is 0; None until a teacher scored the sample."""
    token_versions: np.ndarray | None = None
    """int32[L]: the policy version that sampled each token, where the engine swapped weights
    mid-sequence; None: ``policy_version`` on every token."""
    routed_experts: np.ndarray | None = None
    """uint8/uint16 [L, n_moe_layers, k] (mixture-of-experts policies): the experts the engine
    routed each token to per sparse layer, which ``[trainer] moe_routing = "replay"`` makes the
    trainer use; the last token's row is a placeholder (no forward follows it). None: not recorded."""

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        n = self.token_ids.shape[0]
        self.sampled_mask = np.asarray(self.sampled_mask, dtype=bool)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.rl_w = np.asarray(self.rl_w, dtype=np.float32)
        self.ce_w = np.asarray(self.ce_w, dtype=np.float32)
        self.ref_kl_w = np.zeros(n, np.float32) if self.ref_kl_w is None else np.asarray(self.ref_kl_w, np.float32)
        if self.logr is not None:
            self.logr = np.asarray(self.logr, dtype=np.float32)
        if self.token_versions is not None:
            self.token_versions = np.asarray(self.token_versions, dtype=np.int32)
        if self.routed_experts is not None:
            self.routed_experts = np.asarray(self.routed_experts)
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != n:
                raise ValueError(
                    f"TrainingSample.routed_experts has shape {self.routed_experts.shape}; expected ({n}, layers, k)"
                )
        optional = tuple(k for k in ("logr", "token_versions") if getattr(self, k) is not None)
        for name in ("sampled_mask", "logprobs", *(f"{c}_w" for c in COMPONENTS), *optional):
            arr = getattr(self, name)
            if arr.shape != (n,):
                raise ValueError(f"TrainingSample.{name} has shape {arr.shape}; expected ({n},) like token_ids")
        if n < 2:
            raise ValueError("TrainingSample needs at least 2 tokens (the first is never predicted)")
        check_trainable_temperature(self.temperature, "TrainingSample.temperature")

    def versions(self) -> np.ndarray:
        """int32[L]: the sampling policy version of every token."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(len(self), self.policy_version, np.int32)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def needs_reference(self) -> bool:
        """Whether the sample trains the ref-KL component but no teacher has scored it yet."""
        return self.logr is None and bool(self.ref_kl_w[1:].any())

    @classmethod
    def sft(cls, token_ids: np.ndarray, loss_mask: np.ndarray, **kw: Any) -> TrainingSample:
        """An SFT example: CE weight 1 on ``loss_mask`` tokens, nothing in the RL component."""
        token_ids = np.asarray(token_ids, dtype=np.int32)
        n = token_ids.shape[0]
        return cls(
            token_ids=token_ids,
            sampled_mask=np.zeros(n, bool),
            logprobs=np.zeros(n, np.float32),
            rl_w=np.zeros(n, np.float32),
            ce_w=np.asarray(loss_mask, np.float32),
            **kw,
        )

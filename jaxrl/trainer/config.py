"""``[trainer]``: optimizer, loss, sequence length, micro-batching and the mesh."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxrl.kernel_dispatch import KernelChoice
from jaxrl.parallel.mesh import MeshConfig
from jaxrl.trainer.lora import LoraConfig
from jaxrl.trainer.loss import LossConfig
from jaxrl.trainer.optim import OptimConfig


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    steps: int = Field(100, ge=1)
    """Optimizer steps to run (also the length of the LR schedule)."""
    seq_len: int = Field(512, ge=8)
    """Longest packed row; every sample must fit in one row."""
    seq_len_buckets: list[int] | None = None
    """Row lengths to pack into (the smallest that holds the longest sample is used). Each
    bucket compiles the train step once. Default: [seq_len // 4, seq_len // 2, seq_len]."""
    micro_batch_rows: int = Field(8, ge=1)
    """Packed rows per micro-batch (one jitted forward/backward); must divide by data*fsdp."""
    vocab_block: int = Field(4096, ge=128)
    """Vocabulary block of the fused log-prob (peak memory ~ tokens x vocab_block floats)."""
    remat: Literal["auto", "none", "full", "save_dots"] = "auto"
    """What the backward pass recomputes (``jax.checkpoint`` on the scanned layer): "none" keeps
    every layer's activations (fastest; at real sizes far more than HBM), "full" keeps only each
    layer's input (~1/3 more FLOPs; at Qwen3-0.6B x 4 rows x 4096 tokens 2 GB per chip instead of
    53 GB), "save_dots" keeps the projections' matmul outputs (between the two). "auto": "full"
    on TPU and GPU (one 80 GB GPU holds a 0.6B model's trainer and engine only so), "none" on CPU
    (CPU runs are small). ``true`` / ``false`` mean "full" / "none"."""
    kernels: KernelChoice = "auto"
    """Log-prob and attention implementations (``jaxrl.kernel_dispatch``). "auto": the Pallas
    kernels on TPU, cuDNN's fused training attention on GPU (bfloat16), the pure-JAX references
    elsewhere. "reference" / "pallas": always that one
    ("pallas" on a backend without the kernels fails at start-up). "pallas_interpret": the kernels
    in Pallas interpret mode on any backend (slow; for tests)."""
    optim: OptimConfig = OptimConfig()
    lora: LoraConfig | None = None
    """``[trainer.lora]``: train low-rank adapters on the attention/MLP projections with the base
    weights frozen (``jaxrl.trainer.lora``); unset: full fine-tuning."""
    loss: LossConfig = LossConfig()
    moe_routing: Literal["replay", "recompute"] | None = None
    """Mixture-of-experts models: which experts each trained token goes to. "replay" (routing
    replay, "R3"): the experts the engine used when it sampled the token (the samples'
    ``routed_experts``; the gates still come from the trainer's router, which keeps its
    gradient), so engine and trainer log-probs agree to float precision; "recompute": the
    trainer's router chooses (engine/trainer routing mismatch shows in ``routing_changed_frac``
    and ``mismatch_kl``). None: "replay" for an MoE model whose rollout backend returns routing
    (the embedded engine, external jaxrl servers), else "recompute". Samples without routing
    (SFT) are always routed by the router. "replay" on a dense model is an error."""
    moe_aux_loss_coef: float = Field(0.0, ge=0.0, le=1.0)
    """Weight of the load-balancing auxiliary loss (transformers' ``load_balancing_loss_func``,
    Switch Transformer) added to the loss of MoE models; its value is logged as
    ``moe_aux_loss`` whatever this is. 0 by default for RL: the term pulls the policy toward
    balanced routing, away from the reward objective, and under replay the sampled tokens'
    experts are fixed by the engine anyway, so it only moves the gates. Pretraining-style SFT
    may set the model's ``router_aux_loss_coef`` (0.001 for Qwen3-MoE)."""
    mesh: MeshConfig = MeshConfig()
    peak_tflops: float | None = None
    """Peak FLOP/s per device for MFU (e.g. 197 for a TPU v5e chip). None: measured once at
    start-up with a float32 matmul (the right peak on CPU)."""

    @field_validator("remat", mode="before")
    @classmethod
    def _remat_bool(cls, v: Any) -> Any:
        return {True: "full", False: "none"}.get(v, v) if isinstance(v, bool) else v

    def remat_policy(self, platform: str) -> Literal["none", "full", "save_dots"]:
        """``remat`` resolved for the mesh's ``platform`` ("tpu", "cpu", ...)."""
        if self.remat == "auto":
            return "full" if platform in ("tpu", "gpu", "cuda") else "none"
        return self.remat

    @model_validator(mode="after")
    def _buckets(self) -> "TrainerConfig":
        if self.seq_len_buckets is None:
            self.seq_len_buckets = sorted({max(self.seq_len // 4, 8), max(self.seq_len // 2, 8), self.seq_len})
        if max(self.seq_len_buckets) != self.seq_len:
            raise ValueError(f"trainer.seq_len_buckets {self.seq_len_buckets} must end at trainer.seq_len = {self.seq_len}")
        return self

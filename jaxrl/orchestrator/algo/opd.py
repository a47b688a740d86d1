"""On-policy distillation: the policy samples, a teacher scores every sampled token, and the
trainer's ref-KL component pulls the policy towards the teacher (DESIGN contract 3).

No scalar credit: each sampled token's signal is `logr - logp` (teacher minus policy log-prob),
evaluated in the trainer against the live policy, so every successful rollout trains whatever
its reward (`group_size` only fans out sampling). This algorithm only routes tokens: sampled
tokens get `ref_kl_w = 1` (and `rl_w = 0`); the trainer-side teacher (`jaxrl.trainer.teacher`)
fills each sample's `logr` before the step.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from jaxrl.orchestrator.algo.base import AlgoConfigBase, Algorithm, LossComponent, sampled_token_samples
from jaxrl.orchestrator.traces import Rollout
from jaxrl.training_sample import TrainingSample


class TeacherConfig(AlgoConfigBase):
    name: str = Field(min_length=1)
    """The teacher: a Hugging Face model directory or hub id (fetched with huggingface_hub; its
    cache and HF_HUB_OFFLINE are honoured). It must share the policy's tokenizer (same vocabulary).
    Loaded on the trainer's mesh, frozen."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Teacher parameter and compute dtype."""


class OPDConfig(AlgoConfigBase):
    type: Literal["opd"] = "opd"
    loss_components: ClassVar[frozenset[LossComponent]] = frozenset({"ref_kl"})
    teacher: TeacherConfig
    """`[orchestrator.train.env.algo.teacher]`: the model whose reverse KL the policy distills."""

    def teacher_config(self) -> TeacherConfig:
        return self.teacher


class OPD(Algorithm):
    def __init__(self, config: OPDConfig) -> None:
        self.config = config

    def samples(self, group: list[Rollout]) -> list[TrainingSample]:
        return sampled_token_samples(group, stream="ref_kl_w", teacher=self.config.teacher.name)

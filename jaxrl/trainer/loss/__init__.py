"""The trainer's loss (DESIGN contract 3): RL, CE and ref-KL components over per-token weights.

One job per module, imported one way (batch <- objectives <- config <- sums):
``batch`` what every RL loss sees (``LossBatch``, ``RLTokenLoss``, segment helpers);
``objectives`` the built-in RL objectives registered by name (``OBJECTIVES``), the MIS mask,
the staleness factor, the ref-KL token loss; ``config`` ``[trainer.loss]`` (``LossConfig``);
``sums`` the per-micro-batch sums, their accumulation, normalisation and metrics.
"""

from jaxrl.trainer.loss.batch import (
    LossBatch,
    RLTokenLoss,
    count_segments,
    segment_mean,
    segment_sums,
    segment_total,
)
from jaxrl.trainer.loss.config import LossConfig, MISConfig, ObjectiveType, StalenessConfig
from jaxrl.trainer.loss.objectives import OBJECTIVES, Objective, PolicyGradient, objective
from jaxrl.trainer.loss.sums import (
    LAG_BINS,
    LossCounts,
    LossSums,
    add_sums,
    combine,
    component_metrics,
    counts_of,
    loss_counts,
    loss_sums,
    metrics,
    normalized_loss,
)
from jaxrl.training_sample import COMPONENTS, LossComponent

__all__ = [
    "COMPONENTS",
    "LAG_BINS",
    "OBJECTIVES",
    "LossBatch",
    "LossComponent",
    "LossConfig",
    "LossCounts",
    "LossSums",
    "MISConfig",
    "Objective",
    "ObjectiveType",
    "PolicyGradient",
    "RLTokenLoss",
    "StalenessConfig",
    "add_sums",
    "combine",
    "component_metrics",
    "count_segments",
    "counts_of",
    "loss_counts",
    "loss_sums",
    "metrics",
    "normalized_loss",
    "objective",
    "segment_mean",
    "segment_sums",
    "segment_total",
]

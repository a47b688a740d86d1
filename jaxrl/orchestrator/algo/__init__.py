"""Algorithms, selected per env by `type` (a pydantic discriminated union).

[orchestrator.train.env.algo]
type = "echo"        # "grpo" (default) | "max_rl" | "rae" | "echo" | "opd" | "sft"
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from jaxrl.orchestrator.algo.base import Algorithm
from jaxrl.orchestrator.algo.echo import Echo, EchoConfig, EchoFilter, EchoRoles, RoleEcho, ToolEcho
from jaxrl.orchestrator.algo.grpo import GRPO, GRPOConfig, LinearLengthPenalty
from jaxrl.orchestrator.algo.max_rl import MaxRL, MaxRLConfig
from jaxrl.orchestrator.algo.opd import OPD, OPDConfig, TeacherConfig
from jaxrl.orchestrator.algo.rae import RAE, RAEConfig
from jaxrl.orchestrator.algo.sft import SFT, SFTConfig

AlgoConfig = Annotated[
    GRPOConfig | MaxRLConfig | RAEConfig | EchoConfig | OPDConfig | SFTConfig, Field(discriminator="type")
]


_ALGORITHMS: dict[type, type[Algorithm]] = {
    GRPOConfig: GRPO,
    MaxRLConfig: MaxRL,
    RAEConfig: RAE,
    EchoConfig: Echo,
    OPDConfig: OPD,
    SFTConfig: SFT,
}


def make_algorithm(
    config: GRPOConfig | MaxRLConfig | RAEConfig | EchoConfig | OPDConfig | SFTConfig,
) -> Algorithm:
    """The algorithm a config names."""
    return _ALGORITHMS[type(config)](config)


__all__ = [
    "GRPO",
    "OPD",
    "RAE",
    "SFT",
    "AlgoConfig",
    "Algorithm",
    "Echo",
    "EchoConfig",
    "EchoFilter",
    "EchoRoles",
    "GRPOConfig",
    "LinearLengthPenalty",
    "MaxRL",
    "MaxRLConfig",
    "OPDConfig",
    "RAEConfig",
    "RoleEcho",
    "SFTConfig",
    "TeacherConfig",
    "ToolEcho",
    "make_algorithm",
]

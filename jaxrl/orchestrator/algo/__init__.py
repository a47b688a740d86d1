"""Algorithms, selected per env by `type` (a pydantic discriminated union).

[orchestrator.train.env.algo]
type = "echo"        # "grpo" (default) | "echo" | "sft"
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from jaxrl.orchestrator.algo.base import Algorithm
from jaxrl.orchestrator.algo.echo import Echo, EchoConfig, EchoFilter, EchoRoles, RoleEcho, ToolEcho
from jaxrl.orchestrator.algo.grpo import GRPO, GRPOConfig
from jaxrl.orchestrator.algo.sft import SFT, SFTConfig

AlgoConfig = Annotated[GRPOConfig | EchoConfig | SFTConfig, Field(discriminator="type")]


def make_algorithm(config: GRPOConfig | EchoConfig | SFTConfig) -> Algorithm:
    """The algorithm a config names."""
    if isinstance(config, EchoConfig):
        return Echo(config)
    if isinstance(config, GRPOConfig):
        return GRPO(config)
    return SFT(config)


__all__ = [
    "GRPO",
    "SFT",
    "AlgoConfig",
    "Algorithm",
    "Echo",
    "EchoConfig",
    "EchoFilter",
    "EchoRoles",
    "GRPOConfig",
    "RoleEcho",
    "SFTConfig",
    "ToolEcho",
    "make_algorithm",
]

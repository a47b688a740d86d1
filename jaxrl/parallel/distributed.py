"""Multi-host start-up: ``jax.distributed.initialize`` from config or the environment."""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class DistributedConfig(BaseModel):
    """JAX multi-controller runtime. On TPU pod slices (GKE JobSet) ``enabled = true`` with
    nothing else set lets JAX discover the coordinator; elsewhere give all three fields."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(False, description="Call jax.distributed.initialize before anything else.")
    coordinator_address: str | None = Field(None, description="host:port of process 0.")
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: list[int] | None = Field(None, description="Devices this process owns (CPU tests).")


def initialize(cfg: DistributedConfig) -> None:
    """Start the runtime once; a no-op when disabled or already running."""
    if not cfg.enabled or jax.distributed.is_initialized():
        return
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=cfg.local_device_ids,
    )


def is_main_process() -> bool:
    """Only process 0 writes logs, plots and exports."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Block until every process reaches ``barrier(name)`` (a no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def broadcast_from_main(obj: Any) -> Any:
    """Process 0's ``obj`` on every process (pickled; the others' argument is ignored): how
    multi-host RL hands process 0's batch to every process. Identity with one process."""
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(obj), np.uint8) if is_main_process() else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = data if is_main_process() else np.zeros(size, np.uint8)
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buf)).tobytes())

"""Multi-host start-up: ``jax.distributed.initialize`` from config or the environment."""

from __future__ import annotations

import os
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

    def expected_processes(self) -> int:
        """How many processes the run will have, known before JAX starts: ``num_processes``, or
        the hosts GKE lists in ``TPU_WORKER_HOSTNAMES`` (a JobSet pod on a TPU slice), else 1.
        Lets config checks refuse a multi-host layout before any work (a warm start included)."""
        if not self.enabled:
            return 1
        if self.num_processes is not None:
            return self.num_processes
        return len(gke_worker_hostnames()) or 1


def gke_slice_layout() -> tuple[str, int, int] | None:
    """(coordinator, process count, process id) of a single-slice GKE JobSet pod, read from the
    variables GKE injects, as JAX's own TPU detection computes them (first host, port 8476 or
    ``JAX_COORDINATOR_PORT``). JAX does this by itself only on a TPU VM; reading them here makes
    the same pod environment start CPU processes too (``launch/gke/local.py``). None elsewhere,
    and on multislice (``MEGASCALE_*``), which JAX's detection handles."""
    hosts = gke_worker_hostnames()
    worker = os.environ.get("TPU_WORKER_ID")
    if not hosts or worker is None or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return None
    port = os.environ.get("JAX_COORDINATOR_PORT", "8476")
    return f"{hosts[0].rsplit(':', 1)[0]}:{port}", len(hosts), int(worker)


def gke_worker_hostnames() -> list[str]:
    """The slice's hosts as GKE injects them into JobSet pods that request TPUs (empty elsewhere)."""
    hosts = os.environ.get("TPU_PROCESS_ADDRESSES") or os.environ.get("TPU_WORKER_HOSTNAMES") or ""
    return [h for h in hosts.split(",") if h]


def initialize(cfg: DistributedConfig) -> None:
    """Start the runtime once; a no-op when disabled or already running."""
    if not cfg.enabled or jax.distributed.is_initialized():
        return
    coordinator, num_processes, process_id = cfg.coordinator_address, cfg.num_processes, cfg.process_id
    if coordinator is None and num_processes is None and process_id is None and (gke := gke_slice_layout()):
        coordinator, num_processes, process_id = gke
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
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


def meet_over(mesh: jax.sharding.Mesh) -> None:
    """Every process runs one collective over all of ``mesh``'s devices, now, while they start in
    step. On CPU (gloo) the first collective over a set of devices also connects them, within a
    30 s deadline. Left to the train step, processes can reach it further apart than that (seen
    on a resumed 2-process run on a loaded host: one process's step programs ready well before
    the other's), and the run fails. Later collectives over a connected set wait as long as they must."""
    if jax.process_count() == 1:
        return
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
    ones = jax.make_array_from_callback((mesh.devices.size,), sharding, lambda index: np.ones(1, np.int32))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    total = int(jax.jit(lambda x: x.sum(), out_shardings=replicated)(ones))
    if total != mesh.devices.size:
        raise RuntimeError(f"meet_over: {total} of the mesh's {mesh.devices.size} devices answered")


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


def gather_strings(text: str, max_bytes: int = 512) -> list[str]:
    """Every process's ``text`` (UTF-8, at most ``max_bytes``), by process index: how the RL
    trainer's processes learn each other's weight publisher addresses. ``[text]`` with one process."""
    data = text.encode()
    if len(data) > max_bytes:
        raise ValueError(f"gather_strings: {len(data)} bytes, more than {max_bytes}")
    if jax.process_count() == 1:
        return [text]
    from jax.experimental import multihost_utils

    buf = np.zeros(max_bytes, np.uint8)  # zero-padded: addresses hold no NUL
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), max_bytes)
    return [bytes(row).rstrip(b"\0").decode() for row in rows]

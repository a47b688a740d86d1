"""``[inference.backend] type = "embedded"`` with several trainer processes: one engine colocated
across every device of every process (a multi-host slice runs RL with no second slice).

Process 0 runs the engine's scheduler, its HTTP server and the orchestrator; every other
process repeats its device calls (``jaxrl.engine.lockstep``). The RL loop meets the other
processes only in sections (``collective()``: the batch hand-off, the train step, the weight
reshard, a checkpoint), which process 0 opens with a ``SYNC`` in the command stream and during
which no engine call runs. Weights swap in place: each process reshards the trainer's
parameters onto the engine's mesh inside the section (no host copy, no files), and the swap
itself is a command, so every process serves the new version from the same call on.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxrl.endpoint import ModelEndpoint
from jaxrl.engine.lockstep import STOP, SYNC, Follower, Leader, Replica
from jaxrl.parallel.distributed import gather_strings, gke_worker_hostnames
from jaxrl.rollout.config import WILDCARDS, EmbeddedConfig, InferenceConfig

if TYPE_CHECKING:
    from jaxrl.engine.engine import Engine
    from jaxrl.engine.metrics import EngineMetrics
    from jaxrl.models.decoder import Decoder
    from jaxrl.rollout.embedded import EmbeddedBackend


class LeaderStoppedEngine(RuntimeError):
    """On a process other than 0: process 0 stopped the engine where a section was expected."""


def join(model: Decoder, inference: InferenceConfig) -> tuple[Engine, Leader | Replica]:
    """Every process calls this at the same point: the engine over every device of every
    process (built in the same order everywhere: the runner places weights and zeroes the cache
    with programs over the whole mesh), and this process's end of the command stream: process
    0's ``Leader`` (its runner sends every device call), the others' ``Replica``."""
    from jaxrl.engine.engine import Engine
    from jaxrl.engine.weights import colocated_mesh

    cfg = inference.backend
    assert isinstance(cfg, EmbeddedConfig)
    mesh = colocated_mesh(cfg.tensor_parallel, cfg.expert_parallel)
    leader = None
    if jax.process_index() == 0:
        leader = Leader(
            followers=jax.process_count() - 1, host=cfg.colocated_host, port=cfg.colocated_port,
            timeout_s=cfg.colocated_timeout_s,
        )  # fmt: skip
        address = f"{_advertised(cfg.colocated_host)}:{leader.port}"
    else:
        address = ""
    address = gather_strings(address)[0]  # a collective: every process is here
    follower = None
    if leader is not None:
        leader.accept()
    else:
        follower = Follower(address, index=jax.process_index(), timeout_s=cfg.colocated_timeout_s)
    engine = Engine(model, inference.engine_config(), mesh=mesh)
    if leader is None:
        assert follower is not None
        return engine, Replica(engine.runner, follower)
    engine.runner.lockstep = leader
    return engine, leader


def _advertised(host: str) -> str:
    """The address the other processes dial: the bind address, or for a wildcard the slice's
    first worker (GKE's ``TPU_WORKER_HOSTNAMES``, the host JAX's coordinator also runs on), else
    this host's name."""
    if host not in WILDCARDS:
        return host
    hosts = gke_worker_hostnames()
    return hosts[0].rsplit(":", 1)[0] if hosts else socket.gethostname()


class ColocatedLeader:
    """Process 0: the embedded backend (``embedded``: its engine behind the HTTP server) whose
    engine calls every process repeats; updates weights inside sections."""

    def __init__(self, embedded: EmbeddedBackend, leader: Leader):
        self.embedded = embedded
        self.engine = embedded.engine
        self.leader = leader
        self._awaiting: int | None = None

    def start(self, state: nnx.State | Decoder | None = None, version: int = 0) -> ModelEndpoint:
        return self.embedded.start(state, version)

    @property
    def endpoint(self) -> ModelEndpoint:
        return self.embedded.endpoint

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def check(self) -> None:
        return None  # as the embedded backend: a failed engine fails its requests

    def metrics(self) -> EngineMetrics | None:
        return self.engine.metrics()

    def token_versions(self, session_id: str) -> list[list[int]] | None:
        return self.embedded.token_versions(session_id)

    def update_weights(self, state: nnx.State | Decoder, *, version: int) -> int:
        """Inside a section: reshard ``state`` onto the engine's mesh (every process does the
        same now) and queue the swap; the section's end waits until it is served."""
        self._awaiting = self.engine.update_weights_from_state(state, version=version, wait=False)
        return version

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        with self.leader.section():
            yield
        if self._awaiting is not None:  # the engine thread swaps once the section lets it issue commands
            version, self._awaiting = self._awaiting, None
            self._wait_served(version)

    def _wait_served(self, version: int) -> None:
        deadline = time.monotonic() + self.leader.timeout_s
        while self.engine.policy_version < version:
            if not self.engine.healthy:
                raise RuntimeError(f"colocated engine failed before serving version {version}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"colocated engine: version {version} not served within {self.leader.timeout_s:.0f} s"
                )
            time.sleep(0.002)

    def weight_metrics(self) -> dict[str, float]:
        return {}  # an on-device reshard on every process: nothing travels by host

    def stop(self) -> None:
        try:
            self.embedded.stop()
        finally:
            self.leader.close()


class ColocatedFollower:
    """A process other than 0: repeats the engine's calls; serves nothing itself."""

    def __init__(self, engine: Engine, replica: Replica):
        self.engine = engine
        self.replica = replica

    def start(self, state: nnx.State | Decoder | None = None, version: int = 0) -> None:
        """Compile what process 0 compiles, and place a resumed run's weights as it does."""
        if self.engine.config.warmup:  # compiles only, no program runs
            self.engine.warmup()
        if state is not None and version != self.engine.policy_version:
            self.replica.place(state, version)  # process 0 does the same in its start()

    @property
    def endpoint(self) -> ModelEndpoint:
        raise RuntimeError("the colocated engine is served by process 0; other processes have no endpoint")

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def update_weights(self, state: nnx.State | Decoder, *, version: int) -> int:
        self.replica.place(state, version)
        return version

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        if self.replica.run_until(SYNC) == STOP:
            raise LeaderStoppedEngine("colocated engine: process 0 stopped the engine")
        yield

    def check(self) -> None:
        return None

    def metrics(self) -> EngineMetrics | None:
        return None

    def weight_metrics(self) -> dict[str, float]:
        return {}

    def token_versions(self, session_id: str) -> list[list[int]] | None:
        return None

    def stop(self) -> None:
        try:
            self.replica.run_until(STOP)
        finally:
            self.replica.follower.close()

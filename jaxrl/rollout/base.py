"""The one interface the RL loop drives rollouts through, whichever server samples them.

Three implementations, one module each, each importing only this protocol from its siblings:
the embedded engine behind its loopback HTTP server (``embedded.EmbeddedBackend``), a vLLM
server launched beside the run or attached to (``vllm.VLLMBackend``), and servers already
running elsewhere (``external.ExternalBackend``); ``factory.start_rollout_backend`` picks one
by ``[inference] backend``. The RL loop only ever calls what ``RolloutBackend`` lists, so a new
kind of server is a new class, not a change to the loop.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

from flax import nnx

from jaxrl.endpoint import ModelEndpoint

if TYPE_CHECKING:
    from jaxrl.engine.metrics import EngineMetrics
    from jaxrl.models.decoder import Decoder


class RolloutServerDead(RuntimeError):
    """A rollout server stopped answering (refused, reset, or timed out): the run must stop."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"rollout server {url} stopped answering ({reason})")
        self.url = url


class RolloutBackend(Protocol):
    """What serves rollouts to the env servers and takes the trainer's weights after each step."""

    def start(self, state: nnx.State | Decoder | None = None, version: int = 0) -> ModelEndpoint:
        """Start serving ``state`` (None: the weights the backend was built with) as policy
        ``version``; returns the endpoint env servers sample from."""
        ...

    @property
    def endpoint(self) -> ModelEndpoint: ...

    @property
    def policy_version(self) -> int:
        """The newest policy version every server serves."""
        ...

    def update_weights(self, state: nnx.State | Decoder, *, version: int) -> int:
        """Serve ``state`` as ``version`` (greater than the current one); returns it once served."""
        ...

    def check(self) -> None:
        """Raise ``RolloutServerDead`` once a server has stopped answering (else nothing)."""
        ...

    def metrics(self) -> EngineMetrics | None:
        """The serving engine's own counters, when it exposes them in jaxrl's form."""
        ...

    def weight_metrics(self) -> dict[str, float]:
        """What the last ``update_weights`` sent, as ``weights/...`` metric keys ({} when the
        backend measures nothing, e.g. ``weights/changed_fraction`` of a delta publisher)."""
        ...

    def token_versions(self, session_id: str) -> list[list[int]] | None:
        """The policy version of each token of each generate answer sent for ``session_id``
        (verifiers' trace id), in answer order, taken once; None where the backend does not know
        (each token then carries its rollout's dispatch version)."""
        ...

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """A section every trainer process runs together (the batch hand-off, the train step,
        the weight update, a checkpoint). Only the colocated engine (``colocated``) needs it:
        its processes run the engine's calls in one order outside such sections and meet at
        its start; elsewhere a no-op."""
        ...

    def stop(self) -> None: ...

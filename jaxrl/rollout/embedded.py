"""``[inference] backend = "embedded"`` (the default): jaxrl's own engine in the training
process, behind its vLLM-compatible HTTP server on loopback (``jaxrl.engine`` behind ``jaxrl.serving``)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flax import nnx

from jaxrl.endpoint import ModelEndpoint

if TYPE_CHECKING:
    from jaxrl.engine.engine import Engine
    from jaxrl.engine.metrics import EngineMetrics
    from jaxrl.models.decoder import Decoder
    from jaxrl.serving.server import EngineServer


class EmbeddedBackend:
    """The embedded JAX engine in this process, behind its HTTP server on loopback; weights are
    handed over in memory (one batched reshard, no files)."""

    def __init__(self, engine: Engine, server: EngineServer, *, tokenizer_dir: str, renderer: Mapping[str, Any] | None):
        self.engine = engine
        self.server = server
        self.tokenizer_dir = tokenizer_dir
        self.renderer = renderer
        self._endpoint: ModelEndpoint | None = None

    def start(self, state: nnx.State | Decoder | None = None, version: int = 0) -> ModelEndpoint:
        self.server.start()
        if state is not None and version != self.engine.policy_version:
            self.engine.update_weights_from_state(state, version=version)
        self._endpoint = ModelEndpoint.at(self.server.url, self.server.model_name, self.tokenizer_dir, self.renderer)
        return self._endpoint

    @property
    def endpoint(self) -> ModelEndpoint:
        assert self._endpoint is not None, "start() first"
        return self._endpoint

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def update_weights(self, state: nnx.State | Decoder, *, version: int) -> int:
        return self.engine.update_weights_from_state(state, version=version)

    def check(self) -> None:
        return None  # a failed engine fails its requests and the next weight update itself

    def metrics(self) -> EngineMetrics | None:
        return self.engine.metrics()

    def weight_metrics(self) -> dict[str, float]:
        return {}  # an in-process reshard: nothing travels

    def token_versions(self, session_id: str) -> list[list[int]] | None:
        return self.server.session_versions.take(session_id)

    def collective(self) -> contextlib.AbstractContextManager[None]:
        """A section every trainer process runs together (nothing to order here)."""
        return contextlib.nullcontext()

    def stop(self) -> None:
        self.server.stop()
        self.engine.stop()

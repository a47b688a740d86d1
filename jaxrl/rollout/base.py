"""The one interface the RL loop drives rollouts through, whichever server samples them.

Three implementations: the embedded engine behind its loopback HTTP server (here), a vLLM
server launched beside the run or attached to (``vllm_backend.VLLMBackend``), and servers
already running elsewhere (``external.ExternalBackend``). The RL loop only ever calls what
``RolloutBackend`` lists, so a new kind of server is a new class, not a change to the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from flax import nnx

from jaxrl.endpoint import ModelEndpoint

if TYPE_CHECKING:
    from jaxrl.inference.engine import Engine
    from jaxrl.inference.engine_metrics import EngineMetrics
    from jaxrl.inference.server import EngineServer
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

    def stop(self) -> None: ...


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

    def stop(self) -> None:
        self.server.stop()
        self.engine.stop()


def start_rollout_backend(run: Any) -> RolloutBackend:
    """``[inference] backend``'s implementation for ``run`` (a ``jaxrl.run_common.TrainingRun``),
    started on the trainer's current weights as policy version ``run.trainer.step``."""
    cfg = run.cfg
    backend: RolloutBackend
    if cfg.inference.backend == "vllm":
        from jaxrl.inference.vllm_backend import vllm_backend

        backend = vllm_backend(run)
    elif cfg.inference.backend == "external":
        from jaxrl.inference.external import ExternalBackend

        backend = ExternalBackend.for_run(run)
    else:
        from jaxrl.inference.engine import Engine
        from jaxrl.inference.serving import build_engine_server
        from jaxrl.models.hub import resolve_model_dir

        engine = Engine(run.trainer.model(), cfg.inference)
        model_dir = resolve_model_dir(cfg.model.name, cfg.model.revision) if cfg.model.name else None
        server = build_engine_server(
            engine, cfg.inference, tokenizer_dir=run.tokenizer_dir, model_dir=model_dir,
            model_name=cfg.model.name or "jaxrl", renderer=run.renderer,
        )  # fmt: skip
        backend = EmbeddedBackend(engine, server, tokenizer_dir=str(run.tokenizer_dir), renderer=run.renderer)
    try:
        backend.start(run.trainer.params, version=run.trainer.step)
    except BaseException:
        backend.stop()
        raise
    return backend

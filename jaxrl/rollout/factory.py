"""``[inference] backend`` -> the ``RolloutBackend`` that serves it, started on the trainer's
weights. The one place that knows every backend; each backend module knows only ``base``.

Everything a backend needs is passed in (the model, its HF config, the ``[inference]`` and
``[model]`` sections, the run's output directory), so this package depends on no training run
object; ``jaxrl.rl`` calls it with its ``TrainingRun``'s parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
from flax import nnx

from jaxrl.rollout.base import RolloutBackend
from jaxrl.rollout.config import InferenceConfig

if TYPE_CHECKING:
    from jaxrl.config import ModelConfig
    from jaxrl.models.decoder import Decoder


def start_rollout_backend(
    model: Decoder,
    state: nnx.State,
    *,
    version: int,
    hf_config: Mapping[str, Any],
    inference: InferenceConfig,
    model_config: ModelConfig,
    output_dir: str | Path,
    tokenizer_dir: str | Path,
    renderer: Mapping[str, Any] | None,
    moe_routing: Literal["replay", "recompute"] | None = None,
) -> RolloutBackend:
    """The backend ``inference.backend`` names, built with ``model`` (graph and weights; its HF
    config ``hf_config``) and started serving ``state`` as policy ``version``; stopped again if
    it fails to start. ``model_config`` gives the served model's name, hub revision and dtype;
    file-fed backends write weights and logs under ``output_dir`` unless configured elsewhere.

    ``moe_routing`` is the trainer's (``[trainer] moe_routing``). The embedded server returns
    every token's experts (``return_routed_experts``) when the trainer replays them: decided here,
    where the server is built, from the model's architecture (an MoE model) and ``moe_routing``
    (not "recompute"), as the model's architecture is known for certain only once it is loaded
    (a warm start writes it after the config loads). ``[inference.server]
    return_routed_experts = true`` turns it on whatever the trainer does. External servers must
    already return them when the trainer asks for replay by name (``moe_routing = "replay"``;
    unset, it replays what comes back): their backend checks each at start."""
    backend: RolloutBackend
    served_name = model_config.name or "jaxrl"
    if inference.backend.type == "vllm":
        from jaxrl.rollout.vllm import VLLMBackend

        backend = VLLMBackend(
            model, hf_config, inference, output_dir=output_dir, tokenizer_dir=tokenizer_dir,
            model_name=inference.server.served_model_name or served_name, model_dtype=model_config.dtype,
            renderer=renderer,
        )  # fmt: skip
    elif inference.backend.type == "external":
        from jaxrl.rollout.external import ExternalBackend

        backend = ExternalBackend(
            model, hf_config, inference, output_dir=output_dir, tokenizer_dir=tokenizer_dir, renderer=renderer,
            replay_routing=model.arch.is_moe and moe_routing == "replay",
        )
    else:
        from jaxrl.engine.engine import Engine
        from jaxrl.models.hub import resolve_model_dir
        from jaxrl.rollout.embedded import EmbeddedBackend
        from jaxrl.serving.server import build_engine_server

        model_dir = resolve_model_dir(model_config.name, model_config.revision) if model_config.name else None
        replay = model.arch.is_moe and moe_routing != "recompute"  # verifiers puts the experts on the trace
        routed = inference.server.return_routed_experts or replay
        if jax.process_count() > 1:  # a multi-host trainer: one engine over every process
            backend = colocated_backend(
                model, inference, model_dir=model_dir, served_name=served_name, tokenizer_dir=str(tokenizer_dir),
                renderer=renderer, return_routed_experts=routed,
            )  # fmt: skip
        else:
            engine = Engine(model, inference.engine_config())
            server = build_engine_server(
                engine, inference.server, tokenizer_dir=tokenizer_dir, model_dir=model_dir, model_name=served_name,
                renderer=renderer, return_routed_experts=routed,
            )  # fmt: skip
            backend = EmbeddedBackend(engine, server, tokenizer_dir=str(tokenizer_dir), renderer=renderer)
    try:
        backend.start(state, version=version)
    except BaseException:
        backend.stop()
        raise
    return backend


def colocated_backend(
    model: Decoder,
    inference: InferenceConfig,
    *,
    model_dir: Any,
    served_name: str,
    tokenizer_dir: str,
    renderer: Mapping[str, Any] | None,
    return_routed_experts: bool,
) -> RolloutBackend:
    """The embedded engine colocated over every process (``jaxrl.rollout.colocated``), not yet
    started; every process calls this at the same point. Process 0 gets the backend that serves
    (its engine behind the HTTP server), the others one that repeats its engine calls."""
    from jaxrl.engine.lockstep import Leader
    from jaxrl.rollout.colocated import ColocatedFollower, ColocatedLeader, join
    from jaxrl.rollout.embedded import EmbeddedBackend
    from jaxrl.serving.server import build_engine_server

    engine, end = join(model, inference)
    if not isinstance(end, Leader):  # a Replica: this process repeats process 0's calls
        return ColocatedFollower(engine, end)
    server = build_engine_server(
        engine, inference.server, tokenizer_dir=tokenizer_dir, model_dir=model_dir, model_name=served_name,
        renderer=renderer, return_routed_experts=return_routed_experts,
    )  # fmt: skip
    return ColocatedLeader(EmbeddedBackend(engine, server, tokenizer_dir=tokenizer_dir, renderer=renderer), end)

"""``[inference.server]``: where the engine's HTTP API listens and what it lets clients do."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServerConfig(BaseModel):
    """``[inference.server]``: where the HTTP API (DESIGN contract 6) listens."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; set "0.0.0.0" only on a trusted network."""

    port: int = Field(0, ge=0, le=65535)
    """TCP port; 0 (the default of a training run's in-process server: two runs on one machine never
    collide) picks a free port, printed at start-up. ``jaxrl.serve`` defaults to 8000."""

    served_model_name: str | None = None
    """Model id reported by ``GET /v1/models``; default: the ``[model] name`` it was loaded from."""

    graceful_shutdown_s: float = Field(30.0, ge=0)
    """On shutdown, how long in-flight requests may take to finish before they are cut off."""

    api_key: str | None = Field(None, min_length=16)
    """Shared secret that ``POST /update_weights`` requires as ``Authorization: Bearer <key>``
    (it makes the server read a directory the caller names). Default: none on a loopback host;
    on any other host a random key is generated at start and logged once."""

    weights_root: str | None = None
    """If set, ``/update_weights`` only loads model directories under this one: a local directory,
    or a ``gs://`` prefix (such directories are copied to local disk, then loaded)."""

    allow_request_chat_template: bool = False
    """Accept a chat template in a chat request (``chat_template``, or in
    ``chat_template_kwargs``), as vLLM's ``--trust-request-chat-template``. Off by default: a
    template is code. When on, each renders in a separate process within
    ``request_template_timeout_s`` and a memory cap (``jaxrl.serving.template_sandbox``)."""

    request_template_timeout_s: float = Field(2.0, gt=0, le=60)
    """Wall-clock budget of rendering one request-supplied chat template."""

    return_routed_experts: bool = False
    """Mixture-of-experts models: every ``/inference/v1/generate`` choice carries
    ``routed_experts``, the experts each token was routed to (vLLM's
    ``--enable-return-routed-experts``; verifiers attaches them to the trace for routing replay).
    A request's ``sampling_params.return_routed_experts`` overrides it. An RL run whose trainer
    replays routing (an MoE model, ``[trainer] moe_routing`` not "recompute") turns it on for its
    embedded server (``jaxrl.rollout.factory``)."""

    keep_alive_s: float = Field(600.0, gt=0)
    """How long an idle client connection stays open. Long on purpose: env servers pool their
    connections and do not retry, and uvicorn's 5 s default closes them while rollouts wait
    out a train step, so the next request on a pooled connection races the close and fails
    ("Connection error"; measured: 22 of 3,840 rollouts in a 30-step run)."""

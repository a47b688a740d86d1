"""The model endpoint env servers sample from: what the RL loop hands the orchestrator.

It lives outside both ``inference`` (which produces it: embedded engine, vLLM launcher,
external servers) and ``orchestrator`` (which hands it to env servers), so neither imports the
other. ``renderer`` is the run's resolved `renderers` config (``jaxrl.models.renderer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import verifiers.v1 as vf


@dataclass(frozen=True)
class ModelEndpoint:
    """The model the env servers sample from: an OpenAI/vLLM-compatible `/v1` endpoint."""

    base_url: str
    """E.g. `http://127.0.0.1:8000/v1`; the engine must also serve `/inference/v1/generate`."""
    model: str
    """Model name sent with every request (as listed by `GET /v1/models`)."""
    tokenizer_dir: str
    """Local tokenizer directory the env server renders prompts with (`renderer_model_name`)."""
    renderer: Mapping[str, Any] = field(default_factory=lambda: {"name": "qwen3", "enable_thinking": False})
    """A `renderers` RendererConfig: the run's `[model] renderer`, resolved
    (`jaxrl.models.renderer.resolve_renderer`). Name it explicitly: an unknown model falls back to
    a default renderer without content attribution (so no echo)."""
    api_key_var: str = "JAXRL_INFERENCE_API_KEY"
    """Environment variable the env server reads the API key from (unset: "EMPTY")."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra HTTP headers on every engine request."""

    @classmethod
    def at(cls, server_url: str, model: str, tokenizer_dir: str, renderer: Mapping[str, Any] | None) -> ModelEndpoint:
        """The endpoint of a server root (``/v1`` appended); ``renderer`` None keeps the default."""
        extra = {"renderer": dict(renderer)} if renderer is not None else {}
        return cls(base_url=f"{server_url}/v1", model=model, tokenizer_dir=str(tokenizer_dir), **extra)

    def client_config(self) -> vf.TrainClientConfig:
        """verifiers' train-client config: client-side rendering, token-in/token-out generate."""
        from verifiers.v1 import TrainClientConfig

        return TrainClientConfig(
            base_url=self.base_url,
            api_key_var=self.api_key_var,
            headers=dict(self.headers),
            renderer=dict(self.renderer),
            renderer_model_name=self.tokenizer_dir,
        )

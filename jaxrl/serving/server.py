"""HTTP API over an ``Engine`` (DESIGN contract 6), with FastAPI + uvicorn: thin routes (as
vLLM's ``api_router``) that map each request to its handler: ``completions`` (generate,
completions), ``chat`` (chat), ``auth`` (who may update weights, from where),
``errors`` (error answers and the schema); bodies are ``protocol``'s.

``/update_weights`` loads a model directory (``path``) or pulls the version a weight manifest
describes from the trainer's publishers (``manifest``, ``jaxrl.weight_transfer``) in a worker
thread, so requests keep being served meanwhile; the engine swaps the new weights in between
steps, or keeps the old ones when the load fails.

Handlers submit requests to the engine (its own thread runs the steps) and await their
futures; a handler cancelled mid-flight (client gone, shutdown) aborts its requests. Bad input
gets a 400 whose message names the field; an unexpected error gets a 500 and the server keeps
serving. ``EngineServer`` runs uvicorn in a background thread (``start``/``stop``: the training entry
point, tests; ``serve_forever``: ``python -m jaxrl.serve``, which waits for SIGINT/SIGTERM).
Shutdown is graceful: the socket closes, in-flight requests finish (up to
``graceful_shutdown_s``), then the engine stops.

``build_engine_server`` is the one way to put an engine behind this server, shared by
``jaxrl.serve`` and the RL loop: both serve the same API with the same defaults (the model's
stop tokens: the tokenizer's EOS plus ``generation_config.json``'s ``eos_token_id``s; the run's
renderer for the chat endpoint; the ``[inference.server]`` settings).
"""

from __future__ import annotations

import asyncio
import json
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl.engine.engine import Engine, StaleVersion
from jaxrl.engine.metrics import EngineMetrics
from jaxrl.models.hf_io import copy_model_dir
from jaxrl.serving import auth, errors, prometheus, protocol, streaming
from jaxrl.serving.chat import ChatServing
from jaxrl.serving.completions import CompletionServing
from jaxrl.serving.config import ServerConfig
from jaxrl.serving.errors import BadRequest, Unavailable
from jaxrl.serving.http_thread import BackgroundServer
from jaxrl.serving.session_versions import SessionVersions
from jaxrl.weight_transfer import Manifest, WeightTransferError

SESSION_HEADER = "x-session-id"


class EngineServer:
    """The HTTP API of ``engine``: ``start()`` / ``stop()`` in a background thread, ``url``."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        model_name: str = "jaxrl",
        stop_token_ids: Sequence[int] | None = None,
        graceful_shutdown_s: float = 30.0,
        keep_alive_s: float = 600.0,
        api_key: str | None = None,
        weights_root: str | Path | None = None,
        allow_request_chat_template: bool = False,
        request_template_timeout_s: float = 2.0,
        renderer: Mapping[str, Any] | None = None,
        return_routed_experts: bool = False,
    ):
        self.engine = engine
        self.api_key = auth.control_key(host, api_key)
        self.weights_root = auth.WeightsRoot(weights_root)
        self.tokenizer = tokenizer
        self.host = host
        self.model_name = model_name
        eos = tokenizer.eos_token_id
        default_stops = list(stop_token_ids) if stop_token_ids is not None else ([eos] if eos is not None else [])
        self.completion = CompletionServing(engine, tokenizer, model_name, default_stops, return_routed_experts)
        self.chat = ChatServing(
            self.completion,
            renderer=renderer,
            allow_request_chat_template=allow_request_chat_template,
            request_template_timeout_s=request_template_timeout_s,
        )
        self.graceful_shutdown_s = graceful_shutdown_s
        self.session_versions = SessionVersions()
        """Per ``X-Session-ID``, the per-token policy versions of its generate answers (the RL loop
        takes them: verifiers' traces cannot carry them)."""
        self.created = int(time.time())
        self.registry = prometheus.registry(engine.metrics, self.model_name)
        """This server's Prometheus metrics (its own registry: two servers in a process never mix)."""
        self.app = self._build_app()
        self._http = BackgroundServer(
            self.app,
            host,
            port,
            name="jaxrl-http",
            keep_alive_s=keep_alive_s,
            graceful_shutdown_s=graceful_shutdown_s,
        )
        self._owns_engine = False

    @classmethod
    def from_config(
        cls,
        engine: Engine,
        tokenizer: Any,
        config: ServerConfig,
        *,
        model_name: str,
        stop_token_ids: Sequence[int] | None = None,
        renderer: Mapping[str, Any] | None = None,
        return_routed_experts: bool | None = None,
    ) -> EngineServer:
        """The server ``[inference.server]`` describes (not started); ``return_routed_experts``,
        when given, in place of ``config.return_routed_experts``."""
        return cls(
            engine,
            tokenizer,
            config.host,
            config.port,
            model_name=config.served_model_name or model_name,
            stop_token_ids=stop_token_ids,
            graceful_shutdown_s=config.graceful_shutdown_s,
            keep_alive_s=config.keep_alive_s,
            api_key=config.api_key,
            weights_root=config.weights_root,
            allow_request_chat_template=config.allow_request_chat_template,
            request_template_timeout_s=config.request_template_timeout_s,
            return_routed_experts=(
                config.return_routed_experts if return_routed_experts is None else return_routed_experts
            ),
            renderer=renderer,
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def port(self) -> int:
        return self._http.port

    def start(self, timeout: float = 30.0, progress: Callable[[str], None] | None = None) -> None:
        """Serve in a background thread (starting the engine if it is not running, after its
        warm-up when ``inference.backend.warmup``; ``progress`` gets its line per program
        compiled); returns once the socket accepts connections."""
        if not self.engine.running:
            if self.engine.config.warmup:
                self.engine.warmup(progress)
            self.engine.start()
            self._owns_engine = True
        self._http.start(timeout)

    def serve_forever(
        self, on_ready: Callable[[str], None] | None = None, progress: Callable[[str], None] | None = None
    ) -> None:
        """Serve until SIGINT/SIGTERM (call from the main thread), then shut down gracefully and
        return. ``on_ready`` gets the URL once the server accepts connections; ``progress`` the
        warm-up's lines (``start``)."""
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start(progress=progress)
            if on_ready is not None:
                on_ready(self.url)
            while not stop.wait(0.5):
                if not self._http.alive:
                    raise RuntimeError("inference server stopped unexpectedly")
                if not self.engine.healthy:  # exit non-zero: a supervisor restarts a fresh process
                    raise RuntimeError("inference engine failed and cannot serve; see the log above")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop()

    def stop(self) -> None:
        """Close the socket, let in-flight requests finish, then stop the engine if we started it."""
        self._http.stop()
        self._stop_engine()

    def _stop_engine(self) -> None:
        if self._owns_engine:
            self.engine.stop(timeout=self.graceful_shutdown_s)
            self._owns_engine = False

    # -- routes ----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="jaxrl inference", description=protocol.LOGPROBS, docs_url=None, redoc_url=None)
        narrow = partial(
            protocol.server_schema,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.engine.max_model_len,
            allow_request_chat_template=self.chat.allow_request_chat_template,
            template_kwargs=self.chat.template_kwarg_names(),
            routes_experts=self.engine.arch.is_moe,
            max_logprobs=self.engine.max_logprobs,
        )
        errors.install(app, narrow)

        def session(request: Request) -> str | None:
            return request.headers.get(SESSION_HEADER)

        @app.get("/health")
        async def health() -> JSONResponse:
            if not (self.engine.healthy and self.engine.running):
                return errors.error_response(503, "engine is not running")
            return JSONResponse({"status": "ok", "policy_version": self.engine.policy_version})

        @app.get(
            "/metrics",
            response_class=Response,
            responses={200: {"content": {prometheus.CONTENT_TYPE: {"schema": {"type": "string"}}}}},
        )
        async def metrics() -> Response:
            """Prometheus text exposition (vLLM's names where it has the quantity; ``jaxrl.serving.prometheus``)."""
            return Response(prometheus.exposition(self.registry), media_type=prometheus.CONTENT_TYPE)

        @app.get("/metrics.json", response_model=EngineMetrics)
        async def metrics_json() -> dict[str, Any]:
            """The engine's snapshot as JSON (what jaxrl's own tools read: the external backend, bench)."""
            return self.engine.metrics().model_dump()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = protocol.ModelCard(
                id=self.model_name, created=self.created, root=self.model_name, max_model_len=self.engine.max_model_len
            )
            return protocol.ModelList(data=[card]).model_dump()

        # The handlers build plain dicts (no per-request model validation on the hot path); the
        # response models document them in the schema, and the tests check answers against them.
        def answers(model: type[BaseModel], stream: bool = False) -> dict[int | str, dict[str, Any]]:
            content = {"application/json": {}} | ({"text/event-stream": {}} if stream else {})
            return {200: {"model": model, "content": content}}

        @app.post("/inference/v1/generate", responses=answers(protocol.GenerateResponse))
        async def generate(body: protocol.GenerateRequest, request: Request) -> JSONResponse:
            out = await self.completion.generate(body, session(request))
            if (sid := session(request)) is not None:
                for choice in out["choices"]:
                    self.session_versions.record(sid, choice["token_versions"])
            return JSONResponse(out)

        @app.post("/v1/chat/completions", responses=answers(protocol.ChatCompletionResponse, stream=True))
        async def chat(body: protocol.ChatCompletionRequest, request: Request) -> Response:
            if body.stream:
                return streaming.sse(await self.chat.chat_stream(body, session(request)))
            return JSONResponse(await self.chat.chat(body, session(request)))

        @app.post("/v1/completions", responses=answers(protocol.CompletionResponse, stream=True))
        async def completions(body: protocol.CompletionRequest, request: Request) -> Response:
            if body.stream:
                return streaming.sse(streaming.completion_stream(self.completion, body, session(request)))
            return JSONResponse(await self.completion.completions(body, session(request)))

        error_body = {"model": protocol.ErrorResponse}

        @app.post(
            "/update_weights",
            responses={
                403: {**error_body, "description": "path is outside inference.server.weights_root"},
                404: {**error_body, "description": "path is not a model directory"},
                409: {**error_body, "description": "version is not above the policy version served or pending"},
            },
        )
        async def update_weights(body: protocol.UpdateWeightsRequest, request: Request) -> dict[str, int]:
            auth.require_key(request, self.api_key)
            if body.manifest is not None:
                manifest = parse_manifest(body.manifest)
                timeout_s = body.timeout_s or PULL_TIMEOUT_S
                load = partial(self.engine.update_weights_from_manifest, manifest, timeout_s=timeout_s)
                source = f"trainer version {manifest.version} from {', '.join(manifest.endpoints) or 'no endpoint'}"
            else:
                path = self.weights_root.check(body.path)
                load, source = partial(self._load_weights, path), body.path
            try:  # off the event loop: requests keep being served while the weights load
                version = await asyncio.to_thread(load, version=body.version)
            except StaleVersion as e:  # a later update came first
                raise StarletteHTTPException(409, f"version: {e}") from None
            except WeightTransferError as e:  # names the endpoint and param; the old weights keep serving
                raise BadRequest(f"update_weights: {e}") from None
            except RuntimeError as e:  # the engine failed or stops
                raise Unavailable(f"update_weights: {e}") from None
            except Exception as e:
                raise BadRequest(f"update_weights: cannot load {source}: {type(e).__name__}: {e}") from None
            # One line per swap: what an operator (and the GKE test) reads to follow the versions served.
            generated = self.engine.metrics().generated_tokens
            print(f"jaxrl.serve: policy version {version} ({source}); {generated} tokens generated before", flush=True)
            return protocol.UpdateWeightsResponse(policy_version=version).model_dump()

        routes = frozenset(path for r in app.routes if isinstance(path := getattr(r, "path", None), str))
        app.add_middleware(prometheus.HttpCounter, registry=self.registry, routes=routes)
        return app

    def _load_weights(self, path: Path | str, *, version: int | None) -> int:
        """Load a model directory as the new weights; a URL (``gs://...``, shared storage of an
        external rollout backend) is first copied to a local temporary directory."""
        if isinstance(path, Path):
            return self.engine.update_weights_from_path(path, version=version)
        with tempfile.TemporaryDirectory(prefix="jaxrl-update-") as tmp:
            copy_model_dir(path, tmp)
            return self.engine.update_weights_from_path(tmp, version=version)


PULL_TIMEOUT_S = 300.0
"""A manifest pull's deadline when the request names none (``timeout_s``)."""


def parse_manifest(body: dict[str, Any]) -> Manifest:
    """The request's ``manifest`` as a ``Manifest``; a malformed one is a 400 naming the field."""
    try:
        manifest = Manifest.from_json(json.dumps(body))
        if not isinstance(manifest.version, int) or isinstance(manifest.version, bool):
            raise TypeError(f"version {manifest.version!r} is not an integer")
        if not all(isinstance(e, str) and ":" in e for e in manifest.endpoints):
            raise TypeError(f"endpoints {list(manifest.endpoints)!r} are not all host:port")
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise BadRequest(f"manifest: not a weight manifest (jaxrl.weight_transfer's): {what}") from None
    return manifest


def eos_token_ids(model_dir: str | Path | None, tokenizer: Any) -> list[int]:
    """Default stop tokens: the tokenizer's EOS plus ``generation_config.json``'s eos ids."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return list(dict.fromkeys(int(i) for i in ids))


def build_engine_server(
    engine: Engine,
    config: ServerConfig,
    *,
    tokenizer_dir: str | Path,
    model_dir: str | Path | None,
    model_name: str,
    renderer: Mapping[str, Any] | None,
    return_routed_experts: bool | None = None,
) -> EngineServer:
    """``engine``'s (not yet started) HTTP server as ``config`` (``[inference.server]``) says;
    ``model_dir`` is where generation_config.json may be; ``return_routed_experts``, when given,
    in place of the config's (an RL run that replays routing turns it on)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return EngineServer.from_config(
        engine,
        tokenizer,
        config,
        model_name=model_name,
        stop_token_ids=eos_token_ids(model_dir, tokenizer),
        renderer=renderer,
        return_routed_experts=return_routed_experts,
    )

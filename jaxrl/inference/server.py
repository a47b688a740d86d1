"""HTTP API over an ``Engine`` (DESIGN contract 6), with FastAPI + uvicorn.

Handlers submit requests to the engine (its own thread runs the steps) and await their
futures; a handler cancelled mid-flight (client gone, shutdown) aborts its requests. Bad input
gets a 400 whose message names the field; an unexpected error gets a 500 and the server keeps
serving. ``EngineServer`` runs uvicorn in a background thread (``start``/``stop``: the training entry
point, tests; ``serve_forever``: ``python -m jaxrl.serve``, which waits for SIGINT/SIGTERM).
Shutdown is graceful: the socket closes, in-flight requests finish (up to
``graceful_shutdown_s``), then the engine stops.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import secrets
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl.inference import api
from jaxrl.inference.config import ServerConfig
from jaxrl.inference.engine import Engine
from jaxrl.inference.http_thread import BackgroundServer
from jaxrl.inference.sampling import SamplingParams
from jaxrl.inference.scheduler import Completion
from jaxrl.inference.scheduler import Request as EngineRequest
from jaxrl.inference.template_sandbox import TemplateBudgetError, render_in_sandbox
from jaxrl.models.hf_io import copy_model_dir, is_url

_MAX_CACHED_RENDERERS = 16
SESSION_HEADER = "x-session-id"
MAX_TEMPLATE_CHARS = 64 * 1024  # a request-supplied chat template (real ones are a few KB)
PROMPT_CHARS_PER_TOKEN = 64  # rendered prompts longer than this x max_model_len cannot fit anyway
SANDBOX_SLOTS = 2  # request-supplied templates rendering at once (each in its own process)
log = logging.getLogger(__name__)


class BadRequest(Exception):
    """Client error: answered with a 400 carrying this message."""


class Unavailable(Exception):
    """The engine is stopping or failed: answered with a 503."""


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


def _error(status: int, message: str) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def _describe(errors: Sequence[Any]) -> str:
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "request body"
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts)


def make_stop_fn(tokenizer: Any, stops: list[str]) -> Callable[[list[int]], bool]:
    """True once the decoded completion tail contains a stop string."""
    width = 4 * max(len(s) for s in stops) + 8  # tokens enough to hold any stop string

    def stop(tokens: list[int]) -> bool:
        tail = tokenizer.decode(tokens[-width:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    return stop


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CONTROL = re.compile(r"<\|[^|>]*\|>")


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split Qwen/Hermes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks out of
    ``text``; returns (content before the first call, OpenAI tool_calls). Malformed blocks stay
    in the content."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            name, args = obj["name"], obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        arguments = args if isinstance(args, str) else json.dumps(args)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")].strip(), calls


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the 400 this server answers for invalid bodies documented in place
    of FastAPI's default 422 (clients and fuzzers check responses against it)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = {
            "description": "Bad request: the message names the field and the problem",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        error_schema = api.ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error_schema.pop("$defs", {}), ErrorResponse=error_schema)
        for methods in schema.get("paths", {}).values():
            for op in methods.values():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None or op.get("requestBody"):
                    responses["400"] = error
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


class _GuardedRoute(APIRoute):
    """A route whose unexpected errors become a 500 response here, not in Starlette's
    ServerErrorMiddleware, which re-raises them and makes uvicorn close the keep-alive
    connection; env servers pool connections and do not retry, so a closed one would fail the
    next rollout on it too."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (StarletteHTTPException, RequestValidationError, BadRequest, Unavailable):
                raise  # answered by the app's exception handlers
            except Exception as exc:  # a bug: answer 500 and keep serving
                log.exception("%s %s failed", request.method, request.url.path)
                return _error(500, f"internal error: {exc!r}")

        return guarded


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
    ):
        self.engine = engine
        if api_key is None and not is_loopback(host):  # never an open control route on a network
            api_key = secrets.token_urlsafe(24)
            log.warning(
                "inference server binds %s without inference.server.api_key: /update_weights requires "
                "'Authorization: Bearer %s' (a key generated for this process)",
                host,
                api_key,
            )
        self.api_key = api_key
        self.allow_request_chat_template = allow_request_chat_template
        self.request_template_timeout_s = request_template_timeout_s
        self._sandbox_slots = asyncio.Semaphore(SANDBOX_SLOTS)
        self._max_prompt_chars = PROMPT_CHARS_PER_TOKEN * engine.max_model_len
        # A local root admits only local directories under it; a URL root (gs://...) only URLs under it.
        self.weights_root: Path | str | None = None
        if weights_root is not None:
            self.weights_root = str(weights_root).rstrip("/") if is_url(weights_root) else Path(weights_root).resolve()
        self.tokenizer = tokenizer
        # The run's `renderers` config (`[model] renderer`): chat prompts render and completions
        # parse exactly as the env servers' do. None: the tokenizer's chat template.
        self.renderer = dict(renderer) if renderer is not None else None
        self._renderers: dict[str, Any] = {}
        self.host = host
        self.model_name = model_name
        eos = tokenizer.eos_token_id
        self.default_stop_ids = (
            list(stop_token_ids) if stop_token_ids is not None else ([eos] if eos is not None else [])
        )
        self.graceful_shutdown_s = graceful_shutdown_s
        self.created = int(time.time())
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
    ) -> EngineServer:
        """The server ``[inference.server]`` describes (not started)."""
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
            renderer=renderer,
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def port(self) -> int:
        return self._http.port

    def start(self, timeout: float = 30.0) -> None:
        """Serve in a background thread (starting the engine if it is not running, after its
        warm-up when ``inference.warmup``); returns once the socket accepts connections."""
        if not self.engine.running:
            if self.engine.config.warmup:
                self.engine.warmup()
            self.engine.start()
            self._owns_engine = True
        self._http.start(timeout)

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until SIGINT/SIGTERM (call from the main thread), then shut down gracefully and
        return. ``on_ready`` gets the URL once the server accepts connections."""
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
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

    # -- helpers ---------------------------------------------------------------------------

    def _params(
        self, body: api.SamplingFields, prompt_len: int, max_tokens: int | None
    ) -> list[SamplingParams]:
        """Engine sampling settings of a request's ``n`` choices. Like vLLM, a prompt plus
        ``max_tokens`` beyond ``max_model_len`` is refused rather than silently cut short."""
        limit = self.engine.max_model_len
        if max_tokens is None:
            max_tokens = max(limit - prompt_len, 1)  # a too-long prompt is refused by the engine
        elif prompt_len + max_tokens > limit:
            raise BadRequest(
                f"max_tokens: this model's maximum context length is {limit} tokens; the request asks for "
                f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} for the completion): "
                f"lower max_tokens to at most {max(limit - prompt_len, 0)} or shorten the prompt"
            )
        stop_ids = list(body.stop_token_ids or []) + ([] if body.ignore_eos else self.default_stop_ids)
        seeds = [None] * body.n if body.seed is None else [body.seed + i for i in range(body.n)]
        try:
            return [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=body.top_k or 0,
                    seed=seed,
                    stop_token_ids=tuple(dict.fromkeys(stop_ids)),
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                )
                for seed in seeds
            ]
        except ValueError as e:
            raise BadRequest(str(e)) from None

    @staticmethod
    def _stops(body: api.SamplingFields) -> list[str]:
        return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])

    async def _complete(
        self, prompt: list[int], params: list[SamplingParams], session: str | None, stops: list[str]
    ) -> list[Completion]:
        stop_fn = make_stop_fn(self.tokenizer, stops) if stops else None
        reqs = [EngineRequest(prompt, p, session_id=session, stop_fn=stop_fn) for p in params]
        futures = []
        try:
            for r in reqs:
                futures.append(self.engine.submit(r))
        except (ValueError, RuntimeError) as e:
            for r in reqs[: len(futures)]:
                self.engine.abort(r.request_id)
            raise (BadRequest if isinstance(e, ValueError) else Unavailable)(str(e)) from None
        try:
            return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
        except asyncio.CancelledError:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise

    def _visible(self, c: Completion, stops: list[str]) -> tuple[list[int], str]:
        """Completion tokens and text as a client sees them: without the matched stop token,
        the text cut before a matched stop string."""
        ids = c.token_ids
        if c.stop_token is not None:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        return ids, text if cut < 0 else text[:cut]

    @staticmethod
    def _usage(prompt_len: int, completions: list[Completion]) -> dict[str, Any]:
        out = sum(len(c.token_ids) for c in completions)
        cached = min(c.cached_prompt_tokens for c in completions)
        return {
            "prompt_tokens": prompt_len,
            "completion_tokens": out,
            "total_tokens": prompt_len + out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- app -------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="jaxrl inference", docs_url=None, redoc_url=None)
        app.router.route_class = _GuardedRoute

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            return _error(400, _describe(exc.errors()))

        @app.exception_handler(BadRequest)
        async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
            return _error(400, str(exc))

        @app.exception_handler(Unavailable)
        async def _unavailable(request: Request, exc: Unavailable) -> JSONResponse:
            return _error(503, str(exc))

        @app.exception_handler(StarletteHTTPException)
        async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            response = _error(exc.status_code, str(exc.detail))
            response.headers.update(exc.headers or {})  # e.g. Allow on a 405, WWW-Authenticate on a 401
            return response

        @app.exception_handler(Exception)
        async def _crash(request: Request, exc: Exception) -> JSONResponse:
            return _error(500, f"internal error: {exc!r}")

        @app.get("/health")
        async def health() -> JSONResponse:
            if not (self.engine.healthy and self.engine.running):
                return _error(503, "engine is not running")
            return JSONResponse({"status": "ok", "policy_version": self.engine.policy_version})

        @app.get("/metrics")
        async def metrics() -> dict[str, Any]:
            return self.engine.metrics().model_dump()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = api.ModelCard(
                id=self.model_name,
                created=self.created,
                root=self.model_name,
                max_model_len=self.engine.max_model_len,
            )
            return api.ModelList(data=[card]).model_dump()

        @app.post("/inference/v1/generate")
        async def generate(body: api.GenerateRequest, request: Request) -> JSONResponse:
            sp = body.sampling_params
            params = self._params(sp, len(body.token_ids), sp.max_tokens)
            completions = await self._complete(
                body.token_ids, params, request.headers.get(SESSION_HEADER), self._stops(sp)
            )
            choices = []
            for i, c in enumerate(completions):
                logprobs = None
                if sp.logprobs is not None:
                    content = [
                        {"token": f"token_id:{t}", "token_id": t, "logprob": lp}
                        for t, lp in zip(c.token_ids, c.logprobs)
                    ]
                    logprobs = {"content": content}
                choices.append(
                    {
                        "index": i,
                        "token_ids": c.token_ids,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "policy_version": c.policy_version,
                        "policy_version_final": c.policy_version_final,
                    }
                )
            return JSONResponse(
                {
                    "request_id": body.request_id or f"gen-{uuid.uuid4().hex}",
                    "prompt_token_ids": body.token_ids,
                    "choices": choices,
                    "usage": self._usage(len(body.token_ids), completions),
                }
            )

        @app.post("/v1/chat/completions")
        async def chat(body: api.ChatCompletionRequest, request: Request) -> JSONResponse:
            if body.stream:
                raise BadRequest("stream: streaming is not supported; send stream=false")
            prompt, renderer = await self._render_chat(body)
            params = self._params(body, len(prompt), body.max_completion_tokens or body.max_tokens)
            stops = self._stops(body)
            completions = await self._complete(prompt, params, request.headers.get(SESSION_HEADER), stops)
            choices = [self._chat_choice(i, c, stops, body, renderer, prompt) for i, c in enumerate(completions)]
            out = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": self._usage(len(prompt), completions),
            }
            if body.return_token_ids:
                out["prompt_token_ids"] = prompt
            return JSONResponse(out)

        @app.post("/v1/completions")
        async def completions(body: api.CompletionRequest, request: Request) -> JSONResponse:
            if body.stream:
                raise BadRequest("stream: streaming is not supported; send stream=false")
            prompt = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)
            params = self._params(body, len(prompt), body.max_tokens)
            stops = self._stops(body)
            done = await self._complete(prompt, params, request.headers.get(SESSION_HEADER), stops)
            choices = []
            for i, c in enumerate(done):
                ids, text = self._visible(c, stops)
                logprobs = None
                if body.logprobs is not None:
                    pieces = [self._piece(t) for t in ids]
                    offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
                    logprobs = {
                        "tokens": pieces,
                        "token_logprobs": c.logprobs[: len(ids)],
                        "top_logprobs": None,
                        "text_offset": offsets,
                    }
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                        "token_ids": c.token_ids,
                    }
                )
            return JSONResponse(
                {
                    "id": f"cmpl-{uuid.uuid4().hex}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": self.model_name,
                    "choices": choices,
                    "usage": self._usage(len(prompt), done),
                }
            )

        errors = {"model": api.ErrorResponse}
        @app.post("/update_weights", responses={403: {**errors, "description": "path outside inference.server.weights_root"},
                                                404: {**errors, "description": "path is not a model directory"}})
        async def update_weights(body: api.UpdateWeightsRequest, request: Request) -> dict[str, int]:
            self._authorize(request)
            path = self._weights_dir(body.path)
            try:
                version = await asyncio.to_thread(self._load_weights, path, body.version)
            except RuntimeError as e:  # the engine failed or stops
                raise Unavailable(f"update_weights: {e}") from None
            except Exception as e:  # noqa: BLE001 - the client's directory does not load: the old weights stay
                raise BadRequest(
                    f"update_weights: cannot load {body.path}: {type(e).__name__}: {e}"
                ) from None
            return api.UpdateWeightsResponse(policy_version=version).model_dump()

        app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
        return app

    def _authorize(self, request: Request) -> None:
        """Control routes need ``Authorization: Bearer <api_key>`` when the server has a key."""
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise StarletteHTTPException(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <inference.server.api_key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _load_weights(self, path: Path | str, version: int | None) -> int:
        """Load a model directory as the new weights; a URL (``gs://...``, shared storage of an
        external rollout backend) is first copied to a local temporary directory."""
        if isinstance(path, Path):
            return self.engine.update_weights_from_path(path, version=version)
        with tempfile.TemporaryDirectory(prefix="jaxrl-update-") as tmp:
            copy_model_dir(path, tmp)
            return self.engine.update_weights_from_path(tmp, version=version)

    def _weights_dir(self, path: str) -> Path | str:
        """The model directory an update names, checked before anything is read from it."""
        root = self.weights_root
        if is_url(path):  # checked by name here; its config.json when it is copied
            if ".." in path.split("/") or (root is not None and not path.startswith(f"{root}/")):
                raise StarletteHTTPException(403, f"path: {path} is outside the allowed weights directory {root}")
            return path
        p = Path(path).resolve()
        if root is not None and not (isinstance(root, Path) and p.is_relative_to(root)):
            raise StarletteHTTPException(
                403, f"path: {path} is outside the allowed weights directory {self.weights_root}"
            )
        if not (p / "config.json").is_file():  # a well-formed request naming no model: not found
            raise StarletteHTTPException(404, f"path: {path} is not a model directory (no config.json)")
        return p

    async def _render_chat(self, body: api.ChatCompletionRequest) -> tuple[list[int], Any]:
        """Prompt token ids of a chat request (and the renderer that parses its answer, if any),
        rendered off the event loop: with the run's renderer (``[model] renderer``) or the server's
        own template in a worker thread, or with a request-supplied template (only when allowed)
        in a budgeted child process (``template_sandbox``)."""
        messages = [self._message(m) for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        template = kwargs.pop("chat_template", None) or body.chat_template
        for reserved in ("tokenize", "add_generation_prompt", "tools", "conversation", "messages"):
            if reserved in kwargs:
                raise BadRequest(f"chat_template_kwargs.{reserved}: set by the server, not the request")
        if template is None and self.renderer is not None:
            try:
                renderer = self._chat_renderer(kwargs)
                render_ids = partial(renderer.render_ids, messages, tools=body.tools, add_generation_prompt=True)
                prompt = await asyncio.to_thread(render_ids)
            except (TemplateError, TypeError, KeyError, ValueError, AssertionError) as e:  # the renderer rejects it
                raise BadRequest(f"messages: the chat template failed: {e}") from None
            return list(prompt), renderer
        if template is not None:
            text = await self._render_request_template(template, messages, body.tools, kwargs)
        else:
            render = partial(
                self.tokenizer.apply_chat_template,
                messages,
                tools=body.tools,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
            try:
                text = await asyncio.to_thread(render)
            except (TemplateError, TypeError, KeyError, ValueError) as e:  # the template rejects it
                raise BadRequest(f"messages: the chat template failed: {e}") from None
        if len(text) > self._max_prompt_chars:
            raise BadRequest(f"messages: the rendered prompt has over {self._max_prompt_chars} characters")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False), None

    async def _render_request_template(
        self, template: Any, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]
    ) -> str:
        if not self.allow_request_chat_template:
            raise BadRequest(
                "chat_template: request-supplied chat templates are off on this server (they run code); "
                "start it with inference.server.allow_request_chat_template = true to accept them"
            )
        if not isinstance(template, str) or len(template) > MAX_TEMPLATE_CHARS:
            raise BadRequest(f"chat_template: must be a string of at most {MAX_TEMPLATE_CHARS} characters")
        specials = {k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)}
        context = {**specials, **kwargs, "messages": messages, "tools": tools, "add_generation_prompt": True}
        try:
            json.dumps(context)
        except (TypeError, ValueError) as e:
            raise BadRequest(f"chat_template_kwargs: not JSON data: {e}") from None
        async with self._sandbox_slots:
            try:
                return await render_in_sandbox(
                    template,
                    context,
                    timeout_s=self.request_template_timeout_s,
                    max_chars=self._max_prompt_chars,
                )
            except TemplateBudgetError as e:
                raise BadRequest(f"chat_template: {e}") from None

    @staticmethod
    def _message(m: api.ChatMessage) -> dict[str, Any]:
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):  # OpenAI content parts (text only), concatenated
            msg["content"] = "".join(p.text for p in m.content)
        msg.setdefault("content", "")
        return msg

    def _chat_renderer(self, kwargs: Mapping[str, Any] | None) -> Any:
        """The run's renderer with a request's chat_template_kwargs (validated by renderers), cached."""
        from jaxrl.models.chat import create_renderer

        key = json.dumps(kwargs or {}, sort_keys=True, default=str)
        if key in self._renderers:
            return self._renderers[key]
        assert self.renderer is not None
        renderer = create_renderer(self.tokenizer, self.renderer, kwargs or None)
        if len(self._renderers) < _MAX_CACHED_RENDERERS:  # requests choose the keys: bound the cache
            self._renderers[key] = renderer
        return renderer

    def _chat_choice(
        self,
        index: int,
        c: Completion,
        stops: list[str],
        body: api.ChatCompletionRequest,
        renderer: Any = None,
        prompt: list[int] | None = None,
    ) -> dict[str, Any]:
        ids, text = self._visible(c, stops)
        reasoning = None
        if renderer is not None:
            parsed = renderer.parse_response(ids, tools=body.tools, prompt_ids=prompt)
            content, reasoning = parsed.content, parsed.reasoning_content
            tool_calls = [
                {
                    "id": tc.id or f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": tc.name,
                        "arguments": tc.arguments if isinstance(tc.arguments, str) else json.dumps(tc.arguments or {}),
                    },
                }
                for tc in parsed.tool_calls
                if tc.status.value == "ok" and tc.name
            ]
        else:
            content, tool_calls = parse_tool_calls(text) if body.tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": _CONTROL.sub("", content) or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason
        logprobs = None
        if body.logprobs:
            entries = []
            for t, lp in zip(ids, c.logprobs):
                piece = self._piece(t)
                entries.append(
                    {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                )
            logprobs = {"content": entries}
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        if body.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

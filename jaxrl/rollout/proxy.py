"""The loopback HTTP proxy env servers reach rollout servers through: in front of a vLLM server
(``backend = "vllm"``) or of one or more external servers (``backend = "external"``).

Two jobs:

- **Balancing** over several servers: a request with an ``X-Session-ID`` (verifiers' train
  client sends the rollout's trace id, the same every turn) goes to the server that session
  was first sent to, so a multi-turn rollout stays on one server and its growing prefix stays
  in that server's KV cache; a new session or a request without one goes to the server with
  the fewest requests in flight. With seeded sampling a rollout's tokens do not depend on
  which server produced them.
- **A server that stops answering** (connection refused or reset, or no answer within the
  timeout) is reported once through ``on_unreachable(url, reason)`` and the request answers
  502 naming it: the RL loop stops the run with a checkpoint (``jaxrl.rollout.external``).

And for vLLM, log-probs readable by ``renderers`` 0.1.12 (DESIGN contract 6). Why: vLLM 0.32's ``POST /inference/v1/generate`` answers in its "tokens" output mode
unless the request says otherwise, with log-prob entries ``{"token_id": 7, "logprob": x, ...}``.
``renderers`` 0.1.12 (the parser verifiers' train client uses) requires
``{"token": "token_id:7", "logprob": x}`` and rejects anything else, and verifiers sends no
``output_mode``. Asking for ``output_mode: "text"`` instead would make vLLM detokenize every
response and needs a server flag (``--return-tokens-as-token-ids``) that an attached server may
not have. So the proxy rewrites the *response*: every entry of ``choices[*].logprobs.content``
gets ``"token": "token_id:<id>"`` beside its ``token_id`` (the form our embedded engine emits),
which satisfies both parsers whatever output mode the client asked for. Streamed generate
responses (SSE) and every other route (``/v1/models``, chat/completions, ``/health``, ...) pass
through unchanged.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxrl.serving.http_thread import BackgroundServer

GENERATE_PATH = "inference/v1/generate"
SESSION_HEADER = "x-session-id"
MAX_SESSIONS = 65536  # sticky-session entries kept (oldest forgotten first): far more than rollouts in flight
Unreachable = Callable[[str, str], None]
# Hop-by-hop headers and those httpx recomputes; never forwarded.
_DROP_HEADERS = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-encoding",
}


def _entry_token_id(entry: Mapping[str, Any], fallback: int | None) -> int | None:
    """The token id of one log-prob entry, from ``token_id``, a "token_id:<id>" string, or the
    choice's own ``token_ids`` at that position."""
    if isinstance(entry.get("token_id"), int):
        return entry["token_id"]
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token.removeprefix("token_id:"))
        except ValueError:
            return fallback
    return fallback


def rewrite_generate_response(payload: dict[str, Any]) -> dict[str, Any]:
    """Give every sampled-token log-prob entry both ``token`` ("token_id:<id>") and ``token_id``.

    Entries whose id cannot be determined are left as they are (renderers then reports the
    mismatch itself, naming the position). Mutates and returns ``payload``.
    """
    for choice in payload.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(content, list):
            continue
        token_ids = choice.get("token_ids") or []
        for i, entry in enumerate(content):
            if not isinstance(entry, dict):
                continue
            fallback = token_ids[i] if i < len(token_ids) and isinstance(token_ids[i], int) else None
            tid = _entry_token_id(entry, fallback)
            if tid is not None:
                entry["token"] = f"token_id:{tid}"
                entry["token_id"] = tid
    return payload


def _forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


class Balancer:
    """Which upstream serves a request: sticky per session, else the least busy (ties in turn)."""

    def __init__(self, upstreams: Sequence[str]):
        if not upstreams:
            raise ValueError("the proxy needs at least one upstream server")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.in_flight = dict.fromkeys(self.upstreams, 0)
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def acquire(self, session: str | None) -> str:
        with self._lock:
            upstream = self._sessions.get(session) if session else None
            if upstream is None:
                start = next(self._turn)
                order = self.upstreams[start % len(self.upstreams) :] + self.upstreams[: start % len(self.upstreams)]
                upstream = min(order, key=self.in_flight.__getitem__)
            if session:
                self._sessions[session] = upstream
                self._sessions.move_to_end(session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            self.in_flight[upstream] += 1
            return upstream

    def release(self, upstream: str) -> None:
        with self._lock:
            self.in_flight[upstream] -= 1


def build_proxy_app(
    upstreams: str | Sequence[str],
    *,
    timeout_s: float = 600.0,
    connect_timeout_s: float | None = None,
    on_unreachable: Unreachable | None = None,
) -> FastAPI:
    """An app forwarding every request to one of ``upstreams`` (server roots, no ``/v1``)."""
    balancer = Balancer([upstreams] if isinstance(upstreams, str) else upstreams)
    app = FastAPI(title="jaxrl rollout proxy")
    # Pooled connections to vLLM are dropped after 2 s idle, before vLLM's own keep-alive (5 s by
    # default) closes them: reusing a connection the server is closing fails the request.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=2.0)
    timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s or timeout_s)
    state: dict[str, httpx.AsyncClient] = {}
    app.state.balancer = balancer

    def client() -> httpx.AsyncClient:
        # Created lazily inside the server's event loop (an AsyncClient is bound to its loop).
        if "c" not in state:
            state["c"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        return state["c"]

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        upstream = balancer.acquire(request.headers.get(SESSION_HEADER))
        upstream_req = client().build_request(
            request.method,
            f"{upstream}/{path}",
            params=request.query_params,
            headers=_forward_headers(request.headers),
            content=body,
        )
        try:
            resp = await client().send(upstream_req, stream=True)
            headers = _forward_headers(resp.headers)
            is_json = resp.headers.get("content-type", "").startswith("application/json")
            if path == GENERATE_PATH and resp.status_code == 200 and is_json:
                raw = await resp.aread()
                await resp.aclose()
                payload = rewrite_generate_response(httpx.Response(200, content=raw).json())
                headers.pop("content-type", None)
                return JSONResponse(payload, status_code=200, headers=headers)
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if on_unreachable is not None:
                on_unreachable(upstream, f"{request.method} /{path}: {reason}")
            return JSONResponse(
                {"error": {"message": f"rollout server {upstream} unreachable: {reason}", "type": "BadGateway"}},
                status_code=502,
            )
        finally:
            balancer.release(upstream)
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, headers=headers, background=_Closer(resp)
        )

    return app


class _Closer:
    """Background task closing an upstream streamed response once it has been relayed."""

    def __init__(self, resp: httpx.Response):
        self.resp = resp

    async def __call__(self) -> None:
        await self.resp.aclose()


class ProxyServer:
    """``build_proxy_app`` served by uvicorn in a background thread on ``host:port`` (0 = free)."""

    def __init__(
        self,
        upstreams: str | Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float | None = None,
        keep_alive_s: float = 600.0,
        on_unreachable: Unreachable | None = None,
    ):
        self.upstreams = [upstreams] if isinstance(upstreams, str) else list(upstreams)
        self.app = build_proxy_app(
            self.upstreams, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s, on_unreachable=on_unreachable
        )
        # A long keep-alive towards the env servers: they pool connections and do not retry
        # (see ``ServerConfig.keep_alive_s``).
        self._http = BackgroundServer(self.app, host, port, name="jaxrl-rollout-proxy", keep_alive_s=keep_alive_s)

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def port(self) -> int:
        return self._http.port

    def start(self, timeout: float = 30.0) -> None:
        """Serve in a background thread; returns once the socket accepts connections."""
        self._http.start(timeout)

    def stop(self) -> None:
        self._http.stop()

"""A loopback HTTP proxy in front of a vLLM server that makes its generate answers readable by
``renderers`` 0.1.12 (DESIGN contract 6).

Why it exists: vLLM 0.32's ``POST /inference/v1/generate`` answers in its "tokens" output mode
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

from collections.abc import Mapping
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxrl.inference.http_thread import BackgroundServer

GENERATE_PATH = "inference/v1/generate"
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


def build_proxy_app(upstream: str, *, timeout_s: float = 600.0) -> FastAPI:
    """An app forwarding every request to ``upstream`` (a server root, no ``/v1``)."""
    upstream = upstream.rstrip("/")
    app = FastAPI(title="jaxrl vLLM proxy")
    # Pooled connections to vLLM are dropped after 2 s idle, before vLLM's own keep-alive (5 s by
    # default) closes them: reusing a connection the server is closing fails the request.
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=2.0)
    state: dict[str, httpx.AsyncClient] = {}

    def client() -> httpx.AsyncClient:
        # Created lazily inside the server's event loop (an AsyncClient is bound to its loop).
        if "c" not in state:
            state["c"] = httpx.AsyncClient(timeout=timeout_s, limits=limits)
        return state["c"]

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(path: str, request: Request) -> Response:
        body = await request.body()
        upstream_req = client().build_request(
            request.method,
            f"{upstream}/{path}",
            params=request.query_params,
            headers=_forward_headers(request.headers),
            content=body,
        )
        try:
            resp = await client().send(upstream_req, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse(
                {
                    "error": {
                        "message": f"vLLM server at {upstream} unreachable: {exc!r}",
                        "type": "BadGateway",
                    }
                },
                status_code=502,
            )
        headers = _forward_headers(resp.headers)
        is_json = resp.headers.get("content-type", "").startswith("application/json")
        if path == GENERATE_PATH and resp.status_code == 200 and is_json:
            raw = await resp.aread()
            await resp.aclose()
            payload = rewrite_generate_response(httpx.Response(200, content=raw).json())
            headers.pop("content-type", None)
            return JSONResponse(payload, status_code=200, headers=headers)
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
        upstream: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 600.0,
        keep_alive_s: float = 600.0,
    ):
        self.upstream = upstream
        self.app = build_proxy_app(upstream, timeout_s=timeout_s)
        # A long keep-alive towards the env servers: they pool connections and do not retry
        # (see ``ServerConfig.keep_alive_s``).
        self._http = BackgroundServer(self.app, host, port, name="jaxrl-vllm-proxy", keep_alive_s=keep_alive_s)

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

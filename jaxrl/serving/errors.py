"""How the inference server answers errors: OpenAI's error body, a 400 naming the field for bad
input, a 503 while the engine cannot serve, a 500 (connection kept) for a bug, and an OpenAPI
schema that documents the 400 in place of FastAPI's 422."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl.serving import protocol

log = logging.getLogger(__name__)


class BadRequest(Exception):
    """Client error: answered with a 400 carrying this message."""


class Unavailable(Exception):
    """The engine is stopping or failed: answered with a 503."""


_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


def error_response(status: int, message: str) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def describe(errors: Sequence[Any]) -> str:
    """One line naming each invalid field (pydantic's errors) and what is wrong with it."""
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "request body"
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts)


def openapi(app: FastAPI, narrow: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
    """FastAPI's schema, with the 400 this server answers for invalid bodies documented in place
    of FastAPI's default 422 (clients and fuzzers check responses against it), then ``narrow``ed
    to what this server accepts (``protocol.server_schema``)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        error = {
            "description": "Bad request: the message names the field and the problem",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        error_schema = protocol.ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error_schema.pop("$defs", {}), ErrorResponse=error_schema)
        for methods in schema.get("paths", {}).values():
            for op in methods.values():
                responses = op.setdefault("responses", {})
                if responses.pop("422", None) is not None or op.get("requestBody"):
                    responses["400"] = error
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = narrow(schema) if narrow is not None else schema
    return app.openapi_schema


class GuardedRoute(APIRoute):
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
                return error_response(500, f"internal error: {exc!r}")

        return guarded


def install(app: FastAPI, narrow: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Route class, exception handlers and schema of the error policy above, on ``app``."""
    app.router.route_class = GuardedRoute

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, describe(exc.errors()))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(Unavailable)
    async def _unavailable(request: Request, exc: Unavailable) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # e.g. Allow on a 405, WWW-Authenticate on a 401
        return response

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {exc!r}")

    app.openapi = lambda: openapi(app, narrow)  # type: ignore[method-assign]

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
    """One line naming each invalid field as the client wrote it (``messages[0].content``) and
    what it should be, in words. Pydantic's own locations carry its internals (a union's branch
    tags such as ``list[function-before[_json_integer(), int]]``, ``constrained-str``): those are
    taken out, and the failed branches of one union become one "expected a string or a list of
    integers" naming the field, with the error of a branch that matched the shape further in."""
    parts: list[str] = []
    unions: dict[str, list[tuple[str, Any]]] = {}  # field -> (branch tag, error), in order
    for e in errors:
        if e.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
            continue
        loc = [x for x in e.get("loc", ()) if x != "body"]
        tag_at = next((i for i, x in enumerate(loc) if isinstance(x, str) and _is_tag(x)), None)
        if tag_at is None:
            parts.append(_field_error(_path(loc), e))
            continue
        field = _path(loc[:tag_at])
        if field not in unions:
            unions[field] = []
            parts.append(field)  # placeholder, filled below in the order the fields came
        unions[field].append((str(loc[tag_at]), dict(e, loc=loc[:tag_at] + loc[tag_at + 1 :])))
    for i, part in enumerate(parts):
        if part in unions:
            parts[i] = _union_error(part, unions[part])
    return "; ".join(parts)


def _path(loc: Sequence[Any]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content`` (the request body itself: "request body")."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or "request body"


def _is_tag(part: str) -> bool:
    """Whether a location part is pydantic's name for a union branch (a type), not a field name:
    field names here are snake_case identifiers; branch tags are types (``str``, ``int``,
    ``list[...]``, ``constrained-str``, ``function-before[...]``) or model class names."""
    return not part.isidentifier() or part in _TYPE_WORDS or part[:1].isupper()


_TYPE_WORDS = {
    "str": ("a string", "strings"),
    "int": ("an integer", "integers"),
    "float": ("a number", "numbers"),
    "bool": ("true or false", "booleans"),
    "none": ("null", "nulls"),
    "dict": ("an object", "objects"),
    "list": ("a list", "lists"),
}


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of a tag's ``[...]``."""
    args, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c in "[(" and 1 or c in "])" and -1 or 0
        if c == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
    return [*args, text[start:].strip()]


def _words(tag: str) -> tuple[str, str]:
    """A branch tag in words, (singular, plural): ``list[function-before[_json_integer(), int]]``
    is ("a list of integers", "lists of integers")."""
    name, _, rest = tag.partition("[")
    args = _split_args(rest[:-1]) if rest.endswith("]") else []
    if name.startswith("function-") and args:  # a validator around a type: the type
        return _words(args[-1])
    if name in ("list", "tuple", "set", "frozenset") and args:
        plural = _words(args[0])[1]
        return f"a list of {plural}", f"lists of {plural}"
    if name == "literal" and args:
        return "one of " + ", ".join(args), "values among " + ", ".join(args)
    if name in ("nullable", "lax-or-strict", "json-or-python") and args:
        return _words(args[0])
    base = name.removeprefix("constrained-").removeprefix("strict-").lower()
    if base in _TYPE_WORDS:
        return _TYPE_WORDS[base]
    if name[:1].isupper():
        return f"a {name} object", f"{name} objects"
    return "a value of another type", "values of another type"


def _got(e: Any) -> str:
    """``, got X``: what the client sent (cut at 60 characters), or nothing for a missing field."""
    if e.get("type") == "missing" or "input" not in e:
        return ""
    text = repr(e["input"])
    return f", got {text if len(text) <= 60 else text[:57] + '...'}"


def _mismatch(e: Any) -> bool:
    """Whether an error says the value is of the wrong type (not: of the right type but invalid)."""
    kind = str(e.get("type", ""))
    return kind.endswith(("_type", "_parsing")) or kind in ("is_instance_of", "model_attributes_type")


def _field_error(field: str, e: Any) -> str:
    """``field: what is wrong`` from one pydantic error, its message without pydantic's phrasing."""
    if e.get("type") == "missing":
        return f"{field}: required"
    if e.get("type") == "extra_forbidden":
        return f"{field}: unknown field"
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    msg = msg.replace("Input should be", "should be").replace("Input ", "value ")
    if msg[:1].isupper() and msg[1:2].islower():  # "String should ..." -> "string should ..."
        msg = msg[0].lower() + msg[1:]
    return f"{field}: {msg}{_got(e)}"


def _union_error(field: str, branches: list[tuple[str, Any]]) -> str:
    """One line for a field none of whose types matched: what it accepts, what it got, and the
    first error of a branch that matched the shape but not deeper down (e.g. a list whose
    item ``prompt[0]`` is not a token id)."""
    expected = list(dict.fromkeys(_words(tag)[0] for tag, _ in branches))
    words = expected[0] if len(expected) == 1 else ", ".join(expected[:-1]) + " or " + expected[-1]
    shallow = next((e for _, e in branches if _path(e["loc"]) == field), branches[0][1])
    line = f"{field}: expected {words}{_got(shallow)}"
    # A branch of the right type that failed a rule (too short) or further in (an item, a key).
    matched = next((e for _, e in branches if not _mismatch(e) or len(_path(e["loc"])) > len(field)), None)
    if matched is not None and _path(matched["loc"]) == field:  # the right type, against a rule
        return _field_error(field, matched)
    if matched is not None:
        line += f" ({_field_error(_path(matched['loc']), matched).replace(': ', ' ', 1)})"
    return line


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

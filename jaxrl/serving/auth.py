"""Who may change the served weights, and from where: the control route's API key (generated
when the server binds a non-loopback address without one: never an open control route on a
network) and the directory (or URL prefix) weights may be loaded from."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from pathlib import Path

from fastapi import Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxrl.models.hf_io import is_url

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def control_key(host: str, api_key: str | None) -> str | None:
    """The key control routes require: ``api_key``, or one generated (and logged) when the server
    binds a non-loopback ``host`` without one; None (no key) on loopback."""
    if api_key is None and not is_loopback(host):
        api_key = secrets.token_urlsafe(24)
        log.warning(
            "inference server binds %s without inference.server.api_key: /update_weights requires "
            "'Authorization: Bearer %s' (a key generated for this process)",
            host,
            api_key,
        )
    return api_key


def require_key(request: Request, api_key: str | None) -> None:
    """A 401 unless the request carries ``Authorization: Bearer <api_key>`` (no key: open)."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
        raise StarletteHTTPException(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <inference.server.api_key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


class WeightsRoot:
    """Where ``/update_weights`` may load from: a local root admits only local directories under
    it, a URL root (gs://...) only URLs under it; None admits any model directory."""

    def __init__(self, root: str | Path | None):
        self.root: Path | str | None = None
        if root is not None:
            self.root = str(root).rstrip("/") if is_url(root) else Path(root).resolve()

    def check(self, path: str) -> Path | str:
        """The model directory an update names, checked before anything is read from it: a 403
        outside the root, a 404 where no model directory is (a URL is checked by name here; its
        config.json when it is copied)."""
        root = self.root
        if is_url(path):
            if ".." in path.split("/") or (root is not None and not path.startswith(f"{root}/")):
                raise StarletteHTTPException(403, f"path: {path} is outside the allowed weights directory {root}")
            return path
        p = Path(path).resolve()
        if root is not None and not (isinstance(root, Path) and p.is_relative_to(root)):
            raise StarletteHTTPException(403, f"path: {path} is outside the allowed weights directory {root}")
        if not (p / "config.json").is_file():  # a well-formed request naming no model: not found
            raise StarletteHTTPException(404, f"path: {path} is not a model directory (no config.json)")
        return p

"""An ASGI app served by uvicorn in a background thread: what the engine's HTTP API and the
rollout proxy (``jaxrl.rollout.proxy``) both need (the training process keeps its main thread;
tests start and stop the server in-process).

Binds the socket itself so ``port = 0`` resolves to a free port before serving, and keeps idle
client connections open ``keep_alive_s`` (see ``ServerConfig.keep_alive_s`` for why long).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class PortInUse(ValueError):
    """A configured port cannot be bound (a config error the entry points report with exit 2)."""


def check_port_free(host: str, port: int, field: str = "inference.server.port") -> None:
    """Fail fast (before a model loads for minutes) when ``host:port`` cannot be bound; the
    message names the config field. Port 0 (a free port) always passes."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise PortInUse(
                f"{field} = {port}: cannot listen on {host}:{port} ({e.strerror}); another process may hold it: "
                f"pick another port, or 0 for a free one"
            ) from None


class BackgroundServer:
    """``start()`` returns once the socket accepts connections; ``stop()`` lets in-flight
    requests finish (up to ``graceful_shutdown_s``) and joins the thread."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        name: str,
        keep_alive_s: float,
        graceful_shutdown_s: float | None = None,
    ):
        self.app = app
        self.host = host
        self.port = port
        self.name = name
        self.keep_alive_s = keep_alive_s
        self.graceful_shutdown_s = graceful_shutdown_s
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:  # taken since start-up's check_port_free (e.g. during a warm start)
            sock.close()
            raise PortInUse(
                f"{self.name}: cannot listen on {self.host}:{self.port} ({e.strerror}); another process took it "
                "after start-up: pick another port (inference.server.port), or 0 for a free one"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=int(self.keep_alive_s),
            timeout_graceful_shutdown=self.graceful_shutdown_s,
        )
        server = self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=self.name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} failed to start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None

"""Supervision of one spawned env-server process: `python -m jaxrl.orchestrator.env_child` runs
verifiers' `serve_env` (one `EnvServer` or an `EnvServerPool` of `pool_size` workers) bound by
ZeroMQ to a free port of 127.0.0.1 and reports that address through a pipe; its output goes to
`<output_dir>/logs/envs/{train,eval}/<name>.log`. It exits when asked (SIGTERM, handled
gracefully by verifiers) or when the orchestrator dies (its stdin closes)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jaxrl.envs import LOCAL_HARNESS, plugin_id
from jaxrl.orchestrator.config import EnvConfig

if TYPE_CHECKING:
    import verifiers.v1 as vf


class EnvServerError(RuntimeError):
    """A spawned env server failed to start or died."""


class EnvServerDead(EnvServerError):
    """A spawned env server died more often than ``max_restarts`` allows: the run must stop."""


class EnvProcess:
    """One env's server process: launch, its bound address, its log, stop."""

    def __init__(self, config: EnvConfig, vf_config: vf.EnvConfig, log_path: Path):
        self.config = config
        self.name = config.name
        self.vf_config = vf_config
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._address_fd: int | None = None

    def launch(self) -> None:
        """Start the server process (no-op when started); `wait_address` finishes start-up."""
        if self.proc is not None:
            return
        taskset_id, module = plugin_id(self.config.id)
        from verifiers.v1.serve import env_config_data

        spec = {
            "config": env_config_data(self.vf_config),
            "aliases": ({taskset_id: module} if module else {}) | {LOCAL_HARNESS[0]: LOCAL_HARNESS[1]},
            "pool_size": self.config.pool_size,
            "elastic": self.config.elastic,
            "worker_capacity": self.config.worker_capacity,
            "max_concurrent": self.config.max_concurrent,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxrl.orchestrator.env_child", "--address-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        os.close(write_fd)
        self._address_fd = read_fd
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()  # stdin stays open: its EOF tells the server we are gone

    def wait_address(self) -> str:
        """Block until the spawned server reports its bound address; on failure it is stopped."""
        assert self.proc is not None and self._address_fd is not None, "launch() first"
        deadline = time.monotonic() + self.config.startup_timeout
        line = b""
        try:
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EnvServerError(
                        f"env server {self.name!r} did not come up in {self.config.startup_timeout:g}s "
                        f"(startup_timeout); see {self.log_path}:\n{self.log_tail()}"
                    )
                ready, _, _ = select.select([self._address_fd], [], [], min(left, 1.0))
                if ready:
                    chunk = os.read(self._address_fd, 256)
                    if not chunk:
                        self.proc.wait(timeout=10)
                        raise EnvServerError(
                            f"env server {self.name!r} exited with code {self.proc.returncode} during "
                            f"start-up; see {self.log_path}:\n{self.log_tail()}"
                        )
                    line += chunk
        except BaseException:
            self.close()
            raise
        finally:
            os.close(self._address_fd)
            self._address_fd = None
        return line.decode().strip()

    def close(self) -> None:
        """Stop a spawned server: SIGTERM (verifiers tears down gracefully), then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log_tail(self, limit: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-limit:].decode(errors="replace")
        return ""

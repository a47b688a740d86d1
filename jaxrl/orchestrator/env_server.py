"""Env servers: spawn (or attach to) verifiers v1 env servers and run rollouts through them.

One env server process per configured env (`[[orchestrator.train.env]]` / eval entries, their
schema `config.EnvConfig`): `python -m jaxrl.orchestrator.env_child` runs verifiers' own
`serve_env` — a single `EnvServer`, or an `EnvServerPool` of `pool_size` worker processes —
bound by ZeroMQ to a free port on 127.0.0.1, with its logs in
`<output_dir>/logs/envs/{train,eval}/<name>.log`. It exits when asked (SIGTERM, handled
gracefully by verifiers) or when the orchestrator dies (its stdin closes). Or an entry names
the `address` of a server someone else runs.

Rollouts go through verifiers' `EnvClient.run(client_config, model, sampling, task_data)`:
the env server renders prompts with the model's tokenizer, calls the engine's
`/inference/v1/generate` (DESIGN contract 6), runs the harness and scoring, and streams the
episode back. Tasks come from the taskset loaded here, on the orchestrator side (the server
has no list-tasks call). Every run comes back as a `Rollout`: failures (env errors, provider
errors, timeouts, a dead server) carry their error instead of being dropped.

verifiers takes seconds to import, so it is imported where it is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

from jaxrl.endpoint import ModelEndpoint
from jaxrl.envs import LOCAL_HARNESS, plugin_id, register_plugin
from jaxrl.orchestrator.config import EnvConfig
from jaxrl.orchestrator.traces import Rollout, episode_error

if TYPE_CHECKING:
    import verifiers.v1 as vf

logger = logging.getLogger(__name__)

ENV_LOG_DIR = Path("logs") / "envs"


def verifiers_env_config(config: EnvConfig) -> vf.EnvConfig:
    """The verifiers env config an entry describes, validated (clear errors before any spawn)."""
    from pydantic import ValidationError
    from verifiers.v1 import AgentConfig
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type, resolve_env_config

    taskset_id, module = plugin_id(config.id)
    try:
        if module is not None:
            register_plugin(taskset_id, module)
        register_plugin(*LOCAL_HARNESS)
        own_harness = default_harness_id(taskset_id) == taskset_id  # the taskset module exports one
        data: dict[str, Any] = {**config.env_args, "taskset": {**config.args, "id": taskset_id}}
        for name, info in env_config_type(taskset_id, data.get("id", "")).model_fields.items():
            if isinstance(info.default, AgentConfig):
                seat = dict(data.get(name) or {})
                seat.setdefault("runtime", {"type": "subprocess"})
                if not own_harness and seat.get("harness") is None and info.default.harness is None:
                    seat["harness"] = {"id": LOCAL_HARNESS[0]}  # offline, not verifiers' networked `bash`
                data[name] = seat
        return resolve_env_config(data)
    except (ValidationError, ImportError, TypeError, ValueError, AttributeError) as e:
        # Imported here, not at the top: jaxrl.config is the whole run config (it imports
        # jaxrl.engine.config), and the orchestrator must not import jaxrl.engine
        # (tests/test_seams.py). one_line needs the run config for its did-you-mean hints.
        from jaxrl.config import one_line

        detail = one_line(e) if isinstance(e, ValidationError) else e
        raise ValueError(f"env {config.name!r} (id {config.id!r}): {detail}") from e


class EnvServerError(RuntimeError):
    """A spawned env server failed to start or died."""


class EnvServerDead(EnvServerError):
    """A spawned env server died more often than ``max_restarts`` allows: the run must stop."""


class EnvServer:
    """One env's server (spawned or attached) and the client that runs rollouts on it."""

    def __init__(
        self, config: EnvConfig, *, output_dir: str | Path = ".", kind: Literal["train", "eval"] = "train"
    ):
        self.config = config
        self.name = config.name
        self.vf_config = verifiers_env_config(config)
        self.log_path = Path(output_dir) / ENV_LOG_DIR / kind / f"{config.name}.log"
        self.address: str | None = config.address
        self._proc: subprocess.Popen | None = None
        self._address_fd: int | None = None
        self._client: Any = None
        self._dead: asyncio.Event | None = None
        self._watcher: asyncio.Task | None = None
        self._revive_lock: asyncio.Lock | None = None
        self.restarts = 0

    # --- lifecycle --------------------------------------------------------------------

    def launch(self) -> None:
        """Start the server process (no-op when attaching); `wait_address` finishes start-up."""
        if self.config.address is not None or self._proc is not None:
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
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "jaxrl.orchestrator.env_child", "--address-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        os.close(write_fd)
        self._address_fd = read_fd
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(spec) + "\n").encode())
        self._proc.stdin.flush()  # stdin stays open: its EOF tells the server we are gone

    def wait_address(self) -> str:
        """Block until the spawned server reports its bound address."""
        if self.address is not None:
            return self.address
        assert self._proc is not None and self._address_fd is not None, "launch() first"
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
                        self._proc.wait(timeout=10)
                        raise EnvServerError(
                            f"env server {self.name!r} exited with code {self._proc.returncode} during "
                            f"start-up; see {self.log_path}:\n{self.log_tail()}"
                        )
                    line += chunk
        except BaseException:
            self.close()
            raise
        finally:
            os.close(self._address_fd)
            self._address_fd = None
        self.address = line.decode().strip()
        logger.info("env server %s up at %s (log %s)", self.name, self.address, self.log_path)
        return self.address

    async def wait_healthy(self) -> None:
        """Wait until the server answers `health` (the first rollouts need not queue blind)."""
        client = self._ensure_client()
        try:
            await self._guarded(client.wait_for_server_startup(timeout=self.config.startup_timeout), None)
        except Exception as e:
            raise EnvServerError(f"env server {self.name!r} at {self.address} is not healthy: {e}") from e

    async def start(self) -> Self:
        """Spawn (or attach), wait for the address and for health."""
        self.launch()
        await asyncio.to_thread(self.wait_address)
        await self.wait_healthy()
        return self

    def close(self) -> None:
        """Stop a spawned server: SIGTERM (verifiers tears down gracefully), then SIGKILL."""
        proc, self._proc = self._proc, None
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

    async def aclose(self) -> None:
        """Close the client, then the server."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def log_tail(self, limit: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-limit:].decode(errors="replace")
        return ""

    # --- tasks ------------------------------------------------------------------------

    def taskset(self) -> vf.Taskset:
        """The env's taskset, loaded here (iterate it, or `select`/`shuffle`/`take` views)."""
        from verifiers.v1 import load_taskset

        return load_taskset(self.vf_config.taskset)

    # --- rollouts ---------------------------------------------------------------------

    def _ensure_client(self) -> Any:
        if self.address is None:
            raise EnvServerError(f"env server {self.name!r} has no address yet; call start() first")
        if self._client is None:
            from verifiers.v1.serve import EnvClient

            self._client = EnvClient(self.address)
            self._dead = asyncio.Event()
            if self._proc is not None:
                self._watcher = asyncio.create_task(self._watch(self._proc, self._dead))
        return self._client

    async def revive(self) -> None:
        """Restart the spawned server if it died (at most ``max_restarts`` times in a run);
        beyond that raise ``EnvServerDead`` naming the env and its log."""
        if self._proc is None or self._proc.poll() is None:
            return
        if self._revive_lock is None:
            self._revive_lock = asyncio.Lock()
        async with self._revive_lock:
            if self._proc is None or self._proc.poll() is None:  # revived by a concurrent rollout
                return
            code = self._proc.returncode
            if self.restarts >= self.config.max_restarts:
                raise EnvServerDead(
                    f"env server {self.name!r} died (exit code {code}) after {self.restarts} restarts "
                    f"(max_restarts = {self.config.max_restarts}); see {self.log_path}:\n{self.log_tail(1500)}"
                )
            self.restarts += 1
            logger.warning(
                "env server %s died (exit code %s): restarting it (%d of max_restarts %d); log %s",
                self.name, code, self.restarts, self.config.max_restarts, self.log_path,
            )  # fmt: skip
            if self._watcher is not None:
                self._watcher.cancel()
                self._watcher = None
            client, self._client = self._client, None
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
            await asyncio.to_thread(self.close)
            self.address = None
            try:
                await self.start()
            except EnvServerError as e:
                raise EnvServerDead(f"env server {self.name!r} died and could not be restarted: {e}") from e

    @staticmethod
    async def _watch(proc: subprocess.Popen, dead: asyncio.Event) -> None:
        while proc.poll() is None:
            await asyncio.sleep(0.5)
        dead.set()

    async def _guarded(self, coro: Any, timeout: float | None) -> Any:
        """Await `coro`, failing fast if the server process dies or `timeout` passes."""
        assert self._dead is not None
        work = asyncio.ensure_future(coro)
        died = asyncio.ensure_future(self._dead.wait())
        try:
            done, _ = await asyncio.wait({work, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
        if work in done:
            return work.result()
        if died in done:
            code = self._proc.returncode if self._proc is not None else None
            raise EnvServerError(f"env server {self.name!r} died (exit code {code}); see {self.log_path}")
        raise TimeoutError(f"rollout on env {self.name!r} exceeded {timeout:g}s (rollout_timeout)")

    async def run(
        self,
        task_data: Mapping[str, Any],
        endpoint: ModelEndpoint,
        sampling: Mapping[str, Any] | vf.SamplingConfig,
        *,
        group_id: str | None = None,
        policy_version: int = 0,
    ) -> Rollout:
        """One rollout of one task. Never raises for a failed run (the error is on the record),
        only ``EnvServerDead`` when the server died and may not be restarted again."""
        from verifiers.v1 import SamplingConfig

        await self.revive()
        sampling = SamplingConfig.model_validate(sampling)
        rollout = Rollout(
            env=self.name,
            group_id=group_id or uuid.uuid4().hex,
            task=dict(task_data),
            episode=None,
            policy_version=policy_version,
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            seed=(sampling.model_extra or {}).get("seed"),
        )
        try:
            client = self._ensure_client()
            episode = await self._guarded(
                client.run(endpoint.client_config(), endpoint.model, sampling, dict(task_data)),
                self.config.rollout_timeout,
            )
            rollout.episode = episode.model_dump(mode="python")
            rollout.error = episode_error(rollout.episode)
        except Exception as e:  # noqa: BLE001 - a failed run is a record
            rollout.error = f"{type(e).__name__}: {e}"
        if rollout.error is not None:  # the RL loop logs one line per step with the first error
            logger.debug("rollout on env %s failed: %s", self.name, rollout.error)
        return rollout

    async def run_group(
        self,
        task_data: Mapping[str, Any],
        endpoint: ModelEndpoint,
        sampling: Mapping[str, Any],
        group_size: int,
        *,
        policy_version: int = 0,
        seeds: Sequence[int] | None = None,
    ) -> list[Rollout]:
        """`group_size` concurrent rollouts of one task, sharing a fresh group id. With `seeds`
        (one per rollout), rollout i samples with `seed = seeds[i]`: the engine's draws then
        depend on the seed and the token position only, not on which requests share a batch."""
        if seeds is not None and len(seeds) != group_size:
            raise ValueError(f"run_group: {len(seeds)} seeds for a group of {group_size}")
        group_id = uuid.uuid4().hex
        per_rollout = [dict(sampling)] * group_size if seeds is None else [{**sampling, "seed": s} for s in seeds]
        return list(
            await asyncio.gather(
                *(
                    self.run(task_data, endpoint, params, group_id=group_id, policy_version=policy_version)
                    for params in per_rollout
                )
            )
        )


def task_data(task: vf.Task) -> dict:
    """A task's wire data, as an env server rebuilds the task from it."""
    return task.data.model_dump(mode="json")


async def start_env_servers(
    configs: Sequence[EnvConfig], *, output_dir: str | Path, kind: Literal["train", "eval"]
) -> list[EnvServer]:
    """Validate every entry (unknown ids and bad args fail here, before anything runs), then
    start all servers at once. On any failure the ones already started are stopped."""
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"{kind} env names must be unique, got {names}; set `name` on duplicates")
    servers = [EnvServer(c, output_dir=output_dir, kind=kind) for c in configs]
    try:
        for server in servers:
            server.launch()
        for server in servers:
            await asyncio.to_thread(server.wait_address)
        await asyncio.gather(*(server.wait_healthy() for server in servers))
    except BaseException:
        await asyncio.gather(*(server.aclose() for server in servers), return_exceptions=True)
        raise
    return servers

"""A spawned env server follows its trainer. A SIGKILLed trainer runs no teardown: all the env
server sees is its stdin pipe closing as the kernel closes the dead process's files. Closing that
pipe here (and nothing else) is that event; the server must be gone within ``ORPHAN_GRACE_S``
plus its own exit."""

from __future__ import annotations

import subprocess
from pathlib import Path

from jaxrl.orchestrator.config import EnvConfig
from jaxrl.orchestrator.env_child import ORPHAN_GRACE_S
from jaxrl.orchestrator.env_config import verifiers_env_config
from jaxrl.orchestrator.env_process import EnvProcess


def test_env_server_exits_when_its_trainer_dies(tmp_path: Path) -> None:
    config = EnvConfig(id="reverse_text", args={"num_tasks": 4})
    env = EnvProcess(config, verifiers_env_config(config), tmp_path / "env.log")
    env.launch()
    try:
        env.wait_address()
        proc = env.proc
        assert proc is not None and proc.stdin is not None and proc.poll() is None
        proc.stdin.close()  # what the trainer's death does to the pipe; no signal is sent
        # The bound is generous (a loaded host); the mechanism is ORPHAN_GRACE_S (2 s) at most.
        try:
            proc.wait(timeout=ORPHAN_GRACE_S + 28)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the env server outlived its trainer by {ORPHAN_GRACE_S + 28:g}s") from None
    finally:
        env.close()

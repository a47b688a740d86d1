"""Real ``python -m jaxrl.serve`` processes on 127.0.0.1 for the external-backend RL tests, and
the RL config that trains over them (a tiny random Qwen3 checkpoint on reverse_text)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
from xla_flags import cpu_devices
from jaxrl.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# One set of engine sizes for servers and runs: every shape is compiled at server start.
SIZES = {"max_model_len": 256, "max_seqs": 8}  # [inference]: what every backend reads
ENGINE = {"prefill_len_buckets": [128, 256], "prefill_batch_buckets": [4], "decode_batch_buckets": [8]}
"""[inference.backend] of the embedded engine (the servers'; the runs' external backend has none)."""


def env_with_devices(devices: int) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=cpu_devices(devices), JAX_PLATFORMS="cpu")


class Serve:
    """One ``python -m jaxrl.serve`` process (own process group, output in ``log``): ``sizes`` of
    ``[inference]``, ``engine`` of ``[inference.backend]``, ``extra`` arguments."""

    def __init__(
        self, model_dir: Path, log: Path, *, sizes: dict = SIZES, engine: dict = ENGINE, extra: tuple[str, ...] = ()
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [a for k, v in sizes.items() for a in (f"--inference.{k}", json.dumps(v))]
        args += [a for k, v in engine.items() for a in (f"--inference.backend.{k}", json.dumps(v))]
        with log.open("w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxrl.serve", "--model.name", str(model_dir),
                 "--inference.server.port", str(self.port), *args, *extra],
                env=env_with_devices(1), stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
            )  # fmt: skip

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"jaxrl.serve exited:\n{self.log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{self.url} not healthy:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def metrics(self) -> dict:
        return httpx.get(f"{self.url}/metrics.json", timeout=10).json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_servers(model_dir: Path, logs: Path, n: int = 2, **kw: Any) -> list[Serve]:
    """``n`` servers (``Serve``'s keyword arguments ``kw``), once every one is healthy."""
    servers = [Serve(model_dir, logs / f"serve{i}.log", **kw) for i in range(n)]
    try:
        for s in servers:
            s.wait_healthy()
    except BaseException:
        for s in servers:
            s.kill()
        raise
    return servers


def tiny_grpo(steps: int, mesh: dict) -> dict[str, Any]:
    """The tiny RL run the multi-process tests share: ``[trainer]`` and ``[orchestrator]`` of GRPO
    on reverse_text, 2 groups of 4, on-policy (lag 0), ``steps`` steps on ``mesh``."""
    return {
        "trainer": {"steps": steps, "seq_len": 256, "seq_len_buckets": [256], "micro_batch_rows": 4, "mesh": mesh,
                    "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"}},
        "orchestrator": {"batch_size": 8, "group_size": 4, "max_async_level": 0, "max_resample": 3,
                         "train": {"sampling": {"max_completion_tokens": 8, "temperature": 1.0},
                                   "env": [{"id": "reverse_text", "args": {"seed": 3}}]}},
    }  # fmt: skip


def rl_toml(
    path: Path, model_dir: Path, out: Path, urls: list[str], *, steps: int, mesh: dict,
    weight_transfer: str = "direct", **extra: Any,
) -> Path:  # fmt: skip
    """An RL config over ``urls``: ``tiny_grpo``, weights to the servers by ``weight_transfer``."""
    run = tiny_grpo(steps, mesh)
    cfg = {
        "output_dir": str(out),
        "seed": 0,
        "model": {"name": str(model_dir)},
        "trainer": run["trainer"],
        "inference": {"backend": "external", "base_url": urls, "server": {"port": 0},
                      "external": {"request_timeout_s": 60, "startup_timeout_s": 30,
                                   "weight_transfer": weight_transfer}, **SIZES},
        "orchestrator": run["orchestrator"],
        "log": {"progress": False, "plot": False},
    }  # fmt: skip
    for key, value in extra.items():
        cfg[key] = value
    path.write_text(tomli_w.dumps(cfg))
    return path


def train_cmd(config: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "jaxrl.train", "--config", str(config), *more]


DEADLINE_S = 420  # safety net only: a tiny RL run takes ~30-60 s on a loaded 2-core machine
# Metrics computed from the rollouts alone (equal when the rollouts are), and the trainer's.
ROLLOUT_KEYS = ("train/reward_mean", "train/reward_std", "train/rollouts", "train/rollouts_failed", "train/rl_tokens",
                "train/samples", "train/policy_version", "train/sampled_tokens_mean")  # fmt: skip
TRAIN_KEYS = ("train/rl_loss", "train/entropy", "train/grad_norm", "train/mismatch_kl", "train/tokens")



def run_to_end(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait for every process; fail with the logs' tails if one exits non-zero or hangs."""
    end = time.monotonic() + DEADLINE_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if codes != [0] * len(procs):
        tails = "\n".join(f"--- {log.name} ---\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"exit codes {codes}\n{tails}")


def launch(cmd: list[str], devices: int, log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env_with_devices(devices), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip

"""The rendered GKE job, run here: ``render.py`` writes a JobSet (2 trainer hosts x 4 chips of a
v5p-16 + 2 single-chip rollout slices serving ``python -m jaxrl.serve``, fed by direct weight
transfer: every trainer process publishes on its pod's port ``weights`` under its JobSet DNS
name, and every server pulls each version from both), and
``launch/gke/local.py`` starts every pod's command as a local process with the environment GKE
injects (CPU devices for chips, 127.A.B.k addresses for JobSet's DNS names, a folder for the
bucket). One real run covers:

(a) the tiny model given by hub id is fetched once, by trainer process 0, into the bucket (the
    hub is a local huggingface_hub cache prepared here, read offline: the same
    ``snapshot_download`` call a pod makes), and every other pod waits for it;
(b) every pod evicted after the first step (a preemption: SIGTERM and pod condition
    DisruptionTarget): the JobSet restarts without counting it, and the run resumes;
(c) one rollout server killed after the resumed run's first step: its Job fails, so JobSet
    restarts the whole set (counted against maxRestarts; the trainer is stopped with SIGTERM and
    checkpoints, as on GKE), and the run finishes.

No step is missing or duplicated in metrics.jsonl; every server, in every attempt, pulled the
trainer's current version before it served a token and then every step's version in turn.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
from external_servers import ENGINE, SIZES, tiny_grpo
from families import build_family_model

from jaxrl.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "jaxrl-test/tiny-qwen3"
NAME = "rt"
# The line a jaxrl.serve server prints for each version it swaps in (jaxrl/serving/server.py).
SWAPPED = re.compile(r"jaxrl\.serve: policy version \d+ \(trainer version (\d+) from ([^)]*)\); (\d+) tokens generated before")
DEADLINE_S = 900  # safety net only: the whole run takes ~4 min on a loaded 2-core machine


def hub_cache(cache: Path, model_dir: Path) -> Path:
    """``model_dir`` as huggingface_hub's cache holds a downloaded ``HUB_ID`` (refs/main -> snapshot)."""
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    commit = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


def recipe(path: Path, *, colocated: bool = False) -> Path:
    """The run's recipe: for rollout servers, or (``colocated``) for the embedded engine over the
    trainer's processes, which reads no ``[inference.external]``."""
    run = tiny_grpo(3, {"data": 1, "fsdp": 4, "tensor": 2})
    cfg = {
        "output_dir": "outputs/rl",
        "seed": 0,
        "model": {"name": HUB_ID},
        "trainer": run["trainer"],
        # One recipe for both sides: the trainer's (--inference.backend external) and the rollout
        # servers' (jaxrl.serve --inference.backend embedded, which reads the engine's settings).
        "inference": {"external": {"request_timeout_s": 60}, **SIZES, "backend": ENGINE},
        "orchestrator": run["orchestrator"],
        "ckpt": {"interval": 1},
        "log": {"progress": False, "plot": False},
    }  # fmt: skip
    if colocated:
        del cfg["inference"]["external"]
        cfg["inference"]["backend"] = ENGINE | {"colocated_timeout_s": 120}
    path.write_text(tomli_w.dumps(cfg))
    return path


def wait_until(cond, runner: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert runner.poll() is None, f"runner exited {runner.returncode} before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {DEADLINE_S} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def run_rendered(tmp_path: Path, render_args: list[str]) -> tuple[subprocess.Popen, Path, Path, Path]:
    """Render a JobSet of NAME (v5p-16 trainer; ``render_args`` add the rest) and start
    ``launch/gke/local.py`` on it with the tiny model given by hub id (an offline hub cache):
    (the runner, its log, the bucket, local.py's work folder)."""
    cache = hub_cache(tmp_path / "hub", build_family_model(tmp_path / "model", "qwen3"))
    manifest, bucket, work = tmp_path / "jobset.yaml", tmp_path / "bucket", tmp_path / "work"
    rendered = subprocess.run(
        [sys.executable, str(ROOT / "launch/gke/render.py"), "--slice", "v5p-16", "--image", "jaxrl:test",
         "--bucket", "b", "--name", NAME, "--max-restarts", "2", "--wait-timeout-s", "300", "-o", str(manifest),
         *render_args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    log = tmp_path / "runner.log"
    with log.open("w") as f:
        runner = subprocess.Popen(
            [sys.executable, str(ROOT / "launch/gke/local.py"), str(manifest), "--bucket", str(bucket),
             "--work", str(work), "--timeout-s", str(DEADLINE_S)],
            env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return runner, log, bucket, work


def test_rendered_jobset_fetches_once_resumes_after_preemption_and_a_dead_server(tmp_path) -> None:
    runner, log, bucket, work = run_rendered(tmp_path, [
        "--config", str(recipe(tmp_path / "rl.toml")), "--rollout-slice", "v5e-1", "--rollout-replicas", "2",
        "--rollout-server", "jaxrl", "--rollout-tensor-parallel", "1"])  # fmt: skip
    metrics = bucket / NAME / "rl" / "metrics.jsonl"
    rows = lambda: read_metrics(metrics) if metrics.exists() else []
    pods = lambda: json.loads((work / "pods.json").read_text())
    try:
        # (b) a preemption after the first step: every pod evicted (DisruptionTarget + SIGTERM).
        wait_until(lambda: len(rows()) >= 1, runner, log, "first step")
        os.kill(runner.pid, signal.SIGUSR1)
        wait_until(lambda: (work / "pods.json").exists() and next(iter(pods().values()))["attempt"] == 1,
                   runner, log, "restart")  # fmt: skip
        before = len(rows())
        # (c) one rollout server killed once the resumed run has made a step.
        wait_until(lambda: len(rows()) > before, runner, log, "a step after the restart")
        doomed = pods()[f"{NAME}-rollout-1-0"]
        os.killpg(doomed["pid"], signal.SIGKILL)
        assert runner.wait(timeout=DEADLINE_S) == 0, log.read_text()[-3000:]
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGTERM)  # the runner stops its pods
            runner.wait(timeout=300)

    assert [r["step"] for r in rows()] == [1, 2, 3]  # nothing missing, nothing twice
    assert json.loads((bucket / NAME / "rl" / "result.json").read_text())["steps"] == 3
    status = json.loads((work / "status.json").read_text())
    assert status["outcome"] == "succeeded" and len(status["restarts"]) >= 2, status
    # The preemption restarts for free (exit 75 after the checkpoint matches the pod failure policy);
    # the dead server fails its Job, which restarts the whole set, counted against maxRestarts.
    assert status["restarts"][0]["reason"] == "PodFailurePolicy" and not status["restarts"][0]["counted"], status
    last = status["restarts"][-1]
    assert (last["pod"], last["reason"], last["counted"]) == (f"{NAME}-rollout-1-0", "BackoffLimitExceeded", True)
    # (a) fetched once into the bucket by process 0; every later attempt found it there.
    marker = json.loads((bucket / NAME / "model" / ".jaxrl-fetched.json").read_text())
    assert marker["source"] == HUB_ID
    logs = sorted((work / "logs").glob(f"attempt-*/{NAME}-trainer-0-0.log"))
    assert "fetching jaxrl-test/tiny-qwen3" in logs[0].read_text()
    assert all("already fetched" in p.read_text() for p in logs[1:])
    assert any((bucket / NAME / "jax_cache").iterdir())  # restarts find the compiled programs on the bucket
    # Direct transfer: every server pulled from both trainer pods at the rendered port ("weights"),
    # dialled by their DNS names (here the pods' addresses).
    publishers = ", ".join(f"{pods()[f'{NAME}-trainer-0-{i}']['address']}:8477" for i in (0, 1))
    attempts = sorted((work / "logs").glob("attempt-*"), key=lambda d: int(d.name.split("-")[1]))
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    for attempt in attempts:
        first = []
        for server in (0, 1):
            found = SWAPPED.findall((attempt / f"{NAME}-rollout-{server}-0.log").read_text())
            assert found and {src for _, src, _ in found} == {publishers}, (attempt.name, server, found)
            swaps = [(int(v), int(n)) for v, _, n in found]
            versions = [v for v, _ in swaps]
            # The trainer's current version, pulled before the server generated any token (a
            # restarted server never serves its base weights), then every step's, in order.
            assert swaps[0][1] == 0 and versions == list(range(versions[0], versions[0] + len(versions))), swaps
            first.append(versions[0])
            seen[server] |= set(versions)
        assert first[0] == first[1] and (first[0] >= 1) == (attempt != attempts[0]), first  # a resumed run's version
    assert all(seen[server] >= {1, 2, 3} for server in seen), seen  # every server followed every step


def test_rendered_colocated_jobset_resumes_after_preemption_and_a_dead_trainer_process(tmp_path) -> None:
    """The single-slice colocated render (no rollout slice: the embedded engine over both trainer
    processes) run here: a preemption after the first step restarts it for free and it resumes;
    then trainer process 1 is killed mid-run: process 0 sees its connection close and exits (70)
    instead of waiting in a collective, the JobSet restarts (counted), and the run finishes with
    each step once."""
    runner, log, bucket, work = run_rendered(tmp_path, ["--config", str(recipe(tmp_path / "rl.toml", colocated=True))])
    metrics = bucket / NAME / "rl" / "metrics.jsonl"
    rows = lambda: read_metrics(metrics) if metrics.exists() else []
    pods = lambda: json.loads((work / "pods.json").read_text())
    attempt = lambda: next(iter(pods().values()))["attempt"] if (work / "pods.json").exists() else -1
    try:
        wait_until(lambda: len(rows()) >= 1, runner, log, "first step")
        os.kill(runner.pid, signal.SIGUSR1)  # preemption: every pod evicted
        wait_until(lambda: attempt() == 1, runner, log, "restart")
        before = len(rows())
        wait_until(lambda: len(rows()) > before, runner, log, "a step after the restart")
        os.killpg(pods()[f"{NAME}-trainer-0-1"]["pid"], signal.SIGKILL)
        assert runner.wait(timeout=DEADLINE_S) == 0, log.read_text()[-3000:]
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGTERM)
            runner.wait(timeout=300)

    assert [r["step"] for r in rows()] == [1, 2, 3]  # nothing missing, nothing twice
    assert json.loads((bucket / NAME / "rl" / "result.json").read_text())["steps"] == 3
    status = json.loads((work / "status.json").read_text())
    assert status["outcome"] == "succeeded" and len(status["restarts"]) == 2, status
    assert status["restarts"][0]["reason"] == "PodFailurePolicy" and not status["restarts"][0]["counted"], status
    assert status["restarts"][1]["counted"], status
    attempts = sorted((work / "logs").glob("attempt-*"), key=lambda d: int(d.name.split("-")[1]))
    killed = (attempts[1] / f"{NAME}-trainer-0-0.log").read_text()
    assert "process 1 closed its connection" in killed, killed[-3000:]
    assert not (bucket / NAME / "rl" / "rollout_weights").exists()  # weights never left the devices

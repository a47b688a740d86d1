"""Run a rendered JobSet on this machine: every pod's command as a local process, with the
environment GKE and JobSet inject, and JobSet's failure policy.

    python launch/gke/local.py jobset.yaml --bucket DIR [--work DIR] [--timeout-s S]

What is run is the manifest ``render.py`` wrote, so what is tested is what is shipped. Per pod:

- the container's ``command`` and ``env`` (a ``secretKeyRef`` is read from this environment's
  variable of the same name, when set; a ``fieldRef`` to the pod's name, IP, or the labels and
  annotations Job and JobSet put on it is the pod's value), ``python`` being this interpreter;
  ``$(VAR)`` in the command expanded as Kubernetes does (the container's declared variables, and
  those the Job controller and GKE add to its spec: ``$$`` escapes, an unknown one stays as is);
- ``TPU_WORKER_ID`` (the pod's index in its Job), ``TPU_WORKER_HOSTNAMES`` (its Job's pods),
  ``JOBSET_NAME``, ``REPLICATED_JOB_NAME``, ``JOB_INDEX``, ``JOB_COMPLETION_INDEX``, ``HOSTNAME``;
- an address of its own, ``127.A.B.k`` (one random ``127.A.B.0/24`` per run): JobSet's DNS names
  (``<jobset>-<job>-<i>-<p>.<jobset>``) and ``0.0.0.0`` in the command become that address, so
  every pod binds its rendered ports (8000, JAX's 8476, the weight publisher's 8477) as it would
  on its own node;
- the bucket mount (``/data``) is ``--bucket``; the image's ``/app`` is a directory of links to
  this repository (one per pod, so each pod's ``outputs`` link is its own);
- one CPU device per TPU chip the pod requests (``--xla_force_host_platform_device_count``).

Failure policy, as JobSet >= 0.6 applies it: a pod exiting 0 completes; any other exit fails its
Job, with reason ``PodFailurePolicy`` when a ``podFailurePolicy`` rule matches its exit code (the
entry point's 75 after a checkpoint), else ``BackoffLimitExceeded`` (``backoffLimit: 0``). A failed
Job restarts the whole set: free for the reasons a ``RestartJobSetAndIgnoreMaxRestarts`` rule
names, otherwise counted against ``maxRestarts`` (over it, the JobSet fails: exit 1). The set
succeeds when every pod of the ``successPolicy`` target jobs (default: all jobs) has exited 0;
the other pods are then stopped. Pods are stopped with SIGTERM, then SIGKILL after the pod's
``terminationGracePeriodSeconds``.

``kill -USR1 <runner>`` evicts every pod, as a preemption or maintenance event does on GKE:
each gets pod condition ``DisruptionTarget`` and SIGTERM (the rendered ``podFailurePolicy``
then makes the restart free).

``<work>/pods.json`` lists the running pods (pid, address, attempt) and ``<work>/status.json``
the restarts so far; each attempt's logs are under ``<work>/logs/attempt-N/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DATA, APP = "/data", "/app"  # render.DATA, render.APP
POLL_S = 0.2


@dataclass
class Pod:
    """One pod of the JobSet: where it runs here and its process once started."""

    job: str  # replicated job
    index: int  # Job index within the replicated job
    completion: int  # pod index within the Job (TPU_WORKER_ID)
    jobset: str
    address: str
    spec: dict[str, Any]  # the pod template's spec
    rules: list[dict[str, Any]]  # its Job's podFailurePolicy rules
    proc: subprocess.Popen | None = None
    log: Path | None = None
    peers: list[str] = field(default_factory=list)  # addresses of its Job's pods, by index
    evicted: bool = False  # pod condition DisruptionTarget: the runner evicted it (SIGUSR1)

    @property
    def name(self) -> str:
        return f"{self.jobset}-{self.job}-{self.index}-{self.completion}"

    @property
    def hostname(self) -> str:
        """The DNS name JobSet gives the pod (``network.enableDNSHostnames``)."""
        return f"{self.name}.{self.jobset}"

    @property
    def container(self) -> dict[str, Any]:
        return self.spec["containers"][0]

    @property
    def chips(self) -> int:
        return int(self.container.get("resources", {}).get("limits", {}).get("google.com/tpu", 1))


def plan(manifest: dict[str, Any], subnet: str) -> list[Pod]:
    """Every pod the manifest asks for, each with an address in ``subnet`` (``127.A.B``)."""
    jobset = manifest["metadata"]["name"]
    pods: list[Pod] = []
    for rjob in manifest["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        rules = job.get("podFailurePolicy", {}).get("rules", [])
        for i in range(rjob.get("replicas", 1)):
            group = [
                Pod(rjob["name"], i, p, jobset, f"{subnet}.{len(pods) + p + 2}", job["template"]["spec"], rules)
                for p in range(job.get("parallelism", 1))
            ]
            for pod in group:
                pod.peers = [q.address for q in group]
            pods += group
    if len(pods) > 250:
        raise ValueError(f"{len(pods)} pods: at most 250 run here (one 127.A.B.0/24)")
    return pods


def translate(text: str, pod: Pod, names: dict[str, str], bucket: Path, app: Path) -> str:
    """A command or env string as this machine runs it: JobSet names and ``0.0.0.0`` to
    addresses, ``/data`` to the bucket folder, ``/app`` to the pod's image folder."""
    for name in sorted(names, key=len, reverse=True):
        text = text.replace(name, names[name])
    text = text.replace("0.0.0.0", pod.address)
    text = re.sub(r"(?<![\w./-])/data(?=/|\b|$)", str(bucket), text)
    return re.sub(r"(?<![\w./-])/app(?=/|\b|$)", str(app), text)


def pod_fields(pod: Pod) -> dict[str, str]:
    """The pod fields a ``fieldRef`` may name, as Kubernetes, the Job controller and JobSet set them."""
    meta = {
        "batch.kubernetes.io/job-completion-index": str(pod.completion),
        "jobset.sigs.k8s.io/jobset-name": pod.jobset,
        "jobset.sigs.k8s.io/replicatedjob-name": pod.job,
        "jobset.sigs.k8s.io/job-index": str(pod.index),
    }
    fields = {"metadata.name": pod.name, "status.podIP": pod.address}
    for kind in ("labels", "annotations"):
        fields |= {f"metadata.{kind}['{k}']": v for k, v in meta.items()}
    return fields


K8S_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, declared: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a command: a declared variable's value, ``$$`` -> ``$``,
    anything else left as written."""
    return K8S_VAR.sub(lambda m: "$" if m.group(0) == "$$" else declared.get(m.group(1), m.group(0)), text)


def image_dir(work: Path, pod: Pod) -> Path:
    """The pod's ``/app``: links to the repository's entries, without ``outputs`` (the entry
    point links its own to the bucket)."""
    app = work / "pods" / pod.name / "app"
    app.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name not in ("outputs", ".git") and not (app / entry.name).is_symlink():
            (app / entry.name).symlink_to(entry)
    return app


def declared_env(pod: Pod, names: dict[str, str], bucket: Path, app: Path) -> dict[str, str]:
    """The variables in the container's spec: its own ``env`` (values, field references) and those
    the Job controller (``JOB_COMPLETION_INDEX``) and GKE's TPU webhook (``TPU_WORKER_*``) add."""
    env: dict[str, str] = {}
    fields = pod_fields(pod)
    for var in pod.container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            env[var["name"]] = translate(str(var["value"]), pod, names, bucket, app)
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                raise ValueError(f"{pod.name}: env {var['name']}: fieldRef {path!r} is not emulated here; "
                                 f"use one of {sorted(fields)}")  # fmt: skip
            env[var["name"]] = fields[path]
        elif "secretKeyRef" in source and var["name"] in os.environ:
            env[var["name"]] = os.environ[var["name"]]
    return {
        **env,
        "JOB_COMPLETION_INDEX": str(pod.completion),
        "TPU_WORKER_ID": str(pod.completion),
        "TPU_WORKER_HOSTNAMES": ",".join(pod.peers),
    }


def pod_env(pod: Pod, names: dict[str, str], bucket: Path, app: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    for var in pod.container.get("env", []):
        if "secretKeyRef" in var.get("valueFrom", {}) and var["name"] not in os.environ:
            ref = var["valueFrom"]["secretKeyRef"]
            print(f"[local] {pod.name}: secret {ref['name']}/{ref['key']} not set here (export {var['name']})")
    env |= declared_env(pod, names, bucket, app)
    env |= {
        "JOBSET_NAME": pod.jobset,
        "REPLICATED_JOB_NAME": pod.job,
        "JOB_INDEX": str(pod.index),
        "HOSTNAME": pod.name,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={pod.chips}",
        "PYTHONUNBUFFERED": "1",
    }
    if coord := [p["containerPort"] for p in pod.container.get("ports", []) if p.get("name") == "jax-coord"]:
        env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{pod.address}:{coord[0]}"  # JAX's default binds every address
    return env


def pod_command(pod: Pod, names: dict[str, str], bucket: Path, app: Path) -> list[str]:
    """The container's command and args as Kubernetes runs them (``$(VAR)`` expanded), then
    translated for this machine; ``python`` is this interpreter."""
    c = pod.container
    declared = declared_env(pod, names, bucket, app)
    cmd = [translate(expand(a, declared), pod, names, bucket, app) for a in [*c.get("command", []), *c.get("args", [])]]
    return [sys.executable, *cmd[1:]] if cmd and cmd[0] == "python" else cmd


def start(pod: Pod, names: dict[str, str], bucket: Path, work: Path, attempt: int) -> None:
    app = image_dir(work, pod)
    c = pod.container
    cmd = pod_command(pod, names, bucket, app)
    cwd = translate(c.get("workingDir", APP), pod, names, bucket, app)
    pod.log = work / "logs" / f"attempt-{attempt}" / f"{pod.name}.log"
    pod.log.parent.mkdir(parents=True, exist_ok=True)
    with pod.log.open("w") as f:
        pod.proc = subprocess.Popen(
            cmd, cwd=cwd, env=pod_env(pod, names, bucket, app), stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def stop(pods: list[Pod]) -> None:
    """SIGTERM every running pod, SIGKILL what is left after its grace period."""
    for pod in pods:
        if pod.proc is not None and pod.proc.poll() is None:
            pod.proc.send_signal(signal.SIGTERM)
    for pod in pods:
        if pod.proc is None:
            continue
        try:
            pod.proc.wait(timeout=float(pod.spec.get("terminationGracePeriodSeconds", 30)))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pod.proc.pid, signal.SIGKILL)  # the container's other processes go with it
        except ProcessLookupError:
            pass
        pod.proc.wait()


def failure_reason(pod: Pod, code: int) -> str:
    """Why a pod's exit ``code`` fails its Job: a matching podFailurePolicy rule, else backoffLimit 0."""
    for rule in pod.rules:
        conditions = rule.get("onPodConditions", [])
        if rule.get("action") == "FailJob" and pod.evicted and any(c.get("type") == "DisruptionTarget" for c in conditions):
            return "PodFailurePolicy"
        codes = rule.get("onExitCodes") or {}
        mine = codes.get("containerName") in (None, pod.container["name"])
        if rule.get("action") == "FailJob" and codes and mine and (code in codes["values"]) == (codes.get("operator", "In") == "In"):
            return "PodFailurePolicy"
    return "BackoffLimitExceeded"


def evict_all(pods: list[Pod]) -> None:
    """A preemption as GKE delivers it: every pod gets condition DisruptionTarget and SIGTERM."""
    print("[local] evicting every pod (DisruptionTarget + SIGTERM)", flush=True)
    for pod in pods:
        if pod.proc is not None and pod.proc.poll() is None:
            pod.evicted = True
            pod.proc.send_signal(signal.SIGTERM)


def watch(pods: list[Pod], targets: set[str], deadline: float, evict: list[bool]) -> tuple[str, Pod | None]:
    """Until the set succeeds ("succeeded", None), a pod fails its Job (reason, pod) or the
    deadline passes ("deadline", None). ``evict[0]`` set (by SIGUSR1) evicts every pod."""
    while time.monotonic() < deadline:
        if evict[0]:
            evict[0] = False
            evict_all(pods)
        for pod in pods:
            code = pod.proc.poll() if pod.proc is not None else None
            if code not in (None, 0):
                return failure_reason(pod, code), pod
        if all(p.proc is not None and p.proc.poll() == 0 for p in pods if p.job in targets):
            return "succeeded", None
        time.sleep(POLL_S)
    return "deadline", None


def free_subnet(ports: list[int]) -> str:
    """A random ``127.A.B`` whose addresses have the rendered ports free (loopback covers 127/8)."""
    rng = random.Random()
    for _ in range(20):
        subnet = f"127.{rng.randrange(1, 255)}.{rng.randrange(1, 255)}"
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind((f"{subnet}.2", port))
            return subnet
        except OSError:
            continue
    raise RuntimeError(f"no 127.A.B.0/24 with ports {ports} free")


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def run(manifest: dict[str, Any], bucket: Path, work: Path, timeout_s: float) -> int:
    """Run the JobSet to its end: 0 when it succeeds, 1 when it fails, 124 past ``timeout_s``."""
    spec = manifest["spec"]
    policy = spec.get("failurePolicy", {})
    max_restarts = int(policy.get("maxRestarts", 0))
    free = {
        reason
        for rule in policy.get("rules", [])
        if rule.get("action") == "RestartJobSetAndIgnoreMaxRestarts"
        for reason in rule.get("onJobFailureReasons", [])
    }
    targets = set(spec.get("successPolicy", {}).get("targetReplicatedJobs", [])) or {
        r["name"] for r in spec["replicatedJobs"]
    }
    ports = sorted({p["containerPort"] for r in spec["replicatedJobs"]
                    for c in r["template"]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])})  # fmt: skip
    pods = plan(manifest, free_subnet(ports))
    names = {pod.hostname: pod.address for pod in pods}
    print("[local] pods: " + ", ".join(f"{p.hostname} = {p.address}" for p in pods), flush=True)
    deadline = time.monotonic() + timeout_s
    history: list[dict[str, Any]] = []
    counted = attempt = 0
    evict = [False]
    signal.signal(signal.SIGUSR1, lambda *_: evict.__setitem__(0, True))
    while True:
        for pod in pods:
            pod.evicted = False
            start(pod, names, bucket, work, attempt)
        write_json(work / "pods.json", {p.name: {"pid": p.proc.pid, "address": p.address, "job": p.job,
                                                  "attempt": attempt, "log": str(p.log)} for p in pods})  # fmt: skip
        try:
            outcome, failed = watch(pods, targets, deadline, evict)
        finally:
            stop(pods)
        if outcome in ("succeeded", "deadline"):
            write_json(work / "status.json", {"outcome": outcome, "restarts": history})
            print(f"[local] JobSet {outcome} after {attempt} restart(s)", flush=True)
            return 0 if outcome == "succeeded" else 124
        assert failed is not None and failed.proc is not None
        counted += outcome not in free
        history.append({"attempt": attempt, "pod": failed.name, "exit": failed.proc.returncode, "reason": outcome,
                        "counted": outcome not in free})  # fmt: skip
        write_json(work / "status.json", {"outcome": "running", "restarts": history})
        print(f"[local] {failed.name} exited {failed.proc.returncode}: Job {failed.job}-{failed.index} failed "
              f"({outcome}); {'restart' if outcome in free else 'restart counted'} {counted}/{max_restarts}",
              flush=True)  # fmt: skip
        if counted > max_restarts:
            write_json(work / "status.json", {"outcome": "failed", "restarts": history})
            print(f"[local] JobSet failed: more than maxRestarts = {max_restarts} failures", flush=True)
            return 1
        attempt += 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("manifest", type=Path, help="a JobSet rendered by launch/gke/render.py")
    p.add_argument("--bucket", type=Path, required=True, help="local folder standing in for the bucket (/data)")
    p.add_argument("--work", type=Path, default=None, help="logs, pods.json, status.json (default: a temp dir)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="stop everything after this long (exit 124)")
    args = p.parse_args(argv)
    if args.timeout_s <= 0:
        p.error(f"--timeout-s {args.timeout_s:g}: must be > 0")
    manifest = yaml.safe_load(args.manifest.read_text())
    if not isinstance(manifest, dict) or manifest.get("kind") != "JobSet":
        p.error(f"{args.manifest}: not a JobSet manifest (kind: JobSet)")
    args.bucket.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="jaxrl-local-jobset-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[local] logs in {work}/logs", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop() in run's finally still runs
    return run(manifest, args.bucket.resolve(), work.resolve(), args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())

"""GKE launch files: the JobSet renderer (parsed back with PyYAML and checked field by field),
the trainer command it writes (validated by jaxrl's own config loader), the committed example
manifests (equal to a fresh render), and the restartable container entry point."""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from jaxrl.cli import load_config

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    """A launch/gke script as a module (launch/ is not a package: the scripts run standalone)."""
    spec = importlib.util.spec_from_file_location(
        f"launch_gke_{name}", ROOT / "launch" / "gke" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


render = load("render")
entrypoint = load("entrypoint")
local = load("local")

IMAGE = "REGION-docker.pkg.dev/PROJECT/REPO/jaxrl:TAG"
BASE = ["--image", IMAGE, "--bucket", "BUCKET", "--config", "configs/reverse_text/rl.toml"]
# (file name, renderer arguments) of the committed examples in launch/gke/examples/.
EXAMPLES = {
    "v5e-16-sft.yaml": [
        "--slice",
        "v5e-16",
        *BASE[:4],
        "--config",
        "configs/reverse_text/sft.toml",
        "--name",
        "rt-sft",
    ],
    "v6e-8-rl.yaml": ["--slice", "v6e-8", *BASE, "--name", "rt-rl"],
    "v6e-16-rl-vllm.yaml": [
        "--slice",
        "v6e-16",
        *BASE,
        "--name",
        "rt-rl-vllm",
        "--rollout-slice",
        "v6e-8",
        "--rollout-replicas",
        "2",
    ],
}


def rendered(tmp_path: Path, args: list[str]) -> dict:
    out = tmp_path / "jobset.yaml"
    assert render.main(["-o", str(out), *args]) == 0
    return yaml.safe_load(out.read_text())


def jobs(manifest: dict) -> dict[str, dict]:
    return {j["name"]: j for j in manifest["spec"]["replicatedJobs"]}


def pod(job: dict) -> dict:
    return job["template"]["spec"]["template"]["spec"]


def train_args(job: dict, env: dict[str, str] | None = None) -> list[str]:
    """The ``jaxrl.train`` arguments of the trainer container (entry point flags removed), with
    ``$(VAR)`` expanded from ``env`` as Kubernetes does."""
    cmd = [local.expand(a, env or {}) for a in pod(job)["containers"][0]["command"]]
    assert cmd[:2] == ["python", "/app/launch/gke/entrypoint.py"]
    args = list(cmd[2:])
    for flag in ("--output-root", "--fetch", "--fetch-to", "--fetch-revision", "--pip", "--wait-timeout-s"):
        while flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    j = args.index("--config") + 1
    return [*args[:j], str(ROOT / args[j]), *args[j + 1 :]]  # recipe paths are relative to the repo


@pytest.mark.parametrize(
    ("name", "accelerator", "topology", "hosts", "per_host"),
    [
        ("v5e-16", "tpu-v5-lite-podslice", "4x4", 4, 4),
        ("v5e-8", "tpu-v5-lite-podslice", "2x4", 1, 8),
        ("v6e-4", "tpu-v6e-slice", "2x2", 1, 4),
        ("v6e-256", "tpu-v6e-slice", "16x16", 64, 4),
        ("v5p-32", "tpu-v5p-slice", "2x2x4", 4, 4),  # the 8B recipe's slice: 16 chips (v5p counts TensorCores)
        ("v5p-8", "tpu-v5p-slice", "2x2x1", 1, 4),
    ],
)
def test_slice_shapes(name, accelerator, topology, hosts, per_host) -> None:
    s = render.Slice.parse(name)
    assert (s.accelerator, s.topology, s.hosts, s.chips_per_host) == (accelerator, topology, hosts, per_host)
    assert s.hosts * s.chips_per_host == s.chips


@pytest.mark.parametrize("bad", ["v5e-12", "v4-8", "v6e", "v5p-12"])
def test_unknown_slice_is_a_clear_error(bad, capsys) -> None:
    assert render.main(["--slice", bad, *BASE]) == 2
    err = capsys.readouterr().err
    assert bad in err and "v5e-16" in err and "v6e-8" in err


@pytest.mark.parametrize(
    ("slice_name", "hosts", "chips"), [("v5e-16", 4, 4), ("v6e-32", 8, 4), ("v5e-8", 1, 8), ("v5p-32", 4, 4)]
)
def test_trainer_jobset(tmp_path, slice_name, hosts, chips) -> None:
    roll = ["--rollout-slice", "v6e-8"] if hosts > 1 else []  # multi-host RL: rollout servers of their own
    m = rendered(tmp_path, ["--slice", slice_name, *BASE, *roll, "--name", "rt", "--", "--trainer.steps", "100"])
    assert (m["apiVersion"], m["kind"], m["metadata"]["name"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet", "rt")
    assert (
        m["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"]
        == "cloud.google.com/gke-nodepool"
    )
    assert m["spec"]["failurePolicy"] == {"maxRestarts": 3, "rules": [{
        "name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]}]}
    assert list(jobs(m)) == ["trainer", "rollout"] if roll else ["trainer"]
    job = jobs(m)["trainer"]
    assert job["replicas"] == 1
    spec = job["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] == hosts  # one pod per host of the slice
    # A preemption (exit 75 after the checkpoint, or an eviction) fails the Job by its pod failure
    # policy, which the JobSet restarts without counting; any other failure counts.
    assert spec["backoffLimit"] == 0 and spec["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "jaxrl", "operator": "In", "values": [75]}},
    ]
    assert entrypoint.EXIT_INTERRUPTED == render.EXIT_INTERRUPTED == 75
    p = pod(job)
    gen = slice_name.split("-")[0]
    assert p["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": render.ACCELERATORS[gen],
        "cloud.google.com/gke-tpu-topology": render.Slice.parse(slice_name).topology,
        # 2x4 is one 8-chip VM or two 4-chip VMs: the machine type picks the shape.
        "node.kubernetes.io/instance-type": {"v5e": "ct5lp-hightpu", "v6e": "ct6e-standard", "v5p": "ct5p-hightpu"}[gen]
        + f"-{chips}t",
    }
    (c,) = p["containers"]
    assert c["resources"]["limits"]["google.com/tpu"] == c["resources"]["requests"]["google.com/tpu"] == chips
    assert c["image"] == IMAGE
    assert {"mountPath": "/data", "name": "data"} in c["volumeMounts"]
    assert p["volumes"][0]["csi"]["volumeAttributes"]["bucketName"] == "BUCKET"
    assert c["command"][c["command"].index("--output-root") + 1] == "/data/rt"
    cfg, _ = load_config(train_args(job))  # the command is a valid jaxrl run
    assert cfg.mode == "rl" and cfg.trainer.steps == 100
    assert cfg.distributed.enabled == (hosts > 1)


def test_disaggregated_jobset(tmp_path) -> None:
    args = ["--slice", "v6e-16", *BASE, "--name", "rt", "--rollout-slice", "v5e-8", "--rollout-replicas", "3"]
    m = rendered(tmp_path, args)
    assert list(jobs(m)) == ["trainer", "rollout"]
    assert m["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    roll = jobs(m)["rollout"]
    assert roll["replicas"] == 3
    assert roll["template"]["spec"]["parallelism"] == roll["template"]["spec"]["completions"] == 1
    p = pod(roll)
    assert p["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    assert p["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    (c,) = p["containers"]
    assert c["resources"]["limits"]["google.com/tpu"] == 8
    serve = c["command"][-1]
    # The servers wait for the warm start's export on the bucket, then serve it. The recipe's
    # model has 4 heads / 2 KV heads: tensor parallel 4 (8 would not divide the heads).
    assert "vllm serve /data/rt/reverse_text/sft/hf " in serve
    assert "--tensor-parallel-size 4 " in serve and "--max-model-len 256" in serve
    assert "--logprobs-mode processed_logprobs" in serve
    assert c["image"] == render.VLLM_TPU_IMAGE and not c["image"].endswith(":latest")
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in c["env"]
    assert [r["action"] for r in roll["template"]["spec"]["podFailurePolicy"]["rules"]] == ["FailJob"]  # evictions
    cfg, _ = load_config(train_args(jobs(m)["trainer"]))
    assert cfg.inference.backend.type == "external" and cfg.inference.backend.server == "vllm"
    # Every server, by the DNS name JobSet gives pod 0 of rollout Job i.
    assert cfg.inference.base_url == [f"http://rt-rollout-{i}-0.rt:8000/v1" for i in range(3)]
    assert cfg.inference.backend.weights_dir == "/data/rt/rollout_weights"  # the servers' mount too
    assert cfg.inference.backend.weight_transfer == "files"  # vLLM loads files (tpu-inference ignores a trainer)
    assert cfg.distributed.enabled
    trainer = pod(jobs(m)["trainer"])["containers"][0]
    assert "weights" not in [p["name"] for p in trainer["ports"]]  # no publisher: nothing pulls from it
    assert "--inference.backend.weight_transfer_advertise" not in trainer["command"]


def test_jaxrl_servers_pull_each_version_from_every_trainer_pod(tmp_path) -> None:
    """Direct transfer, the default with jaxrl.serve servers: every trainer process publishes on
    the declared port ``weights`` of its pod, bound on every interface, and advertises its pod's
    JobSet DNS name, its index expanded by Kubernetes from the env the container declares."""
    m = rendered(tmp_path, ["--slice", "v5p-16", *BASE, "--name", "rt", "--rollout-slice", "v5e-1",
                            "--rollout-replicas", "2", "--rollout-server", "jaxrl", "--rollout-tensor-parallel", "1"])  # fmt: skip
    trainer = pod(jobs(m)["trainer"])["containers"][0]
    assert {"containerPort": render.WEIGHTS_PORT, "name": "weights"} in trainer["ports"]
    assert render.POD_INDEX_ENV in trainer["env"]
    assert render.POD_INDEX_ENV["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    cmd = trainer["command"]
    assert cmd[cmd.index("--inference.backend.weight_transfer_advertise") + 1] == "rt-trainer-0-$(JOB_COMPLETION_INDEX).rt"
    assert "--inference.backend.weights_dir" not in cmd  # no files
    assert m["spec"]["network"] == {"enableDNSHostnames": True}  # the DNS names exist
    for index in (0, 1):  # as Kubernetes expands the command on pod ``index``
        cfg, _ = load_config(train_args(jobs(m)["trainer"], {"JOB_COMPLETION_INDEX": str(index)}))
        b = cfg.inference.backend
        assert (b.server, b.weight_transfer, b.weight_transfer_host, b.weight_transfer_port) == (
            "jaxrl", "direct", "0.0.0.0", render.WEIGHTS_PORT)  # fmt: skip
        assert b.advertised_host() == f"rt-trainer-0-{index}.rt"
    # --weight-transfer files: the fallback, through the bucket, with nothing to publish.
    m = rendered(tmp_path, ["--slice", "v5p-16", *BASE, "--name", "rt", "--rollout-slice", "v5e-1", "--rollout-server",
                            "jaxrl", "--rollout-tensor-parallel", "1", "--weight-transfer", "files"])  # fmt: skip
    cfg, _ = load_config(train_args(jobs(m)["trainer"]))
    assert (cfg.inference.backend.weight_transfer, cfg.inference.backend.weights_dir) == ("files", "/data/rt/rollout_weights")
    trainer = pod(jobs(m)["trainer"])["containers"][0]
    assert "weights" not in [p["name"] for p in trainer["ports"]] and render.POD_INDEX_ENV not in trainer["env"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--rollout-slice", "v6e-8", "--weight-transfer", "direct"], "--weight-transfer direct: vLLM servers load weights from files"),
    (["--weight-transfer", "files"], "--weight-transfer files: it feeds rollout servers; add --rollout-slice"),
])  # fmt: skip
def test_weight_transfer_the_servers_cannot_use_is_refused_naming_the_flag(capsys, extra, message) -> None:
    assert render.main(["--slice", "v6e-16" if "--rollout-slice" in extra else "v6e-8", *BASE, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize(("heads", "kv", "chips", "tp"), [
    (16, 8, 8, 8),  # Qwen3-0.6B / 1.7B on v6e-8
    (64, 8, 8, 8),  # Qwen3-32B
    (40, 8, 8, 8),  # Qwen3-14B
    (4, 2, 8, 4),  # the reverse_text recipe's model
    (12, 4, 8, 4),
    (14, 2, 4, 2),  # Qwen2.5-0.5B-like
    (3, 1, 4, 1),
])  # fmt: skip
def test_tensor_parallel_follows_head_counts(heads, kv, chips, tp) -> None:
    assert render.tensor_parallel(heads, kv, chips) == tp


def test_head_counts_come_from_the_recipe_or_its_preset() -> None:
    assert render.model_heads(render.read_recipe("configs/qwen3_8b/rl.toml")) == (32, 8)  # preset, no download
    assert render.model_heads(render.read_recipe("configs/reverse_text/rl.toml")) == (4, 2)  # via its warm start
    assert render.model_heads({"model": {"name": "models/MyModel"}}) is None


def test_rollout_tensor_parallel_override_is_checked(capsys) -> None:
    args = ["--slice", "v6e-16", *BASE, "--rollout-slice", "v6e-8", "--rollout-tensor-parallel", "8"]
    assert render.main(args) == 2
    assert "--rollout-tensor-parallel 8" in capsys.readouterr().err


# One example in the fast tier, the others (a process each) in the slow tier.
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if i else []) for i, n in enumerate(sorted(EXAMPLES))])
def test_each_example_command_starts_through_the_real_entry_point(tmp_path, name, monkeypatch) -> None:
    """The trainer container's command, as rendered, through launch/gke/entrypoint.py and
    `python -m jaxrl.train` (the whole CLI and config validation, --dry-run so nothing trains)."""
    manifest = yaml.safe_load((ROOT / "launch" / "gke" / "examples" / name).read_text())
    cmd = pod(jobs(manifest)["trainer"])["containers"][0]["command"]
    args = cmd[2:]
    args[args.index("--output-root") + 1] = str(tmp_path / "bucket")
    args[args.index("--config") + 1] = str(ROOT / args[args.index("--config") + 1])
    monkeypatch.chdir(tmp_path)  # the entry point links ./outputs to the bucket
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # as in the image: a warm start's recipe is read at config time
    out = subprocess.run([sys.executable, str(ROOT / "launch/gke/entrypoint.py"), *args, "--dry-run"],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    resolved = tomllib.loads(out.stdout[out.stdout.index("output_dir = "):])  # --dry-run prints TOML
    assert Path("outputs").resolve() == (tmp_path / "bucket").resolve()
    assert resolved["distributed"]["enabled"] == (render.Slice.parse(name.split("-rl")[0].split("-sft")[0]).hosts > 1)


def test_rollout_slice_must_be_single_host(capsys) -> None:
    assert render.main(["--slice", "v6e-8", *BASE, "--rollout-slice", "v6e-16"]) == 2
    assert "single-host" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_examples_are_current(tmp_path, name) -> None:
    committed = ROOT / "launch" / "gke" / "examples" / name
    out = tmp_path / name
    assert render.main([*EXAMPLES[name], "-o", str(out)]) == 0
    assert committed.read_text() == out.read_text(), f"re-render {committed} (see launch/gke/README.md)"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_kubectl_reads_the_examples(name) -> None:
    """kubectl decodes every example as a Kubernetes object. (`apply --dry-run=client` needs an
    API server for discovery, even with --validate=false; `label --local` does not.)"""
    path = ROOT / "launch" / "gke" / "examples" / name
    out = subprocess.run(
        ["kubectl", "label", "--local", "-f", str(path), "checked=yes", "-o", "json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["kind"] == "JobSet" and obj["metadata"]["labels"] == {"checked": "yes"}


# -- entry point ---------------------------------------------------------------------------


def test_outputs_link_and_resume_detection(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    entrypoint.link_outputs(tmp_path / "bucket" / "run")
    assert Path("outputs").resolve() == (tmp_path / "bucket" / "run").resolve()
    entrypoint.link_outputs(tmp_path / "bucket" / "other")  # a restart re-points the link
    assert Path("outputs").resolve() == (tmp_path / "bucket" / "other").resolve()
    ckpt = tmp_path / "ckpt"
    assert not entrypoint.has_checkpoint(ckpt)
    (ckpt / "3.orbax-checkpoint-tmp-17").mkdir(parents=True)  # an uncommitted save
    assert not entrypoint.has_checkpoint(ckpt)
    (ckpt / "3").mkdir()
    assert entrypoint.has_checkpoint(ckpt)
    out, ck = entrypoint.run_paths(
        ["--config", str(ROOT / "configs/reverse_text/sft.toml"), "--ckpt.dir", str(ckpt)]
    )
    assert (out, ck) == (Path("outputs/reverse_text/sft"), ckpt)


def test_real_outputs_directory_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("outputs").mkdir()
    with pytest.raises(FileExistsError, match="outputs"):
        entrypoint.link_outputs(tmp_path / "bucket")


def test_exit_code_marks_interrupted_runs(tmp_path) -> None:
    assert entrypoint.exit_code(0, tmp_path) == 0  # no result.json
    (tmp_path / "result.json").write_text(json.dumps({"steps": 7, "stopped_by": "SIGTERM"}))
    assert entrypoint.exit_code(0, tmp_path) == entrypoint.EXIT_INTERRUPTED
    assert entrypoint.exit_code(1, tmp_path) == 1
    (tmp_path / "result.json").write_text(json.dumps({"steps": 10, "stopped_by": None}))
    assert entrypoint.exit_code(0, tmp_path) == 0


def test_sigterm_reaches_the_trainer_process(tmp_path) -> None:
    """The pod's SIGTERM goes to PID 1 (the entry point) only; the trainer must get it too."""
    child = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(tmp_path / 'got')!r}).write_text('TERM'), sys.exit(0)))\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).write_text('')\n"
        "time.sleep(60)\n"
    )
    parent = (
        f"import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ep', {str(ROOT / 'launch/gke/entrypoint.py')!r})\n"
        "ep = importlib.util.module_from_spec(spec); spec.loader.exec_module(ep)\n"
        f"sys.exit(ep.run_forwarding_signals([sys.executable, '-c', {child!r}]))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "child never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert (tmp_path / "got").read_text() == "TERM"
    finally:
        if proc.poll() is None:
            proc.kill()




@pytest.mark.parametrize("slice_name", ["v6e-16", "v5p-32"])
@pytest.mark.parametrize("config", ["configs/reverse_text/rl.toml", "configs/qwen3_8b/rl.toml"])
def test_multihost_rl_on_the_embedded_engine_is_colocated_on_the_slice(tmp_path, slice_name, config) -> None:
    """No --rollout-slice: one JobSet of trainer pods, the embedded engine on every chip of the
    slice. Process 0 binds its command socket on every interface at the declared port ``engine``;
    the others dial it at the slice's first host (TPU_WORKER_HOSTNAMES)."""
    m = rendered(tmp_path, ["--slice", slice_name, "--image", IMAGE, "--bucket", "B", "--config", config, "--name", "co"])
    assert list(jobs(m)) == ["trainer"] and "successPolicy" not in m["spec"]  # no rollout servers
    job = jobs(m)["trainer"]
    s = render.Slice.parse(slice_name)
    assert job["replicas"] == 1 and job["template"]["spec"]["parallelism"] == s.hosts > 1
    (c,) = pod(job)["containers"]
    assert {"containerPort": render.ENGINE_PORT, "name": "engine"} in c["ports"]
    ports = [p["containerPort"] for p in c["ports"]]
    assert len(set(ports)) == len(ports) and render.ENGINE_PORT not in (render.WEIGHTS_PORT, render.VLLM_PORT, 8476)
    assert "weights" not in [p["name"] for p in c["ports"]] and render.POD_INDEX_ENV not in c["env"]  # no publisher
    cmd = c["command"]
    flags = {name: cmd[cmd.index(f"--inference.backend.{name}") + 1] for name in ("type", "colocated_host", "colocated_port")}
    assert flags == {"type": "embedded", "colocated_host": "0.0.0.0", "colocated_port": str(render.ENGINE_PORT)}
    assert "--inference.base_url" not in cmd  # no servers: the recipe's embedded engine
    args = train_args(job)
    if "--model.name" in args:
        args[args.index("--model.name") + 1] = str(ROOT / "tests")  # any directory: the fetched weights are not here
    cfg, _ = load_config(args)
    b = cfg.inference.backend
    assert (b.type, b.colocated_host, b.colocated_port) == ("embedded", "0.0.0.0", render.ENGINE_PORT)
    assert cfg.distributed.enabled
    # A single-host slice runs one process: no command socket, nothing declared.
    one = pod(jobs(rendered(tmp_path, ["--slice", "v6e-8", "--image", IMAGE, "--bucket", "B", "--config", config]))["trainer"])
    assert "--inference.backend.colocated_host" not in one["containers"][0]["command"]
    assert "engine" not in [p["name"] for p in one["containers"][0]["ports"]]


def test_colocated_jobset_runs_here_each_process_dialing_process_0(tmp_path) -> None:
    """launch/gke/local.py runs the colocated render as rendered: ``0.0.0.0`` becomes each pod's
    own address (process 0 binds its own), and the others find process 0 as the first of
    TPU_WORKER_HOSTNAMES, at the declared port."""
    m = rendered(tmp_path, ["--slice", "v5p-16", *BASE, "--name", "rt"])
    pods = local.plan(m, "127.9.9")
    assert [p.name for p in pods] == ["rt-trainer-0-0", "rt-trainer-0-1"]
    names = {p.hostname: p.address for p in pods}
    for p in pods:
        cmd = local.pod_command(p, names, Path("/b"), Path("/i"))
        host, port = (cmd[cmd.index(f"--inference.backend.colocated_{f}") + 1] for f in ("host", "port"))
        assert (host, port) == (p.address, str(render.ENGINE_PORT))
        env = local.pod_env(p, names, Path("/b"), Path("/i"))
        assert env["TPU_WORKER_HOSTNAMES"].split(",")[0] == pods[0].address == "127.9.9.2"


@pytest.mark.parametrize(("slice_name", "extra", "message"), [
    # A vLLM the trainer launches runs beside one process: colocated (embedded) or rollout servers.
    ("v5p-32", [], 'type = "embedded"'),
    ("v6e-16", [], "add --rollout-slice v6e-8"),
    ("v5p-32", ["--", "--inference.backend.type=vllm"], "add --rollout-slice"),  # an override too
    # Weight transfer feeds rollout servers: the colocated engine swaps weights in place.
    ("v5p-32", ["--weight-transfer", "direct"], "--weight-transfer direct: it feeds rollout servers; add --rollout-slice"),
])  # fmt: skip
def test_multihost_rl_layouts_that_cannot_run_are_refused_naming_the_fix(tmp_path, capsys, slice_name, extra, message) -> None:
    recipe = tmp_path / "vllm_rl.toml"
    text = (ROOT / "configs/qwen3_8b/rl.toml").read_text()
    recipe.write_text(text.replace('type = "embedded"\ntensor_parallel = 8', 'type = "vllm"'))
    config = str(recipe if not extra else ROOT / "configs/qwen3_8b/rl.toml")
    args = ["--slice", slice_name, "--image", IMAGE, "--bucket", "B", "--config", config]
    assert render.main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    if not extra:
        assert slice_name in err and 'type = "embedded"' in err and "add --rollout-slice" in err
        # ... and with the flag it names, the layout renders (rollout servers: the backend is external).
        m = rendered(tmp_path, [*args, "--rollout-slice", "v6e-8"])
        assert list(jobs(m)) == ["trainer", "rollout"]
        cmd = pod(jobs(m)["trainer"])["containers"][0]["command"]
        assert cmd[cmd.index("--inference.backend") + 1] == "external" and "--inference.backend.colocated_host" not in cmd


def test_multihost_rl_backend_is_checked_at_config_time(monkeypatch) -> None:
    """On the slice the process count is GKE's TPU_WORKER_HOSTNAMES: the check fires while the
    config loads, before jax.distributed or a warm start does any work. The embedded engine runs
    colocated over the processes; a vLLM the trainer launches cannot."""
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "h0,h1,h2,h3")
    args = ["--config", str(ROOT / "configs/reverse_text/rl.toml"), "--distributed.enabled", "true"]
    cfg, _ = load_config(args)
    assert cfg.inference.backend.type == "embedded" and cfg.distributed.expected_processes() == 4
    with pytest.raises(ValueError, match="vllm"):
        load_config([*args, "--inference.backend", "vllm"])
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    assert load_config(args)[0].distributed.expected_processes() == 1


def test_warmstart_resolves_against_the_recipe_from_any_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_config(["--config", str(ROOT / "configs/reverse_text/rl.toml")])
    assert Path(cfg.warmstart.config) == ROOT / "configs/reverse_text/sft.toml"
    assert cfg.warmstart_export() == Path("outputs/reverse_text/sft/hf")  # outputs stay relative to the run


def test_a_hub_model_is_fetched_once_and_every_wait_has_a_deadline(tmp_path) -> None:
    m = rendered(tmp_path, ["--slice", "v5p-32", "--image", IMAGE, "--bucket", "B", "--config",
                            "configs/qwen3_8b/rl.toml", "--name", "q8", "--rollout-slice", "v6e-8",
                            "--hf-token-secret", "hf", "--extra-pip", "/data/wheels/my_env-0.1-py3-none-any.whl"])  # fmt: skip
    trainer = pod(jobs(m)["trainer"])["containers"][0]
    cmd = trainer["command"]
    assert cmd[cmd.index("--fetch") + 1] == "Qwen/Qwen3-8B" and cmd[cmd.index("--fetch-to") + 1] == "/data/q8/model"
    assert cmd[cmd.index("--model.name") + 1] == "/data/q8/model"
    assert cmd[cmd.index("--pip") + 1] == "/data/wheels/my_env-0.1-py3-none-any.whl"
    assert trainer["env"] == [
        {"name": "JAX_COMPILATION_CACHE_DIR", "value": "/data/q8/jax_cache"},  # restarts skip compiles
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]
    serve = pod(jobs(m)["rollout"])["containers"][0]["command"][-1]
    assert "until [ -f /data/q8/model/.jaxrl-fetched.json ]" in serve and "SECONDS + 3600" in serve
    assert "exit 1" in serve and "vllm serve /data/q8/model " in serve
    # The trainer's command, entry point flags removed, is a valid run of the fetched model.
    args = train_args(jobs(m)["trainer"])
    args[args.index("--model.name") + 1] = str(ROOT / "tests")  # any directory: the fetched weights are not here
    cfg, _ = load_config(args)
    assert cfg.inference.backend.type == "external"


def test_a_model_no_pod_can_read_is_refused(tmp_path, capsys) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text((ROOT / "configs/qwen3_8b/rl.toml").read_text().replace('"Qwen/Qwen3-8B"', '"./models/Qwen3-8B"'))
    assert render.main(["--slice", "v6e-8", "--image", IMAGE, "--bucket", "B", "--config", str(recipe)]) == 2
    assert "add --model ORG/NAME" in capsys.readouterr().err


def test_fetch_copies_a_hub_snapshot_once_and_waiters_time_out_naming_it(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "hub" / "models--org--tiny"
    snap = cache / "snapshots" / ("1" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"x" * 10)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text("1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    dest = tmp_path / "bucket" / "model"
    monkeypatch.setattr(entrypoint, "WAIT_POLL_S", 0.05)
    with pytest.raises(TimeoutError, match=r"org/tiny .* not there after 0.2 s"):
        entrypoint.wait_for(dest / entrypoint.FETCHED_MARKER, 0.2, "org/tiny (fetched by process 0)")
    entrypoint.fetch_weights("org/tiny", dest, None)
    assert (dest / "model.safetensors").read_bytes() == b"x" * 10
    assert json.loads((dest / entrypoint.FETCHED_MARKER).read_text())["source"] == "org/tiny"
    (dest / "model.safetensors").write_bytes(b"y")
    entrypoint.fetch_weights("org/tiny", dest, None)  # a restart: already there, not fetched again
    assert (dest / "model.safetensors").read_bytes() == b"y"
    with pytest.raises(FileExistsError, match="new --name"):
        entrypoint.fetch_weights("org/other", dest, None)
    entrypoint.wait_for(dest / entrypoint.FETCHED_MARKER, 0.2, "org/tiny")


def test_local_runner_maps_names_mounts_and_the_failure_policy(tmp_path) -> None:
    m = rendered(tmp_path, ["--slice", "v5p-16", *BASE, "--name", "rt", "--rollout-slice", "v5e-1",
                            "--rollout-replicas", "2", "--rollout-server", "jaxrl"])  # fmt: skip
    pods = local.plan(m, "127.9.9")
    assert [(p.name, p.address, p.chips, p.peers) for p in pods] == [
        ("rt-trainer-0-0", "127.9.9.2", 4, ["127.9.9.2", "127.9.9.3"]),
        ("rt-trainer-0-1", "127.9.9.3", 4, ["127.9.9.2", "127.9.9.3"]),
        ("rt-rollout-0-0", "127.9.9.4", 1, ["127.9.9.4"]),
        ("rt-rollout-1-0", "127.9.9.5", 1, ["127.9.9.5"]),
    ]
    names = {p.hostname: p.address for p in pods}
    text = local.translate('["http://rt-rollout-1-0.rt:8000/v1"] /data/rt --host 0.0.0.0 /app/x /database',
                           pods[2], names, Path("/b"), Path("/i"))  # fmt: skip
    assert text == '["http://127.9.9.5:8000/v1"] /b/rt --host 127.9.9.4 /i/x /database'
    env = local.pod_env(pods[1], names, Path("/b"), Path("/i"))
    assert (env["TPU_WORKER_ID"], env["TPU_WORKER_HOSTNAMES"]) == ("1", "127.9.9.2,127.9.9.3")
    assert env["XLA_FLAGS"].endswith("=4") and env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.9.9.3:8476"
    assert local.failure_reason(pods[0], 75) == "PodFailurePolicy"  # preempted: a free restart
    assert local.failure_reason(pods[0], 1) == "BackoffLimitExceeded"  # counted against maxRestarts
    assert local.failure_reason(pods[2], 75) == "BackoffLimitExceeded"  # the rule names the trainer container
    # Direct transfer: each trainer pod binds its publisher on its own address and advertises its
    # own DNS name (Kubernetes expands $(JOB_COMPLETION_INDEX) from the declared fieldRef).
    cmd = local.pod_command(pods[1], names, Path("/b"), Path("/i"))
    flag = lambda name: cmd[cmd.index(f"--inference.backend.{name}") + 1]  # noqa: E731
    assert (flag("weight_transfer_host"), flag("weight_transfer_port"), flag("weight_transfer_advertise")) == (
        "127.9.9.3", "8477", "127.9.9.3")  # fmt: skip
    assert local.expand("a-$(JOB_COMPLETION_INDEX).b $$(X) $(UNSET)", {"JOB_COMPLETION_INDEX": "1"}) == "a-1.b $(X) $(UNSET)"
    fields = local.pod_fields(pods[3])
    assert fields["metadata.annotations['batch.kubernetes.io/job-completion-index']"] == "0"
    assert fields["metadata.labels['jobset.sigs.k8s.io/job-index']"] == "1" and fields["status.podIP"] == "127.9.9.5"


def test_a_user_package_that_does_not_install_stops_the_pod_naming_it(tmp_path) -> None:
    missing = tmp_path / "my_env-0.1-py3-none-any.whl"
    with pytest.raises(RuntimeError, match=f"--pip {missing}: pip install failed"):
        entrypoint.pip_install([str(missing)])


@pytest.mark.parametrize("server", ["vllm", "jaxrl"])
def test_rollout_servers_return_routed_experts_when_the_trainer_replays_routing(tmp_path, server) -> None:
    """A trainer replaying MoE routing needs each token's experts from its rollout servers: the
    rendered vLLM servers get ``--enable-return-routed-experts`` and jaxrl.serve servers
    ``inference.server.return_routed_experts`` (which they cannot infer: they read no ``[trainer]``);
    without replay neither is rendered."""
    common = ["--slice", "v6e-16", *BASE, "--rollout-slice", "v6e-8", "--rollout-server", server]
    flag = "--enable-return-routed-experts" if server == "vllm" else "--inference.server.return_routed_experts true"
    for extra, expected in (([], False), (["--", "--trainer.moe_routing", "replay"], True),
                            (["--", "--trainer.moe-routing=replay"], True),
                            (["--", "--trainer.moe_routing", "recompute"], False)):
        command = pod(jobs(rendered(tmp_path, [*common, *extra]))["rollout"])["containers"][0]["command"][-1]
        assert (flag in command) == expected, (extra, command)

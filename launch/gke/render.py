"""Render a GKE JobSet manifest for a jaxrl run on a TPU v5e / v6e / v5p slice.

    python launch/gke/render.py --slice v6e-16 --image IMAGE --bucket BUCKET \\
        --config configs/reverse_text/rl.toml [--rollout-slice v6e-8 --rollout-replicas 2 \\
        [--rollout-server jaxrl] [--weight-transfer files]] \\
        [--model ORG/NAME | gs://...] [--hf-token-secret hf] [--extra-pip SPEC] \\
        [-o jobset.yaml] [-- --trainer.steps 100 ...]

One replicated Job ("trainer") runs ``launch/gke/entrypoint.py`` - i.e. ``python -m
jaxrl.train --config ... --distributed.enabled true`` - on every host of the slice; JAX finds
its peers from the TPU_WORKER_* variables GKE injects. RL on the embedded engine (the recipes'
default) with no ``--rollout-slice`` is colocated, also on a multi-host slice: the engine runs
on every chip of the trainer's slice, process 0 scheduling and sending each device call to the
other processes over its command socket (``inference.backend.colocated_host`` 0.0.0.0, port
``ENGINE_PORT``, declared as the port named ``engine``; the others dial the slice's first host
from TPU_WORKER_HOSTNAMES), and weights change hands in place. With ``--rollout-slice`` a second
replicated Job ("rollout") runs vllm-tpu (or ``jaxrl.serve``) servers, one per single-host slice,
and the trainer spreads its rollouts over all of them as external servers, giving each every new
version: jaxrl.serve servers pull it straight from every trainer pod (``--weight-transfer direct``,
their default: each trainer process publishes on port ``WEIGHTS_PORT`` of its pod, advertised by
its JobSet DNS name), vLLM servers load it from files on the bucket (see launch/gke/README.md).
Everything a run writes lands in the bucket, mounted at /data by the GCS FUSE CSI driver.

Only layouts that can run are rendered: RL on a multi-host slice samples from the embedded
engine (colocated) or from rollout servers (``--rollout-slice``), never from a vLLM the trainer
launches (``backend = "vllm"``, one process), ``--weight-transfer`` needs ``--rollout-slice``, and
the starting weights must be readable by every pod (a hub id or ``gs://`` path is fetched once
per run into the bucket by trainer process 0; everything else waits for it with a deadline).
``launch/gke/local.py`` runs the rendered manifest on one machine.

Only the standard library and PyYAML: the renderer runs wherever kubectl does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DATA = "/data"  # the bucket's mount point in every container
APP = "/app"  # the repository inside the image (launch/gke/Dockerfile)
VLLM_PORT = 8000
# Each trainer process's weight publisher (direct transfer): the rollout servers pull every
# version from this port of every trainer pod (``inference.backend.weight_transfer_port``).
WEIGHTS_PORT = 8477
# Colocated RL (the embedded engine on a multi-host trainer slice): process 0's command socket,
# which every other trainer process dials (``inference.backend.colocated_port``).
ENGINE_PORT = 8478
# The pod's index in its Job, as Kubernetes sets it on an Indexed Job's pods (JobSet's Jobs are
# Indexed); declared in the container's env so that ``$(JOB_COMPLETION_INDEX)`` in its command
# expands to it, which makes each trainer process's own DNS name.
POD_INDEX_ENV = {
    "name": "JOB_COMPLETION_INDEX",
    "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}},
}
# The vllm-tpu release the rollout servers run: pinned (never `latest`), and the vLLM release
# whose RL routes (pause / reload_weights / update_weight_version) and `--enable-scale-out`
# generate API jaxrl's weight sync is tested against (the CPU build of the same release).
VLLM_TPU_IMAGE = "vllm/vllm-tpu:v0.32.0"
TRAINER_CONTAINER = "jaxrl"
EXIT_INTERRUPTED = 75  # launch/gke/entrypoint.py: stopped by SIGTERM after a checkpoint; run again to resume
FETCHED_MARKER = ".jaxrl-fetched.json"  # launch/gke/entrypoint.py writes it last, once the weights are complete
WAIT_POLL_S = 5

# GKE node-selector value per TPU generation.
ACCELERATORS = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice", "v5p": "tpu-v5p-slice"}
# GKE machine type per (generation, chips per host). A topology can come in two VM shapes
# (v5e/v6e 2x4: one 8-chip VM, or two 4-chip VMs), so the node selector names the machine type
# too: without it a 2x4 pod asking for 8 chips could be scheduled on nothing, or the pool
# chosen could be the multi-host one.
MACHINE_TYPES = {
    ("v5e", 1): "ct5lp-hightpu-1t", ("v5e", 4): "ct5lp-hightpu-4t", ("v5e", 8): "ct5lp-hightpu-8t",
    ("v6e", 1): "ct6e-standard-1t", ("v6e", 4): "ct6e-standard-4t", ("v6e", 8): "ct6e-standard-8t",
    ("v5p", 4): "ct5p-hightpu-4t",
}  # fmt: skip
# chips -> (topology, chips per host). v5e and v6e share shapes; above 8 chips every host has 4.
SHAPES = {
    1: ("1x1", 1),
    4: ("2x2", 4),
    8: ("2x4", 8),
    16: ("4x4", 4),
    32: ("4x8", 4),
    64: ("8x8", 4),
    128: ("8x16", 4),
    256: ("16x16", 4),
}

# v5p slices are named by TensorCores (two per chip: v5p-32 is 16 chips, 4 hosts) and shaped in
# 3D; every host has 4 chips. TensorCores -> topology.
V5P_SHAPES = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8"}


@dataclass(frozen=True)
class Slice:
    """A TPU slice shape, e.g. ``Slice.parse("v5e-16")``: 16 chips, topology 4x4, 4 hosts."""

    name: str
    accelerator: str
    topology: str
    chips: int
    chips_per_host: int
    machine_type: str

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @classmethod
    def parse(cls, name: str) -> Slice:
        gen, _, n = name.partition("-")
        shapes = {c: (t, 4) for c, t in V5P_SHAPES.items()} if gen == "v5p" else SHAPES
        if gen not in ACCELERATORS or not n.isdigit() or int(n) not in shapes:
            supported = ", ".join(f"{g}-{c}" for g in ACCELERATORS for c in (V5P_SHAPES if g == "v5p" else SHAPES))
            raise ValueError(f"--slice {name!r}: expected one of {supported}")
        topology, per_host = shapes[int(n)]
        chips = int(n) // 2 if gen == "v5p" else int(n)
        return cls(name, ACCELERATORS[gen], topology, chips, per_host, MACHINE_TYPES[gen, per_host])


def tpu_pod_spec(
    s: Slice, container: dict[str, Any], service_account: str | None, bucket: str
) -> dict[str, Any]:
    """Pod template for one host of slice ``s``: TPU node selectors, chips, the bucket at /data."""
    container = {
        **container,
        "resources": {
            "requests": {"google.com/tpu": s.chips_per_host},
            "limits": {"google.com/tpu": s.chips_per_host},
        },
        "volumeMounts": [{"name": "data", "mountPath": DATA}],
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": s.accelerator,
            "cloud.google.com/gke-tpu-topology": s.topology,
            "node.kubernetes.io/instance-type": s.machine_type,
        },
        "containers": [container],
        "volumes": [
            {
                "name": "data",
                "csi": {
                    "driver": "gcsfuse.csi.storage.gke.io",
                    "volumeAttributes": {"bucketName": bucket, "mountOptions": "implicit-dirs"},
                },
            }
        ],
        "terminationGracePeriodSeconds": 120,  # SIGTERM -> checkpoint -> exit (jaxrl.preemption)
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return {"metadata": {"annotations": {"gke-gcsfuse/volumes": "true"}}, "spec": spec}


def replicated_job(name: str, s: Slice, pod: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    """``replicas`` Jobs, each one whole slice: one pod per host, all started together.

    A preempted attempt (the entry point's exit 75 after its checkpoint, or a pod the node's
    maintenance or a spot reclaim evicted: condition DisruptionTarget) fails its Job with reason
    ``PodFailurePolicy``; the JobSet's failure policy restarts everything for that reason
    without counting it against ``maxRestarts`` (``restart_policy``), which is left for real
    failures (backoffLimit 0: any other exit fails the Job, and the JobSet restarts it counted)."""
    on_preemption: list[dict[str, Any]] = [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    ]
    if (container := pod["spec"]["containers"][0]["name"]) == TRAINER_CONTAINER:  # vLLM has no such exit
        on_preemption.append(
            {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In", "values": [EXIT_INTERRUPTED]}}
        )  # fmt: skip
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            "spec": {
                "parallelism": s.hosts, "completions": s.hosts, "backoffLimit": 0,
                "podFailurePolicy": {"rules": on_preemption}, "template": pod,
            }
        },
    }  # fmt: skip


def restart_policy(max_restarts: int) -> dict[str, Any]:
    """JobSet ``failurePolicy`` (JobSet >= 0.6): preemptions restart for free, failures count."""
    return {
        "maxRestarts": max_restarts,
        "rules": [
            {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]}
        ],
    }  # fmt: skip


def read_recipe(config: str) -> dict[str, Any]:
    """The recipe TOML; a relative ``[warmstart] config`` made absolute against the recipe's own
    directory, as ``jaxrl.cli.load_config`` does."""
    path = Path(config) if Path(config).is_absolute() else REPO / config
    if not path.exists():
        raise FileNotFoundError(
            f"--config {config}: no such recipe (paths are relative to the repository root)"
        )
    recipe = tomllib.loads(path.read_text())
    warm = recipe.get("warmstart", {})
    if isinstance(warm.get("config"), str) and not Path(warm["config"]).is_absolute():
        recipe["warmstart"] = {**warm, "config": str((path.parent / warm["config"]).resolve())}
    return recipe


def is_hub_id(name: str) -> bool:
    """``org/name`` (a Hugging Face hub id), as jaxrl's config tells one from a path."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not Path(REPO, name).exists()


def warmstart_output(recipe: dict[str, Any]) -> str | None:
    """The warm start recipe's ``output_dir`` when the recipe's ``[model] name`` is its export."""
    warm = recipe.get("warmstart", {}).get("config")
    if not warm:
        return None
    out = read_recipe(warm).get("output_dir", "outputs/run")
    return out if recipe.get("model", {}).get("name") == f"{out}/hf" else None


@dataclass(frozen=True)
class Weights:
    """Where the run's starting weights come from and how every pod knows they are there.

    ``source``: a hub id or ``gs://`` path fetched once into ``path`` on the bucket by trainer
    process 0 (the others and the rollout servers wait for ``ready`` with a deadline); None
    when the trainer makes them itself (a ``[warmstart]`` export) or a scratch model is trained."""

    source: str | None
    path: str | None  # the model directory as every pod sees it (None: a scratch model, no rollout server)
    ready: str | None  # shell test that is true once the weights are complete
    what: str  # for the waiting message


def run_weights(args: argparse.Namespace, recipe: dict[str, Any]) -> Weights:
    """The weights the rendered job starts from; refuses a ``[model] name`` no pod could read."""
    name = recipe.get("model", {}).get("name")
    source = args.model or (name if name and is_hub_id(name) else None)
    if source:
        if warmstart_output(recipe) and args.model:
            raise ValueError(
                f"--model {args.model}: the recipe's [model] name is its [warmstart] export; drop --model "
                "or the recipe's [warmstart]"
            )
        if not (source.startswith("gs://") or is_hub_id(source)):
            raise ValueError(f"--model {source}: expected a Hugging Face hub id (org/name) or a gs:// path")
        dest = f"{DATA}/{args.name}/model"
        return Weights(source, dest, f"[ -f {dest}/{FETCHED_MARKER} ]", f"{source} (fetched into {dest} by trainer process 0)")
    if warm_out := warmstart_output(recipe):
        model = rollout_model_path(recipe, args.name)
        result = f"{DATA}/{args.name}/{Path(warm_out).relative_to('outputs')}/result.json"
        # result.json names the export only once the warm start finished it (an interrupted one has none).
        return Weights(None, model, f"grep -qs '\"export\"' {result}", f"the warm start's export {model}")
    if name is None:
        return Weights(None, None, None, "a scratch model")
    if Path(name).is_absolute():
        return Weights(None, name, f"[ -f {name}/config.json ]", name)
    raise ValueError(
        f"[model] name = {name!r} is in neither the image nor the bucket; add --model ORG/NAME (a hub id) or "
        "--model gs://BUCKET/DIR: fetched once into the bucket for every pod"
    )


def wait_script(weights: Weights, timeout_s: int) -> str:
    """Bash that waits for ``weights`` with a deadline, saying what it waits for."""
    return (
        f"deadline=$((SECONDS + {timeout_s})); until {weights.ready}; do "
        f"if [ $SECONDS -ge $deadline ]; then echo \"error: {weights.what} not there after {timeout_s} s "
        f"(--wait-timeout-s); see the trainer's log\" >&2; exit 1; fi; "
        f"echo \"waiting for {weights.what}\"; sleep {WAIT_POLL_S}; done; "
    )


def rollout_model_path(recipe: dict[str, Any], run: str) -> str:
    """Where vLLM finds the policy: the run's ``[model] name``, as seen under the bucket mount
    (the entrypoint links the image's ``outputs/`` to ``/data/<run>``)."""
    name = recipe.get("model", {}).get("name")
    if not name:
        raise ValueError("the recipe's [model] name is unset; give the served model with --rollout-model")
    p = Path(name)
    if p.is_absolute():
        return name
    if p.parts[0] != "outputs":
        raise ValueError(f"the recipe's [model] name = {name!r} is not under outputs/; give --rollout-model")
    return str(Path(DATA, run, *p.parts[1:]))


def compile_cache(args: argparse.Namespace) -> dict[str, str]:
    """JAX's persistent compilation cache on the bucket: a restarted pod (preemption, failure)
    loads its programs instead of compiling them again (minutes for an 8B train step)."""
    return {"name": "JAX_COMPILATION_CACHE_DIR", "value": f"{DATA}/{args.name}/jax_cache"}


def trainer_container(
    args: argparse.Namespace, s: Slice, weights: Weights, overrides: list[str], direct: bool, colocated: bool = False
) -> dict[str, Any]:
    """The entry point on every host of the trainer slice. ``direct``: each process publishes
    its weights on ``WEIGHTS_PORT`` (declared as the port named ``weights``) and advertises its
    pod's JobSet DNS name, ``<jobset>-trainer-0-<i>.<jobset>``, for the rollout servers to dial.
    ``colocated``: the embedded engine spans the slice; process 0 listens for the others' command
    connections on ``ENGINE_PORT`` (declared as the port named ``engine``; the flags are in
    ``overrides``)."""
    # Multi-host: JAX's multi-controller runtime, its peers read from GKE's TPU_WORKER_* variables.
    dist = ["--distributed.enabled", "true"] if s.hosts > 1 else []
    fetch = ["--fetch", weights.source, "--fetch-to", weights.path] if weights.source else []
    if fetch and args.model_revision:
        fetch += ["--fetch-revision", args.model_revision]
    model = ["--model.name", weights.path] if weights.source else []
    command = [
        "python",
        f"{APP}/launch/gke/entrypoint.py",
        "--output-root",
        f"{DATA}/{args.name}",
        *fetch,
        *[a for spec in args.extra_pip for a in ("--pip", spec)],
        "--wait-timeout-s",
        str(args.wait_timeout_s),
        "--config",
        args.config,
        *dist,
        *model,
        *overrides,
    ]
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": args.image,
        "workingDir": APP,
        "command": command,
        "env": [compile_cache(args)],
        "ports": [
            {"containerPort": 8471, "name": "tpu-runtime"},
            {"containerPort": 8476, "name": "jax-coord"},
        ],
    }
    if direct:
        container["env"].append(POD_INDEX_ENV)
        container["ports"].append({"containerPort": WEIGHTS_PORT, "name": "weights"})
    if colocated:
        container["ports"].append({"containerPort": ENGINE_PORT, "name": "engine"})
    if args.hf_token_secret:  # a gated or private hub model: the token from a Kubernetes secret
        secret, _, key = args.hf_token_secret.partition(":")
        container["env"].append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": key or "token"}}}
        )
    return container


def _presets() -> Any:
    """jaxrl/models/presets.py loaded by path: importing the jaxrl package would import JAX, and
    the renderer runs wherever kubectl does (standard library + PyYAML)."""
    spec = importlib.util.spec_from_file_location("jaxrl_presets", REPO / "jaxrl" / "models" / "presets.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def model_heads(recipe: dict[str, Any]) -> tuple[int, int] | None:
    """(attention heads, KV heads) of the model a recipe trains: its ``[model.scratch]``, the
    ``config.json`` of a local ``[model] name``, a released checkpoint's preset (``Qwen3-8B``),
    or else what its ``[warmstart]`` recipe trains; None when none of them says."""
    model = recipe.get("model", {})
    if scratch := model.get("scratch"):
        return scratch["num_heads"], scratch.get("num_kv_heads", scratch["num_heads"])
    if name := model.get("name"):
        config = (Path(name) if Path(name).is_absolute() else REPO / name) / "config.json"
        if config.exists():
            hf = json.loads(config.read_text())
            return hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
        if heads := _presets().preset_heads(name):
            return heads
    if warm := recipe.get("warmstart", {}).get("config"):
        return model_heads(read_recipe(warm))
    return None


def tensor_parallel(heads: int, kv_heads: int, chips: int) -> int:
    """The largest tensor-parallel size vLLM accepts on ``chips``: it divides the chips and the
    attention heads, and either divides the KV heads or is a multiple of them (vLLM then
    replicates each KV head)."""
    return max(
        d for d in range(1, chips + 1)
        if chips % d == 0 and heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    )  # fmt: skip


def rollout_tensor_parallel(args: argparse.Namespace, recipe: dict[str, Any], s: Slice) -> int:
    heads = model_heads(recipe)
    if args.rollout_tensor_parallel:
        tp = args.rollout_tensor_parallel
        if s.chips_per_host % tp or (heads and tensor_parallel(*heads, tp) != tp):
            raise ValueError(
                f"--rollout-tensor-parallel {tp}: must divide the {s.chips_per_host} chips of {s.name}"
                + (f" and fit {heads[0]} heads / {heads[1]} KV heads" if heads else "")
            )
        return tp
    if heads is None:
        raise ValueError("cannot tell the model's head counts from the recipe; give --rollout-tensor-parallel")
    tp = tensor_parallel(*heads, s.chips_per_host)
    if tp < s.chips_per_host:
        print(
            f"note: rollout tensor parallel {tp} of {s.chips_per_host} chips per server ({heads[0]} heads, "
            f"{heads[1]} KV heads); the other chips of each rollout slice stay idle",
            file=sys.stderr,
        )
    return tp


def replays_routing(recipe: dict[str, Any], overrides: list[str]) -> bool:
    """Whether the run's trainer replays MoE routing (``trainer.moe_routing = "replay"``, in the
    recipe or an override): its rollout servers must then return each token's experts."""
    value = recipe.get("trainer", {}).get("moe_routing")
    for i, arg in enumerate(overrides):
        flag, eq, given = arg.partition("=")
        if flag.replace("-", "_") == "__trainer.moe_routing":
            value = given if eq else (overrides[i + 1] if i + 1 < len(overrides) else None)
    return value == "replay"


def rollout_container(
    args: argparse.Namespace, weights: Weights, max_len: int, tp: int, replay: bool = False
) -> dict[str, Any]:
    """One rollout server: it waits (with a deadline) for the weights it serves, then serves them
    on port ``VLLM_PORT``: vllm-tpu, or ``python -m jaxrl.serve`` (``--rollout-server jaxrl``)
    reading the recipe's ``[model]`` / ``[inference]`` sections (the embedded engine's settings in
    ``[inference.backend]`` included), as the trainer does. ``replay`` (the trainer replays MoE
    routing): every answer carries the experts each token used (vLLM's
    ``--enable-return-routed-experts``; jaxrl.serve's ``inference.server.return_routed_experts``,
    which it does not infer from the ``[trainer]`` section it never reads)."""
    model = weights.path
    if args.rollout_server == "jaxrl":
        serve = shlex.join([
            "python", "-m", "jaxrl.serve", "--config", args.config, "--model.name", model,
            "--inference.backend", "embedded", "--inference.max_model_len", str(max_len),
            "--inference.backend.tensor_parallel", str(tp),
            "--inference.server.host", "0.0.0.0", "--inference.server.port", str(VLLM_PORT),
            *(["--inference.server.return_routed_experts", "true"] if replay else []),
        ])  # fmt: skip
        image: dict[str, Any] = {"image": args.image, "workingDir": APP}
        env: list[dict[str, str]] = [compile_cache(args)]
    else:
        # --logprobs-mode processed_logprobs: log-probs of logits / temperature, what the trainer's
        # loss compares against (vLLM's default is the raw distribution's).
        serve = (
            f"vllm serve {model} --host 0.0.0.0 --port {VLLM_PORT} --tensor-parallel-size {tp} "
            f"--max-model-len {max_len} --enable-scale-out --return-tokens-as-token-ids "
            f"--logprobs-mode processed_logprobs" + (" --enable-return-routed-experts" if replay else "")
        )
        image = {"image": args.rollout_image}
        env = [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}]
    return {
        "name": "rollout",
        **image,
        "command": ["bash", "-c", wait_script(weights, args.wait_timeout_s) + "exec " + serve],
        **({"env": env} if env else {}),
        "ports": [{"containerPort": VLLM_PORT, "name": "http"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": VLLM_PORT}, "periodSeconds": 10},
    }


def trainer_host(name: str) -> str:
    """Each trainer pod's own DNS name (JobSet's ``<jobset>-<job>-<job index>-<pod index>.<jobset>``),
    its pod index written ``$(JOB_COMPLETION_INDEX)`` for Kubernetes to expand in the command."""
    return f"{name}-trainer-0-$(JOB_COMPLETION_INDEX).{name}"


def weight_transfer_args(args: argparse.Namespace) -> list[str]:
    """How the trainer gives the rollout servers each version: ``direct`` (every trainer process
    publishes its shards on ``WEIGHTS_PORT`` of its pod; jaxrl.serve servers pull them) or
    ``files`` (safetensors on the bucket mount, which the servers read at the same path: the
    fallback, and always for vLLM, whose tpu-inference ``update_weights`` ignores an external trainer)."""
    if args.weight_transfer == "direct":
        return [
            "--inference.backend.weight_transfer", "direct",
            "--inference.backend.weight_transfer_host", "0.0.0.0",
            "--inference.backend.weight_transfer_port", str(WEIGHTS_PORT),
            "--inference.backend.weight_transfer_advertise", trainer_host(args.name),
        ]  # fmt: skip
    return [
        "--inference.backend.weight_transfer", "files",
        "--inference.backend.weights_dir", f"{DATA}/{args.name}/rollout_weights",
    ]  # fmt: skip


def rollout_url(name: str, index: int) -> str:
    """Stable DNS name JobSet gives rollout server ``index`` (pod 0 of rollout Job ``index``)."""
    return f"http://{name}-rollout-{index}-0.{name}:{VLLM_PORT}/v1"


def rollout_backend(recipe: dict[str, Any], overrides: list[str]) -> str:
    """The run's ``[inference.backend]`` type: the recipe's (the table's ``type`` or the name
    itself, default "embedded"), unless an override (``--inference.backend X`` or
    ``--inference.backend.type X``) sets it."""
    backend = recipe.get("inference", {}).get("backend", "embedded")
    backend = backend.get("type", "embedded") if isinstance(backend, dict) else backend  # the table or its name
    for i, arg in enumerate(overrides):
        flag, eq, given = arg.partition("=")
        if flag.replace("-", "_") in ("__inference.backend", "__inference.backend.type"):
            backend = given if eq else (overrides[i + 1] if i + 1 < len(overrides) else backend)
    return backend


def is_colocated(args: argparse.Namespace, recipe: dict[str, Any], train: Slice, overrides: list[str]) -> bool:
    """RL on the embedded engine across a multi-host trainer slice (no rollout servers)."""
    return ("orchestrator" in recipe and train.hosts > 1 and not args.rollout_slice
            and rollout_backend(recipe, overrides) == "embedded")  # fmt: skip


def colocated_args() -> list[str]:
    """The colocated engine's command socket: process 0 binds every interface at ``ENGINE_PORT``
    (the pod's declared port), which the other processes dial at the slice's first host. The
    backend is named too: a recipe that leaves it to the default has no backend table for the
    socket's fields to join."""
    return [
        "--inference.backend.type", "embedded",
        "--inference.backend.colocated_host", "0.0.0.0",
        "--inference.backend.colocated_port", str(ENGINE_PORT),
    ]  # fmt: skip


def check_runnable(args: argparse.Namespace, recipe: dict[str, Any], train: Slice, overrides: list[str]) -> None:
    """Refuse a layout that cannot run, naming the flag that makes it run."""
    backend = rollout_backend(recipe, overrides)
    if "orchestrator" in recipe and train.hosts > 1 and not args.rollout_slice and backend == "vllm":
        raise ValueError(
            f'--slice {train.name} has {train.hosts} hosts, and the vllm backend (a vLLM server the trainer launches) '
            'runs in one process: set [inference.backend] type = "embedded" (the engine colocated on the slice), '
            "or add --rollout-slice v6e-8 (and --rollout-replicas N) for rollout servers on their own slices"
        )
    if args.rollout_slice and "orchestrator" not in recipe:
        raise ValueError(f"--rollout-slice: {args.config} is not an RL recipe (no [orchestrator]); drop --rollout-slice")
    if args.weight_transfer == "direct" and args.rollout_server == "vllm":
        raise ValueError(
            "--weight-transfer direct: vLLM servers load weights from files (tpu-inference's update_weights "
            "ignores an external trainer); drop --weight-transfer or add --rollout-server jaxrl"
        )


def render(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """The JobSet (as a dict) for ``args``; ``overrides`` are extra ``jaxrl.train`` arguments."""
    train = Slice.parse(args.slice)
    recipe = read_recipe(args.config)
    check_runnable(args, recipe, train, overrides)
    colocated = is_colocated(args, recipe, train, overrides)
    if colocated:  # before the user's overrides, which may still change them
        overrides = [*colocated_args(), *overrides]
    weights = run_weights(args, recipe)
    jobs = []
    spec: dict[str, Any] = {
        "failurePolicy": restart_policy(args.max_restarts),
        "network": {"enableDNSHostnames": True},
    }
    if args.rollout_slice:
        roll = Slice.parse(args.rollout_slice)
        if roll.hosts != 1:
            raise ValueError(
                f"--rollout-slice {roll.name}: one rollout server per single-host slice (<= 8 chips)"
            )
        if weights.path is None:
            raise ValueError("the recipe trains a scratch model: rollout servers need a [model] name or --model")
        if args.rollout_model:
            weights = Weights(None, args.rollout_model, f"[ -f {args.rollout_model}/config.json ]", args.rollout_model)
        max_len = args.rollout_max_model_len or recipe.get("inference", {}).get("max_model_len")
        if not max_len:
            raise ValueError("the recipe has no [inference] max_model_len; give --rollout-max-model-len")
        urls = [rollout_url(args.name, i) for i in range(args.rollout_replicas)]
        overrides = [
            "--inference.backend", "external",
            "--inference.base_url", urls[0] if len(urls) == 1 else json.dumps(urls),  # every server
            "--inference.backend.server", args.rollout_server,
            *weight_transfer_args(args),
            # The servers start after the weights exist, then load and compile them.
            "--inference.backend.startup_timeout_s", str(args.wait_timeout_s),
            *overrides,
        ]  # fmt: skip
        tp = rollout_tensor_parallel(args, recipe, roll)
        replay = replays_routing(recipe, overrides)
        pod = tpu_pod_spec(roll, rollout_container(args, weights, max_len, tp, replay), args.service_account, args.bucket)
        jobs.append(replicated_job("rollout", roll, pod, replicas=args.rollout_replicas))
        # The run is over when the trainer is; the servers are then torn down with the JobSet.
        spec["successPolicy"] = {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    direct = bool(args.rollout_slice) and args.weight_transfer == "direct"
    pod = tpu_pod_spec(train, trainer_container(args, train, run_weights(args, recipe), overrides, direct, colocated),
                       args.service_account, args.bucket)  # fmt: skip
    jobs.insert(0, replicated_job("trainer", train, pod))
    spec["replicatedJobs"] = jobs
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": args.name,
            # One Job per node pool: a Job's pods fill exactly one slice, never two half slices.
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": spec,
    }


class _Help(argparse.RawDescriptionHelpFormatter):
    """``--help`` keeps the description's line breaks and shows each flag's default (where it has
    one its help does not already explain)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in help or not action.option_strings:
            return help
        return f"{help} (default: %(default)s)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_Help
    )
    p.add_argument("--slice", required=True, help="trainer slice, e.g. v5e-16 or v6e-8")
    p.add_argument("--image", required=True, help="jaxrl image (launch/gke/Dockerfile)")
    p.add_argument("--bucket", required=True, help="GCS bucket (name only) mounted at /data for all outputs")
    p.add_argument(
        "--config", required=True, help="recipe path inside the image, e.g. configs/reverse_text/rl.toml"
    )
    p.add_argument("--name", default="jaxrl", help="JobSet name; also the run's directory in the bucket")
    p.add_argument(
        "--service-account", default=None, help="Kubernetes service account with access to the bucket"
    )
    p.add_argument("--max-restarts", type=int, default=3, help="JobSet restarts (after preemption: resumes)")
    p.add_argument(
        "--rollout-slice", default=None,
        help="disaggregated: rollout servers on their own slices (default for RL: the embedded engine "
        "colocated on the trainer's slice)",
    )  # fmt: skip
    p.add_argument("--rollout-replicas", type=int, default=1, help="vLLM servers (one slice each)")
    p.add_argument("--rollout-image", default=VLLM_TPU_IMAGE, help="vLLM server image")
    p.add_argument(
        "--rollout-tensor-parallel", type=int, default=None,
        help="chips per vLLM server (default: the most that the model's head counts allow)",
    )  # fmt: skip
    p.add_argument(
        "--rollout-model", default=None, help="model dir the servers load (default: from the config)"
    )
    p.add_argument(
        "--rollout-max-model-len", type=int, default=None, help="default: [inference] max_model_len"
    )
    p.add_argument(
        "--model", default=None,
        help="starting weights: a hub id (org/name) or gs:// path, fetched once per run into the bucket "
        "(default: the recipe's [model] name when it is a hub id)",
    )  # fmt: skip
    p.add_argument("--model-revision", default=None, help="hub revision (branch, tag or commit) of --model")
    p.add_argument(
        "--hf-token-secret", default=None,
        help="Kubernetes secret holding a Hugging Face token (NAME or NAME:KEY, key default 'token'), for gated models",
    )  # fmt: skip
    p.add_argument(
        "--extra-pip", action="append", default=[],
        help="pip requirement installed in every trainer pod at start (your env package, e.g. "
        "/data/wheels/my_env-0.1-py3-none-any.whl); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--rollout-server", choices=("vllm", "jaxrl"), default="vllm",
        help="rollout server: vllm-tpu (--rollout-image) or python -m jaxrl.serve (the jaxrl image)",
    )  # fmt: skip
    p.add_argument(
        "--weight-transfer", choices=("direct", "files"), default=None,
        help="how the rollout servers get each version: direct (default with --rollout-server jaxrl: "
        f"they pull it from every trainer pod's port {WEIGHTS_PORT}) or files (on the bucket; the fallback, "
        "and what vLLM servers always use)",
    )  # fmt: skip
    p.add_argument(
        "--wait-timeout-s", type=int, default=3600,
        help="deadline of every wait (weights fetched or exported, rollout servers healthy)",
    )
    p.add_argument("-o", "--output", default="-", help="output file (-: stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:cut])
    for flag, value, low in (("--max-restarts", args.max_restarts, 0), ("--rollout-replicas", args.rollout_replicas, 1),
                             ("--wait-timeout-s", args.wait_timeout_s, 1)):  # fmt: skip
        if value < low:
            print(f"error: {flag} {value}: must be >= {low}", file=sys.stderr)
            return 2
    if args.weight_transfer is not None and not args.rollout_slice:
        print(f"error: --weight-transfer {args.weight_transfer}: it feeds rollout servers; add --rollout-slice "
              "or drop --weight-transfer", file=sys.stderr)  # fmt: skip
        return 2
    if args.weight_transfer is None:
        args.weight_transfer = "files" if args.rollout_server == "vllm" else "direct"
    try:
        manifest = render(args, argv[cut + 1 :])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = yaml.safe_dump(manifest, sort_keys=False, width=120)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

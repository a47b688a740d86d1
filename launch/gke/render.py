"""Render a GKE JobSet manifest for a jaxrl run on a TPU v5e / v6e slice.

    python launch/gke/render.py --slice v6e-16 --image IMAGE --bucket BUCKET \\
        --config configs/reverse_text/rl.toml [--rollout-slice v6e-8 --rollout-replicas 2] \\
        [-o jobset.yaml] [-- --trainer.steps 100 ...]

One replicated Job ("trainer") runs ``launch/gke/entrypoint.py`` - i.e. ``python -m
jaxrl.train --config ... --distributed.enabled true`` - on every host of the slice; JAX finds
its peers from the TPU_WORKER_* variables GKE injects. With ``--rollout-slice`` a second
replicated Job ("rollout") runs vllm-tpu servers, one per single-host slice, and the trainer
talks to the first of them as an external engine (see launch/gke/README.md). Everything a run
writes lands in the bucket, mounted at /data by the GCS FUSE CSI driver.

Only the standard library and PyYAML: the renderer runs wherever kubectl does.
"""

from __future__ import annotations

import argparse
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

# GKE node-selector value per TPU generation.
ACCELERATORS = {"v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}
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


@dataclass(frozen=True)
class Slice:
    """A TPU slice shape, e.g. ``Slice.parse("v5e-16")``: 16 chips, topology 4x4, 4 hosts."""

    name: str
    accelerator: str
    topology: str
    chips: int
    chips_per_host: int

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @classmethod
    def parse(cls, name: str) -> Slice:
        gen, _, n = name.partition("-")
        if gen not in ACCELERATORS or not n.isdigit() or int(n) not in SHAPES:
            supported = ", ".join(f"{g}-{c}" for g in ACCELERATORS for c in SHAPES)
            raise ValueError(f"--slice {name!r}: expected one of {supported}")
        topology, per_host = SHAPES[int(n)]
        return cls(name, ACCELERATORS[gen], topology, int(n), per_host)


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
    """``replicas`` Jobs, each one whole slice: one pod per host, all started together."""
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            "spec": {"parallelism": s.hosts, "completions": s.hosts, "backoffLimit": 0, "template": pod}
        },
    }


def read_recipe(config: str) -> dict[str, Any]:
    path = Path(config) if Path(config).is_absolute() else REPO / config
    if not path.exists():
        raise FileNotFoundError(
            f"--config {config}: no such recipe (paths are relative to the repository root)"
        )
    return tomllib.loads(path.read_text())


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


def trainer_container(args: argparse.Namespace, s: Slice, overrides: list[str]) -> dict[str, Any]:
    # Multi-host: JAX's multi-controller runtime, its peers read from GKE's TPU_WORKER_* variables.
    dist = ["--distributed.enabled", "true"] if s.hosts > 1 else []
    command = [
        "python",
        f"{APP}/launch/gke/entrypoint.py",
        "--output-root",
        f"{DATA}/{args.name}",
        "--config",
        args.config,
        *dist,
        *overrides,
    ]
    return {
        "name": "jaxrl",
        "image": args.image,
        "workingDir": APP,
        "command": command,
        "ports": [
            {"containerPort": 8471, "name": "tpu-runtime"},
            {"containerPort": 8476, "name": "jax-coord"},
        ],
    }


def rollout_container(args: argparse.Namespace, s: Slice, model: str, max_len: int) -> dict[str, Any]:
    serve = (
        f"until [ -f {model}/config.json ]; do echo waiting for {model}; sleep 15; done; "
        f"exec vllm serve {model} --host 0.0.0.0 --port {VLLM_PORT} --tensor-parallel-size {s.chips_per_host} "
        f"--max-model-len {max_len} --enable-scale-out --return-tokens-as-token-ids"
    )
    return {
        "name": "vllm",
        "image": args.rollout_image,
        "command": ["bash", "-c", serve],
        "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
        "ports": [{"containerPort": VLLM_PORT, "name": "http"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": VLLM_PORT}, "periodSeconds": 10},
    }


def rollout_url(name: str, index: int) -> str:
    """Stable DNS name JobSet gives rollout server ``index`` (pod 0 of rollout Job ``index``)."""
    return f"http://{name}-rollout-{index}-0.{name}:{VLLM_PORT}/v1"


def render(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """The JobSet (as a dict) for ``args``; ``overrides`` are extra ``jaxrl.train`` arguments."""
    train = Slice.parse(args.slice)
    jobs = []
    spec: dict[str, Any] = {
        "failurePolicy": {"maxRestarts": args.max_restarts},
        "network": {"enableDNSHostnames": True},
    }
    if args.rollout_slice:
        roll = Slice.parse(args.rollout_slice)
        if roll.hosts != 1:
            raise ValueError(
                f"--rollout-slice {roll.name}: one vLLM server per single-host slice (<= 8 chips)"
            )
        recipe = read_recipe(args.config)
        model = args.rollout_model or rollout_model_path(recipe, args.name)
        max_len = args.rollout_max_model_len or recipe.get("inference", {}).get("max_model_len")
        if not max_len:
            raise ValueError("the recipe has no [inference] max_model_len; give --rollout-max-model-len")
        overrides = [
            "--inference.backend",
            "external",
            "--inference.base_url",
            rollout_url(args.name, 0),
            *overrides,
        ]
        pod = tpu_pod_spec(
            roll, rollout_container(args, roll, model, max_len), args.service_account, args.bucket
        )
        jobs.append(replicated_job("rollout", roll, pod, replicas=args.rollout_replicas))
        # The run is over when the trainer is; the servers are then torn down with the JobSet.
        spec["successPolicy"] = {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    pod = tpu_pod_spec(train, trainer_container(args, train, overrides), args.service_account, args.bucket)
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
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
        "--rollout-slice", default=None, help="disaggregated: vllm-tpu servers on their own slices"
    )
    p.add_argument("--rollout-replicas", type=int, default=1, help="vLLM servers (one slice each)")
    p.add_argument("--rollout-image", default="vllm/vllm-tpu:latest")
    p.add_argument(
        "--rollout-model", default=None, help="model dir the servers load (default: from the config)"
    )
    p.add_argument(
        "--rollout-max-model-len", type=int, default=None, help="default: [inference] max_model_len"
    )
    p.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:cut])
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

"""A trainer process for tests/weight_transfer: one of ``--num-processes`` JAX processes (the
multi-controller runtime when more than one) holding a tiny decoder's params on an fsdp mesh over
all their devices, with a ``Publisher`` per transport. Driven over stdin, one command a line:

    publish V   publish version V (params: the seed-0 tiny model + V), print one JSON line
                {"version": V, "manifests": {transport: this process's fragment}}; process 0
                also writes the float32 params it published to OUT/ref_V.npz (the reference)
    quit        stop the publishers and exit

Prints "READY" once its publishers listen.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path[:0] = [
    str(Path(__file__).resolve().parents[i]) for i in (1, 2)
]  # tests/helpers.py, this checkout's jaxrl

import jax
import numpy as np
from flax import nnx
from helpers import tiny_model

from jaxrl.models.sharding import state_shardings
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.weight_transfer import Publisher
from jaxrl.weight_transfer.manifest import param_leaves

TRANSPORTS = ("tcp", "jax")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--coordinator")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))  # fsdp over every process's devices
    _, base = nnx.split(tiny_model(seed=0))
    base = jax.tree.map(np.asarray, base)
    shardings = state_shardings(base, mesh)
    publishers = {t: Publisher(transport=t, dtype="bfloat16", keep=2) for t in TRANSPORTS}
    print("READY", flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "quit":
            break
        version = int(rest[0])
        shift = np.float32(version)
        host = jax.tree.map(lambda x, v=shift: x + v, base)
        state = jax.tree.map(
            lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]), host, shardings
        )
        manifests = {t: p.publish(version, state).to_json() for t, p in publishers.items()}
        if jax.process_index() == 0:
            np.savez(args.out / f"ref_{version}.npz", **dict(param_leaves(host)))
        print(json.dumps({"version": version, "manifests": manifests}), flush=True)
    for p in publishers.values():
        p.stop()


if __name__ == "__main__":
    main()

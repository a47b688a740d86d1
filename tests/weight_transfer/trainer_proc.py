"""A trainer process for tests/weight_transfer: one of ``--num-processes`` JAX processes (the
multi-controller runtime when more than one) holding a tiny decoder's params on an fsdp mesh over
all their devices, with a ``Publisher`` per transport. Driven over stdin, one command a line:

    publish V   publish version V (params: the seed-0 tiny model + V), print one JSON line
                {"version": V, "manifests": {transport: this process's fragment},
                 "whole": {transport: manifest_for(...) of the global arrays, every process's
                 endpoint included}}; process 0 also writes the float32 params it published
                to OUT/ref_V.npz (the reference)
    quit        stop the publishers and exit

Prints "READY" once its publishers listen. The replies have stdout to themselves: the C++
libraries' own prints (gloo announces its connections from its threads) go to stderr, the log;
sharing the stream, one such line once cut into "READY" and the test read neither.
"""

from __future__ import annotations

import argparse
import json
import os
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
from jaxrl.weight_transfer import Publisher, manifest_for
from jaxrl.weight_transfer.manifest import param_leaves

TRANSPORTS = ("tcp", "jax")


def every_process(address: str) -> list[str]:
    """Every process's ``host:port`` (all on 127.0.0.1 here), by process index."""
    from jax.experimental import multihost_utils

    port = np.int32(address.rsplit(":", 1)[1])
    return [f"127.0.0.1:{p}" for p in np.asarray(multihost_utils.process_allgather(port)).reshape(-1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--coordinator")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # fd 1, where C++ code prints, is the log now
    sys.stdout = replies
    if args.num_processes > 1:
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))  # fsdp over every process's devices
    _, base = nnx.split(tiny_model(seed=0))
    base = jax.tree.map(np.asarray, base)
    shardings = state_shardings(base, mesh)
    # One run: every process's publishers share a lineage, so their fragments merge into the
    # manifest that manifest_for gives.
    publishers = {t: Publisher(transport=t, dtype="bfloat16", keep=2, lineage="trainer-proc") for t in TRANSPORTS}
    endpoints = {t: every_process(p.address) for t, p in publishers.items()}
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
        whole = {
            t: manifest_for(version, state, endpoints[t], "bfloat16", transport=t, lineage="trainer-proc").to_json()
            for t in TRANSPORTS
        }
        if jax.process_index() == 0:
            np.savez(args.out / f"ref_{version}.npz", **dict(param_leaves(host)))
        print(json.dumps({"version": version, "manifests": manifests, "whole": whole}), flush=True)
    for p in publishers.values():
        p.stop()


if __name__ == "__main__":
    main()

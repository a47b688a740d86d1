"""Trainer -> server weight transfer between two processes on this host: GB/s of each
``jaxrl.weight_transfer`` transport beside this host's memcpy and a plain loopback socket.

    python bench/weight_transfer.py [--sizes-mb 256 1024] [--repeats 5] [--connections 4]

A child process (the "trainer") publishes one bfloat16 array per size with a ``Publisher`` per
transport and runs a plain socket sender; this process (the "server") measures, in interleaved
repeats (one round of every method, then the next round), one JSON line per method and size
with the median GB/s (1 GB = 1e9 bytes):

- ``memcpy``: ``np.copyto`` of the array's bytes in this process (one thread): the ceiling.
- ``memcpy_fresh``: the same into newly allocated memory, as every path that lands a version in
  new buffers does (the pull; a file load): the first touch of each page costs here.
- ``socket``: one loopback TCP stream, ``sendall`` of the bytes there, ``recv_into`` a
  preallocated buffer here: what any socket transport can reach on one connection.
- ``tcp/fetch``, ``jax/fetch``: the transport alone, the whole array into a host buffer over one
  connection (``Connection.fetch``; for "jax": stage on the control channel, then pull).
- ``tcp/pull``, ``jax/pull``: ``pull_weights`` end to end onto one CPU device (plan, ``connections``
  parallel parts, host assembly, ``device_put``), the path a server runs.

Measured 2026-11-29 03:38 UTC on the shared 2-core host (load average 8-13; medians of 5, GB/s at
1 GiB; 256 MiB lines were noisier): memcpy 4.80, into fresh memory 3.20, loopback socket 2.53,
tcp fetch 1.77, tcp pull_weights 1.23 (4 connections), jax fetch 0.30, jax pull_weights 0.23.
TCP moves ~6x what jax.experimental.transfer does here (its transfer_size tuned to 4 MiB: the
256 MiB default gave 0.17). Before the puller's host buffers were 64-byte aligned, tcp
pull_weights was 0.29: XLA:CPU copied each unaligned buffer at ~0.6 GB/s.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxrl.weight_transfer import Manifest, Publisher, get_transport, pull_weights
from jaxrl.weight_transfer.plan import Pull

TRANSPORTS = ("tcp", "jax")


def serve(sizes_mb: list[int]) -> None:
    """The trainer side: publishers and a plain sender; one JSON line, then wait for stdin to close."""
    rng = np.random.default_rng(0)
    pubs = {t: Publisher(transport=t, dtype="bfloat16", keep=len(sizes_mb)) for t in TRANSPORTS}
    manifests: dict[str, dict[str, str]] = {t: {} for t in TRANSPORTS}
    payload = {}
    for version, mb in enumerate(sizes_mb, start=1):
        n = mb * (1 << 20) // 2
        host = rng.standard_normal(n // 1024, dtype=np.float32).astype(jnp.bfloat16)
        w = jax.device_put(np.tile(host, 1024).reshape(n // 4096, 4096))  # random enough; cheap to make
        for t, pub in pubs.items():
            manifests[t][str(mb)] = pub.publish(version, {"w": w}).to_json()
        payload[mb] = np.asarray(w).view(np.uint8).reshape(-1)
        del w
    plain = socket.create_server(("127.0.0.1", 0))

    def sender() -> None:
        while True:
            conn, _ = plain.accept()
            with conn:
                mb = int.from_bytes(conn.recv(8), "little")
                conn.sendall(memoryview(payload[mb]))

    threading.Thread(target=sender, daemon=True).start()
    print(json.dumps({"manifests": manifests, "plain": plain.getsockname()[1]}), flush=True)
    sys.stdin.read()
    for pub in pubs.values():
        pub.stop()


def measure(fn, nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.sizes_mb)
        return
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--sizes-mb", *map(str, args.sizes_mb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(child.stdout.readline())
        run(args, info)
    finally:
        child.stdin.close()
        child.wait(60)


def run(args: argparse.Namespace, info: dict) -> None:
    for mb in args.sizes_mb:
        manifests = {t: Manifest.from_json(info["manifests"][t][str(mb)]) for t in TRANSPORTS}
        runs = bench_size(mb, manifests, info["plain"], args.repeats, args.connections)
        for name, gbps in runs.items():
            line = {
                "bench": "weight_transfer",
                "method": name,
                "mb": mb,
                "gb_per_s": round(statistics.median(gbps), 3),
                "runs": [round(g, 3) for g in gbps],
            }
            if name.endswith("/pull"):
                line["connections"] = args.connections
            print(json.dumps(line), flush=True)


def bench_size(
    mb: int, manifests: dict[str, Manifest], plain_port: int, repeats: int, connections: int
) -> dict[str, list[float]]:
    """GB/s of every method, ``repeats`` interleaved rounds after one warm-up round."""
    param = manifests["tcp"].param("w")
    nbytes = param.nbytes
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    out = np.empty(param.shape, jnp.bfloat16)
    device = jax.local_devices(backend="cpu")[0]
    target = {"w": jax.ShapeDtypeStruct(param.shape, jnp.bfloat16, sharding=SingleDeviceSharding(device))}
    whole = Pull(0, "w", param.shards[0].box, param.shards[0].box, param.itemsize)

    def plain() -> None:
        with socket.create_connection(("127.0.0.1", plain_port)) as s:
            s.sendall(mb.to_bytes(8, "little"))
            view, got = memoryview(dst), 0
            while got < nbytes:
                got += s.recv_into(view[got:])

    def fetch(t: str) -> None:
        m = manifests[t]
        conn = get_transport(t).connect(m.endpoints[0], time.monotonic() + 120)
        try:
            conn.fetch(m.version, [(whole, out)], time.monotonic() + 120)
        finally:
            conn.close()

    def pull(t: str) -> None:
        jax.block_until_ready(pull_weights(manifests[t], target, timeout_s=120, connections=connections))

    methods = {
        "memcpy": lambda: np.copyto(dst, src),
        "memcpy_fresh": lambda: np.copyto(np.empty(nbytes, np.uint8), src),
        "socket": plain,
    }
    for t in TRANSPORTS:
        methods[f"{t}/fetch"] = lambda t=t: fetch(t)
        methods[f"{t}/pull"] = lambda t=t: pull(t)
    for fn in methods.values():  # warm-up: connections, transfer servers, first touch of buffers
        fn()
    runs: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            runs[name].append(measure(fn, nbytes))
    return runs


if __name__ == "__main__":
    main()

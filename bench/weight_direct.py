"""The trainer and server processes of bench/weight_delivery.py's ``direct`` paths, and the
measurements they share with it (this host's memcpy and loopback socket, the changed fraction
of real optimizer steps).

    python bench/weight_direct.py trainer --model Qwen3-0.6B --process-id I --num-processes N --coordinator H:P
    python bench/weight_direct.py server --model Qwen3-0.6B

Both are driven over stdin, one JSON command a line, and answer one JSON line each:

- trainer (one of N JAX processes, ``jax.distributed``, 2 CPU devices each; the model's bf16
  params laid out as the trainer lays them out, ``state_shardings`` on an fsdp mesh over all
  devices): ``{"op": "publish", "version": V, "delta": bool, "fraction": f}`` publishes version V
  (V = 1: random weights; later: the previous version with a fraction ``f`` of each shard's
  64 KiB blocks changed) with a ``Publisher(delta=...)`` and answers ``publish_s`` and, from
  process 0, the manifest (``manifest_for``). ``{"op": "reset", "delta": bool, "quantization":
  "none" | "int8" | "fp8"}`` starts a new publisher (new lineage), quantizing the projections as
  the external backend does for 8-bit servers unless "none".
- server (one CPU device): ``{"op": "pull", "manifest": ..., "fresh": bool}`` pulls it (in the manifest's dtypes) onto
  its device over the last version it pulled (a delta when that is the manifest's base) into host buffers
  of its ``HostBufferPool`` (as the engine's runner does), or fresh ones with ``"fresh": true``, and answers ``pull_s``;
  ``{"op": "forget"}`` drops the held version.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np


def abstract_params(name: str, layers: int | None) -> list[tuple[str, Any]]:
    """``(param path, ShapeDtypeStruct)`` of a Qwen3 preset's params in bfloat16, nothing allocated."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.presets import preset_hf_config, with_layers
    from jaxrl.weight_transfer.manifest import param_leaves

    hf = preset_hf_config(name)
    assert hf is not None
    if layers is not None:
        hf = with_layers(hf, layers)
    arch = arch_from_hf_config(hf)
    model = nnx.eval_shape(lambda: Decoder(arch, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16))
    return param_leaves(nnx.state(model, nnx.Param))


# -- this host's limits -------------------------------------------------------------------------


def memcpy_GBps(nbytes: int, repeats: int = 3) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    dst[:] = 0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def socket_GBps(nbytes: int, repeats: int = 3) -> float:
    """One loopback TCP stream: ``sendall`` there, ``recv_into`` a preallocated buffer here."""
    payload, out = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    server = socket.create_server(("127.0.0.1", 0))

    def send() -> None:
        for _ in range(repeats):
            conn, _ = server.accept()
            with conn:
                conn.sendall(memoryview(payload))

    threading.Thread(target=send, daemon=True).start()
    times = []
    for _ in range(repeats):
        with socket.create_connection(server.getsockname()) as s:
            t0 = time.perf_counter()
            view, got = memoryview(out), 0
            while got < nbytes:
                got += s.recv_into(view[got:])
            times.append(time.perf_counter() - t0)
    server.close()
    return nbytes / statistics.median(times) / 1e9


# -- the changed fraction of real optimizer steps -----------------------------------------------


def changed_fraction(steps: int, block_sizes: tuple[int, ...], lr: float) -> list[dict[str, Any]]:
    """AdamW (optax, ``lr``, no weight decay: the main recipe's) on a tiny Qwen3-shaped model
    (the main job's shape: hidden 128, 4 layers, Qwen3's 151,936-token vocabulary, tied), float32
    master weights, next-token loss on batches drawn from 300 of the tokens (a small task's
    vocabulary); after each step, the fraction of the bfloat16 serving bytes that changed: by
    element, by whole tensor, by block of each size; and of the projections' int8 values
    (``int8_values``: what a delta to an int8 server would carry)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.quantize import quantize_param
    from jaxrl.models.tiny import qwen3_config
    from jaxrl.weight_transfer.delta import Changed, changed_blocks, count_changed, delta_payload_bytes, diff, num_blocks
    from jaxrl.weight_transfer.manifest import param_leaves

    hf = qwen3_config(vocab_size=151936, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=32, intermediate_size=384).to_dict()  # fmt: skip
    model = Decoder(arch_from_hf_config(hf), rngs=nnx.Rngs(0), param_dtype=jnp.float32, dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    opt = optax.adamw(lr, weight_decay=0.0)
    opt_state = opt.init(params)
    rng = np.random.default_rng(0)
    used = rng.choice(hf["vocab_size"], 300, replace=False)
    batch, seq = 16, 64

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        m = nnx.merge(graphdef, p)
        logits = m.logits_f32(m(tokens, jnp.broadcast_to(jnp.arange(seq), tokens.shape))[0])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1).mean()

    @jax.jit
    def step(p: Any, s: Any, tokens: jax.Array) -> tuple[Any, Any, jax.Array]:
        value, g = jax.value_and_grad(loss)(p, tokens)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    def served(p: Any) -> dict[str, np.ndarray]:
        return {k: np.asarray(x.astype(jnp.bfloat16)) for k, x in param_leaves(p)}

    def int8_values(p: Any) -> dict[str, np.ndarray]:
        """The projections as an int8 server serves them (what quantized transfer sends)."""
        made = {k: quantize_param(k, x, jnp.bfloat16, "int8") for k, x in param_leaves(p)}
        return {k: np.asarray(m["values"]) for k, m in made.items() if isinstance(m, dict)}

    rows, before, before_q = [], served(params), int8_values(params)
    for i in range(steps):
        params, opt_state, value = step(params, opt_state, jnp.asarray(rng.choice(used, (batch, seq))))
        after = served(params)
        total = sum(a.nbytes for a in after.values())
        row = {"step": i + 1, "loss": round(float(value), 4), "bytes": total}
        changed = sum(int((before[k].view(np.uint16) != after[k].view(np.uint16)).sum()) for k in after)
        row["elements"] = changed * 2 / total
        made = [diff(before[k], after[k], 2) for k in after]  # what a delta of elements sends: its description and values
        row["bytes_element_delta"] = sum(sum(p.nbytes for p in c.encode()) + v.nbytes for c, v in made) / total
        row["tensors"] = sum(a.nbytes for k, a in after.items() if not np.array_equal(before[k].view(np.uint16), a.view(np.uint16))) / total  # fmt: skip
        for bs in block_sizes:  # the fraction of blocks, and of bytes in changed blocks (what a delta sends)
            bits = {k: changed_blocks(before[k], after[k], bs) for k in after}
            row[f"blocks_{bs >> 10}k"] = sum(count_changed(b) for b in bits.values()) / sum(num_blocks(after[k].nbytes, bs) for k in bits)
            row[f"bytes_{bs >> 10}k"] = sum(
                delta_payload_bytes(Changed(num_blocks(after[k].nbytes, bs), packed=b), after[k].nbytes, bs) for k, b in bits.items()
            ) / total
        after_q = int8_values(params)  # the share of int8 projection values that moved a step
        row["int8_values"] = sum(int((before_q[k] != a).sum()) for k, a in after_q.items()) / sum(a.size for a in after_q.values())
        rows.append({k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()})
        before, before_q = after, after_q
    return rows


# -- the trainer and server processes ------------------------------------------------------------


def replies_alone_on_stdout() -> None:
    """Keep stdout for this process's JSON replies: fd 1, where C++ code prints (gloo announces
    its connections from its own threads), goes to stderr. Sharing the stream, such a line once
    cut into a reply, which the driver then skipped, waiting for it forever."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = replies


def trainer(args: argparse.Namespace) -> None:
    replies_alone_on_stdout()
    import jax
    import ml_dtypes

    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    from jax.experimental import multihost_utils

    from jaxrl.models.sharding import state_shardings
    from jaxrl.parallel.mesh import MeshConfig, make_mesh
    from jaxrl.weight_transfer import Publisher, manifest_for
    from jaxrl.weight_transfer.manifest import box_of

    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    leaves = abstract_params(args.model, args.layers)
    shardings = state_shardings(dict(leaves), mesh)
    rng = np.random.default_rng(args.process_id)
    pattern = rng.standard_normal(1 << 16, dtype=np.float32).astype(ml_dtypes.bfloat16)
    host: dict[str, dict[Any, np.ndarray]] = {}  # this process's shards, by param and box
    for path, x in leaves:
        host[path] = {}
        for index in shardings[path].addressable_devices_indices_map(x.shape).values():
            box = box_of(index, x.shape)
            if box not in host[path]:
                n = int(np.prod([b - a for a, b in box]))
                host[path][box] = np.resize(pattern, n).reshape([b - a for a, b in box])

    def state() -> dict[str, jax.Array]:
        return {
            p: jax.make_array_from_callback(x.shape, shardings[p], lambda i, p=p, x=x: host[p][box_of(i, x.shape)])
            for p, x in leaves
        }

    def perturb(fraction: float) -> None:
        """Change ``fraction`` of every shard's elements, scattered (one bf16 ulp each), as an
        optimizer step at a small learning rate does (``changed_fraction`` lines)."""
        for boxes in host.values():
            for a in boxes.values():
                flat = a.reshape(-1).view(np.uint16)
                hit = rng.integers(0, flat.size, round(fraction * flat.size))
                flat[hit] += 1

    def allgather(address: str) -> list[str]:
        port = np.int32(address.rsplit(":", 1)[1])
        return [f"127.0.0.1:{p}" for p in np.asarray(multihost_utils.process_allgather(port)).reshape(-1)]

    def publisher(delta: bool, quantization: str) -> Publisher:
        """bfloat16 as served, or int8 / fp8 projections quantized here (the external backend's
        ``prepare`` for 8-bit servers)."""
        if quantization == "none":
            return Publisher(dtype="bfloat16", delta=delta, full_every=1 << 30)
        prepare = functools.partial(_quantized, kind=quantization)
        return Publisher(dtype=None, prepare=prepare, block_bytes=2, delta=delta, full_every=1 << 30)

    pub = publisher(False, "none")
    endpoints = allgather(pub.address)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":
            pub.stop()
            pub = publisher(cmd["delta"], cmd.get("quantization", "none"))
            endpoints = allgather(pub.address)
            print(json.dumps({"ok": True}), flush=True)
            continue
        if cmd["version"] > 1 and cmd.get("fraction") is not None:
            perturb(cmd["fraction"])
        arrays = state()
        jax.block_until_ready(arrays)
        multihost_utils.sync_global_devices("publish")
        t0 = time.perf_counter()
        fragment = pub.publish(cmd["version"], arrays)
        publish_s = time.perf_counter() - t0
        answer: dict[str, Any] = {"publish_s": publish_s}
        changes = pub.changes(cmd["version"])
        if changes is not None:
            answer |= {"changed_bytes": changes.changed_bytes, "bytes": changes.bytes, "block_bytes": pub.block_bytes,
                       "sent_bytes": changes.sent_bytes}  # fmt: skip
        if jax.process_index() == 0:
            manifest = manifest_for(cmd["version"], pub.layout(), endpoints, None, lineage=pub.lineage,
                                    base_version=fragment.base_version, block_bytes=pub.block_bytes)  # fmt: skip
            answer["manifest"] = manifest.to_json()
        print(json.dumps(answer), flush=True)
    pub.stop()


def _quantized(path: str, x: Any, kind: str) -> Any:
    from jaxrl.models.quantize import quantize_param

    return quantize_param(path, x, "bfloat16", kind)


def server(args: argparse.Namespace) -> None:
    import jax
    from jax.sharding import SingleDeviceSharding

    from jaxrl.weight_transfer import HostBufferPool, Manifest, applies_as_delta, pull_weights

    sh = SingleDeviceSharding(jax.devices()[0])
    held: tuple[str, int, Any] | None = None
    pool = HostBufferPool()  # as the engine's runner keeps one
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "forget":
            held = None
            print(json.dumps({"ok": True}), flush=True)
            continue
        manifest = Manifest.from_json(cmd["manifest"])
        # What the manifest serves (bfloat16, or 8-bit values + scales), on this server's device.
        target = {p.path: jax.ShapeDtypeStruct(p.shape, jax.numpy.dtype(p.dtype), sharding=sh) for p in manifest.params}
        lineage, have, previous = held or (None, None, None)
        delta = applies_as_delta(manifest, lineage, have) and previous is not None
        t0 = time.perf_counter()
        pulled = pull_weights(manifest, target, previous=previous, have_version=have, have_lineage=lineage,
                              timeout_s=600, buffers=None if cmd.get("fresh") else pool)  # fmt: skip
        jax.block_until_ready(pulled)
        pull_s = time.perf_counter() - t0
        held = None  # let the previous version go before keeping the new one
        held = (manifest.lineage, manifest.version, pulled)
        print(json.dumps({"pull_s": pull_s, "delta": delta}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["trainer", "server"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--coordinator")
    args = ap.parse_args()
    (trainer if args.role == "trainer" else server)(args)


if __name__ == "__main__":
    main()

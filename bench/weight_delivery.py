"""Weight delivery to rollout servers, as ``inference.backend = "external"`` does it every step:
through files (the trainer writes HF safetensors to a shared directory, every server loads them)
or directly (every trainer process publishes its shards, every server pulls them: whole, or only
the elements a step changed).

    python bench/weight_delivery.py [--models qwen3-0.6b qwen3-8b] [--layers-8b 2] [--writers 4] [--dir DIR]
                                    [--direct-8b] [--fractions F ...] [--repeats 2]

First this host's own limits (``host`` line: memcpy and one loopback socket stream, GB/s) and
the changed fraction of real optimizer steps (``changed_fraction`` lines: AdamW at each of
``--lrs``, the main recipe's 5e-4 and an LLM RL run's 1e-6, on a tiny Qwen3-shaped model: the
bfloat16 serving bytes that changed per step, by element (and what an element delta sends:
``bytes_element_delta``: its changed values and their gaps), whole tensor and block size). Then, per model, one JSON line per path:

- ``gather``: today's path. ``export_hf`` gathers every weight to process 0 (``device_get``) and
  writes 2 GB shards there, one after another; then ``sync``.
- ``parallel``: every trainer host writes the tensors it holds, at once (``--writers`` processes,
  each one host's share, no gather); then ``sync``. ``write_s`` includes turning the weights into
  HF tensors (``of_which_convert_s``, done by one process here, by every host on a pod).
- ``direct``: 2 trainer processes (``jax.distributed``, 2 CPU devices each, the params on the
  trainer's fsdp layout) publish the version (``Publisher``: cast, copy to host) and 2 server
  processes (one CPU device each) pull it whole at once over loopback TCP (``pull_weights``);
  ``step_s`` = publish + the slower pull, median of ``--repeats`` versions.
- ``direct_int8``: ``direct`` to servers that serve int8 projections: the trainers quantize them
  (``quantize_param``, as the external backend does) and the servers pull values + scales,
  ``bytes`` being what travelled;
- ``direct_delta``: the same as ``direct`` with ``Publisher(delta=True)``: each version changes a fraction of
  every shard's elements, scattered (the measured fraction of a real step at each of ``--lrs``,
  then each of ``--fractions``) and the servers, holding the version before, pull only the
  changed elements (their gaps and bytes);
  ``publish_s`` includes the compare; ``delta_bytes``: what a delta sends each server;
- ``direct_int8_delta``: ``direct_delta`` to int8 servers at the first fraction (a real step's):
  a bf16 element's one-ulp change moves its int8 value only when it crosses a rounding step, so
  a small share of the int8 values change (real steps: 0.14-0.29%, ``int8_values``);
- ``direct_fresh_buffers``: ``direct`` with every server pulling into fresh host memory (no
  ``HostBufferPool``), for comparison; every other direct line counts versions from the third
  (the pool's steady state). ``socket_GBps_adjacent``: one loopback socket stream
  measured right before and after these paths (the host's load drifts), ``vs_socket``: both
  servers' pull rate together against it.

The files paths are then loaded the way a ``jaxrl.serve`` server does it (``load_decoder`` from the
directory), with the files dropped from the page cache first (``posix_fadvise DONTNEED``) so the
read comes from disk, not memory. Per path: bytes, write and load seconds, bytes/s, and the
seconds a step spends on delivery (write + load; servers load in parallel on their own hosts).

Qwen3-8B (16.4 GB) does not fit this machine's free memory three times over (model, host copy,
load), so it runs with ``--layers-8b`` of its 36 layers (embeddings and head whole) and the
line also gives the time extrapolated by bytes to all 36 layers (``extrapolated_*``). Its direct
paths (2 trainers holding two versions, 2 servers holding two) need ~6x its bytes of memory and
run only with ``--direct-8b`` (more than a 24 GB host has, even at one layer: the embedding and head are 2.5 GB). The file paths' numbers are this machine's disk: a TPU VM writing through GCS FUSE sees other bandwidths; the
ratio of the two paths is what carries over.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxrl.ports import free_port

SHAPES = {"qwen3-0.6b": ("Qwen3-0.6B", None), "qwen3-8b": ("Qwen3-8B", "layers_8b")}


def drop_from_page_cache(directory: Path) -> None:
    """Evict ``directory``'s files from the page cache, so the next read comes from the disk."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build_model(name: str, layers: int | None) -> tuple[Any, dict[str, Any]]:
    """A Qwen3 decoder at ``name``'s shape (``layers`` of its layers if given), bfloat16 weights."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.models.decoder import Decoder
    from jaxrl.models.presets import preset_hf_config, with_layers

    hf = preset_hf_config(name)
    assert hf is not None
    if layers is not None:
        hf = with_layers(hf, layers)
    arch = arch_from_hf_config(hf)
    model = Decoder(arch, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    return model, hf


def write_share(out: str, share: dict[str, Any], index: int) -> None:
    from safetensors.numpy import save_file

    save_file(share, f"{out}/model-{index:05d}.safetensors", metadata={"format": "pt"})


def parallel_write(tensors: dict[str, Any], out: Path, writers: int) -> None:
    """``writers`` processes (forked: the tensors are shared, not copied) each write one share,
    then the index (written by process 0 on a pod, after a barrier)."""
    names = sorted(tensors, key=lambda n: -tensors[n].nbytes)
    shares: list[dict[str, Any]] = [{} for _ in range(writers)]
    sizes = [0] * writers
    for n in names:  # balance bytes: largest first onto the lightest share
        k = sizes.index(min(sizes))
        shares[k][n] = tensors[n]
        sizes[k] += tensors[n].nbytes
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=write_share, args=(str(out), s, i)) for i, s in enumerate(shares)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"writer exited {p.exitcode}"
    weight_map = {n: f"model-{i:05d}.safetensors" for i, share in enumerate(shares) for n in share}
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))  # what every loader reads first


def measure(label: str, name: str, layers: int | None, full_layers: int, args: argparse.Namespace) -> None:
    import jax.numpy as jnp

    from jaxrl.models.hf_io import export_hf, iter_hf_tensors, load_decoder

    model, hf = build_model(name, layers)
    root = Path(tempfile.mkdtemp(prefix="jaxrl-weights-", dir=args.dir))
    try:
        for path in ("gather", "parallel"):
            out = root / path
            t0 = time.perf_counter()
            convert_s = None
            if path == "gather":
                export_hf(model, out, hf)
            else:
                out.mkdir()
                # Each host's own shards as HF tensors (here one process converts them all: on a
                # pod each host converts its 1/N, so this part would shrink too).
                tensors = dict(iter_hf_tensors(model))
                (out / "config.json").write_text(json.dumps(hf))
                convert_s = time.perf_counter() - t0
                parallel_write(tensors, out, args.writers)
                del tensors
            os.sync()
            write_s = time.perf_counter() - t0
            size = sum(f.stat().st_size for f in out.iterdir() if f.suffix == ".safetensors")
            drop_from_page_cache(out)
            t0 = time.perf_counter()
            loaded = load_decoder(out, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
            load_s = time.perf_counter() - t0
            del loaded
            row = {
                "bench": "weight_delivery", "model": label, "path": path, "layers": hf["num_hidden_layers"],
                "writers": 1 if path == "gather" else args.writers, "bytes": size,
                "write_s": round(write_s, 2), "of_which_convert_s": None if convert_s is None else round(convert_s, 2),
                "load_s": round(load_s, 2),
                "write_GBps": round(size / write_s / 1e9, 3), "load_GBps": round(size / load_s / 1e9, 3),
                "step_s": round(write_s + load_s, 2),
            }  # fmt: skip
            if layers is not None:
                per_layer = (size - bytes_outside_layers(hf)) / layers
                full = size + per_layer * (full_layers - layers)
                row |= {"extrapolated_layers": full_layers, "extrapolated_bytes": int(full),
                        "extrapolated_step_s": round((write_s + load_s) * full / size, 1)}  # fmt: skip
            print(json.dumps(row), flush=True)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Procs:
    """The direct paths' processes (bench/weight_direct.py), driven one JSON line at a time."""

    def __init__(self, name: str, layers: int | None, trainers: int, servers: int):
        script = str(Path(__file__).with_name("weight_direct.py"))
        common = ["--model", name] + ([] if layers is None else ["--layers", str(layers)])
        coordinator = f"127.0.0.1:{free_port()}"

        def spawn(args: list[str], devices: int) -> subprocess.Popen:
            env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
            return subprocess.Popen([sys.executable, script, *args, *common], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip

        self.trainers = [
            spawn(["trainer", "--process-id", str(i), "--num-processes", str(trainers), "--coordinator", coordinator], 2)
            for i in range(trainers)
        ]
        self.servers = [spawn(["server"], 1) for _ in range(servers)]
        for p in self.trainers + self.servers:
            self.read(p)

    @staticmethod
    def read(p: subprocess.Popen) -> dict[str, Any]:
        while (line := p.stdout.readline()).strip()[:1] != "{":  # type: ignore[union-attr]
            if not line:
                raise RuntimeError(f"bench process {p.args[2]} exited {p.wait()}")
        return json.loads(line)

    def ask(self, procs: list[subprocess.Popen], cmd: dict[str, Any]) -> list[dict[str, Any]]:
        for p in procs:
            p.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        return [self.read(p) for p in procs]

    def step(self, version: int, fraction: float | None, fresh: bool = False) -> dict[str, Any]:
        """Publish ``version`` on every trainer, then pull it on every server at once (into fresh
        host buffers with ``fresh``, else the servers' pools)."""
        from jaxrl.weight_transfer.manifest import Manifest

        pub = self.ask(self.trainers, {"op": "publish", "version": version, "fraction": fraction})
        publish_s = max(p["publish_s"] for p in pub)  # the processes publish at once (after a barrier)
        manifest = pub[0]["manifest"]
        t0 = time.perf_counter()
        pulls = self.ask(self.servers, {"op": "pull", "manifest": manifest, "fresh": fresh})
        pull_s = time.perf_counter() - t0
        changed = sum(p.get("changed_bytes", 0) for p in pub)
        total = sum(p.get("bytes", 0) for p in pub)
        sent = [p.get("sent_bytes") for p in pub]
        return {"publish_s": publish_s, "pull_s": pull_s, "delta": all(p["delta"] for p in pulls),
                "changed_fraction": changed / total if total else None, "block_bytes": pub[0].get("block_bytes", 2),
                "delta_bytes": None if None in sent else sum(sent),
                "bytes_sent": Manifest.from_json(manifest).nbytes}  # fmt: skip

    def stop(self) -> None:
        for p in self.trainers + self.servers:
            try:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")  # type: ignore[union-attr]
                p.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in self.trainers + self.servers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def measure_direct(label: str, name: str, layers: int | None, full_layers: int, fractions: list[tuple[str, float]],
                   args: argparse.Namespace) -> None:  # fmt: skip
    """The ``direct`` and ``direct_delta`` lines of one model (see the module docstring)."""
    from weight_direct import abstract_params, socket_GBps

    size = sum(int(x.size) * 2 for _, x in abstract_params(name, layers))
    procs = Procs(name, layers, trainers=2, servers=2)
    sockets = [socket_GBps(256 << 20)]  # this host's socket right before and after: its load drifts
    # Each path's first WARM versions are not counted: a server's host buffer pool reuses a
    # version's memory once it no longer serves it, so from its third pull on (steady state).
    warm = 2
    try:
        steps = [procs.step(v, None, fresh=True) for v in range(1, args.repeats + 1)]
        rows = [("direct_fresh_buffers", None, steps)]
        procs.ask(procs.servers, {"op": "forget"})
        steps = [procs.step(v, None) for v in range(args.repeats + 1, 2 * args.repeats + warm + 1)]
        rows.append(("direct", None, steps[warm:]))
        procs.ask(procs.trainers, {"op": "reset", "delta": False, "quantization": "int8"})
        procs.ask(procs.servers, {"op": "forget"})
        rows.append(("direct_int8", None, [procs.step(v, None) for v in range(1, args.repeats + warm + 1)][warm:]))
        for kind, fraction in fractions:
            procs.ask(procs.trainers, {"op": "reset", "delta": True})
            procs.ask(procs.servers, {"op": "forget"})
            procs.step(1, None)  # the base every server then holds
            runs = [procs.step(v, fraction) for v in range(2, args.repeats + warm + 2)]
            rows.append(("direct_delta", (kind, fraction), runs[warm:]))
        if fractions:  # deltas to int8 servers at a real step's fraction: few int8 values move a step
            kind, fraction = fractions[0]
            procs.ask(procs.trainers, {"op": "reset", "delta": True, "quantization": "int8"})
            procs.ask(procs.servers, {"op": "forget"})
            procs.step(1, None)
            runs = [procs.step(v, fraction) for v in range(2, args.repeats + warm + 2)]
            rows.append(("direct_int8_delta", (kind, fraction), runs[warm:]))
        sockets.append(socket_GBps(256 << 20))
    finally:
        procs.stop()
    socket_now = statistics.mean(sockets)
    for path, fraction, runs in rows:
        publish_s = statistics.median(r["publish_s"] for r in runs)
        pull_s = statistics.median(r["pull_s"] for r in runs)
        step_s = statistics.median(r["publish_s"] + r["pull_s"] for r in runs)
        row = {
            "bench": "weight_delivery", "model": label, "path": path, "layers": layers or full_layers,
            "trainers": 2, "servers": 2, "bytes": size, "publish_s": round(publish_s, 3), "pull_s": round(pull_s, 3),
            "step_s": round(step_s, 3), "GBps": round(size / step_s / 1e9, 3),
            "pull_GBps_per_server": round(size / pull_s / 1e9, 3), "repeats": len(runs),
        }  # fmt: skip
        if path in ("direct_int8", "direct_int8_delta"):  # a version's bytes: int8 projections + their scales
            row |= {"bytes": runs[0]["bytes_sent"], "GBps": round(runs[0]["bytes_sent"] / step_s / 1e9, 3),
                    "pull_GBps_per_server": round(runs[0]["bytes_sent"] / pull_s / 1e9, 3)}  # fmt: skip
        if path in ("direct", "direct_fresh_buffers", "direct_int8"):  # both servers pull at once: their sum against one socket stream
            row |= {"socket_GBps_adjacent": round(socket_now, 3),
                    "vs_socket": round(2 * row["pull_GBps_per_server"] / socket_now, 3)}  # fmt: skip
        else:
            changed = statistics.median(r["changed_fraction"] for r in runs)
            row |= {"fraction_source": fraction[0], "fraction_asked": fraction[1],
                    "changed_fraction": round(changed, 4), "applied_as_delta": all(r["delta"] for r in runs),
                    # what a delta sends each server: the changed blocks' bytes and their description
                    "delta_bytes": statistics.median(r["delta_bytes"] for r in runs)}  # fmt: skip
        if layers is not None:
            per_layer = (size - bytes_outside_layers(preset(name))) / layers
            full = size + per_layer * (full_layers - layers)
            row |= {"extrapolated_layers": full_layers, "extrapolated_bytes": int(full),
                    "extrapolated_step_s": round(step_s * full / size, 2)}  # fmt: skip
        print(json.dumps(row), flush=True)


def preset(name: str) -> dict[str, Any]:
    from jaxrl.models.presets import preset_hf_config

    hf = preset_hf_config(name)
    assert hf is not None
    return hf


def host_limits() -> dict[str, float]:
    from weight_direct import memcpy_GBps, socket_GBps

    row = {"memcpy_GBps": round(memcpy_GBps(1 << 30), 3), "socket_GBps": round(socket_GBps(1 << 30), 3)}
    print(json.dumps({"bench": "weight_delivery", "path": "host", "bytes": 1 << 30, **row}), flush=True)
    return row


def real_step_fractions(args: argparse.Namespace) -> list[tuple[str, float]]:
    """The ``changed_fraction`` lines; returns, per learning rate, the median fraction of bf16
    elements a real step changed (after the first step): the ``direct_delta`` lines' fractions."""
    from weight_direct import changed_fraction

    fractions = []
    for lr in args.lrs:
        rows = changed_fraction(args.optimizer_steps, (4 << 10, 64 << 10, 1 << 20), lr=lr)
        for r in rows:
            print(json.dumps({"bench": "weight_delivery", "path": "changed_fraction", "lr": lr, **r}), flush=True)
        fractions.append((f"real_step_lr{lr:g}", statistics.median(r["elements"] for r in rows[1:] or rows)))
    return fractions


def bytes_outside_layers(hf: dict[str, Any]) -> int:
    """Embedding, final norm and (untied) head, in bfloat16."""
    d, v = hf["hidden_size"], hf["vocab_size"]
    return 2 * (v * d * (1 if hf.get("tie_word_embeddings") else 2) + d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--layers-8b", type=int, default=2, help="Qwen3-8B layers built here (of 36)")
    ap.add_argument("--writers", type=int, default=4, help="trainer hosts writing at once (v5p-32: 4)")
    ap.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    ap.add_argument("--direct-8b", action="store_true", help="also the direct paths of the Qwen3-8B subset (~6x its bytes of memory)")
    ap.add_argument("--fractions", type=float, nargs="*", default=[0.05],
                    help="direct_delta also at these changed fractions (after the measured one)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=2, help="versions per direct path (the median is reported)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-6],
                    help="AdamW learning rates of the changed-fraction steps: the main recipe's, and an LLM RL run's")
    ap.add_argument("--optimizer-steps", type=int, default=3, help="real optimizer steps for the changed fraction")
    args = ap.parse_args()
    if not 1 <= args.layers_8b <= 36 or args.writers < 1 or args.repeats < 1 or args.optimizer_steps < 1:
        ap.error("--layers-8b must be in 1..36 and --writers, --repeats, --optimizer-steps >= 1")
    if not all(0 <= f <= 1 for f in args.fractions):
        ap.error("--fractions must be in [0, 1]")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    host_limits()
    fractions = real_step_fractions(args) + [("asked", f) for f in args.fractions]
    for label in args.models:
        name, layer_arg = SHAPES[label]
        full = preset(name)["num_hidden_layers"]
        layers = args.layers_8b if layer_arg else None
        measure(label, name, layers, full, args)
        if layer_arg is None or args.direct_8b:
            measure_direct(label, name, layers, full, fractions, args)


if __name__ == "__main__":
    main()

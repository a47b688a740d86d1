"""Weight delivery to rollout servers, as ``inference.backend = "external"`` does it every step:
the trainer writes HF safetensors to a shared directory, every server loads them.

    python bench/weight_delivery.py [--models qwen3-0.6b qwen3-8b] [--layers-8b 2] [--writers 4] [--dir DIR]

Two paths, side by side in one run, at real Qwen3 shapes in bfloat16 (one JSON line each):

- ``gather``: today's path. ``export_hf`` gathers every weight to process 0 (``device_get``) and
  writes 2 GB shards there, one after another; then ``sync``.
- ``parallel``: every trainer host writes the tensors it holds, at once (``--writers`` processes,
  each one host's share, no gather); then ``sync``. ``write_s`` includes turning the weights into
  HF tensors (``of_which_convert_s``, done by one process here, by every host on a pod).

Both are then loaded the way a ``jaxrl.serve`` server does it (``load_decoder`` from the
directory), with the files dropped from the page cache first (``posix_fadvise DONTNEED``) so the
read comes from disk, not memory. Per path: bytes, write and load seconds, bytes/s, and the
seconds a step spends on delivery (write + load; servers load in parallel on their own hosts).

Qwen3-8B (16.4 GB) does not fit this machine's free memory three times over (model, host copy,
load), so it runs with ``--layers-8b`` of its 36 layers (embeddings and head whole) and the
line also gives the time extrapolated by bytes to all 36 layers (``extrapolated_*``). The
numbers are this machine's disk: a TPU VM writing through GCS FUSE sees other bandwidths; the
ratio of the two paths is what carries over.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

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
    from jaxrl.models.presets import preset_hf_config

    hf = preset_hf_config(name)
    assert hf is not None
    if layers is not None:
        hf = {**hf, "num_hidden_layers": layers}
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
    args = ap.parse_args()
    if not 1 <= args.layers_8b <= 36 or args.writers < 1:
        ap.error("--layers-8b must be in 1..36 and --writers >= 1")
    from jaxrl.models.presets import preset_hf_config

    for label in args.models:
        name, layer_arg = SHAPES[label]
        full = preset_hf_config(name)["num_hidden_layers"]  # type: ignore[index]
        measure(label, name, args.layers_8b if layer_arg else None, full, args)


if __name__ == "__main__":
    main()

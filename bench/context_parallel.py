"""Train-step speed at context 1 vs 4 on 8 CPU devices, at equal global tokens, and where the
communication goes in each compiled program. Prints one JSON line per mesh, then the ratio.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/context_parallel.py

8 virtual CPU devices share this host's cores: the ratio says what context parallelism costs
in extra work and collectives on one machine, not what it buys on a TPU slice (there it buys
memory: README "Long context"). Collectives are counted from the optimized HLO by kind, with the
bytes each moves per device (the sum of its result shapes); ops inside the scanned layer body
count once (not once per layer).

Measured 2026-11-27 on the loaded 2-core host (2 layers, width 128, 8 rows x 2048 tokens):
context 4 runs at 0.92x context 1's tokens/s with 379 vs 598 MB of temporaries per device; its
communication is the Ulysses all-to-alls (8 ops in the program: q, k, v and the output, forward
and backward, 8.4 MB) plus FSDP's parameter all-gathers, now over fsdp x context (36 ops,
86 MB; context 1: 7 ops, 59 MB), and much smaller gradient all-reduces (4.4 vs 143 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' tiny-model builders

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import random_samples, tiny_model  # noqa: E402

from jaxrl.kernel_dispatch import Kernels  # noqa: E402
from jaxrl.models.sharding import shard_params  # noqa: E402
from jaxrl.parallel.mesh import MeshConfig, batch_sharding, make_mesh  # noqa: E402
from jaxrl.trainer.config import TrainerConfig  # noqa: E402
from jaxrl.trainer.packing import component_counts, pack  # noqa: E402
from jaxrl.trainer.step import micro_batch_loss  # noqa: E402

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_SHAPE = re.compile(r"(f32|bf16|s32|pred|u32)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "u32": 4}


def collectives(hlo: str) -> dict[str, dict[str, float]]:
    """Per collective kind in optimized HLO text: op count and MB its results hold per device."""
    out = {k: {"ops": 0, "mb": 0.0} for k in COLLECTIVES}
    for line in hlo.splitlines():
        if "=" not in line:
            continue
        rhs = line.split("=", 1)[1]
        match = next((m for k in COLLECTIVES if (m := re.search(rf"\b{k}(-start)?\(", rhs))), None)
        if match is None:
            continue
        kind = match.group(0).removesuffix("(").removesuffix("-start")
        out[kind]["ops"] += 1
        for dtype, dims in _SHAPE.findall(rhs[: match.start()]):  # the result shape(s), a tuple too
            out[kind]["mb"] += int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _BYTES[dtype] / 1e6
    return {k: {"ops": v["ops"], "mb": round(v["mb"], 3)} for k, v in out.items() if v["ops"]}


def measure(context: int, seq_len: int, rows: int, repeats: int) -> dict:
    mesh = make_mesh(MeshConfig(fsdp=8 // context, context=context))
    cfg = TrainerConfig(seq_len=seq_len, micro_batch_rows=rows)
    model = tiny_model(vocab=256, hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=4, head_dim=32)
    graphdef, params = nnx.split(model)
    samples = random_samples(rows * 4, seed=0, vocab=256, min_len=seq_len // 8, max_len=seq_len // 4)
    batch = pack(samples, seq_len, rows_multiple=rows)
    mb = {k: jax.device_put(jnp.asarray(v[:rows]), batch_sharding(mesh)) for k, v in batch.as_dict().items()}
    counts = {k: jnp.float32(v) for k, v in component_counts(batch).items()}
    kernels = Kernels.create("reference", field="trainer.kernels", mesh=mesh)
    grad = jax.jit(jax.grad(lambda p, b, c: micro_batch_loss(p, graphdef, b, c, cfg, kernels)[0]))
    params = shard_params(params, mesh)
    compiled = grad.lower(params, mb, counts).compile()
    jax.block_until_ready(compiled(params, mb, counts))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, mb, counts))
        times.append(time.perf_counter() - t0)
    tokens = rows * seq_len
    return {
        "bench": "context_parallel", "context": context, "fsdp": 8 // context, "rows": rows, "seq_len": seq_len,
        "step_s_median": round(statistics.median(times), 4), "tokens_per_s": round(tokens / statistics.median(times), 1),
        "temp_mb_per_device": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 2),
        "collectives": collectives(compiled.as_text()),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rows", type=int, default=8, help="rows per micro-step (global; equal tokens at both meshes)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    results = {}
    for context in (1, 4):
        results[context] = measure(context, a.seq_len, a.rows, a.repeats)
        print(json.dumps(results[context]), flush=True)
    ratio = results[4]["tokens_per_s"] / results[1]["tokens_per_s"]
    print(json.dumps({"bench": "context_parallel", "tokens_per_s_ratio_context4_over_context1": round(ratio, 3)}))


if __name__ == "__main__":
    main()

"""Compile each Pallas kernel for TPU generations at Qwen3 sizes: VMEM, temporaries, compile time.

No TPU needed: libtpu's compile-only client (``jax.experimental.topologies``; the ``tpu`` extra)
runs the real Mosaic + XLA compile for the named topologies. Each kernel is traced under a
one-chip mesh of the target, as ``jaxrl.kernel_dispatch`` runs it per shard, so it sizes its
blocks for that chip. Prints one JSON line per kernel x topology x model size x dtype (x sequence
length for attention):

* ``kernel_vmem_mib``: VMEM the compiler allotted each Mosaic kernel in the program (forward and
  backward kernels, in program order), against ``vmem_limit_mib``, what the kernel requested;
* ``temp_mib`` / ``args_mib``: the program's per-chip temporaries and arguments
  (``memory_analysis()``); for decode attention, ``temp_vs_cache`` = temporaries / KV cache bytes;
* ``compile_s``: wall seconds of ``.lower().compile()`` (machine-dependent);
* ``blocks``: the tiles chosen for the chip.

    python studies/tpu_fit/tpu_kernels.py [--topologies v5e:2x2 v6e:2x2 v5p:2x2x2] [--kernels logprobs
        attention decode] [--sizes 0.6B 8B 32B]

Shapes: log-probs over 8192 tokens per chip (vocabulary 151936); attention over one row of 4096
and 32768 tokens (forward + backward, splash when T is a multiple of 128, as on TPU runs);
decode attention over 32 rows x 4096 cached positions of 2 layers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no TPU is touched

from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from jaxrl_kernels.attention import tpu_segment_attention  # noqa: E402
from jaxrl_kernels.decode_attention import choose_block_s, decode_attention  # noqa: E402
from jaxrl_kernels.logprobs import logprobs, plan_blocks  # noqa: E402
from jaxrl_kernels.tpu_budget import compiled_kernel_vmem, target_chip  # noqa: E402

VOCAB, KV_HEADS, HEAD_DIM = 151936, 8, 128
QWEN3 = {"0.6B": (1024, 16), "8B": (4096, 32), "32B": (5120, 64)}  # hidden, query heads
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
MiB = 2**20


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def compile_row(mesh: Mesh, fn, shapes) -> dict:
    sharding = NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn).lower(*args).compile()
    except Exception as exc:  # report and go on: one failing shape must not hide the others
        return {"compiles": False, "error": str(exc).splitlines()[0][:300]}
    mem = compiled.memory_analysis()
    return {
        "compiles": True,
        "kernel_vmem_mib": [round(b / MiB, 2) for _, b in compiled_kernel_vmem(compiled)],
        "temp_mib": round(mem.temp_size_in_bytes / MiB, 2),
        "args_mib": round(mem.argument_size_in_bytes / MiB, 1),
        "compile_s": round(time.perf_counter() - t0, 1),
    }


def grad(fn, argnums):
    def loss(*args):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(fn(*args)))

    return jax.grad(loss, argnums=argnums)


def bench_logprobs(mesh, base, size, dtype_name) -> None:
    d, dtype, n = QWEN3[size][0], DTYPES[dtype_name], 8192
    with jax.set_mesh(mesh):
        plan = plan_blocks(n, d, VOCAB, jnp.dtype(dtype).itemsize, target_chip())
    shapes = [((n, d), dtype), ((d, VOCAB), dtype), ((n,), jnp.int32), ((n,), jnp.float32)]
    row = compile_row(mesh, grad(logprobs, (0, 1, 3)), shapes)
    blocks = {"forward": plan.forward, "d_hidden": plan.d_hidden, "d_lm_head": plan.d_lm_head}
    emit(kernel="logprobs_fwd_bwd", **base, size=size, dtype=dtype_name, tokens=n, hidden=d,
         blocks=blocks, vmem_limit_mib=plan.chip.vmem_limit // MiB, **row)  # fmt: skip


def bench_attention(mesh, base, size, t) -> None:
    heads = QWEN3[size][1]
    q, kv = ((1, t, heads, HEAD_DIM), jnp.bfloat16), ((1, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    row = compile_row(mesh, grad(tpu_segment_attention, (0, 1, 2)), [q, kv, kv, ((1, t), jnp.int32)])
    impl = "splash" if t % 128 == 0 else "segment_attention"
    emit(kernel="attention_fwd_bwd", impl=impl, **base, size=size, dtype="bfloat16", seq=t, heads=heads, **row)


def bench_decode(mesh, base, size, dtype_name) -> None:
    layers, rows, s, heads, dtype = 2, 32, 4096, QWEN3[size][1], DTYPES[dtype_name]
    cache = ((layers, rows, KV_HEADS, s, HEAD_DIM), dtype)
    i32 = ((rows,), jnp.int32)
    fn = lambda q, k, v, n, r, l: decode_attention(q, k, v, n, rows=r, layer=l)  # noqa: E731
    row = compile_row(mesh, fn, [((rows, heads, HEAD_DIM), dtype), cache, cache, i32, i32, ((), jnp.int32)])
    with jax.set_mesh(mesh):
        chip = target_chip()
    cache_bytes = 2 * np.prod(cache[0]) * jnp.dtype(dtype).itemsize
    if row["compiles"]:
        row["temp_vs_cache"] = round(row["temp_mib"] * MiB / cache_bytes, 5)
    emit(kernel="decode_attention", **base, size=size, dtype=dtype_name, rows=rows, positions=s,
         cache_mib=round(cache_bytes / MiB), vmem_limit_mib=chip.vmem_limit // MiB,
         block_s=choose_block_s(s, KV_HEADS, HEAD_DIM, jnp.dtype(dtype).itemsize, chip), **row)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topologies", nargs="+", default=["v5e:2x2", "v6e:2x2", "v5p:2x2x2"])
    p.add_argument("--kernels", nargs="+", default=["logprobs", "attention", "decode"])
    p.add_argument("--sizes", nargs="+", default=list(QWEN3), choices=list(QWEN3))
    p.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768])
    a = p.parse_args()
    if importlib.util.find_spec("libtpu") is None:
        sys.exit("studies/tpu_fit/tpu_kernels.py needs libtpu: pip install -e '.[tpu]'")
    for topology in a.topologies:
        device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
        mesh = Mesh(np.array([device]), ("x",))
        base = {"topology": topology, "device_kind": device.device_kind}
        for size in a.sizes:
            if "logprobs" in a.kernels:
                for dtype in DTYPES:
                    bench_logprobs(mesh, base, size, dtype)
            if "attention" in a.kernels:
                for t in a.seqs:
                    bench_attention(mesh, base, size, t)
            if "decode" in a.kernels:
                for dtype in DTYPES:
                    bench_decode(mesh, base, size, dtype)


if __name__ == "__main__":
    main()

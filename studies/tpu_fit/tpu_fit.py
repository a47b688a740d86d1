"""What fits where: Qwen3 sizes x TPU slices, compiled on this host (no TPU) by jaxrl.aot.

For each model and slice, the trainer's micro-step at each sequence length (fsdp over the whole
slice, remat "full", bfloat16 compute on float32 master weights, one row per chip per
micro-batch) and the update, and the engine's decode at ``max_seqs`` x ``max_model_len``
(tensor-parallel over min(8, chips) chips, as the recipes do). A combination whose resident
state alone (16 bytes per parameter for the trainer) exceeds HBM is reported without
compiling. Prints one JSON object per line; ``--table`` prints the README's markdown table.

XLA's cost-model figures (``estimated_flops``, ``estimated_bytes_accessed``) are estimates:
its cost model does not see into Pallas custom calls and counts a scanned layer body once.

    python studies/tpu_fit/tpu_fit.py --models Qwen3-0.6B --slices v6e:2x4 --seqs 4096 > fit.jsonl
    python studies/tpu_fit/tpu_fit.py --table < fit.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

SLICES = {"v5e-8": "v5e:2x4", "v6e-8": "v6e:2x4", "v5p-32": "v5p:2x2x4", "v5p-64": "v5p:2x4x4"}
MODELS = ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-8B", "Qwen3-32B")


def run_config(model: str, seq: int, chips: int, *, max_seqs: int, engine_len: int, rows_per_chip: int) -> Any:
    from jaxrl.cli import build_config

    toml = {
        "model": {"name": f"models/{model}", "dtype": "bfloat16", "param_dtype": "float32"},
        "trainer": {
            "seq_len": seq,
            "seq_len_buckets": [seq],
            "micro_batch_rows": chips * rows_per_chip,
            "remat": "full",
            "mesh": {"fsdp": -1},
        },
        "inference": {
            "max_model_len": engine_len,
            "max_seqs": max_seqs,
            "max_batched_tokens": 4096,
            "backend": {"type": "embedded", "tensor_parallel": min(8, chips)},
        },
        "orchestrator": {"train": {"env": [{"id": "reverse_text"}]}},
    }
    return build_config(toml, [])


def fit_one(model: str, slice_name: str, seq: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from jaxrl.aot import get_topology, plan, run_shapes

    topo = get_topology(SLICES[slice_name])
    cfg = run_config(model, seq, topo.num_devices, max_seqs=args.max_seqs, engine_len=min(seq, 8192), rows_per_chip=args.rows_per_chip)
    run = run_shapes(cfg, topo)
    sb = run.state_bytes()
    base = {"model": model, "slice": slice_name, "topology": topo.name, "seq_len": seq, "state_bytes": sb,
            "micro_batch_rows": cfg.trainer.micro_batch_rows, "max_seqs": args.max_seqs, "max_model_len": cfg.inference.max_model_len}
    trainer_state = sb["trainer_params"] * 2 + sb["trainer_opt_state"]  # + gradients
    out = []
    if args.state_only:  # resident state only (no compile, no activations): a lower bound
        engine_state = sb["engine_weights"] + sb["engine_kv_cache"]
        for prog, total in (("trainer state", trainer_state), ("trainer + engine state", trainer_state + engine_state)):
            out.append({**base, "program": prog, "mesh": {"fsdp": topo.num_devices}, "total_bytes": total,
                        "hbm_bytes": topo.hbm_per_device, "fits": total <= topo.hbm_per_device, "compile_s": "-"})
        return out
    if trainer_state > topo.hbm_per_device:
        out.append({**base, "program": "trainer", "fits": False, "hbm_bytes": topo.hbm_per_device,
                    "total_bytes": trainer_state, "note": "trainer state alone (16 B/param / chips) exceeds HBM"})
        return out
    for f in plan(cfg, topo, engine=not args.no_engine, trainer=not args.engine_only):
        out.append({**base, **json.loads(f.json())})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    gib = lambda n: f"{n / 1024**3:.1f}"
    lines = ["| model | slice | program | mesh | micro-batch | per-chip GiB (of HBM) | fits | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mesh = ",".join(f"{k}={v}" for k, v in r.get("mesh", {}).items() if v > 1) or "-"
        prog = r["program"]
        if r.get("error"):
            cell, fits = "compile error", "error"
        else:
            cell, fits = f"{gib(r['total_bytes'])} ({gib(r['hbm_bytes'])})", "yes" if r["fits"] else "**no**"
        mb = f"{r['micro_batch_rows']}x{r['seq_len']}" if prog.startswith("train") else f"{r['max_seqs']}x{r['max_model_len']}"
        if prog.endswith("state"):
            mb = f"{r['micro_batch_rows']}x{r['seq_len']}; engine {r['max_seqs']}x{r['max_model_len']}"
        lines.append(f"| {r['model']} | {r['slice']} | {prog} | {mesh} | {mb} | {cell} | {fits} | {r.get('compile_s', '-')} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--slices", nargs="+", default=list(SLICES), choices=list(SLICES))
    p.add_argument("--seqs", nargs="+", type=int, default=[4096, 8192])
    p.add_argument("--max-seqs", type=int, default=64, help="engine KV cache rows (the recipes' max_seqs)")
    p.add_argument("--rows-per-chip", type=int, default=1)
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--engine-only", action="store_true", help="compile the engine's programs only")
    p.add_argument("--state-only", action="store_true", help="resident state per chip only (no compiles; a lower bound)")
    p.add_argument("--table", action="store_true", help="read JSON lines on stdin, print the markdown table")
    args = p.parse_args()
    if args.table:
        print(table([json.loads(line) for line in sys.stdin if line.startswith("{")]))
        return 0
    from jaxrl.aot.topology import compile_only_env

    compile_only_env()
    for model in args.models:
        for s in args.slices:
            for seq in args.seqs:
                for row in fit_one(model, s, seq, args):
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

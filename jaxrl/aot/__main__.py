"""``python -m jaxrl.aot --config X.toml --topology v5e:4x4 [--section.field value ...]``

Compiles the run's programs for the TPU topology on this host (no TPU, no weights) and prints
one JSON line per program on stdout and a table on stderr. Exit status: 0 when every program
fits the chip's HBM, 1 when one does not (or fails to compile), 2 on a bad config or topology.
"""

from __future__ import annotations

import argparse
import sys

from jaxrl.aot.topology import compile_only_env


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f}"


def _table(fits: list, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("program", "mesh", "args GiB", "out GiB", "alias GiB", "temp GiB", "other GiB", "total GiB", "HBM GiB", "fits", "compile s"):
        t.add_column(col, justify="left" if col in ("program", "mesh") else "right")
    for f in fits:
        mesh = "x".join(f"{k}={v}" for k, v in f.mesh.items())
        if f.error:
            t.add_row(f.program, mesh, *["-"] * 7, "[red]NO (XLA: over HBM)[/red]" if f.oom else "[red]error[/red]", f"{f.compile_s:.1f}")
            continue
        ok = "[green]yes[/green]" if f.fits else "[red]NO[/red]"
        t.add_row(
            f.program, mesh, _gib(f.argument_bytes), _gib(f.output_bytes), _gib(f.alias_bytes), _gib(f.temp_bytes),
            _gib(f.resident_other_bytes), _gib(f.total_bytes), _gib(f.hbm_bytes), ok, f"{f.compile_s:.1f}",
        )
    Console(stderr=True, width=180).print(t)


def main(argv: list[str] | None = None) -> int:
    compile_only_env()
    parser = argparse.ArgumentParser(prog="python -m jaxrl.aot", description=__doc__.split("\n\n")[1])
    parser.add_argument("--topology", required=True, help="TPU slice (v5e:2x4, v6e:2x4, v5p:2x2x4) or GPUs (gpu:h100, gpu:h100x8)")
    parser.add_argument("--no-engine", action="store_true", help="skip the embedded engine's programs (RL configs)")
    parser.add_argument("--serve", action="store_true",
                        help="only the engine's programs, nothing else resident (a jaxrl.serve rollout server's view)")
    args, rest = parser.parse_known_args(argv)
    from jaxrl.aot.programs import model_hf_config, plan
    from jaxrl.aot.topology import get_topology
    from jaxrl.cli import load_config

    try:
        cfg, _ = load_config(rest)
        topo = get_topology(args.topology)
        _, source = model_hf_config(cfg.model)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hosts = f"{topo.hosts} hosts (an embedded engine runs colocated on every device)" if topo.hosts > 1 else "1 host"
    print(f"[jaxrl.aot] {topo.name}: {topo.num_devices} devices, {topo.hbm_per_device / 1024**3:.0f} GiB HBM each, "
          f"{hosts}; model from {source}", file=sys.stderr)
    try:
        if args.serve and args.no_engine:
            raise ValueError("--serve compiles only the engine; drop --no-engine")
        fits = plan(cfg, topo, engine=True if args.serve else (False if args.no_engine else None), serve=args.serve)
    except ValueError as e:  # e.g. a mesh that does not match the topology
        print(f"error: {e}", file=sys.stderr)
        return 2
    for f in fits:
        print(f.json(), flush=True)
    _table(fits, f"{topo.name} per-chip memory")
    bad = [f for f in fits if not f.fits]
    for f in bad:
        if f.oom:
            why = f"does not fit: the compiler ran out of HBM ({f.error})"
        elif f.error:
            why = f"failed to compile: {f.error}"
        else:
            why = f"does not fit: needs {_gib(f.total_bytes)} GiB per chip of {_gib(f.hbm_bytes)} GiB"
        print(f"error: {f.program} {why}. Knobs that change it: {'; '.join(f.knobs)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m jaxrl.train --config X.toml [--section.field value ...] [--dry-run] [--resume]``

Runs the recipe the config describes: SFT (``[data]``) or RL (``[orchestrator]``). A
``[warmstart]`` recipe (e.g. the SFT that produces the RL starting checkpoint) runs first
when ``[model] name`` has no weights yet, so one command goes from nothing to an RL run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from jaxrl.config import RunConfig, load_config
from jaxrl.inference.http_thread import PortInUse
from jaxrl.parallel.distributed import initialize
from jaxrl.preemption import RunAborted


def has_weights(model_dir: str | None) -> bool:
    d = Path(model_dir or "")
    return (d / "config.json").exists() and any(d.glob("*.safetensors*"))


def run(cfg: RunConfig, *, resume: bool = False) -> dict:
    initialize(cfg.distributed)  # before any JAX work: the warm start runs in these same processes
    if cfg.warmstart is not None and not has_weights(cfg.model.name):
        print(f"[jaxrl] {cfg.model.name} has no weights yet: running warm start {cfg.warmstart.config}")
        warm, _ = load_config(["--config", cfg.warmstart.config])
        run(warm)
        if not has_weights(cfg.model.name):
            raise RuntimeError(
                f"warmstart {cfg.warmstart.config} finished but {cfg.model.name} still has no weights; "
                "its output_dir must export to this run's model.name"
            )
    if cfg.mode == "sft":
        from jaxrl.sft import run_sft

        return run_sft(cfg, resume=resume)
    from jaxrl.rl import run_rl

    return run_rl(cfg, resume=resume)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, flags = load_config(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if flags.dry_run:
        print(cfg.model_dump_json(indent=2))
        return 0
    try:
        result = run(cfg, resume=flags.resume)
    except PortInUse as e:  # a config error only the environment shows: found before any work
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunAborted as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"[jaxrl] done: {result.get('steps')} steps; outputs in {cfg.output_dir}")
    return 0


def cli() -> None:
    """The ``jaxrl-train`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()

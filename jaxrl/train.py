"""``python -m jaxrl.train --config X.toml [--section.field value ...] [--dry-run] [--resume | --overwrite]``

Runs the recipe the config describes: SFT (``[data]``) or RL (``[orchestrator]``). A
``[warmstart]`` recipe (e.g. the SFT that produces the RL starting checkpoint) runs first
when ``[model] name`` is that recipe's export and has no weights yet, so one command goes from
nothing to an RL run.

Before anything is written the run checks what only the machine shows: the model resolves
(a hub id is fetched), and ``output_dir`` holds no other run (``--resume`` continues it,
``--overwrite`` deletes it). Such errors, like config errors, exit 2 with one line.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from jaxrl.cli import load_config, to_toml
from jaxrl.config import ConfigError, RunConfig
from jaxrl.parallel.distributed import barrier, initialize, is_main_process
from jaxrl.preemption import RunAborted
from jaxrl.serving.http_thread import PortInUse

RUN_OUTPUTS = frozenset({
    "config.json", "metrics.jsonl", "rollouts.jsonl", "metrics.png", "result.json", "checkpoints", "hf",
    "hf_adapter", "logs", "tb", "wandb", "rollout_weights", "vllm", "base",
})  # fmt: skip
"""What a run writes into its output_dir: a directory holding any of them holds a run, and
--overwrite deletes exactly these."""


def has_weights(model_dir: str | Path | None) -> bool:
    d = Path(model_dir or "")
    return (d / "config.json").exists() and any(d.glob("*.safetensors*"))


def has_checkpoint(cfg: RunConfig) -> bool:
    ckpt = Path(cfg.ckpt.dir or Path(cfg.output_dir) / "checkpoints")
    return ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())


def claim_output_dir(cfg: RunConfig, *, resume: bool, overwrite: bool) -> None:
    """Never mix two runs in one output_dir: one that holds a run's outputs is continued
    (--resume), cleared of them (--overwrite; other files stay), or refused."""
    out = Path(cfg.output_dir)
    if resume and overwrite:
        raise ConfigError("--resume continues the run in output_dir and --overwrite deletes it: pass one")
    held = sorted(p.name for p in out.iterdir() if p.name in RUN_OUTPUTS) if out.is_dir() else []
    if not held or resume:
        return
    if not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ConfigError(
            f"output_dir {out} already holds a run ({shown}): rerun with --resume to continue it, "
            "--overwrite to delete it and start over, or set --output_dir to a new directory"
        )
    if is_main_process():
        for name in held:
            path = out / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        print(f"[jaxrl] --overwrite: deleted the earlier run in {out} ({', '.join(held)})")
    barrier("jaxrl-overwrite")


def check_model(cfg: RunConfig) -> None:
    """Resolve ``[model] name`` now (a hub id is fetched into the HF cache), before output_dir is
    touched: an unknown id is a config error, not a crash after the run has started."""
    name = cfg.model.name
    if name is None or Path(name).expanduser().is_dir() or cfg.warmstart_export() is not None:
        return
    from jaxrl.models.hub import resolve_model_dir

    try:
        resolve_model_dir(name, cfg.model.revision)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


def run(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False) -> dict:
    initialize(cfg.distributed)  # before any JAX work: the warm start runs in these same processes
    export = cfg.warmstart_export()
    if export is not None and not has_weights(export):
        assert cfg.warmstart is not None
        if cfg.orchestrator is not None:  # a broken env fails now, not after the warm start's minutes
            from jaxrl.orchestrator.orchestrator import check_envs

            try:
                check_envs(cfg.orchestrator)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        warm, _ = load_config(["--config", cfg.warmstart.config])
        print(f"[jaxrl] {cfg.model.name} has no weights yet: running warm start {cfg.warmstart.config}")
        resume = has_checkpoint(warm)
        restart = not resume and not any((Path(warm.output_dir) / f).exists() for f in ("result.json", "hf"))
        run(warm, resume=resume, overwrite=restart)  # an interrupted warm start continues; a finished run is refused
        if not has_weights(export):
            raise RuntimeError(
                f"warmstart {cfg.warmstart.config} finished but {cfg.model.name} still has no weights; "
                "its output_dir must export to this run's model.name"
            )
    check_model(cfg)
    claim_output_dir(cfg, resume=resume, overwrite=overwrite)
    fresh = not resume
    try:
        if cfg.mode == "sft":
            from jaxrl.sft import run_sft

            return run_sft(cfg, resume=resume)
        from jaxrl.rl import run_rl

        return run_rl(cfg, resume=resume)
    except ConfigError:  # found after output_dir was claimed (a bad data row, an env): leave it as it was
        if fresh and is_main_process():
            discard_outputs(Path(cfg.output_dir))
        raise


def discard_outputs(out: Path) -> None:
    """Delete what a fresh run wrote into ``out`` before it refused to start, so the fixed rerun
    finds no earlier run there (only ``RUN_OUTPUTS``: other files were there before)."""
    for path in (out / name for name in RUN_OUTPUTS):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, flags = load_config(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if flags.dry_run:
        print(to_toml(cfg), end="")
        return 0
    try:
        result = run(cfg, resume=flags.resume, overwrite=flags.overwrite)
    except (PortInUse, ConfigError) as e:  # config errors only the environment shows: found before any work
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunAborted as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the loop installed its handler (loading, compiling)
        print("[jaxrl] interrupted before the first checkpoint: nothing to resume; rerun with --overwrite",
              file=sys.stderr)  # fmt: skip
        return EXIT_INTERRUPTED
    if stopped := result.get("stopped_by"):
        return interrupted(cfg, result["steps"], stopped)
    print(f"[jaxrl] done: {result.get('steps')} steps; outputs in {cfg.output_dir}")
    return 0


EXIT_INTERRUPTED = 130
"""Exit code of a run stopped by Ctrl-C (128 + SIGINT, the shell's convention), so scripts and
``&&`` chains see that it did not finish. SIGTERM (preemption) exits 0: the GKE entry point
(launch/gke/entrypoint.py) reads ``result.json``'s ``stopped_by`` and restarts the job."""


def interrupted(cfg: RunConfig, steps: int, signal_name: str) -> int:
    """Say where a stopped run stands (its checkpoint) and how to continue it; the exit code."""
    ckpt = cfg.ckpt.dir or Path(cfg.output_dir) / "checkpoints"
    what = "interrupted" if signal_name == "SIGINT" else f"stopped by {signal_name}"
    print(f"[jaxrl] {what} at step {steps} (checkpoint in {ckpt}) — rerun with --resume", file=sys.stderr)
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else 0


def cli() -> None:
    """The ``jaxrl-train`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()

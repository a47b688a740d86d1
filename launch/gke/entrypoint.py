"""Container entry point of a jaxrl run on GKE: ``python -m jaxrl.train`` made restartable.

    python launch/gke/entrypoint.py --output-root /data/RUN --config X.toml [overrides ...]

- ``outputs/`` (where the recipes write) becomes a link to ``--output-root`` on the bucket
  mount, so every host of the slice, every restart and the vLLM servers see the same files.
- If the run already has a checkpoint (an earlier attempt was preempted), ``--resume`` is added.
- SIGTERM / SIGINT are forwarded to the trainer, which checkpoints and exits 0. The entry point
  then exits ``EXIT_INTERRUPTED`` so that JobSet counts the attempt as failed and restarts it
  (``failurePolicy.maxRestarts``) rather than reporting an unfinished run as complete.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after checkpointing; run again to resume


def link_outputs(root: Path, link: Path = Path("outputs")) -> None:
    """Point ``link`` at ``root`` (created if missing); a real directory there is an error."""
    root.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    elif link.exists():
        raise FileExistsError(f"{link.absolute()} is a real directory; the image must not ship outputs/")
    link.symlink_to(root, target_is_directory=True)


def has_checkpoint(ckpt_dir: Path) -> bool:
    """True when orbax committed at least one step (a digits-only directory) in ``ckpt_dir``."""
    return ckpt_dir.is_dir() and any(p.name.isdigit() and p.is_dir() for p in ckpt_dir.iterdir())


def run_paths(train_args: list[str]) -> tuple[Path, Path]:
    """(output_dir, checkpoint dir) of the run ``train_args`` describe, via jaxrl's own config."""
    from jaxrl.config import load_config

    cfg, _ = load_config(train_args)
    out = Path(cfg.output_dir)
    return out, Path(cfg.ckpt.dir) if cfg.ckpt.dir else out / "checkpoints"


def exit_code(returncode: int, output_dir: Path) -> int:
    """The trainer's code, except that a clean stop by a signal becomes ``EXIT_INTERRUPTED``."""
    result = output_dir / "result.json"
    if returncode == 0 and result.exists() and json.loads(result.read_text()).get("stopped_by"):
        return EXIT_INTERRUPTED
    return returncode


def run_forwarding_signals(cmd: list[str]) -> int:
    """Run ``cmd``; SIGTERM / SIGINT sent to this process go to the child too."""
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    return child.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-root", type=Path, required=True, help="run directory on shared storage")
    args, train_args = p.parse_known_args(argv)
    link_outputs(args.output_root)
    output_dir, ckpt_dir = run_paths(train_args)
    if "--resume" not in train_args and has_checkpoint(ckpt_dir):
        print(f"[entrypoint] checkpoint found in {ckpt_dir}: resuming", flush=True)
        train_args = [*train_args, "--resume"]
    elif "--resume" not in train_args and output_dir.is_dir() and any(output_dir.iterdir()):
        # this job's own earlier attempt, stopped before its first checkpoint: start it over
        print(f"[entrypoint] {output_dir} holds no checkpoint yet: starting over (--overwrite)", flush=True)
        train_args = [*train_args, "--overwrite"]
    returncode = run_forwarding_signals([sys.executable, "-m", "jaxrl.train", *train_args])
    return exit_code(returncode, output_dir)


if __name__ == "__main__":
    sys.exit(main())

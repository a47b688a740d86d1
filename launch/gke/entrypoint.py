"""Container entry point of a jaxrl run on GKE: ``python -m jaxrl.train`` made restartable.

    python launch/gke/entrypoint.py --output-root /data/RUN [--fetch ORG/NAME|gs://... --fetch-to DIR]
        [--pip SPEC ...] [--wait-timeout-s S] --config X.toml [overrides ...]

- ``--pip``: requirements installed first (the user's own env package, e.g. a wheel on the bucket).
- ``--fetch``: the starting weights, fetched once per run into ``--fetch-to`` on the bucket by
  process 0 (``TPU_WORKER_ID`` 0): a hub id through ``huggingface_hub`` (``HF_TOKEN`` for gated
  models; cache and offline mode honoured) or a ``gs://`` directory through ``etils.epath``. A
  marker written last (``FETCHED_MARKER``) says the copy is complete; every other process (and
  every rollout server) waits for it, at most ``--wait-timeout-s``, saying what it waits for.

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
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after checkpointing; run again to resume
FETCHED_MARKER = ".jaxrl-fetched.json"  # render.FETCHED_MARKER: written last, once the weights are complete
WAIT_POLL_S = 5.0


def fetch_weights(source: str, dest: Path, revision: str | None) -> None:
    """``source`` (hub id or ``gs://`` directory) copied into ``dest``, then the marker. A marker
    already there for the same source means an earlier attempt of this run fetched it: nothing to do."""
    marker = dest / FETCHED_MARKER
    want = {"source": source, "revision": revision}
    if marker.exists():
        have = json.loads(marker.read_text())
        if {k: have.get(k) for k in want} == want:
            print(f"[entrypoint] {source} already fetched into {dest}", flush=True)
            return
        raise FileExistsError(
            f"{dest} holds {have.get('source')} (revision {have.get('revision')}), not {source}: "
            "render the job with a new --name for another model"
        )
    print(f"[entrypoint] fetching {source} into {dest}", flush=True)
    start = time.monotonic()
    if source.startswith("gs://"):
        from jaxrl.models.hf_io import copy_model_dir

        copy_model_dir(source, dest)
    else:
        from huggingface_hub import snapshot_download

        from jaxrl.models.hub import MODEL_FILES

        snapshot = Path(snapshot_download(source, revision=revision, allow_patterns=list(MODEL_FILES)))
        dest.mkdir(parents=True, exist_ok=True)
        for f in snapshot.iterdir():
            if f.is_file():  # the cache's symlinks, followed
                shutil.copyfile(f, dest / f.name)
    size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps(want | {"bytes": size, "seconds": round(time.monotonic() - start, 1)}))
    tmp.replace(marker)
    print(f"[entrypoint] fetched {size / 1e9:.2f} GB in {time.monotonic() - start:.0f} s", flush=True)


def wait_for(path: Path, timeout_s: float, what: str) -> None:
    """Block until ``path`` exists, at most ``timeout_s``; says every poll what it waits for."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not there after {timeout_s:g} s ({path} missing; --wait-timeout-s)")
        print(f"[entrypoint] waiting for {what} ({path})", flush=True)
        time.sleep(WAIT_POLL_S)


def pip_install(specs: list[str]) -> None:
    """Install the user's own packages (``--pip``) into the image's environment before the run."""
    if not specs:
        return
    print(f"[entrypoint] pip install {' '.join(specs)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-input", *specs], check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--pip {' '.join(specs)}: pip install failed (exit {done.returncode}); see above")


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
    from jaxrl.cli import load_config

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
    p.add_argument("--fetch", default=None, help="hub id or gs:// directory of the starting weights")
    p.add_argument("--fetch-to", type=Path, default=None, help="where on the bucket the weights go")
    p.add_argument("--fetch-revision", default=None, help="hub revision of --fetch")
    p.add_argument("--pip", action="append", default=[], help="requirement to pip install first; repeatable")
    p.add_argument("--wait-timeout-s", type=float, default=3600.0, help="deadline of the wait for the weights")
    args, train_args = p.parse_known_args(argv)
    if (args.fetch is None) != (args.fetch_to is None):
        p.error("--fetch and --fetch-to go together")
    if args.wait_timeout_s <= 0:
        p.error(f"--wait-timeout-s {args.wait_timeout_s:g}: must be > 0")
    try:
        pip_install(args.pip)
        if args.fetch is not None:
            if int(os.environ.get("TPU_WORKER_ID", "0")) == 0:
                fetch_weights(args.fetch, args.fetch_to, args.fetch_revision)
            else:
                what = f"{args.fetch} (fetched into {args.fetch_to} by trainer process 0)"
                wait_for(args.fetch_to / FETCHED_MARKER, args.wait_timeout_s, what)
    except (RuntimeError, TimeoutError, FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
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

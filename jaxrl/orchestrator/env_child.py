"""The env server process jaxrl spawns (`python -m jaxrl.orchestrator.env_child`, started by
`env_process.EnvProcess.launch`): reads its spec (one JSON line) from stdin, runs verifiers'
`serve_env` (one `EnvServer`, or an `EnvServerPool` of worker processes) on a free port of
127.0.0.1, reports the bound address on the fd it was given, and exits when asked (SIGTERM,
handled gracefully by verifiers) or when the orchestrator dies (its stdin closes).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jaxrl.envs import register_plugin


def _child_setup(aliases: Mapping[str, str]) -> None:
    """Per-process setup of a spawned env server and each of its pool workers.

    Imports the heavy libraries up front (the renderer's tokenizer stack would otherwise
    load in front of the first rollout) and freezes everything imported out of the garbage
    collector: tracing those millions of objects made collections, and interpreter exit
    (which the pool waits on), take seconds.
    """
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        force=True,
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("httpx", "aiohttp.access"):  # a line per HTTP request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for taskset_id, module in aliases.items():
        register_plugin(taskset_id, module)
    import renderers.client  # noqa: F401
    import transformers  # noqa: F401
    import verifiers.v1  # noqa: F401

    gc.freeze()



class _AddressPipe:
    """What verifiers' `serve_env` reports its bound address to (an `address_queue`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def put(self, address: str) -> None:
        os.write(self.fd, f"{address}\n".encode())
        os.close(self.fd)


def _read_line(fd: int) -> bytes:
    """One line from a raw fd, unbuffered (the rest of the stream is the parent-death watch)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            raise SystemExit("env server: stdin closed before the spec arrived")
        data += chunk
    return data


ORPHAN_GRACE_S = 2.0
"""Seconds an orphaned env server gets for verifiers' graceful teardown before it exits hard:
rollouts in flight belong to a trainer that is gone, so nothing is lost by cutting them. (Pool
workers follow this process on their own: verifiers arms each with a death pipe.)"""


def _exit_with_parent() -> None:
    """Once the orchestrator's end of stdin closes (it stopped us, or died): SIGTERM ourselves (a
    graceful verifiers teardown), and exit hard if that has not ended the process within
    ``ORPHAN_GRACE_S`` (a teardown waiting on rollouts in flight kept an orphan alive > 10 s)."""
    with contextlib.suppress(OSError):
        while os.read(0, 65536):  # the raw fd: a buffered reader would hold its lock at exit
            pass
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run one verifiers env server (spawned by jaxrl).")
    parser.add_argument("--address-fd", type=int, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(_read_line(0))
    _child_setup(spec["aliases"])
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    from verifiers.v1.serve import serve_env

    serve_env(
        max_workers=spec["pool_size"],
        address="tcp://127.0.0.1:0",
        address_queue=_AddressPipe(args.address_fd),
        log_setup=functools.partial(_child_setup, spec["aliases"]),
        elastic=spec["elastic"],
        multiplex=spec["worker_capacity"],
        config_data=spec["config"],
        max_concurrent=spec["max_concurrent"],
    )


if __name__ == "__main__":
    main()

"""A free TCP port for a process about to be started, to bind itself."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
BELOW_EPHEMERAL = 8192
"""How many ports under the kernel's ephemeral range to pick from."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on ``host`` now, for a child process to bind (a vLLM server,
    a ``jax.distributed`` coordinator, a rollout server).

    Picked at random below the kernel's ephemeral range, not by binding port 0: a port from
    ``bind(0)`` is free again before the child binds it, and meanwhile any ``bind(0)`` on the
    host (a neighbour test's server, a weight publisher) can be handed the same one; it was, as a
    ``jax.distributed`` coordinator that could not start under the parallel test runner. Ports
    below the range are never handed out by ``bind(0)``; two children picking the same one at
    once is left to chance over ``BELOW_EPHEMERAL`` ports."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    first = max(1024, low - BELOW_EPHEMERAL)
    pick = random.SystemRandom()  # not the seeded global generator: tests seed that
    for _ in range(64):
        port = pick.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]

"""The colocated engine's command stream: one engine across every process of a multi-host slice.

With one process per host (as GKE runs JAX), a program over devices of several processes runs
only when every process issues it, in the same order. The engine's scheduler is host-side
state that must exist once (requests, rows, prefix cache, the HTTP server in front), so it lives
on process 0, and each of its device calls (``ModelRunner.prefill`` / ``decode`` / ``copy_row``
/ ``reset_counts`` / ``reset`` / ``swap``) is first sent to the other processes, which repeat
it on their own ``ModelRunner`` over the same global mesh (``Replica``). Sampled tokens come
back to process 0 from the program itself (its outputs are replicated).

How the decisions travel, and why a socket: a decode call's host inputs are a few KB (token
ids, positions, rows, sampling settings). Sent in-program (a collective over the mesh) or with
``multihost_utils.broadcast_one_to_all`` they would cost a device program per call and block the
other processes in it; a pickled message over one TCP connection per process costs a send and
a receive (``bench/colocated.py`` measures both per decode step). It also carries the points
where the processes meet outside the engine: ``SYNC`` before each section they run together
(the batch hand-off, the train step, the weight reshard, a checkpoint) and ``STOP``.

Deadlines: process 0 sends a heartbeat (``PING``) when it has sent nothing for a quarter of
``timeout_s``; another process that hears nothing for ``timeout_s`` raises ``LeaderLost``.
Process 0 watches each connection: when another process dies its connection closes, and as
process 0 may then be blocked inside a collective with it, it exits at once with a line saying
so (the job restarts every process; the run resumes from its last checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

SYNC, STOP, PING = "sync", "stop", "ping"
RUNNER_CALLS = frozenset({"prefill", "decode", "copy_row", "reset_counts", "reset", "swap"})
_HEADER = struct.Struct("<Q")
EXIT_PEER_LOST = 70
"""Process 0's exit status when another process of the colocated engine died: a failure, not a
preemption (the GKE render restarts 75, a checkpointed stop, without counting it; this counts)."""


class LeaderLost(RuntimeError):
    """Process 0 went silent or closed its connection: this process cannot follow the engine."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


class Leader:
    """Process 0's end: a listener the other ``followers`` processes connect to, and ``send``.

    ``lock`` orders process 0's device calls: a runner call holds it while it sends and issues
    its program, and a section every process runs together (``section``) holds it throughout, so
    the order the others receive is the order process 0 issued. Re-entrant: a section may issue
    a runner call (a weight swap) on its own thread.
    """

    def __init__(self, *, followers: int, host: str, port: int, timeout_s: float):
        self.followers = followers
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._closing = False
        self._last_send = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        self.sent_bytes = 0
        self.sent_messages = 0

    def accept(self) -> None:
        """Wait for every other process (each sends its process index), within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        seen: set[int] = set()
        while len(self._conns) < self.followers:
            self._listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                missing = self.followers - len(self._conns)
                raise TimeoutError(
                    f"colocated engine: {missing} of {self.followers} processes did not connect within "
                    f"{self.timeout_s:.0f} s (inference.backend.colocated_timeout_s)"
                ) from None
            conn.settimeout(self.timeout_s)
            index = struct.unpack("<I", _recv_exact(conn, 4))[0]
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            seen.add(index)
            self._conns.append(conn)
            threading.Thread(target=self._watch, args=(conn, index), name=f"jaxrl-lockstep-watch-{index}", daemon=True).start()
        self._listener.close()
        self._heartbeat = threading.Thread(target=self._beat, name="jaxrl-lockstep-heartbeat", daemon=True)
        self._heartbeat.start()

    def send(self, name: str, *args: Any) -> None:
        """Send one command to every other process (under ``lock``)."""
        payload = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
        message = _HEADER.pack(len(payload)) + payload
        with self.lock:
            for conn in self._conns:
                conn.sendall(message)
            self._last_send = time.monotonic()
            self.sent_bytes += len(message) * len(self._conns)
            self.sent_messages += 1

    @contextlib.contextmanager
    def command(self, name: str, *args: Any) -> Iterator[None]:
        """Send ``name(*args)`` and hold the order until the caller has issued the same call."""
        with self.lock:
            self.send(name, *args)
            yield

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """A section every process runs together: the others leave their command loop at its
        ``SYNC``; no engine call is issued here until it ends."""
        with self.lock:
            self.send(SYNC)
            yield

    def close(self) -> None:
        """Tell the others the engine stopped (``STOP``) and close the connections."""
        with self.lock:
            if self._closing:
                return
            self._closing = True  # before STOP: the others close their ends once they read it
            with contextlib.suppress(OSError):
                self.send(STOP)
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_WR)
        with contextlib.suppress(OSError):
            self._listener.close()

    def _beat(self) -> None:
        period = self.timeout_s / 4
        while not self._closing:
            time.sleep(min(period, 1.0))
            if self._closing:
                return
            if time.monotonic() - self._last_send >= period and self.lock.acquire(timeout=period):
                try:
                    if not self._closing:
                        self.send(PING)
                except OSError:
                    return  # a closed connection: its watcher ends the process
                finally:
                    self.lock.release()

    def _watch(self, conn: socket.socket, index: int) -> None:
        """Followers never send after their index: a read returns only when the connection ends."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if self._closing or data:
            return
        # Process 0 may be blocked inside a collective with the dead process, where no exception
        # reaches it: say why and leave, so the job restarts every process and the run resumes.
        print(
            f"[jaxrl] colocated engine: process {index} closed its connection (it died or was stopped); "
            f"process 0 exits ({EXIT_PEER_LOST}) so the job restarts every process; the run resumes from "
            "its last checkpoint",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_PEER_LOST)


class Follower:
    """Another process's end: the connection to process 0 and ``receive``."""

    def __init__(self, address: str, *, index: int, timeout_s: float):
        self.timeout_s = timeout_s
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while True:  # process 0 listens before it tells the address, but its host may be slow to resolve
            try:
                self._sock = socket.create_connection((host, int(port)), timeout=min(10.0, timeout_s))
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise LeaderLost(f"colocated engine: cannot reach process 0 at {address}: {e}") from None
                time.sleep(0.5)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(struct.pack("<I", index))
        self._sock.settimeout(timeout_s)

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """The next command other than a heartbeat; ``LeaderLost`` past the deadline or on a closed connection."""
        while True:
            try:
                (size,) = _HEADER.unpack(_recv_exact(self._sock, _HEADER.size))
                name, args = pickle.loads(_recv_exact(self._sock, size))
            except TimeoutError:
                raise LeaderLost(
                    f"colocated engine: no word from process 0 in {self.timeout_s:.0f} s "
                    "(inference.backend.colocated_timeout_s)"
                ) from None
            except (ConnectionError, OSError) as e:
                raise LeaderLost(f"colocated engine: process 0 closed the connection ({e})") from None
            if name != PING:
                return name, args

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class Replica:
    """A process other than 0 repeating process 0's engine calls on its own ``ModelRunner``.

    Weights: each process places the trainer's new parameters on the engine's shardings in the
    same section (``place``: a collective reshard, no host copy) and keeps them pending; the
    ``swap`` command installs them at the same point of the stream as on process 0."""

    def __init__(self, runner: Any, follower: Follower):
        self.runner = runner
        self.follower = follower
        self._pending: dict[int, Any] = {}
        self.stopped = False

    def place(self, state: Any, version: int) -> None:
        self._pending[version] = self.runner.place(state)

    def run_until(self, marker: str) -> str:
        """Repeat commands until ``marker`` (``SYNC`` or ``STOP``); returns the marker met. A
        ``STOP`` met first ends the engine here: later calls return at once."""
        if self.stopped:
            return STOP
        while True:
            name, args = self.follower.receive()
            if name == marker:
                return name
            if name == STOP:
                self.stopped = True
                return STOP
            if name == SYNC:
                raise RuntimeError(f"colocated engine: process 0 opened a section while this process waited for {marker}")
            if name not in RUNNER_CALLS:
                raise RuntimeError(f"colocated engine: unknown command {name!r} from process 0")
            if name == "swap":
                (version,) = args
                state = self._pending.pop(version)
                for old in [v for v in self._pending if v < version]:
                    del self._pending[old]
                self.runner.swap(state, version)
            else:
                getattr(self.runner, name)(*args)

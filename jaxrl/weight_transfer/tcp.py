"""Raw TCP: the wire format both transports speak, a threaded socket server, and the "tcp" transport.

The TCP transport is the standard library's sockets, one thread per connection, no library:
the job is to move large contiguous buffers between two hosts as fast as the link allows, and a
blocking ``sendall`` of a numpy buffer and ``recv_into`` straight into the destination array
do that with no copy in Python and the GIL released during the transfer. An RPC or messaging
library (gRPC, ZeroMQ, HTTP) would add framing, copies into its own messages and a dependency for
nothing this needs; asyncio would add an event loop to code that never waits on more than one
socket per thread.

Wire format (little-endian). A request is ``u32 length`` + a JSON object
``{"op": "get", "version": v, "items": [[param, shard box, region box], ...]}``. The reply is,
per item, ``u8 status, u64 length`` + payload: status 0, the region's bytes in row-major order;
status 1, a UTF-8 error message, after which the rest of the request's items are not sent (the
connection stays usable). A delta request, ``{"op": "delta", "version": v, "base": b,
"block_bytes": k, "items": [...]}``, is answered the same way, each payload being which of the region's
``k``-byte blocks changed (``delta.Changed``: ``u8`` kind, then a packed bitmap, little bit order,
or ``u64`` count and ``u32`` block indices) and then the bytes of its changed blocks, one after
another in order (``delta.py``).
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrl.weight_transfer.base import FetchFailed, RemoteError, ShardSource, WeightTransferError
from jaxrl.weight_transfer.bits import contiguous
from jaxrl.weight_transfer.delta import Changed, Patch, delta_payload_bytes, num_blocks
from jaxrl.weight_transfer.manifest import Box, local_slices
from jaxrl.weight_transfer.plan import Pull

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<I")
REPLY = struct.Struct("<BQ")
OK, ERROR = 0, 1
MAX_REQUEST = 64 << 20


# -- framing helpers (both transports) ---------------------------------------------------------


def request_item(item: Sequence[Any]) -> tuple[str, Box, Box]:
    """A request item ``[param, shard, region]`` as (param, shard box, region box); raises
    ``ValueError`` unless the region is a box inside the shard (numpy would clip a slice past
    the shard's end and serve other bytes than asked for)."""
    try:
        param, shard, region = str(item[0]), _box(item[1]), _box(item[2])
    except (TypeError, ValueError, IndexError) as e:
        raise ValueError(f"request item {item!r}: give [param, shard box, region box] ({e})") from e
    if len(region) != len(shard) or any(not (s0 <= r0 < r1 <= s1) for (r0, r1), (s0, s1) in zip(region, shard)):
        raise ValueError(f"request item for {param!r}: region {list(region)} is not inside shard {list(shard)}")
    return param, shard, region


def _box(value: Any) -> Box:
    return tuple((int(a), int(b)) for a, b in value)


def region_bytes(source: ShardSource, version: int, item: Sequence[Any]) -> np.ndarray:
    """The C-contiguous array of one request item ``[param, shard, region]`` (a view when the
    region is contiguous in the shard, else a copy)."""
    param, shard, region = request_item(item)
    array = source.shard(version, param, shard)
    return contiguous(array[local_slices(region, shard)])


def as_bytes(array: np.ndarray) -> memoryview:
    return memoryview(array.reshape(-1).view(np.uint8))


def send_request(sock: socket.socket, request: dict[str, Any], deadline: float) -> None:
    body = json.dumps(request).encode()
    settimeout(sock, deadline)
    sock.sendall(REQUEST.pack(len(body)) + body)


def read_request(sock: socket.socket) -> dict[str, Any] | None:
    """The next request on a server socket, None when the peer closed it."""
    head = recv_exact(sock, REQUEST.size, eof_ok=True)
    if head is None:
        return None
    (n,) = REQUEST.unpack(head)
    if n > MAX_REQUEST:
        raise ValueError(f"request of {n} bytes")
    return json.loads(recv_exact(sock, n))


def send_error(sock: socket.socket, message: str) -> None:
    body = message.encode()
    sock.sendall(REPLY.pack(ERROR, len(body)) + body)


def read_reply(sock: socket.socket, deadline: float) -> int:
    """The next reply header's payload length; raises ``RemoteError`` with the message of an error."""
    settimeout(sock, deadline)
    status, n = REPLY.unpack(recv_exact(sock, REPLY.size))
    if status != OK:
        raise RemoteError(recv_exact(sock, n).decode(errors="replace"))
    return n


def settimeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("weight pull deadline passed")
    sock.settimeout(left)


def recv_exact(sock: socket.socket, n: int, *, eof_ok: bool = False) -> Any:
    buf = bytearray(n)
    if not recv_into(sock, memoryview(buf)):
        if eof_ok:
            return None
        raise ConnectionError("connection closed by the peer")
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fill ``view`` (by ``deadline``, when given); False when the peer closed before the first
    byte, ``ConnectionError`` when it closed midway."""
    got = 0
    while got < len(view):
        if deadline is not None:
            settimeout(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionError(f"connection closed by the peer after {got} of {len(view)} bytes")
        got += n
    return True


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def open_socket(address: str, deadline: float) -> socket.socket:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("weight pull deadline passed")
    sock = socket.create_connection(parse_address(address), timeout=left)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


# -- a threaded socket server --------------------------------------------------------------------


class SocketServer:
    """Accepts connections on ``host:port`` (port 0: any free one) and runs ``handle(sock)`` for
    each in its own daemon thread until the peer closes it or ``stop``."""

    def __init__(
        self, handle: Callable[[socket.socket], None], host: str, port: int, advertise: str | None = None
    ):
        self._handle = handle
        self._listener = socket.create_server((host, port), backlog=128)
        self.address = f"{advertise or host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._stopping = False
        self._accepter = threading.Thread(
            target=self._accept, name=f"weights-accept-{self.address}", daemon=True
        )
        self._accepter.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # the listener was closed: stop
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopping:
                    sock.close()
                    return
                thread = threading.Thread(target=self._serve, args=(sock,), name="weights-conn", daemon=True)
                self._conns.add(sock)
                self._threads.add(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            self._handle(sock)
        except OSError:  # the peer went away, or stop() shut the socket
            pass
        except Exception:  # a malformed request: drop this connection, keep serving the others
            log.exception("weight transfer: dropped a connection to %s", self.address)
        finally:
            sock.close()
            with self._lock:
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the listener and every connection; wait for their threads."""
        with self._lock:
            self._stopping = True
            conns, threads = list(self._conns), list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._listener.close()
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accepter.join(timeout_s)
        for thread in threads:
            thread.join(timeout_s)


# -- TCP ---------------------------------------------------------------------------------------


class TcpTransport:
    """Raw bytes over TCP (see the module docstring)."""

    name = "tcp"

    def serve(self, source: ShardSource, host: str, port: int, advertise: str | None = None) -> SocketServer:
        def handle(sock: socket.socket) -> None:
            while (request := read_request(sock)) is not None:
                serve_get(sock, source, request)

        return SocketServer(handle, host, port, advertise)

    def connect(self, address: str, deadline: float) -> TcpConnection:
        return TcpConnection(open_socket(address, deadline))


def serve_get(sock: socket.socket, source: ShardSource, request: dict[str, Any]) -> None:
    op = request.get("op")
    if op not in ("get", "delta"):
        send_error(sock, f"unknown op {op!r}")
        return
    items = request.get("items")
    if not isinstance(items, list):
        send_error(sock, f"items {items!r}: give a list of [param, shard box, region box]")
        return
    for item in items:
        try:
            if op == "get":
                data = region_bytes(source, request["version"], item)
            else:
                parts = delta_parts(source, request, item)
        except (WeightTransferError, KeyError, TypeError, ValueError) as e:
            send_error(sock, str(e))
            return
        if op == "get":
            sock.sendall(REPLY.pack(OK, data.nbytes))
            sock.sendall(as_bytes(data))
            continue
        sock.sendall(REPLY.pack(OK, sum(len(p) for p in parts)))
        for part in parts:
            sock.sendall(part)


def delta_parts(source: ShardSource, request: dict[str, Any], item: Sequence[Any]) -> list[memoryview]:
    """A delta reply's payload: the packed bitmap, then the changed blocks' bytes, packed."""
    k = int(request["block_bytes"])
    if k < 1:
        raise ValueError(f"block_bytes {k}")
    param, shard, region = request_item(item)
    return [memoryview(p) for p in source.delta_of(request["version"], request["base"], param, shard, region, k)]


class TcpConnection:
    def __init__(self, sock: socket.socket):
        self._sock = sock

    def fetch(
        self,
        version: int,
        items: Sequence[tuple[Pull, np.ndarray | Patch]],
        deadline: float,
        delta: tuple[int, int] | None = None,
    ) -> None:
        request: dict[str, Any] = {
            "op": "get", "version": version, "items": [[p.param, p.shard, p.region] for p, _ in items]
        }  # fmt: skip
        if delta is not None:
            request |= {"op": "delta", "base": delta[0], "block_bytes": delta[1]}
        pull = items[0][0]
        try:
            send_request(self._sock, request, deadline)
            for pull, out in items:
                n = read_reply(self._sock, deadline)
                if delta is None:
                    assert isinstance(out, np.ndarray)
                    if n != out.nbytes:
                        raise WeightTransferError(f"the endpoint sent {n} bytes, {out.nbytes} expected")
                    if not recv_into(self._sock, as_bytes(out), deadline):
                        raise ConnectionError("connection closed by the peer")
                else:
                    assert isinstance(out, Patch)
                    self._read_delta(out, n, delta[1], deadline)
        except (OSError, WeightTransferError) as e:
            raise FetchFailed(pull, e) from e

    def _read_delta(self, patch: Patch, n: int, k: int, deadline: float) -> None:
        """One delta payload of ``n`` bytes written over the base's bytes into ``patch.out``."""
        out = patch.out
        head = 0

        def read(size: int) -> bytes:
            nonlocal head
            if head + size > n:
                raise WeightTransferError(f"the endpoint sent a delta of {n} bytes that its head does not fit")
            head += size
            return recv_exact(self._sock, size)

        try:
            changed = Changed.decode(read, num_blocks(out.nbytes, k))
        except ValueError as e:
            raise WeightTransferError(f"the endpoint sent a delta that does not describe its region: {e}") from e
        if head + delta_payload_bytes(changed, out.nbytes, k) != n:
            raise WeightTransferError(
                f"the endpoint sent a delta of {n} bytes that its changed blocks do not describe"
            )
        payload = np.empty(n - head, np.uint8)
        if payload.size and not recv_into(self._sock, memoryview(payload), deadline):
            raise ConnectionError("connection closed by the peer")
        patch.write(changed, k, payload)

    def close(self) -> None:
        shutdown(self._sock)


def shutdown(sock: socket.socket) -> None:
    """Close ``sock``, waking a thread blocked on it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()

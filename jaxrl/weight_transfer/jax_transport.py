"""``jax.experimental.transfer`` as a weight transport: the one that rides DCN between TPU slices.

Its data plane moves whole arrays: a server stages arrays under an integer id
(``TransferServer.await_pull(uuid, arrays)``) and a peer pulls them once
(``connect(address).pull(uuid, shapes)``), straight into its own device buffers. It has no way
to ask for a region of an array, and no way to ask for anything that was not staged. So a pull
here is two steps: a request on a small TCP control channel (``transport.py``'s framing, op
"stage") makes the publisher cut the requested regions from its host shards, put them on one of
its CPU devices and stage them under a fresh id; the reply carries the id and the transfer
server's address; the puller then pulls the arrays onto one of its CPU devices and copies them
into its buffers.

Found on jax 0.10.2, CPU (jaxlib's socket transport), two processes on one host:
- It works: several ids over one connection, bfloat16 and float32, arrays of any size.
- An id can be pulled once; a second pull of it fails with "SocketServer: Connection closed
  recv() == 0" and that connection is dead afterwards.
- ``pull(..., timeout=)`` is not honoured for an id that was never staged: the call blocks until
  the server process exits (seen: 21 s with timeout=3 s). The control channel avoids the case
  (an id is only pulled after the publisher staged it), and the puller waits on its threads with
  its own deadline, so a hung pull fails on time; the thread stays blocked until the peer dies.
- Ids must be unique on the pulling side too: two concurrent pulls of id 1 from two servers
  fail ("Error while transferring: Buffer id: 0 out of range 0"). Ids here are random 62-bit.
- A pull with another dtype than staged fails ("Async transfer object was deleted before
  transfers completed"); another shape with the same byte count silently reinterprets the bytes.
  The control channel states each array's shape and dtype, so neither happens here.
- Staged arrays stay until pulled: ``await_pull`` is given a timeout so a puller that dies
  between the two steps does not leave them staged.
"""

from __future__ import annotations

import datetime
import json
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any, cast

import jax
import numpy as np

from jaxrl.weight_transfer.base import FetchFailed, ShardSource, WeightTransferError
from jaxrl.weight_transfer.bits import copy_into
from jaxrl.weight_transfer.delta import Patch
from jaxrl.weight_transfer.plan import Pull
from jaxrl.weight_transfer.tcp import (
    OK,
    REPLY,
    SocketServer,
    open_socket,
    read_reply,
    read_request,
    recv_exact,
    region_bytes,
    send_error,
    send_request,
    shutdown,
)

TRANSFER_SIZE = 4 << 20
"""The transfer server's chunk size. Measured on this 2-core host (1 GiB bfloat16, two processes,
the raw pull): the default 256 MiB moves 0.17 GB/s, 16 MiB 0.33, 4 MiB 0.45, 1 MiB 0.44."""

STAGED_FOR = datetime.timedelta(minutes=10)
"""How long staged arrays wait for their pull before the transfer server drops them."""


def _cpu() -> Any:
    return jax.local_devices(backend="cpu")[0]


_local: dict[str, Any] = {}
_local_lock = threading.Lock()


def _transfer_server(host: str = "127.0.0.1") -> Any:
    """This process's transfer server (one, started on first use): a puller needs one to connect."""
    from jax.experimental import transfer

    with _local_lock:
        if "server" not in _local:
            _local["server"] = transfer.start_transfer_server(
                _cpu().client, f"{host}:0", [f"{host}:0"], transfer_size=TRANSFER_SIZE
            )
        return _local["server"]


class JaxTransferTransport:
    name = "jax"

    def serve(self, source: ShardSource, host: str, port: int, advertise: str | None = None) -> _JaxServer:
        from jax.experimental import transfer

        xfer = transfer.start_transfer_server(
            _cpu().client, f"{host}:0", [f"{host}:0"], transfer_size=TRANSFER_SIZE
        )
        address = xfer.address()
        if advertise:
            address = f"{advertise}:{address.rpartition(':')[2]}"

        def handle(sock: socket.socket) -> None:
            while (request := read_request(sock)) is not None:
                if request.get("op") != "stage":
                    send_error(sock, f"unknown op {request.get('op')!r}")
                    continue
                try:
                    pieces = [region_bytes(source, request["version"], item) for item in request["items"]]
                except (WeightTransferError, KeyError, TypeError, ValueError) as e:
                    send_error(sock, str(e))
                    continue
                uuid = secrets.randbits(
                    62
                )  # unique per puller: its transfer server keys incoming pulls by id
                arrays = jax.device_put(pieces, _cpu())
                xfer.await_pull(uuid, arrays, timeout=datetime.datetime.now() + STAGED_FOR)
                body = json.dumps({"uuid": uuid, "address": address}).encode()
                sock.sendall(REPLY.pack(OK, len(body)) + body)

        return _JaxServer(SocketServer(handle, host, port, advertise), xfer)

    def connect(self, address: str, deadline: float) -> JaxTransferConnection:
        return JaxTransferConnection(open_socket(address, deadline))


class _JaxServer:
    """The control server and the transfer server it stages into (jax has no call to stop one:
    it goes when the last reference does)."""

    def __init__(self, control: SocketServer, transfer: Any):
        self.address, self._control, self._transfer = control.address, control, transfer

    def stop(self) -> None:
        self._control.stop()
        self._transfer = None


class JaxTransferConnection:
    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._peers: dict[str, Any] = {}

    def fetch(
        self,
        version: int,
        items: Sequence[tuple[Pull, np.ndarray | Patch]],
        deadline: float,
        delta: tuple[int, int] | None = None,
    ) -> None:
        if delta is not None:
            raise FetchFailed(items[0][0], WeightTransferError("the jax transport sends whole versions, not deltas"))
        outs = [cast(np.ndarray, out) for _, out in items]  # whole versions: plain buffers
        request = {
            "op": "stage",
            "version": version,
            "items": [[p.param, p.shard, p.region] for p, _ in items],
        }
        try:
            send_request(self._sock, request, deadline)
            reply = json.loads(recv_exact(self._sock, read_reply(self._sock, deadline)))
            peer = self._peers.get(reply["address"])
            if peer is None:
                peer = self._peers[reply["address"]] = _transfer_server().connect(reply["address"])
            cpu = jax.sharding.SingleDeviceSharding(_cpu())
            shapes = [jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=cpu) for out in outs]
            # No timeout here: pull's own is not honoured (module docstring); the puller's
            # deadline bounds the wait on this thread.
            arrays = peer.pull(reply["uuid"], shapes)
        except (OSError, WeightTransferError, jax.errors.JaxRuntimeError) as e:
            raise FetchFailed(items[0][0], e) from e
        for out, x in zip(outs, arrays, strict=True):
            copy_into(out, np.asarray(x))

    def close(self) -> None:
        shutdown(self._sock)

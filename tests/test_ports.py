"""``jaxrl.ports.free_port``: a port a child process can bind, never one ``bind(0)`` hands out."""

from __future__ import annotations

import socket

from jaxrl.ports import EPHEMERAL_RANGE, free_port


def test_free_ports_are_bindable_and_below_the_ephemeral_range() -> None:
    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        for p in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))  # each was free
        assert held.getsockname()[1] >= low  # bind(0) picks from the range free_port stays out of

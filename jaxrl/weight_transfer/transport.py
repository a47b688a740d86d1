"""Transports by name: "tcp" (raw TCP, ``tcp.py``) or "jax" (``jax.experimental.transfer``,
``jax_transport.py``, imported only when asked for). Which is faster is measured by
bench/weight_transfer.py; both implement ``base.Transport``."""

from __future__ import annotations

from jaxrl.weight_transfer.base import Transport

TRANSPORTS = ("tcp", "jax")


def get_transport(name: str) -> Transport:
    if name == "tcp":
        from jaxrl.weight_transfer.tcp import TcpTransport

        return TcpTransport()
    if name == "jax":
        from jaxrl.weight_transfer.jax_transport import JaxTransferTransport

        return JaxTransferTransport()
    raise ValueError(f"unknown weight transport {name!r}: 'tcp' or 'jax'")

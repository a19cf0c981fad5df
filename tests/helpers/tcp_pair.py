"""A connected pair of real TCP sockets on loopback, for link and schedule tests."""

from __future__ import annotations

import socket

from node.pipeline.transport import connect, listen


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected (client, server) TCP pair on 127.0.0.1, port 0."""
    srv = listen("127.0.0.1", 0)
    srv.settimeout(10)
    try:
        a = connect("127.0.0.1", srv.getsockname()[1], timeout_s=10)
        b, _ = srv.accept()
    finally:
        srv.close()
    return a, b

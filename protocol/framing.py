"""Length-prefixed frames over a TCP byte stream: 4-byte big-endian length, then the payload.

A frame longer than the receiver's limit is refused before any of it is buffered, so a peer cannot make
a node allocate unbounded memory.
"""

from __future__ import annotations

import socket
import struct

from protocol.schema import ProtocolError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class FrameError(ProtocolError):
    """A frame was malformed or too large."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (cleanly, between frames)."""


def encode_frame(payload: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    if len(payload) > max_bytes:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the {max_bytes}-byte limit")
    return HEADER.pack(len(payload)) + payload


def send_frame(sock: socket.socket, payload: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """Write one frame; returns the bytes put on the wire."""
    if len(payload) > max_bytes:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the {max_bytes}-byte limit")
    sock.sendall(HEADER.pack(len(payload)))
    sock.sendall(payload)
    return HEADER.size + len(payload)


def _read_exact(sock: socket.socket, n: int, *, at_boundary: bool) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            if at_boundary and got == 0:
                raise ConnectionClosed("peer closed the connection")
            raise FrameError(f"connection closed mid-frame after {got} of {n} bytes")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Read one frame. Raises ConnectionClosed at a clean EOF, FrameError on a bad or oversized frame."""
    (length,) = HEADER.unpack(_read_exact(sock, HEADER.size, at_boundary=True))
    if length > max_bytes:
        raise FrameError(
            f"peer announced a {length}-byte frame, over the {max_bytes}-byte limit; "
            "it is misconfigured or not a Crucible peer"
        )
    return _read_exact(sock, length, at_boundary=False)

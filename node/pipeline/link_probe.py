"""Measured bandwidth and RTT to other nodes: a short, capped, authenticated probe on the pipeline port.

The prober opens a TCP connection to a peer's pipeline port and sends a signed `Hello` addressed to that
peer with `probe_bytes` set (protocol/messages.py): the acceptor authenticates it exactly like a pipeline
hello (signature, recipient, time window, no replay), so a stranger cannot use probes, and the node being
probed sends back two bytes, never a payload:

    prober                                   probed node
    Hello(probe_bytes=N)  --------------->   authenticate
                          <---------------   b"A"        rtt = time to here
    N bytes (paced by the prober's shaper) ->  read them (paced by its own shaper)
                          <---------------   b"D"        elapsed = first byte sent .. here

    mbps = N * 8 / (elapsed - rtt) / 1e6

Both ends pace with their node's emulated link (`--emulate-mbps`, the transport's `Shaper`), the same one
their pipeline links use, so tests can give nodes on one host different bandwidths. The timing is the
prober's own: a probed node cannot make itself look faster than it is to the node measuring it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import dataclass

from node.pipeline.transport import Shaper
from protocol.envelope import seal
from protocol.framing import encode_frame
from protocol.identity import Identity
from protocol.messages import MAX_PROBE_BYTES, Hello

log = logging.getLogger(__name__)

PROBE_RUN_ID = "probe"
"""The run id probe hellos carry (they are told apart by probe_bytes > 0, not by this)."""
CHUNK = 64 * 1024
ACK, DONE = b"A", b"D"


class ProbeError(RuntimeError):
    """The probe did not complete (refused, timed out, connection lost); the message says which."""


@dataclass(frozen=True)
class LinkMeasure:
    peer_id: str
    mbps: float
    rtt_ms: float
    at: float
    """time.monotonic() of the measurement."""


def _pace(shaper: Shaper, free_at: float, nbytes: int) -> float:
    """Sleep so that `nbytes` leave no faster than the shaper's rate; returns when the wire is free."""
    tx = shaper.transmit_s(nbytes)
    if tx <= 0:
        return free_at
    free_at = max(free_at, time.monotonic()) + tx
    time.sleep(max(0.0, free_at - time.monotonic()))
    return free_at


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProbeError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def probe_peer(
    identity: Identity,
    peer_id: str,
    host: str,
    port: int,
    *,
    nbytes: int = 1 << 20,
    shaper: Shaper | None = None,
    timeout_s: float = 30.0,
    sock: socket.socket | None = None,
) -> LinkMeasure:
    """Measure upload bandwidth and RTT to the node `peer_id` at host:port (module docstring), or over
    `sock` when given (a relayed connection to it, node/pipeline/fallback.py)."""
    if not 0 < nbytes <= MAX_PROBE_BYTES:
        raise ValueError(f"probe of {nbytes} bytes: must be 1..{MAX_PROBE_BYTES}")
    shaper = shaper or Shaper()
    hello = Hello(
        run_id=PROBE_RUN_ID,
        term=0,
        epoch=0,
        replica=0,
        stage=0,
        peer_id=identity.peer_id,
        to_peer_id=peer_id,
        sent_at=time.time(),
        probe_bytes=nbytes,
    )
    try:
        with sock or socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            sock.sendall(encode_frame(seal(identity, hello)))
            if _recv_exactly(sock, 1) != ACK:
                raise ProbeError("the peer did not acknowledge the probe")
            rtt = time.monotonic() - t0
            payload = bytes(CHUNK)
            start = free_at = time.monotonic()
            left = nbytes
            while left > 0:
                n = min(CHUNK, left)
                free_at = _pace(shaper, free_at, n)
                sock.sendall(payload[:n])
                left -= n
            if _recv_exactly(sock, 1) != DONE:
                raise ProbeError("the peer did not confirm the probe's bytes")
            elapsed = time.monotonic() - start
    except (OSError, ProbeError) as e:
        raise ProbeError(f"probe of {peer_id[-8:]} at {host}:{port} failed: {e}") from e
    # the DONE byte takes half an RTT to come back; the first bytes half an RTT to arrive
    busy = max(elapsed - rtt, elapsed * 0.05, 1e-6)
    return LinkMeasure(peer_id, nbytes * 8 / busy / 1e6, rtt * 1e3, time.monotonic())


def serve_probe(conn: socket.socket, hello: Hello, shaper: Shaper, timeout_s: float = 30.0) -> None:
    """The probed side, after the acceptor authenticated `hello`: acknowledge, read exactly
    hello.probe_bytes (paced by this node's emulated link), confirm, close. Sends 2 bytes in all."""
    deadline = time.monotonic() + timeout_s
    try:
        conn.settimeout(timeout_s)
        conn.sendall(ACK)
        left, free_at = hello.probe_bytes, time.monotonic()
        while left > 0:
            if time.monotonic() > deadline:
                raise ProbeError(f"probe from {hello.peer_id[-8:]} not complete within {timeout_s:.0f} s")
            chunk = conn.recv(min(CHUNK, left))
            if not chunk:
                raise ProbeError(
                    f"probe from {hello.peer_id[-8:]} closed after {hello.probe_bytes - left} bytes"
                )
            left -= len(chunk)
            free_at = _pace(shaper, free_at, len(chunk))
        conn.sendall(DONE)
    except (OSError, ProbeError) as e:
        log.info("probe from %s ended early: %s", hello.peer_id[-8:], e)
    finally:
        with contextlib.suppress(OSError):
            conn.close()

"""Opening a stage's link to its downstream neighbour: direct TCP, or through the relay when placement
says the neighbour cannot be dialed (its endpoint carries a relayed address); then the signed Hello,
the same on both transports, so the neighbour's acceptor applies one set of rules."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from node.pipeline.fallback import Fallback, FallbackError
from node.pipeline.relay_bridge import BridgeSession
from node.pipeline.transport import LinkError, connect
from protocol.envelope import seal
from protocol.framing import encode_frame
from protocol.identity import Identity
from protocol.messages import Assignment, Endpoint, Hello


@dataclass
class LinkRoute:
    """How a link reaches its neighbour: "direct" (TCP) or "relayed" (a libp2p stream through a relay)."""

    transport: str
    address: str
    """host:port, or the relayed stream's /p2p-circuit multiaddr."""
    session: BridgeSession | None = None
    """A relayed link's session (its resumes), None for TCP."""


def route_of(sock: socket.socket, fallback: Fallback | None) -> LinkRoute:
    """The route of a connection the acceptor handed over (relayed ones are local socket pairs)."""
    if sock.family == socket.AF_UNIX and fallback is not None:
        session = fallback.session_of(sock)
        return LinkRoute("relayed", session.address if session else "", session)
    try:
        host, port = sock.getpeername()[:2]
        return LinkRoute("direct", f"{host}:{port}")
    except OSError:
        return LinkRoute("direct", "")


def dial(
    to: Endpoint, name: str, fallback: Fallback | None, *, timeout_s: float, cancelled: Callable[[], bool]
) -> tuple[socket.socket, LinkRoute]:
    """A connection to `to`: through the relay when its endpoint names a relayed address."""
    if not to.relay_addr:
        sock = connect(to.host, to.port, timeout_s=timeout_s, cancelled=cancelled)
        return sock, LinkRoute("direct", f"{to.host}:{to.port}")
    if fallback is None:
        raise LinkError(
            f"{name} cannot be dialed (its pipeline port is unreachable) and this node has no relay: start it "
            "with --relay MULTIADDR (the relay `crucible-node bootstrap --relay-port` prints), without --no-relay"
        )
    try:
        sock, session = fallback.dial(to.relay_addr, name, timeout_s=timeout_s)
    except (FallbackError, ValueError) as e:  # a link that cannot open, like a refused TCP connect
        raise LinkError(f"could not reach {name} through the relay: {e}") from e
    return sock, LinkRoute("relayed", session.address, session)


def open_downstream(
    a: Assignment,
    identity: Identity,
    proof: bytes,
    start_step: int,
    fallback: Fallback | None,
    *,
    timeout_s: float,
    cancelled: Callable[[], bool],
) -> tuple[socket.socket, LinkRoute]:
    """Connect to the next stage and send the signed Hello: bound to the recipient and the time (not
    replayable elsewhere) and carrying our signed assignment (the next node holds only neighbours)."""
    assert a.next is not None
    name = f"{a.next.peer_id[-8:]} (stage {a.stage + 1})"
    sock, route = dial(a.next, name, fallback, timeout_s=timeout_s, cancelled=cancelled)
    hello = Hello(
        run_id=a.run_id,
        term=a.term,
        epoch=a.epoch,
        replica=a.replica,
        stage=a.stage,
        peer_id=identity.peer_id,
        start_step=start_step,
        to_peer_id=a.next.peer_id,
        sent_at=time.time(),
        assignment=proof,
    )
    sock.sendall(encode_frame(seal(identity, hello)))
    return sock, route

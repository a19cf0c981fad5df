"""node/pipeline/transport.py over real loopback sockets: the shaper's bandwidth and delay, frame limits on both
ends, malformed frames, and backpressure when the peer stops reading."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from node.pipeline.transport import Link, LinkError, Shaper
from protocol.framing import FrameError
from tests.helpers.tcp_pair import socket_pair

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def links() -> Iterator[list[Link]]:
    made: list[Link] = []
    yield made
    for link in made:
        link.close()


def _pair(made: list[Link], a: dict | None = None, b: dict | None = None) -> tuple[Link, Link]:
    sa, sb = socket_pair()
    la, lb = Link(sa, "b", **(a or {})), Link(sb, "a", **(b or {}))
    made += [la, lb]
    return la, lb


def _transfer_s(sender: Link, receiver: Link, n: int, size: int) -> float:
    frames = [bytes([i]) * size for i in range(n)]
    t = time.monotonic()
    for f in frames:
        sender.send(f, timeout_s=10)
    for f in frames:
        assert receiver.recv(10) == f
    return time.monotonic() - t


def test_shaper_limits_throughput(links: list[Link]) -> None:
    n, size, mbps = 25, 40_000, 8.0
    expected = n * (size + 4) * 8 / (mbps * 1e6)  # 1.0 s of serialization at 8 Mbit/s
    a, b = _pair(links, a={"shaper": Shaper(bandwidth_mbps=mbps)})
    elapsed = _transfer_s(a, b, n, size)
    assert expected * 0.9 <= elapsed < expected * 2 + 1.0, (elapsed, expected)
    assert a.bytes_sent == b.bytes_recv == n * (size + 4)
    # The same transfer unshaped takes a fraction of it: the shaper, not the socket, set the pace.
    c, d = _pair(links)
    assert _transfer_s(c, d, n, size) < expected * 0.5


def test_shaper_delays_each_frame_once(links: list[Link]) -> None:
    delay_s = 0.15
    a, b = _pair(links, b={"shaper": Shaper(delay_ms=delay_s * 1e3)})
    t = time.monotonic()
    for i in range(5):
        a.send(bytes([i]) * 100)
    assert b.recv(5) == bytes([0]) * 100
    first = time.monotonic() - t
    for i in range(1, 5):
        assert b.recv(5) == bytes([i]) * 100
    last = time.monotonic() - t
    # propagation delay: every frame arrives delay_s late, frames in flight do not add up
    assert delay_s * 0.95 <= first < delay_s + 1.0, first
    assert last < 2 * delay_s + 0.5, last


def test_recv_timeout_inside_the_delay_keeps_the_frame(links: list[Link]) -> None:
    a, b = _pair(links, b={"shaper": Shaper(delay_ms=300)})
    a.send(b"late")
    time.sleep(0.05)  # the frame is in b's inbox, not yet due
    with pytest.raises(LinkError, match="nothing received"):
        b.recv(0.05)
    assert b.recv(5) == b"late"


def test_oversize_frames_are_refused_on_both_sides(links: list[Link]) -> None:
    # sender side: refused before it is queued, and the link stays usable
    a, b = _pair(links, a={"max_frame_bytes": 1000})
    with pytest.raises(FrameError, match="exceeds the 1000-byte limit"):
        a.send(b"x" * 1001)
    a.send(b"ok")
    assert b.recv(5) == b"ok"

    # receiver side: the length prefix is refused before the payload is buffered; the link is dropped
    c, d = _pair(links, b={"max_frame_bytes": 1000})
    c.send(b"y" * 2000)
    with pytest.raises(LinkError, match="over the 1000-byte limit") as info:
        d.recv(5)
    assert isinstance(info.value.__cause__, FrameError)
    with pytest.raises(LinkError):  # the error stays
        d.recv(5)
    with pytest.raises(LinkError, match="broke"):  # and the peer's link too (d shut the connection down)
        c.recv(5)


@pytest.mark.parametrize(
    "garbage",
    [struct.pack(">I", 0xFFFF_FFFF), struct.pack(">I", 100) + b"only ten b"],
    ids=["length-4GiB", "truncated"],
)
def test_malformed_frame_closes_the_link(links: list[Link], garbage: bytes) -> None:
    raw, sock = socket_pair()
    link = Link(sock, "raw peer")
    links.append(link)
    raw.sendall(garbage)
    if len(garbage) > 4:
        raw.shutdown(socket.SHUT_WR)  # EOF in the middle of the frame
    with pytest.raises(LinkError, match="broke") as info:
        link.recv(5)
    assert isinstance(info.value.__cause__, FrameError)
    raw.settimeout(5)
    assert raw.recv(1) == b""  # the link closed its end
    raw.close()
    with pytest.raises(LinkError):
        link.send(b"after")


def test_send_blocks_when_the_peer_does_not_read(links: list[Link]) -> None:
    raw, sock = socket_pair()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    link = Link(sock, "silent peer", queue_depth=2)
    links.append(link)
    size, sent = 1 << 20, 0
    blocked_s = 0.0
    for _ in range(64):  # 64 MiB: far more than the socket buffers and the 2-frame queue hold
        t = time.monotonic()
        try:
            link.send(b"z" * size, timeout_s=0.5)
        except LinkError as e:
            assert "send queue stayed full" in str(e)
            blocked_s = time.monotonic() - t
            break
        sent += 1
    else:
        pytest.fail("64 sends of 1 MiB never blocked on a peer that reads nothing")
    assert blocked_s >= 0.45 and sent < 32, (blocked_s, sent)

    got = bytearray()

    def drain() -> None:
        raw.settimeout(10)
        while len(got) < (sent + 1) * (size + 4):
            chunk = raw.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    link.send(b"w" * size, timeout_s=10)  # the peer reads again: the queue drains and sends go through
    link.flush(10)
    reader.join(10)
    assert len(got) == (sent + 1) * (size + 4)  # every accepted frame arrived, the refused one was not queued
    assert link.bytes_sent == len(got)
    raw.close()

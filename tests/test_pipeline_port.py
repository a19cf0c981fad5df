"""The pipeline port and the health port under hostile clients, over real loopback sockets (issue 10,
finding 7): an accept loop that survives EMFILE, a total hello deadline (slowloris), a cap on connections
in their handshake, hellos that cannot be replayed or used for an older (term, epoch), bounded link
inboxes under a frame flood, and a health server that does not keep 1,000 half-open requests."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from node.health import HealthServer
from node.pipeline.acceptor import Acceptor
from node.pipeline.transport import Link, listen
from protocol.envelope import seal
from protocol.framing import HEADER, encode_frame
from protocol.identity import Identity
from protocol.messages import Hello
from tests.helpers.tcp_pair import socket_pair

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parent.parent


def _hello_frame(
    ident: Identity, *, to: str | None = None, sent_at: float | None = None, **over: int
) -> bytes:
    """A signed Hello frame from `ident`; addressed to peer `to` and stamped now (or `sent_at`) unless
    `to` is None (an unbound hello, for acceptors started without a peer id)."""
    fields: dict = {"run_id": "r", "term": 1, "epoch": 1, "replica": 0, "stage": 0} | over
    if to is not None:
        fields |= {"to_peer_id": to, "sent_at": time.time() if sent_at is None else sent_at}
    return encode_frame(seal(ident, Hello(**fields, peer_id=ident.peer_id)))


def _send(port: int, frame: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(frame)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """True once the server has closed its end (EOF or reset); reads and discards anything it sent."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:  # ECONNRESET: closed with unread data
        return True


def _wait_until(cond: Callable[[], bool], timeout_s: float, step_s: float = 0.02) -> float:
    """Seconds until cond() held; raises AssertionError after timeout_s."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - t0


@pytest.fixture
def acceptors() -> Iterator[list[Acceptor]]:
    made: list[Acceptor] = []
    yield made
    for acc in made:
        acc.close()


@pytest.fixture
def clients() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


# --- accept loop ------------------------------------------------------------------------------------
_EMFILE_CHILD = """
import os, resource, sys
from node.pipeline.acceptor import Acceptor
from node.pipeline.transport import listen

acc = Acceptor(listen("127.0.0.1", 0), hello_timeout_s=1.0)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 3, hard))
print(acc.port, flush=True)
hello, conn = acc.take("r", sys.argv[1], 0, 0, timeout_s=20)
print("taken", hello.peer_id, getattr(acc, "accept_errors", "?"), flush=True)
"""


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return proc.stdout.readline().strip()


def test_accept_loop_survives_emfile(clients: list[socket.socket]) -> None:
    """A child process whose descriptor limit leaves room for 3 connections: the 4th accept fails with
    EMFILE. The loop must pause, carry on, and hand over a good hello once descriptors are free."""
    ident = Identity.generate()
    proc = subprocess.Popen(
        [sys.executable, "-c", _EMFILE_CHILD, ident.peer_id],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = int(_readline(proc, 20) or "0")
        assert port, proc.stderr.read() if proc.poll() is not None else "child did not report its port"  # type: ignore[union-attr]
        for _ in range(8):  # more connections than the child has descriptors for
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)  # the child accepts 3, then accept() raises EMFILE
        for s in clients:  # free the child's descriptors: it reads EOF and closes its ends
            s.close()
        clients.clear()
        good = _send(port, _hello_frame(ident))
        clients.append(good)
        line = _readline(proc, 15)
        assert line.startswith("taken"), f"hello not taken after EMFILE; child said {line!r}"
        _, peer, errors = line.split()
        assert peer == ident.peer_id
        assert int(errors) >= 1, "the test did not make accept() fail"
        proc.wait(10)
        assert proc.returncode == 0
        assert proc.stderr is not None
        assert "accept failed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


# --- handshake deadline and caps -------------------------------------------------------------------
def test_slowloris_hello_is_dropped_at_the_total_deadline(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    acc = Acceptor(listen("127.0.0.1", 0), hello_timeout_s=1.0)
    acceptors.append(acc)
    ident = Identity.generate()
    frame = _hello_frame(ident)
    slow = socket.create_connection(("127.0.0.1", acc.port), timeout=5)
    clients.append(slow)
    t0 = time.monotonic()
    closed_after = None
    for b in frame:  # one byte every 0.25 s: each recv is quick, the whole hello would take ~50 s
        try:
            slow.sendall(bytes([b]))
        except OSError:
            closed_after = time.monotonic() - t0
            break
        time.sleep(0.25)
        if _closed_by_server(slow):
            closed_after = time.monotonic() - t0
            break
        slow.setblocking(True)
        if time.monotonic() - t0 > 4.0:
            break
    assert closed_after is not None, "a hello trickled at 4 bytes/s was still held after 4 s"
    assert 0.9 <= closed_after <= 2.5, closed_after
    assert acc.rejected == 1
    # the port still serves: a prompt hello from the same peer is handed over
    clients.append(_send(acc.port, frame))
    hello, conn = acc.take("r", ident.peer_id, 0, 0, timeout_s=5)
    conn.close()
    assert hello.peer_id == ident.peer_id


def test_half_open_flood_is_bounded_in_count_and_time(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    """300 connections that send 1 byte of a frame header: at most the default `max_pending` (64) are
    held at any time, the rest are dropped at once; the held ones go at the 2 s deadline; a good hello
    sent during the flood is still handed over."""
    deadline_s = 2.0
    acc = Acceptor(listen("127.0.0.1", 0), hello_timeout_s=deadline_s)
    acceptors.append(acc)
    n, cap = 300, 64
    t0 = time.monotonic()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", acc.port), timeout=5)
        s.sendall(b"\x00")
        clients.append(s)
    ident = Identity.generate()
    clients.append(_send(acc.port, _hello_frame(ident)))
    hello, conn = acc.take("r", ident.peer_id, 0, 0, timeout_s=5)
    conn.close()
    assert hello.peer_id == ident.peer_id
    # by count: long before the deadline, all but the cap have been closed
    _wait_until(lambda: sum(_closed_by_server(s) for s in clients[:n]) >= n - cap, 0.5)
    assert time.monotonic() - t0 < deadline_s - 0.5, "the flood itself was too slow to tell count from time"
    # by time: every one of them is closed shortly after the handshake deadline
    _wait_until(lambda: all(_closed_by_server(s) for s in clients[:n]), deadline_s + 1.5)
    assert acc.dropped >= n - cap
    assert acc.dropped + acc.rejected == n
    assert acc.pending == 0


def test_held_connections_are_capped(acceptors: list[Acceptor], clients: list[socket.socket]) -> None:
    """Valid hellos that nobody takes (any stranger can sign one) are held at most `max_held` at a time."""
    me = Identity.generate()
    acc = Acceptor(listen("127.0.0.1", 0), peer_id=me.peer_id, max_held=8, keep_s=30)
    acceptors.append(acc)
    for i in range(20):
        clients.append(_send(acc.port, _hello_frame(Identity.generate(), to=me.peer_id, replica=i)))
    _wait_until(lambda: acc.held + acc.dropped == 20, 5)
    assert acc.held == 8 and acc.dropped == 12
    _wait_until(lambda: sum(_closed_by_server(s) for s in clients) == 12, 5)


# --- hello binding: recipient, time, replay, (term, epoch) ---------------------------------------
def test_replayed_or_stale_hello_is_refused(acceptors: list[Acceptor], clients: list[socket.socket]) -> None:
    upstream, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    acc_b = Acceptor(listen("127.0.0.1", 0), peer_id=b.peer_id, max_skew_s=30)
    acc_c = Acceptor(listen("127.0.0.1", 0), peer_id=c.peer_id, max_skew_s=30)
    acceptors += [acc_b, acc_c]

    def refused(acc: Acceptor, frame: bytes, **take: int) -> bool:
        before = acc.rejected
        s = _send(acc.port, frame)
        clients.append(s)
        _wait_until(lambda: _closed_by_server(s), 5)
        with pytest.raises(TimeoutError):
            acc.take("r", upstream.peer_id, 0, 0, timeout_s=0.1, **take)
        return acc.rejected == before + 1

    captured = _hello_frame(upstream, to=b.peer_id)
    clients.append(_send(acc_b.port, captured))
    hello, conn = acc_b.take("r", upstream.peer_id, 0, 0, timeout_s=5, term=1, epoch=1)
    conn.close()
    assert hello.to_peer_id == b.peer_id

    assert refused(acc_b, captured)  # the same hello again, to its recipient
    assert refused(acc_c, captured)  # to another node
    assert refused(acc_b, _hello_frame(upstream, to=""))  # addressed to no one
    assert refused(acc_b, _hello_frame(upstream, to=b.peer_id, sent_at=time.time() - 600))  # old
    assert refused(acc_b, _hello_frame(upstream, to=b.peer_id, sent_at=time.time() + 600))  # future
    impostor = Identity.generate()  # signs a hello that names the upstream peer
    forged = Hello(
        run_id="r", term=1, epoch=1, replica=0, stage=0, peer_id=upstream.peer_id, to_peer_id=b.peer_id
    )
    assert refused(acc_b, encode_frame(seal(impostor, forged)))

    # (term, epoch): a hello for an older assignment is closed; the current one or a newer one is taken
    s = _send(acc_b.port, _hello_frame(upstream, to=b.peer_id, term=2, epoch=0))
    clients.append(s)
    _wait_until(lambda: acc_b.held == 1, 5)
    with pytest.raises(TimeoutError):
        acc_b.take("r", upstream.peer_id, 0, 0, timeout_s=0.1, term=2, epoch=1)
    assert _wait_until(lambda: _closed_by_server(s), 5) >= 0
    clients.append(_send(acc_b.port, _hello_frame(upstream, to=b.peer_id, term=3, epoch=0)))
    hello, conn = acc_b.take("r", upstream.peer_id, 0, 0, timeout_s=5, term=2, epoch=1)
    conn.close()
    assert (hello.term, hello.epoch) == (3, 0)


def test_clock_skew_is_measured_with_the_injected_clock(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    upstream, me = Identity.generate(), Identity.generate()
    skewed = Acceptor(
        listen("127.0.0.1", 0), peer_id=me.peer_id, max_skew_s=30, clock=lambda: time.time() + 120
    )
    acceptors.append(skewed)
    s = _send(skewed.port, _hello_frame(upstream, to=me.peer_id))
    clients.append(s)
    _wait_until(lambda: _closed_by_server(s), 5)
    assert skewed.rejected == 1
    s = _send(skewed.port, _hello_frame(upstream, to=me.peer_id, sent_at=time.time() + 100))
    clients.append(s)
    hello, conn = skewed.take("r", upstream.peer_id, 0, 0, timeout_s=5)
    conn.close()


# --- link inbox ----------------------------------------------------------------------------------
def test_frame_flood_is_backpressured_by_a_bounded_inbox() -> None:
    """A peer floods 256 KiB frames that the stage never receives: the link stops reading after its
    inbox bound (default 64 frames), so the flooder blocks; nothing is lost once the stage reads."""
    raw, sock = socket_pair()
    link = Link(sock, "flooder")
    size, limit = 256 * 1024, 128 << 20
    frame = HEADER.pack(size) + b"f" * size
    raw.settimeout(0.5)
    sent = 0
    try:
        with pytest.raises(TimeoutError):
            while sent < limit:
                raw.sendall(frame)
                sent += len(frame)
        assert sent < limit // 2, f"the link read {sent >> 20} MiB without its stage taking a frame"
        assert link.inbox_len == 64
        got = 0
        raw.settimeout(5)
        for _ in range(sent // len(frame)):
            assert link.recv(5) == b"f" * size
            got += 1
        assert got >= 64
    finally:
        link.close()
        raw.close()


# --- health server -------------------------------------------------------------------------------
def test_health_server_bounds_half_open_requests(clients: list[socket.socket]) -> None:
    """1,000 requests whose head never ends: at most max_connections are open at once, all are closed
    by the request deadline, and /health answers throughout."""
    health = HealthServer(
        "127.0.0.1", 0, lambda: {"peer_id": "p", "state": "idle"}, max_connections=32, request_timeout_s=1.0
    )
    try:
        n = 1000
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", health.port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: the head never ends
            clients.append(s)
        with urllib.request.urlopen(f"http://127.0.0.1:{health.port}/health", timeout=5) as r:
            assert r.status == 200
        _wait_until(lambda: sum(_closed_by_server(s) for s in clients) >= n - 32, 1.0)
        assert health.open_connections <= 32 + 1
        _wait_until(lambda: all(_closed_by_server(s) for s in clients), 2.5)
        assert health.dropped >= n - 32 - 1 and health.timed_out >= 1
        assert health.dropped + health.timed_out >= n
        _wait_until(lambda: health.open_connections == 0, 2.0)
        with urllib.request.urlopen(f"http://127.0.0.1:{health.port}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        health.close()

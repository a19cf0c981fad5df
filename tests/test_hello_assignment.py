"""Issue 21, acceptance 7: hellos name the assignment. A pipeline hello carries the sender's signed
assignment putting the receiving node right downstream of it (node/pipeline/hello_proof.py), so the
acceptor holds neighbours only: 70 validly signed hellos from fresh identities are refused and the real
neighbour's held connection survives (without the rule they evict it). Over real loopback sockets, with
real signatures and certificates, and the sender's lookup against a real S3 server (moto)."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from node.pipeline import acceptor as acceptor_module
from node.pipeline.acceptor import HELLO_MAX_BYTES, Acceptor
from node.pipeline.hello_proof import check, find_sealed
from node.pipeline.link_probe import PROBE_RUN_ID, probe_peer
from node.pipeline.transport import listen
from protocol import keys
from protocol.envelope import open_envelope, seal
from protocol.framing import HEADER, encode_frame
from protocol.identity import Identity
from protocol.messages import Assignment, Endpoint, Hello
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, RunSpec
from protocol.schema import ProtocolError
from protocol.trust.assignment_archive import encode_archive
from protocol.trust.delegation import OperatorTrust, issue

pytestmark = pytest.mark.timeout(60)
OPERATOR = Identity.from_seed(bytes([21]) * 32)
TRUST = OperatorTrust.of({OPERATOR.public_key})
COORD = Identity.from_seed(bytes([22]) * 32)
"""A coordinator key the operator certified for RID (the usual signer of assignments)."""
ME = Identity.from_seed(bytes([23]) * 32)
"""The receiving node: stage 1 of replica 0."""
UP = Identity.from_seed(bytes([24]) * 32)
"""Its real upstream neighbour: stage 0 of replica 0."""
RID = "hello-proof"
SPEC = RunSpec(run_id=RID, replicas=2, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2))


def _cert(run: str = RID) -> bytes:
    return issue(OPERATOR, COORD.peer_id, expires_at=time.time() + 3600, run=run)


def _assignment(
    peer: str = UP.peer_id,
    *,
    stage: int = 0,
    nxt: str | None = ME.peer_id,
    term: int = 1,
    epoch: int = 1,
    spec: RunSpec = SPEC,
    **over: object,
) -> Assignment:
    fields: dict = dict(
        run_id=spec.run_id, term=term, epoch=epoch, peer_id=peer, replica=0, stage=stage,
        layers=list(spec.layer_ranges()[stage]), spec=spec,
        next=None if nxt is None else Endpoint(peer_id=nxt, host="127.0.0.1", port=1),
        stage_peers={str(r): Identity.generate().peer_id for r in range(spec.replicas)},
        issued_at=time.time(), certificate=_cert(spec.run_id),
    )  # fmt: skip
    return Assignment(**(fields | over))


def _hello(sender: Identity, proof: bytes = b"", **over: object) -> Hello:
    fields: dict = dict(
        run_id=RID, term=1, epoch=1, replica=0, stage=0, peer_id=sender.peer_id, to_peer_id=ME.peer_id,
        sent_at=time.time(), assignment=proof,
    )  # fmt: skip
    return Hello(**(fields | over))


def _frame(sender: Identity, proof: bytes = b"", **over: object) -> bytes:
    return encode_frame(seal(sender, _hello(sender, proof, **over)))


def _wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.02)


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


def _send(clients: list[socket.socket], port: int, frame: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(frame)
    clients.append(s)
    return s


def _flood(n: int) -> list[bytes]:
    """n validly signed hellos from fresh identities, cycling through what a stranger can put in them."""
    real = seal(COORD, _assignment())  # the neighbour's real assignment, as anyone reads it in the DHT
    frames = []
    for i in range(n):
        me = Identity.generate()
        proof = [
            b"",  # none
            real,  # copied: names UP, not the sender
            seal(me, _assignment(me.peer_id, certificate=b"")),  # signed by itself: uncertified
            seal(me, _assignment(me.peer_id)),  # with the coordinator's certificate copied: for another key
        ][i % 4]
        frames.append(_frame(me, proof, replica=i % 2, stage=0))
    return frames


# --- acceptance 7 -------------------------------------------------------------------------------------
def test_seventy_signed_hellos_from_fresh_identities_do_not_evict_the_real_neighbour(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    flood = _flood(70)
    neighbour = _frame(UP, seal(COORD, _assignment()))

    # without the rule (today's acceptor: any validly signed hello is held), the flood evicts the neighbour
    before = Acceptor(listen("127.0.0.1", 0), peer_id=ME.peer_id)
    acceptors.append(before)
    _send(clients, before.port, neighbour)
    _wait_until(lambda: before.held == 1)
    for frame in flood:
        _send(clients, before.port, frame)
    _wait_until(lambda: before.held + before.dropped == 71)
    with pytest.raises(TimeoutError):
        before.take(RID, UP.peer_id, 0, 0, timeout_s=0.2, term=1, epoch=1)

    # with the node's trust rule: every stranger is refused on arrival, the neighbour is held and taken
    acc = Acceptor(listen("127.0.0.1", 0), peer_id=ME.peer_id, trust=TRUST)
    acceptors.append(acc)
    up = _send(clients, acc.port, neighbour)
    _wait_until(lambda: acc.held == 1)
    for i, frame in enumerate(flood, 1):
        _send(clients, acc.port, frame)
        if i % 20 == 0:  # in bursts the handshake cap (64) would drop some before they are refused
            _wait_until(lambda: acc.rejected == i)  # noqa: B023 (called before i changes)
    _wait_until(lambda: acc.rejected == 70)
    assert acc.held == 1 and acc.dropped == 0
    hello, conn = acc.take(RID, UP.peer_id, 0, 0, timeout_s=5, term=1, epoch=1)
    with conn:
        assert hello.peer_id == UP.peer_id
        up.sendall(b"activations")  # the connection handed over is the neighbour's own, still open
        conn.settimeout(5)
        assert conn.recv(64) == b"activations"


# --- the rule, reason by reason -----------------------------------------------------------------------
def _refused(hello: Hello, match: str, held: tuple[int, int] | None = None) -> None:
    with pytest.raises(ProtocolError, match=match):
        check(hello, TRUST, ME.peer_id, now=time.time(), held=held)


def test_a_hello_proves_a_neighbour_only_with_the_sender_s_trusted_assignment_naming_this_node() -> None:
    a = _assignment()
    got = check(_hello(UP, seal(COORD, a)), TRUST, ME.peer_id, now=time.time())
    assert got == a
    operator_signed = _assignment(certificate=b"")  # the operator's key signs without a certificate
    assert (
        check(_hello(UP, seal(OPERATOR, operator_signed)), TRUST, ME.peer_id, now=time.time())
        == operator_signed
    )
    # newer than what this node holds: the sender saw its next assignment first
    assert check(_hello(UP, seal(COORD, a)), TRUST, ME.peer_id, now=time.time(), held=(1, 0)) == a

    stranger = Identity.generate()
    _refused(_hello(UP), "carries no assignment naming this node")
    _refused(_hello(UP, b"\x93junk"), "carries an assignment that is refused")
    _refused(_hello(UP, seal(stranger, _assignment(certificate=b""))), "uncertified")
    _refused(_hello(UP, seal(COORD, _assignment(certificate=_cert("other-run")))), "wrong scope")
    _refused(
        _hello(UP, seal(COORD, _assignment(issued_at=time.time() + 3 * 3600))), "ahead of this host.s clock"
    )
    _refused(_hello(stranger, seal(COORD, a)), f"does not name {stranger.peer_id} .copied")
    listed = _assignment(stage_peers={"0": UP.peer_id, "1": stranger.peer_id})  # another replica's node
    _refused(_hello(stranger, seal(COORD, listed)), f"the assignment of {UP.peer_id}, not its own")
    _refused(_hello(UP, seal(COORD, _assignment(nxt=stranger.peer_id))), "not this node")
    _refused(_hello(UP, seal(COORD, _assignment(stage=1, nxt=None))), "puts no node downstream")
    _refused(_hello(UP, seal(COORD, a), stage=1), "but its assignment is for run")
    _refused(_hello(UP, seal(COORD, a), epoch=2), "but its assignment is for run")
    _refused(_hello(UP, seal(COORD, a)), "older than the assignment this node holds", held=(1, 2))


def test_hellos_refused_on_arrival_for_an_older_assignment_than_this_node_holds(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    acc = Acceptor(listen("127.0.0.1", 0), peer_id=ME.peer_id, trust=TRUST)
    acceptors.append(acc)
    with pytest.raises(TimeoutError):  # the worker holds term 2 epoch 1 (take tells the acceptor)
        acc.take(RID, UP.peer_id, 0, 0, timeout_s=0.05, term=2, epoch=1)
    _send(clients, acc.port, _frame(UP, seal(COORD, _assignment())))  # term 1: superseded
    _wait_until(lambda: acc.rejected == 1)
    assert acc.held == 0
    _send(clients, acc.port, _frame(UP, seal(COORD, _assignment(term=3, epoch=0)), term=3, epoch=0))
    hello, conn = acc.take(RID, UP.peer_id, 0, 0, timeout_s=5, term=2, epoch=1)
    conn.close()
    assert (hello.term, hello.epoch) == (3, 0)


def test_a_hello_without_assignment_is_taken_only_while_the_worker_waits_for_its_sender(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    """The sender could not read its assignment from the store (or runs an older build): the receiver's
    own trusted assignment names it, so it is handed over while take() waits for it, and refused else."""
    acc = Acceptor(listen("127.0.0.1", 0), peer_id=ME.peer_id, trust=TRUST)
    acceptors.append(acc)
    _send(clients, acc.port, _frame(UP))
    _wait_until(lambda: acc.rejected == 1)
    got: list[Hello] = []

    def take() -> None:
        hello, conn = acc.take(RID, UP.peer_id, 0, 0, timeout_s=10, term=1, epoch=1)
        conn.close()
        got.append(hello)

    taker = threading.Thread(target=take)
    taker.start()
    _wait_until(lambda: bool(acc._wanted))
    _send(clients, acc.port, _frame(UP))
    taker.join(10)
    assert got and got[0].peer_id == UP.peer_id and not got[0].assignment


# --- probes -------------------------------------------------------------------------------------------
def test_probes_keep_working_and_cannot_make_a_neighbour_s_hello_replayable(
    acceptors: list[Acceptor],
    clients: list[socket.socket],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A probe carries no assignment (any node may measure any other) and is never held. Probes and
    pipeline hellos are remembered for replay apart, and refused hellos not at all: with room for 8
    remembered hellos, 20 probes and 20 refused hellos leave the neighbour's captured hello refused."""
    monkeypatch.setattr(acceptor_module, "SEEN_HELLOS_MAX", 8)
    acc = Acceptor(listen("127.0.0.1", 0), peer_id=ME.peer_id, trust=TRUST, max_probes=64)
    acceptors.append(acc)
    assert probe_peer(Identity.generate(), ME.peer_id, "127.0.0.1", acc.port, nbytes=4096).mbps > 0
    captured = _frame(UP, seal(COORD, _assignment()))
    _send(clients, acc.port, captured)
    acc.take(RID, UP.peer_id, 0, 0, timeout_s=5, term=1, epoch=1)[1].close()
    for frame in _flood(20):
        _send(clients, acc.port, frame)
    probes = [
        encode_frame(seal(p, _hello(p, run_id=PROBE_RUN_ID, term=0, epoch=0, probe_bytes=1)))
        for p in (Identity.generate() for _ in range(20))
    ]
    for frame in probes:
        _send(clients, acc.port, frame).sendall(b"\x00")
    _wait_until(lambda: acc.rejected == 20 and acc.probes_served == 21)
    time.sleep(1.1)  # the acceptor logs a refusal at most once a second
    with caplog.at_level(logging.WARNING, logger="node.pipeline.acceptor"):
        _send(clients, acc.port, captured)  # the replay, within the skew window
        _wait_until(lambda: acc.rejected == 21)
    assert "already used by an earlier connection (replayed)" in caplog.text
    assert acc.held == 0
    # a probe naming a pipeline run is refused: a probe is told apart by its form, not only probe_bytes
    stranger = Identity.generate()
    _send(clients, acc.port, encode_frame(seal(stranger, _hello(stranger, probe_bytes=1))))
    _wait_until(lambda: acc.rejected == 22)
    with pytest.raises(ValueError, match="must be empty in a probe"):
        _hello(UP, seal(COORD, _assignment()), probe_bytes=1)


# --- size ---------------------------------------------------------------------------------------------
def test_a_large_run_s_hello_fits_and_announced_bytes_in_handshake_are_bounded(
    acceptors: list[Acceptor], clients: list[socket.socket]
) -> None:
    """A 2,000-replica run's assignment (over the old 64 KiB hello limit) is carried and accepted; 12
    connections announcing 4 MiB hellos reserve at most max_pending_bytes: the oldest are dropped."""
    big_spec = RunSpec(
        run_id=RID, replicas=2000, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2)
    )
    proof = seal(COORD, _assignment(spec=big_spec))
    assert len(proof) > 64 * 1024
    acc = Acceptor(
        listen("127.0.0.1", 0), peer_id=ME.peer_id, trust=TRUST, max_pending_bytes=HELLO_MAX_BYTES * 3
    )
    acceptors.append(acc)
    for _ in range(12):
        _send(clients, acc.port, HEADER.pack(HELLO_MAX_BYTES))
    _wait_until(lambda: acc.dropped == 9)
    _send(clients, acc.port, _frame(UP, proof))
    hello, conn = acc.take(RID, UP.peer_id, 0, 0, timeout_s=5, term=1, epoch=1)
    conn.close()
    assert hello.assignment == proof
    with listen("127.0.0.1", 0) as srv, pytest.raises(ValueError, match="max_pending_bytes"):
        Acceptor(srv, peer_id=ME.peer_id, max_pending_bytes=1 << 20)
    with listen("127.0.0.1", 0) as srv, pytest.raises(ValueError, match="trust needs peer_id"):
        Acceptor(srv, trust=TRUST)


# --- the sender's side: its sealed assignment from the store's archives ------------------------------
@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="hello-proof"))
    s.ensure_bucket()
    return s


def test_the_sender_finds_its_sealed_assignment_in_the_archives(
    store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Laid out as coordinator/run_publisher.py writes them: (term 1, epoch 1) placed, epoch 2 re-placed
    other slots and re-archived this one unchanged; a new leader re-issued it under term 2 in its archive of
    epoch 5. The node holds the body it decoded from the DHT; it finds the envelope its coordinator sealed."""
    spec = RunSpec(run_id=f"hp-{uuid.uuid4().hex[:8]}", replicas=2, stages=2, model=SPEC.model)
    a1 = _assignment(spec=spec)
    other = _assignment(Identity.generate().peer_id, stage=1, nxt=None, spec=spec, epoch=2)
    store.put(keys.assign_key(spec.run_id, 1, 1), encode_archive(COORD, [a1]))
    store.put(keys.assign_key(spec.run_id, 1, 2), encode_archive(COORD, [other, a1]))
    store.put(keys.assign_key(spec.run_id, 1, 3), b"\x93 junk where an archive belongs")
    a2 = _assignment(spec=spec, term=2, epoch=3)
    store.put(keys.assign_key(spec.run_id, 2, 5), encode_archive(COORD, [other, a2]))

    for a in (a1, a2):
        held = open_envelope(
            seal(COORD, a, expires_at=time.time() + 60), Assignment
        ).body  # as the DHT gave it
        sealed = find_sealed(store, held)
        assert open_envelope(sealed, Assignment).body == a
        assert (
            check(
                _hello(UP, sealed, run_id=a.run_id, term=a.term, epoch=a.epoch),
                TRUST,
                ME.peer_id,
                now=time.time(),
            )
            == a
        )

    with caplog.at_level(logging.WARNING, logger="node.pipeline.hello_proof"):
        assert find_sealed(store, _assignment(spec=spec, term=1, epoch=3)) == b""  # junk at (1, 3) skipped
    assert "in none of the store's archives" in caplog.text

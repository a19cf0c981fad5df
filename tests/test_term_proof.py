"""Issue 21, terms with proof (acceptance 3): a certified key that does not hold the run's lease signs an
assignment with a higher term, for a run that was never launched, and dated hours ahead; the node refuses
each, naming the reason, and follows the real leader, through a takeover too. The rule is
protocol/trust/run_authority.py: the operator launched the run, the signer holds the store's lease of the
assignment's term, and the assignment was issued within that lease.

Real S3 server (moto), real DHT, real leases taken with coordinator/lease.py, the node's own
`AssignmentSource` (node/daemon.py); the forgeries are validly signed under valid certificates."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from coordinator.lease import launch, try_acquire
from protocol import keys
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Assignment, RunRecord, RunState, TermClaim
from protocol.net.dht_client import DHTClient
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, RunSpec
from protocol.trust import run_authority as ra
from protocol.trust.delegation import FUTURE_DATED, NOT_LAUNCHER, OperatorTrust, RefusalLog, Untrusted, issue

pytestmark = pytest.mark.timeout(120)
OPERATOR = Identity.from_seed(bytes([21]) * 32)
TRUST = OperatorTrust.of({OPERATOR.public_key})
HOUR = 3600.0


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="term-proof"))
    s.ensure_bucket()
    return s


@pytest.fixture(scope="module")
def dht() -> Iterator[DHTClient]:
    d = DHTClient(OPERATOR)
    try:
        yield d
    finally:
        d.shutdown()


@dataclass
class Key:
    """A coordinator key the operator certified (for every run unless `run` says one)."""

    run: str = "*"
    ident: Identity = field(default_factory=Identity.generate)

    def __post_init__(self) -> None:
        self.cert = issue(OPERATOR, self.ident.peer_id, expires_at=time.time() + 24 * HOUR, run=self.run)

    @property
    def peer_id(self) -> str:
        return self.ident.peer_id

    def take(self, store: ObjectStore, rid: str, *, lease_s: float = 600, at: float | None = None) -> int:
        held = try_acquire(store, self.ident, rid, lease_s, now=at, trusted=TRUST, certificate=self.cert)
        assert held is not None
        return held.lease.term


def spec_of(rid: str) -> RunSpec:
    return RunSpec(run_id=rid, replicas=1, stages=1, model=ModelSpec(d_model=32, n_layers=2, n_heads=2))


def assignment(
    by: Key, rid: str, peer: str, *, term: int, epoch: int = 1, at: float | None = None
) -> Assignment:
    return Assignment(
        run_id=rid, term=term, epoch=epoch, peer_id=peer, replica=0, stage=0, layers=[0, 2], spec=spec_of(rid),
        stage_peers={"0": peer}, issued_at=time.time() if at is None else at, certificate=by.cert,
    )  # fmt: skip


def launched(dht: DHTClient, store: ObjectStore) -> str:
    rid = f"run-{uuid.uuid4().hex[:8]}"
    launch(dht, store, OPERATOR, RunRecord(spec=spec_of(rid), updated=time.time()))
    return rid


def refusal(store: ObjectStore, by: Key, a: Assignment) -> tuple[str, str] | None:
    """(reason, why) the rule gives for `a` signed by `by` (None: it directs the run), read afresh."""
    try:
        ra.RunAuthority(store, TRUST).check(open_envelope(seal(by.ident, a), Assignment))
    except Untrusted as e:
        return e.reason, e.why
    return None


def test_only_the_lease_holder_of_a_launched_run_directs_it(dht: DHTClient, store: ObjectStore) -> None:
    rid, peer, now = launched(dht, store), Identity.generate().peer_id, time.time()
    deposed, leader = Key(), Key()
    assert deposed.take(store, rid, lease_s=30, at=now - HOUR) == 1  # led an hour ago, then died
    assert leader.take(store, rid) == 2  # the real leader
    held = f"the run's lease is at term 2, held by {leader.peer_id}"

    assert refusal(store, leader, assignment(leader, rid, peer, term=2)) is None
    # the deposed leader (its certificate still valid) signs a higher term: the message proves nothing
    assert refusal(store, deposed, assignment(deposed, rid, peer, term=999)) == (
        ra.NOT_LEADER,
        f"{deposed.peer_id} does not hold the lease of term 999: {held}",
    )
    # ... and writes a valid claim of term 3 for itself (a certified key can): the lease still decides
    claim = TermClaim(run_id=rid, term=3, holder=deposed.peer_id, claimed_at=now, certificate=deposed.cert)
    store.put(keys.term_key(rid, 3), seal(deposed.ident, claim))
    assert refusal(store, deposed, assignment(deposed, rid, peer, term=3)) == (
        ra.NOT_LEADER,
        f"{deposed.peer_id} does not hold the lease of term 3: {held}",
    )
    # its own old term, dated back into its old lease: over
    old = assignment(deposed, rid, peer, term=1, epoch=50, at=now - HOUR + 10)
    assert refusal(store, deposed, old) == (ra.DEPOSED, f"term 1 is over: {held}")
    # the leader's own term, backdated to before it claimed it
    early = refusal(store, leader, assignment(leader, rid, peer, term=2, at=now - 2 * HOUR))
    assert early is not None and early[0] == ra.OUTSIDE_LEASE and "before term 2 was claimed" in early[1]
    # a store writer overwrites the term's claim with another key's: not that term's leader
    other = TermClaim(run_id=rid, term=2, holder=deposed.peer_id, claimed_at=now, certificate=deposed.cert)
    store.put(keys.term_key(rid, 2), seal(deposed.ident, other))
    assert refusal(store, leader, assignment(leader, rid, peer, term=2)) == (
        ra.NOT_LEADER,
        f"term 2 was claimed by {deposed.peer_id}, not by {leader.peer_id}",
    )
    store.put(keys.term_key(rid, 2), b"junk")  # junk there decides nothing: the lease does
    assert refusal(store, leader, assignment(leader, rid, peer, term=2)) is None

    # a holder whose lease ran out an hour ago, nobody having taken over, signs now: outside its lease
    lapsed = launched(dht, store)
    assert leader.take(store, lapsed, lease_s=30, at=now - HOUR) == 1
    late = refusal(store, leader, assignment(leader, lapsed, peer, term=1))
    assert late is not None and late[0] == ra.OUTSIDE_LEASE and "after the lease of term 1 ran out" in late[1]

    # a launched run nobody leads, or whose lease object is junk
    unled = launched(dht, store)
    assert refusal(store, leader, assignment(leader, unled, peer, term=1)) == (
        ra.NO_LEASE,
        f"run {unled} has no lease a trusted coordinator holds: there is no {unled}/lease in the store",
    )
    store.put(keys.lease_key(unled), b"\x00junk")
    no_lease = refusal(store, leader, assignment(leader, unled, peer, term=1))
    assert no_lease is not None and no_lease[0] == ra.NO_LEASE


def test_a_run_the_operator_never_launched_is_refused_even_to_its_lease_holder(store: ObjectStore) -> None:
    """The certified key takes the lease of a run nobody launched (conditional writes let it: no lease is
    live), then signs a launch itself; only the operator's key, or a key certified for that run alone,
    launches a run."""
    ghost, peer = f"ghost-{uuid.uuid4().hex[:8]}", Identity.generate().peer_id
    intruder = Key()
    assert intruder.take(store, ghost) == 1
    a = assignment(intruder, ghost, peer, term=1)
    assert refusal(store, intruder, a) == (
        ra.NOT_LAUNCHED,
        f"run {ghost} was not launched by the operator: there is no {ghost}/launch in the store "
        "(the operator launches runs: crucible-coordinator launch)",
    )
    record = RunRecord(spec=spec_of(ghost), updated=time.time(), certificate=intruder.cert)
    store.put(keys.launch_key(ghost), seal(intruder.ident, record))
    got = refusal(store, intruder, a)
    assert got is not None and got[0] == NOT_LAUNCHER and "a key certified for run" in got[1], got
    store.put(keys.launch_key(ghost), b"\x93junk")
    got = refusal(store, intruder, a)
    assert got is not None and got[0] == ra.NOT_LAUNCHED and "is not a signed launch" in got[1], got
    # dated hours ahead, even by the operator: refused
    ahead = RunRecord(spec=spec_of(ghost), updated=time.time() + 3 * HOUR)
    store.put(keys.launch_key(ghost), seal(OPERATOR, ahead))
    got = refusal(store, intruder, a)
    assert got is not None and got[0] == FUTURE_DATED, got
    # the operator certified a key for this run alone: that key's launch counts
    launcher = Key(run=ghost)
    record = RunRecord(spec=spec_of(ghost), updated=time.time(), certificate=launcher.cert)
    store.put(keys.launch_key(ghost), seal(launcher.ident, record))
    assert refusal(store, intruder, a) is None


def test_a_node_refuses_each_forgery_naming_why_and_follows_the_real_leader(
    dht: DHTClient, store: ObjectStore, caplog: pytest.LogCaptureFixture
) -> None:
    """All at once in the node's DHT key: the real leader's assignment (term 2), the deposed leader's at
    term 999, an intruder's for a run never launched (it even holds that run's lease), another certified
    key's dated three hours ahead. The node takes the real one and says why not each other; after a real
    takeover it follows the new leader (term 3), and refuses what the old one still signs."""
    from node.daemon import AssignmentSource

    rid, node, now = launched(dht, store), Identity.generate(), time.time()
    deposed, leader, intruder, ahead = Key(), Key(), Key(), Key()
    assert deposed.take(store, rid, lease_s=30, at=now - HOUR) == 1
    assert leader.take(store, rid, lease_s=30) == 2
    ghost = f"ghost-{uuid.uuid4().hex[:8]}"
    assert intruder.take(store, ghost) == 1
    real = assignment(leader, rid, node.peer_id, term=2)
    planted = [
        (leader, real),
        (deposed, assignment(deposed, rid, node.peer_id, term=999)),
        (intruder, assignment(intruder, ghost, node.peer_id, term=1)),
        (ahead, assignment(ahead, rid, node.peer_id, term=2, epoch=9, at=now + 3 * HOUR)),
    ]
    for by, a in planted:
        assert dht.publish(keys.assignment_key(node.peer_id), a, 60, signer=by.ident)

    refusals = RefusalLog(logging.getLogger("node.daemon"))
    source = AssignmentSource(node.peer_id, dht, store, TRUST, refusals)
    with caplog.at_level(logging.INFO, logger="node.daemon"):
        got = source.pick(None)
        assert got is not None and (got.run_id, got.term, got.epoch) == (rid, 2, 1)
        assert source.pick(got) is None  # nothing newer counts: it keeps following the leader
    said = [r.getMessage() for r in caplog.records]
    for line in (
        f"ignoring Assignment of run {rid} term 999 epoch 1 signed by {deposed.peer_id}: {deposed.peer_id} "
        f"does not hold the lease of term 999: the run's lease is at term 2, held by {leader.peer_id}",
        f"ignoring Assignment of run {ghost} term 1 epoch 1 signed by {intruder.peer_id}: run {ghost} was not "
        "launched by the operator",
        f"ignoring Assignment signed by {ahead.peer_id}: it is dated",
    ):
        assert sum(m.startswith(line) for m in said) == 1, (line, said)
    assert {ra.NOT_LEADER, ra.NOT_LAUNCHED, FUTURE_DATED} <= set(refusals.by_reason)
    assert source.last_ignored is not None and source.last_ignored["reason"]

    # the leader dies; another certified key takes over at term 3 once its lease ran out
    successor = Key()
    assert successor.take(store, rid, at=now + 31) == 3
    new = assignment(successor, rid, node.peer_id, term=3)
    assert dht.publish(keys.assignment_key(node.peer_id), new, 60, signer=successor.ident)
    stale = assignment(leader, rid, node.peer_id, term=2, epoch=7)  # the old leader goes on signing
    assert dht.publish(keys.assignment_key(node.peer_id), stale, 60, signer=leader.ident)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="node.daemon"):
        got = source.pick(got)
    assert got is not None and (got.term, got.epoch) == (3, 1)
    assert any(
        m.startswith(
            f"ignoring Assignment of run {rid} term 2 epoch 7 signed by {leader.peer_id}: term 2 is over"
        )
        for m in (r.getMessage() for r in caplog.records)
    ), caplog.text

    # the old leader says the run is over, dated after the new leader's word: it does not lead the run now,
    # so its nodes go on; the new leader's record counts
    def say(by: Key, state: RunState, updated: float) -> None:
        rec = RunRecord(spec=spec_of(rid), state=state, updated=updated, certificate=by.cert)
        assert dht.publish(keys.RUNS_KEY, rec, 60, signer=by.ident, name=rid)

    assert source.run_state(rid) == "pending"  # the operator's launch
    say(leader, "stopped", time.time() + 1)
    say(successor, "stopping", time.time())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="node.daemon"):
        assert source.run_state(rid) == "stopping"
    assert (
        f"ignoring RunRecord of run {rid} (stopped) signed by {leader.peer_id}: {leader.peer_id} does not "
        f"hold the run's lease: it is at term 3, held by {successor.peer_id}" in caplog.text
    )

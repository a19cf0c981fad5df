"""Lease fencing (issue 10 finding 4) against the real S3 server: terms strictly increase, a live lease is
respected whoever holds it, and forged, garbage or absurd lease objects neither block nor reset the term."""

from __future__ import annotations

import time
import uuid

import pytest

from coordinator.lease import MAX_LEASE_S, renew, try_acquire
from protocol import keys
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment, Lease
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, RunSpec
from protocol.trust.assignment_archive import encode_archive

OPERATOR = Identity.from_seed(bytes([7]) * 32)  # coordinators sign with one trusted key


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="lease-fencing"))
    s.ensure_bucket()
    return s


def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:8]}"


def test_a_second_process_with_the_same_key_does_not_share_a_live_lease(store: ObjectStore) -> None:
    rid = run_id()
    first = try_acquire(store, OPERATOR, rid, 30)
    assert first is not None and first.lease.term == 1
    assert try_acquire(store, OPERATOR, rid, 30) is None  # same key, other process: the lease is live
    assert renew(store, OPERATOR, first, 30) is not None  # the holder keeps renewing at its term


def test_a_takeover_after_a_crash_is_a_new_term(store: ObjectStore) -> None:
    rid = run_id()
    crashed = try_acquire(store, OPERATOR, rid, 30)
    assert crashed is not None
    later = try_acquire(store, OPERATOR, rid, 30, now=time.time() + 60)  # same key restarted, lease expired
    assert later is not None and later.lease.term == crashed.lease.term + 1
    assert renew(store, OPERATOR, crashed, 30) is None  # the crashed incarnation is fenced off


def test_a_stranger_s_lease_blocks_nothing(store: ObjectStore) -> None:
    """Anyone with store credentials could write a lease expiring in the year 30,000 (the schema now caps
    expiries; this one is in 2255)."""
    rid = run_id()
    stranger = Identity.generate()
    forged = Lease(run_id=rid, term=5, holder=stranger.peer_id, expires_at=9e9)  # year 2255
    store.put(keys.lease_key(rid), seal(stranger, forged))
    held = try_acquire(store, OPERATOR, rid, 30)
    assert held is not None and held.lease.holder == OPERATOR.peer_id


def test_a_trusted_lease_claiming_the_far_future_is_not_believed(store: ObjectStore) -> None:
    rid = run_id()
    absurd = Lease(run_id=rid, term=3, holder=OPERATOR.peer_id, expires_at=time.time() + 10 * MAX_LEASE_S)
    store.put(keys.lease_key(rid), seal(OPERATOR, absurd))
    held = try_acquire(store, OPERATOR, rid, 30)
    assert held is not None and held.lease.term == 4


def test_a_garbage_lease_object_does_not_reset_the_term(store: ObjectStore) -> None:
    rid = run_id()
    held = try_acquire(store, OPERATOR, rid, 30)
    assert held is not None
    # a holder that reached term 7 archived its assignments (its claims are gone); only signed ones count
    spec = RunSpec(run_id=rid, replicas=1, stages=1, model=ModelSpec(d_model=32, n_layers=2, n_heads=2))
    peer = Identity.generate().peer_id
    seven = Assignment(
        run_id=rid, term=7, epoch=1, peer_id=peer, replica=0, stage=0, layers=[0, 2], spec=spec,
        stage_peers={"0": peer},
    )  # fmt: skip
    store.put(keys.assign_key(rid, 7, 1), encode_archive(OPERATOR, [seven]))
    store.put(keys.lease_key(rid), b"\x00garbage")
    taken = try_acquire(store, OPERATOR, rid, 30)
    assert taken is not None and taken.lease.term == 8  # above every term already used, not back to 1
    store.put(keys.lease_key(rid), b"x" * (1 << 20))  # an oversized object is overwritten unread
    again = try_acquire(store, OPERATOR, rid, 30)
    assert again is not None and again.lease.term == 9


@pytest.mark.parametrize("dropped", [False, True], ids=["all-replicas", "replica-1-dropped-out"])
def test_a_coordinator_taking_over_a_running_run_adopts_its_placement(
    store: ObjectStore, dropped: bool
) -> None:
    """Issue 10 finding 4, last part: the new holder of a running run's lease had no placement and raised
    AssertionError on every tick. It now adopts the placement, assignments and epoch the previous holder
    archived in the store, under a higher term, and its tick goes on. A replica that had dropped out (the
    survivors' newest assignments leave it out of stage_peers) stays out under the new holder."""
    import msgpack

    from coordinator.service import Coordinator
    from protocol.messages import Assignment, RunRecord
    from protocol.net.dht_client import DHTClient, dht_time
    from protocol.runspec import ModelSpec, RunSpec

    rid = run_id()
    spec = RunSpec(run_id=rid, replicas=2, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2))
    nodes = {(r, s): Identity.generate().peer_id for r in range(2) for s in range(2)}
    crashed = try_acquire(store, OPERATOR, rid, 30, now=time.time() - 100)  # the old holder's lease lapsed
    assert crashed is not None and crashed.lease.term == 1

    def assignment(r: int, s: int, epoch: int, replicas: int) -> bytes:
        return seal(
            OPERATOR,
            Assignment(
                run_id=rid, term=1, epoch=epoch, peer_id=nodes[(r, s)], replica=r, stage=s,
                layers=list(spec.layer_ranges()[s]), spec=spec,
                stage_peers={str(rr): nodes[(rr, s)] for rr in range(replicas)},
            ),
        )  # fmt: skip

    # dropped: the survivors (replica 0) were re-assigned at epoch 3 without replica 1, whose nodes still
    # hold their epoch-2 assignments
    archive = [
        assignment(r, s, 2, 2) if dropped and r == 1 else assignment(r, s, 3, 1 if dropped else 2)
        for r, s in nodes
    ]
    store.put(keys.assign_key(rid, 1, 3), msgpack.packb(archive))
    dht = DHTClient(OPERATOR)
    try:
        record = RunRecord(
            spec=spec, state="running", term=1, coordinator=OPERATOR.peer_id, updated=dht_time()
        )
        assert dht.publish(keys.RUNS_KEY, record, 60, name=rid)
        coord = Coordinator(OPERATOR, dht, store, lease_s=15)
        coord.tick()
        coord.tick()  # the nodes are gone (no adverts): it tries to rebuild, and goes on
        run = coord.runs[rid]
        assert run.lease.lease.term == 2
        assert run.placement is not None and run.placement.slots == nodes
        assert run.epoch == 3 and set(run.assignments) == set(nodes.values())
        assert run.dropped == ({1} if dropped else set())
    finally:
        dht.shutdown()


def test_forged_garbage_or_oversized_control_objects_do_not_stop_a_run(store: ObjectStore) -> None:
    """Issue 10 finding 2, store side: any holder of store credentials can write a run's control object.
    A stop signed by a stranger, garbage and a 1 MiB object are ignored (the oversized one unread) and the
    coordinator's tick goes on; the operator's signed stop then stops the run."""
    from coordinator.service import Coordinator
    from protocol.messages import RunControl, RunRecord
    from protocol.net.dht_client import DHTClient, dht_time
    from protocol.runspec import ModelSpec, RunSpec

    rid = run_id()
    spec = RunSpec(run_id=rid, replicas=2, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2))
    dht = DHTClient(OPERATOR)
    try:
        record = RunRecord(spec=spec, state="pending", term=0, coordinator="", updated=dht_time())
        assert dht.publish(keys.RUNS_KEY, record, 60, name=rid)
        coord = Coordinator(OPERATOR, dht, store, lease_s=15)
        coord.tick()
        assert coord.runs[rid].record.state == "pending"  # no nodes: nothing placed yet
        stop = RunControl(run_id=rid, action="stop", issued_at=time.time())
        down0 = store.bytes_down
        for planted in (seal(Identity.generate(), stop), b"\x93garbage", b"\0" * (1 << 20)):
            store.put(keys.control_key(rid), planted)
            coord.tick()
            assert coord.runs[rid].record.state == "pending"
        assert store.bytes_down - down0 < 1 << 20  # the oversized object was refused from its size
        store.put(keys.control_key(rid), seal(OPERATOR, stop))
        coord.tick()
        assert coord.runs[rid].record.state == "stopped"
    finally:
        dht.shutdown()

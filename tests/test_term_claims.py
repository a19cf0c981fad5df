"""Issue 21, term claims: anyone with the store's credentials may write any key, so whatever sits under a
run's `{run}/terms/` and `{run}/assign/` counts for the term floor only when a trusted coordinator signed it
under a canonical name, in range; the rest is ignored and counted, and the lease still fails over. And the
coordinator's tick isolates runs: what one run's handling raises never stops another's takeover.

Real S3 server (moto), real DHT, real `Coordinator` objects; faults injected on purpose."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from coordinator import service
from coordinator.lease import MAX_CLAIM_BYTES, MAX_TERM_STEP, claim_refusal, try_acquire
from coordinator.metrics import coordinator_families
from coordinator.service import Coordinator
from protocol import keys
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment, RunRecord, TermClaim
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, RunSpec
from protocol.trust.assignment_archive import MAX_ARCHIVE_TRIES, encode_archive, read_archive
from protocol.trust.delegation import OperatorTrust, issue

OPERATOR = Identity.from_seed(bytes([7]) * 32)  # the coordinators sign with the operator's key
STRANGER = Identity.generate()


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="term-claims"))
    s.ensure_bucket()
    return s


@pytest.fixture
def dht() -> Iterator[DHTClient]:
    client = DHTClient(OPERATOR)
    try:
        yield client
    finally:
        client.shutdown()


def spec_of(rid: str) -> RunSpec:
    return RunSpec(run_id=rid, replicas=1, stages=1, model=ModelSpec(d_model=32, n_layers=2, n_heads=2))


def launched(dht: DHTClient, rid: str) -> None:
    record = RunRecord(spec=spec_of(rid), state="pending", term=0, coordinator="", updated=dht_time())
    assert dht.publish(keys.RUNS_KEY, record, 60, name=rid)


def claim(rid: str, term: int, *, signer: Identity = OPERATOR, run: str = "") -> bytes:
    body = TermClaim(run_id=run or rid, term=term, holder=signer.peer_id, claimed_at=time.time())
    return seal(signer, body)


def archive(rid: str, term: int, signer: Identity = OPERATOR) -> bytes:
    peer = Identity.generate().peer_id
    a = Assignment(
        run_id=rid, term=term, epoch=1, peer_id=peer, replica=0, stage=0, layers=[0, 2], spec=spec_of(rid),
        stage_peers={"0": peer},
    )  # fmt: skip
    return encode_archive(signer, [a])


def poison(store: ObjectStore, rid: str) -> None:
    """Every kind of junk at once, the real claim of term 1 among it."""
    terms, assign = keys.terms_prefix(rid), keys.assign_prefix(rid)
    planted = {
        f"{terms}9223372036854775807": claim(rid, 2**63 - 1),  # the issue's key, even validly signed
        keys.term_key(rid, 2**53): claim(rid, 2**53),  # above MAX_TERM
        keys.term_key(rid, 10 * MAX_TERM_STEP): claim(rid, 10 * MAX_TERM_STEP),  # out of reach
        f"{terms}-3": b"x",
        f"{terms}+5": claim(rid, 5),
        f"{terms}007": claim(rid, 7),  # non-canonical names of in-range terms
        f"{terms}0000009": claim(rid, 9),
        f"{terms}{'9' * 40}": b"x",
        f"{terms}abc": b"",
        keys.term_key(rid, 2): b"\x00garbage",  # at the next term to claim: replaced
        keys.term_key(rid, 3): OPERATOR.peer_id.encode(),  # the unsigned body claims had before
        keys.term_key(rid, 4): claim(rid, 4, signer=STRANGER),
        keys.term_key(rid, 5): claim(rid, 5, run="other-run"),
        keys.term_key(rid, 6): claim(rid, 9),  # another term's claim
        keys.term_key(rid, 8): b"\0" * (MAX_CLAIM_BYTES + 1),
        keys.assign_key(rid, 2**63 - 1, 1): archive(rid, 1),
        f"{assign}007-000001": archive(rid, 7),
        f"{assign}000010": b"x",
        f"{assign}abc": b"x",
        keys.assign_key(rid, 10, 1): b"\x93 not an archive",
        keys.assign_key(rid, 11, 1): archive(rid, 11, signer=STRANGER),
        keys.assign_key(rid, 12, 1): archive(rid, 3),  # assignments of another term
    }
    for key, blob in planted.items():
        store.put(key, blob)


def test_poisoned_term_claims_and_archive_keys_do_not_stop_a_takeover(
    store: ObjectStore, dht: DHTClient
) -> None:
    """Before: `terms/9223372036854775807` made every standby's tick raise (term 2**63 is no Lease term),
    and any junk name raised the floor. Now the takeover after a crash takes term 2, every kind of junk is
    counted by reason, and the next takeover takes term 3 (the claim of term 2 is the taker's, signed)."""
    rid = f"run-{uuid.uuid4().hex[:8]}"
    crashed = try_acquire(store, OPERATOR, rid, 30, now=time.time() - 100)  # claims term 1, then dies
    assert crashed is not None and crashed.lease.term == 1
    poison(store, rid)
    launched(dht, rid)
    coord = Coordinator(OPERATOR, dht, store, lease_s=15)
    coord.tick()
    assert coord.events["leases_taken"] == 1 and coord.events["run_failures"] == 0
    assert coord.runs[rid].lease.lease.term == 2
    blob = store.get(keys.term_key(rid, 2))
    assert blob is not None and claim_refusal(blob, rid, 2, OperatorTrust.of({OPERATOR.public_key})) is None
    assert coord.ignored.by_reason == {
        "term_claim_name": 6,
        "term_claim_range": 3,
        "term_claim_unsigned": 2,
        "term_claim_untrusted": 1,
        "term_claim_mismatch": 2,
        "term_claim_size": 1,
        "archive_name": 3,
        "archive_range": 1,
        "archive_unsigned": 1,
        "archive_untrusted": 1,
        "archive_mismatch": 1,
    }
    rejected = next(f for f in coordinator_families(coord, None) if f.name == "crucible_rejected_inputs")
    assert sum(s.value for s in rejected.samples if s.labels["source"] == "store_key") == 22
    later = try_acquire(store, OPERATOR, rid, 30, now=time.time() + 60)  # the new holder crashed too
    assert later is not None and later.lease.term == 3


def test_an_archive_signed_by_a_trusted_coordinator_still_raises_the_floor(store: ObjectStore) -> None:
    """Claims lost (or unsigned, as before this change), the lease garbage: the newest signed archive
    still sets the floor, above the junk claims at its term."""
    rid = f"run-{uuid.uuid4().hex[:8]}"
    store.put(keys.term_key(rid, 5), OPERATOR.peer_id.encode())
    store.put(keys.assign_key(rid, 5, 2), archive(rid, 5))
    store.put(keys.lease_key(rid), b"\x00garbage")
    held = try_acquire(store, OPERATOR, rid, 30)
    assert held is not None and held.lease.term == 6


def test_junk_archives_do_not_hide_the_placement_a_new_leader_adopts(store: ObjectStore) -> None:
    """What a new leader adopts (`read_archive`): the newest archive that holds signed assignments of the
    run, by canonical (term, epoch); non-canonical names are not candidates, and junk, a stranger's or
    another run's archive under a newer canonical name is skipped, at one GET each, up to MAX_ARCHIVE_TRIES."""
    rid = f"run-{uuid.uuid4().hex[:8]}"
    real = archive(rid, 3)
    store.put(keys.assign_key(rid, 3, 1), real)
    store.put(keys.assign_prefix(rid) + "abc", archive(rid, 9))  # sorts last, not an archive's name
    store.put(keys.assign_prefix(rid) + "999999-999999x", real)
    store.put(keys.assign_key(rid, 4, 1), b"\x00junk")
    store.put(keys.assign_key(rid, 4, 2), archive(rid, 4, signer=STRANGER))
    store.put(keys.assign_key(rid, 5, 1), archive(f"{rid}-other", 5))
    got = read_archive(store, spec_of(rid), {OPERATOR.public_key})
    assert got is not None and [a.term for a in got] == [3]
    # beyond MAX_ARCHIVE_TRIES newer junk archives the reader gives up (bounded work), and says so
    for e in range(MAX_ARCHIVE_TRIES):
        store.put(keys.assign_key(rid, 6, e + 1), b"junk")
    assert read_archive(store, spec_of(rid), {OPERATOR.public_key}) is None


def test_a_run_whose_handling_raises_does_not_stop_another_run_s_takeover(
    store: ObjectStore, dht: DHTClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Run A raises while its lease is taken, run B (which this coordinator leads) while it is placed;
    run C is taken over in the same ticks. Each cause is counted at every tick and logged once."""
    a, b, c = (f"run-{n}-{uuid.uuid4().hex[:6]}" for n in "abc")
    for rid in (a, b, c):
        launched(dht, rid)
    coord = Coordinator(OPERATOR, dht, store, lease_s=15)
    real_acquire, real_place = service.try_acquire, coord.placer.place

    def acquire(store_: ObjectStore, identity: Identity, rid: str, *args: Any, **kw: Any) -> Any:
        if rid == a:
            raise RuntimeError("a poisoned store answer")
        return real_acquire(store_, identity, rid, *args, **kw)

    def place(run: Any, adverts: Any) -> None:
        if run.record.spec.run_id == b:
            raise KeyError("a bug this run's state reaches")
        real_place(run, adverts)

    monkeypatch.setattr(service, "try_acquire", acquire)
    monkeypatch.setattr(coord.placer, "place", place)
    with caplog.at_level(logging.DEBUG, logger="coordinator.service"):
        coord.tick()
        coord.tick()
    assert set(coord.runs) == {b, c} and coord.events["leases_taken"] == 2
    assert coord.runs[c].record.reason.startswith("waiting for nodes")  # C is led and placed as usual
    assert coord.events["run_failures"] == 4  # A and B, at each tick
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert any(m.startswith(f"run {a}: taking the lease failed") for m in errors)
    assert any(m.startswith(f"run {b}: leading the run failed") for m in errors)


def test_a_standby_takes_over_a_poisoned_run_and_a_clean_one_within_the_lease_time(
    store: ObjectStore, dht: DHTClient
) -> None:
    """Issue 21 acceptance 4: the leader of two runs (a coordinator the operator certified) holds both
    leases at term 1 and dies; run A's terms/ holds the claims 2^63-1 and 999999 and junk. A standby
    ticking every second holds both runs within the lease time + 5 s of the crash, each at term 2."""
    lease_s = 4.0
    leader = Identity.generate()
    cert = issue(OPERATOR, leader.peer_id, expires_at=time.time() + 3600)
    trust = OperatorTrust.of({OPERATOR.public_key})
    a, b = (f"run-{n}-{uuid.uuid4().hex[:6]}" for n in "ab")
    for rid in (a, b):
        launched(dht, rid)
        held = try_acquire(store, leader, rid, lease_s, trusted=trust, certificate=cert)
        assert held is not None and held.lease.term == 1
    crashed_at = time.monotonic()  # the leader renews nothing from here on
    terms = keys.terms_prefix(a)
    store.put(f"{terms}9223372036854775807", claim(a, 2**63 - 1))
    store.put(keys.term_key(a, 999999), claim(a, 999999))
    store.put(f"{terms}junk", b"\x00junk")
    store.put(keys.term_key(a, 2), b"\x00garbage")  # at the next term to claim: replaced
    standby = Coordinator(OPERATOR, dht, store, lease_s=lease_s)
    while set(standby.runs) != {a, b} and time.monotonic() - crashed_at < lease_s + 10:
        standby.tick()
        time.sleep(1.0)
    took_s = time.monotonic() - crashed_at
    assert set(standby.runs) == {a, b}, standby.runs
    assert took_s <= lease_s + 5, took_s
    assert [standby.runs[rid].lease.lease.term for rid in (a, b)] == [2, 2]
    assert standby.events["run_failures"] == 0

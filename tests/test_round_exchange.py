"""The round exchange on its own (node/sync/round_exchange.py), against a real S3 server (moto), with no outer
loop around it: replicas agree on one set per round (node/sync/round_rule.py), a late replica applies it too,
a round below quorum applies nothing, a squatted key takes no slot.
Fragments are DiLoCo's dense codec on a 4-value tensor: the exchange only moves signed bytes."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from node.sync.dense_sync import DenseCodec
from node.sync.exchange import Exchanged, FragmentId, SyncStats
from node.sync.round_exchange import RoundExchange
from protocol import keys
from protocol.identity import Identity
from protocol.net.store import ObjectStore, StoreConfig

pytestmark = pytest.mark.timeout(60)

IDS = [Identity.from_seed(bytes([40 + i]) * 32) for i in range(3)]
SHAPES = [torch.Size([4])]


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="round-exchange"))
    s.ensure_bucket()
    return s


def exchange(
    store: ObjectStore, r: int, replicas: int, timeout_s: float = 10.0, max_late_rounds: int = 1
) -> RoundExchange:
    return RoundExchange(
        store,
        DenseCodec(IDS[r]),
        replica=r,
        stage_peers={q: IDS[q].peer_id for q in range(replicas)},
        former_stage_peers=None,
        timeout_s=timeout_s,
        poll_s=0.01,
        poll_max_s=0.1,
        stats=SyncStats(),
        lock=threading.Lock(),
        max_late_rounds=max_late_rounds,
    )


def put(ex: RoundExchange, fid: FragmentId) -> Exchanged:
    """Replica fid.replica's contribution: the value r + 1 + 10 x round everywhere, so the set shows who is
    in it, from which round."""
    delta = [torch.full((4,), float(fid.replica + 1 + 10 * fid.round))]
    return ex.run(fid, ex.codec.encode(fid, delta, 100 + 10 * fid.round), SHAPES)


def together(exs: list[RoundExchange], run: str, rnd: int) -> list[Exchanged]:
    """Each exchange's replica puts its round-`rnd` fragment, all at once (one thread each)."""
    with ThreadPoolExecutor(len(exs)) as pool:
        return list(pool.map(lambda ex: put(ex, FragmentId(run, 0, 0, rnd, ex.replica)), exs))


def values(ex: Exchanged) -> dict[int, float]:
    return {r: float(t[0][0]) for r, t in ex.contribs.items()}


def test_replicas_settle_one_set_from_the_store_and_write_no_record(store: ObjectStore) -> None:
    run = f"rx-{uuid.uuid4().hex[:8]}"
    exs = [exchange(store, r, 3) for r in range(3)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda r: put(exs[r], FragmentId(run, 0, 0, 0, r)), range(3)))
    assert all(values(g) == {0: 1.0, 1: 2.0, 2: 3.0} for g in got)
    assert all(g.unsent == [] for g in got)  # every replica's own fragment is in the set
    assert sorted(store.list(keys.sync_prefix(run, 0, 0, 0))) == sorted(
        keys.primary_fragment_key(run, 0, 0, 0, r, IDS[r].peer_id) for r in range(3)
    )  # the fragments and nothing else: the set is what the store says, not what a replica wrote
    assert all(ex.stats.missing == ex.stats.rejected == 0 for ex in exs)


def test_a_replica_that_never_comes_is_missing_and_a_late_one_applies_the_same_set(
    store: ObjectStore,
) -> None:
    """Replicas 0 and 1 (a quorum of 3) settle without 2 once the store's clock passes their arrival + W
    (1 s) + the margin; replica 2, later, reads the same final LIST: it applies their set, and its own
    fragment, in the store after the deadline, waits for the late window (issue 22): with
    sync.max_late_rounds = 0 it goes back to it as unsent at once."""
    for k in (1, 0):
        run = f"rx-{uuid.uuid4().hex[:8]}"
        exs = [exchange(store, r, 3, timeout_s=1.0, max_late_rounds=k) for r in range(3)]
        early = together(exs[:2], run, 0)
        assert all(values(g) == {0: 1.0, 1: 2.0} for g in early)
        assert all(exs[r].stats.missing == 1 for r in range(2))
        late = put(exs[2], FragmentId(run, 0, 0, 0, 2))
        assert values(late) == {0: 1.0, 1: 2.0}
        assert exs[2].stats.not_uploaded == 1
        if k == 0:
            assert len(late.unsent) == 1 and float(late.unsent[0][0][0]) == 3.0
        else:
            assert late.unsent == [] and exs[2].late.waiting.keys() == {(0, 0)}


def test_a_late_fragment_is_committed_in_the_next_round_by_every_replica(store: ObjectStore) -> None:
    """Issue 22: replica 2's round-0 fragment lands after round 0's deadline; round 1's set, on every
    replica, holds it summed with replica 2's round-1 fragment (3 + 13), and nothing goes back to replica
    2's error feedback: it was used, once."""
    run = f"rx-{uuid.uuid4().hex[:8]}"
    exs = [exchange(store, r, 3, timeout_s=1.0) for r in range(3)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: put(exs[r], FragmentId(run, 0, 0, 0, r)), range(2)))
    assert put(exs[2], FragmentId(run, 0, 0, 0, 2)).unsent == []
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda r: put(exs[r], FragmentId(run, 0, 0, 1, r)), range(3)))
    assert all(values(g) == {0: 11.0, 1: 12.0, 2: 16.0} for g in got)
    assert all(g.late == {2: [0]} and g.unsent == [] for g in got)
    # its tokens are the two fragments' (100 + 110); it weighs as its larger part, not as both rounds
    assert all(g.tokens == {0: 110, 1: 110, 2: 210} and g.weights == {0: 110, 1: 110, 2: 110} for g in got)
    assert all(ex.stats.late_committed == 1 and ex.stats.late_expired == 0 for ex in exs)
    assert exs[2].late.waiting == {}


def test_a_fragment_later_than_the_window_goes_back_to_its_sender(store: ObjectStore) -> None:
    """Replicas 0 and 1 settle rounds 0 and 1 without replica 2; its round-0 fragment lands after round 1's
    cutoff, beyond sync.max_late_rounds = 1: no round commits it, every replica applies the same sets, and
    replica 2 gets it back (restore) with round 1, counted as expired; its round-1 fragment now waits."""
    run = f"rx-{uuid.uuid4().hex[:8]}"
    exs = [exchange(store, r, 3, timeout_s=1.0) for r in range(3)]
    early = [together(exs[:2], run, rnd) for rnd in (0, 1)]
    assert [values(g[0]) for g in early] == [{0: 1.0, 1: 2.0}, {0: 11.0, 1: 12.0}]
    assert put(exs[2], FragmentId(run, 0, 0, 0, 2)).unsent == []
    got = put(exs[2], FragmentId(run, 0, 0, 1, 2))
    assert values(got) == {0: 11.0, 1: 12.0} and got.late == {}
    assert [float(u[0][0]) for u in got.unsent] == [3.0]  # round 0's, its window closed
    assert exs[2].stats.late_expired == 1 and exs[2].late.waiting.keys() == {(0, 1)}
    assert all(ex.stats.late_committed == 0 for ex in exs)


def test_below_quorum_a_round_waits_for_the_slots_to_shrink_or_the_worker_to_stop(store: ObjectStore) -> None:
    """One replica of three alone (q = 2) does not apply its fragment alone, nor give up: a replica that
    applied nothing would differ from one reaching the round once its quorum is in (issue 21's attack E).
    When the coordinator drops the other two (the live slots shrink, q = 1) the round settles with it;
    a stopping worker ends the wait, applying nothing and keeping its fragment."""
    run = f"rx-{uuid.uuid4().hex[:8]}"
    ex = exchange(store, 0, 3, timeout_s=0.5)
    dropped = threading.Timer(2.0, ex.set_stage_peers, ({0: IDS[0].peer_id},))
    dropped.start()
    t0 = time.monotonic()
    got = put(ex, FragmentId(run, 0, 0, 0, 0))
    assert values(got) == {0: 1.0} and got.unsent == []
    assert time.monotonic() - t0 >= 2.0
    stop = threading.Event()
    waiting = RoundExchange(
        store,
        DenseCodec(IDS[0]),
        replica=0,
        stage_peers={q: IDS[q].peer_id for q in range(3)},
        former_stage_peers=None,
        timeout_s=0.5,
        poll_s=0.01,
        poll_max_s=0.1,
        stats=SyncStats(),
        lock=threading.Lock(),
        cancelled=stop.is_set,
    )
    threading.Timer(1.0, stop.set).start()
    got = put(waiting, FragmentId(run, 0, 0, 1, 0))
    assert got.contribs == {} and len(got.unsent) == 1


def test_a_squatted_primary_key_takes_no_slot(store: ObjectStore) -> None:
    """Someone with store credentials writes garbage at replica 1's primary fragment key first: replica 1
    writes under the key naming its bytes' hash, both replicas find it there, and the set has both."""
    run = f"rx-{uuid.uuid4().hex[:8]}"
    squatted = keys.primary_fragment_key(run, 0, 0, 0, 1, IDS[1].peer_id)
    store.put(squatted, b"not a fragment")
    exs = [exchange(store, r, 2) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda r: put(exs[r], FragmentId(run, 0, 0, 0, r)), range(2)))
    assert all(values(g) == {0: 1.0, 1: 2.0} for g in got)
    assert store.get(squatted) == b"not a fragment"  # write-once: the squatter's bytes stay, unused
    assert len(store.list(keys.slot_prefix(run, 0, 0, 0, 1))) == 2
    assert exs[0].stats.rejected >= 1
    assert got[1].unsent == []  # replica 1's own fragment, at its hash-named key, is the one used
    assert exs[1].reader.signers(1) == {IDS[1].peer_id}


def test_set_stage_peers_keeps_the_replaced_signer_for_its_rounds(store: ObjectStore) -> None:
    ex = exchange(store, 0, 2)
    newcomer = Identity.from_seed(bytes([77]) * 32).peer_id
    known = ex.set_stage_peers({0: IDS[0].peer_id, 1: newcomer})
    assert ex.reader.signers(1) == {newcomer, IDS[1].peer_id}
    assert known == {IDS[0].peer_id, newcomer, IDS[1].peer_id}
    assert ex.reader.slots() == {0, 1}


def test_a_replica_restarted_from_a_checkpoint_commits_the_same_late_fragments(store: ObjectStore) -> None:
    """The late window's cutoffs are consensus state carried by checkpoints: replica 1 restarted after
    round 0 with the state of a checkpoint (`state()` -> `load_state()`) commits replica 2's late round-0
    fragment in round 1 exactly as the others do. A replica with no cutoff for an earlier round, whose view
    cannot re-derive it (a round played alone, read back with two live slots: below quorum), commits
    nothing of that round and does not get stuck."""
    run = f"rx-{uuid.uuid4().hex[:8]}"
    exs = [exchange(store, r, 3, timeout_s=1.0) for r in range(3)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: put(exs[r], FragmentId(run, 0, 0, 0, r)), range(2)))
    put(exs[2], FragmentId(run, 0, 0, 0, 2))
    restarted = exchange(store, 1, 3, timeout_s=1.0)
    restarted.load_state(exs[1].state())
    now = [exs[0], restarted, exs[2]]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda r: put(now[r], FragmentId(run, 0, 0, 1, r)), range(3)))
    assert all(values(g) == {0: 11.0, 1: 12.0, 2: 16.0} and g.late == {2: [0]} for g in got)

    solo = f"rx-{uuid.uuid4().hex[:8]}"
    alone = exchange(store, 0, 1, timeout_s=1.0)
    assert values(put(alone, FragmentId(solo, 0, 0, 0, 0))) == {0: 1.0}
    alone.set_stage_peers({0: IDS[0].peer_id, 1: IDS[1].peer_id})
    fresh = exchange(store, 1, 2, timeout_s=1.0)  # no state: round 0 read back under two live slots
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda ex: put(ex, FragmentId(solo, 0, 0, 1, ex.replica)), [alone, fresh]))
    assert all(values(g) == {0: 11.0, 1: 12.0} and g.late == {} for g in got)


def test_a_replica_left_out_by_a_newer_epoch_applies_no_more_rounds(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's split (docs/reliability.md): replica 1 dropped out while its nodes trained on; replica 0,
    at the new epoch, settles rounds alone while replica 1, at the old one, would settle them with both:
    two agreed sets. Told by its node that a newer epoch left it out (`superseded`), replica 1 applies
    neither a settled round nor keeps waiting on one below quorum: RoundSuperseded, and nothing applied."""
    from node.sync.exchange import RoundSuperseded

    monkeypatch.setattr("node.sync.round_exchange.SUPERSEDED_CHECK_S", 0.2)
    run = f"rx-{uuid.uuid4().hex[:8]}"
    survivor = exchange(store, 0, 2, timeout_s=0.5)
    survivor.set_stage_peers({0: IDS[0].peer_id})  # epoch 2: replica 1 dropped out
    why = "left out of run x replica 1 stage 0: term 1 epoch 2 gives this node no slot"
    dropped = exchange(store, 1, 2, timeout_s=0.5)  # still at epoch 1: both replicas live
    assert values(put(survivor, FragmentId(run, 0, 0, 0, 0))) == {0: 1.0}
    assert values(put(dropped, FragmentId(run, 0, 0, 0, 1))) == {0: 1.0, 1: 2.0}  # the second consensus
    dropped.superseded = lambda: why
    assert values(put(survivor, FragmentId(run, 0, 0, 1, 0))) == {0: 11.0}
    with pytest.raises(RoundSuperseded, match="gives this node no slot"):
        put(dropped, FragmentId(run, 0, 0, 1, 1))  # settled {0, 1}, but not ours to apply
    t0 = time.monotonic()
    with pytest.raises(RoundSuperseded):  # below quorum (replica 0 never comes): it does not wait on
        put(dropped, FragmentId(run, 0, 0, 2, 1))
    assert time.monotonic() - t0 < 5.0

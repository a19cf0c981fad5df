"""Issue 22 acceptance 3: late updates committed, not lost. Three real OuterSync replicas (SparseLoCo codec,
the per-coordinate aggregation) on a real S3 server (moto); replica 2 reaches the store through the fault
proxy, which holds its round-0 upload back (a slow link): the request reaches the store whole, seconds
after the round's deadline (W = 3 s on the store's clock).

- Held 6 s: round 0 settles without it on every replica; round 1's set commits it (summed with replica 2's
  round-1 fragment) on every replica; anchors bit-identical; replica 2's error feedback is, bit for bit,
  that of its fragments used in time: the same encodes and no restore.
- Held 15 s, past round 1's cutoff (sync.max_late_rounds = 1): no round commits it; anchors bit-identical;
  replica 2 restores it with round 1 (its error feedback is the same encodes plus that restore) and counts
  it as expired.

The replicas run in their own threads (a replica blocked on its slow upload does not hold the others).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from node.sync.exchange import FragmentId
from node.sync.outer_sync import OuterSync
from node.sync.sparseloco_sync import SparseLoCoCodec
from protocol.net.store import ObjectStore, StoreConfig
from scripts.fault_proxy import FaultProxy
from tests.test_sparseloco_sync import (
    CFG,
    IDS,
    SHAPES,
    assert_same_anchors,
    closer,
    inner_step,
    make_replicas,
)

pytestmark = pytest.mark.timeout(180)

__all__ = ["closer"]  # the fixture, used by name

W = 3.0


class RecordingCodec(SparseLoCoCodec):
    """The real codec, keeping each pseudo-gradient it is given, to replay them on a fresh codec."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.deltas: list[tuple[FragmentId, list[torch.Tensor]]] = []
        self.restored: list[list[torch.Tensor]] = []

    def encode(self, fid, delta, tokens):  # type: ignore[no-untyped-def]
        self.deltas.append((fid, [t.detach().clone() for t in delta]))
        return super().encode(fid, delta, tokens)

    def restore(self, fid, unsent):  # type: ignore[no-untyped-def]
        self.restored.append([t.clone() for t in unsent])
        super().restore(fid, unsent)


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="late-commits"))
    s.ensure_bucket()
    return s


def run_two_rounds(
    store: ObjectStore, moto_store: str, held_s: float, closer: list[OuterSync]
) -> list[OuterSync]:
    proxy = FaultProxy(moto_store)
    proxy.delay_s = held_s
    slow = ObjectStore(StoreConfig(endpoint_url=proxy.url, bucket="late-commits"))
    codecs = [RecordingCodec(IDS[r], CFG) for r in range(3)]
    run_id, syncs = make_replicas(
        store, SHAPES, R=3, H=2, timeout_s=W, stores=[store, store, slow], codecs=codecs
    )
    closer.extend(syncs)
    proxy.rule = lambda m, p: "delay" if m == "PUT" and f"/{run_id}/sync/s0/f0/r0/2/" in p else "pass"

    def replica(s: OuterSync) -> None:
        for step in range(1, 5):
            inner_step(s, step)
            s.capture_due(step)
            s.apply_due(step)

    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(replica, syncs))
    finally:
        proxy.close()
    assert proxy.actions.get("delay") == 1, "the proxy held nothing back: the test did not exercise the fault"
    return syncs


def replayed(codec: RecordingCodec, restore_round: int | None) -> dict[str, torch.Tensor]:
    """A fresh codec given the same pseudo-gradients in the same order, then, if `restore_round` is given,
    that round's contribution (as receivers decode it) restored: the error feedback the sender must end
    with."""
    fresh = SparseLoCoCodec(IDS[2], CFG)
    sent = {fid.round: fresh.encode(fid, delta, 1)()[1].tensors for fid, delta in codec.deltas}
    if restore_round is not None:
        fresh.restore(FragmentId("", 0, 0, restore_round, 2), sent[restore_round])
    return fresh.state()


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), f"error feedback {k} differs"


def test_a_fragment_held_back_past_its_round_is_committed_in_the_next(
    store: ObjectStore, moto_store: str, closer: list[OuterSync]
) -> None:
    # held 1.5 W: it lands after round 0's cutoff (the quorum's arrival + W) but about when the round
    # settles (cutoff + 2 s), so replica 2 settles round 0 with the others and its round-1 fragment is on
    # time like theirs (held 2 W, that upload raced round 1's deadline, and lost it once on a CI host)
    t0 = time.monotonic()
    syncs = run_two_rounds(store, moto_store, 1.5 * W, closer)
    assert time.monotonic() - t0 >= 1.5 * W
    assert_same_anchors(syncs)
    for s in syncs:
        assert s.stats.rounds_applied == 2
        assert s.stats.late_committed == 1 and s.stats.late_expired == 0
        assert s.stats.last_contributors == [0, 1, 2]  # round 1: replica 2's late and on-time, as one
    assert [s.stats.missing for s in syncs] == [1, 1, 0]  # replica 2 missed round 0 (its own is not counted)
    codec = syncs[2].codec
    assert isinstance(codec, RecordingCodec)
    assert codec.restored == [] and len(codec.deltas) == 2  # used once, so never restored
    assert_same_state(codec.state(), replayed(codec, None))


def test_a_fragment_later_than_the_window_goes_back_to_its_sender(
    store: ObjectStore, moto_store: str, closer: list[OuterSync]
) -> None:
    syncs = run_two_rounds(store, moto_store, 5 * W, closer)
    assert_same_anchors(syncs)
    for s in syncs:
        assert s.stats.rounds_applied == 2 and s.stats.late_committed == 0
    assert [s.stats.last_contributors for s in syncs] == [[0, 1]] * 3
    codec = syncs[2].codec
    assert isinstance(codec, RecordingCodec)
    assert syncs[2].stats.late_expired == 1 and len(codec.restored) == 1  # round 0's, at round 1's apply
    assert_same_state(codec.state(), replayed(codec, 0))
    assert syncs[2].exchange.late.waiting.keys() == {(0, 1)}  # type: ignore[attr-defined]

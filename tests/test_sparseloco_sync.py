"""SparseLoCo through the outer loop: OuterSync + SparseLoCoCodec against a real S3 server (moto).

Replicas are simulated in one process and driven in lockstep: every replica's capture phase, then every
replica's apply phase, so that tau = 0 (apply right after capture) cannot deadlock a single thread.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from node.sync.aggregation import aggregate
from node.sync.outer_sync import FragmentId, OuterSync
from node.sync.sparseloco_sync import SparseLoCoCodec, make_aggregator, make_sync_parts
from protocol import keys
from protocol.codecs.sparseloco import SparseLoCoConfig
from protocol.codecs.sparseloco_format import (
    MAX_FRAGMENT_BYTES,
    FragmentError,
    ratio,
)
from protocol.identity import Identity
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import RunSpec, SyncSpec
from protocol.sync_settings import AggregationSettings, Schedule
from scripts.fault_proxy import FaultProxy
from tests.helpers.fragment_faults import KINDS, corrupt, valid_blob

pytestmark = pytest.mark.timeout(60)

CFG = SparseLoCoConfig()
AGG = AggregationSettings(aggregation="per_coordinate")
IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(4)]


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="sparseloco-sync"))
    s.ensure_bucket()
    return s


def stored_fragment(store: ObjectStore, run_id: str, f: int, rnd: int, r: int) -> bytes | None:
    """The one fragment under replica r's slot of a round (None if there is none)."""
    found = store.list(keys.slot_prefix(run_id, 0, f, rnd, r))
    assert len(found) <= 1, found
    return store.get(found[0]) if found else None


def plant(store: ObjectStore, run_id: str, rnd: int, r: int, blob: bytes) -> str:
    """Write `blob` under replica r's slot of round `rnd`, at a key naming r's signer and the blob's hash."""
    key = keys.sync_key(run_id, 0, 0, rnd, r, IDS[r].peer_id, blob)
    store.put(key, blob)
    return key


def make_params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]


def make_replicas(
    store: ObjectStore,
    shapes: list[tuple[int, ...]],
    *,
    R: int,
    H: int,
    P: int = 1,
    tau: int = 0,
    alpha: float = 1.0,
    expected: int | None = None,
    device_paths: list[bool] | None = None,
    stores: list[ObjectStore] | None = None,
    timeout_s: float = 15.0,
    codecs: list[SparseLoCoCodec] | None = None,
    tokens_per_step: list[int] | None = None,
    agg: AggregationSettings = AGG,
    group: int = 0,
) -> tuple[str, list[OuterSync]]:
    """R replicas of the same initial parameters; `expected` (>= R) replicas are listed as stage peers.
    group: the layer group they hold (> 0: held by stage 1, its signers given per group)."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    peers = {r: IDS[r].peer_id for r in range(expected or R)}
    syncs = [
        OuterSync(
            make_params(shapes),
            store=stores[r] if stores else store,
            codec=codecs[r]
            if codecs
            else SparseLoCoCodec(IDS[r], CFG, device_path=device_paths[r] if device_paths else None),
            aggregate=make_aggregator(agg),
            tokens_per_step=tokens_per_step[r] if tokens_per_step else 1,
            run_id=run_id,
            stage=min(group, 1),
            replica=r,
            stage_peers={} if group else peers,
            groups={group: list(range(len(shapes)))},
            group_peers={group: peers} if group else None,
            schedule=Schedule(H=H, P=P, tau=tau),
            alpha=alpha,
            timeout_s=timeout_s,
            poll_s=0.01,
        )
        for r in range(R)
    ]
    return run_id, syncs


def inner_step(sync: OuterSync, step: int) -> None:
    """A stand-in for AdamW: a replica- and step-dependent update of every parameter."""
    g = torch.Generator().manual_seed(1000 * sync.replica + step)
    with torch.no_grad():
        for p in sync.params:
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def lockstep(
    syncs: list[OuterSync], steps: range, before_apply: Callable[[int], None] | None = None
) -> Iterator[tuple[int, list[list[int]]]]:
    """Inner step, capture phase for all replicas, then apply phase for all; yields (step, applied)."""
    for step in steps:
        for s in syncs:
            inner_step(s, step)
        for s in syncs:
            s.capture_due(step)
        if before_apply is not None:
            before_apply(step)
        yield step, [s.apply_due(step) for s in syncs]


@pytest.fixture
def closer() -> Iterator[list[OuterSync]]:
    opened: list[OuterSync] = []
    yield opened
    for s in opened:
        s._io.shutdown(wait=True, cancel_futures=True)


def assert_same_anchors(syncs: list[OuterSync]) -> None:
    for s in syncs[1:]:
        for a, b in zip(syncs[0].anchor, s.anchor, strict=True):
            assert torch.equal(a, b), "replicas disagree on the consensus"


SHAPES = [(128, 192), (64,), (100, 70)]


def test_a_store_that_fails_fetches_for_a_while_is_retried_until_the_deadline(
    store: ObjectStore, moto_store: str, closer: list[OuterSync]
) -> None:
    """Finding 8 of the attack report: one transient GET error of another replica's fragment raised out
    of after_inner_step. Here replica 1 reaches the store through a proxy that answers 503 SlowDown to
    every GET of replica 0's fragments for 6 s (more than boto3's own retries cover): the round waits,
    retries, and completes with both contributions and identical anchors."""
    proxy = FaultProxy(moto_store)
    try:
        flaky = ObjectStore(StoreConfig(endpoint_url=proxy.url, bucket="sparseloco-sync"))
        t0 = time.monotonic()
        proxy.rule = lambda m, p: (
            m == "GET" and "/sync/" in p and f"/0/{IDS[0].peer_id}/" in p and time.monotonic() - t0 < 6
        )
        _, syncs = make_replicas(store, SHAPES, R=2, H=3, tau=1, stores=[store, flaky])
        closer.extend(syncs)
        for _ in lockstep(syncs, range(1, 8)):
            pass
        assert proxy.failed, "the proxy failed no request: the test did not exercise the fault"
        assert_same_anchors(syncs)
        for s in syncs:
            assert (
                s.stats.rounds_applied == 2 and s.stats.missing == 0 and s.stats.last_contributors == [0, 1]
            )
    finally:
        proxy.close()


def test_rounds_complete_through_503s_stalls_and_truncated_answers(
    store: ObjectStore, moto_store: str, closer: list[OuterSync]
) -> None:
    """Issue 10 acceptance 4 (at the outer-sync level): replica 2 reaches the store through a proxy that,
    for 4 s, answers its fragment requests (uploads, listings and fetches) with 503 SlowDown, stalls them
    for 3 s, or cuts the answer in half, in turn. Rounds wait and retry within their deadline: every round
    completes with all three contributions, the anchors stay bit-identical (nothing half-applied), and
    the faults did happen."""
    proxy = FaultProxy(moto_store)
    proxy.stall_s = 3.0
    try:
        flaky = ObjectStore(StoreConfig(endpoint_url=proxy.url, bucket="sparseloco-sync"), timeout_s=1.5)
        first: list[float] = []  # when the first fragment request came (setting up may take seconds)
        turn = iter(range(1 << 30))
        kinds = ("503", "stall", "truncate")

        def rule(method: str, path: str) -> str:
            if "/sync/" not in path and "sync%2F" not in path:
                return "pass"
            first[:] = first or [time.monotonic()]
            return "pass" if time.monotonic() - first[0] > 4 else kinds[next(turn) % 3]

        proxy.rule = rule
        _, syncs = make_replicas(store, SHAPES, R=3, H=3, P=1, tau=1, stores=[store, store, flaky])
        for s in syncs:
            s.exchange.timeout_s = 30.0
        closer.extend(syncs)
        for _ in lockstep(syncs, range(1, 14)):  # captures at 3, 6, 9, 12; applied one step later
            pass
        assert set(proxy.actions) == set(kinds), proxy.actions
        assert_same_anchors(syncs)
        for s in syncs:
            assert s.stats.rounds_applied == 4 and s.stats.missing == 0 and s.stats.rejected == 0
            assert s.stats.last_contributors == [0, 1, 2]
    finally:
        proxy.close()


def test_an_oversized_object_at_a_fragment_key_is_rejected_unread(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Issue 10 finding 6 (bounded reads): a 2 GiB object at a fragment key used to be downloaded before
    the 64 MiB check. Here a 65 MiB object is planted under replica 1's slot of round 0, named by its
    signer: both replicas reject it from its size alone (nothing downloaded), replica 1's own upload
    lands beside it, and the round uses both contributions; anchors stay identical."""
    run_id, syncs = make_replicas(store, SHAPES, R=2, H=3)
    closer.extend(syncs)
    big = b"\0" * (MAX_FRAGMENT_BYTES + (1 << 20))
    plant(store, run_id, 0, 1, big)
    down0 = store.bytes_down
    for _ in lockstep(syncs, range(1, 4)):
        pass
    assert_same_anchors(syncs)
    for s in syncs:
        assert s.stats.rounds_applied == 1 and s.stats.last_contributors == [0, 1]
        assert s.stats.bytes_down < 1 << 20  # the squatted object was never fetched
        assert s.stats.not_uploaded == 0  # the LIST's size alone rules it out: not even a candidate
    assert store.bytes_down - down0 < 1 << 20


def test_device_and_host_codec_paths_reach_the_same_consensus(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Replicas whose SparseLoCo runs on the device path (torch, forced onto the CPU here) and replicas on
    the numpy reference path exchange fragments that each other accept, and the consensus is bit for bit
    the one an all-reference swarm reaches from the same inner steps."""
    _, mixed = make_replicas(store, SHAPES, R=3, H=3, P=2, tau=1, device_paths=[True, False, True])
    _, ref = make_replicas(store, SHAPES, R=3, H=3, P=2, tau=1, device_paths=[False] * 3)
    closer.extend(mixed + ref)
    for _ in lockstep(mixed, range(1, 10)):
        pass
    for _ in lockstep(ref, range(1, 10)):
        pass
    assert_same_anchors(mixed)
    for a, b in zip(mixed[0].anchor, ref[0].anchor, strict=True):
        assert torch.equal(a, b)
    for s in mixed:
        assert s.stats.rejected == s.stats.missing == 0 and s.stats.rounds_applied == 6
    for f, e in mixed[0].codec.e.items():  # type: ignore[attr-defined]
        for x, y in zip(e, ref[0].codec.e[f], strict=True):  # type: ignore[attr-defined]
            assert torch.allclose(x, y, rtol=0, atol=1e-6)  # error feedback: same to float32 rounding


def test_round_gives_bit_identical_anchors(store: ObjectStore, closer: list[OuterSync]) -> None:
    _, syncs = make_replicas(store, SHAPES, R=3, H=3, alpha=1.0)
    closer.extend(syncs)
    start = [a.clone() for a in syncs[0].anchor]
    applied = {step: a for step, a in lockstep(syncs, range(1, 7))}
    assert applied[3] == applied[6] == [[0]] * 3 and applied[1] == [[]] * 3
    assert_same_anchors(syncs)
    for s in syncs:
        assert s.stats.rounds_applied == 2 and s.stats.rejected == s.stats.missing == 0
        assert s.stats.last_contributors == [0, 1, 2]
        for p, a in zip(s.params, s.anchor, strict=True):
            assert torch.equal(p.detach(), a)  # tau = 0: nothing drifted since the capture
    moved = [float((a - b).abs().max()) for a, b in zip(syncs[0].anchor, start, strict=True)]
    assert all(m > 0 for m in moved)
    # the error-feedback buffers hold what was not sent; with 1.56% sent they are nearly all of Delta
    e = syncs[0].codec.e[0, 0]  # type: ignore[attr-defined]
    assert [t.shape for t in e] == [torch.Size(s) for s in SHAPES] and float(e[0].abs().sum()) > 0


def test_bytes_per_round_match_the_ratio(store: ObjectStore, closer: list[OuterSync]) -> None:
    shapes = [(256, 256), (256,), (512, 256), (256, 512)]
    run_id, syncs = make_replicas(store, shapes, R=2, H=2, P=2)
    closer.extend(syncs)
    rounds = 2
    for _ in lockstep(syncs, range(1, 2 * rounds + 1)):
        pass
    codec = SparseLoCoCodec(IDS[0], CFG)
    want = 0.0  # dense fp32 bytes / ratio, per fragment, with the fragment's real header
    for (_, f), idx in syncs[0].fragments.items():
        fs = [torch.Size(shapes[i]) for i in idx]
        header = codec.expected_header(FragmentId(run_id, 0, f, 0, 0), fs, tokens=2)
        dense = 4 * sum(math.prod(s) for s in fs)
        want += dense / ratio([tuple(s) for s in fs], CFG, header=header)
    for s in syncs:
        per_round = s.stats.bytes_up / rounds
        assert abs(per_round - want) <= 0.10 * want, f"{per_round:.0f} B/round, dense/ratio = {want:.0f} B"
        dense_all = 4 * sum(math.prod(sh) for sh in shapes)
        assert dense_all / per_round > 150  # headers included, on this 0.4M-parameter stage


def test_corrupted_fragments_are_rejected_and_the_round_completes(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Replica 2 is an expected stage peer whose uploads are corrupted; replicas 0 and 1 reject them, wait
    for a valid one until the round's deadline, and go on without replica 2."""
    H = 2
    run_id, syncs = make_replicas(store, SHAPES, R=2, H=H, expected=3)
    closer.extend(syncs)
    for s in syncs:
        s.exchange.timeout_s = 1.0
    checker = SparseLoCoCodec(IDS[0], CFG)
    for rnd, kind in enumerate(KINDS):
        fid = FragmentId(run_id, 0, 0, rnd, 2)
        blob = corrupt(kind, IDS[2], fid, SHAPES, CFG)
        with pytest.raises(FragmentError):  # what each replica's I/O thread will see
            checker.decode(fid, blob, [torch.Size(s) for s in SHAPES], IDS[2].peer_id)
        plant(store, run_id, rnd, 2, blob)
        phases = [a for _, a in lockstep(syncs, range(rnd * H + 1, (rnd + 1) * H + 1))]
        assert phases[-1] == [[0], [0]], kind
        for s in syncs:
            assert s.stats.rejected == rnd + 1, kind
            assert s.stats.rounds_applied == rnd + 1 and s.stats.missing == rnd + 1
            assert s.stats.last_contributors == [0, 1]
        assert_same_anchors(syncs)
    for s in syncs:
        assert all(bool(torch.isfinite(a).all()) for a in s.anchor)


def test_squatted_future_rounds_do_not_empty_them(store: ObjectStore, closer: list[OuterSync]) -> None:
    """Issue 10 finding 6: anyone with store credentials could write replica 1's future fragment keys
    first (write-once: first writer wins) and leave every round without replica 1. Now a fragment's key
    names its signer and its content hash, so nobody can take the key of a fragment not yet written:
    garbage planted under replica 1's slot for rounds 0-2 (at the old key, at keys naming replica 1's
    signer with a truncated fragment, one signed by a stranger) is rejected and never read again, and
    every round uses both replicas; anchors stay identical."""
    H = 2
    run_id, syncs = make_replicas(store, SHAPES, R=2, H=H)
    closer.extend(syncs)
    planted = 0
    for rnd in range(3):
        fid = FragmentId(run_id, 0, 0, rnd, 1)
        store.put(f"{keys.sync_prefix(run_id, 0, 0, rnd)}1", b"squatted")  # the old layout's key
        for kind in ("truncated", "untrusted-signer", "nan-scale"):
            plant(store, run_id, rnd, 1, corrupt(kind, IDS[1], fid, SHAPES, CFG))
            planted += 1
    for step, _ in lockstep(syncs, range(1, 3 * H + 1)):
        if step % H == 0:
            assert [s.stats.last_contributors for s in syncs] == [[0, 1], [0, 1]], step
    assert_same_anchors(syncs)
    for s in syncs:
        assert s.stats.rounds_applied == 3 and s.stats.missing == 0 and s.stats.not_uploaded == 0
    # a signer's primary key is its first candidate (node/sync/round_reader.py): the real fragment there,
    # nobody reads the garbage beside it (each reader would reject an object once, at most)
    assert all(s.stats.rejected <= planted for s in syncs)


def test_a_valid_fragment_already_in_our_slot_is_what_the_round_uses(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """A node that replays a round after a restart finds its own earlier, validly signed upload in its
    slot: every replica (itself included) aggregates those stored bytes and it uploads no second one, so
    the consensus stays identical."""
    H = 2
    run_id, syncs = make_replicas(store, SHAPES, R=2, H=H)
    closer.extend(syncs)
    fid = FragmentId(run_id, 0, 0, 0, 1)
    earlier = valid_blob(IDS[1], fid, SHAPES, CFG)[0]
    store.put(keys.primary_fragment_key(run_id, 0, 0, 0, 1, IDS[1].peer_id), earlier)  # its upload before
    for _ in lockstep(syncs, range(1, H + 1)):
        pass
    assert [s.stats.last_contributors for s in syncs] == [[0, 1], [0, 1]]
    assert syncs[1].stats.not_uploaded == 1 and syncs[0].stats.rejected == 0
    assert stored_fragment(store, run_id, 0, 0, 1) == earlier  # no second fragment in the slot
    assert_same_anchors(syncs)


def test_put_once_tells_ours_from_other_bytes(store: ObjectStore, closer: list[OuterSync]) -> None:
    """put_if_absent refuses a second PUT of identical bytes (a retry whose first attempt landed): ours."""
    _, syncs = make_replicas(store, SHAPES, R=1, H=2)
    closer.extend(syncs)
    key = f"{syncs[0].run_id}/put-once"
    assert syncs[0].exchange.put_once(key, b"the same bytes") == (True, None)
    assert syncs[0].exchange.put_once(key, b"the same bytes") == (True, None)
    assert syncs[0].exchange.put_once(key, b"other bytes") == (False, b"the same bytes")


def test_an_unreachable_store_leaves_our_fragment_unused(closer: list[OuterSync]) -> None:
    """Connection refused on every PUT and GET until the deadline: the round goes on without us."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = ObjectStore(StoreConfig(endpoint_url=f"http://127.0.0.1:{port}", bucket="gone"), timeout_s=2)
    _, syncs = make_replicas(dead, SHAPES, R=1, H=2)
    syncs[0].exchange.timeout_s = 1.0
    closer.extend(syncs)
    assert syncs[0].exchange.put_once("k", b"fragment") == (None, None)
    for _ in lockstep(syncs, range(1, 3)):
        pass
    assert syncs[0].stats.not_uploaded == 1 and syncs[0].stats.bytes_up == 0
    assert syncs[0].stats.last_contributors == []
    assert all(torch.equal(a, p.detach()) for a, p in zip(syncs[0].anchor, syncs[0].params, strict=True))


@pytest.mark.parametrize("tau", [1, 2])
def test_streaming_applies_at_c_plus_tau_and_keeps_the_drift(
    store: ObjectStore, closer: list[OuterSync], tau: int
) -> None:
    H, P, alpha = 4, 2, 0.8
    shapes = [(64, 96), (32,), (96, 64), (48, 48)]  # fragment 0: tensors 0, 2; fragment 1: tensors 1, 3
    run_id, syncs = make_replicas(store, shapes, R=2, H=H, P=P, tau=tau, alpha=alpha)
    closer.extend(syncs)
    assert syncs[0].fragments == {(0, 0): [0, 2], (0, 1): [1, 3]}
    q = H // P
    c = {f: (f + 1) * q for f in range(P)}  # c_f within a cycle
    captured: dict[tuple[int, int], list[list[torch.Tensor]]] = {}  # (f, round) -> per replica theta(c_f)
    before: dict[int, list[list[torch.Tensor]]] = {}  # step -> per replica params before the apply phase
    anchors: dict[int, list[list[torch.Tensor]]] = {}

    def snapshot(step: int) -> None:
        before[step] = [[p.detach().clone() for p in s.params] for s in syncs]
        anchors[step] = [[a.clone() for a in s.anchor] for s in syncs]
        for f in range(P):
            if step % H == c[f] % H:
                rnd = (step - 1) // H
                captured[(f, rnd)] = [[p.detach().clone() for p in s.params] for s in syncs]

    steps = range(1, 3 * H + tau + 1)
    for step, applied in lockstep(syncs, steps, before_apply=snapshot):
        due = [f for f in range(P) if step - tau > 0 and (step - tau) % H == c[f] % H]
        assert applied == [due] * len(syncs), (step, applied)
        for f in due:
            rnd = (step - tau - 1) // H
            # Delta_bar from the fragments in the store, decoded independently of the replicas
            contribs = {}
            for r in range(len(syncs)):
                blob = stored_fragment(store, run_id, f, rnd, r)
                assert blob is not None
                fs = [syncs[0].params[i].shape for i in syncs[0].fragments[0, f]]
                contribs[r] = (
                    SparseLoCoCodec(IDS[r], CFG)
                    .decode(FragmentId(run_id, 0, f, rnd, r), blob, fs, IDS[r].peer_id)
                    .tensors
                )
            delta_bar = aggregate(contribs, AGG).tensors
            for r, s in enumerate(syncs):
                for j, i in enumerate(s.fragments[0, f]):
                    anchor_new = anchors[step][r][i] - alpha * delta_bar[j]
                    drift = before[step][r][i] - captured[(f, rnd)][r][i]  # theta(a_f) - theta(c_f)
                    assert float(drift.abs().max()) > 0  # tau > 0 steps did train in between
                    torch.testing.assert_close(s.anchor[i], anchor_new, rtol=0, atol=1e-7)
                    torch.testing.assert_close(s.params[i].detach(), anchor_new + drift, rtol=0, atol=1e-7)
                for i in s.fragments[0, 1 - f]:  # the other fragment is not touched
                    assert torch.equal(s.params[i].detach(), before[step][r][i])
                    assert torch.equal(s.anchor[i], anchors[step][r][i])
    assert_same_anchors(syncs)
    assert all(s.stats.rounds_applied == 3 * P for s in syncs)


def test_sync_spec_and_factory() -> None:
    spec = RunSpec(run_id="t")
    assert (spec.sync.k, spec.sync.chunk, spec.sync.beta) == (64, 4096, 0.95)
    parts = make_sync_parts(RunSpec(run_id="t", sync=SyncSpec(method="sparseloco", k=32)), IDS[0])
    assert isinstance(parts.codec, SparseLoCoCodec) and parts.codec.cfg.k == 32 and parts.momentum == 0.0
    dense = make_sync_parts(RunSpec(run_id="t", sync=SyncSpec(method="diloco", outer_momentum=0.9)), IDS[0])
    assert type(dense.codec).__name__ == "DenseCodec" and dense.momentum == 0.9
    x = {0: [torch.tensor([1.0, 0.0])], 1: [torch.tensor([3.0, 2.0])]}
    bare = make_sync_parts(RunSpec(run_id="t", sync=SyncSpec(robust="none")), IDS[0])
    assert bare.aggregate(x, {0: 1.0, 1: 1.0})[0].tolist() == [
        2.0,
        2.0,
    ]  # per-coordinate: 2.0 is not diluted to 1.0
    mean = make_sync_parts(RunSpec(run_id="t", sync=SyncSpec(aggregation="mean", robust="none")), IDS[0])
    assert mean.aggregate(x, {0: 1.0, 1: 1.0})[0].tolist() == [2.0, 1.0]
    # the default bounds one replica's influence: replica 1 is scaled to the (lower) median norm, |x_0| = 1
    assert SyncSpec().robust == "trimmed"
    assert math.hypot(*parts.aggregate(x, {0: 1.0, 1: 1.0})[0].tolist()) < math.hypot(2.0, 2.0)
    for bad, what in [
        ({"chunk": 4000}, "perfect square"),
        ({"k": 0}, "sync.k"),
        ({"beta": 1.5}, "sync.beta"),
        ({"aggregation": "median"}, "aggregation"),
        ({"robust": "median"}, "sync.robust"),
        ({"max_norm_ratio": 0.0}, "sync.max_norm_ratio"),
        ({"method": "adam"}, "method"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
    ]:
        with pytest.raises(ValueError, match=what):
            SyncSpec(**bad)  # type: ignore[arg-type]


def test_replicas_that_look_at_different_times_apply_the_same_set(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Issue 11 acceptance 2, under issue 21's rule: the deadline is the store's, not each replica's.
    Replica 0 uploads at once, replica 2's fragment lands 1.5 s later (the quorum of 3: D = its
    LastModified + W = 1 s), replica 1 reaches the round 6 s in. Each replica used to aggregate what it had
    seen by its own deadline (replica 1 with its own fragment, replica 0 without): the anchors diverged.
    Now both apply {0, 2}, replica 1's own fragment goes back to it, and the anchors are bit-identical.
    The next round, with everyone in time, uses all three."""
    import threading

    H = 2
    run_id, syncs = make_replicas(store, SHAPES, R=2, H=H, expected=3)
    closer.extend(syncs)
    for sy in syncs:
        sy.exchange.timeout_s = 1.0
    third = valid_blob(IDS[2], FragmentId(run_id, 0, 0, 0, 2), SHAPES, CFG)[0]
    timer = threading.Timer(1.5, plant, (store, run_id, 0, 2, third))
    timer.start()
    try:
        for step in range(1, H + 1):
            for sy in syncs:
                inner_step(sy, step)
            syncs[0].capture_due(step)
            if step == H:
                time.sleep(6.0)
            syncs[1].capture_due(step)
            for sy in syncs:
                sy.apply_due(step)
    finally:
        timer.cancel()
    assert [sy.stats.last_contributors for sy in syncs] == [[0, 2], [0, 2]]
    assert syncs[1].stats.not_uploaded == 1 and syncs[0].stats.not_uploaded == 0
    assert_same_anchors(syncs)
    assert store.get(keys.round_record_key(run_id, 0, 0, 0)) is None  # no replica wrote what the set is
    # the next round: replica 2's fragment is there before anyone settles; all three are used
    plant(store, run_id, 1, 2, valid_blob(IDS[2], FragmentId(run_id, 0, 0, 1, 2), SHAPES, CFG)[0])
    for _ in lockstep(syncs, range(H + 1, 2 * H + 1)):
        pass
    assert [sy.stats.last_contributors for sy in syncs] == [[0, 1, 2], [0, 1, 2]]
    assert_same_anchors(syncs)


def test_a_late_replica_applies_the_same_sets_and_its_own_fragment_goes_back(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """A replica that reaches rounds after the others settled them (late, or rebuilt and replaying)
    reads the same final LIST and applies each round's set, fetching what it lacks; its own fragments,
    in the store after the rounds' deadlines, return to its error feedback; its anchor is the others'
    bit for bit."""
    H = 2
    _, syncs = make_replicas(store, SHAPES, R=3, H=H)
    closer.extend(syncs)
    early, late = syncs[:2], syncs[2]
    for sy in syncs:
        sy.exchange.timeout_s = 1.0
    for _ in lockstep(early, range(1, 2 * H + 1)):
        pass
    assert [sy.stats.last_contributors for sy in early] == [[0, 1], [0, 1]]
    for _ in lockstep([late], range(1, 2 * H + 1)):
        pass
    assert late.stats.last_contributors == [0, 1] and late.stats.rounds_applied == 2
    assert late.stats.not_uploaded == 2 and late.stats.missing == 0
    for a, b in zip(early[0].anchor, late.anchor, strict=True):
        assert torch.equal(a, b)


def test_a_replica_that_drops_out_mid_round_ends_the_wait_and_counts_as_missing(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Replicas 0 and 1 train; replica 2 (listed) never uploads. 1 s into the round's 20 s wait the
    coordinator's drop-out reaches both (set_stage_peers without replica 2): the round settles at once on
    {0, 1}, replica 2 counts as missing for that round, and the next round waits for no one."""
    import threading

    H = 2
    run_id, syncs = make_replicas(store, SHAPES, R=2, H=H, expected=3)
    closer.extend(syncs)
    for s in syncs:
        s.exchange.timeout_s = 20.0
    survivors = {r: IDS[r].peer_id for r in range(2)}
    timers = [threading.Timer(1.0, s.set_stage_peers, (survivors,)) for s in syncs]
    for t in timers:
        t.start()
    started = time.monotonic()
    try:
        for _ in lockstep(syncs, range(1, H + 1)):
            pass
    finally:
        for t in timers:
            t.cancel()
    assert time.monotonic() - started < 10, "the drop-out did not end the wait"
    assert [s.stats.last_contributors for s in syncs] == [[0, 1], [0, 1]]
    assert [s.stats.missing for s in syncs] == [1, 1]
    assert_same_anchors(syncs)
    started = time.monotonic()
    for _ in lockstep(syncs, range(H + 1, 2 * H + 1)):
        pass
    assert time.monotonic() - started < 5 and [s.stats.missing for s in syncs] == [1, 1]

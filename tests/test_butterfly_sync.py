"""Butterfly mixing through the outer loop (issue 23): OuterSync with `butterfly=` against a real S3 server
(moto), replicas simulated in one process in lockstep (every capture phase, then every apply phase)."""

from __future__ import annotations

import uuid

import pytest
import torch

from node.sync.outer_sync import OuterSync
from node.sync.pair_mix import digest
from node.sync.pair_sync import PairSettings
from node.sync.sparseloco_sync import SparseLoCoCodec, make_aggregator
from protocol.codecs.sparseloco import SparseLoCoConfig
from protocol.identity import Identity
from protocol.net.store import ObjectStore, StoreConfig
from protocol.pairing import partner
from protocol.runspec import RunSpec, SyncSpec
from protocol.sync_settings import AggregationSettings, Schedule

pytestmark = pytest.mark.timeout(120)

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(8)]
SHAPES = [(64, 64), (64,), (32, 64)]


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="butterfly-sync"))
    s.ensure_bucket()
    return s


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]


def replicas(
    store: ObjectStore,
    n: int,
    *,
    live: int | None = None,
    P: int = 2,
    tau: int = 1,
    ratio: float = 2.0,
    agreement: float = -1.0,
) -> list[OuterSync]:
    """`live` (default n) of n butterfly replicas; all n are in the stage's slots. agreement: the pair's
    gamma, off by default (`train`'s replicas move independently, so their messages barely agree)."""
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    cfg = PairSettings(
        replicas=n,
        alpha=1.0,
        ratio=ratio,
        blend="outer",
        max_abs=1e3,
        max_norm=1e5,
        weighted=False,
        agreement=agreement,
    )
    peers = {r: IDS[r].peer_id for r in range(n)}
    return [
        OuterSync(
            params(),
            store=store,
            codec=SparseLoCoCodec(IDS[r], SparseLoCoConfig()),
            aggregate=make_aggregator(AggregationSettings()),
            run_id=run_id,
            stage=0,
            replica=r,
            stage_peers=peers,
            schedule=Schedule(H=2 * P, P=P, tau=tau),
            alpha=1.0,
            timeout_s=1.0,
            poll_s=0.01,
            max_late_rounds=0,
            butterfly=cfg,
        )
        for r in range(live if live is not None else n)
    ]


def train(s: OuterSync, step: int, scale: float = 1e-3) -> None:
    g = torch.Generator().manual_seed(1000 * s.replica + step)
    with torch.no_grad():
        for p in s.params:
            p.add_(torch.randn(p.shape, generator=g) * scale)


def lockstep(syncs: list[OuterSync], steps: range) -> None:
    for step in steps:
        for s in syncs:
            train(s, step)
        for s in syncs:
            s.capture_due(step)
        for s in syncs:
            s.apply_due(step)


def test_both_ends_compute_the_same_pair_result_and_their_partners_follow_the_butterfly(
    store: ObjectStore,
) -> None:
    syncs = replicas(store, 4)
    try:
        lockstep(syncs, range(1, 18))  # 4 rounds x 2 fragments (the last applied at step 17)
        for s in syncs:
            st = s.pairs.stats if s.pairs else None
            assert st is not None and st.exchanged == 8 and st.missing == st.refused == st.unpaired == 0
            for name, entry in st.last.items():
                rnd, p, sha = entry.split(":")
                f = int(name.split(".")[1])
                assert int(p) == partner(s.replica, int(rnd), f, 4)
                theirs = syncs[int(p)].pairs.stats.last[name]  # type: ignore[union-attr]
                assert theirs == f"{rnd}:{s.replica}:{sha}"  # the same bits at both ends
                assert digest(s.pairs.bases[0, f, int(p)]) == sha  # type: ignore[union-attr]
        # no consensus: anchors differ, but every replica moved and all stay close to their mean
        flat = [torch.cat([a.flatten() for a in s.anchor]) for s in syncs]
        mean = sum(flat) / 4
        start = torch.cat([p.detach().flatten() for p in params()])
        moved = float((mean - start).norm())
        assert moved > 0 and len({digest([f]) for f in flat}) == 4
        assert max(float((f - mean).norm()) for f in flat) < moved
    finally:
        for s in syncs:
            s.finish()


def test_three_replicas_sit_out_the_missing_index_and_count_it(store: ObjectStore) -> None:
    syncs = replicas(store, 3, P=1, tau=0)
    try:
        lockstep(syncs, range(1, 9))  # rounds 0..3: stage 0 pairs 0-1 (2 sits out), stage 1 pairs 0-2
        counts = [(s.pairs.stats.exchanged, s.pairs.stats.unpaired) for s in syncs]  # type: ignore[union-attr]
        assert counts == [(4, 0), (2, 2), (2, 2)]
        assert [s.pairs.stats.missing for s in syncs] == [0, 0, 0]  # type: ignore[union-attr]
    finally:
        for s in syncs:
            s.finish()


def test_a_missing_partner_is_skipped_counted_and_its_delta_kept_in_error_feedback(
    store: ObjectStore,
) -> None:
    syncs = replicas(store, 4, live=3, P=1, tau=0)  # replica 3 holds a slot but never sends
    try:
        before = [[a.clone() for a in s.anchor] for s in syncs]
        lockstep(syncs, range(1, 3))  # round 0: pairs 0-1 and 2-3
        two = syncs[2]
        assert two.pairs is not None and two.pairs.stats.missing == 1 and two.pairs.stats.exchanged == 0
        assert all(torch.equal(a, b) for a, b in zip(two.anchor, before[2], strict=True))  # anchor kept
        ef = two.codec.residual(0, 0)
        assert sum(float(e.abs().sum()) for e in ef) > 0  # the unsent Delta is in error feedback
        assert [s.pairs.stats.exchanged for s in syncs[:2]] == [1, 1]  # type: ignore[union-attr]
    finally:
        for s in syncs:
            s.finish()


@pytest.mark.parametrize("hostile", [False, True])
def test_a_partner_whose_update_points_away_is_skipped_at_both_ends(
    store: ObjectStore, hostile: bool
) -> None:
    """The agreement rule (sync.pair_agreement = 0, the run spec's default) in the outer loop: two replicas
    descend one loss (a shared direction plus their own noise); a sign-flipping replica 1 moves against
    it. Honest, they exchange; hostile, both ends skip the exchange (counted as `disagreed`), keep their
    anchors, and each keeps its Delta in error feedback for its next partner."""
    assert SyncSpec().pair_agreement == 0.0
    syncs = replicas(store, 2, P=1, tau=0, agreement=0.0)
    try:
        before = [[a.clone() for a in s.anchor] for s in syncs]
        for step in (1, 2):
            shared = torch.Generator().manual_seed(step)
            direction = [torch.randn(p.shape, generator=shared) for p in syncs[0].params]
            for s in syncs:
                noise = torch.Generator().manual_seed(1000 * s.replica + step)
                sign = -1.0 if hostile and s.replica == 1 else 1.0
                with torch.no_grad():
                    for p, d in zip(s.params, direction, strict=True):
                        p.add_((sign * d + torch.randn(p.shape, generator=noise)) * 1e-3)
            for s in syncs:
                s.capture_due(step)
            for s in syncs:
                s.apply_due(step)
        stats = [s.pairs.stats for s in syncs]  # type: ignore[union-attr]
        assert [(x.exchanged, x.disagreed) for x in stats] == ([(0, 1)] * 2 if hostile else [(1, 0)] * 2)
        kept = [
            all(torch.equal(a, b) for a, b in zip(s.anchor, bs, strict=True))
            for s, bs in zip(syncs, before, strict=True)
        ]
        assert kept == [hostile, hostile]
        if hostile:
            for s in syncs:
                assert sum(float(e.abs().sum()) for e in s.codec.residual(0, 0)) > 0
    finally:
        for s in syncs:
            s.finish()


def test_a_skipped_exchange_s_delta_goes_out_whole_in_the_next_message() -> None:
    """Both ends skip an exchange (partner missing, a disagreement, a refusal, a resync): our message's
    Delta part goes back to error feedback as c / beta, so the next encode (beta e + Delta) carries c
    itself, not the beta c a plain restore leaves (30% lost at beta 0.7 per skip)."""
    from node.sync.outer_sync import FragmentId

    cfg = SparseLoCoConfig(chunk=64, k=4, beta=0.7)
    fid = FragmentId(run_id="whole", stage=0, fragment=0, round=1, replica=0)
    delta = [torch.randn(8, 64, generator=torch.Generator().manual_seed(3))]
    for whole in (True, False):
        codec = SparseLoCoCodec(Identity.from_seed(bytes(32)), cfg)
        _, sent = codec.encode(fid, delta, 64)()
        kept = [t.clone() for t in codec.residual(0, 0)]
        c = sent.tensors[0]
        assert float(c.abs().sum()) > 0
        codec.restore(fid, [c], whole=whole)
        carried = cfg.beta * codec.residual(0, 0)[0]  # what the next encode starts from, before its Delta
        expect = cfg.beta * kept[0] + (c if whole else cfg.beta * c)
        assert torch.allclose(carried, expect, atol=1e-6), whole


def test_pair_bases_survive_a_checkpoint(store: ObjectStore) -> None:
    syncs = replicas(store, 2, P=1, tau=0)
    try:
        lockstep(syncs, range(1, 5))
        names = [f"p{i}" for i in range(len(SHAPES))]
        state = syncs[0].state_tensors(names)
        assert any(k.startswith("pair.base.") for k in state)
        fresh = replicas(store, 2, P=1, tau=0)[0]
        fresh.load_state_tensors(names, state)
        assert fresh.pairs is not None and syncs[0].pairs is not None
        assert fresh.pairs.base_round == syncs[0].pairs.base_round == {(0, 0, 1): 1}
        assert digest(fresh.pairs.bases[0, 0, 1]) == digest(syncs[0].pairs.bases[0, 0, 1])
        fresh.finish()
    finally:
        for s in syncs:
            s.finish()


def test_a_hostile_partner_moves_an_honest_end_by_at_most_the_pair_bound(store: ObjectStore) -> None:
    """x100 and a sign flip by replica 1: replica 0's anchor moves from where an honest partner would have
    left it by at most rho (||z'_0|| / 2 + alpha / 2 ||c'_0||) (node/sync/pair_mix.py)."""
    honest = replicas(store, 2, P=1, tau=0)
    lockstep(honest, range(1, 3))
    for scale in (100.0, -1.0):
        syncs = replicas(store, 2, P=1, tau=0)
        try:
            for step in (1, 2):
                for s in syncs:  # replica 1's updates, so its pseudo-gradients, scaled
                    train(s, step, scale=1e-3 * (scale if s.replica == 1 else 1.0))
                for s in syncs:
                    s.capture_due(step)
                for s in syncs:
                    s.apply_due(step)
            a0 = torch.cat([a.flatten() for a in syncs[0].anchor])
            h0 = torch.cat([a.flatten() for a in honest[0].anchor])
            start = torch.cat([p.detach().flatten() for p in params()])
            own = float((h0 - start).norm())  # what replica 0's honest exchange moved it by
            assert float((a0 - h0).norm()) <= 2.0 * 2 * own + 1e-6  # rho x (its parts), with margin 2
        finally:
            for s in syncs:
                s.finish()
    for s in honest:
        s.finish()


@pytest.mark.parametrize(
    ("sync", "fix"),
    [
        ({"method": "diloco"}, "method = 'sparseloco'"),
        ({"outer_momentum": 0.9}, "outer_momentum = 0"),
        ({"quorum": 2}, "quorum = 0"),
        ({"max_late_rounds": 1}, "max_late_rounds = 0"),
    ],
)
def test_the_run_spec_refuses_what_butterfly_cannot_run(sync: dict[str, object], fix: str) -> None:
    settings = {"topology": "butterfly", "max_late_rounds": 0, **sync}
    with pytest.raises(ValueError, match=fix):
        SyncSpec(**settings)  # type: ignore[arg-type]


def test_butterfly_needs_two_replicas_and_names_its_settings() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        RunSpec(run_id="b", replicas=1, sync=SyncSpec(topology="butterfly", max_late_rounds=0))
    with pytest.raises(ValueError, match="sync.topology"):
        SyncSpec(topology="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sync.pair_blend"):
        SyncSpec(topology="butterfly", max_late_rounds=0, pair_blend="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"sync.pair_agreement=1.5 must be a finite number in \[-1, 1\]"):
        SyncSpec(topology="butterfly", max_late_rounds=0, pair_agreement=1.5)
    spec = RunSpec(run_id="b", replicas=3, sync=SyncSpec(topology="butterfly", max_late_rounds=0))
    assert spec.sync.pair_clip == 1.0 and spec.sync.pair_blend == "outer" and spec.sync.pair_agreement == 0


def test_ends_holding_different_bases_both_skip_and_restart_the_pair_from_zero(store: ObjectStore) -> None:
    """One end restored an older base (or applied an exchange the other skipped): the base tags in the two
    messages differ, both ends see it from the same bytes, skip that exchange and restart from one base."""
    syncs = replicas(store, 2, P=1, tau=0)
    try:
        lockstep(syncs, range(1, 5))  # rounds 0 and 1: bases agree
        one = syncs[1].pairs
        assert one is not None and syncs[0].pairs is not None
        one.bases[0, 0, 0] = [b + 1e-3 for b in one.bases[0, 0, 0]]  # replica 1 now holds another base
        before = [[a.clone() for a in s.anchor] for s in syncs]
        lockstep(syncs, range(5, 7))  # round 2: detected at both ends
        for s, b in zip(syncs, before, strict=True):
            assert s.pairs is not None and s.pairs.stats.resynced == 1 and s.pairs.stats.exchanged == 2
            assert all(torch.equal(x, y) for x, y in zip(s.anchor, b, strict=True))  # skipped
            assert all(float(t.abs().sum()) == 0 for t in s.pairs.bases[0, 0, 1 - s.replica])
        lockstep(syncs, range(7, 9))  # round 3: one base again, one pair result
        last = [s.pairs.stats.last["0.0"] for s in syncs]  # type: ignore[union-attr]
        assert last[0].split(":")[2] == last[1].split(":")[2] and last[0].startswith("3:")
        assert [s.pairs.stats.exchanged for s in syncs] == [3, 3]  # type: ignore[union-attr]
    finally:
        for s in syncs:
            s.finish()

"""Replicas of different batch sizes in one run (issue 22): each fragment carries, signed, the tokens its
replica trained on; receivers bound the claim by the replica's shape; the aggregate weighs by it.

Real parts: a real S3 server (moto) under the outer loop, the real codecs and their signed formats.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.sync.aggregation import aggregate
from node.sync.dense_sync import DenseCodec
from node.sync.exchange import FragmentId, TokenClaimError
from node.sync.outer_sync import OuterSync
from node.sync.sparseloco_sync import SparseLoCoCodec, make_sync_parts
from protocol.net.store import ObjectStore
from protocol.runspec import ReplicaShape, RunSpec, SyncSpec, TrainSpec, load_run_spec
from protocol.sync_settings import AggregationSettings
from tests.test_sparseloco_sync import (
    CFG,
    IDS,
    assert_same_anchors,
    make_replicas,
    store,  # noqa: F401  (the module's store fixture)
    stored_fragment,
)

pytestmark = pytest.mark.timeout(120)

SHAPES = [(64, 64), (64,)]
MIXED = RunSpec(
    run_id="mixed",
    replicas=3,
    train=TrainSpec(batch_size=8, microbatches=2),
    sync=SyncSpec(H=5),
    shapes=[ReplicaShape(replicas=[1], microbatches=4)],
)


def test_a_replica_shape_sets_its_batch_and_its_round_bound(tmp_path: Path) -> None:
    seq = MIXED.model.seq_len
    assert [MIXED.microbatches_of(r) for r in range(3)] == [2, 4, 2]
    assert [MIXED.batch_of(r) for r in range(3)] == [8, 16, 8]  # microbatches of 4 sequences each
    assert [MIXED.round_tokens_bound(r) for r in range(3)] == [5 * 8 * seq, 5 * 16 * seq, 5 * 8 * seq]
    toml = tmp_path / "run.toml"
    toml.write_text(
        '[run]\nrun_id = "mixed"\nreplicas = 3\n[train]\nbatch_size = 8\nmicrobatches = 2\n'
        "[[shapes]]\nreplicas = [1, 2]\nmicrobatches = 6\n"
    )
    assert [load_run_spec(toml).batch_of(r) for r in range(3)] == [8, 24, 24]
    for shapes, what in [
        ([ReplicaShape(replicas=[3], microbatches=4)], "0..replicas-1"),
        (
            [ReplicaShape(replicas=[1], microbatches=4), ReplicaShape(replicas=[1], microbatches=2)],
            "at most one",
        ),
    ]:
        with pytest.raises(ValueError, match=what):
            RunSpec(run_id="mixed", replicas=3, shapes=shapes)
    with pytest.raises(ValueError, match="shapes.microbatches"):
        ReplicaShape(replicas=[0], microbatches=-1)


@pytest.mark.parametrize("method", ["sparseloco", "diloco"])
def test_a_token_claim_beyond_the_replica_shape_is_refused_by_every_codec(method: str) -> None:
    """Both codecs sign the count; a receiver holding the run's spec refuses one above what the sender's
    shape can train on in a round (replica 1's bound is twice replica 0's), naming claim and bound."""
    spec = RunSpec(**{**MIXED.__dict__, "sync": SyncSpec(method=method, H=5)})  # type: ignore[arg-type]
    sender, receiver = make_sync_parts(spec, IDS[1]).codec, make_sync_parts(spec, IDS[0]).codec
    delta = [torch.randn(s) * 1e-2 for s in SHAPES]
    shapes = [torch.Size(s) for s in SHAPES]
    for r in (0, 1):
        fid = FragmentId("mixed", 0, 0, 3, r)
        most = spec.round_tokens_bound(r)
        data, own = sender.encode(fid, delta, most)()
        got = receiver.decode(fid, data, shapes, IDS[1].peer_id)
        assert got.tokens == own.tokens == most
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, own.tensors, strict=True))
        over, _ = sender.encode(fid, delta, most + 1)()
        with pytest.raises(TokenClaimError, match=f"claims {most + 1} tokens.*at most {most}"):
            receiver.decode(fid, over, shapes, IDS[1].peer_id)
    # replica 0 claiming replica 1's count: the bound is the slot's, not the claim's
    fid0 = FragmentId("mixed", 0, 0, 3, 0)
    data, _ = sender.encode(fid0, delta, spec.round_tokens_bound(1))()
    with pytest.raises(TokenClaimError):
        receiver.decode(fid0, data, shapes, IDS[1].peer_id)


def test_a_zero_claim_is_refused() -> None:
    fid = FragmentId("mixed", 0, 0, 0, 0)
    delta = [torch.ones(4)]
    with pytest.raises(ValueError, match="tokens=0"):  # the signed header cannot hold it
        SparseLoCoCodec(IDS[0], CFG).encode(fid, delta, 0)()
    data, _ = DenseCodec(IDS[0]).encode(fid, delta, 0)()
    with pytest.raises(TokenClaimError, match="claims 0 tokens"):
        DenseCodec(IDS[0]).decode(fid, data, [torch.Size([4])], IDS[0].peer_id)


def test_round_0_claims_are_bounded_by_the_steps_its_fragments_trained() -> None:
    """With P streaming fragments, fragment f of round 0 is captured c_f = (f+1) H/P steps in: that is all a
    fragment of it may claim (a hostile replica cannot outweigh honest ones there by claiming a round)."""
    spec = RunSpec(**{**MIXED.__dict__, "sync": SyncSpec(H=6, P=3)})  # type: ignore[arg-type]
    tps = [spec.tokens_per_step(r) for r in range(3)]
    assert [spec.fragment_tokens(1, f, 0) for f in range(3)] == [2 * tps[1], 4 * tps[1], 6 * tps[1]]
    assert [spec.fragment_tokens(0, f, 2) for f in range(3)] == [6 * tps[0]] * 3
    codec = make_sync_parts(spec, IDS[0]).codec
    fid = FragmentId("mixed", 0, 0, 0, 1)
    data, _ = codec.encode(fid, [torch.ones(64)], 3 * tps[1])()
    with pytest.raises(TokenClaimError, match=f"at most {2 * tps[1]}"):
        codec.decode(fid, data, [torch.Size([64])], IDS[0].peer_id)


def test_a_spec_whose_rounds_overflow_a_claim_is_refused() -> None:
    with pytest.raises(ValueError, match="more than a fragment can claim"):
        RunSpec(run_id="big", train=TrainSpec(batch_size=1 << 20, microbatches=1), sync=SyncSpec(H=1 << 20))


def train_step(syncs: list[OuterSync], step: int) -> list[list[int]]:
    """Replicas that learn alike (a shared direction plus their own noise, as honest replicas do: the
    default agreement screen leaves out a replica whose update is orthogonal to the others'), then every
    capture phase, then every apply phase."""
    shared = torch.Generator().manual_seed(step)
    common = [torch.randn(p.shape, generator=shared) * 1e-3 for p in syncs[0].params]
    for s in syncs:
        g = torch.Generator().manual_seed(1000 * s.replica + step)
        with torch.no_grad():
            for p, c in zip(s.params, common, strict=True):
                p.add_(c + torch.randn(p.shape, generator=g) * 5e-4)
    for s in syncs:
        s.capture_due(step)
    return [s.apply_due(step) for s in syncs]


@pytest.mark.parametrize("weighting", ["tokens", "equal"])
def test_the_aggregate_weighs_each_replica_by_the_tokens_it_trained(
    store: ObjectStore,  # noqa: F811
    weighting: str,
) -> None:
    """Four replicas through a real store, replica 1 at twice the batch: every round's weights are the
    tokens each trained (H x its tokens per step; the first round's captured after c_f steps), the anchors
    equal the aggregate of the stored fragments under those weights, identical on every replica; under
    "equal" they equal the unweighted aggregate. (Four, not three: the default trim keeps the median of
    three, whatever the weights.)"""
    H, P, tps = 4, 2, [100, 200, 100, 100]
    agg = AggregationSettings(weighting=weighting)  # type: ignore[arg-type]
    run_id, syncs = make_replicas(store, SHAPES, R=4, H=H, P=P, tokens_per_step=tps, agg=agg)
    prev = {f: [syncs[0].anchor[i].clone() for i in idx] for (_, f), idx in syncs[0].fragments.items()}
    try:
        for step in range(1, 3 * H + 1):
            applied = train_step(syncs, step)
            if not applied[0]:
                continue
            (f,) = applied[0]
            rnd = (step - 1) // H
            steps = min(step, H)  # since the fragment's previous capture (tau = 0: captured at `step`)
            assert all(s.stats.last_tokens == {r: steps * tps[r] for r in range(4)} for s in syncs), step
            contribs = {}
            for r in range(4):
                blob = stored_fragment(store, run_id, f, rnd, r)
                assert blob is not None
                fs = [syncs[0].params[i].shape for i in syncs[0].fragments[0, f]]
                contribs[r] = SparseLoCoCodec(IDS[r], CFG).decode(
                    FragmentId(run_id, 0, f, rnd, r), blob, fs, IDS[r].peer_id
                )
            tensors = {r: c.tensors for r, c in contribs.items()}
            weights = {r: float(c.tokens) for r, c in contribs.items()}
            want = aggregate(tensors, agg, weights=weights if weighting == "tokens" else None).tensors
            plain = aggregate(tensors, agg).tensors
            differs = any(not torch.equal(a, b) for a, b in zip(want, plain, strict=True))
            assert differs == (weighting == "tokens")  # the weights do move the aggregate
            assert_same_anchors(syncs)
            for j, i in enumerate(syncs[0].fragments[0, f]):
                assert torch.equal(syncs[0].anchor[i], prev[f][j] - want[j]), (step, f)
            prev[f] = [syncs[0].anchor[i].clone() for i in syncs[0].fragments[0, f]]
    finally:
        for s in syncs:
            s._io.shutdown(wait=True, cancel_futures=True)


class OverClaiming(SparseLoCoCodec):
    """A validly signed replica that trains honestly but signs three times the tokens it trained."""

    def encode(self, fid, delta, tokens):  # type: ignore[no-untyped-def]
        return super().encode(fid, delta, 3 * tokens)


def test_a_replica_claiming_more_tokens_than_its_shape_is_left_out_by_every_honest_replica(
    store: ObjectStore,  # noqa: F811
) -> None:
    """Issue 22 acceptance 2, the claimed token count, on a mixed run through a real store: replica 2
    signs 3x what its shape trains; both honest replicas (one of them at twice the batch) reject every
    fragment of it, each round settles with the two of them, weighted by their own claims, and their
    consensus stays identical."""
    spec = RunSpec(**{**MIXED.__dict__, "sync": SyncSpec(H=4)})  # type: ignore[arg-type]
    cfg = spec.sync.sparseloco()
    bound = make_sync_parts(spec, IDS[0]).codec.tokens_bound  # type: ignore[attr-defined]
    codecs = [SparseLoCoCodec(IDS[r], cfg, tokens_bound=bound) for r in range(2)]
    codecs.append(OverClaiming(IDS[2], cfg, tokens_bound=bound))
    tps = [spec.tokens_per_step(r) for r in range(3)]
    _, syncs = make_replicas(store, SHAPES, R=3, H=4, tokens_per_step=tps, codecs=codecs, timeout_s=1.0)
    try:
        for step in range(1, 2 * 4 + 1):
            train_step(syncs, step)
        honest = syncs[:2]
        assert_same_anchors(honest)
        for s in honest:
            assert s.stats.rejected == 2  # replica 2's fragment of each round, once each
            assert s.stats.last_tokens == {0: 4 * tps[0], 1: 4 * tps[1]}
            assert s.stats.rounds_applied == 2
    finally:
        for s in syncs:
            s._io.shutdown(wait=True, cancel_futures=True)


def test_the_dashboard_view_shows_each_replica_s_batch() -> None:
    from coordinator.run_figures import History
    from coordinator.run_views import run_view
    from protocol.messages import RunRecord

    view = run_view(RunRecord(spec=MIXED), None, {}, History())
    assert view["batches"] == [8, 16, 8]

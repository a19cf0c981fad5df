"""Fragments keyed by layer group (issue 22): replicas of different stage counts and layer splits exchange
the same layers. The spec's groups, the model-wide subspace plan, the assignment's group signers, and real
OuterSync replicas of two splits against a real S3 server (moto): one consensus per group, and the trust
rules on group keys (a node of the replica that does not hold the group, a claim beyond the shape)."""

from __future__ import annotations

import time

import pytest
import torch

from node.sync.outer_sync import FragmentId, OuterSync
from node.sync.sparseloco_sync import SparseLoCoCodec, make_aggregator
from node.worker import group_params
from protocol import keys
from protocol.codecs.subspace import subspace_plan
from protocol.identity import Identity
from protocol.messages import Assignment
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, PipelineSpec, ReplicaShape, RunSpec
from protocol.sync_settings import Schedule
from tests.helpers.fragment_faults import valid_blob
from tests.test_sparseloco_sync import AGG, CFG, closer, inner_step

pytestmark = pytest.mark.timeout(120)

__all__ = ["closer"]  # the fixture, used by name

MODEL = ModelSpec(d_model=64, n_layers=6, n_heads=2, d_ff=96, seq_len=32)
SPEC = RunSpec(
    run_id="groups",
    replicas=2,
    stages=2,
    model=MODEL,
    pipeline=PipelineSpec(link_k=[16]),
    shapes=[ReplicaShape(replicas=[1], microbatches=8, stages=3, link_k=[8, 32])],
)
"""Replica 0: stages [0, 3) [3, 6), k = 16; replica 1: [0, 2) [2, 4) [4, 6), k = 8 then 32, twice the batch."""


def test_groups_are_the_intervals_between_every_split_s_boundaries() -> None:
    assert SPEC.layer_ranges(0) == [(0, 3), (3, 6)] and SPEC.layer_ranges(1) == [(0, 2), (2, 4), (4, 6)]
    assert SPEC.mixed_layout and SPEC.max_stages == 3 and SPEC.stages_of(1) == 3
    assert SPEC.layer_groups() == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert [SPEC.groups_of(0, s) for s in range(2)] == [[0, 1], [2, 3]]
    assert [SPEC.groups_of(1, s) for s in range(3)] == [[0], [1, 2], [3]]
    assert [SPEC.stage_of_group(1, g) for g in range(4)] == [0, 1, 1, 2]
    names = [
        "embed.weight",
        "layers.0.attn.wq.weight",
        "layers.2.mlp.w_down.weight",
        "norm.weight",
        "head.weight",
    ]
    assert [SPEC.group_of_param(n) for n in names] == [0, 0, 1, 3, 3]
    assert group_params(SPEC, names) == {0: [0, 1], 1: [2], 3: [3, 4]}
    # a run whose replicas share a split has one group per stage: the keys of every earlier run
    uniform = RunSpec(run_id="u", stages=2, model=MODEL, shapes=[ReplicaShape(replicas=[1], microbatches=8)])
    assert not uniform.mixed_layout and uniform.layer_groups() == uniform.layer_ranges()
    for bad, what in [
        (ReplicaShape(replicas=[1], stages=7), "exceeds model.n_layers"),
        (ReplicaShape(replicas=[1], stages=3, layer_split=[3, 3]), "layer_split"),
        (ReplicaShape(replicas=[1], stages=3, link_k=[8]), "link_k has 1 values"),
        (ReplicaShape(replicas=[1], stages=3, link_k=[8, 99]), "1..d_model"),
    ]:
        with pytest.raises(ValueError, match=what):
            RunSpec(run_id="bad", model=MODEL, shapes=[bad])
    with pytest.raises(ValueError, match="layer_split_auto"):
        RunSpec(
            run_id="bad", model=MODEL, layer_split_auto=True, shapes=[ReplicaShape(replicas=[1], stages=3)]
        )


def test_one_subspace_plan_holds_for_every_split() -> None:
    """Each layer's span is the narrowest any split needs after it: replica 0's boundary at layer 3 (k 16)
    and replica 1's at 2 (k 8) and 4 (wire k 32) confine layers 0-1 to 8, layer 2 to 16, layer 3 to 32;
    layers 4-5 stay full-rank; E to 8. Both replicas' plans agree on all of it; each keeps its own wires."""
    plans = [
        subspace_plan(MODEL, SPEC.pipeline_of(r), SPEC.layer_ranges(r), layouts=SPEC.layouts())
        for r in (0, 1)
    ]
    assert plans[0].write_k == plans[1].write_k == {0: 8, 1: 8, 2: 16, 3: 32}
    assert plans[0].embed_k == plans[1].embed_k == 8 and plans[0].k_max == plans[1].k_max == 32
    assert plans[0].wire_k == (16,) and plans[1].wire_k == (8, 32)
    alone = subspace_plan(MODEL, SPEC.pipeline_of(0), SPEC.layer_ranges(0))  # what a split alone would need
    assert alone.write_k == {0: 16, 1: 16, 2: 16}


def test_an_assignment_names_signers_only_for_its_own_groups() -> None:
    base = dict(run_id="groups", term=1, epoch=1, peer_id="12D3KooWnode", replica=1, stage=1, layers=[2, 4])
    ok = Assignment(spec=SPEC, group_peers={"1": {"0": "A", "1": "B"}, "2": {"0": "C", "1": "B"}}, **base)  # type: ignore[arg-type]
    assert sorted(ok.group_peers) == ["1", "2"]
    with pytest.raises(
        ValueError, match=r"group_peers key '0' must be a layer group of this stage \(\[1, 2\]\)"
    ):
        Assignment(spec=SPEC, group_peers={"0": {"0": "A"}}, **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replica index below replicas=2"):
        Assignment(spec=SPEC, group_peers={"1": {"5": "A"}}, **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Assignment.stage"):
        Assignment(spec=SPEC, **{**base, "replica": 0, "stage": 2, "layers": [4, 6]})  # type: ignore[arg-type]


# --- real round owners of two splits --------------------------------------------------------------
GROUP_SHAPES = {0: [(48, 32), (32,)], 1: [(32, 32)]}
"""Two layer groups of a toy model, by group: their parameters' shapes."""
NODE = {
    (0, 0): Identity.from_seed(b"a" * 32),
    (1, 0): Identity.from_seed(b"b" * 32),
    (1, 1): Identity.from_seed(b"c" * 32),
}
"""Replica 0 holds both groups in one stage; replica 1 holds group 0 in stage 0 and group 1 in stage 1."""
H = 2


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="layer-groups"))
    s.ensure_bucket()
    return s


def params(groups: list[int]) -> list[torch.nn.Parameter]:
    out = []
    for g in groups:
        for j, shape in enumerate(GROUP_SHAPES[g]):
            gen = torch.Generator().manual_seed(100 * g + j)  # a parameter's start is its own, in any split
            out.append(torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02))
    return out


def owners(
    store: ObjectStore, run_id: str, claim: int = 1, quorum: int = 0
) -> dict[tuple[int, int], OuterSync]:
    """(replica, stage) -> the round owner of that stage; replica 1's fragments claim `claim` x the tokens."""
    signer = {
        0: {0: NODE[0, 0].peer_id, 1: NODE[1, 0].peer_id},
        1: {0: NODE[0, 0].peer_id, 1: NODE[1, 1].peer_id},
    }
    holds = {(0, 0): [0, 1], (1, 0): [0], (1, 1): [1]}
    out = {}
    for (r, s), groups in holds.items():
        index, at = {}, 0
        for g in groups:
            index[g] = list(range(at, at + len(GROUP_SHAPES[g])))
            at += len(GROUP_SHAPES[g])
        out[r, s] = OuterSync(
            params(groups),
            store=store,
            codec=SparseLoCoCodec(NODE[r, s], CFG, tokens_bound=lambda fid: H * (fid.replica + 1)),
            aggregate=make_aggregator(AGG),
            run_id=run_id,
            stage=s,
            replica=r,
            stage_peers={},
            groups=index,
            group_peers={g: signer[g] for g in groups},
            schedule=Schedule(H=H, P=1, tau=0),
            alpha=1.0,
            timeout_s=2.0,
            poll_s=0.01,
            tokens_per_step=(r + 1) * (claim if r == 1 else 1),  # replica 1: twice the batch
            quorum=quorum,
        )
    return out


def run_round(syncs: dict[tuple[int, int], OuterSync]) -> None:
    for step in range(1, H + 1):
        for s in syncs.values():
            inner_step(s, step)
        for s in syncs.values():
            s.capture_due(step)
        for s in syncs.values():
            s.apply_due(step)


def group_anchor(syncs: dict[tuple[int, int], OuterSync], replica: int, g: int) -> list[torch.Tensor]:
    for (r, _), s in syncs.items():
        if r == replica and g in s.groups:
            return [s.anchor[i] for i in s.groups[g]]
    raise AssertionError(f"replica {replica} holds no group {g}")


def test_two_splits_reach_one_consensus_per_group_and_a_non_holder_cannot_sign_for_a_group(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Replica 1's stage-0 node, which does not hold group 1, plants a validly signed group-1 fragment under
    replica 1's slot before the round: the group's signer there is stage 1's node, so every replica applies
    what it would have without the plant, bit for bit, weighing replica 1 at its tokens."""
    results = {}
    for arm in ("clean", "planted"):
        run_id = f"groups-{arm}-{time.monotonic_ns()}"
        syncs = owners(store, run_id)
        closer.extend(syncs.values())
        if arm == "planted":
            fid = FragmentId(run_id, 1, 0, 0, 1)
            blob = valid_blob(NODE[1, 0], fid, GROUP_SHAPES[1], CFG, seed=3)[0]
            store.put(keys.primary_fragment_key(run_id, 1, 0, 0, 1, NODE[1, 0].peer_id), blob)
        run_round(syncs)
        for s in syncs.values():
            assert s.stats.last_contributors == [0, 1] and s.stats.last_weights == {0: 2.0, 1: 4.0}
            assert s.stats.missing == 0
        for g in (0, 1):  # one consensus per group, whichever stage holds it
            for a, b in zip(group_anchor(syncs, 0, g), group_anchor(syncs, 1, g), strict=True):
                assert torch.equal(a, b), (arm, g)
        results[arm] = [t.clone() for g in (0, 1) for t in group_anchor(syncs, 0, g)]
        # the store holds the round under each group's key, written by the group's holder in each replica
        for g, r, who in ((0, 0, (0, 0)), (1, 0, (0, 0)), (0, 1, (1, 0)), (1, 1, (1, 1))):
            assert store.list(keys.slot_prefix(run_id, g, 0, 0, r) + NODE[who].peer_id + "/"), (g, r)
    for a, b in zip(results["clean"], results["planted"], strict=True):
        assert torch.equal(a, b)


def test_a_claim_beyond_a_replica_s_shape_is_refused_on_group_keys(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    run_id = f"groups-claim-{time.monotonic_ns()}"
    syncs = owners(store, run_id, claim=3, quorum=1)  # replica 1 claims 3 x what its shape trains
    closer.extend(syncs.values())
    run_round(syncs)
    honest = syncs[0, 0]  # holds both groups: each group's fragment from replica 1 is refused
    assert honest.stats.last_contributors == [0] and honest.stats.rejected == 2, honest.stats
    assert honest.stats.last_weights == {0: 2.0}


def test_each_layout_class_is_placed_on_nodes_that_fit_its_stages() -> None:
    """Replica 0 in 2 stages (about 4 GB each), replica 1 in 3 (about 2.7 GB): the class of fewer stages is
    placed first, on the two nodes with the memory for its stages, though the small nodes are faster; the
    3-stage replica gets the small ones. Too few large nodes: the error names the class that lacks them."""
    from coordinator.placement import PlacementError
    from coordinator.plan.layout_classes import layout_classes, place_run
    from protocol.messages import NodeAdvert
    from protocol.runspec import TrainSpec

    model = ModelSpec(d_model=2048, n_layers=6, n_heads=16, d_ff=5504, seq_len=256)
    spec = RunSpec(
        run_id="placed",
        replicas=2,
        stages=2,
        model=model,
        train=TrainSpec(batch_size=4, microbatches=2, precision="fp32"),
        shapes=[ReplicaShape(replicas=[1], stages=3)],
    )
    assert [c.replicas for c in layout_classes(spec)] == [(0,), (1,)]

    def node(i: int, gb: float, tflops: float) -> NodeAdvert:
        return NodeAdvert(
            peer_id=f"12D3KooWnode{i}",
            version="0",
            device="cpu",
            memory_gb=gb,
            free_memory_gb=gb,
            tflops=tflops,
            price_per_hour=0,
            host="127.0.0.1",
            port=1000 + i,
            health_port=2000 + i,
        )

    pool = [node(0, 8, 1), node(1, 8, 1), node(2, 3.5, 5), node(3, 3.5, 5), node(4, 3.5, 5)]
    pl = place_run(pool, spec)
    assert sorted(pl.slots) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert {pl.slots[0, 0], pl.slots[0, 1]} == {"12D3KooWnode0", "12D3KooWnode1"}
    assert pl.tokens_per_s > 0
    with pytest.raises(PlacementError, match=r"replicas \[0\] \(2 stages\)"):
        place_run([pool[0], *pool[2:], node(5, 3.5, 5)], spec)


def test_a_stage_of_four_groups_puts_every_group_s_fragment_in_time(
    store: ObjectStore, closer: list[OuterSync]
) -> None:
    """Each group's exchange holds an I/O thread from its put until its round settles: a stage holding 4
    groups still puts all 4 fragments at the capture (a pool of 2 threads sent groups 2 and 3 after the
    first two settled, past a 1 s deadline), and a checkpoint of a build before groups (error feedback
    named "ef.{f}.{j}") restores into a stage of one group."""
    run_id = f"groups-four-{time.monotonic_ns()}"
    shapes = {g: [(32, 16)] for g in range(4)}
    syncs = []
    for r in range(2):
        syncs.append(
            OuterSync(
                [torch.nn.Parameter(torch.full(shapes[g][0], 0.01 * g)) for g in range(4)],
                store=store,
                codec=SparseLoCoCodec((NODE[0, 0], NODE[1, 0])[r], CFG),
                aggregate=make_aggregator(AGG),
                run_id=run_id,
                stage=0,
                replica=r,
                stage_peers={0: NODE[0, 0].peer_id, 1: NODE[1, 0].peer_id},
                groups={g: [g] for g in range(4)},
                schedule=Schedule(H=H, P=1, tau=0),
                alpha=1.0,
                timeout_s=1.0,
                poll_s=0.01,
            )
        )
    closer.extend(syncs)
    for step in range(1, H + 1):
        for s in syncs:
            inner_step(s, step)
        for s in syncs:
            s.capture_due(step)
        for s in syncs:
            s.apply_due(step)
    for s in syncs:
        assert s.stats.last_contributors == [0, 1] and s.stats.not_uploaded == 0 and s.stats.missing == 0
        assert s.stats.rounds_applied == 4  # one per group
    old = {f"codec.ef.0.{j}": torch.ones(4, 4) for j in range(2)}
    one = owners(store, f"groups-old-{time.monotonic_ns()}")[1, 1]  # a stage of one group (1)
    closer.append(one)
    one.codec.load_state({})
    one.load_state_tensors(
        [f"p{i}" for i in range(len(one.params))],
        {**{f"anchor.p{i}": p.detach() for i, p in enumerate(one.params)}, **old},
    )
    assert [t.shape for t in one.codec.residual(1, 0)] == [torch.Size([4, 4])] * 2


def test_a_mixed_run_s_assignment_names_every_group_of_its_stage() -> None:
    base = dict(run_id="groups", term=1, epoch=1, peer_id="12D3KooWnode", replica=1, stage=1, layers=[2, 4])
    with pytest.raises(ValueError, match=r"needs the signers of each of the stage's groups \[1, 2\]"):
        Assignment(spec=SPEC, group_peers={"1": {"0": "A", "1": "B"}}, **base)  # type: ignore[arg-type]

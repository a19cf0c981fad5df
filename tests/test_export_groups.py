"""Export and resume of a run whose replicas differ in layer split, agreed layer group by layer group,
against a real S3 server (moto on loopback, tests/conftest.py).

Replica 0 holds the 6-layer model in 2 stages [3, 3], replica 1 in 3 stages [2, 2, 2]: the layer groups are
(0,2) (2,3) (3,4) (4,6), and no stage of one replica holds the layers of the other's stage of the same
index, so whole-stage anchor digests never match. Every slot checkpoints through the worker's own writer
(`StageCheckpoints.write`), which signs one digest per layer group the stage holds. Faults are injected on
purpose: a node whose anchor of one group is not the consensus (signing its own digest), and one whose
tensors are not what its manifest signs.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from coordinator.cli import main as coordinator_main
from coordinator.export import consensus_states, export_llama, export_parts, fold_to_llama
from node.model import build_stage
from node.subspace_model import constrain_stage, project_weights_
from node.sync.stage_checkpoints import StageCheckpoints
from protocol import keys
from protocol.checkpoint import (
    ANCHOR_META,
    GROUP_ANCHOR_META,
    anchor_sha256,
    group_anchor_meta,
    group_anchor_sha256,
    read_manifest,
    write_checkpoint,
)
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment, RunRecord
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, PipelineSpec, ReplicaShape, RunSpec, SyncSpec, TrainSpec
from protocol.trust.assignment_archive import encode_archive
from protocol.trust.delegation import OperatorTrust

pytestmark = pytest.mark.timeout(120)

BUCKET = "export-groups"
OPERATOR = Identity.from_seed(b"g" * 32)
MODEL = ModelSpec(vocab=256, d_model=32, n_layers=6, n_heads=2, d_ff=64, seq_len=16)
SLOTS = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
"""(replica, stage) of every node."""
NODES = {slot: Identity.from_seed(bytes([40 + 10 * slot[0] + slot[1]]) * 32) for slot in SLOTS}


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket=BUCKET))
    s.ensure_bucket()
    return s


def make_spec() -> RunSpec:
    # H = 5, tau = 0: round r is checkpointed at step 5 r; subspace links k = 8 < d on every boundary
    return RunSpec(
        run_id=f"groups-{uuid.uuid4().hex[:10]}",
        replicas=2,
        stages=2,
        model=MODEL,
        train=TrainSpec(total_steps=100),
        sync=SyncSpec(H=5),
        pipeline=PipelineSpec(link_k=[8]),
        shapes=[ReplicaShape(replicas=[1], stages=3, layer_split=[2, 2, 2], link_k=[8, 8])],
    )


def assignment(spec: RunSpec, replica: int, stage: int) -> Assignment:
    """As coordinator/run_publisher.py signs them: stage_peers only the replicas of this one's split, each
    layer group's signer in every replica in group_peers."""
    same = [r for r in range(spec.replicas) if spec.layer_ranges(r) == spec.layer_ranges(replica)]
    return Assignment(
        run_id=spec.run_id,
        term=1,
        epoch=1,
        peer_id=NODES[replica, stage].peer_id,
        replica=replica,
        stage=stage,
        layers=list(spec.layer_ranges(replica)[stage]),
        spec=spec,
        stage_peers={str(r): NODES[r, stage].peer_id for r in same},
        group_peers={
            str(g): {str(r): NODES[r, spec.stage_of_group(r, g)].peer_id for r in range(spec.replicas)}
            for g in spec.groups_of(replica, stage)
        },
        start_step=-1,
        issued_at=time.time(),
    )


def launch(store: ObjectStore, spec: RunSpec) -> None:
    """The operator's signed run record and assignment archive, as a coordinator leaves them."""
    store.put(
        keys.spec_key(spec.run_id), seal(OPERATOR, RunRecord(spec=spec, state="running", updated=time.time()))
    )
    store.put(
        keys.assign_key(spec.run_id, 1, 1), encode_archive(OPERATOR, [assignment(spec, *s) for s in SLOTS])
    )


def consensus(spec: RunSpec, rnd: int) -> dict[str, torch.Tensor]:
    """The round's consensus by global parameter name: replica 1's stages as the worker builds and
    constrains them (the model's spans, every layout's), moved far from init and projected back."""
    g = torch.Generator().manual_seed(rnd)
    ranges, out = spec.layer_ranges(1), {}
    for s in range(len(ranges)):
        stage = build_stage(spec.model, ranges, s)
        constrain_stage(stage, spec.model, spec.pipeline_of(1), ranges, s, layouts=spec.layouts())
        with torch.no_grad():
            for p in stage.parameters():
                p.add_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        project_weights_(stage)
        out.update({n: p.detach().clone() for n, p in stage.named_parameters()})
    return out


def slot_tensors(
    spec: RunSpec, replica: int, stage: int, anchors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What a worker checkpoints: its local weights (drifted from the anchor), the anchor, the momentum."""
    names = build_stage(spec.model, spec.layer_ranges(replica), stage).state_dict()
    out = {f"model.{n}": anchors[n] + 0.01 * (replica + 1) for n in names}
    out.update({f"anchor.{n}": anchors[n] for n in names})
    out.update({f"outer_m.{n}": torch.zeros_like(anchors[n]) for n in names})
    return out


def hostile(anchors: dict[str, torch.Tensor], layer: int = 2) -> dict[str, torch.Tensor]:
    """The consensus with layer `layer` (of layer group 1, layers 2-2) not the consensus."""
    return {n: t + 1.0 if n.startswith(f"layers.{layer}.") else t for n, t in anchors.items()}


def train(
    store: ObjectStore, spec: RunSpec, rounds: int, skip: set[tuple[int, int, int]] = frozenset()
) -> None:
    """Every slot checkpoints rounds 1..rounds through the worker's writer, except (replica, stage, round)
    in `skip`."""
    for r, s in SLOTS:
        writer = StageCheckpoints(store, NODES[r, s], assignment(spec, r, s))
        for rnd in range(1, rounds + 1):
            if (r, s, rnd) not in skip:
                writer.write(slot_tensors(spec, r, s, consensus(spec, rnd)), step=5 * rnd, rnd=rnd)
                writer.join()


def write_as(
    store: ObjectStore,
    spec: RunSpec,
    slot: tuple[int, int],
    rnd: int,
    tensors: dict[str, torch.Tensor],
    meta_of: dict[str, torch.Tensor] | None = None,
) -> None:
    """A checkpoint signed by the slot's own node, its manifest's digests those of `meta_of` (default: of
    its tensors)."""
    signed = meta_of if meta_of is not None else tensors
    meta: dict[str, int | float | str] = {
        ANCHOR_META: anchor_sha256(signed),
        **group_anchor_meta(spec, signed),
    }
    r, s = slot
    write_checkpoint(
        store,
        NODES[slot],
        run_id=spec.run_id,
        stage=s,
        replica=r,
        round=rnd,
        step=5 * rnd,
        tensors=tensors,
        meta=meta,
    )


def exported(spec: RunSpec, states: list[dict[str, torch.Tensor]], out: Path) -> dict[str, torch.Tensor]:
    export_llama(spec, states, out)
    return load_file(out / "model.safetensors")


def assert_is_consensus(spec: RunSpec, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    ref = fold_to_llama(spec, want)
    assert sorted(got) == sorted(ref)
    for name, t in ref.items():
        assert torch.allclose(got[name], t, atol=1e-6), name


def test_group_digests_are_per_layer_group_and_signed_by_the_writer(store: ObjectStore) -> None:
    spec = make_spec()
    assert spec.mixed_layout and spec.layer_groups() == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert export_parts(spec) == spec.layer_groups()
    launch(store, spec)
    train(store, spec, 1)
    anchors = consensus(spec, 1)
    digests = {}
    for r, s in SLOTS:
        m = read_manifest(store, run_id=spec.run_id, stage=s, replica=r, round=1, trusted=None)
        held = {g: m.group_anchor_sha256(g) for g in range(4) if m.group_anchor_sha256(g) is not None}
        assert sorted(held) == spec.groups_of(r, s), (r, s, m.manifest.meta)
        assert held == group_anchor_sha256(spec, slot_tensors(spec, r, s, anchors))
        for g, digest in held.items():
            assert digests.setdefault(g, digest) == digest  # one digest per group, whatever the split
    # a stage holding one group: its group's digest is the whole-stage digest
    one = slot_tensors(spec, 1, 2, anchors)
    assert group_anchor_sha256(spec, one) == {3: anchor_sha256(one)}
    # junk names are no group's (a hostile checkpoint does not crash the reader)
    junk = {"anchor.layers.x.w": torch.ones(1), "anchor.layers.99.w": torch.ones(1), "other": torch.ones(1)}
    assert group_anchor_sha256(spec, junk) == {}
    # a run whose replicas share one split signs no group digests (its checkpoints are as before)
    uniform = RunSpec(run_id=f"uniform-{uuid.uuid4().hex[:8]}", replicas=2, stages=2, model=MODEL)
    a = Assignment(
        run_id=uniform.run_id,
        term=1,
        epoch=1,
        peer_id=NODES[0, 0].peer_id,
        replica=0,
        stage=0,
        layers=[0, 3],
        spec=uniform,
        stage_peers={"0": NODES[0, 0].peer_id},
    )
    writer = StageCheckpoints(store, NODES[0, 0], a)
    writer.write({"anchor.embed.weight": torch.ones(2)}, step=0, rnd=0)
    writer.join()
    m = read_manifest(store, run_id=uniform.run_id, stage=0, replica=0, round=0, trusted=None)
    assert (
        not [k for k in m.manifest.meta if k.startswith(GROUP_ANCHOR_META)] and ANCHOR_META in m.manifest.meta
    )


def test_a_mixed_run_exports_the_consensus_its_replicas_agree_on_per_group(
    store: ObjectStore, moto_store: str, tmp_path: Path
) -> None:
    spec = make_spec()
    launch(store, spec)
    train(store, spec, 2)
    got_spec, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert (got_spec, rnd, len(states)) == (spec, 2, 4)
    assert_is_consensus(spec, exported(spec, states, tmp_path / "a"), consensus(spec, 2))
    # a named round: any one valid checkpoint of each group
    _, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key}, 1)
    assert rnd == 1
    assert_is_consensus(spec, exported(spec, states, tmp_path / "b"), consensus(spec, 1))
    # the CLI exports it too
    out = tmp_path / "cli"
    argv = ["export", spec.run_id, "--out", str(out), "--operator-key", OPERATOR.peer_id]
    argv += ["--store-endpoint", moto_store, "--store-bucket", BUCKET]
    assert coordinator_main(argv) == 0
    assert_is_consensus(spec, load_file(out / "model.safetensors"), consensus(spec, 2))


def test_a_group_anchor_one_replica_alone_signs_is_not_exported(store: ObjectStore, tmp_path: Path) -> None:
    """Replica 1's node of layers 2-3 signs its own anchor of layer group 1 at round 2: the group has no
    second witness there, so the export falls back to round 1; with no honest round it refuses, naming the
    group. A named round takes the one replica's checkpoint anyway."""
    spec = make_spec()
    launch(store, spec)
    train(store, spec, 2, skip={(1, 1, 2)})
    write_as(store, spec, (1, 1), 2, slot_tensors(spec, 1, 1, hostile(consensus(spec, 2))))
    _, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert rnd == 1
    assert_is_consensus(spec, exported(spec, states, tmp_path / "a"), consensus(spec, 1))

    spec = make_spec()
    launch(store, spec)
    train(store, spec, 1, skip={(1, 1, 1)})
    write_as(store, spec, (1, 1), 1, slot_tensors(spec, 1, 1, hostile(consensus(spec, 1))))
    with pytest.raises(ValueError, match="no round with a valid checkpoint of every layer group") as refused:
        consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert "layer group 1 (layers 2-2)" in str(refused.value), refused.value
    assert "--round" in str(refused.value)
    _, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key}, 1)
    assert rnd == 1 and len(states) == 4


def test_tensors_that_do_not_hold_the_signed_group_anchor_are_passed_over(
    store: ObjectStore, tmp_path: Path
) -> None:
    """Replica 0's first stage (layers 0-2) signs the consensus digests but its tensors hold another anchor
    of layer group 1: its groups 0 is still taken from it, group 1 from replica 1's checkpoint instead."""
    spec = make_spec()
    launch(store, spec)
    train(store, spec, 1, skip={(0, 0, 1)})
    honest = slot_tensors(spec, 0, 0, consensus(spec, 1))
    write_as(store, spec, (0, 0), 1, slot_tensors(spec, 0, 0, hostile(consensus(spec, 1))), meta_of=honest)
    _, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert rnd == 1
    assert_is_consensus(spec, exported(spec, states, tmp_path), consensus(spec, 1))


def test_a_mixed_run_resumes_only_a_round_every_group_of_its_stages_agrees_on(store: ObjectStore) -> None:
    """Resume (rule 3 per layer group, rule 4 over the replica's later stages): replica 1's first stage
    resumes from round 2 when every group agrees; when replica 0 signs its own anchor of layer group 1 at
    round 2 (held by replica 1's second stage), from round 1, the refusal naming the group."""
    operator = OperatorTrust.of({OPERATOR.public_key})
    spec = make_spec()
    launch(store, spec)
    train(store, spec, 2)
    for slot in ((1, 0), (0, 0), (0, 1)):
        reader = StageCheckpoints(store, NODES[slot], assignment(spec, *slot), operator=operator)
        ck = reader.latest()
        assert ck is not None and ck.round == 2, (slot, [str(r) for r in reader.refused])
    second = StageCheckpoints(store, NODES[1, 1], assignment(spec, 1, 1))
    assert second.at_step(10).round == 2

    spec = make_spec()
    launch(store, spec)
    train(store, spec, 2, skip={(0, 0, 2)})
    write_as(store, spec, (0, 0), 2, slot_tensors(spec, 0, 0, hostile(consensus(spec, 2))))
    reader = StageCheckpoints(store, NODES[1, 0], assignment(spec, 1, 0), operator=operator)
    ck = reader.latest()
    reasons = [str(r) for r in reader.refused]
    assert ck is not None and ck.round == 1, reasons
    assert any("layer group 1 (layers 2-2)" in r and "s1/r1" in r for r in reasons), reasons
    # the hostile replica's own first stage finds no witness of its group 1 at round 2 either
    victim = StageCheckpoints(store, NODES[0, 0], assignment(spec, 0, 0), operator=operator)
    ck = victim.latest()
    assert ck is not None and ck.round == 1, [str(r) for r in victim.refused]
    # replica 1's later stage, told to resume at round 2 by its first stage, reads its own (group 3 agrees)
    last = StageCheckpoints(store, NODES[1, 2], assignment(spec, 1, 2))
    assert last.at_step(10).round == 2

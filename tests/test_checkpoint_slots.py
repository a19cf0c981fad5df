"""Checkpoint slots bound to their replica (issue 21, acceptance 5), against a real S3 server (moto).

Two replicas of two stages checkpoint through `StageCheckpoints` (the worker's own writer and reader): stage 0
rounds 1-4, stage 1 rounds 1-3 (its round 4 never finished). Then replica 1's first-stage node, validly
signed and trusted for its own slot, attacks: it signs replica 0's slot at round 1,000,000 and at rounds 6 and
10, its own slot at rounds 10 and 1,000,000, a manifest for replica 0's second stage at round 4 and junk ones
for later stages; and 3,000 junk prefixes go under ckpt/. Before, every replica's node was trusted for every
slot, the higher round won, later stages were only HEADed, and every listed prefix cost a GET (20-25 s).

Every S3 call the victim makes is counted on its store client's botocore events, as
tests/test_fragment_polling.py does (a hook on the real client, not a mock).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import pytest
import torch

from coordinator.export import consensus_states
from node.sync.stage_checkpoints import StageCheckpoints
from protocol import keys
from protocol.checkpoint import ANCHOR_META, anchor_sha256, checkpoint_rounds, write_checkpoint
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment, RunRecord
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ReplicaShape, RunSpec, SyncSpec, TrainSpec
from protocol.trust.assignment_archive import encode_archive
from protocol.trust.delegation import OperatorTrust
from tests.test_fragment_polling import Requests

pytestmark = pytest.mark.timeout(120)

BUCKET = "checkpoint-slots"
OPERATOR = Identity.from_seed(b"o" * 32)
NODES = {(r, s): Identity.from_seed(bytes([10 * r + s + 1]) * 32) for r in range(2) for s in range(2)}
"""(replica, stage) -> the node serving it."""
FORMER = Identity.from_seed(b"f" * 32)
"""Served replica 0's first stage before NODES[0, 0] (a former node: still a signer of that slot)."""
ATTACKER = NODES[1, 0]
FAR = 1_000_000


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket=BUCKET))
    s.ensure_bucket()
    return s


def make_spec(stages: int = 2) -> RunSpec:
    # H = 5, tau = 0: round r is checkpointed at step 5 r; rounds 1-20. A mixed-batch run (issue 22
    # acceptance 2): replica 1 at twice the microbatches; slots stay bound to their replica all the same
    return RunSpec(
        run_id=f"slots-{uuid.uuid4().hex[:10]}",
        replicas=2,
        stages=stages,
        train=TrainSpec(total_steps=100),
        sync=SyncSpec(H=5),
        shapes=[ReplicaShape(replicas=[1], microbatches=8)],
    )


def assignment(spec: RunSpec, replica: int, stage: int) -> Assignment:
    return Assignment(
        run_id=spec.run_id,
        term=1,
        epoch=1,
        peer_id=NODES[replica, stage].peer_id,
        replica=replica,
        stage=stage,
        layers=list(spec.layer_ranges()[stage]),
        spec=spec,
        stage_peers={str(r): NODES[r, stage].peer_id for r in range(2)},
        former_stage_peers={"0": [FORMER.peer_id]} if stage == 0 else {},
        start_step=-1,
        issued_at=time.time(),
    )


def tensors(replica: int, stage: int, rnd: int, *, hostile: bool = False) -> dict[str, torch.Tensor]:
    """The consensus anchor is one per (stage, round), the same on every replica; the local weights are not."""
    g = torch.Generator().manual_seed(1000 * stage + rnd + (7_777 if hostile else 0))
    anchor = torch.randn(4, 8, generator=g) * (100.0 if hostile else 1.0)
    return {"model.w": anchor + 0.01 * (replica + 1), "anchor.w": anchor, "outer_m.w": torch.zeros(4, 8)}


def launch(store: ObjectStore, spec: RunSpec) -> None:
    """The operator's signed run record and assignment archive, as a coordinator leaves them."""
    store.put(
        keys.spec_key(spec.run_id), seal(OPERATOR, RunRecord(spec=spec, state="running", updated=time.time()))
    )
    archive = [assignment(spec, r, s) for r in range(2) for s in range(2)]
    store.put(keys.assign_key(spec.run_id, 1, 1), encode_archive(OPERATOR, archive))


def train(store: ObjectStore, spec: RunSpec, rounds: dict[int, int]) -> None:
    """Every replica's stage s checkpoints rounds 1..rounds[s], through the worker's writer."""
    for s, last in rounds.items():
        for r in range(2):
            ck = StageCheckpoints(store, NODES[r, s], assignment(spec, r, s))
            for rnd in range(1, last + 1):
                ck.write(tensors(r, s, rnd), step=5 * rnd, rnd=rnd)
                ck.join()


def forge(store: ObjectStore, spec: RunSpec, who: Identity, stage: int, replica: int, rnd: int) -> None:
    """A whole, validly signed checkpoint (and a LATEST pointer) by `who`, at the step the round would have,
    its manifest naming its own hostile anchor."""
    bad = tensors(replica, stage, rnd, hostile=True)
    meta: dict[str, int | float | str] = {ANCHOR_META: anchor_sha256(bad)}
    write_checkpoint(
        store,
        who,
        run_id=spec.run_id,
        stage=stage,
        replica=replica,
        round=rnd,
        step=5 * rnd,
        tensors=bad,
        meta=meta,
    )


def junk(store: ObjectStore, run_id: str, n: int = 3000) -> None:
    """n junk prefixes under ckpt/: round folders above, among and below the real rounds, and other names.
    Put straight into the S3 server's storage: the session's moto server runs in this process
    (tests/conftest.py), and 3,000 HTTP PUTs take 10-25 s on 2 cores. They are listed back over HTTP."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    names = [f"{keys.ckpt_prefix(run_id)}{4 + 337 * i:08d}/junk" for i in range(n // 2)]
    names += [f"{keys.ckpt_prefix(run_id)}x{i}/junk" for i in range(n - len(names))]
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    for name in names:
        backend.put_object(BUCKET, name, b"junk")
    assert len(store.list_prefixes(keys.ckpt_prefix(run_id))) >= n  # what any reader of the store sees


def attack(store: ObjectStore, spec: RunSpec) -> None:
    run = spec.run_id
    for rnd in (FAR, 6, 10):
        forge(store, spec, ATTACKER, 0, 0, rnd)  # another replica's slot
    for rnd in (10, FAR):
        forge(store, spec, ATTACKER, 0, 1, rnd)  # its own slot, at rounds nobody else reached
    forge(store, spec, ATTACKER, 1, 0, 4)  # the later stage of the victim's replica, where it never finished
    for rnd, s, r in ((10, 1, 0), (10, 1, 1), (FAR, 1, 0), (FAR, 1, 1), (12, 0, 0), (12, 1, 0)):
        store.put(keys.ckpt_manifest_key(run, rnd=rnd, stage=s, replica=r), b"junk")  # later stages', ours
    junk(store, run)


def test_a_node_forging_another_replica_s_slot_and_junk_do_not_move_the_resume_or_the_export(
    store: ObjectStore, moto_store: str
) -> None:
    spec = make_spec()
    launch(store, spec)
    train(store, spec, {0: 4, 1: 3})  # stage 1's round 4 never finished: round 3 is the replica's newest
    attack(store, spec)

    victim_store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket=BUCKET))
    seen = Requests(victim_store)
    operator = OperatorTrust.of({OPERATOR.public_key})
    victim = StageCheckpoints(victim_store, NODES[0, 0], assignment(spec, 0, 0), operator=operator)
    ck = victim.latest()
    assert ck is not None and (ck.round, ck.step) == (3, 15), [str(r) for r in victim.refused]
    assert torch.equal(ck.tensors["model.w"], tensors(0, 0, 3)["model.w"])  # replica 0's own, not a copy
    assert anchor_sha256(ck.tensors) == anchor_sha256(tensors(1, 0, 3))
    reasons = " | ".join(str(r) for r in victim.refused)  # round 4 of stage 1 is forged, not just absent
    assert any(r.round == 4 and "not among" in r.reason and "s1/r0" in r.key for r in victim.refused), reasons
    assert any("not among" in r.reason and "/s0/r0/" in r.key for r in victim.refused), reasons

    # bounded, whatever lies under ckpt/: a bisection over the run's 20 checkpoint rounds (at most 5 probes,
    # each 2 manifests and up to 2 later stages' = 20 GETs), the round read (manifest, HEAD, tensors), the
    # assignment archive (1 LIST, 1 GET): at most 25 (21 here; the old reader resumed from round 1,000,000).
    # No listing of ckpt/, no junk prefix read, no LATEST pointer asked
    assert len(checkpoint_rounds(spec)) == 20
    calls = seen.calls
    assert len(calls) <= 5 * 4 + 3 + 2, calls
    assert seen.count("ListObjectsV2") == 1 and all(
        k.startswith(keys.assign_prefix(spec.run_id)) for o, k, _ in calls if o == "ListObjectsV2"
    )
    assert not [k for _, k, _ in calls if k.endswith("/junk") or "LATEST" in k or f"{FAR:08d}" in k], calls

    # the replica's second stage reads round 3; the forged round 4 of its slot is refused, naming why
    second = StageCheckpoints(store, NODES[0, 1], assignment(spec, 0, 1))
    assert second.at_step(15).round == 3
    with pytest.raises(RuntimeError, match="no valid checkpoint of round 4"):
        second.at_step(20, wait_s=0.0)
    assert any("not among" in r.reason for r in second.refused), [str(r) for r in second.refused]

    # export takes the newest round two replicas' checkpoints of every stage agree on; a named far round is
    # not a round the run checkpoints: refused
    got_spec, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert (got_spec, rnd) == (spec, 3)
    for s, state in enumerate(states):
        assert torch.equal(state["w"], tensors(0, s, 3)["anchor.w"])
    with pytest.raises(ValueError, match="no round with a valid checkpoint of every stage"):
        consensus_states(store, spec.run_id, {OPERATOR.public_key}, FAR)


def test_a_former_node_s_far_round_in_its_own_slot_is_not_vouched_for(store: ObjectStore) -> None:
    """The node replica 0's first stage had before (still a signer of that slot) signs the slot at rounds
    nobody else reached (one of them holding round 3's honest tensors and digest, as a replay), and replica
    1's slot at one of them: the victim still resumes from round 3, and export ignores them."""
    spec = make_spec()
    launch(store, spec)
    train(store, spec, {0: 3, 1: 3})
    for rnd in (7, 20):
        forge(store, spec, FORMER, 0, 0, rnd)
    forge(store, spec, FORMER, 0, 1, 7)  # not its slot: no voucher for its round 7
    copied = tensors(0, 0, 3)
    write_checkpoint(
        store,
        FORMER,
        run_id=spec.run_id,
        stage=0,
        replica=0,
        round=5,
        step=25,
        tensors=copied,
        meta={ANCHOR_META: anchor_sha256(copied)},
    )
    victim = StageCheckpoints(
        store, NODES[0, 0], assignment(spec, 0, 0), operator=OperatorTrust.of({OPERATOR.public_key})
    )
    ck = victim.latest()
    reasons = [str(r) for r in victim.refused]
    assert ck is not None and ck.round == 3 and ck.signer == NODES[0, 0].public_key, reasons
    assert any("vouches" in r for r in reasons), reasons
    _, rnd, _ = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert rnd == 3


def test_a_node_serving_two_slots_is_no_second_witness(store: ObjectStore) -> None:
    """A node that served replica 0's first stage and now serves replica 1's signs for both slots: it signs
    both at round 5 with one hostile anchor. Its checkpoints do not vouch for each other; round 3 (replica 0's
    node and it, two nodes) still does."""
    spec = make_spec(stages=1)
    moved = replace(
        assignment(spec, 0, 0), stage_peers={"0": NODES[0, 0].peer_id, "1": FORMER.peer_id}
    )  # former_stage_peers {"0": [FORMER]}
    for r, who in ((0, NODES[0, 0]), (1, FORMER)):
        writer = StageCheckpoints(store, who, replace(moved, peer_id=who.peer_id, replica=r))
        for rnd in (1, 2, 3):
            writer.write(tensors(r, 0, rnd), step=5 * rnd, rnd=rnd)
            writer.join()
    for r in (0, 1):
        bad = tensors(0, 0, 5, hostile=True)
        write_checkpoint(
            store,
            FORMER,
            run_id=spec.run_id,
            stage=0,
            replica=r,
            round=5,
            step=25,
            tensors=bad,
            meta={ANCHOR_META: anchor_sha256(bad)},
        )
    victim = StageCheckpoints(store, NODES[0, 0], moved)
    assert victim.signers(0) == {NODES[0, 0].public_key, FORMER.public_key}
    assert victim.signers(1) == {FORMER.public_key}
    ck = victim.latest()
    assert ck is not None and ck.round == 3 and ck.signer == NODES[0, 0].public_key
    assert any("vouches" in r.reason and r.round == 5 for r in victim.refused), [
        str(r) for r in victim.refused
    ]

"""SparseLoCo with subspace links: the consensus anchor stays in span(U) and the run exports.

A sparse, quantized Delta_bar is not in span(U); unprojected, the anchor of every constrained weight
drifts off it round by round and the exported "consensus" is not the model that trained. The round
owner projects Delta_bar on the host (node/subspace_model.py `consensus_projection`, fixed order, so the
anchors stay bit-identical) and the error feedback on the device. Replicas run in one process against a
real S3 server (moto), each stage through the run spec's own codec and robust aggregation.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from coordinator.export import export_llama
from node.model import Stage
from node.subspace_model import confinement, consensus_projection, project_weights_
from node.sync.outer_sync import ANCHOR_IN_SPAN, OuterSync
from node.sync.sparseloco_sync import SparseLoCoCodec, make_sync_parts
from protocol.codecs.subspace import basis
from protocol.identity import Identity
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import PipelineSpec, RunSpec, SyncSpec
from tests.test_export import MODEL, TOL, hf_logits, needs_transformers, pipeline_logits, sample_tokens
from tests.test_export import trained_stages as perturbed_stages

pytestmark = pytest.mark.timeout(120)

R = 2
ROUNDS = 3
SYNC = SyncSpec(H=4, P=2, tau=1, timeout_s=15.0)  # streaming fragments, the default codec and aggregation


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="anchor-span"))
    s.ensure_bucket()
    return s


def make_spec() -> RunSpec:
    """The default swarm's shape of link: k = d/8 on the one link of 2 stages."""
    return RunSpec(
        run_id=f"span-{uuid.uuid4().hex[:8]}",
        replicas=R,
        stages=2,
        model=MODEL,
        pipeline=PipelineSpec(link_k=[MODEL.d_model // 8]),
        sync=SYNC,
    )


def off_span(spec: RunSpec, name: str, W: torch.Tensor) -> float:
    """||W - P W|| / ||W||, as coordinator/export.py measures it (0 for an unconstrained weight)."""
    k = spec.pipeline.link_k[0]
    if not (name == "embed.weight" or name.endswith(("attn.wo.weight", "mlp.w_down.weight"))):
        return 0.0
    if name.startswith("layers.") and int(name.split(".")[1]) >= spec.layer_ranges()[0][1]:
        return 0.0  # after the last compressed link: full rank
    U = basis(spec.model.d_model, k, spec.pipeline.projection_seed).double()
    W = W.double()
    P = (W @ U) @ U.T if name == "embed.weight" else U @ (U.T @ W)
    return float((W - P).norm() / W.norm())


class Replica:
    """One replica's stages, each with its round owner (R = 2 replicas x 2 stages)."""

    def __init__(
        self, spec: RunSpec, store: ObjectStore, r: int, *, confined: bool, device_path: bool
    ) -> None:
        self.r = r
        self.stages: list[Stage] = perturbed_stages(spec)  # far from init: the logits are not trivial
        ids = [[Identity.from_seed(bytes([1 + 2 * q + s]) * 32) for s in range(2)] for q in range(R)]
        self.syncs = []
        for s, stage in enumerate(self.stages):
            parts = make_sync_parts(spec, ids[r][s])
            assert isinstance(parts.codec, SparseLoCoCodec)
            parts.codec.device_path = device_path
            self.syncs.append(
                OuterSync(
                    list(stage.parameters()),
                    store=store,
                    codec=parts.codec,
                    aggregate=parts.aggregate,
                    run_id=spec.run_id,
                    stage=s,
                    replica=r,
                    stage_peers={q: ids[q][s].peer_id for q in range(R)},
                    schedule=spec.sync.schedule(),
                    alpha=spec.sync.alpha,
                    momentum=parts.momentum,
                    timeout_s=spec.sync.timeout_s,
                    poll_s=0.01,
                    confine=confinement(stage) if confined else None,
                )
            )

    def inner_step(self, step: int) -> None:
        """A stand-in for AdamW: an elementwise update (shared + replica noise), then the projection
        of the weights that the node's inner step makes (node/inner_step.py)."""
        shared = torch.Generator().manual_seed(step)  # the replicas agree on a direction, as in training
        own = torch.Generator().manual_seed(1000 * (self.r + 1) + step)
        with torch.no_grad():
            for stage in self.stages:
                for p in stage.parameters():
                    g = torch.randn(p.shape, generator=shared) + 0.5 * torch.randn(p.shape, generator=own)
                    p.add_(g.sign() * 2e-3)
                project_weights_(stage)

    def consensus(self, s: int) -> dict[str, torch.Tensor]:
        names = [n for n, _ in self.stages[s].named_parameters()]
        return {n: a.detach().clone() for n, a in zip(names, self.syncs[s].anchor, strict=True)}


def train(spec: RunSpec, store: ObjectStore, *, confined: bool, device_path: bool) -> list[Replica]:
    """ROUNDS rounds in lockstep: every replica's inner step and capture, then every replica's apply."""
    reps = [Replica(spec, store, r, confined=confined, device_path=device_path) for r in range(R)]
    syncs = [s for rep in reps for s in rep.syncs]
    try:
        for step in range(1, ROUNDS * spec.sync.H + spec.sync.tau + 1):
            for rep in reps:
                rep.inner_step(step)
            for s in syncs:
                s.capture_due(step)
            for rep in reps:
                for s in rep.syncs:
                    if s.apply_due(step):
                        project_weights_(rep.stages[s.stage])  # as the worker's after_apply
    finally:
        for s in syncs:
            s.finish()
    for s in syncs:
        assert s.stats.rounds_applied == ROUNDS * spec.sync.P and s.stats.rejected == s.stats.missing == 0
    return reps


@needs_transformers
@pytest.mark.parametrize("device_path", [False, True], ids=["reference", "torch-cpu"])
def test_sparseloco_anchor_stays_in_span_and_exports(
    tmp_path: Path, store: ObjectStore, device_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    spec = make_spec()
    reps = train(spec, store, confined=True, device_path=device_path)
    states = [reps[0].consensus(s) for s in range(spec.stages)]
    for rep in reps[1:]:  # bit-identical across replicas
        for s in range(spec.stages):
            assert rep.syncs[s].anchor_digest() == reps[0].syncs[s].anchor_digest()
    worst = max(off_span(spec, n, W) for st in states for n, W in st.items())
    assert worst < 1e-5, f"a constrained anchor is {worst:.3g} off span(U)"
    start = perturbed_stages(spec)
    moved = max(
        float((W - p.detach()).abs().max())
        for st, m in zip(states, start, strict=True)
        for (n, W), p in zip(st.items(), m.parameters(), strict=True)
    )
    assert moved > 1e-3  # the rounds changed the consensus
    # the error feedback carries nothing off the span into the next round's top-k
    codec = reps[0].syncs[0].codec
    assert isinstance(codec, SparseLoCoCodec)
    cf = reps[0].syncs[0].confine
    assert cf is not None
    for f, e in codec.e.items():
        for i, t in zip(reps[0].syncs[0].fragments[f], e, strict=True):  # f: (group, fragment)
            cf.local_(i, t)
            assert cf.off_span(i, t) < 1e-5

    export_llama(spec, states, tmp_path)
    model = []
    for s, st in enumerate(states):  # the swarm model: the consensus through the k-wide link
        stage = perturbed_stages(spec)[s]
        stage.load_state_dict(st, strict=False)
        model.append(stage.eval())
    tokens = sample_tokens(spec)
    ref = pipeline_logits(spec, model, tokens)
    assert ref.abs().max() > 1.0
    diff = float((hf_logits(tmp_path, tokens) - ref).abs().max())
    assert diff <= TOL, f"HF logits differ from the swarm's by {diff:.3g}"


def test_without_the_projection_the_anchor_leaves_the_span(store: ObjectStore, tmp_path: Path) -> None:
    """The negative control: the same rounds with nothing confined drift off span(U) and do not export."""
    spec = make_spec()
    reps = train(spec, store, confined=False, device_path=False)
    states = [reps[0].consensus(s) for s in range(spec.stages)]
    worst = max(off_span(spec, n, W) for st in states for n, W in st.items())
    assert worst > 1e-3, worst
    with pytest.raises(ValueError, match="outside span"):
        export_llama(spec, states, tmp_path)


def test_consensus_projection_is_fixed_order_and_matches_the_matmul() -> None:
    """The host projection equals U U^T W to float64 rounding, is idempotent to float32 rounding, and gives
    the same bits whatever the thread count, the layout of its input or the side it is given."""
    g = torch.Generator().manual_seed(0)
    U = basis(64, 8, 7)
    W = torch.randn(64, 48, generator=g)
    P = consensus_projection(W, U, "out")
    ref = (U.double() @ (U.double().T @ W.double())).float()
    assert torch.allclose(P, ref, rtol=0, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = consensus_projection(W, U, "out")
        torch.set_num_threads(2)
        two = consensus_projection(W, U, "out")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, P) and torch.equal(two, P)
    E = torch.randn(48, 64, generator=g)
    assert torch.equal(consensus_projection(E, U, "rows"), consensus_projection(E.T.contiguous(), U, "out").T)
    assert torch.equal(consensus_projection(W.T.contiguous().T, U, "out"), P)  # a non-contiguous input
    again = consensus_projection(P, U, "out")
    assert float((again - P).norm() / P.norm()) < 1e-6
    with pytest.raises(ValueError, match="basis of 64 rows"):
        consensus_projection(torch.zeros(32, 4), U, "out")


def test_a_checkpoint_from_before_the_fix_is_projected_on_restore(store: ObjectStore) -> None:
    """An anchor written without the in-span mark is projected on restore, to the same bits on every
    replica; one written with it is restored bit for bit."""
    spec = make_spec()
    reps = train(spec, store, confined=False, device_path=False)  # the old build: anchors off span
    names = [n for n, _ in reps[0].stages[0].named_parameters()]
    old = reps[0].syncs[0].state_tensors(names)
    assert ANCHOR_IN_SPAN not in old
    fresh = [Replica(spec, store, r, confined=True, device_path=False) for r in range(R)]
    for rep in fresh:
        rep.syncs[0].load_state_tensors(names, old)
    a, b = (rep.syncs[0] for rep in fresh)
    assert a.anchor_digest() == b.anchor_digest()
    state = {n: t for n, t in zip(names, a.anchor, strict=True)}
    assert max(off_span(spec, n, W) for n, W in state.items()) < 1e-5
    marked = a.state_tensors(names)
    assert ANCHOR_IN_SPAN in marked
    b.load_state_tensors(names, marked)
    assert b.anchor_digest() == a.anchor_digest()  # not projected again (that would move a few bits)
    for rep in fresh:
        for s in rep.syncs:
            s.finish()

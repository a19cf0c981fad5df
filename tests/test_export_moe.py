"""An MoE run exports as a Hugging Face GLM-4-MoE folder that computes the swarm's model (issue 24,
acceptance 4), and the export takes only an expert bias two nodes' checkpoints hold alike.

The reference is the crucible pipeline (tests/test_export.py `pipeline_logits`): stage by stage through the
real link codecs. Every weight is moved far from init and every expert bias set away from zero, so routing
depends on the bias: a missed or misnamed `e_score_correction_bias` changes which experts a token visits.
The checkpoints go through a real S3 server (moto, tests/conftest.py) and the worker's own writer.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.cli import main as coordinator_main
from coordinator.export import (
    consensus_states,
    expected_shapes,
    export_llama,
    export_parts,
)
from node.model import Stage, build_full_model, build_stage, moe_blocks
from node.sync.stage_checkpoints import StageCheckpoints
from protocol import keys
from protocol.checkpoint import write_checkpoint
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment, RunRecord
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, MoESpec, PipelineSpec, RunSpec, SyncSpec, TrainSpec
from protocol.trust.assignment_archive import encode_archive
from tests.test_export import TOL, needs_transformers, pipeline_logits, sample_tokens, trained_stages

pytestmark = [
    pytest.mark.timeout(120),
    # GLM builds its shared SwiGLU even when n_shared_experts = 0: torch warns that it initializes nothing
    pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op"),
]

BUCKET = "export-moe"
OPERATOR = Identity.from_seed(b"m" * 32)
MOE = MoESpec(experts=8, top_k=2, d_ff=48)
SLOTS = [(0, 0), (0, 1), (1, 0), (1, 1)]
"""(replica, stage) of every node of the 2 x 2 store runs."""
NODES = {slot: Identity.from_seed(bytes([70 + 10 * slot[0] + slot[1]]) * 32) for slot in SLOTS}


def moe_model(**moe: int) -> ModelSpec:
    return ModelSpec(
        vocab=256,
        d_model=64,
        n_layers=3,
        n_heads=4,
        d_ff=176,
        seq_len=32,
        rope_theta=500.0,
        moe=MoESpec(**{**MOE.__dict__, **moe}),
    )


def make_spec(model: ModelSpec, stages: int = 2, link_k: tuple[int, ...] = (8,), **run: object) -> RunSpec:
    return RunSpec(
        run_id=f"moe-export-{uuid.uuid4().hex[:8]}",
        stages=stages,
        model=model,
        pipeline=PipelineSpec(link_k=list(link_k)),
        **run,  # type: ignore[arg-type]
    )


def moe_stages(spec: RunSpec, seed: int = 0) -> list[Stage]:
    """tests/test_export.py's trained stages (every weight moved, residual writers back in span), each
    expert bias set to N(0, 0.2^2): of the order of the router's score gaps, so it changes many choices."""
    stages = trained_stages(spec, seed)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for stage in stages:
            for moe in moe_blocks(stage).values():
                b = moe.router.expert_bias
                b.copy_(0.2 * torch.randn(b.shape, generator=g))
    return stages


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def auto_logits(out: Path, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (b, L+1) -> (b, L, V) of the folder as AutoModelForCausalLM loads it (fp32, eager)."""
    import transformers  # here, not at import: the offline fixture's environment is set by now

    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32, local_files_only=True
    ).eval()
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    with torch.no_grad():
        return model(input_ids=tokens[:, :-1]).logits


def max_diff(spec: RunSpec, stages: list[Stage], out: Path) -> float:
    tokens = sample_tokens(spec)
    ref = pipeline_logits(spec, stages, tokens)  # (b, L, V)
    assert ref.abs().max() > 1.0  # logits far from uniform: the comparison can fail
    return float((auto_logits(out, tokens) - ref).abs().max())


# --- the folder -------------------------------------------------------------------------------------
@needs_transformers
@pytest.mark.parametrize(
    "moe,stages,link_k",
    [
        ({"first_dense": 1}, 2, (8,)),  # a dense block first, no shared expert (GLM's is zero-wide)
        ({"shared_experts": 1}, 2, (8,)),  # every block MoE, one shared expert, T folded
        ({"first_dense": 1, "shared_experts": 2}, 3, ()),  # dense links: no T, nothing constrained
    ],
)
def test_exported_glm4_moe_matches_swarm_logits(
    tmp_path: Path, moe: dict[str, int], stages: int, link_k: tuple[int, ...]
) -> None:
    spec = make_spec(moe_model(**moe), stages, link_k)
    model = moe_stages(spec)
    export_llama(spec, [m.state_dict() for m in model], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"] and config["model_type"] == "glm4_moe"
    assert (config["first_k_dense_replace"], config["n_shared_experts"]) == (
        spec.model.moe.first_dense,
        spec.model.moe.shared_experts,
    )
    diff = max_diff(spec, model, tmp_path)
    print(f"max |logit difference| {moe} stages={stages} link_k={link_k}: {diff:.3g}")
    assert diff <= TOL, f"HF logits differ from the swarm's by {diff:.3g}"

    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.rope_parameters["partial_rotary_factor"] == 1.0 and loaded.num_mtp_layers == 0
    # the same check fails without the expert bias: routing depends on it
    tensors = load_file(tmp_path / "model.safetensors")
    bias = [n for n in tensors if n.endswith("mlp.gate.e_score_correction_bias")]
    assert len(bias) == len(spec.model.moe_layers)
    save_file({**tensors, **{n: torch.zeros_like(tensors[n]) for n in bias}}, tmp_path / "model.safetensors")
    bad = max_diff(spec, model, tmp_path)
    assert bad > 100 * TOL, f"without the expert bias the logits still match ({bad:.3g})"


def test_names_and_writers_follow_the_node_model() -> None:
    """The exporter's restatement of the state names and shapes agrees with node/model.py, and the residual
    writers the model spec names are the model's parameters."""
    for moe in ({"first_dense": 1}, {"shared_experts": 2}):
        spec = make_spec(moe_model(**moe), 2)
        for part in range(len(export_parts(spec))):
            state = build_stage(spec.model, spec.layer_ranges(), part).state_dict()
            assert expected_shapes(spec, part) == {n: tuple(t.shape) for n, t in state.items()}
        names = set(build_full_model(spec.model).state_dict())
        for layer in range(spec.model.n_layers):
            assert set(spec.model.residual_writers(layer)) <= names


def test_one_routed_expert_is_refused(tmp_path: Path) -> None:
    """GLM's router ranks a group by its top two experts: one expert cannot be exported, and nothing is."""
    spec = make_spec(moe_model(experts=1, top_k=1), 1, ())
    with pytest.raises(ValueError, match="at least 2 routed experts"):
        export_llama(spec, [m.state_dict() for m in moe_stages(spec)], tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


# --- from the store: the expert bias must agree too ---------------------------------------------------
@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket=BUCKET))
    s.ensure_bucket()
    return s


def store_spec() -> RunSpec:
    # 2 replicas x 2 stages, H = 5: round r is checkpointed at step 5 r
    model = moe_model(first_dense=1, shared_experts=1)
    return make_spec(model, 2, (8,), replicas=2, train=TrainSpec(total_steps=100), sync=SyncSpec(H=5))


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
        stage_peers={str(r): NODES[r, stage].peer_id for r in range(spec.replicas)},
        start_step=-1,
        issued_at=time.time(),
    )


def launch(store: ObjectStore, spec: RunSpec) -> None:
    """The operator's signed run record and assignment archive, as a coordinator leaves them (a node per
    (replica, stage) of `spec` in SLOTS)."""
    record = RunRecord(spec=spec, state="running", updated=time.time())
    store.put(keys.spec_key(spec.run_id), seal(OPERATOR, record))
    slots = [(r, s) for r, s in SLOTS if s < spec.stages]
    archive = encode_archive(OPERATOR, [assignment(spec, *slot) for slot in slots])
    store.put(keys.assign_key(spec.run_id, 1, 1), archive)


def slot_tensors(stage: Stage, replica: int, bias_shift: float = 0.0) -> dict[str, torch.Tensor]:
    """What a worker checkpoints: the module's state ("model.*": its weights drifted from the anchor, the
    expert bias, moved by `bias_shift` for a node that tampers with it) and the parameters' anchors."""
    out = {f"model.{n}": t.clone() for n, t in stage.state_dict().items()}
    for n, p in stage.named_parameters():
        out[f"model.{n}"] = p.detach() + 0.01 * (replica + 1)
        out[f"anchor.{n}"] = p.detach().clone()
    for n in out:
        if n.endswith("router.expert_bias"):
            out[n] = out[n] + bias_shift
    return out


def train(
    store: ObjectStore, spec: RunSpec, rounds: int, tampered: frozenset[tuple[int, int, int]] = frozenset()
) -> None:
    """Every slot checkpoints rounds 1..rounds (the round's consensus: `moe_stages(spec, rnd)`) through the
    worker's writer; (replica, stage, round) in `tampered` with its expert bias shifted (its anchor, and so
    the digest it signs, the consensus)."""
    for rnd in range(1, rounds + 1):
        consensus = moe_stages(spec, rnd)
        for r, s in SLOTS:
            writer = StageCheckpoints(store, NODES[r, s], assignment(spec, r, s))
            shift = 0.5 if (r, s, rnd) in tampered else 0.0
            writer.write(slot_tensors(consensus[s], r, shift), step=5 * rnd, rnd=rnd)
            writer.join()


@needs_transformers
def test_an_moe_run_exports_its_consensus_from_the_store(
    store: ObjectStore, moto_store: str, tmp_path: Path
) -> None:
    spec = store_spec()
    launch(store, spec)
    train(store, spec, 2)
    got, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert (got, rnd, len(states)) == (spec, 2, 2)
    want = moe_stages(spec, 2)
    for state, stage in zip(states, want, strict=True):
        for name, t in stage.state_dict().items():
            assert torch.equal(state[name], t), name  # the anchors, and the bias the nodes hold
    out = tmp_path / "cli"
    argv = ["export", spec.run_id, "--out", str(out), "--operator-key", OPERATOR.peer_id]
    argv += ["--store-endpoint", moto_store, "--store-bucket", BUCKET]
    assert coordinator_main(argv) == 0
    assert max_diff(spec, want, out) <= TOL


def test_an_expert_bias_one_node_alone_holds_is_not_exported(store: ObjectStore) -> None:
    """Replica 1's last stage checkpoints the agreed anchor (signing the consensus digest) with its own
    expert bias at round 2: no second node holds that bias, so the export falls back to round 1; with no
    honest round it refuses, naming the bias. A named round takes one replica's checkpoint anyway."""
    spec = store_spec()
    launch(store, spec)
    train(store, spec, 2, tampered=frozenset({(1, 1, 2)}))
    _, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert rnd == 1
    bias = "layers.2.mlp.router.expert_bias"
    assert torch.equal(states[1][bias], moe_stages(spec, 1)[1].state_dict()[bias])

    spec = store_spec()
    launch(store, spec)
    train(store, spec, 1, tampered=frozenset({(1, 1, 1)}))
    with pytest.raises(ValueError, match="no round with a valid checkpoint of every stage") as refused:
        consensus_states(store, spec.run_id, {OPERATOR.public_key})
    assert "round 1 stage 1: no two nodes' checkpoints of the agreed anchor hold the same expert bias" in str(
        refused.value
    ), refused.value
    _, rnd, states = consensus_states(store, spec.run_id, {OPERATOR.public_key}, 1)
    assert rnd == 1 and len(states) == 2


# --- a butterfly run: the bias has no pair base ------------------------------------------------------
def butterfly_spec() -> RunSpec:
    sync = SyncSpec(
        H=5, method="sparseloco", topology="butterfly", outer_momentum=0.0, quorum=0, max_late_rounds=0
    )
    model = moe_model(first_dense=1)
    return make_spec(model, 1, (), replicas=2, train=TrainSpec(total_steps=100), sync=sync)


def write_pair_checkpoint(
    store: ObjectStore, spec: RunSpec, replica: int, stage: Stage, shift: float
) -> None:
    """Round 1 of `replica` (one stage) as a butterfly node writes it: its module state and, per parameter,
    the pair base it and its partner made at round 1 (here the consensus, alike at both ends)."""
    tensors = slot_tensors(stage, replica, shift)
    partner = 1 - replica
    for n, p in stage.named_parameters():
        del tensors[f"anchor.{n}"]
        tensors[f"pair.base.{partner}.{n}"] = p.detach().clone()
        tensors[f"pair.round.{partner}.{n}"] = torch.tensor([1], dtype=torch.int64)
    write_checkpoint(
        store,
        NODES[replica, 0],
        run_id=spec.run_id,
        stage=0,
        replica=replica,
        round=1,
        step=5,
        tensors=tensors,
    )


def test_a_butterfly_run_takes_the_expert_bias_two_nodes_hold_alike(store: ObjectStore) -> None:
    for shift, exported in ((0.0, True), (0.5, False)):
        spec = butterfly_spec()
        launch(store, spec)
        (stage,) = moe_stages(spec, 1)
        write_pair_checkpoint(store, spec, 0, stage, 0.0)
        write_pair_checkpoint(store, spec, 1, stage, shift)
        if exported:
            _, rnd, (state,) = consensus_states(store, spec.run_id, {OPERATOR.public_key})
            assert rnd == 1
            for name, t in stage.state_dict().items():
                assert torch.equal(state[name], t), name
        else:
            with pytest.raises(
                ValueError, match="no two nodes' checkpoints hold the same layers.1.mlp.router"
            ):
                consensus_states(store, spec.run_id, {OPERATOR.public_key})

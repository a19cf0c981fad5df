"""A real localhost swarm whose two replicas differ in stage count, layer split and batch (issue 22):
a 2-stage replica of 2 microbatches and a 3-stage replica of 4 train one 6-layer model together through
fragments keyed by layer group, with k < d subspace links on every boundary."""

from __future__ import annotations

import hashlib
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from coordinator.export import consensus_states, export_llama
from node.model import Stage, build_stage
from node.subspace_model import boundary_codecs, constrain_stage
from protocol import keys
from protocol.checkpoint import read_checkpoint, slot_signers
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import RunSpec, load_run_spec
from protocol.trust.assignment_archive import read_archive
from protocol.trust.delegation import OperatorTrust
from scripts.local_swarm import Swarm
from tests.helpers.observability import chromium
from tests.test_export import hf_logits, sample_tokens
from tests.test_swarm import run_metrics, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN_ID, H, ROUNDS = "mixed-layout", 4, 4

RUN_TOML = f"""\
[run]
run_id = "{RUN_ID}"
replicas = 2
stages = 2
eval_every = 1
[model]
d_model = 64
n_layers = 6
n_heads = 2
d_ff = 176
seq_len = 64
[train]
total_steps = {H * ROUNDS}
batch_size = 4
microbatches = 2
lr = 3e-3
warmup_steps = 2
eval_batches = 2
[sync]
method = "sparseloco"
H = {H}
timeout_s = 60
[pipeline]
link_k = [8]
[[shapes]]
replicas = [1]
microbatches = 4
stages = 3
link_k = [8, 8]
"""


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("mixed"), 5)
    try:
        s.start()
        yield s
    finally:
        killed = {c.name for c in s.children if c.killed}
        codes = s.stop()
        bad = {k: v for k, v in codes.items() if k not in killed and v != 0}
        assert not bad, f"processes did not exit cleanly: {bad}"


def layer_digests(anchors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Layer ("layers.{l}", or "embed", "norm", "head") -> sha256 of its consensus anchor tensors."""
    out: dict[str, hashlib._Hash] = {}
    for name in sorted(anchors):
        head, _, rest = name.partition(".")
        layer = f"layers.{rest.partition('.')[0]}" if head == "layers" else head
        out.setdefault(layer, hashlib.sha256()).update(
            name.encode() + anchors[name].contiguous().numpy().tobytes()
        )
    return {layer: h.hexdigest() for layer, h in sorted(out.items())}


def replica_logits(
    spec: RunSpec, replica: int, state: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """The crucible forward of `replica`'s split on the consensus `state`, each link through its codec."""
    ranges, pipeline = spec.layer_ranges(replica), spec.pipeline_of(replica)
    stages: list[Stage] = []
    for s in range(len(ranges)):
        st = build_stage(spec.model, ranges, s)
        constrain_stage(st, spec.model, pipeline, ranges, s, layouts=spec.layouts())
        own = st.state_dict()
        st.load_state_dict({k: state[k] if k in state else v for k, v in own.items()})
        stages.append(st.eval())
    with torch.no_grad():
        h = stages[0](tokens[:, :-1])
        for s in range(1, len(stages)):
            _, send = boundary_codecs(stages[s - 1], spec.model, pipeline, ranges, s - 1)
            receive, _ = boundary_codecs(stages[s], spec.model, pipeline, ranges, s)
            assert send is not None and receive is not None
            _, _, _, h, _ = receive.unpack_fwd(send.pack_fwd("eval", 0, 0, h, tokens))
            h = stages[s](h)
    return h


def test_replicas_of_two_splits_train_one_model(swarm: Swarm, tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(RUN_TOML)
    spec = load_run_spec(toml)
    assert spec.layer_ranges(0) == [(0, 3), (3, 6)] and spec.layer_ranges(1) == [(0, 2), (2, 4), (4, 6)]
    assert spec.layer_groups() == [(0, 2), (2, 3), (3, 4), (4, 6)]
    swarm.launch(toml)

    def finished() -> list[dict] | None:
        ms = run_metrics(swarm, RUN_ID)
        return ms if len(ms) == 5 and all(m["state"] == "done" for m in ms) else None

    ms = wait_until(finished, 420, f"5 nodes to finish {RUN_ID}")
    by_slot = {(m["replica"], m["stage"]): m for m in ms}
    assert sorted(by_slot) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    # every round's aggregate weighs each replica by the tokens it trained: replica 1 twice replica 0
    want = {str(r): H * spec.batch_of(r) * spec.model.seq_len for r in (0, 1)}
    assert want["1"] == 2 * want["0"]
    for m in ms:
        assert m["rounds"] == ROUNDS
        assert m["round_tokens"] == want, (m["replica"], m["stage"], m["round_tokens"])
        assert m["fragments_missing"] == m["fragments_rejected"] == 0
    # each layer group's final weights are bit-identical in both replicas (the nodes' own digests)
    held: dict[str, set[str]] = {}
    for m in ms:
        for g, digest in m["group_sha256"].items():
            held.setdefault(g, set()).add(digest)
    assert sorted(held) == ["0", "1", "2", "3"] and all(len(v) == 1 for v in held.values()), held
    # the coordinator's dashboard API shows each replica's split, batch and nodes
    with urllib.request.urlopen(f"{swarm.dashboard}api/runs/{RUN_ID}", timeout=10) as resp:
        view = json.load(resp)
    assert view["splits"] == [[3, 3], [2, 2, 2]] and view["batches"] == [4, 8] and view["stages"] == 3
    assert [len(row) for row in view["grid"]] == [2, 3]
    dom = chromium(f"{swarm.dashboard}?run={RUN_ID}", "--virtual-time-budget=3000", "--dump-dom")
    assert "0 (layers 3+3, batch 4)" in dom and "1 (layers 2+2+2, batch 8)" in dom, dom[:3000]
    # validation on each replica's last stage falls
    for slot in ((0, 1), (1, 2)):
        val = by_slot[slot]["val_history"]
        assert len(val) == ROUNDS + 1 and val[-1][1] < val[0][1], (slot, val)

    # every layer group's consensus is bit-identical in both replicas, whatever stage holds it there
    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    assigned = read_archive(store, spec, OperatorTrust.of({swarm.operator.public_key}), as_issued=True) or []
    anchors: dict[int, dict[str, torch.Tensor]] = {0: {}, 1: {}}
    for r, s in by_slot:
        ck = read_checkpoint(
            store,
            run_id=RUN_ID,
            stage=s,
            replica=r,
            round=ROUNDS,
            trusted=slot_signers(assigned, s).get(r, set()),
        )
        assert ck is not None, f"no checkpoint of replica {r} stage {s} at round {ROUNDS}"
        anchors[r].update({k[len("anchor.") :]: v for k, v in ck.tensors.items() if k.startswith("anchor.")})
    assert set(anchors[0]) == set(anchors[1])
    d0, d1 = layer_digests(anchors[0]), layer_digests(anchors[1])
    assert len(d0) == 6 + 3 and d0 == d1, (d0, d1)  # every layer, the embedding, final norm and head
    # the store keys the fragments by layer group: four groups, each written by both replicas
    for g in range(4):
        for r in (0, 1):
            assert store.list(keys.slot_prefix(RUN_ID, g, 0, ROUNDS - 1, r)), (g, r)

    # the run exports (its consensus, agreed per layer group) and loads in transformers
    spec2, rnd, states = consensus_states(store, RUN_ID, {swarm.operator.public_key})
    assert rnd == ROUNDS
    out = tmp_path / "hf"
    export_llama(spec2, states, out, origin=f"round {rnd} of run {RUN_ID}")
    tokens = sample_tokens(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        hf = hf_logits(out, tokens)
    for r in (0, 1):  # the exported model is each replica's consensus, through its own links
        diff = (hf - replica_logits(spec, r, anchors[r], tokens)).abs().max().item()
        assert diff <= 1e-4, (r, diff)


def test_a_lost_node_of_the_three_stage_replica_is_replaced_within_its_split(
    swarm: Swarm, tmp_path: Path
) -> None:
    """Replica 1's middle stage (layer groups 1 and 2) is killed after the first rounds; the spare takes its
    slot in the 3-stage split (placement repairs each layout class on its own), resumes from its
    predecessor's checkpoint, which the other replica's checkpoints vouch for group by group, and the run
    ends with every layer group identical in both replicas."""
    spare = swarm.add_node(5)
    swarm.health.append(spare.wait_for(r"health=(\S+)/health", 120).group(1))
    run_id = "mixed-rebuild"
    toml = tmp_path / "run.toml"
    toml.write_text(
        RUN_TOML.replace(RUN_ID, run_id).replace(f"total_steps = {H * ROUNDS}", f"total_steps = {H * 10}")
    )
    swarm.launch(toml)
    wait_until(
        lambda: (m := run_metrics(swarm, run_id)) and len(m) == 5 and min(x["step"] for x in m) >= 2 * H + 1,
        300,
        f"{run_id} to pass its second round",
    )
    placed = {i for i, st in enumerate(swarm.statuses()) if st and st["metrics"]["run_id"] == run_id}
    (idle,) = set(range(len(swarm.nodes))) - placed
    victim = next(
        i
        for i, st in enumerate(swarm.statuses())
        if st
        and st["metrics"]["run_id"] == run_id
        and (st["metrics"]["replica"], st["metrics"]["stage"]) == (1, 1)
    )
    swarm.nodes[victim].kill()

    def finished() -> list[dict] | None:
        sts = [s for i, s in enumerate(swarm.statuses()) if i != victim and s]
        ms = [s["metrics"] for s in sts if s["metrics"]["run_id"] == run_id]
        return ms if len(ms) == 5 and all(m["state"] == "done" for m in ms) else None

    ms = wait_until(finished, 400, f"{run_id} to finish with the replacement node")
    replacement = swarm.statuses()[idle]["metrics"]
    assert (replacement["replica"], replacement["stage"]) == (1, 1)
    assert "rebuilding replica(s) [1]" in swarm.coordinator.log_text()
    assert "resumes from round" in swarm.nodes[idle].log_text()
    assert all(m["step"] == H * 10 for m in ms)
    held: dict[str, set[str]] = {}
    for m in ms:
        for g, digest in m["group_sha256"].items():
            held.setdefault(g, set()).add(digest)
    assert sorted(held) == ["0", "1", "2", "3"] and all(len(v) == 1 for v in held.values()), held

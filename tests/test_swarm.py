"""Real localhost swarms: embedded S3 store, bootstrap peer, coordinator and 4 nodes as OS processes."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from coordinator.export import consensus_states, export_llama
from node.model import build_stage
from node.subspace_model import constrain_stage, off_subspace
from node.sync.expert_bias import bias_digest
from node.sync.outer_sync import FragmentId
from node.sync.sparseloco_sync import SparseLoCoCodec
from node.worker import weights_digest
from protocol import keys
from protocol.checkpoint import read_round
from protocol.codecs.sparseloco import SparseLoCoConfig
from protocol.codecs.sparseloco_format import ratio
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreConfig
from protocol.pairing import partner
from protocol.runspec import ModelSpec, RunSpec, SyncSpec, TrainSpec, load_run_spec
from scripts.local_swarm import Swarm, set_pipeline
from tests.helpers.fragment_faults import corrupt
from tests.helpers.observability import (
    bad_requests_get_4xx,
    chromium,
    dashboard_shows_run,
    http_status,
    scrape,
)
from tests.test_export import hf_logits, pipeline_logits, sample_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN_TOML = """\
[run]
run_id = "{run_id}"
replicas = 2
stages = 2
eval_every = 1
[model]
d_model = 64
n_layers = 2
n_heads = 2
d_ff = 176
seq_len = 64
[train]
total_steps = {steps}
batch_size = 4
microbatches = 2
lr = 3e-3
warmup_steps = 2
eval_batches = 2
[sync]
method = "diloco"
H = {H}
timeout_s = {timeout}
"""


def wait_until(pred, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def coordinator_loss(swarm: Swarm) -> dict[str, float]:
    """run -> crucible_run_train_loss_bits_per_token in the coordinator's /metrics."""
    sampled = scrape(f"{swarm.dashboard}metrics")
    return {lab["run"]: v for lab, v in sampled.get("crucible_run_train_loss_bits_per_token", [])}


def run_metrics(swarm: Swarm, run_id: str) -> list[dict]:
    return [s["metrics"] for s in swarm.statuses() if s and s["metrics"]["run_id"] == run_id]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("swarm"), 4)
    try:
        s.start()
        yield s
    finally:
        killed = {c.name for c in s.children if c.killed}
        codes = s.stop()
        # graceful SIGTERM must give exit 0 for every process still running (the crashed node is excluded)
        bad = {k: v for k, v in codes.items() if k not in killed and v != 0}
        assert not bad, f"processes did not exit cleanly: {bad}"


def test_two_outer_rounds_identical_consensus(
    swarm: Swarm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(RUN_TOML.format(run_id="swarm-a", steps=10, H=5, timeout=60))
    swarm.launch(toml)
    ms = wait_until(
        lambda: (
            (m := run_metrics(swarm, "swarm-a"))
            and len(m) == 4
            and all(x["state"] == "done" for x in m)
            and m
        ),
        300,
        "4 nodes to finish run swarm-a",
    )
    assert all(m["rounds"] == 2 for m in ms)
    # one cost model: the coordinator logs the planner's prediction for what it placed
    assert re.search(r"run swarm-a: predicted \d+ tokens/s, MFU", swarm.coordinator.log_text())
    # where and how each trained: auto on a CPU-only host is the CPU in fp32, in /status for the user
    assert all(m["device"] == "cpu" and m["precision"] == "fp32" for m in ms)
    st = [s for s in swarm.statuses() if s]
    assert all(s["device"] == "cpu" and s["tflops_fp32"] > 0 and s["free_memory_gb"] > 0 for s in st)
    # and what it sustains on training work: the reference block's time, which placement scales
    assert all(s["ref_block"] == "cpu-d256" and s["ref_block_s"] > 0 for s in st)
    for stage in (0, 1):
        digests = {m["weights_sha256"] for m in ms if m["stage"] == stage}
        assert len(digests) == 1 and "" not in digests, f"stage {stage} replicas disagree: {digests}"
    last = [m for m in ms if m["stage"] == 1]
    for m in last:  # start, after round 1, end
        assert len(m["val_history"]) == 3
        assert m["val_history"][-1][1] < m["val_history"][0][1]
    assert all(m["bytes_store_up"] > 0 and m["bytes_pipe_sent"] > 0 for m in ms)

    # issue 11 acceptance 5: the consensus, exported from the store's checkpoints as a Hugging Face Llama
    # folder, is the model the swarm reports (same digests) and gives its logits within 1e-4
    out = tmp_path / "hf"
    ex = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "export",
            "swarm-a",
            "--out",
            str(out),
            "--operator-key",
            swarm.operator.peer_id,
            "--store-endpoint",
            swarm.store_url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ex.returncode == 0 and "round 2" in ex.stdout, ex.stdout + ex.stderr
    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    spec, rnd, states = consensus_states(store, "swarm-a", {swarm.operator.public_key})
    stages = []
    for s, state in enumerate(states):
        stage = build_stage(spec.model, spec.layer_ranges(), s)
        constrain_stage(stage, spec.model, spec.pipeline, spec.layer_ranges(), s)
        stage.load_state_dict(state)
        assert weights_digest(stage) == {m["weights_sha256"] for m in ms if m["stage"] == s}.pop()
        stages.append(stage.eval())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tokens = sample_tokens(spec)
    diff = (hf_logits(out, tokens) - pipeline_logits(spec, stages, tokens)).abs().max().item()
    assert diff <= 1e-4, diff

    # the store holds the run under its own prefix, listable by an ordinary S3 client (awscli)
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID="crucible",
        AWS_SECRET_ACCESS_KEY="crucible",
        AWS_DEFAULT_REGION="us-east-1",
    )
    ls = subprocess.run(
        [
            sys.executable,
            "-m",
            "awscli",
            "s3",
            "ls",
            "--recursive",
            "--endpoint-url",
            swarm.store_url,
            "s3://crucible/swarm-a/",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert ls.returncode == 0, ls.stderr
    listed = ls.stdout
    for part in (
        "swarm-a/spec",
        "swarm-a/lease",
        "swarm-a/assign/",
        "swarm-a/sync/s0/f0/r0/0/",
        "swarm-a/sync/s1/f0/r1/1/",
        "swarm-a/ckpt/",
    ):
        assert part in listed, f"{part} missing from:\n{listed}"
    assert all(line.split()[-1].startswith("swarm-a/") for line in listed.strip().splitlines())

    # the operator CLI sees the finished run (the coordinator marks it done once every node's advert says so)
    def cli_status() -> str | None:
        st = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "swarm-a", "--bootstrap", swarm.bootstrap],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert st.returncode == 0, st.stderr
        return st.stdout if "run swarm-a: done" in st.stdout else None

    out = wait_until(cli_status, 60, "`crucible-coordinator status` to show swarm-a done", poll_s=2)
    assert out.count("swarm-a") >= 5  # the run line and its 4 nodes


MOE_EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "run_moe.toml"


def test_moe_run_balances_experts_alike_on_every_replica_and_exports(
    swarm: Swarm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 acceptance 1 and 4: docs/examples/run_moe.toml (8 experts, top-2, every block an MoE; SparseLoCo)
    as a 2 x 2 run. Every replica's stage moves its expert bias by the same agreed routing counts after
    every step: the bias digests of the two replicas' stages are equal at every step both report (and
    moved), the consensus is identical (the weights digest includes the bias), the per-step barrier's
    sets took both replicas every step, and the expert load is in /status and /metrics. The export loads
    in transformers with the consensus model's logits."""
    run_id, steps = "swarm-moe", 20
    text = (
        MOE_EXAMPLE.read_text()
        .replace('run_id = "tiny-moe-1"', f'run_id = "{run_id}"')
        .replace("total_steps = 60", f"total_steps = {steps}")
        .replace("H = 10", "H = 5")
    )
    toml = tmp_path / "run.toml"
    toml.write_text(text)
    spec = load_run_spec(toml)
    assert spec.model.moe.experts == 8 and spec.model.moe.top_k == 2 and spec.sync.method == "sparseloco"
    while sum(c.alive for c in swarm.nodes) < 4:
        swarm.respawn_node()
    swarm.launch(toml)

    def finished():
        ms = run_metrics(swarm, run_id)
        return len(ms) == 4 and all(m["state"] == "done" for m in ms) and ms

    ms = wait_until(finished, 300, f"{run_id} to finish")
    for stage in (0, 1):
        pair = [m for m in ms if m["stage"] == stage]
        assert len({m["weights_sha256"] for m in pair}) == 1, f"stage {stage}: consensus differs"
        histories = [dict(m["expert_bias_history"]) for m in pair]
        common = sorted(set(histories[0]) & set(histories[1]))
        assert len(common) >= steps - 2, (stage, common)
        for step in common:  # the balancing state, bit for bit, at every step both report
            assert histories[0][step] == histories[1][step], f"stage {stage} step {step}: biases differ"
        assert len({histories[0][s] for s in common}) > 1, "the expert bias never moved"
        layers = [str(i) for i in range(*spec.layer_ranges()[stage])]
        for m in pair:
            r = m["routing"]
            assert r["steps"] == steps and r["missing"] == 0 and r["rejected"] == 0, r
            assert r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["wait_s"] >= 0
            assert sorted(m["expert_load"]) == layers and all(v >= 1.0 for v in m["expert_load"].values())
    last = [m for m in ms if m["stage"] == 1]
    assert all(m["val_history"][-1][1] < m["val_history"][0][1] for m in last)
    slots = _slots(swarm, run_id)
    sampled = scrape(f"{swarm.health[slots[(0, 1)]]}/metrics")
    loads = [(lab, v) for lab, v in sampled["crucible_expert_load_ratio"] if lab["run"] == run_id]
    assert {lab["layer"] for lab, _ in loads} == {"2", "3"} and all(v >= 1.0 for _, v in loads)
    waited = [v for lab, v in sampled["crucible_routing_wait_seconds_total"] if lab["run"] == run_id]
    assert waited and waited[0] >= 0

    def shown():  # the coordinator's dashboard shows each node's expert load, from its advert
        with urllib.request.urlopen(f"{swarm.dashboard}api/runs/{run_id}", timeout=10) as resp:
            cells = [c for row in json.load(resp)["grid"] for c in row if c]
        return len(cells) == 4 and all(c["expert_load"] for c in cells) and cells

    cells = wait_until(shown, 30, "the dashboard API to show every node's expert load")
    assert {k for c in cells for k in c["expert_load"]} == {"0", "1", "2", "3"}
    dom = chromium(f"{swarm.dashboard}?run={run_id}", "--virtual-time-budget=3000", "--dump-dom")
    assert re.search(r"expert load L0 \d\.\d\d L1 \d\.\d\d", dom), dom[:3000]

    # acceptance 4: `crucible-coordinator export` writes a GLM-4-MoE folder (expert bias included) that
    # transformers loads, and its logits are the swarm's consensus model's
    line = swarm.export(run_id, tmp_path / "hf")
    assert f"round {steps // 5}" in line, line
    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    spec, _, states = consensus_states(store, run_id, {swarm.operator.public_key})
    stages = []
    for s, state in enumerate(states):
        stage = build_stage(spec.model, spec.layer_ranges(), s)
        constrain_stage(stage, spec.model, spec.pipeline, spec.layer_ranges(), s)
        stage.load_state_dict(state)
        # the export's bias is the one both replicas used for the step after the last (the subspace link's
        # constrained weights are projected on each node, so their local bits may differ from the
        # anchor's: the logits below compare the models)
        reported = {tuple(m["expert_bias_history"][-1]) for m in ms if m["stage"] == s}
        assert reported == {(steps, bias_digest(stage))}, reported
        stages.append(stage.eval())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "glm4_moe"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tokens = sample_tokens(spec)
    diff = (hf_logits(tmp_path / "hf", tokens) - pipeline_logits(spec, stages, tokens)).abs().max().item()
    assert diff <= 1e-4, diff


def test_metrics_dashboard_and_bad_requests(swarm: Swarm, tmp_path: Path) -> None:
    """Issue 14 acceptance 1-3: /metrics of a node and of the coordinator parse with prometheus_client and
    carry the figures with units in their names; the dashboard, rendered by headless Chromium, shows the
    run, its loss plot and tokens/s; bad requests to every endpoint get a 4xx with a message."""
    # a run the coordinator samples while it trains: its links paced (20 ms each way, so >= 40 ms a step
    # on any host) to last >= 8 s; adverts refresh every 3 s
    toml = tmp_path / "run.toml"
    toml.write_text(set_pipeline(RUN_TOML.format(run_id="swarm-m", steps=200, H=50, timeout=60), delay_ms=20))
    swarm.launch(toml)
    wait_until(
        lambda: len(m := run_metrics(swarm, "swarm-m")) == 4 and all(x["state"] == "done" for x in m),
        300,
        "4 nodes to finish run swarm-m",
    )
    # the coordinator sees the nodes through their DHT adverts: its figures lag theirs by a refresh
    wait_until(
        lambda: "swarm-m" in coordinator_loss(swarm), 30, "the coordinator's /metrics to carry the final loss"
    )
    labels = {"run": "swarm-m"}
    nodes = [scrape(f"{h}/metrics") for h in swarm.health]
    for sampled in nodes:
        for name in (
            "crucible_tokens_total",
            "crucible_compute_seconds_total",
            "crucible_link_stall_seconds_total",
            "crucible_fragment_wait_seconds_total",
            "crucible_outer_rounds_total",
        ):
            mine = [v for lab, v in sampled[name] if lab.items() >= labels.items()]
            assert mine and all(set(lab) >= {"run", "replica", "stage"} for lab, _ in sampled[name]), name
        assert sum(v for lab, v in sampled["crucible_tokens_total"] if lab["run"] == "swarm-m") > 0
        assert any(v > 0 for _, v in sampled["crucible_outer_rounds_total"])
        links = sampled["crucible_link_bytes_total"]  # by neighbour peer and direction
        assert {lab["direction"] for lab, _ in links} == {"sent", "received"} and all(v > 0 for _, v in links)
        assert all(lab["peer"].startswith("12D3KooW") for lab, _ in links)
        ops = {lab["operation"]: v for lab, v in sampled["crucible_store_request_seconds_count"]}
        assert ops.get("PutObject", 0) > 0 and ops.get("GetObject", 0) > 0, ops
        assert all(v >= 0 for _, v in sampled["crucible_store_request_seconds_sum"])
        assert "crucible_store_bytes_total" in sampled and "crucible_rejected_inputs_total" in sampled
        assert {lab["outcome"] for lab, _ in sampled["crucible_fragments_total"]} >= {"rejected", "missing"}
        assert (
            sampled["crucible_node_peak_flops"]
            and sampled["crucible_store_upload_bandwidth_bytes_per_second"]
        )
    # the last stages report the loss, its unit in the name (issue 19)
    assert any(n.get("crucible_train_loss_bits_per_token") for n in nodes)
    assert any(n.get("crucible_validation_loss_bits_per_byte") for n in nodes)
    # one unit from node to coordinator: its run loss is the mean of the last stages' (the advert carries
    # nats per token; both /metrics say bits per token)
    last = [m["train_loss_bits_per_token"] for m in run_metrics(swarm, "swarm-m") if m["stage"] == 1]
    wait_until(
        lambda: math.isclose(coordinator_loss(swarm)["swarm-m"], sum(last) / len(last), rel_tol=1e-9),
        30,
        "the coordinator's final sample of the loss",
    )
    coord = scrape(f"{swarm.dashboard}metrics")
    for name in (
        "crucible_run_step",
        "crucible_run_tokens_per_second",
        "crucible_run_effective_mfu_ratio",
        "crucible_run_low_bandwidth_tax_ratio",
        "crucible_run_train_loss_bits_per_token",
        "crucible_run_validation_loss_bits_per_byte",
        "crucible_run_pipeline_bytes",
        "crucible_run_store_bytes",
    ):
        assert any(lab == labels for lab, _ in coord.get(name, [])), f"{name} missing for swarm-m"
    assert any(
        lab["event"] == "placements" and v >= 1 for lab, v in coord["crucible_coordinator_events_total"]
    )
    assert coord["crucible_store_request_seconds_count"] and coord["crucible_nodes"]

    with urllib.request.urlopen(f"{swarm.dashboard}api/runs/swarm-m/history", timeout=20) as r:
        samples = json.load(r)["samples"]
    assert max(x["tokens_per_s"] for x in samples) > 0 and max(x["effective_mfu"] for x in samples) > 0
    shot = dashboard_shows_run(swarm.dashboard, "swarm-m")
    print(f"dashboard screenshot: {shot}")

    bad_requests_get_4xx(
        swarm.dashboard,
        [
            ("GET", "/api/runs/no-such-run", 404),
            ("GET", "/api/runs/no-such-run/history", 404),
            ("GET", "/api/runs/swarm-m/history?since=yesterday", 400),
            ("GET", "/api/runs/swarm-m/history?since=nan", 400),
            ("GET", "/api/runs/swarm-m/history?limit=0", 400),
            ("GET", "/api/runs/swarm-m/history?limit=ten", 400),
            ("GET", "/api/runs/swarm-m/bogus", 404),
            ("GET", "/api/runs/swarm-m?x=1", 400),
            ("GET", "/api/runs?verbose=1", 400),
            ("GET", "/api/nodes?all", 400),
            ("GET", "/?run=no-such-run", 404),
            ("GET", "/?colour=red", 400),
            ("GET", "/metrics?name=x", 400),
            ("GET", "/nope", 404),
            ("GET", "/api/runs/%ZZ", 404),
            ("POST", "/api/runs", 405),
            ("DELETE", "/", 405),
        ],
    )
    bad_requests_get_4xx(
        swarm.health[0],
        [
            ("GET", "/metrics?x=1", 400),
            ("GET", "/status?verbose", 400),
            ("GET", "/health?probe=1", 400),
            ("GET", "/nope", 404),
            ("PUT", "/status", 405),
        ],
    )
    # the good requests still answer
    for url in (
        f"{swarm.dashboard}api/runs",
        f"{swarm.dashboard}api/runs/swarm-m/history?limit=5",
        f"{swarm.health[0]}/health",
    ):
        assert http_status(url)[0] == 200, url


def test_two_runs_at_once_share_the_swarm_and_nothing_else(swarm: Swarm, tmp_path: Path) -> None:
    """Issue 13 acceptance 5: two runs launched at once (1 replica x 2 stages each) on the 4 nodes both
    complete, each on its own two nodes; everything each wrote to the store is under its own prefix, and
    its DHT records (run record subkey, its nodes' assignments) name only itself. swarm-q's inner
    optimizer is Muon (issue 24: train.optimizer = "muon"): it learns, and its checkpoints hold Muon's
    momentum next to AdamW's moments."""
    runs, steps = ("swarm-p", "swarm-q"), 60  # a few seconds each: the two train at the same time
    tomls = []
    for rid in runs:
        toml = tmp_path / f"{rid}.toml"
        text = RUN_TOML.format(run_id=rid, steps=steps, H=30, timeout=60).replace(
            "replicas = 2", "replicas = 1"
        )
        if rid == "swarm-q":
            text = text.replace("[train]\n", '[train]\noptimizer = "muon"\nmuon_lr = 0.02\n')
        tomls.append(toml)
        toml.write_text(text)
    assert load_run_spec(tomls[1]).train.optimizer == "muon"
    swarm.launch(*tomls)

    def both_done() -> dict[str, list[dict]] | None:
        got = {rid: run_metrics(swarm, rid) for rid in runs}
        ok = all(
            len(ms) == 2 and all(m["state"] == "done" and m["step"] == steps for m in ms)
            for ms in got.values()
        )
        return got if ok else None

    got = wait_until(both_done, 240, "both runs to finish")
    peers = {
        rid: {st["peer_id"] for st in swarm.statuses() if st and st["metrics"]["run_id"] == rid}
        for rid in runs
    }
    assert not peers["swarm-p"] & peers["swarm-q"] and all(len(p) == 2 for p in peers.values())
    for ms in got.values():
        last = next(m for m in ms if m["stage"] == 1)
        assert last["val_history"][-1][1] < last["val_history"][0][1]
    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    for rid in runs:
        keys_of_run = store.list(f"{rid}/")
        assert any("/sync/" in k for k in keys_of_run) and any("/ckpt/" in k for k in keys_of_run)
        other = runs[1 - runs.index(rid)]
        assert not [k for k in keys_of_run if other in k]
    assert not [
        k
        for k in store.list("swarm-")
        if not k.startswith(("swarm-a/", "swarm-moe/", "swarm-m/", "swarm-p/", "swarm-q/"))
    ]
    signers = {k.public_key for k in _node_identities(swarm)}
    for st in (0, 1):
        ck = read_round(store, run_id="swarm-q", stage=st, replica=0, round=steps // 30, trusted=signers)
        assert any(k.endswith(".momentum_buffer") for k in ck.tensors), sorted(ck.tensors)[:8]
        assert any(k.endswith(".exp_avg_sq") for k in ck.tensors)


def _node_identities(swarm: Swarm) -> list[Identity]:
    """Every node key the swarm has written (a node restarted with an old key has no key file of its own)."""
    return [Identity.load_or_create(k) for k in sorted(swarm.out.glob("node*.key"))]


def _slots(swarm: Swarm, run_id: str) -> dict[tuple[int, int], int]:
    """(replica, stage) -> index of the node serving it, from the nodes' /status."""
    found = {}
    for i, st in enumerate(swarm.statuses()):
        m = st["metrics"] if st else None
        if m and m["run_id"] == run_id:
            found[(m["replica"], m["stage"])] = i
    return found


def test_sparseloco_bytes_per_round_and_corrupted_fragments_in_the_store(
    swarm: Swarm, tmp_path: Path
) -> None:
    """SparseLoCo across 2 replicas x 2 stages, replica 1 at twice the batch (a [[shapes]] table, issue 22),
    with garbage written into the store at replica 1's keys.

    Each round's aggregate weighs each replica by the tokens it trained (signed in its fragments: H x its
    batch x seq_len); both replicas end with the same consensus. Every node uploads dense/ratio bytes per round (within 10%). The garbage (a flipped bit, a NaN scale
    under a valid signature, a truncated fragment) is planted under replica 1's slot of a round before
    replica 1 gets there, at keys naming replica 1's signer (issue 10 finding 6: squatting; the truncated
    one at its primary key): it takes no slot, replica 1's own fragment lands beside it, every round uses
    both replicas and both end with identical weights."""
    run_id, H, rounds = "swarm-sl", 5, 14  # P = 1: one fragment per stage and round
    toml = tmp_path / "run.toml"
    toml.write_text(  # a k = d/8 subspace link, as the default run's
        RUN_TOML.format(run_id=run_id, steps=H * rounds, H=H, timeout=60).replace(
            'method = "diloco"', 'method = "sparseloco"'
        )
        + "[pipeline]\nlink_k = [8]\n"
        + "[[shapes]]\nreplicas = [1]\nmicrobatches = 4\n"  # replica 1: 4 microbatches of 2, not 2
    )
    spec = load_run_spec(toml)
    cfg = SparseLoCoConfig(chunk=spec.sync.chunk, k=spec.sync.k, beta=spec.sync.beta)
    ranges = spec.layer_ranges()
    shapes = {st: [tuple(p.shape) for p in build_stage(spec.model, ranges, st).parameters()] for st in (0, 1)}
    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    swarm.launch(toml)
    slots = wait_until(lambda: (f := _slots(swarm, run_id)) and len(f) == 4 and f, 120, f"{run_id} placed")
    signer = {st: Identity.load_or_create(swarm.out / f"node{slots[(1, st)]}.key") for st in (0, 1)}

    placed: list[tuple[str, int, int]] = []  # (kind, stage, round); written before replica 1 gets there
    rnd = 3
    for kind, st in (("bad-signature", 0), ("nan-scale", 1), ("truncated", 0)):
        while True:
            assert rnd < rounds, f"the run reached round {rnd} before the test could write {kind}"
            blob = corrupt(kind, signer[st], FragmentId(run_id, st, 0, rnd, 1), shapes[st], cfg)
            rnd += 1
            if not store.list(keys.slot_prefix(run_id, st, 0, rnd - 1, 1)):  # replica 1 is not there yet
                at = (  # the truncated one squats replica 1's primary key; the others lie beside it
                    keys.primary_fragment_key(run_id, st, 0, rnd - 1, 1, signer[st].peer_id)
                    if kind == "truncated"
                    else keys.sync_key(run_id, st, 0, rnd - 1, 1, signer[st].peer_id, blob)
                )
                store.put(at, blob)
                placed.append((kind, st, rnd - 1))
                break

    def finished():
        ms = run_metrics(swarm, run_id)
        return len(ms) == 4 and all(m["state"] == "done" for m in ms) and ms

    by_slot = {(m["replica"], m["stage"]): m for m in wait_until(finished, 300, f"{run_id} to finish")}
    rejected_total = 0
    for st in (0, 1):
        bad = sum(1 for _, s, _ in placed if s == st)
        r0, r1 = by_slot[(0, st)], by_slot[(1, st)]
        assert r0["rounds"] == r1["rounds"] == rounds
        assert r0["weights_sha256"] == r1["weights_sha256"] != "", f"stage {st}: replicas disagree"
        # the last round's weights: the tokens each replica trained in it, replica 1 twice replica 0
        want_tokens = {str(r): H * spec.batch_of(r) * spec.model.seq_len for r in (0, 1)}
        assert want_tokens["1"] == 2 * want_tokens["0"]
        assert r0["round_tokens"] == r1["round_tokens"] == want_tokens, (r0["round_tokens"], want_tokens)
        assert r1["tokens"] == 2 * r0["tokens"]
        for m in (r0, r1):  # nothing missing, nothing left out: the garbage took no slot
            assert (m["fragments_missing"], m["fragments_not_uploaded"]) == (0, 0)
            # each planted object is rejected at most once (a reader that finds the real fragment first
            # never reads the garbage beside it)
            assert m["fragments_rejected"] <= bad
        rejected_total += r0["fragments_rejected"] + r1["fragments_rejected"]
        # bytes uploaded per round vs dense fp32 / ratio (= the codec's wire size, header included)
        header = SparseLoCoCodec(signer[st], cfg).expected_header(
            FragmentId(run_id, st, 0, 0, 0),
            [torch.Size(s) for s in shapes[st]],
            tokens=spec.round_tokens_bound(0),
        )
        want = 4 * sum(math.prod(s) for s in shapes[st]) / ratio(shapes[st], cfg, header=header)
        for m in (r0, r1):
            per_round = m["bytes_store_up"] / rounds
            assert abs(per_round - want) <= 0.10 * want, f"stage {st}: {per_round:.0f} B/round vs {want:.0f}"
        for _, s, r in placed:
            if s == st:  # the garbage and replica 1's real fragment side by side
                assert len(store.list(keys.slot_prefix(run_id, st, 0, r, 1))) == 2
    # the squatted primary key is read, and rejected, by both replicas (replica 1 when its PUT is refused);
    # garbage beside a valid primary fragment need not be read at all (a signer's primary key comes first)
    assert rejected_total >= 2
    logs = "".join(swarm.nodes[i].log_text() for i in slots.values())
    assert logs.count("rejected an object under replica 1's slot") == rejected_total
    for i in slots.values():
        with urllib.request.urlopen(f"{swarm.health[i]}/health", timeout=5) as r:
            assert json.load(r)["status"] == "ok"

    # issue 19: with SparseLoCo and a k < d link the consensus stays in span(U), so it exports, and the
    # export is the model that trained (the export refused every such run before)
    spec, rnd, states = consensus_states(store, run_id, {swarm.operator.public_key})
    assert rnd == rounds
    out = tmp_path / "hf"
    export_llama(spec, states, out, origin=f"round {rnd} of run {run_id}")
    stages = []
    for st, state in enumerate(states):
        stage = build_stage(spec.model, ranges, st)
        constrain_stage(stage, spec.model, spec.pipeline, ranges, st)
        stage.load_state_dict(state)
        assert off_subspace(stage) < 1e-5  # the live weights are this projected: the same to ~1e-7
        stages.append(stage.eval())
    tokens = sample_tokens(spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        diff = (hf_logits(out, tokens) - pipeline_logits(spec, stages, tokens)).abs().max().item()
    assert diff <= 1e-4, diff


def test_bad_input_is_rejected_and_node_keeps_running(swarm: Swarm) -> None:
    import socket

    node_status = swarm.statuses()[0]
    host, port = node_status["pipeline"].split(":")
    # 1. garbage on the pipeline port: a frame header announcing 4 GB, then junk
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"\xff\xff\xff\xf0junk")
    # 2. a malformed hello (valid frame, not an envelope)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"\x00\x00\x00\x05hello")
    # 3. a forged assignment: well-formed, signed by a key that is not the operator's
    forger = Identity.generate()
    dht = DHTClient(forger, bootstrap=[swarm.bootstrap])
    try:
        target = node_status["peer_id"]
        forged = Assignment(
            run_id="forged",
            term=99,
            epoch=1,
            peer_id=target,
            replica=0,
            stage=0,
            layers=[0, 1],
            spec=RunSpec(run_id="forged", replicas=1, stages=1, model=ModelSpec(n_layers=1)),
        )
        dht.publish(
            keys.assignment_key(target), forged, 300
        )  # under the forger's own subkey: read, then rejected
        # and under the operator's subkey, to shadow the real assignment: every DHT peer refuses to store it
        shadow = dht.dht.store(
            keys.assignment_key(target),
            seal(forger, forged),
            expiration_time=dht_time() + 300,
            subkey=swarm.operator.peer_id,
        )
        assert not shadow
        time.sleep(4)
    finally:
        dht.shutdown()
    st = swarm.statuses()[0]
    assert st is not None, "node stopped answering after bad input"
    assert st["metrics"]["run_id"] != "forged" and (st["assignment"] or {}).get("run_id") != "forged"
    assert "rejected pipeline connection" in swarm.nodes[0].log_text()
    assert "not a trusted key" in swarm.nodes[0].log_text()
    with urllib.request.urlopen(f"{swarm.health[0]}/health", timeout=5) as r:
        assert json.load(r)["status"] == "ok"


def test_a_crashed_worker_is_reported_failed_with_its_reason(swarm: Swarm, tmp_path: Path) -> None:
    """Issue 10 finding 8: a worker that dies of an exception the daemon did not list (here a `DataError`,
    a ValueError: train.data names no file) left a zombie advertising "training" with no error. Now the
    first stages report `failed` with the reason in /status and in their DHT advert (the coordinator logs
    it), their neighbours fail at once on the closed link instead of a timeout, and the run can be
    stopped; the next test trains these same nodes (they take new work)."""
    toml = tmp_path / "run.toml"
    missing = tmp_path / "no-such-corpus" / "*.txt"
    text = RUN_TOML.format(run_id="swarm-z", steps=20, H=5, timeout=30)
    toml.write_text(text.replace("eval_batches = 2\n", f'eval_batches = 2\ndata = "{missing}"\n'))
    swarm.launch(toml)
    launched = time.monotonic()

    def status() -> str:
        c = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "swarm-z", "--bootstrap", swarm.bootstrap]
            + ["--operator-key", swarm.operator.peer_id],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert c.returncode == 0, c.stderr
        return c.stdout

    # issue 12 acceptance 3: the operator sees `failed` and the reason in `status` within 30 s of launch
    shown = wait_until(
        lambda: out if re.search(r"failed: .*matches no file", out := status()) else None,
        30,
        "`crucible-coordinator status` to show the failed workers with their reason",
        poll_s=0.1,
    )
    assert time.monotonic() - launched < 30, shown

    def reported() -> list[dict] | None:
        ms = run_metrics(swarm, "swarm-z")
        first = [m for m in ms if m["stage"] == 0]
        ok = len(ms) == 4 and all(m["state"] == "failed" for m in ms) and len(first) == 2
        return ms if ok and all("matches no file" in m["error"] for m in first) else None

    ms = wait_until(
        reported, 90, "all four swarm-z workers to report failed, the first stages with the reason"
    )
    assert all(m["error"] for m in ms if m["stage"] == 1)  # the neighbours say why too (the link closed)
    wait_until(
        lambda: "failed: DataError: --data" in swarm.coordinator.log_text(),
        60,
        "the coordinator to read the reason from the nodes' adverts",
    )
    # restarted once, failed again the same way: the run fails with the reason instead of restarting forever
    shown = wait_until(
        lambda: out if "run swarm-z: failed" in (out := status()) else None,
        90,
        "the run to be marked failed",
        poll_s=1.0,
    )
    assert "reason: every replica lost a node: DataError: --data" in shown, shown
    c = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "stop",
            "swarm-z",
            *swarm.swarm_flags(),
            *swarm.operator_flags(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert c.returncode == 0, c.stderr
    assert all(node.alive for node in swarm.nodes)
    for h in swarm.health:
        with urllib.request.urlopen(f"{h}/health", timeout=5) as r:
            assert json.load(r)["status"] == "ok"


def _slot_index(swarm: Swarm, run_id: str, replica: int, stage: int) -> int:
    for i, st in enumerate(swarm.statuses()):
        m = st["metrics"] if st else None
        if m and m["run_id"] == run_id and (m["replica"], m["stage"]) == (replica, stage):
            return i
    raise AssertionError(f"no node serves {run_id} replica {replica} stage {stage}")


def test_lost_node_is_replaced_and_its_replica_resumes(swarm: Swarm, tmp_path: Path) -> None:
    """Issue 11 acceptance 1: SparseLoCo with P = 2 fragments and tau = 1; replica 1's last stage is
    killed, a spare node takes its place, and replica 1 resumes from its checkpoint (the new node reads
    its predecessor's, signed by the node it replaces). Replaying the rounds replica 0 already settled, it
    applies the same agreed sets, so for every round both replicas checkpointed, the anchors of each
    stage are bit-identical (`anchor_history` in /status), from the first round after it rejoined."""
    spare = swarm.add_node(4)
    swarm.health.append(spare.wait_for(r"health=(\S+)/health", 120).group(1))
    toml = tmp_path / "run.toml"
    toml.write_text(
        RUN_TOML.format(run_id="swarm-b", steps=60, H=5, timeout=30).replace(
            'method = "diloco"', 'method = "sparseloco"\nP = 2\ntau = 1'
        )
    )
    swarm.launch(toml)
    wait_until(
        lambda: (m := run_metrics(swarm, "swarm-b")) and len(m) == 4 and min(x["step"] for x in m) >= 8,
        300,
        "run swarm-b to pass its first round",
    )
    placed = {i for i, st in enumerate(swarm.statuses()) if st and st["metrics"]["run_id"] == "swarm-b"}
    (idle,) = set(range(len(swarm.nodes))) - placed  # 5 nodes, 4 slots: one is left free
    victim = _slot_index(swarm, "swarm-b", 1, 1)
    swarm.nodes[victim].kill()

    # the coordinator notices, puts the spare node into the hole, and replica 1 resumes from the latest
    # consensus checkpoint; replica 0 keeps training meanwhile (it only learns replica 1's new signer)
    def finished():
        sts = [s for i, s in enumerate(swarm.statuses()) if i != victim and s]
        ms = [s["metrics"] for s in sts if s["metrics"]["run_id"] == "swarm-b"]
        return len(ms) == 4 and all(m["state"] == "done" for m in ms) and ms

    ms = wait_until(finished, 300, "swarm-b to finish with the replacement node")
    assert {(m["replica"], m["stage"]) for m in ms} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert all(m["step"] == 60 for m in ms)
    replacement = swarm.statuses()[idle]["metrics"]
    assert replacement["run_id"] == "swarm-b" and (replacement["replica"], replacement["stage"]) == (1, 1)
    assert "rebuilding replica(s) [1]" in swarm.coordinator.log_text()
    assert "resumes from round" in swarm.nodes[idle].log_text()  # from the predecessor's checkpoint
    rejoined = min(r for r, _ in replacement["anchor_history"])
    for st in (0, 1):
        hist = {m["replica"]: dict(map(tuple, m["anchor_history"])) for m in ms if m["stage"] == st}
        common = sorted(set(hist[0]) & set(hist[1]))
        assert common and min(common) <= rejoined + 1, (st, common, rejoined)
        assert all(hist[0][r] == hist[1][r] for r in common), f"stage {st}: anchors differ"


def test_a_preempted_node_leaves_after_its_checkpoint_and_is_replaced_at_once(
    swarm: Swarm, tmp_path: Path
) -> None:
    """Issue 26 acceptance 3: SIGTERM to a training node is a spot host's notice. It trains on to its
    next round's checkpoint (within --preempt-notice-s), advertises "leaving" and exits 0; the coordinator
    re-places its slot with the spare at once (no churn grace: a killed node is noticed only after 2 x
    the grace), the replica resumes from that very checkpoint (no round lost) and the run ends with one
    consensus."""
    from scripts.local_swarm import LOCAL_CHURN_GRACE_S, LOCAL_PREEMPT_NOTICE_S

    while sum(c.alive for c in swarm.nodes) < 5:  # 4 slots and a spare
        swarm.respawn_node()
    run_id, H = "swarm-pre", 5
    toml = tmp_path / "run.toml"
    toml.write_text(
        RUN_TOML.format(run_id=run_id, steps=60, H=H, timeout=30).replace(
            'method = "diloco"', 'method = "sparseloco"'
        )
    )
    swarm.launch(toml)
    wait_until(
        lambda: (m := run_metrics(swarm, run_id)) and len(m) == 4 and min(x["step"] for x in m) >= 8,
        300,
        f"run {run_id} to pass its first round",
    )
    victim = _slot_index(swarm, run_id, 1, 1)
    busy = {i for i, st in enumerate(swarm.statuses()) if st and st["metrics"]["run_id"] == run_id}
    spare = next(i for i, c in enumerate(swarm.nodes) if c.alive and i not in busy)
    t0 = time.monotonic()
    swarm.nodes[victim].terminate()
    assert swarm.nodes[victim].proc.wait(30) == 0
    left = re.search(r"left after the checkpoint of round (\d+)", swarm.nodes[victim].log_text())
    assert left, swarm.nodes[victim].tail()

    def replacing():
        st = swarm.statuses()[spare]
        m = st["metrics"] if st else None
        return m and m["run_id"] == run_id and m["state"] == "training" and m["step"] > 0 and m

    wait_until(replacing, 60, "the spare to take the preempted node's slot and train")
    recovered_s = time.monotonic() - t0
    # the notice's round, then at once: a kill costs 2 x the churn grace before anything happens
    assert recovered_s < LOCAL_PREEMPT_NOTICE_S + 2 * LOCAL_CHURN_GRACE_S, recovered_s
    assert "rebuilding replica(s) [1]" in swarm.coordinator.log_text()
    assert f"resumes from round {left.group(1)} " in swarm.nodes[spare].log_text()  # nothing replayed

    def finished():
        ms = [s["metrics"] for i, s in enumerate(swarm.statuses()) if i != victim and s]
        ms = [m for m in ms if m["run_id"] == run_id]
        return len(ms) == 4 and all(m["state"] == "done" for m in ms) and ms

    ms = wait_until(finished, 300, f"{run_id} to finish with the replacement")
    for stage in (0, 1):
        assert len({m["weights_sha256"] for m in ms if m["stage"] == stage}) == 1


def test_without_spares_a_crashed_replica_drops_out_and_stop_works(swarm: Swarm, tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(RUN_TOML.format(run_id="swarm-c", steps=4000, H=5, timeout=6))
    swarm.launch(toml)
    alive_nodes = [i for i, c in enumerate(swarm.nodes) if c.alive]
    wait_until(
        lambda: (m := run_metrics(swarm, "swarm-c")) and len(m) == 4 and min(x["step"] for x in m) >= 6,
        300,
        "run swarm-c to pass its first round",
    )
    victim = _slot_index(swarm, "swarm-c", 1, 1)
    swarm.nodes[victim].kill()
    alive = [i for i in alive_nodes if i != victim]
    step_at_kill = max(m["step"] for m in run_metrics(swarm, "swarm-c"))

    def progressed():
        r0 = [
            m
            for i in alive
            if (s := swarm.statuses()[i]) and (m := s["metrics"])["run_id"] == "swarm-c" and m["replica"] == 0
        ]
        return len(r0) == 2 and min(m["step"] for m in r0) >= step_at_kill + 15 and r0

    r0 = wait_until(progressed, 240, "replica 0 to keep training after replica 1 lost a node")
    # a stage of replica 0 whose next round began after the drop-out reached it expects no replica 1 (and
    # misses nothing); the one that got there first counts the miss
    assert any(m["fragments_missing"] >= 1 for m in r0), r0
    # killed before its next upload: replica 0 finds replica 1 missing from the round it was in
    missed = {
        int(r)
        for i in alive
        for r in re.findall(
            r"run swarm-c stage \d round (\d+) fragment 0: replicas \[1\] did not arrive",
            swarm.nodes[i].log_text(),
        )
    }
    assert missed and min(missed) <= step_at_kill // 5 + 1, (missed, step_at_kill)
    # killed mid-microbatch: its neighbour in replica 1 reports failed, naming the broken link
    neighbour = _slot_index(swarm, "swarm-c", 1, 0)
    failed = wait_until(
        lambda: (s := swarm.statuses()[neighbour]) and s["metrics"]["state"] == "failed" and s["metrics"],
        120,
        "replica 1's first stage to report its broken link",
    )
    assert failed["run_id"] == "swarm-c" and failed["error"], failed
    # issue 19: the killed node, restarted with its key once its replica dropped out (a new epoch), does
    # not take the epoch-1 assignment the coordinator still republishes for it; /status says why
    wait_until(
        lambda: "run swarm-c: replica(s) [1] dropped out" in swarm.coordinator.log_text(), 60, "the drop-out"
    )
    again = swarm.add_node(victim)  # the same key file (its log replaces the killed one's)
    swarm.health.append(again.wait_for(r"health=(\S+)/health", 90).group(1))
    restarted = len(swarm.health) - 1
    ignored = wait_until(
        lambda: (s := swarm.statuses()[restarted]) and s["ignored_assignment"],
        60,
        "the restarted node to judge its old assignment",
    )
    assert ignored["run_id"] == "swarm-c" and "superseded" in ignored["reason"], ignored
    time.sleep(3)  # more polls: still not taken
    st = swarm.statuses()[restarted]
    assert st and st["state"] == "idle" and st["assignment"] is None, st
    assert again.stop() == 0  # no spare for the tests after this one
    c = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "stop",
            "swarm-c",
            *swarm.swarm_flags(),
            *swarm.operator_flags(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert c.returncode == 0, c.stderr
    wait_until(
        lambda: all((s := swarm.statuses()[i]) and s["metrics"]["state"] != "training" for i in alive),
        120,
        "nodes to stop training",
    )
    assert all(swarm.nodes[i].alive for i in alive)
    # stopped, not failed: a stage whose neighbour stopped first (and closed the link) is no failure
    r0_nodes = [i for i in alive if i != neighbour]
    ends = [swarm.statuses()[i]["metrics"] for i in r0_nodes]  # type: ignore[index]
    assert [(m["state"], m["error"]) for m in ends] == [("idle", "")] * len(r0_nodes), ends


def test_a_replica_killed_right_after_its_upload_is_consumed_then_missed(
    swarm: Swarm, tmp_path: Path
) -> None:
    """Issue 10 acceptance 5: the first stage of replica 1 is killed (SIGKILL, mid-step) as soon as its
    round-2 fragment is in the store. Replica 0 aggregates that fragment in round 2 (its update is
    consumed: no "did not arrive" for round 2), finds replica 1 missing from round 3 (killed before that
    upload) and trains to the end; replica 1's second stage reports `failed` with the broken link; the
    coordinator, with no spare node, lets replica 1 drop out and tells replica 0, whose later rounds then
    stop waiting out the deadline for it."""
    swarm.respawn_node()  # earlier tests killed two nodes: four alive again (a fresh key and index)
    toml = tmp_path / "run.toml"
    toml.write_text(RUN_TOML.format(run_id="swarm-k", steps=40, H=5, timeout=6))
    swarm.launch(toml)
    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    wait_until(lambda: len(run_metrics(swarm, "swarm-k")) == 4, 120, "swarm-k to be placed")
    victim = _slot_index(swarm, "swarm-k", 1, 0)
    r0s0, r1s1 = _slot_index(swarm, "swarm-k", 0, 0), _slot_index(swarm, "swarm-k", 1, 1)
    slot = keys.slot_prefix("swarm-k", 0, 0, 2, 1)  # stage 0, fragment 0, round 2, replica 1
    wait_until(lambda: store.list(slot), 180, "replica 1 to upload its round-2 fragment", poll_s=0.05)
    swarm.nodes[victim].kill()

    def replica0_done() -> list[dict] | None:
        ms = [m for m in run_metrics(swarm, "swarm-k") if m["replica"] == 0]
        return ms if len(ms) == 2 and all(m["state"] == "done" for m in ms) else None

    ms = wait_until(replica0_done, 240, "replica 0 to finish swarm-k without replica 1")
    assert all(m["step"] == 40 and m["fragments_missing"] >= 1 for m in ms)
    missed = {
        int(r)
        for r in re.findall(
            r"run swarm-k stage 0 round (\d+) fragment 0: replicas \[1\] did not arrive",
            swarm.nodes[r0s0].log_text(),
        )
    }
    assert missed and min(missed) > 2, missed  # round 2 consumed; the rounds after the kill missing
    assert "run swarm-k: replica(s) [1] dropped out" in swarm.coordinator.log_text()
    assert max(missed) < 8, missed  # ...until the drop-out reached replica 0: the last round waits for no one
    failed = wait_until(
        lambda: (s := swarm.statuses()[r1s1]) and s["metrics"]["state"] == "failed" and s["metrics"],
        120,
        "replica 1's second stage to report its broken link",
    )
    assert failed["error"]
    assert swarm.nodes[r0s0].alive and swarm.nodes[r1s1].alive

    # issue 19: the finished run shows replica 1 as dropped out (not its failed node's last figures), in
    # `status` and on the dashboard; the coordinator said it could not rebuild it once, not every tick
    def done_status() -> str | None:
        st = subprocess.run(
            [sys.executable, "-m", "coordinator.cli", "status", "swarm-k", "--bootstrap", swarm.bootstrap],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert st.returncode == 0, st.stderr
        return st.stdout if "run swarm-k: done" in st.stdout else None

    out = wait_until(done_status, 60, "`status` to show swarm-k done", poll_s=2)
    assert "reason: replica 1 dropped out: node" in out, out
    r1s1_peer = swarm.statuses()[r1s1]["peer_id"]  # type: ignore[index]
    (row,) = [ln for ln in out.splitlines() if ln.startswith(r1s1_peer[-8:])]
    assert "dropped out" in row and "swarm-k" in row, row
    with urllib.request.urlopen(f"{swarm.dashboard}api/runs/swarm-k", timeout=20) as r:
        grid = json.load(r)["grid"]
    assert [c["state"] for c in grid[1]] == ["dropped out"] * 2, grid
    assert all(c["tokens_per_s"] == 0 for c in grid[1]) and [c["state"] for c in grid[0]] == ["done"] * 2
    assert swarm.coordinator.log_text().count("run swarm-k: cannot rebuild replicas") <= 2


BUTTERFLY_SPREAD_BOUND = 0.6
"""Issue 23 acceptance 2: at the run's last round (every fragment exchanged 8 times, each replica with each
of its log2 4 = 2 partners 4 times) every replica's anchor is within this fraction of how far their mean
moved from the start: max_r ||A_r - mean A|| / ||mean A - A_0||. The anchor difference travels
SparseLoCo-compressed (1.56% of coordinates per exchange, the rest kept in the sender's anchor), so the
replicas do not reach one copy after log2 N exchanges; they stay close (0.43 measured here; 0.21 for 8
replicas after 40 rounds in scripts/bench_quality.py)."""


def test_butterfly_pairs_mix_four_replicas_and_the_run_exports(
    swarm: Swarm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23 acceptance 2 and 4: 4 replicas x 1 stage under sync.topology = "butterfly". Every exchange
    pairs as protocol/pairing.py says, both ends of a pair publish the same pair result digest, the
    replicas' weights differ (no consensus) but stay within BUTTERFLY_SPREAD_BOUND, validation falls, and
    `crucible-coordinator export` gives a Hugging Face folder whose logits are the vouched model's."""
    run_id, H, rounds = "swarm-bf", 5, 8
    toml = tmp_path / "run.toml"
    toml.write_text(
        RUN_TOML.format(run_id=run_id, steps=H * rounds, H=H, timeout=10)
        .replace("replicas = 2\nstages = 2", "replicas = 4\nstages = 1")
        .replace('method = "diloco"', 'method = "sparseloco"\ntopology = "butterfly"\nmax_late_rounds = 0')
    )
    spec = load_run_spec(toml)
    assert spec.sync.topology == "butterfly" and spec.replicas == 4 and spec.stages == 1
    # the fault tests before this one leave three nodes alive: 4 x 1 needs a fourth, or it is never placed
    while sum(c.alive for c in swarm.nodes) < 4:
        swarm.respawn_node()
    swarm.launch(toml)

    def finished():
        ms = run_metrics(swarm, run_id)
        return len(ms) == 4 and all(m["state"] == "done" for m in ms) and ms

    by = {m["replica"]: m for m in wait_until(finished, 300, f"{run_id} to finish")}
    for r, m in by.items():
        assert m["rounds"] == rounds
        assert {k: v for k, v in m["pair_exchanges"].items() if k != "clipped"} == {
            "exchanged": rounds,
            "unpaired": 0,
            "missing": 0,
            "refused": 0,
            "disagreed": 0,
            "resynced": 0,
        }
        last, p, sha = m["pair_sha256"]["0.0"].split(":")
        assert (int(last), int(p)) == (rounds - 1, partner(r, rounds - 1, 0, 4))
        assert by[int(p)]["pair_sha256"]["0.0"] == f"{last}:{r}:{sha}"  # the same bits at both ends
        assert m["val_history"][-1][1] < m["val_history"][0][1], m["val_history"]
    assert len({m["weights_sha256"] for m in by.values()}) == 4  # no consensus: each its own weights
    slots = _slots(swarm, run_id)
    sampled = scrape(f"{swarm.health[slots[(0, 0)]]}/metrics")  # the outcomes as /metrics counts them
    counted = {
        lab["outcome"]: v for lab, v in sampled["crucible_pair_exchanges_total"] if lab["run"] == run_id
    }
    assert counted["exchanged"] == rounds and counted["missing"] == 0

    store = ObjectStore(StoreConfig(endpoint_url=swarm.store_url, bucket="crucible"))
    # each replica's checkpoint signed by the node serving it (its key file found by peer id: a node that
    # was stopped and restarted with an old key breaks "node i's key is node{i}.key")
    signers = {k.peer_id: k.public_key for k in _node_identities(swarm)}
    peer_of = {
        st["metrics"]["replica"]: st["peer_id"]
        for st in swarm.statuses()
        if st and st["metrics"]["run_id"] == run_id
    }
    anchors = []
    for r in range(4):
        signer = signers[peer_of[r]]
        ck = read_round(store, run_id=run_id, stage=0, replica=r, round=rounds, trusted={signer})
        anchors.append(
            torch.cat([t.flatten() for k, t in sorted(ck.tensors.items()) if k.startswith("anchor.")])
        )
    start = build_stage(spec.model, spec.layer_ranges(), 0).state_dict()
    a0 = torch.cat(
        [start[k[len("anchor.") :]].flatten() for k in sorted(ck.tensors) if k.startswith("anchor.")]
    )
    mean = sum(anchors) / 4
    spread = max(float((a - mean).norm()) for a in anchors) / float((mean - a0).norm())
    assert 0 < spread < BUTTERFLY_SPREAD_BOUND, spread

    line = swarm.export(run_id, tmp_path / "hf")  # the command a user runs
    assert f"round {rounds}" in line, line
    spec, rnd, states = consensus_states(store, run_id, {swarm.operator.public_key})
    assert rnd == rounds and len(states) == 1
    stage = build_stage(spec.model, spec.layer_ranges(), 0)
    stage.load_state_dict(states[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tokens = sample_tokens(spec)
    diff = (
        (hf_logits(tmp_path / "hf", tokens) - pipeline_logits(spec, [stage.eval()], tokens))
        .abs()
        .max()
        .item()
    )
    assert diff <= 1e-4, diff


def test_store_lease_is_exclusive(moto_store: str) -> None:
    from coordinator.lease import renew, try_acquire

    store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="lease-test"))
    store.ensure_bucket()
    a, b = Identity.generate(), Identity.generate()
    both = {a.public_key, b.public_key}  # two coordinators that trust each other's leases
    held = try_acquire(store, a, "run-x", 30, trusted=both)
    assert held and held.lease.term == 1
    assert try_acquire(store, b, "run-x", 30, trusted=both) is None  # live lease: b loses
    # after expiry: b takes over, term + 1
    stolen = try_acquire(store, b, "run-x", 30, now=time.time() + 60, trusted=both)
    assert stolen and stolen.lease.term == 2
    assert renew(store, a, held, 30) is None  # a's stale ETag: deposed


def test_join_rejects_bad_bootstrap(moto_store: str) -> None:
    ObjectStore(StoreConfig(endpoint_url=moto_store)).ensure_bucket()  # the store answers; the peer does not
    r = subprocess.run(
        [sys.executable, "-m", "node.cli", "join", "--bootstrap", "not-a-multiaddr"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    assert "not a valid multiaddr" in r.stderr and "/ip4/" in r.stderr and "/p2p/" in r.stderr
    t = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "join",
            "--key-file",
            "/tmp/crucible-test-unreachable.key",
            "--operator-key",
            "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
            "--bootstrap",
            "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
            "--store-endpoint",
            moto_store,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode != 0 and time.monotonic() - t < 60
    assert "could not join the swarm" in r.stderr


def test_join_without_an_operator_key_is_refused() -> None:
    """Issue 10 finding 3: without --operator-key a node accepted assignments and run records signed by
    anyone (a stranger could point train.data at any file on the host and read it back). No trust root,
    no node: join refuses to start, before it binds a port or joins the DHT."""
    r = subprocess.run(
        [sys.executable, "-m", "node.cli", "join", "--key-file", "/tmp/crucible-test-no-operator.key",
         "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--operator-key is required" in r.stderr and "Traceback" not in r.stderr
    from node.daemon import NodeConfig, NodeDaemon

    with pytest.raises(ValueError, match="operator_key is required"):
        NodeDaemon(NodeConfig(device="cpu"), Identity.generate())  # the daemon holds to it as well


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="run_id"):
        RunSpec(run_id="Bad Id")
    with pytest.raises(ValueError, match="tau"):
        SyncSpec(H=5, tau=5)
    with pytest.raises(ValueError, match="microbatches"):
        TrainSpec(batch_size=5, microbatches=2)

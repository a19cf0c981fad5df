"""Planner on mixture-of-experts models (issue 24): total and active parameters, FLOPs per token on the
active ones, memory and sync bytes on all of them, and the routing barrier's stall per step."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.placement import CostModel
from coordinator.plan.inputs import MODELS, Host, ModelShape, RunSettings, load_pool
from coordinator.plan.layout import Layout, naive_layout, stage_memory_bytes, stage_params, stage_work
from coordinator.plan.planner import (
    ROUTE_COUNT_BYTES,
    ROUTE_RECORD_OVERHEAD_BYTES,
    predict,
    replica_step_s,
    route_barrier_s,
)
from coordinator.plan.spec import run_settings
from protocol import memory
from protocol.runspec import ModelSpec, MoESpec, PipelineSpec, RunSpec, SyncSpec, TrainSpec

ROOT = Path(__file__).resolve().parent.parent
POOL_MOE = ROOT / "docs" / "examples" / "pool_moe.toml"

MOE_MODEL = ModelSpec(
    vocab=512,
    d_model=128,
    n_layers=6,
    n_heads=4,
    d_ff=344,
    seq_len=64,
    moe=MoESpec(experts=16, top_k=4, d_ff=64, first_dense=1, shared_experts=1, stats_delay=2),
)


def _spec(model: ModelSpec = MOE_MODEL) -> RunSpec:
    return RunSpec(
        run_id="moe-plan",
        replicas=2,
        stages=3,
        model=model,
        train=TrainSpec(batch_size=8, microbatches=4),
        sync=SyncSpec(method="sparseloco", H=30, P=1, tau=0),
        pipeline=PipelineSpec(extra_in_flight=0),
    )


def _host(name: str, *, tflops: float = 1.0, store_rtt_ms: float = 30.0) -> Host:
    return Host(
        name=name,
        gpus=1,
        peak_tflops=tflops,
        memory_gb=0.0,
        usd_per_hour=1.0,
        link_mbps=1e5,
        rtt_ms=0.0,
        store_mbps=1e5,
        store_rtt_ms=store_rtt_ms,
    )


MOE_SHAPE = ModelShape(
    n_layers=8, d_model=512, n_heads=8, n_kv_heads=8, d_ff=256, vocab=512, seq_len=512, experts=32, top_k=4
)


def _layout(shape: ModelShape, store_rtt_ms: float = 30.0, *, slow: float = 1.0) -> Layout:
    """Two replicas of two stages; the second replica's hosts run at `slow` TFLOP/s."""
    reps = [
        (_host("a0", store_rtt_ms=store_rtt_ms), _host("a1", store_rtt_ms=store_rtt_ms)),
        (
            _host("b0", tflops=slow, store_rtt_ms=store_rtt_ms),
            _host("b1", tflops=slow, store_rtt_ms=store_rtt_ms),
        ),
    ]
    half = shape.n_layers // 2
    return Layout(replicas=tuple(reps), layers=(half, shape.n_layers - half))


# --- counts -----------------------------------------------------------------------------------------
def test_total_and_active_counts_match_the_run_spec() -> None:
    shape = ModelShape.from_spec(MOE_MODEL)
    assert shape.n_params == MOE_MODEL.n_params
    assert shape.n_active_params == MOE_MODEL.n_active_params < shape.n_params
    spec = _spec()
    layers = tuple(b - a for a, b in spec.layer_ranges())
    assert stage_params(shape, layers) == [memory.stage_params(spec, s) for s in range(spec.stages)]
    assert sum(stage_params(shape, layers)) == shape.n_params  # sync bytes count every expert
    # the dense block before first_dense and the MoE blocks are counted by kind
    assert shape.blocks_params(0, 1) == MOE_MODEL.layer_params(0)
    assert shape.blocks_params(1, 6, active=True) == sum(
        MOE_MODEL.layer_params(i, active=True) for i in range(1, 6)
    )


def test_flops_per_token_count_active_parameters() -> None:
    shape = ModelShape.from_spec(MOE_MODEL)
    attention = 14 * shape.n_layers * shape.d_model * shape.seq_len
    assert shape.flops_per_token() == 6 * MOE_MODEL.n_active_params + attention
    assert sum(stage_work(shape, (1, 2, 3))) == pytest.approx(shape.flops_per_token(), rel=1e-12)
    # the stage of the dense block works more per layer than an MoE stage (f = 344 > 4 x 64 + 64)
    w = stage_work(shape, (1, 1, 4))
    assert w[0] > w[1]


def test_moe_32b_preset_is_the_seeds_shape() -> None:
    m = MODELS["moe-32b"]
    assert (m.experts, m.top_k, m.shared_experts, m.first_dense) == (256, 8, 0, 0)
    assert m.n_params == pytest.approx(32e9, rel=0.01)
    assert m.n_active_params == pytest.approx(2.11e9, rel=0.01)
    assert m.flops_per_token() == 6 * m.n_active_params + 14 * 48 * 2048 * 4096


def test_memory_counts_every_expert_as_protocol_memory_does() -> None:
    spec = _spec()
    layers = tuple(b - a for a, b in spec.layer_ranges())
    need = stage_memory_bytes(ModelShape.from_spec(spec.model), layers, run_settings(spec, 0.65))
    assert need == [memory.stage_memory(spec, s, "bf16").total for s in range(spec.stages)]


def test_a_dense_shapes_figures_are_unchanged() -> None:
    m = MODELS["8b"]
    assert m.n_active_params == m.n_params == 8_030_261_248
    assert m.flops_per_token() == 55_697_760_256.0
    pool = load_pool(ROOT / "docs" / "examples" / "pool_8b.toml")
    st = RunSettings(microbatches=32, extra_in_flight=4)
    p = predict(m, naive_layout(m, pool.expand(), 12, 4, st), st)
    assert p.tokens_per_s == pytest.approx(157_502.74568916392, rel=1e-12)  # before MoE counted
    assert p.layers == (9, 9, 8, 6)
    assert (p.route.barrier_s, p.route.stall_s, p.breakdown.route_wait) == (0.0, 0.0, 0.0)


def test_the_cost_model_reads_the_specs_moe() -> None:
    cost = CostModel.from_spec(_spec())
    assert cost.shape.experts == 16 and cost.shape.top_k == 4 and cost.shape.shared_experts == 1
    assert cost.settings.stats_delay == 2


# --- the routing barrier ----------------------------------------------------------------------------
def test_barrier_is_store_round_trips_and_record_bytes() -> None:
    layout = _layout(MOE_SHAPE, store_rtt_ms=100.0)
    t, b = route_barrier_s(MOE_SHAPE, layout.replicas[0], layout.layers, R=2)
    record = 4 * 32 * ROUTE_COUNT_BYTES + ROUTE_RECORD_OVERHEAD_BYTES
    assert b == 2 * record  # ours up, the other replica's down
    assert t == pytest.approx(3 * 0.1 + 2 * record * 8 / 1e11)  # PUT, LIST, one GET
    dense = dataclasses.replace(MOE_SHAPE, experts=0, top_k=0)
    assert route_barrier_s(dense, layout.replicas[0], layout.layers, R=2) == (0.0, 0)


def test_stall_grows_with_the_store_rtt_and_vanishes_with_delay() -> None:
    stalls = []
    for rtt in (0.0, 30.0, 300.0):
        p = predict(MOE_SHAPE, _layout(MOE_SHAPE, rtt), RunSettings())
        stalls.append(p.route.stall_s)
        assert p.route.stall_s == pytest.approx(p.route.barrier_s)  # D = 1: nothing hides it
    assert stalls[0] < stalls[1] < stalls[2]
    far = _layout(MOE_SHAPE, 300.0)
    d1, d2 = (predict(MOE_SHAPE, far, RunSettings(stats_delay=d)) for d in (1, 2))
    assert d2.route.stall_s < d1.route.stall_s and d2.tokens_per_s > d1.tokens_per_s
    hidden = predict(MOE_SHAPE, far, RunSettings(stats_delay=4))
    assert hidden.route.stall_s == 0.0 and hidden.breakdown.route_wait == pytest.approx(0.0, abs=1e-12)
    # the stall is in the step, so in tokens/s and MFU
    assert d1.effective_mfu < hidden.effective_mfu
    assert d1.step_s[0] == pytest.approx(hidden.step_s[0] + d1.route.stall_s)


def test_replicas_keep_the_slowest_ones_pace() -> None:
    layout = _layout(MOE_SHAPE, 0.0, slow=0.5)
    p = predict(MOE_SHAPE, layout, RunSettings(stats_delay=4))
    assert p.step_s[0] == p.step_s[1] and p.route.pace_s > 0
    dense = dataclasses.replace(MOE_SHAPE, experts=0, top_k=0)
    q = predict(dense, layout, RunSettings())
    assert q.step_s[0] < q.step_s[1]  # a dense run's replicas never wait on each other
    assert sum(dataclasses.asdict(p.breakdown).values()) == pytest.approx(1.0)


def test_placement_scores_a_replica_as_predict_holds_it() -> None:
    hosts = tuple(dataclasses.replace(h, store_mbps=5.0) for h in _layout(MOE_SHAPE, 300.0).replicas[0])
    one, st = Layout(replicas=(hosts,), layers=(4, 4)), RunSettings(tau=0)
    p = predict(MOE_SHAPE, one, st, run_replicas=2)
    assert p.route.stall_s > 0 and p.breakdown.sync_wait > 0
    assert replica_step_s(MOE_SHAPE, hosts, one.layers, st, replicas=2) == pytest.approx(p.step_s[0])


def test_pool_files_give_each_site_its_store_round_trip(tmp_path: Path) -> None:
    pool = load_pool(POOL_MOE)
    assert {h.store_rtt_ms for h in pool.expand()} == {20.0, 40.0}
    assert {h.store_rtt_ms for h in pool.expand(store_rtt_ms=300.0)} == {300.0}
    bad = tmp_path / "pool.toml"
    bad.write_text(POOL_MOE.read_text().replace("store_rtt_ms = 20", "store_rtt_ms = -1"))
    with pytest.raises(ValueError, match="store_rtt_ms must be >= 0"):
        load_pool(bad)


# --- the CLI ----------------------------------------------------------------------------------------
def _plan(*args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "plan",
        "--model",
        "moe-32b",
        "--pool",
        str(POOL_MOE),
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    return out.stdout


def test_plan_prints_tokens_mfu_on_active_params_price_and_stall() -> None:
    report = _plan()
    assert "params (2.11 B active)" in report
    predicted = next(line for line in report.splitlines() if line.startswith("predicted"))
    assert "tokens/s" in predicted and "MFU" in predicted and "on active params" in predicted
    assert "/Mtok" in predicted and "n/a" not in predicted
    assert "routing    barrier" in report and "s/step at D = 1" in report and "kB a stage" in report
    local = json.loads(_plan("--json"))["prediction"]
    far = json.loads(_plan("--json", "--store-rtt-ms", "300"))["prediction"]
    assert 0 < local["route"]["stall_s"] < far["route"]["stall_s"]
    assert far["tokens_per_s"] < local["tokens_per_s"]
    assert local["route"]["bytes_per_step"] > 0
    assert local["flops_per_token"] == MODELS["moe-32b"].flops_per_token()

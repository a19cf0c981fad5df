"""The planner's calibration step and its local-swarm prediction (scripts/calibrate_local.py): no swarm.

Most tests feed a synthetic `Calibration` to `local_swarm_model`, whose answers follow in closed form;
one starts two real stage probes on a small model. The swarm's measured side (`StepClock`) and the
run.toml edit (`set_pipeline`) are checked here too.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest

from coordinator.plan.planner import MODELS, ModelShape
from coordinator.plan.spec import sync_compression_ratio
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, SyncSpec, TrainSpec
from scripts.calibrate_local import (
    Calibration,
    calibrate,
    link_figures,
    local_swarm_model,
    predict_local_swarm,
)

TOKENS_PER_STEP = 8 * 256  # the default TrainSpec batch x ModelSpec seq_len


def _spec(**pipeline: object) -> RunSpec:
    return RunSpec(run_id="calib-test", pipeline=PipelineSpec(**pipeline))  # type: ignore[arg-type]


def _cal(spec: RunSpec | None = None, **changes: object) -> Calibration:
    """A quiet 2-core machine, 0.3 CPU s per stage step, links from the spec's shaper."""
    spec = spec or _spec()
    mbps, rtt = link_figures(spec, 10_000.0, 0.02)
    cal = Calibration(
        cores=2,
        processes=spec.replicas * spec.stages,
        stage_step_s=(0.3,) * spec.stages,
        shared_step_s=(0.6,) * spec.stages,
        shared_cpu_step_s=(0.3,) * spec.stages,
        capacity=2.0,
        matmul_tflops=0.1,
        link_mbps=mbps,
        rtt_ms=rtt,
        store_mbps=10_000.0,
        loopback_mbps=10_000.0,
        loopback_rtt_ms=0.02,
    )
    return replace(cal, **changes)  # type: ignore[arg-type]


def test_model_shape_from_spec_is_the_tiny_preset() -> None:
    shape = ModelShape.from_spec(ModelSpec())
    assert shape == MODELS["tiny"]
    assert shape.n_params == ModelSpec().n_params == 3_295_488
    assert shape.flops_per_token() == pytest.approx(6 * 3_295_488 + 14 * 4 * 256 * 256)


def test_link_is_the_shaper_in_series_with_loopback() -> None:
    mbps, rtt = link_figures(_spec(bandwidth_mbps=20.0, delay_ms=5.0), 5000.0, 0.05)
    assert mbps == pytest.approx(1 / (1 / 20 + 1 / 5000))
    assert rtt == pytest.approx(2 * 5.0 + 0.05)
    assert link_figures(_spec(), 5000.0, 0.05) == (5000.0, 0.05)  # unshaped: loopback alone


def test_saturated_machine_shares_cores_and_hides_the_bubble() -> None:
    """Compute-bound, 4 processes on 2 idle cores: the cores never idle, so a step of every replica
    takes N t / C (the bubble is filled by the other processes), each busy process at C / n_busy."""
    m = local_swarm_model(_spec(), _cal())
    step = 4 * 0.3 / 2
    assert m.prediction.tokens_per_s == pytest.approx(2 * TOKENS_PER_STEP / step, rel=1e-4)
    assert m.phi == pytest.approx(2 / m.busy, rel=1e-4)
    assert 0.5 < m.phi < 1.0  # more than a fair quarter of 2 cores: the bubble's share is reclaimed
    assert m.other_threads == 0.0


def test_unsaturated_machine_gives_each_process_a_core() -> None:
    """One replica, 2 stages on 4 cores: phi = 1 and the planner's 1F1B step (M + S - 1) t / M."""
    spec = replace(_spec(), replicas=1)
    m = local_swarm_model(spec, _cal(spec, cores=4, capacity=2.0))
    assert m.phi == 1.0
    assert m.prediction.tokens_per_s == pytest.approx(TOKENS_PER_STEP / (5 / 4 * 0.3), rel=0.01)


def test_other_work_on_the_machine_slows_the_prediction() -> None:
    quiet = local_swarm_model(_spec(), _cal())
    busy_cal = _cal(capacity=1.0)  # the probes got half the cores: other work equals 4 threads
    busy = local_swarm_model(_spec(), busy_cal)
    assert busy_cal.other_threads == pytest.approx(4.0)
    # compute-bound 1F1B: each process busy M / (M + S - 1) = 0.8 of a step, so n_busy = 3.2 and the
    # freed cores are shared with the 4 other threads: phi = 2 / (3.2 + 4), step = 5/4 x 0.3 / phi
    phi = 2 / (3.2 + 4.0)
    assert busy.phi == pytest.approx(phi, rel=2e-3)  # link and sync terms add a little idle time
    assert busy.prediction.tokens_per_s == pytest.approx(2 * TOKENS_PER_STEP / (5 / 4 * 0.3 / phi), rel=2e-3)
    assert busy.prediction.tokens_per_s < 0.5 * quiet.prediction.tokens_per_s


@pytest.mark.parametrize("link_k", [[], [32]])
def test_prediction_is_monotonic_in_bandwidth(link_k: list[int]) -> None:
    rates = []
    for mbps in (0.5, 2, 5, 20, 100, 1_000, 0):  # 0: unshaped
        spec = _spec(link_k=link_k, bandwidth_mbps=float(mbps), delay_ms=5.0)
        rates.append(predict_local_swarm(spec, _cal(spec)).tokens_per_s)
    assert all(b >= a * (1 - 1e-6) for a, b in zip(rates, rates[1:], strict=False))
    assert rates[0] < 0.5 * rates[-1]  # a 0.5 Mbit/s link costs more than half the throughput


def test_subspace_link_beats_dense_on_a_slow_link() -> None:
    dense, sub = _spec(bandwidth_mbps=5.0), _spec(bandwidth_mbps=5.0, link_k=[32])
    assert (
        predict_local_swarm(sub, _cal(sub)).tokens_per_s
        > 2 * predict_local_swarm(dense, _cal(dense)).tokens_per_s
    )


def test_figures_are_sane_for_the_tiny_model() -> None:
    spec = _spec(bandwidth_mbps=20.0, delay_ms=5.0)
    m = local_swarm_model(spec, _cal(spec))
    p = m.prediction
    F = MODELS["tiny"].flops_per_token()
    assert m.ceiling == pytest.approx(F * TOKENS_PER_STEP / 0.6 / 0.1e12)  # 2 stages x 0.3 s, one thread
    assert p.peak_tflops == pytest.approx(2 * 0.1)  # the machine: C cores x one thread's matmul
    assert p.effective_mfu == pytest.approx(p.tokens_per_s * F / 0.2e12)
    assert 0 < p.effective_mfu < m.ceiling and 0 < p.tax < 1
    assert p.usd_per_hour == pytest.approx(4 * 0.10)
    assert p.usd_per_mtok == pytest.approx(0.40 / (p.tokens_per_s * 3600) * 1e6)
    assert [ln.k for ln in p.links] == [256, 256]  # dense: k = d on each replica's link
    assert p.links[0].bytes_per_microbatch == 2 * 256 * 256 * 4 + 36  # fp32 wire, b = 2


def test_sync_ratio_follows_the_method() -> None:
    assert sync_compression_ratio(replace(_spec(), sync=SyncSpec(method="diloco"))) == 1.0
    sparse = replace(_spec(), sync=SyncSpec(method="sparseloco"))
    assert 100 < sync_compression_ratio(sparse) < 300


def test_calibrate_measures_a_small_run() -> None:
    """Two real probe processes (one replica x two stages) on a small model."""
    spec = RunSpec(
        run_id="calib-small",
        replicas=1,
        stages=2,
        model=ModelSpec(d_model=64, n_layers=2, n_heads=2, d_ff=172, seq_len=32),
        train=TrainSpec(batch_size=4, microbatches=2),
        pipeline=PipelineSpec(link_k=[16], bandwidth_mbps=50.0, delay_ms=2.0),
    )
    cal = calibrate(spec, alone_s=0.2, shared_s=0.3)
    assert cal.processes == 2 and len(cal.stage_step_s) == 2
    assert all(0 < t < 5 for t in cal.stage_step_s + cal.shared_step_s)
    assert 0 < cal.capacity <= cal.processes * 1.5
    assert 0 < cal.link_mbps < 50.0 and cal.rtt_ms >= 4.0
    assert cal.loopback_mbps > 50.0 and 0 < cal.matmul_tflops < 100
    assert predict_local_swarm(spec, cal).tokens_per_s > 0


def test_step_clock_times_only_the_clean_stretch_of_each_round() -> None:
    from scripts.local_swarm import StepClock

    clock = StepClock()
    t = 0.0
    for step in range(1, 61):
        t += 1.0 + (10.0 if step in (1, 30, 31, 60) else 0.0)  # start-up, sync, eval, final sync
        st = {"metrics": {"run_id": "r", "state": "training", "replica": 0, "stage": 0, "step": step}}
        clock.observe([st, None], t, "r")
    assert clock.steady_steps_per_s(H=30, total=60) == {0: pytest.approx(1.0)}
    assert clock.overall_steps_per_s(total=60)[0] < 0.75


def test_set_pipeline_sets_keys_once() -> None:
    from scripts.local_swarm import set_pipeline

    text = '[run]\nrun_id = "x"\n\n[pipeline]\nwire_dtype = "float32"\nlink_k = [64]\n\n[sync]\nH = 30\n'
    out = tomllib.loads(set_pipeline(text, link_k=[32], bandwidth_mbps=20.0, delay_ms=None))
    assert out["pipeline"] == {"link_k": [32], "bandwidth_mbps": 20.0, "wire_dtype": "float32"}
    assert out["sync"] == {"H": 30}
    added = tomllib.loads(set_pipeline('[run]\nrun_id = "x"\n', delay_ms=5.0))
    assert added["pipeline"] == {"delay_ms": 5.0}


def test_a_failing_probe_is_reported_with_its_error() -> None:
    from scripts.calibrate_local import CalibrationError, _Probe

    probe = _Probe(_spec(), stage=5)  # the run has 2 stages: the probe exits with a ValueError
    try:
        with pytest.raises(CalibrationError, match="stage 5 is outside the run's 2 stages"):
            probe.wait_ready(120)
    finally:
        probe.close()

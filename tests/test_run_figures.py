"""The dashboard's live figures: measured tokens/s through the planner's definitions (one cost model)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.placement import CostModel, Placement, placement_layout
from coordinator.plan.planner import figures, predict
from coordinator.run_figures import History, Sample, sample
from protocol.messages import NodeAdvert
from protocol.runspec import ModelSpec, RunSpec, TrainSpec

SPEC = RunSpec(
    run_id="figs",
    replicas=2,
    stages=2,
    model=ModelSpec(d_model=64, n_layers=2, n_heads=2, d_ff=176, seq_len=64),
    train=TrainSpec(total_steps=10, batch_size=4, microbatches=2),
)


def _advert(peer: str, r: int, s: int, tps: float, loss: float | None, state: str = "training") -> NodeAdvert:
    return NodeAdvert(
        peer_id=peer,
        version="test",
        device="cpu",
        memory_gb=16.0,
        tflops=0.5,
        price_per_hour=2.0,
        host="127.0.0.1",
        port=1,
        health_port=2,
        state=state,  # type: ignore[arg-type]
        run_id="figs",
        replica=r,
        stage=s,
        step=7,
        loss=loss,
        tokens_per_s=tps,
        bytes_pipe=1000,
        bytes_store=500,
    )


def test_measured_figures_follow_the_planner_definitions() -> None:
    pl = Placement({(r, s): f"p{r}{s}" for r in range(2) for s in range(2)})
    ads = {
        "p00": _advert("p00", 0, 0, 900.0, None),
        "p01": _advert("p01", 0, 1, 1000.0, 3.0),
        "p10": _advert("p10", 1, 0, 500.0, None),
        "p11": _advert("p11", 1, 1, 0.0, 5.0),  # not measured yet: its replica counts as its stage 0's
    }
    cost = CostModel.from_spec(SPEC)
    got = sample(SPEC, pl, ads, cost)
    assert got.tokens_per_s == 1500.0 and got.loss == 4.0 and got.step == 7
    assert got.bytes_pipe == 4000 and got.bytes_store == 2000 and got.nodes_training == 4
    layout = placement_layout(pl, ads, cost)
    peak = sum(h.peak_tflops for rep in layout.replicas for h in rep) * 1e12
    assert got.effective_mfu == pytest.approx(1500.0 * cost.shape.flops_per_token() / peak)
    assert got.tax == pytest.approx(1 - got.effective_mfu / cost.settings.ceiling)
    assert got.usd_per_mtok == pytest.approx(4 * 2.0 / (1500.0 * 3600) * 1e6)
    # the planner's prediction reports the same definitions at its own tokens/s
    p = predict(cost.shape, layout, cost.settings)
    f = figures(cost.shape, layout, cost.settings, p.tokens_per_s)
    assert (f.effective_mfu, f.tax, f.usd_per_mtok) == pytest.approx((p.effective_mfu, p.tax, p.usd_per_mtok))

    # a replica with no node training adds nothing; a node of another run is not counted
    ads["p00"] = replace(ads["p00"], state="done")
    ads["p01"] = replace(ads["p01"], run_id="other")
    got = sample(SPEC, pl, ads, cost)
    assert got.tokens_per_s == 500.0 and got.loss == 5.0
    # a placed node's advert gone: figures without a peak, no crash
    del ads["p10"]
    gone = sample(SPEC, pl, ads, cost)
    assert gone.effective_mfu == 0.0 and gone.usd_per_mtok is None


def test_history_keeps_one_sample_per_interval_and_a_bounded_tail() -> None:
    h = History(maxlen=3, every_s=1.0)

    def at(t: float) -> Sample:
        return Sample(
            t=t,
            step=int(t),
            loss=float("nan"),
            val_bpb=None,
            tokens_per_s=1.0,
            effective_mfu=0.1,
            tax=0.5,
            usd_per_mtok=None,
            bytes_pipe=0,
            bytes_store=0,
            nodes_training=1,
        )

    for t in (0.0, 0.5, 1.6, 2.7, 3.8):
        h.add("r", at(t))
    assert [s.t for s in h.samples("r")] == [1.6, 2.7, 3.8]  # 0.5 replaced 0.0, then the oldest dropped
    assert [s.t for s in h.samples("r", since=2.0)] == [2.7, 3.8]
    assert h.latest("r").as_dict()["loss"] is None  # JSON has no NaN  # type: ignore[union-attr]
    assert h.samples("nope") == [] and h.latest("nope") is None


def _idle_advert(peer: str, ref_block_s: float, links: dict[str, float]) -> NodeAdvert:
    """A local swarm node as it advertises itself before placement: a CPU, its reference block's time,
    its store and its loopback links to the others as it probed them."""
    return NodeAdvert(
        peer_id=peer,
        version="test",
        device="cpu",
        memory_gb=16.0,
        free_memory_gb=8.0,
        tflops=0.09,
        tflops_fp32=0.09,
        ref_block="cpu-d256",
        ref_block_s=ref_block_s,
        price_per_hour=0.10,
        host="127.0.0.1",
        port=1,
        health_port=2,
        store_mbps=900.0,
        peer_mbps=links,
        peer_rtt_ms=dict.fromkeys(links, 0.2),
    )


def test_the_dashboard_and_crucible_swarm_show_one_prediction() -> None:
    """Issue 19: the coordinator predicts the placement once, with `predict_placement` on the placed nodes'
    adverts; its dashboard serves that figure (GET /api/runs/RUN) and crucible-swarm prints what it reads
    there, so the two are equal. A real coordinator's views (no DHT or store: nothing here needs one), its
    real dashboard on loopback, and crucible-swarm's own reader and report."""
    from coordinator.dashboard import Dashboard
    from coordinator.placement import place, predict_placement
    from coordinator.plan.planner import Figures, figures_at
    from coordinator.service import Coordinator, ManagedRun
    from protocol.identity import Identity
    from protocol.messages import RunRecord
    from scripts.local_swarm import coordinator_prediction, prediction_line

    spec = replace(SPEC, run_id="one-prediction")
    peers = [f"p{i}" for i in range(4)]
    ads = {
        p: _idle_advert(p, 0.05 + 0.01 * i, {q: 9700.0 - 100 * i for q in peers if q != p})
        for i, p in enumerate(peers)
    }
    cost = CostModel.from_spec(spec)
    pl = place(list(ads.values()), spec.replicas, spec.stages, cost=cost)
    coord = Coordinator(Identity.generate(), None, None)  # type: ignore[arg-type]
    run = ManagedRun(record=RunRecord(spec=spec, state="running"), lease=None, placement=pl)  # type: ignore[arg-type]
    coord.runs[spec.run_id] = run
    coord._log_prediction(run, ads)  # what the coordinator does once it placed the run
    coord._observe({}, ads)  # the snapshot its dashboard serves
    dash = Dashboard(coord, "127.0.0.1", 0)
    try:
        shown = coordinator_prediction(f"http://127.0.0.1:{dash.port}/", spec.run_id)
    finally:
        dash.close()
    p = predict_placement(pl, ads, cost)
    assert shown is not None and shown["tokens_per_s"] == p.tokens_per_s  # exact: one figure, one function
    assert (shown["effective_mfu"], shown["tax"], shown["usd_per_mtok"]) == (
        p.effective_mfu,
        p.tax,
        p.usd_per_mtok,
    )
    assert shown == coord.view["runs"][spec.run_id]["prediction"]  # what the page's script draws
    line = prediction_line(shown, {"tokens_per_s": 1234.0})
    assert f"predicted: {p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.effective_mfu:.1f}%" in line
    assert "calibrated for this machine's CPU sharing 1,234 tokens/s" in line
    # crucible-swarm's measured MFU, tax and $/Mtok: the planner's definitions over the same peaks
    measured = 0.8 * p.tokens_per_s
    want = figures(cost.shape, placement_layout(pl, ads, cost), cost.settings, measured)
    got = figures_at(
        Figures(effective_mfu=p.effective_mfu, tax=p.tax, usd_per_mtok=p.usd_per_mtok),
        p.tokens_per_s,
        measured,
    )
    assert (got.effective_mfu, got.tax, got.usd_per_mtok) == pytest.approx(
        (want.effective_mfu, want.tax, want.usd_per_mtok), rel=1e-12
    )


def test_the_bytes_plot_counts_every_node_the_run_had() -> None:
    """Issue 19: after a rebuild the summed counters dipped (the dead node's bytes left with its advert,
    the new node counts from 0); the history keeps each node's last count and banks a count that starts
    again, so the plotted bytes never fall."""
    pl = Placement({(r, s): f"p{r}{s}" for r in range(2) for s in range(2)})
    ads = {p: _advert(p, r, s, 100.0, 3.0) for (r, s), p in pl.slots.items()}
    cost, h = CostModel.from_spec(SPEC), History(every_s=0.0)
    h.add("figs", sample(SPEC, pl, ads, cost))
    assert h.latest("figs").bytes_pipe == 4000  # type: ignore[union-attr]
    ads = {p: replace(a, bytes_pipe=3000, bytes_store=900) for p, a in ads.items()}
    h.add("figs", sample(SPEC, pl, ads, cost))
    assert (h.latest("figs").bytes_pipe, h.latest("figs").bytes_store) == (12000, 3600)  # type: ignore[union-attr]
    # p11 dies; p12 takes its slot and counts from 0; p10 is re-assigned (a new epoch) and starts again
    del ads["p11"]
    pl = Placement({**pl.slots, (1, 1): "p12"})
    ads["p12"] = _advert("p12", 1, 1, 0.0, None)
    ads["p12"] = replace(ads["p12"], bytes_pipe=10, bytes_store=0)
    ads["p10"] = replace(ads["p10"], bytes_pipe=20)
    s = sample(SPEC, pl, ads, cost)
    assert s.bytes_pipe == 3 * 3000 - 3000 + 30  # what the live counters sum to now: the dip
    h.add("figs", s)
    got = h.latest("figs")
    assert got is not None and got.bytes_pipe == 12000 + 30 and got.bytes_store == 3600
    assert "per_node" not in got.as_dict()  # the API's samples keep their fields

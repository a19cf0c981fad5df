"""The dashboard's live figures: measured tokens/s through the planner's definitions (one cost model)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.placement import CostModel, Placement, placement_layout
from coordinator.planner import figures, predict
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

"""Mixed-shape placement (issue 22, acceptance 5): replicas of different stage counts in one run, priced by
the planner's one per-replica model, beside the best uniform placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.plan.cli import main as plan_main
from coordinator.plan.planner import (
    MEMORY_HEADROOM,
    MODELS,
    HostGroup,
    Pool,
    RunSettings,
    auto_stages,
    load_pool,
    naive_layout,
    predict,
    replica_step_s,
    stage_memory_bytes,
    usd_per_mtok,
)
from coordinator.plan.shapes import ShapePlan, compare_shapes, uniform_layouts
from protocol import memory

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "pool_mixed_memory.toml"
SHAPE = MODELS["72b"]
SETTINGS = RunSettings()


def _servers(big: int, small: int) -> Pool:
    """8-GPU servers: `big` of A100 80GB, `small` of A100 40GB, on equal links."""

    def group(name: str, accelerator: str, count: int, price: float) -> HostGroup:
        return HostGroup(
            name=name,
            accelerator=accelerator,
            gpus=8,
            count=count,
            usd_per_gpu_hour=price,
            link_mbps=1000.0,
            rtt_ms=30.0,
            store_mbps=1000.0,
        )

    return Pool(hosts=(group("big", "a100-80gb", big, 1.3), group("small", "a100-40gb", small, 0.9)))


def _tokens_by_replica(plan: ShapePlan) -> float:
    """The run's tokens/s rebuilt replica by replica from `replica_step_s`, the per-replica model placement
    uses, with R the whole run's replica count."""
    tokens_per_step = SETTINGS.microbatches * SETTINGS.microbatch_size * SHAPE.seq_len
    return sum(
        tokens_per_step / replica_step_s(SHAPE, hosts, g.layout.layers, SETTINGS, replicas=plan.replicas)
        for g in plan.groups
        for hosts in g.layout.replicas
    )


def test_the_example_pool_mixes_80_and_40_gb_gpus() -> None:
    hosts = load_pool(EXAMPLE).expand()
    assert {h.memory_gb / h.gpus for h in hosts} == {80.0, 40.0}
    assert sum(h.gpus for h in hosts) == 256


def test_mixed_placement_on_the_example_pool() -> None:
    hosts = load_pool(EXAMPLE).expand()
    c = compare_shapes(SHAPE, hosts, SETTINGS)
    assert c is not None
    big, small = c.mixed.groups  # largest memory first
    # the 80 GB servers hold a replica in fewer stages than the 40 GB ones
    assert big.memory_gb > small.memory_gb and big.stages < small.stages
    assert (big.replicas, big.stages, small.replicas, small.stages) == (2, 5, 2, 11)
    # every stage fits its host's memory, activations included, and nothing is warned about
    for g in c.mixed.groups:
        need = stage_memory_bytes(SHAPE, g.layout.layers, SETTINGS)
        for rep in g.layout.replicas:
            assert all(need[s] <= MEMORY_HEADROOM * memory.GB * h.memory_gb for s, h in enumerate(rep))
        assert not g.prediction.warnings
    # tokens/s is the sum of the replicas', each by the same per-replica model as the uniform arm
    assert c.mixed.tokens_per_s == pytest.approx(sum(g.prediction.tokens_per_s for g in c.mixed.groups))
    assert c.mixed.tokens_per_s == pytest.approx(_tokens_by_replica(c.mixed), rel=1e-9)
    assert c.uniform.tokens_per_s == pytest.approx(_tokens_by_replica(c.uniform), rel=1e-9)
    # MFU and $/Mtok: the planner's definitions over every placed host
    placed = [h for g in c.mixed.groups for rep in g.layout.replicas for h in rep]
    peak = sum(h.peak_tflops for h in placed) * 1e12
    assert c.mixed.effective_mfu == pytest.approx(c.mixed.tokens_per_s * SHAPE.flops_per_token() / peak)
    usd = sum(h.usd_per_hour for h in placed)
    assert c.mixed.usd_per_mtok == pytest.approx(usd_per_mtok(usd, c.mixed.tokens_per_s))
    # on this pool mixing wins, on tokens/s and on $/Mtok
    assert c.mixed.tokens_per_s > 1.2 * c.uniform.tokens_per_s
    assert c.mixed.usd_per_mtok < c.uniform.usd_per_mtok


def test_the_uniform_arm_is_what_plan_predicts_today() -> None:
    """The automatic uniform layout (`auto_stages`, R = hosts // S, `naive_layout`) with its numbers
    unchanged: `predict` without `run_replicas` is the same prediction."""
    hosts = load_pool(EXAMPLE).expand()
    S = auto_stages(SHAPE, hosts, SETTINGS)
    layout = naive_layout(SHAPE, hosts, len(hosts) // S, S, SETTINGS)
    today = predict(SHAPE, layout, SETTINGS)
    assert predict(SHAPE, layout, SETTINGS, run_replicas=len(layout.replicas)) == today
    c = compare_shapes(SHAPE, hosts, SETTINGS, planned=layout)
    assert c is not None and c.uniform_is_planned
    assert c.uniform.tokens_per_s == today.tokens_per_s
    assert c.uniform.usd_per_mtok == pytest.approx(today.usd_per_mtok)
    assert c.uniform.effective_mfu == pytest.approx(today.effective_mfu)
    # the other candidate leaves the 40 GB servers out; here it predicts less
    candidates = uniform_layouts(SHAPE, hosts, SETTINGS)
    assert len(candidates) == 2
    assert {h.memory_gb for rep in candidates[0].replicas for h in rep} == {640.0}
    assert predict(SHAPE, candidates[0], SETTINGS).tokens_per_s < today.tokens_per_s


def test_uniform_can_win_and_the_cli_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """8 big servers make one 5-stage replica and 3 left over; the uniform 3 x 8 uses every server, its
    last stages on the big ones, and predicts more (though mixing is still cheaper per token)."""
    c = compare_shapes(SHAPE, _servers(8, 16).expand(), SETTINGS)
    assert c is not None and c.mixed_gain < 0
    assert c.mixed.groups[0].replicas == 1 and c.uniform.replicas == 3
    pool = tmp_path / "pool.toml"
    pool.write_text(
        "".join(
            f'[[hosts]]\nname = "{n}"\naccelerator = "{a}"\ngpus = 8\ncount = {k}\nusd_per_gpu_hour = {p}\n'
            "link_mbps = 1000\nrtt_ms = 30\nstore_mbps = 1000\n"
            for n, a, k, p in (("big", "a100-80gb", 8, 1.3), ("small", "a100-40gb", 16, 0.9))
        )
    )
    assert plan_main(["plan", "--model", "72b", "--pool", str(pool)]) == 0
    out = capsys.readouterr().out
    assert f"mixed-shape predicts {-c.mixed_gain:.1%} fewer tokens/s than the best uniform" in out


def test_cli_prints_both_placements_on_the_example_pool(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "72b", "--pool", str(EXAMPLE)]
    assert plan_main(argv) == 0
    report = capsys.readouterr().out
    c = compare_shapes(SHAPE, load_pool(EXAMPLE).expand(), SETTINGS)
    assert c is not None
    assert (
        "mixed      2 replicas x 5 stages on a100-80gb-us (640 GB a host), layers/stage 15/17/17/16/15"
        in report
    )
    assert "2 replicas x 11 stages on a100-40gb-eu (320 GB a host)" in report
    assert "uniform    4 replicas x 8 stages" in report and "(the plan above)" in report
    for plan in (c.mixed, c.uniform):
        assert f"MFU {plan.effective_mfu:.1%}" in report and f"${plan.usd_per_mtok:,.4f}/Mtok" in report
    assert "more tokens/s than the best uniform" in report
    assert "the coordinator does not pick them itself" in report
    assert plan_main([*argv, "--json"]) == 0
    shapes = json.loads(capsys.readouterr().out)["shapes"]
    assert shapes["mixed"]["tokens_per_s"] == pytest.approx(c.mixed.tokens_per_s)
    assert shapes["uniform"]["tokens_per_s"] == pytest.approx(c.uniform.tokens_per_s)
    assert [(s["replicas"], s["stages"]) for s in shapes["mixed"]["shapes"]] == [(2, 5), (2, 11)]
    assert shapes["mixed"]["usd_per_mtok"] < shapes["uniform"]["usd_per_mtok"]
    assert shapes["mixed_gain"] > 0 and "planning figure" in shapes["note"]


def test_a_pool_of_one_memory_prints_no_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    pool = Path(EXAMPLE).with_name("pool_8b.toml")  # H100 SXM and A100 80GB: one memory
    assert compare_shapes(MODELS["8b"], load_pool(pool).expand(), SETTINGS) is None
    assert plan_main(["plan", "--model", "8b", "--pool", str(pool)]) == 0
    assert "mixed-shape" not in capsys.readouterr().out
    assert plan_main(["plan", "--model", "8b", "--pool", str(pool), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shapes"] is None


def test_run_replicas_only_adds_fragments_to_fetch() -> None:
    """A shape's replicas fetch the fragments of the whole run's: a larger R never speeds a replica."""
    hosts = _servers(5, 1).expand()[:5]  # the 80 GB servers
    layout = naive_layout(SHAPE, hosts, 1, 5, SETTINGS)
    alone = predict(SHAPE, layout, RunSettings(tau=0))
    in_run = predict(SHAPE, layout, RunSettings(tau=0), run_replicas=8)
    assert in_run.fragment_transfer_s > alone.fragment_transfer_s and in_run.step_s >= alone.step_s
    with pytest.raises(ValueError, match="fewer than the layout's 1 replicas"):
        predict(SHAPE, layout, SETTINGS, run_replicas=0)

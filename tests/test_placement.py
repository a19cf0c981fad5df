"""coordinator/placement.py: ranking and dealing of nodes, and keeping nodes off stages their memory cannot hold."""

from __future__ import annotations

import dataclasses
import time

import pytest

from coordinator.placement import Placement, PlacementError, place, repair, stage_needs
from protocol.memory import stage_memory
from protocol.messages import NodeAdvert
from protocol.runspec import ModelSpec, RunSpec, TrainSpec

GB = 10**9


def _node(name: str, tflops: float, free_gb: float = 0.0, device: str = "cuda:0") -> NodeAdvert:
    return NodeAdvert(
        peer_id=name,
        version="test",
        device=device,
        memory_gb=80.0,
        free_memory_gb=free_gb,
        tflops=tflops,
        price_per_hour=1.0,
        host="127.0.0.1",
        port=1,
        health_port=2,
        store_mbps=100.0,
    )


def test_nodes_are_dealt_by_rank_so_replicas_get_a_similar_mix() -> None:
    nodes = [_node(f"n{i}", tflops=100.0 - i) for i in range(6)]
    pl = place(nodes, replicas=2, stages=3)
    assert pl.slots == {(r, s): f"n{s * 2 + r}" for s in range(3) for r in range(2)}
    # with memory to spare everywhere, and with unknown free memory, the memory check changes nothing
    roomy = [dataclasses.replace(a, free_memory_gb=80.0) for a in nodes]
    assert place(roomy, 2, 3, need_bytes=[GB, 2 * GB, GB]).slots == pl.slots
    assert place(nodes, 2, 3, need_bytes=[100 * GB] * 3).slots == pl.slots


def test_a_node_without_the_free_memory_is_skipped() -> None:
    nodes = [_node("fast-small", 300.0, free_gb=4.0), _node("mid", 200.0, 40.0), _node("slow", 100.0, 40.0)]
    pl = place(nodes, replicas=1, stages=2, need_bytes=[10 * GB, 10 * GB])
    assert set(pl.slots.values()) == {"mid", "slow"}
    # 4 GB x 90% holds a 3 GB stage: the small node takes the stage it can hold, the big one the other
    pl = place(nodes, replicas=1, stages=2, need_bytes=[30 * GB, 3 * GB])
    assert pl.slots == {(0, 0): "mid", (0, 1): "fast-small"}


def test_a_big_stage_takes_a_big_node_back_from_a_small_stage() -> None:
    """Dealt in order, stage 0 would take the only node that holds stage 1; the matching moves it."""
    nodes = [_node("big", 300.0, 80.0), _node("small-a", 200.0, 10.0), _node("small-b", 100.0, 10.0)]
    pl = place(nodes, replicas=1, stages=2, need_bytes=[5 * GB, 50 * GB])
    assert pl.slots == {(0, 0): "small-a", (0, 1): "big"}


def test_too_few_nodes_with_the_memory_names_the_counts() -> None:
    nodes = [_node("a", 300.0, 8.0), _node("b", 200.0, 8.0), _node("c", 100.0, 40.0), _node("d", 50.0, 40.0)]
    with pytest.raises(PlacementError) as e:
        place(nodes, replicas=2, stages=2, need_bytes=[10 * GB, 30 * GB])
    msg = str(e.value)
    assert "need 4 nodes for 2 replicas x 2 stages" in msg
    assert "only 2 of 4 free nodes have the free memory for a stage" in msg
    assert "stage 1, needs 30.0 GB and 2 node(s) fit it (2 needed)" in msg
    with pytest.raises(PlacementError, match="need 6 free nodes for 2 replicas x 3 stages, found 4"):
        place(nodes, replicas=2, stages=3)


def test_each_node_is_judged_in_its_own_precision() -> None:
    needs = {"bf16": [20 * GB, 20 * GB], "fp32": [50 * GB, 50 * GB]}
    gpu, cpu = _node("gpu", 300.0, 40.0), _node("cpu", 1.0, 40.0, device="cpu")
    big_cpu = _node("big-cpu", 0.5, 100.0, device="cpu")
    pl = place([gpu, cpu, big_cpu], replicas=1, stages=2, need_bytes=needs)
    assert set(pl.slots.values()) == {"gpu", "big-cpu"}
    with pytest.raises(PlacementError, match=r"needs 20.0 GB in bf16 or 50.0 GB in fp32"):
        place([gpu, cpu], replicas=1, stages=2, need_bytes=needs)


def test_stage_needs_from_the_run_spec() -> None:
    model = ModelSpec(vocab=256, d_model=256, n_layers=4, n_heads=4, d_ff=688, seq_len=256)
    spec = RunSpec(run_id="need", replicas=1, stages=2, model=model)
    needs = stage_needs(spec)
    assert isinstance(needs, dict) and set(needs) == {"fp32", "bf16"}
    assert needs["bf16"] == [stage_memory(spec, s, "bf16").total for s in range(2)]
    fixed = dataclasses.replace(spec, train=TrainSpec(precision="fp32"))
    assert stage_needs(fixed) == needs["fp32"]


def test_repair_refills_holes_with_nodes_that_fit() -> None:
    current = Placement({(0, 0): "a", (0, 1): "b", (1, 0): "c", (1, 1): "d"})
    free = [_node("small", 300.0, 8.0), _node("big", 100.0, 80.0)]
    new, holes = repair(current, {"a", "c", "d"}, free, need_bytes=[5 * GB, 50 * GB])
    assert holes == {(0, 1)} and new.peer(0, 1) == "big"
    new, holes = repair(current, {"a", "c", "d"}, free)  # no memory check: the fastest free node
    assert new.peer(0, 1) == "small"
    with pytest.raises(PlacementError, match="1 slot\\(s\\) lost their node: only 0 of 1 free nodes"):
        repair(current, {"a", "c", "d"}, free[:1], need_bytes=[5 * GB, 50 * GB])
    with pytest.raises(PlacementError, match="2 slot\\(s\\) lost their node, only 1 free node"):
        repair(current, {"a", "c"}, free[:1])
    assert repair(current, {"a", "b", "c", "d"}, free) == (current, set())


def test_a_thousand_candidates_place_quickly() -> None:
    """Only 150 nodes hold the last stage; dealt in order, stages 0-6 take 140 of them, so 10 of the 20
    last-stage slots take theirs back through augmenting paths."""
    nodes = [_node(f"n{i:04d}", 1000.0 - i * 0.5, free_gb=80.0 if i < 150 else 20.0) for i in range(1000)]
    needs = [60 * GB if s == 7 else 8 * GB for s in range(8)]
    t = time.perf_counter()
    pl = place(nodes, replicas=20, stages=8, need_bytes=needs)
    assert time.perf_counter() - t < 1.0
    assert len(set(pl.slots.values())) == 160
    by_peer = {a.peer_id: a for a in nodes}
    assert all(by_peer[pl.peer(r, 7)].free_memory_gb == 80.0 for r in range(20))
    with pytest.raises(PlacementError, match="only 150 of 1000 free nodes have the free memory for a stage"):
        place(nodes, replicas=20, stages=8, need_bytes=[60 * GB] * 8)

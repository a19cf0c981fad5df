"""Runs whose replicas differ in stage count or layer split ([[shapes]] with stages / layer_split / link_k):
placement, repair and prediction per layout class.

A layout class is the replicas of one (layer ranges, link_k): within it every replica is an ordinary
pipeline of S_c stages, so `coordinator.placement` places, repairs and predicts it as a run of its own
(`LayoutClass.spec`: the run as those replicas alone). Classes of fewer stages are placed first: their
stages hold more layers, so they take the nodes with the most memory before the others spread out. The
run's figures are the classes' sums. A run whose replicas share one split is one class, and these
functions are `coordinator.placement`'s own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from coordinator.placement import (
    CostModel,
    Placement,
    PlacementError,
    place,
    predict_placement,
    repair,
    stage_needs,
)
from coordinator.plan.planner import Prediction
from protocol.messages import NodeAdvert
from protocol.runspec import ReplicaShape, RunSpec

Slot = tuple[int, int]


@dataclass(frozen=True)
class LayoutClass:
    replicas: tuple[int, ...]
    """The run's replicas of this layout, ascending; local replica i is replicas[i]."""
    spec: RunSpec
    """The run as these replicas alone: their stages, split, link widths and microbatch counts."""

    def local(self, pl: Placement) -> Placement:
        """The slots of `pl` in this class, by local replica index."""
        index = {r: i for i, r in enumerate(self.replicas)}
        return Placement({(index[r], s): p for (r, s), p in pl.slots.items() if r in index})

    def run_slots(self, slots: Mapping[Slot, str]) -> dict[Slot, str]:
        """Local slots -> the run's."""
        return {(self.replicas[r], s): p for (r, s), p in slots.items()}


def layout_classes(spec: RunSpec) -> list[LayoutClass]:
    """The run's replicas grouped by (layer ranges, link_k), fewest stages first (a run whose replicas
    share one split: one class, the run itself)."""
    if len(spec.layouts()) == 1:
        return [LayoutClass(tuple(range(spec.replicas)), spec)]
    by: dict[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], list[int]] = {}
    for r in range(spec.replicas):
        by.setdefault((tuple(spec.layer_ranges(r)), tuple(spec.link_k_of(r))), []).append(r)
    out = []
    for (ranges, link_k), members in by.items():
        mbs = [spec.microbatches_of(r) for r in members]
        shapes = [
            ReplicaShape(replicas=[i], microbatches=m)
            for i, m in enumerate(mbs)
            if m != spec.train.microbatches
        ]
        sub = replace(
            spec,
            replicas=len(members),
            stages=len(ranges),
            layer_split=[b - a for a, b in ranges],
            pipeline=replace(spec.pipeline, link_k=list(link_k)),
            shapes=shapes,
        )
        out.append(LayoutClass(tuple(members), sub))
    return sorted(out, key=lambda c: (c.spec.stages, c.replicas))


def place_run(free: list[NodeAdvert], spec: RunSpec) -> Placement:
    """Place every replica of `spec` on `free` nodes, class by class; raise PlacementError naming the class
    that found too few."""
    slots: dict[Slot, str] = {}
    total = 0.0
    left = list(free)
    for c in layout_classes(spec):
        try:
            pl = place(
                left,
                c.spec.replicas,
                c.spec.stages,
                need_bytes=stage_needs(c.spec),
                cost=CostModel.from_spec(c.spec),
            )
        except PlacementError as e:
            if len(layout_classes(spec)) == 1:
                raise
            raise PlacementError(f"replicas {list(c.replicas)} ({c.spec.stages} stages): {e}") from None
        slots.update(c.run_slots(pl.slots))
        total += pl.tokens_per_s
        taken = set(pl.slots.values())
        left = [a for a in left if a.peer_id not in taken]
    return Placement(slots, total)


def repair_run(
    spec: RunSpec,
    current: Placement,
    alive: set[str],
    free: list[NodeAdvert],
    adverts: Mapping[str, NodeAdvert],
) -> tuple[Placement, set[Slot]]:
    """`coordinator.placement.repair` class by class: the holes of each class refilled from the free
    nodes the classes before it left."""
    slots: dict[Slot, str] = {}
    holes: set[Slot] = set()
    left = list(free)
    for c in layout_classes(spec):
        pl, changed = repair(
            c.local(current),
            alive,
            left,
            need_bytes=stage_needs(c.spec),
            cost=CostModel.from_spec(c.spec),
            adverts=adverts,
        )
        slots.update(c.run_slots(pl.slots))
        holes |= {(c.replicas[r], st) for r, st in changed}
        taken = set(pl.slots.values())
        left = [a for a in left if a.peer_id not in taken]
    return Placement(slots, current.tokens_per_s), holes


def predict_run(spec: RunSpec, pl: Placement, adverts: Mapping[str, NodeAdvert]) -> RunPrediction:
    """The planner's prediction of the run on its placed nodes: each class's, summed."""
    return RunPrediction(
        [predict_placement(c.local(pl), adverts, CostModel.from_spec(c.spec)) for c in layout_classes(spec)]
    )


@dataclass(frozen=True)
class RunPrediction:
    """The classes' predictions as one run's figures: tokens/s and $/h add up; MFU and the tax are the
    classes' averages weighed by their peak FLOP/s (MFU = achieved FLOP/s over the GPUs' peak)."""

    parts: list[Prediction]

    @property
    def tokens_per_s(self) -> float:
        return sum(p.tokens_per_s for p in self.parts)

    @property
    def usd_per_mtok(self) -> float:
        usd_per_s = sum(p.usd_per_hour for p in self.parts) / 3600
        return usd_per_s / self.tokens_per_s * 1e6 if self.tokens_per_s > 0 else float("inf")

    def _by_peak(self, field: str) -> float:
        peak = [p.peak_tflops for p in self.parts]  # each class's hosts' peaks, summed
        return sum(w * getattr(p, field) for w, p in zip(peak, self.parts, strict=True)) / max(
            sum(peak), 1e-30
        )

    @property
    def effective_mfu(self) -> float:
        return self._by_peak("effective_mfu")

    @property
    def tax(self) -> float:
        return self._by_peak("tax")

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(w for p in self.parts for w in p.warnings)


__all__ = ["LayoutClass", "RunPrediction", "layout_classes", "place_run", "predict_run", "repair_run"]

"""Placement: live adverts -> R replicas x S stages.

Greedy and O(n log n): free nodes are ranked by measured TFLOP/s (then store bandwidth, then price), the
fastest R*S are taken, and dealt so that every replica gets a similar mix (replica r, stage s takes rank
s*R + r), keeping replicas' step times close since the slowest stage paces each pipeline.
Re-placement after churn only fills the holes: untouched slots keep their nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import NodeAdvert

Slot = tuple[int, int]  # (replica, stage)


class PlacementError(RuntimeError):
    """Not enough suitable nodes; the message says how many are missing."""


@dataclass(frozen=True)
class Placement:
    slots: dict[Slot, str]
    """(replica, stage) -> peer id."""

    def peer(self, replica: int, stage: int) -> str:
        return self.slots[(replica, stage)]


def _rank_key(a: NodeAdvert) -> tuple[float, float, float, str]:
    return (-a.tflops, -a.store_mbps, a.price_per_hour, a.peer_id)


def place(adverts: list[NodeAdvert], replicas: int, stages: int, *, min_store_mbps: float = 0.0) -> Placement:
    """Choose R*S free nodes; raise PlacementError if there are too few."""
    candidates = sorted((a for a in adverts if a.store_mbps >= min_store_mbps), key=_rank_key)
    need = replicas * stages
    if len(candidates) < need:
        raise PlacementError(
            f"need {need} free nodes for {replicas} replicas x {stages} stages, found {len(candidates)}"
            + (f" with >= {min_store_mbps} Mbit/s to the store" if min_store_mbps else "")
        )
    slots = {(r, s): candidates[s * replicas + r].peer_id for s in range(stages) for r in range(replicas)}
    return Placement(slots)


def repair(current: Placement, alive: set[str], free: list[NodeAdvert]) -> tuple[Placement, set[Slot]]:
    """Refill the slots whose node is gone with the best free nodes; returns the new placement and the
    slots that changed (only those, and their pipeline neighbours, need new assignments)."""
    holes = sorted(slot for slot, peer in current.slots.items() if peer not in alive)
    pool = sorted(free, key=_rank_key)
    if len(pool) < len(holes):
        raise PlacementError(
            f"{len(holes)} slot(s) lost their node, only {len(pool)} free node(s) to refill them"
        )
    slots = dict(current.slots)
    for slot, a in zip(holes, pool, strict=False):
        slots[slot] = a.peer_id
    return Placement(slots), set(holes)

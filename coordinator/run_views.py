"""JSON views of runs and nodes for the dashboard's API (plain dicts: made on the tick, served as they are)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from coordinator.run_figures import History
from protocol.messages import NodeAdvert, RunRecord

if TYPE_CHECKING:
    from coordinator.service import ManagedRun


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def node_view(a: NodeAdvert) -> dict:
    return {
        "peer_id": a.peer_id,
        "device": a.device,
        "tflops": a.tflops,
        "price_per_hour": a.price_per_hour,
        "state": a.state,
        "error": a.error,
        "run_id": a.run_id,
        "replica": a.replica,
        "stage": a.stage,
        "step": a.step,
        "loss": _finite(a.loss),
        "tokens_per_s": a.tokens_per_s,
        "store_mbps": a.store_mbps,
        "coordinator_eligible": a.coordinator_eligible,
    }


def run_view(
    rec: RunRecord, run: ManagedRun | None, adverts: dict[str, NodeAdvert], history: History
) -> dict:
    """A run as the dashboard shows it; `run` is given when this coordinator leads it (then the grid of
    replicas x stages with the node in each slot, and the planner's prediction)."""
    spec = rec.spec
    latest = history.latest(spec.run_id)
    grid: list[list[dict | None]] = []
    if run is not None and run.placement is not None:
        for r in range(spec.replicas):
            row: list[dict | None] = []
            for s in range(spec.stages):
                peer = run.placement.slots.get((r, s))
                a = adverts.get(peer) if peer else None
                on_run = a is not None and a.run_id == spec.run_id
                row.append(
                    None
                    if peer is None
                    else {
                        "peer_id": peer,
                        "device": a.device if a else "",
                        "state": (a.state if on_run else "lost") if a else "lost",
                        "step": a.step if a and on_run else 0,
                        "tokens_per_s": a.tokens_per_s if a and on_run else 0.0,
                        "loss": _finite(a.loss) if a and on_run else None,
                        "error": a.error if a and on_run else "",
                    }
                )
            grid.append(row)
    m = spec.model
    return {
        "run_id": spec.run_id,
        "state": rec.state,
        "reason": rec.reason,
        "term": rec.term,
        "coordinator": rec.coordinator,
        "dashboard": rec.dashboard,
        "led_here": run is not None,
        "replicas": spec.replicas,
        "stages": spec.stages,
        "total_steps": spec.train.total_steps,
        "sync": spec.sync.method,
        "model": {"d_model": m.d_model, "n_layers": m.n_layers, "seq_len": m.seq_len, "vocab": m.vocab},
        "epoch": run.epoch if run else None,
        "prediction": run.prediction if run else None,
        "grid": grid,
        "latest": latest.as_dict() if latest else None,
    }


__all__ = ["node_view", "run_view"]

"""JSON views of runs and nodes for the dashboard's API (plain dicts: made on the tick, served as they are)."""

from __future__ import annotations

import math
import re

from coordinator.managed_run import ManagedRun
from coordinator.run_figures import History
from protocol.messages import NodeAdvert, RunRecord

DROPPED_OUT = "dropped out"
"""The state `status` and the dashboard show for the nodes of a replica that left the run."""
_DROPPED = re.compile(r"replicas? (\d+(?:, \d+)*) dropped out\b")


def dropped_out_reason(why: dict[int, str]) -> str:
    """A run record's reason naming the replicas that dropped out (replica -> why; empty: none), in the
    one form `dropped_out_of` reads back: `replicas 0, 2 dropped out: ...`."""
    if not why:
        return ""
    rs = sorted(why)
    head = f"replica{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} dropped out"
    detail = "; ".join(f"replica {r}: {why[r]}" if len(rs) > 1 else why[r] for r in rs if why[r])
    return f"{head}: {detail}" if detail else head


def dropped_out_of(reason: str) -> set[int]:
    """The replicas a run record's reason says dropped out (`dropped_out_reason`); the record has no field
    of its own for them."""
    m = _DROPPED.match(reason)
    return {int(r) for r in m.group(1).split(", ")} if m else set()


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
        "reachable": a.reachable,
        "link_transport": dict(a.link_transport),
    }


def run_view(
    rec: RunRecord, run: ManagedRun | None, adverts: dict[str, NodeAdvert], history: History
) -> dict:
    """A run as the dashboard shows it; `run` is given when this coordinator leads it (then the grid of
    replicas x stages with the node in each slot, and the planner's prediction)."""
    spec = rec.spec
    latest = history.latest(spec.run_id)
    grid: list[list[dict | None]] = []
    dropped = run.dropped_out() if run is not None else set()
    if run is not None and run.placement is not None:
        for r in range(spec.replicas):
            row: list[dict | None] = []
            for s in range(spec.stages_of(r)):
                peer = run.placement.slots.get((r, s))
                a = adverts.get(peer) if peer else None
                on_run = a is not None and a.run_id == spec.run_id
                state = (a.state if on_run else "lost") if a else "lost"
                row.append(
                    None
                    if peer is None
                    else {
                        "peer_id": peer,
                        "device": a.device if a else "",
                        # out of the run: its last figures are no longer the run's
                        "state": DROPPED_OUT if r in dropped else state,
                        "step": a.step if a and on_run else 0,
                        "tokens_per_s": a.tokens_per_s if a and on_run and r not in dropped else 0.0,
                        "loss": _finite(a.loss) if a and on_run else None,
                        "error": a.error if a and on_run else "",
                        # MoE: max / mean tokens per expert by layer (the balancing's figure)
                        "expert_load": dict(a.expert_load) if a and on_run else {},
                        # NAT: links through the relay, and whether peers can dial this node
                        "relayed": sorted(p for p, t in a.link_transport.items() if t == "relayed")
                        if a and on_run
                        else [],
                        "reachable": a.reachable if a else True,
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
        "stages": spec.max_stages,
        "batches": [spec.batch_of(r) for r in range(spec.replicas)],  # sequences a step ([[shapes]])
        "splits": [
            [b - a for a, b in spec.layer_ranges(r)] for r in range(spec.replicas)
        ],  # layers per stage
        "total_steps": spec.train.total_steps,
        "sync": spec.sync.method,
        "model": {"d_model": m.d_model, "n_layers": m.n_layers, "seq_len": m.seq_len, "vocab": m.vocab},
        "epoch": run.epoch if run else None,
        "dropped_out": sorted(dropped) if run is not None else sorted(dropped_out_of(rec.reason)),
        "prediction": run.prediction if run else None,
        "grid": grid,
        "latest": latest.as_dict() if latest else None,
        "events": [{"t": t, "kind": k, "what": w} for t, k, w in run.events] if run else [],
    }


__all__ = ["DROPPED_OUT", "dropped_out_of", "dropped_out_reason", "node_view", "run_view"]

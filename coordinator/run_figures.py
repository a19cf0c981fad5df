"""What a running run is doing now, from its nodes' adverts, and its recent history (for the dashboard and
the coordinator's /metrics).

    tokens/s   = sum over training replicas of their stages' measured tokens/s (every stage of a replica
                 trains on the same tokens; each measures over its own >= 2 s window, so the newest-measured,
                 the largest, stands for the replica)   # replicas never wait on each other
    loss       = mean over replicas of the last stage's training loss (nats/token)
    MFU, tax, $/Mtok: the planner's definitions (coordinator/plan/planner.py `figures`) at the measured tokens/s,
                      over the placed nodes as placement sees them (one cost model)
    bytes      = summed over every node the run has had (`CumulativeCounters`): a node's counters count
                 its current assignment, so a node that died, or was given a new assignment, keeps what
                 it moved before                                  # the plot never dips at a rebuild
    prediction = `prediction_view` of coordinator/placement.py `predict_placement`: the planner on the
                 placed nodes' adverts; the dashboard shows it and crucible-swarm prints it
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from coordinator.placement import CostModel, Placement, placement_layout
from coordinator.plan.layout_classes import RunPrediction, layout_classes
from coordinator.plan.planner import Prediction, placed_figures
from protocol.messages import NodeAdvert
from protocol.runspec import RunSpec

HISTORY_SAMPLES = 3600
"""Samples kept per run (one per SAMPLE_EVERY_S: an hour at 1 s)."""
SAMPLE_EVERY_S = 1.0


@dataclass(frozen=True)
class Sample:
    t: float
    """Unix time."""
    step: int
    loss: float | None
    """Mean training loss of the replicas' last stages, nats per token."""
    val_bpb: float | None
    tokens_per_s: float
    effective_mfu: float
    tax: float
    usd_per_mtok: float | None
    bytes_pipe: int
    """Pipeline bytes sent + received by the run's nodes so far: `sample` sums their current assignments'
    counts, `History.add` keeps it cumulative over every node the run had."""
    bytes_store: int
    """Object-store bytes up + down by the run's nodes so far (as `bytes_pipe`)."""
    nodes_training: int
    per_node: tuple[tuple[str, int, int], ...] = field(default=(), repr=False)
    """(peer id, bytes_pipe, bytes_store) of each node counted: what `History.add` makes the totals
    cumulative from (not in `as_dict`)."""

    def as_dict(self) -> dict:
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in asdict(self).items()
            if k != "per_node"
        }


class CumulativeCounters:
    """Counters summed over every source that ever reported them, across restarts.

    A source (a node) reports counts since its current start; when a count goes down the source
    restarted (a new assignment, a new process), so what it had counted is banked. A source that stops
    reporting (it died) keeps its last counts. So a total never decreases."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}
        self._banked: Counter[str] = Counter()

    def observe(self, source: str, counts: Mapping[str, int]) -> None:
        last = self._last.setdefault(source, {})
        for name, value in counts.items():
            if value < last.get(name, 0):
                self._banked[name] += last[name]
            last[name] = value

    def total(self, name: str) -> int:
        return self._banked[name] + sum(c.get(name, 0) for c in self._last.values())


def prediction_view(p: Prediction | RunPrediction) -> dict:
    """The planner's prediction for a placement as the coordinator publishes it (`/api/runs/RUN`
    "prediction"): what the dashboard shows and crucible-swarm prints."""
    return {
        "tokens_per_s": p.tokens_per_s,
        "effective_mfu": p.effective_mfu,
        "tax": p.tax,
        "usd_per_mtok": p.usd_per_mtok,
        "warnings": list(p.warnings),
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def sample(spec: RunSpec, placement: Placement, adverts: Mapping[str, NodeAdvert], cost: CostModel) -> Sample:
    """The run's figures now (nodes whose advert is missing or for another run count as not training)."""
    rid = spec.run_id
    mine = {
        slot: a
        for slot, peer in placement.slots.items()
        if (a := adverts.get(peer)) is not None
        and a.run_id == rid
        and a.replica == slot[0]
        and a.stage == slot[1]
    }
    replicas = sorted({r for r, _ in placement.slots})
    tps = 0.0
    losses, vals = [], []
    for r in replicas:
        stages = [mine.get((r, s)) for s in range(spec.stages_of(r))]
        if any(a is not None and a.state == "training" for a in stages):
            tps += max(a.tokens_per_s for a in stages if a is not None)
        last = stages[-1]
        if last is not None and last.loss is not None:
            losses.append(last.loss)
        if last is not None and last.val_bpb is not None:
            vals.append(last.val_bpb)
    try:
        hosts = [
            h
            for c in layout_classes(spec)
            for rep in placement_layout(c.local(placement), adverts, CostModel.from_spec(c.spec)).replicas
            for h in rep
        ]  # each replica as its own split places it (one class: the run's)
        fig = placed_figures(cost.shape, hosts, cost.settings, tps)
        mfu, tax, usd = fig.effective_mfu, fig.tax, fig.usd_per_mtok
    except ValueError:  # a placed node's advert is gone (churn): no peak to divide by this time
        mfu, tax, usd = 0.0, 1.0, None
    return Sample(
        t=time.time(),
        step=max((a.step for a in mine.values()), default=0),
        loss=_mean(losses),
        val_bpb=_mean(vals),
        tokens_per_s=tps,
        effective_mfu=mfu,
        tax=tax,
        usd_per_mtok=usd,
        bytes_pipe=sum(a.bytes_pipe for a in mine.values()),
        bytes_store=sum(a.bytes_store for a in mine.values()),
        nodes_training=sum(a.state == "training" for a in mine.values()),
        per_node=tuple((a.peer_id, a.bytes_pipe, a.bytes_store) for a in mine.values()),
    )


class History:
    """Recent samples per run, bounded; thread-safe (the tick writes, the dashboard's thread reads)."""

    def __init__(self, maxlen: int = HISTORY_SAMPLES, every_s: float = SAMPLE_EVERY_S) -> None:
        self._lock = threading.Lock()
        self._runs: dict[str, deque[Sample]] = {}
        self._bytes: dict[str, CumulativeCounters] = {}
        self.maxlen, self.every_s = maxlen, every_s

    def add(self, run_id: str, s: Sample) -> None:
        """Keep `s`, its bytes made cumulative over the run's nodes (module docstring)."""
        with self._lock:
            if s.per_node:
                c = self._bytes.setdefault(run_id, CumulativeCounters())
                for peer, pipe, store in s.per_node:
                    c.observe(peer, {"pipe": pipe, "store": store})
                s = replace(s, bytes_pipe=c.total("pipe"), bytes_store=c.total("store"))
            q = self._runs.setdefault(run_id, deque(maxlen=self.maxlen))
            if q and s.t - q[-1].t < self.every_s:
                q[-1] = s  # the newest figures, at most one sample per every_s
            else:
                q.append(s)

    def samples(self, run_id: str, since: float = 0.0) -> list[Sample]:
        with self._lock:
            return [s for s in self._runs.get(run_id, ()) if s.t > since]

    def latest(self, run_id: str) -> Sample | None:
        with self._lock:
            q = self._runs.get(run_id)
            return q[-1] if q else None


__all__ = ["HISTORY_SAMPLES", "CumulativeCounters", "History", "Sample", "prediction_view", "sample"]

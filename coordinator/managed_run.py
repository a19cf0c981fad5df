"""A run this coordinator leads: what it placed, signed and saw (`ManagedRun`); and which nodes are free to
place, those of no run it leads."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from coordinator.lease import HeldLease
from coordinator.placement import CostModel, Placement
from protocol.messages import Assignment, NodeAdvert, RunRecord
from protocol.net.store import StoreUnavailable

ACTIVE = ("pending", "running", "stopping")
"""The states of a run that its coordinator still leads (holds the lease of, places, watches)."""


MAX_EVENTS = 200
"""Faults and recoveries a run keeps for the dashboard."""


@dataclass
class ManagedRun:
    record: RunRecord
    lease: HeldLease
    placement: Placement | None = None
    assignments: dict[str, Assignment] = field(default_factory=dict)
    epoch: int = 0
    missing_since: dict[str, float] = field(default_factory=dict)
    former: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    """(replica, stage) -> nodes that served the slot before churn replaced them, oldest first."""
    failures: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    """peer -> (epoch, reason) of each assignment of this run it reported failed, or was lost in."""
    failed_at: dict[str, list[float]] = field(default_factory=dict)
    """peer -> when (monotonic) each of those failures was noted (`RunWatch` counts the recent ones)."""
    prediction: dict | None = None
    """The planner's prediction for the placement (tokens/s, MFU, tax, $/Mtok), for the dashboard."""
    cost: CostModel | None = None
    """The cost model of `record.spec` (cached: the spec changes only when the split or k is fixed)."""
    final_sample: bool = False
    """Whether the dashboard's history took its sample of the ended run."""
    dropped: set[int] = field(default_factory=set)
    """Replicas that dropped out (lost a node, none free to rebuild): no longer in the survivors'
    stage_peers, so their rounds stop waiting out the deadline for them."""
    hopeless: set[int] = field(default_factory=set)
    """Replicas dropped because a node failed again soon after its rebuild (until one is rebuilt): the
    run fails when every replica is out so; a replica out for a node that vanished waits for nodes."""
    rejoin_at: dict[int, float] = field(default_factory=dict)
    """Dropped replica -> when (monotonic) the coordinator next tries to place it again (`RunWatch`)."""
    rejoins: dict[int, int] = field(default_factory=dict)
    """Replica -> its rejoins since it last trained a whole backoff through: each doubles the next wait."""
    rejoined_at: dict[int, float] = field(default_factory=dict)
    events: list[tuple[float, str, str]] = field(default_factory=list)
    """(unix time, "fault" | "recovery", what) of the last MAX_EVENTS: a node failed or went, a replica
    dropped out; a replica rebuilt or placed again. The dashboard marks them on its time axis."""
    rebuild_note: str = ""
    """Why the last rebuild could not be made: logged once per change, not on every tick."""

    def note_event(self, kind: str, what: str) -> None:
        self.events = [*self.events, (time.time(), kind, what)][-MAX_EVENTS:]

    def dropped_out(self) -> set[int]:
        """Replicas out of the run: told to the survivors (`dropped`), or lost with no node to rebuild them
        (not told when the survivors had finished, but out all the same)."""
        if self.placement is None:
            return set()
        lost = {p for p, t in self.missing_since.items() if t == -1.0}
        return self.dropped | {r for (r, _), p in self.placement.slots.items() if p in lost}


class RunFaults:
    """Isolates the runs of one tick: an exception raised while handling one run is counted (`run_failures`
    in `events`) and logged once per run and cause, and the tick goes on with the other runs; so one run's
    poison (a store object, a record, a bug its state reaches) never stops another run's failover."""

    MAX_REMEMBERED = 1024
    """Causes remembered for logging once (then forgotten, and logged again)."""

    def __init__(self, events: Counter[str], logger: logging.Logger) -> None:
        self.events, self.logger = events, logger
        self.seen: set[tuple[str, str, str]] = set()

    @contextmanager
    def guard(self, run_id: str, doing: str) -> Iterator[None]:
        """Run the block for `run_id`; an exception it raises is noted, not raised."""
        try:
            yield
        except Exception as e:  # whatever it is, it is this run's alone
            self.events["run_failures"] += 1
            cause = (run_id, doing, f"{type(e).__name__}: {e}"[:300])
            if cause in self.seen:
                self.logger.debug("run %s: %s failed again: %s", run_id, doing, cause[2])
                return
            if len(self.seen) >= self.MAX_REMEMBERED:
                self.seen.clear()
            self.seen.add(cause)
            if isinstance(e, StoreUnavailable):  # a store outage: no bug to trace, the next tick retries
                self.logger.warning("run %s: %s failed, retrying: %s", run_id, doing, cause[2])
                return
            self.logger.error(
                "run %s: %s failed (the other runs go on; logged once per cause): %s",
                run_id,
                doing,
                cause[2],
                exc_info=True,
            )


def busy_peers(runs: Iterable[ManagedRun]) -> set[str]:
    """The nodes placed in an active run of `runs`."""
    return {
        p
        for run in runs
        if run.record.state in ACTIVE and run.placement
        for p in run.placement.slots.values()
    }


def free_nodes(adverts: dict[str, NodeAdvert], runs: Iterable[ManagedRun]) -> list[NodeAdvert]:
    """The nodes a placement may take: placed in no active run of `runs`, and advertising idle, done or
    failed (at work on no run)."""
    busy = busy_peers(runs)
    return [a for a in adverts.values() if a.peer_id not in busy and a.state in ("idle", "done", "failed")]


__all__ = ["ACTIVE", "ManagedRun", "RunFaults", "busy_peers", "free_nodes"]

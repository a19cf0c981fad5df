"""Where a run's nodes come from: a launched run placed on free nodes (`place`), a run taken over adopted
from its assignment archive (`adopt`), a replica that lost a node rebuilt with free ones (`rebuild`). The
planner's prediction for what was placed is logged, and kept for the dashboard."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

from coordinator.managed_run import ManagedRun, free_nodes
from coordinator.placement import (
    CostModel,
    Placement,
    PlacementError,
    choose_boundary_k,
    choose_layer_split,
)
from coordinator.plan.layout_classes import place_run, predict_run, repair_run
from coordinator.run_figures import prediction_view
from coordinator.run_publisher import RunPublisher
from protocol.checkpoint import list_rounds
from protocol.messages import Assignment, NodeAdvert
from protocol.net.store import ObjectStore, StoreError
from protocol.trust.assignment_archive import read_archive
from protocol.trust.delegation import OperatorTrust

log = logging.getLogger("coordinator.service")  # the coordinator's lines, under the one name they had


def former_of(archived: list[Assignment], *, include_holders: bool) -> dict[tuple[int, int], list[str]]:
    """(replica, stage) -> nodes that served the slot, from archived assignments (and, for a relaunch,
    the archived holders themselves: the checkpoints to resume from are theirs)."""
    former: dict[tuple[int, int], list[str]] = {}
    for a in archived:
        for r, peers in a.former_stage_peers.items():
            slot = former.setdefault((int(r), a.stage), [])
            slot.extend(p for p in peers if p not in slot)
        if include_holders and a.peer_id not in former.setdefault((a.replica, a.stage), []):
            former[(a.replica, a.stage)].append(a.peer_id)
    return former


class RunPlacer:
    """Places the runs in `runs` (the coordinator's own dict: a node placed in one is not free for
    another), reading archives and checkpoints from `store` (signed as `trust` says), assigning through
    `publisher`; counts `placements` and `rebuilds` in `events`."""

    def __init__(
        self,
        store: ObjectStore,
        trust: OperatorTrust,
        runs: dict[str, ManagedRun],
        publisher: RunPublisher,
        events: Counter[str],
    ) -> None:
        self.store, self.trust, self.runs = store, trust, runs
        self.publisher, self.events = publisher, events

    def _archived(self, run: ManagedRun) -> list[Assignment] | None:
        return read_archive(self.store, run.record.spec, self.trust)

    def adopt(self, run: ManagedRun) -> None:
        """Take over a placed run: its placement, assignments and epoch from the newest assignment archive.
        The nodes keep training; our next assignments carry our higher term. An unreadable archive leaves
        the run unplaced, and the next tick places it afresh."""
        mine = self._archived(run)
        if mine is None:
            log.warning(
                "run %s: taken over with no readable assignment archive; placing it afresh",
                run.record.spec.run_id,
            )
            return
        run.placement = Placement({(a.replica, a.stage): a.peer_id for a in mine})
        run.epoch = max(a.epoch for a in mine)
        # replicas that dropped out: placed, but left out of the stage_peers of the newest assignments
        newest = [a for a in mine if a.epoch == run.epoch]
        listed = {int(r) for a in newest for r in a.stage_peers}
        listed |= {int(r) for a in newest for by in a.group_peers.values() for r in by}
        run.dropped = {r for r, _ in run.placement.slots} - listed
        run.former = former_of(mine, include_holders=False)
        log.info(
            "run %s: adopted the placement of term %d epoch %d (%d nodes%s)",
            run.record.spec.run_id,
            max(a.term for a in mine),
            run.epoch,
            len(mine),
            f"; replicas {sorted(run.dropped)} dropped out" if run.dropped else "",
        )
        self.publisher.reissue(run, mine)

    def place(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        spec = run.record.spec
        free = free_nodes(adverts, self.runs.values())
        try:
            run.placement = place_run(free, spec)  # by layout class where the replicas' splits differ
        except PlacementError as e:  # pending, saying why (nodes may join later: then it starts)
            self.publisher.set_reason(run, f"waiting for nodes: {e}; it starts when enough join")
            return
        run.epoch += 1
        # a relaunched run (stopped, or the whole swarm restarted) resumes from its checkpoints
        try:
            resume = set(range(spec.replicas)) if list_rounds(self.store, spec.run_id) else None
        except StoreError as e:
            log.warning("run %s: cannot list checkpoints (%s); starting from step 0", spec.run_id, e)
            resume = None
        if spec.layer_split_auto:
            self._fix_layer_split(run, adverts, resume is not None)
        if spec.pipeline.link_k_auto:
            self._fix_link_k(run, adverts, resume is not None)
        if resume:
            log.info(
                "run %s: checkpoints found in the store; every replica resumes from its latest", spec.run_id
            )
            # the nodes that wrote them may be others: the new ones must trust their signatures
            run.former = former_of(self._archived(run) or [], include_holders=True)
        self.publisher.assign(run, adverts, set(run.placement.slots), resume_replicas=resume)
        self.publisher.set_state(run, "running")
        self.events["placements"] += 1
        self.log_prediction(run, adverts)

    def log_prediction(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        """The planner's prediction for what was placed (one cost model: the one placement scored with),
        and its warnings: a replica whose store bandwidth cannot move its fragments within the overlap
        window, a link slower than its k needs, memory."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        try:
            p = predict_run(spec, pl, adverts)
        except (ValueError, KeyError) as e:  # an advert gone since placement: nothing to predict from
            log.info("run %s: no prediction: %s", spec.run_id, e)
            return
        run.prediction = prediction_view(p)
        log.info(
            "run %s: predicted %.0f tokens/s, MFU %.1f%%, $%.4f/Mtok",
            spec.run_id,
            p.tokens_per_s,
            100 * p.effective_mfu,
            p.usd_per_mtok,
        )
        for w in p.warnings:
            log.warning("run %s: %s", spec.run_id, w)

    def _fix_layer_split(self, run: ManagedRun, adverts: dict[str, NodeAdvert], resumed: bool) -> None:
        """layer_split_auto: split the layers once, by the placed nodes' speed and memory (a resumed run
        keeps the split its checkpoints hold); the run's spec then carries it."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        archived = self._archived(run) if resumed else None
        if archived:
            split = list(archived[0].spec.layer_split) or [b - a for a, b in archived[0].spec.layer_ranges()]
            why = "as its checkpoints hold"
        else:
            split = list(choose_layer_split(pl, adverts, CostModel.from_spec(spec)))
            why = "from the placed nodes' measured speed and memory"
        run.record = replace(run.record, spec=replace(spec, layer_split=split, layer_split_auto=False))
        log.info("run %s: layers per stage %s, %s", spec.run_id, split, why)

    def _fix_link_k(self, run: ManagedRun, adverts: dict[str, NodeAdvert], resumed: bool) -> None:
        """link_k_auto: choose each boundary's k once, from the links of the nodes just placed (a resumed
        run keeps the k its checkpoints were trained with); the run's spec then carries it."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        archived = self._archived(run) if resumed else None
        if archived:
            k = list(archived[0].spec.pipeline.link_k)
            why = "as its checkpoints were trained"
        else:
            k = [
                min(x, spec.model.d_model) for x in choose_boundary_k(pl, adverts, CostModel.from_spec(spec))
            ]
            why = "from the measured links of the nodes placed"
        pipeline = replace(spec.pipeline, link_k=k, link_k_auto=False)
        run.record = replace(run.record, spec=replace(spec, pipeline=pipeline))
        log.info("run %s: link k per boundary %s, %s", spec.run_id, k, why)

    def rebuild(
        self,
        run: ManagedRun,
        adverts: dict[str, NodeAdvert],
        gone: set[str],
        broken: set[int],
        reusable: set[str] = frozenset(),  # type: ignore[assignment]
    ) -> bool:
        """Re-place the `broken` replicas' holes (the nodes `gone`, or failed) with free nodes; they resume
        from the latest consensus checkpoint, the others only learn the new epoch. `reusable`: nodes of the
        holes that may fill them again (a dropped replica's own, healthy again). False (the reason logged
        once per change) when no free nodes fit."""
        pl = run.placement
        assert pl is not None
        free = free_nodes(adverts, self.runs.values()) + [
            adverts[p] for p in sorted(reusable) if p in adverts
        ]
        alive = {p for p in pl.slots.values() if p not in gone}
        try:
            new_pl, holes = repair_run(run.record.spec, pl, alive, free, adverts)
        except PlacementError as e:
            note = f"cannot rebuild replicas {sorted(broken)} yet: {e}"
            if note != run.rebuild_note:  # once per change (the tick retries every second)
                log.info("run %s: %s", run.record.spec.run_id, note)
                run.rebuild_note = note
            return False
        run.rebuild_note = ""
        for slot, peer in pl.slots.items():  # the nodes replaced stay signers of the rounds they signed
            if new_pl.slots.get(slot) != peer and peer not in run.former.setdefault(slot, []):
                run.former[slot].append(peer)
        run.placement = new_pl
        run.epoch += 1
        run.missing_since.clear()
        self.events["rebuilds"] += 1
        rebuilt = broken | {r for r, _ in holes}
        run.dropped -= rebuilt  # a replica that dropped out and now has nodes again counts again
        run.hopeless -= rebuilt
        run.note_event("recovery", f"replica(s) {sorted(rebuilt)} rebuilt (epoch {run.epoch})")
        log.info(
            "run %s: rebuilding replica(s) %s (epoch %d), resuming from the latest consensus checkpoint",
            run.record.spec.run_id,
            sorted(rebuilt),
            run.epoch,
        )
        run.assignments = {p: a for p, a in run.assignments.items() if p in new_pl.slots.values()}
        # a replica still dropped out keeps its old assignments: issued its slots again at this epoch, its
        # nodes (idle once left out) would start them afresh, training where nobody counts them
        going_on = {slot for slot in new_pl.slots if slot[0] not in run.dropped}
        self.publisher.assign(run, adverts, going_on, resume_replicas=rebuilt)
        return True


__all__ = ["RunPlacer", "former_of"]

"""What a coordinator says about the runs it leads, signed: each run's record (its state and why) in the DHT
and the store, and its nodes' assignments, archived in the store (a successor adopts them from there) and
published under each node's DHT key."""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import replace

from coordinator.managed_run import ACTIVE, ManagedRun, RunFaults
from protocol import keys
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import MAX_FORMER_PEERS, MAX_TEXT, Assignment, Endpoint, NodeAdvert
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreError
from protocol.trust.assignment_archive import encode_archive

log = logging.getLogger("coordinator.service")  # the coordinator's lines, under the one name they had


class RunPublisher:
    """Signs with `identity` (carrying `certificate`) and publishes every run in `runs`, the coordinator's
    own dict of the runs it leads."""

    def __init__(
        self,
        identity: Identity,
        dht: DHTClient,
        store: ObjectStore,
        runs: dict[str, ManagedRun],
        *,
        record_ttl_s: float,
        certificate: bytes,
        faults: RunFaults | None = None,
    ) -> None:
        """faults: isolates each run's publishing (the coordinator's; default: what one raises is raised)."""
        self.identity, self.dht, self.store, self.runs = identity, dht, store, runs
        self.record_ttl_s, self.certificate, self.faults = record_ttl_s, certificate, faults
        self._last_publish = 0.0

    def publish(self, *, force: bool) -> None:
        """Every run's record and, while it is active, its assignments (the DHT records expire: refreshed
        every record_ttl_s / 4, or at once when `force`)."""
        if not force and time.monotonic() - self._last_publish < self.record_ttl_s / 4:
            return
        self._last_publish = time.monotonic()
        for rid, run in self.runs.items():
            with self.faults.guard(rid, "publishing") if self.faults else nullcontext():
                self.dht.publish(keys.RUNS_KEY, run.record, self.record_ttl_s, signer=self.identity, name=rid)
                if run.record.state in ACTIVE:
                    for peer, a in run.assignments.items():
                        self.dht.publish(
                            keys.assignment_key(peer), a, self.record_ttl_s, signer=self.identity
                        )

    def set_state(self, run: ManagedRun, state: str, reason: str = "") -> None:
        log.info(
            "run %s: %s -> %s%s",
            run.record.spec.run_id,
            run.record.state,
            state,
            f" ({reason})" if reason else "",
        )
        run.record = replace(
            run.record,
            state=state,  # type: ignore[arg-type]
            updated=dht_time(),
            reason=reason[:MAX_TEXT],
        )
        try:  # the store's copy outlives the DHT record: `launch` and `stop` read it (a finished run)
            self.store.put(keys.spec_key(run.record.spec.run_id), seal(self.identity, run.record))
        except StoreError as e:
            log.warning("run %s: could not write its record to the store: %s", run.record.spec.run_id, e)
        self.publish(force=True)

    def set_reason(self, run: ManagedRun, reason: str) -> None:
        """Say why the run is as it is (waiting for nodes, a replica dropped out) in its record, so
        `status` and the dashboard show it; logged and published when it changes."""
        reason = reason[:MAX_TEXT]
        if reason == run.record.reason:
            return
        if reason:
            log.info("run %s (%s): %s", run.record.spec.run_id, run.record.state, reason)
        run.record = replace(run.record, updated=dht_time(), reason=reason)
        self.publish(force=True)

    def assign(
        self,
        run: ManagedRun,
        adverts: dict[str, NodeAdvert],
        slots: set[tuple[int, int]],
        resume_replicas: set[int] | None = None,
    ) -> None:
        """Sign and publish assignments for `slots`; replicas in resume_replicas restart from the latest
        consensus checkpoint (start_step -1), the others keep their start step."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        live = [rr for rr in range(spec.replicas) if rr not in run.dropped]

        def ep(r: int, s: int) -> Endpoint | None:
            if not 0 <= s < spec.stages_of(r):
                return None
            return adverts[pl.peer(r, s)].endpoint

        def former(rr: int, s: int) -> list[str]:
            return run.former.get((rr, s), [])[-MAX_FORMER_PEERS:]

        old_start = {(a.replica, a.stage): a.start_step for a in run.assignments.values()}
        for r, s in sorted(slots):
            peer = pl.peer(r, s)
            ranges = spec.layer_ranges(r)
            same = [rr for rr in live if spec.layer_ranges(rr) == ranges]  # this stage's layers in theirs
            groups = spec.groups_of(r, s) if spec.mixed_layout else []
            a = Assignment(
                run_id=spec.run_id,
                term=run.lease.lease.term,
                epoch=run.epoch,
                peer_id=peer,
                replica=r,
                stage=s,
                layers=list(ranges[s]),
                prev=ep(r, s - 1),
                next=ep(r, s + 1),
                spec=spec,
                stage_peers={str(rr): pl.peer(rr, s) for rr in same},
                start_step=-1 if r in (resume_replicas or ()) else old_start.get((r, s), 0),
                issued_at=dht_time(),
                former_stage_peers={
                    str(rr): former(rr, s)
                    for rr in range(spec.replicas)
                    if former(rr, s) and spec.layer_ranges(rr) == ranges
                },
                certificate=self.certificate,
                # replicas of other splits: each layer group's signer is whoever holds it there
                group_peers={
                    str(g): {str(rr): pl.peer(rr, spec.stage_of_group(rr, g)) for rr in live} for g in groups
                },
                former_group_peers={
                    str(g): {
                        str(rr): f
                        for rr in range(spec.replicas)
                        if (f := former(rr, spec.stage_of_group(rr, g)))
                    }
                    for g in groups
                },
            )
            run.assignments[peer] = a
        self.archive_and_publish(run)
        log.info(
            "run %s: assigned %d nodes (term %d, epoch %d)",
            spec.run_id,
            len(slots),
            run.lease.lease.term,
            run.epoch,
        )

    def reissue(self, run: ManagedRun, archived: list[Assignment]) -> None:
        """The assignments a deposed leader archived, re-issued at once under our term, signed by us: the
        nodes (training on) now hold our term, so whatever the deposed leader still signs at its lower term
        is stale to them."""
        term = run.lease.lease.term
        run.assignments = {
            a.peer_id: replace(a, term=term, issued_at=dht_time(), certificate=self.certificate)
            for a in archived
        }
        self.archive_and_publish(run)

    def archive_and_publish(self, run: ManagedRun) -> None:
        """Archive the run's assignments in the store (a successor adopts them from there), then publish
        each under its node's DHT key."""
        spec = run.record.spec
        blob = encode_archive(self.identity, list(run.assignments.values()))
        try:
            self.store.put(keys.assign_key(spec.run_id, run.lease.lease.term, run.epoch), blob)
            self.store.put(keys.spec_key(spec.run_id), seal(self.identity, run.record))
        except StoreError as e:
            log.warning("run %s: could not archive assignments in the store: %s", spec.run_id, e)
        for peer, a in run.assignments.items():
            self.dht.publish(keys.assignment_key(peer), a, self.record_ttl_s, signer=self.identity)


__all__ = ["RunPublisher"]

"""The coordinator daemon: takes launched runs' leases, places nodes, signs and publishes assignments,
watches progress, and finishes or stops runs. Lightweight: all state it needs is in the DHT and the store,
so another eligible coordinator can take over a run when the lease expires (with a higher term).

The coordinator holds the lease of each run it leads and the tick that drives them; what it signs and
publishes is `RunPublisher`'s (coordinator/run_publisher.py), where the nodes come from `RunPlacer`'s
(coordinator/run_placer.py), what their adverts say about a placed run `RunWatch`'s
(coordinator/run_watch.py); the runs themselves are `ManagedRun`s (coordinator/managed_run.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import replace

from coordinator.grant_issuer import GrantIssuer
from coordinator.lease import launch as launch  # where it lived: callers (tests) import it from here
from coordinator.lease import renew, try_acquire
from coordinator.managed_run import ACTIVE, ManagedRun, RunFaults, busy_peers
from coordinator.placement import CostModel
from coordinator.run_figures import History, sample
from coordinator.run_placer import RunPlacer
from coordinator.run_publisher import RunPublisher
from coordinator.run_views import node_view, run_view
from coordinator.run_watch import RunWatch
from protocol import keys
from protocol.identity import Identity
from protocol.messages import NodeAdvert, RunControl, RunRecord
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreError
from protocol.schema import ProtocolError
from protocol.trust.delegation import OperatorTrust, RefusalLog, Untrusted

log = logging.getLogger(__name__)


class Coordinator:
    def __init__(
        self,
        identity: Identity,
        dht: DHTClient,
        store: ObjectStore,
        *,
        lease_s: float = 15.0,
        record_ttl_s: float = 60.0,
        tick_s: float = 1.0,
        churn_grace_s: float = 10.0,
        certificate: bytes = b"",
        trust: OperatorTrust | None = None,
    ) -> None:
        """identity: the key this coordinator signs with: the operator's own, or a key the operator
        certified (`certificate`, carried in everything it signs). trust: the operator's trust rule, for
        what others signed (default: `identity` is the operator's key)."""
        self.identity, self.dht, self.store = identity, dht, store
        self.certificate = certificate
        self.trust = trust or OperatorTrust.of({identity.public_key})
        self.refusals = RefusalLog(log)
        self.ignored = RefusalLog(log)
        """Objects under a run's {run}/terms/ and {run}/assign/ that do not count for its term, by reason
        (coordinator/lease.py::highest_term; /metrics source "store_key")."""
        self.lease_s, self.record_ttl_s, self.tick_s, self.churn_grace_s = (
            lease_s,
            record_ttl_s,
            tick_s,
            churn_grace_s,
        )
        self.runs: dict[str, ManagedRun] = {}
        """The runs this coordinator leads (the one dict its publisher, placer and watch share)."""
        self.stop_event = threading.Event()
        self.dashboard_url = ""
        """Where this coordinator's dashboard answers (set by `serve`); named in the records it signs."""
        self.history = History()
        self.events: Counter[str] = Counter()
        """What this coordinator did: ticks, tick_failures, run_failures (what one run's handling raised),
        leases_taken, leases_lost, placements, rebuilds."""
        self.faults = RunFaults(self.events, log)
        self.view: dict = {"updated": 0.0, "coordinator": identity.peer_id, "runs": {}, "nodes": {}}
        """A JSON-ready snapshot made at the end of each tick (the dashboard's thread reads only this and
        `history`, never the tick's own state)."""
        self.publisher = RunPublisher(
            identity,
            dht,
            store,
            self.runs,
            record_ttl_s=record_ttl_s,
            certificate=certificate,
            faults=self.faults,
        )
        self.placer = RunPlacer(store, self.trust, self.runs, self.publisher, self.events)
        self.watch = RunWatch(self.placer, self.publisher, churn_grace_s=churn_grace_s)
        self.grants = GrantIssuer(identity, store, certificate=certificate)
        """Write grants for the placed nodes that write through them (coordinator/grant_issuer.py)."""

    # --- views --------------------------------------------------------------------------------------
    def adverts(self) -> dict[str, NodeAdvert]:
        out = {}
        for peer, signed in self.dht.get_all(keys.NODES_KEY, NodeAdvert).items():
            if signed.signer_id == signed.body.peer_id == peer:  # a node may only advertise itself
                out[peer] = signed.body
        return out

    def busy_peers(self) -> set[str]:
        return busy_peers(self.runs.values())

    # --- lifecycle ----------------------------------------------------------------------------------
    def tick(self) -> None:
        """One pass over every run: take the leases of active runs led nowhere, then lead ours (renew, act
        on a stop, place, watch), publish, and snapshot. Each run is handled inside `faults.guard`: what
        one run raises is counted and logged, and the other runs are handled all the same."""
        records: dict[str, RunRecord] = {}
        found = self.dht.get_all(keys.RUNS_KEY, RunRecord).values()
        for signed in self.trust.filter(found, self.refusals):
            rec = signed.body
            if rec.spec.run_id not in records or rec.updated > records[rec.spec.run_id].updated:
                records[rec.spec.run_id] = rec
        for rid, rec in records.items():
            if rid not in self.runs and rec.state in ACTIVE:
                with self.faults.guard(rid, "taking the lease"):
                    self._take(rid, rec)
        adverts, read_at = self.adverts(), dht_time()
        for rid, run in list(self.runs.items()):
            if run.record.state in ACTIVE:
                with self.faults.guard(rid, "leading the run"):
                    self._lead(rid, run, adverts, read_at)
        self.publisher.publish(force=False)
        self._observe(records, adverts)

    def _take(self, rid: str, rec: RunRecord) -> None:
        """Take the run's lease if nobody holds a live one (and we may sign for it); adopt a placed run."""
        if not self.may_sign_for(rid):
            return
        held = try_acquire(
            self.store,
            self.identity,
            rid,
            self.lease_s,
            trusted=self.trust,
            certificate=self.certificate,
            ignored=self.ignored,
        )
        if held:
            log.info("run %s: took the lease (term %d)", rid, held.lease.term)
            self.events["leases_taken"] += 1
            self.runs[rid] = run = ManagedRun(
                record=replace(
                    rec,
                    term=held.lease.term,
                    coordinator=self.identity.peer_id,
                    certificate=self.certificate,
                    dashboard=self.dashboard_url,
                ),
                lease=held,
            )
            if rec.state != "pending":  # a takeover: carry on from what the last holder archived
                self.placer.adopt(run)
                run.note_event(
                    "recovery",
                    f"coordinator {self.identity.peer_id[-8:]} took the run over (term {held.lease.term})",
                )

    def _lead(self, rid: str, run: ManagedRun, adverts: dict[str, NodeAdvert], read_at: float) -> None:
        """Renew the lease of a run we lead (or let it go), act on a stop request, place or watch it."""
        if not self.may_sign_for(rid):  # our certificate expired: nothing we sign counts any more
            log.error("run %s: letting the lease go: this coordinator may no longer sign for it", rid)
            del self.runs[rid]
            return
        held = renew(self.store, self.identity, run.lease, self.lease_s)
        if held is None:
            log.warning("run %s: lost the lease to another coordinator; letting go", rid)
            self.events["leases_lost"] += 1
            del self.runs[rid]
            return
        run.lease = held
        self._check_control(run)
        # (running but unplaced: a taken-over run whose archive could not be read: re-placed)
        if run.record.state == "pending" or (run.record.state == "running" and run.placement is None):
            self.placer.place(run, adverts)
        elif run.record.state == "running":
            self.watch.watch(run, adverts, read_at)
        if run.record.state == "running":
            self.grants.issue(run, adverts)
        elif run.record.state == "stopping":
            self.watch.watch_stop(run, adverts)

    # --- what the dashboard and /metrics show ---------------------------------------------------------
    def cost_of(self, run: ManagedRun) -> CostModel:
        if run.cost is None or run.cost.layers != tuple(b - a for a, b in run.record.spec.layer_ranges()):
            run.cost = CostModel.from_spec(run.record.spec)
        return run.cost

    def _observe(self, records: dict[str, RunRecord], adverts: dict[str, NodeAdvert]) -> None:
        """Sample the runs this coordinator leads, then swap in a new snapshot for the dashboard."""
        for rid, run in self.runs.items():
            live = run.record.state in ("running", "stopping")
            if run.placement is not None and (live or not run.final_sample):
                run.final_sample = not live  # one more sample once it ended: the nodes' last figures
                with self.faults.guard(rid, "sampling its figures"):
                    try:
                        self.history.add(
                            rid, sample(run.record.spec, run.placement, adverts, self.cost_of(run))
                        )
                    except ValueError as e:  # a spec the planner cannot model: no figures, the run goes on
                        log.debug("run %s: no figures: %s", rid, e)
        runs = {}
        for rid, rec in records.items():
            with self.faults.guard(rid, "showing it"):
                runs[rid] = run_view(rec, None, adverts, self.history)
        for rid, run in self.runs.items():  # ours: the newest record (we sign it) and the placement
            with self.faults.guard(rid, "showing it"):
                runs[rid] = run_view(run.record, run, adverts, self.history)
        self.view = {
            "updated": time.time(),
            "coordinator": self.identity.peer_id,
            "runs": runs,
            "nodes": {p: node_view(a) for p, a in sorted(adverts.items())},
        }

    def may_sign_for(self, run_id: str) -> bool:
        """Whether what we sign for `run_id` is trusted now (the same rule the nodes apply to it); when not,
        the reason is logged once."""
        try:
            self.trust.delegation(self.identity.public_key, self.certificate, run_id, time.time())
        except Untrusted as e:
            if self.refusals.first(f"serving {run_id}", e.reason):
                log.error(
                    "run %s: not serving it: what this coordinator would sign is refused: %s", run_id, e
                )
            return False
        return True

    def _check_control(self, run: ManagedRun) -> None:
        """Act on the run's control object (a stop request) if a trusted key signed it. Anyone with store
        credentials can write there: an unsigned, forged, oversized or unreadable object is logged and
        ignored, and the run goes on."""
        try:
            data = self.store.get(keys.control_key(run.record.spec.run_id), max_bytes=64 * 1024)
        except StoreError as e:  # ObjectTooLarge included: never downloaded
            log.warning("run %s: ignoring control object: %s", run.record.spec.run_id, e)
            return
        if data is None or run.record.state == "stopping":
            return
        try:
            ctl = self.trust.open(data, RunControl).body
        except (ProtocolError, ValueError) as e:  # ValueError: a bad signature (SignatureError)
            log.warning("run %s: ignoring control object: %s", run.record.spec.run_id, e)
            return
        if ctl.action == "stop":
            self.publisher.set_state(run, "stopping" if run.placement else "stopped")

    def _publish(self, *, force: bool) -> None:
        """Publish the records and assignments of the runs led here now (`force`) or when due."""
        self.publisher.publish(force=force)

    def _log_prediction(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        """What placing `run` predicts (`RunPlacer.log_prediction`), as the tick does once it placed it."""
        self.placer.log_prediction(run, adverts)

    def serve(self) -> None:
        while not self.stop_event.is_set():
            self.events["ticks"] += 1
            try:
                self.tick()
            except Exception as e:  # a flaky store or DHT must not take the coordinator down
                self.events["tick_failures"] += 1
                log.warning("coordinator tick failed (will retry): %s", e)
            self.stop_event.wait(self.tick_s)

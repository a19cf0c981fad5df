"""The coordinator daemon: takes launched runs' leases, places nodes, signs and publishes assignments,
watches progress, and finishes or stops runs. Lightweight: all state it needs is in the DHT and the store,
so another eligible coordinator can take over a run when the lease expires (with a higher term).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from coordinator.lease import HeldLease, renew, try_acquire
from coordinator.lease import launch as launch  # where it lived: callers (tests) import it from here
from coordinator.placement import (
    CostModel,
    Placement,
    PlacementError,
    choose_boundary_k,
    choose_layer_split,
    place,
    predict_placement,
    repair,
    stage_needs,
)
from coordinator.run_figures import History, prediction_view, sample
from coordinator.run_views import dropped_out_reason, node_view, run_view
from protocol import keys
from protocol.assignment_archive import encode_archive, read_archive
from protocol.checkpoint import list_rounds
from protocol.delegation import OperatorTrust, RefusalLog, Untrusted
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import (
    MAX_FORMER_PEERS,
    MAX_TEXT,
    Assignment,
    Endpoint,
    NodeAdvert,
    RunControl,
    RunRecord,
)
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreError
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)
ACTIVE = ("pending", "running", "stopping")
MAX_REBUILDS_AFTER_FAILURE = 1
"""A replica whose node reports failed is restarted this many times; then it drops out (a bad data path
fails the same way every time)."""


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
    prediction: dict | None = None
    """The planner's prediction for the placement (tokens/s, MFU, tax, $/Mtok), for the dashboard."""
    cost: CostModel | None = None
    """The cost model of `record.spec` (cached: the spec changes only when the split or k is fixed)."""
    final_sample: bool = False
    """Whether the dashboard's history took its sample of the ended run."""
    dropped: set[int] = field(default_factory=set)
    """Replicas that dropped out (lost a node, none free to rebuild): no longer in the survivors'
    stage_peers, so their rounds stop waiting out the deadline for them."""
    rebuild_note: str = ""
    """Why the last rebuild could not be made: logged once per change, not on every tick."""

    def dropped_out(self) -> set[int]:
        """Replicas out of the run: told to the survivors (`dropped`), or lost with no node to rebuild them
        (not told when the survivors had finished, but out all the same)."""
        if self.placement is None:
            return set()
        lost = {p for p, t in self.missing_since.items() if t == -1.0}
        return self.dropped | {r for (r, _), p in self.placement.slots.items() if p in lost}


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
        self.lease_s, self.record_ttl_s, self.tick_s, self.churn_grace_s = (
            lease_s,
            record_ttl_s,
            tick_s,
            churn_grace_s,
        )
        self.runs: dict[str, ManagedRun] = {}
        self.stop_event = threading.Event()
        self._last_publish = 0.0
        self.dashboard_url = ""
        """Where this coordinator's dashboard answers (set by `serve`); named in the records it signs."""
        self.history = History()
        self.events: Counter[str] = Counter()
        """What this coordinator did: ticks, tick_failures, leases_taken, leases_lost, placements, rebuilds."""
        self.view: dict = {"updated": 0.0, "coordinator": identity.peer_id, "runs": {}, "nodes": {}}
        """A JSON-ready snapshot made at the end of each tick (the dashboard's thread reads only this and
        `history`, never the tick's own state)."""

    # --- views --------------------------------------------------------------------------------------
    def adverts(self) -> dict[str, NodeAdvert]:
        out = {}
        for peer, signed in self.dht.get_all(keys.NODES_KEY, NodeAdvert).items():
            if signed.signer_id == signed.body.peer_id == peer:  # a node may only advertise itself
                out[peer] = signed.body
        return out

    def busy_peers(self) -> set[str]:
        return {
            p
            for run in self.runs.values()
            if run.record.state in ACTIVE and run.placement
            for p in run.placement.slots.values()
        }

    # --- lifecycle ----------------------------------------------------------------------------------
    def tick(self) -> None:
        records: dict[str, RunRecord] = {}
        found = self.dht.get_all(keys.RUNS_KEY, RunRecord).values()
        for signed in self.trust.filter(found, self.refusals):
            rec = signed.body
            if rec.spec.run_id not in records or rec.updated > records[rec.spec.run_id].updated:
                records[rec.spec.run_id] = rec
        for rid, rec in records.items():
            if rid not in self.runs and rec.state in ACTIVE and self.may_sign_for(rid):
                held = try_acquire(
                    self.store,
                    self.identity,
                    rid,
                    self.lease_s,
                    trusted=self.trust,
                    certificate=self.certificate,
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
                        self._adopt(run)
        adverts = self.adverts()
        for rid, run in list(self.runs.items()):
            if run.record.state not in ACTIVE:
                continue
            if not self.may_sign_for(rid):  # our certificate expired: nothing we sign counts any more
                log.error("run %s: letting the lease go: this coordinator may no longer sign for it", rid)
                del self.runs[rid]
                continue
            held = renew(self.store, self.identity, run.lease, self.lease_s)
            if held is None:
                log.warning("run %s: lost the lease to another coordinator; letting go", rid)
                self.events["leases_lost"] += 1
                del self.runs[rid]
                continue
            run.lease = held
            self._check_control(run)
            if run.record.state == "pending" or (run.record.state == "running" and run.placement is None):
                self._try_place(run, adverts)  # (a taken-over run whose archive could not be read: re-place)
            elif run.record.state == "running":
                self._watch(run, adverts)
            elif run.record.state == "stopping":
                self._watch_stop(run, adverts)
        self._publish(force=False)
        self._observe(records, adverts)

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
                try:
                    self.history.add(rid, sample(run.record.spec, run.placement, adverts, self.cost_of(run)))
                except ValueError as e:  # a spec the planner cannot model: no figures, the run goes on
                    log.debug("run %s: no figures: %s", rid, e)
        runs = {rid: run_view(rec, None, adverts, self.history) for rid, rec in records.items()}
        for rid, run in self.runs.items():  # ours: the newest record (we sign it) and the placement
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

    def _set_state(self, run: ManagedRun, state: str, reason: str = "") -> None:
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
        self._publish(force=True)

    def _set_reason(self, run: ManagedRun, reason: str) -> None:
        """Say why the run is as it is (waiting for nodes, a replica dropped out) in its record, so
        `status` and the dashboard show it; logged and published when it changes."""
        reason = reason[:MAX_TEXT]
        if reason == run.record.reason:
            return
        if reason:
            log.info("run %s (%s): %s", run.record.spec.run_id, run.record.state, reason)
        run.record = replace(run.record, updated=dht_time(), reason=reason)
        self._publish(force=True)

    def _archived(self, run: ManagedRun) -> list[Assignment] | None:
        return read_archive(self.store, run.record.spec, self.trust)

    @staticmethod
    def _former_of(archived: list[Assignment], *, include_holders: bool) -> dict[tuple[int, int], list[str]]:
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

    def _adopt(self, run: ManagedRun) -> None:
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
        listed = {int(r) for a in mine if a.epoch == run.epoch for r in a.stage_peers}
        run.dropped = {r for r, _ in run.placement.slots} - listed
        run.former = self._former_of(mine, include_holders=False)
        log.info(
            "run %s: adopted the placement of term %d epoch %d (%d nodes%s)",
            run.record.spec.run_id,
            max(a.term for a in mine),
            run.epoch,
            len(mine),
            f"; replicas {sorted(run.dropped)} dropped out" if run.dropped else "",
        )
        # re-issued at once under our term, signed by us: the nodes (training on) now hold our term, so
        # whatever the deposed leader still signs at its lower term is stale to them
        term = run.lease.lease.term
        run.assignments = {
            a.peer_id: replace(a, term=term, issued_at=dht_time(), certificate=self.certificate) for a in mine
        }
        self._archive_and_publish(run)

    def _archive_and_publish(self, run: ManagedRun) -> None:
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
            self._set_state(run, "stopping" if run.placement else "stopped")

    def _try_place(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        spec = run.record.spec
        busy = self.busy_peers()
        free = [
            a for a in adverts.values() if a.peer_id not in busy and a.state in ("idle", "done", "failed")
        ]
        try:
            run.placement = place(
                free, spec.replicas, spec.stages, need_bytes=stage_needs(spec), cost=CostModel.from_spec(spec)
            )
        except PlacementError as e:  # pending, saying why (nodes may join later: then it starts)
            self._set_reason(run, f"waiting for nodes: {e}; it starts when enough join")
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
            run.former = self._former_of(self._archived(run) or [], include_holders=True)
        self._assign(run, adverts, set(run.placement.slots), resume_replicas=resume)
        self._set_state(run, "running")
        self.events["placements"] += 1
        self._log_prediction(run, adverts)

    def _log_prediction(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        """The planner's prediction for what was placed (one cost model: the one placement scored with),
        and its warnings: a replica whose store bandwidth cannot move its fragments within the overlap
        window, a link slower than its k needs, memory."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        try:
            cost = CostModel.from_spec(spec)
            p = predict_placement(pl, adverts, cost)
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

    def _assign(
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
        ranges = spec.layer_ranges()

        def ep(r: int, s: int) -> Endpoint | None:
            if not 0 <= s < spec.stages:
                return None
            return adverts[pl.peer(r, s)].endpoint

        old_start = {(a.replica, a.stage): a.start_step for a in run.assignments.values()}
        for r, s in sorted(slots):
            peer = pl.peer(r, s)
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
                stage_peers={str(rr): pl.peer(rr, s) for rr in range(spec.replicas) if rr not in run.dropped},
                start_step=-1 if r in (resume_replicas or ()) else old_start.get((r, s), 0),
                issued_at=dht_time(),
                former_stage_peers={
                    str(rr): run.former[(rr, s)][-MAX_FORMER_PEERS:]
                    for rr in range(spec.replicas)
                    if run.former.get((rr, s))
                },
                certificate=self.certificate,
            )
            run.assignments[peer] = a
        self._archive_and_publish(run)
        log.info(
            "run %s: assigned %d nodes (term %d, epoch %d)",
            spec.run_id,
            len(slots),
            run.lease.lease.term,
            run.epoch,
        )

    def _watch(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        """Mark the run done when every slot is done or gone; rebuild replicas that lost a node.

        A slot is broken when its node's advert has been missing for churn_grace_s, or the node reports
        `failed` on the current epoch (e.g. its neighbour crashed and the link broke). A broken replica is
        rebuilt with free nodes (re-placing only its holes) and resumes from the latest consensus
        checkpoint; the other replicas keep training and only learn the new signer (no restart). Without
        free nodes the replica drops out and the others continue."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        now, dnow = time.monotonic(), dht_time()
        done, gone, failed, stale = 0, set(), set(), set()
        for peer in pl.slots.values():
            a = adverts.get(peer)
            if a is not None and dnow - a.timestamp > self.churn_grace_s:
                stale.add(peer)  # maybe dead: wait until it is gone before rebuilding around it
            # adverts refresh every 5 s; a DHT read may return a copy a few refreshes old, hence 2x grace
            if a is None or dnow - a.timestamp > 2 * self.churn_grace_s:
                gone.add(peer)
                continue
            if a.run_id == spec.run_id and a.epoch == run.epoch and a.state == "done":
                done += 1
            elif a.run_id == spec.run_id and a.epoch == run.epoch and a.state == "failed":
                # wait out the grace period: the failure may be a neighbour that is about to count as gone
                if peer not in run.missing_since:
                    log.warning(
                        "run %s: node %s failed: %s", spec.run_id, peer[-8:], a.error or "no reason given"
                    )
                    self._note_failure(run, peer, a.error or "no reason given")
                if now - run.missing_since.setdefault(peer, now) > self.churn_grace_s:
                    failed.add(peer)
        for peer in gone:
            self._note_failure(run, peer, "its node stopped advertising (process or host down)")
        stale_replicas = {r for (r, s), p in pl.slots.items() if p in stale}
        broken = {
            r for (r, s), p in pl.slots.items() if p in gone or (p in failed and r not in stale_replicas)
        }
        # a replica that failed again after one rebuild fails for a reason a rebuild does not fix (its
        # data path, its spec): it drops out instead of being restarted forever
        hopeless = {
            r
            for (r, s), p in pl.slots.items()
            if r in broken and p in failed and len(run.failures.get(p, [])) > MAX_REBUILDS_AFTER_FAILURE
        }
        for peer in {p for (r, s), p in pl.slots.items() if r in hopeless} & (gone | failed):
            run.missing_since[peer] = -1.0
        broken -= hopeless
        if broken and not self._rebuild(run, adverts, gone, broken):
            for peer in gone | failed:
                if run.missing_since.get(peer) != -1.0:
                    log.warning(
                        "run %s: node %s is lost and no free node can replace it; its replica drops "
                        "out, the others continue",
                        spec.run_id,
                        peer[-8:],
                    )
                run.missing_since[peer] = -1.0
        lost = {p for p, t in run.missing_since.items() if t == -1.0}
        self._drop_out(run, adverts, {r for (r, s), p in pl.slots.items() if p in lost})
        self._set_reason(run, self._dropped_summary(run))
        if done and done + len(lost & set(pl.slots.values())) >= len(pl.slots):
            self._set_state(run, "done", reason=self._dropped_summary(run))
        elif not done and {r for (r, s), p in pl.slots.items() if p in lost} >= {r for r, s in pl.slots}:
            self._set_state(run, "failed", reason=self._failure_summary(run))

    def _drop_out(self, run: ManagedRun, adverts: dict[str, NodeAdvert], dropped: set[int]) -> None:
        """Tell the surviving replicas' nodes that `dropped` replicas are gone (a new epoch whose
        stage_peers leave them out; the workers keep training): otherwise every later round of theirs
        waits sync.timeout_s for fragments that will never come. Skipped once a survivor is done (a new
        assignment would start its finished slot again) or while a survivor's advert is missing."""
        pl = run.placement
        assert pl is not None
        if dropped <= run.dropped:
            return
        survivors = {slot for slot in pl.slots if slot[0] not in dropped}
        ads = [adverts.get(pl.slots[slot]) for slot in survivors]
        if not survivors or any(a is None or a.state != "training" for a in ads):
            return
        run.dropped = set(dropped)
        run.epoch += 1
        log.info(
            "run %s: replica(s) %s dropped out; replicas %s go on without waiting for them (epoch %d)",
            run.record.spec.run_id,
            sorted(dropped),
            sorted({r for r, _ in survivors}),
            run.epoch,
        )
        self._assign(run, adverts, survivors)

    def _note_failure(self, run: ManagedRun, peer: str, reason: str) -> None:
        """Count a node's failure once per epoch (status and the run's reason quote it)."""
        seen = run.failures.setdefault(peer, [])
        if not seen or seen[-1][0] != run.epoch:
            seen.append((run.epoch, reason))

    @staticmethod
    def _dropped_summary(run: ManagedRun) -> str:
        """The replicas out of the run and why (the last reason each of their nodes gave); empty if none."""
        pl = run.placement
        why: dict[int, list[str]] = {}
        for r in sorted(run.dropped_out()):
            for s in range(run.record.spec.stages):
                peer = pl.slots.get((r, s)) if pl else None
                if peer and run.failures.get(peer):
                    why.setdefault(r, []).append(f"node {peer[-8:]}: {run.failures[peer][-1][1]}")
            why.setdefault(r, [])
        return dropped_out_reason({r: "; ".join(w) for r, w in why.items()})

    @staticmethod
    def _failure_summary(run: ManagedRun) -> str:
        """Every replica lost: the distinct reasons the nodes gave, the most frequent first."""
        counts: dict[str, int] = {}
        for seen in run.failures.values():
            for _, reason in seen:
                counts[reason] = counts.get(reason, 0) + 1
        ranked = sorted(counts, key=lambda r: -counts[r])
        return "every replica lost a node: " + "; ".join(ranked) if ranked else "every replica lost a node"

    def _rebuild(
        self, run: ManagedRun, adverts: dict[str, NodeAdvert], gone: set[str], broken: set[int]
    ) -> bool:
        pl = run.placement
        assert pl is not None
        busy = self.busy_peers()
        free = [
            a for a in adverts.values() if a.peer_id not in busy and a.state in ("idle", "done", "failed")
        ]
        alive = {p for p in pl.slots.values() if p not in gone}
        try:
            new_pl, holes = repair(
                pl,
                alive,
                free,
                need_bytes=stage_needs(run.record.spec),
                cost=CostModel.from_spec(run.record.spec),
                adverts=adverts,
            )
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
        log.info(
            "run %s: rebuilding replica(s) %s (epoch %d), resuming from the latest consensus checkpoint",
            run.record.spec.run_id,
            sorted(rebuilt),
            run.epoch,
        )
        run.assignments = {p: a for p, a in run.assignments.items() if p in new_pl.slots.values()}
        self._assign(run, adverts, set(new_pl.slots), resume_replicas=rebuilt)
        return True

    def _watch_stop(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        pl = run.placement
        if pl is None or all(
            (a := adverts.get(p)) is None or a.run_id != run.record.spec.run_id or a.state != "training"
            for p in pl.slots.values()
        ):
            self._set_state(run, "stopped")

    def _publish(self, *, force: bool) -> None:
        if not force and time.monotonic() - self._last_publish < self.record_ttl_s / 4:
            return
        self._last_publish = time.monotonic()
        for rid, run in self.runs.items():
            self.dht.publish(keys.RUNS_KEY, run.record, self.record_ttl_s, signer=self.identity, name=rid)
            if run.record.state in ACTIVE:
                for peer, a in run.assignments.items():
                    self.dht.publish(keys.assignment_key(peer), a, self.record_ttl_s, signer=self.identity)

    def serve(self) -> None:
        while not self.stop_event.is_set():
            self.events["ticks"] += 1
            try:
                self.tick()
            except Exception as e:  # a flaky store or DHT must not take the coordinator down
                self.events["tick_failures"] += 1
                log.warning("coordinator tick failed (will retry): %s", e)
            self.stop_event.wait(self.tick_s)

"""The node daemon: joins the DHT, advertises capacity, takes signed assignments and runs its stage.

Threads: the main thread polls the DHT for this node's assignment (a current one only: `AssignmentSource`)
and its run's state; the advert thread refreshes the signed advert before its TTL runs out; the worker
thread trains; the link prober (node/pipeline/link_prober.py) measures links while idle; link, acceptor and
health threads serve I/O; a coordinator-eligible node supervises its coordinator child
(node/coordinator_child.py). Its settings: NodeConfig (node/config.py). SIGINT/SIGTERM stop the worker at the next
step boundary, then everything closes in order and the process exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import torch

from node.config import NodeConfig
from node.coordinator_child import CoordinatorChild, role_config
from node.data.corpus import DataError, DataSource
from node.device import DeviceError, describe, free_memory_bytes, resolve_device, resolve_precision
from node.health import HealthServer
from node.metrics import NodeMetrics, node_families
from node.pipeline.acceptor import Acceptor
from node.pipeline.link_prober import LinkProber
from node.pipeline.reachability import Reachability, socket_for
from node.pipeline.transport import LinkError, Shaper, listen
from node.preemption import Notice
from node.preflight import refuse_if_taken, refuse_live_twin
from node.probe import device_name, measure_reference_block, measure_store_mbps, measure_tflops, memory_gb
from node.worker import LN2, StageWorker, WorkerMetrics
from protocol import keys
from protocol.envelope import Signed
from protocol.identity import Identity, public_key_of_peer_id
from protocol.memory import GB, fits, stage_memory
from protocol.messages import (
    MAX_ADVERT_LAYERS,
    Assignment,
    NodeAdvert,
    RunRecord,
)
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreError
from protocol.process.metrics import render
from protocol.schema import ProtocolError
from protocol.trust.assignment_archive import MAX_ARCHIVE_BYTES, open_archive
from protocol.trust.delegation import OperatorTrust, RefusalLog, Untrusted
from protocol.trust.grant_mail import GrantInbox, mail_key_hex
from protocol.trust.run_authority import RunAuthority

log = logging.getLogger(__name__)
VERSION = "0.1.0"
ADVERT_ERROR_CHARS = 500  # the reason a failed assignment is advertised with, cut to keep adverts small
ENDED = ("stopping", "stopped", "done", "failed")
"""Run states in which no node takes the run's work, or keeps doing it."""
LEFT_OUT_TTL_S = 2.0
"""How long a `left_out` verdict is reused: the fragments and layer groups of one round ask within it."""
ARCHIVE_READS = 4
"""Newer assignment archives read at most to judge one assignment: junk a store writer planted under
archive names costs a few GETs and supersedes nothing (only what a trusted key signed counts)."""
GRANT_WAIT_S = 60.0
"""How long a worker that writes through grants waits for its first grant mail before it starts anyway
(its writes then ask for mails again)."""
MAX_JUDGED = 1024
"""Stale assignments remembered (then forgotten all at once, and judged again if still published)."""


def memory_refusal(a: Assignment, device: torch.device, free_bytes: int) -> str | None:
    """Why a node with `free_bytes` free on `device` cannot hold the assigned stage, or None: the stage's
    memory (protocol/memory.py) estimated from the spec in the precision this node resolves, before
    anything is allocated."""
    precision = resolve_precision(a.spec.train.precision, device)
    return fits(stage_memory(a.spec, a.stage, precision, a.replica), free_bytes)


def _same_slot(a: Assignment, b: Assignment) -> bool:
    """Same run, replica, stage, neighbours and spec: a worker can keep running across the two."""
    return (a.run_id, a.replica, a.stage, a.prev, a.next, a.spec) == (
        b.run_id,
        b.replica,
        b.stage,
        b.prev,
        b.next,
        b.spec,
    )


class AssignmentSource:
    """Which of this node's signed assignments in the DHT it may act on.

    First, who may direct the run (`proven`, protocol/trust/run_authority.py): an assignment counts only when the
    operator launched its run and its signer holds the store's lease of its term, issued within that
    lease; a certified key's higher term, a deposed leader's lower one, an assignment of a run never
    launched are refused, naming why, and the node follows the lease holder's. Then, among those, within
    a run assignments are ordered by (term, epoch). A coordinator moves to a new epoch whenever it
    re-places (a replica rebuilt, a replica dropping out) and issues every slot that goes on at that
    (term, epoch); a taker-over re-issues them all under its higher term. A slot left out (its replica
    dropped out, its node was replaced) keeps its older assignment in the DHT, republished while the run
    is active, and in the archives the coordinators write to the store ({run}/assign/{term}-{epoch}). So,
    with A the assignments of the run in those archives signed by a.term's leader (a's signer),

        current(a)  <=>  state(run) not in ENDED  and  no b in A has b.term = a.term, b.epoch > a.epoch

    (a newer term is no proven one while a's term holds the lease: archives of other terms say nothing)

    and a node acts only on a current assignment: one restarted after its replica dropped out (it holds
    nothing to compare with) does not start its old slot again, nor the slot of a run that is over.
    Judging costs a LIST of the run's archives (GETs only of newer ones): a current assignment is acted
    on at once, a stale one is remembered. A missing run record or archive judges nothing stale: without
    them the node works as before."""

    def __init__(
        self, peer_id: str, dht: DHTClient, store: ObjectStore, trust: OperatorTrust, refusals: RefusalLog
    ) -> None:
        self.peer_id, self.dht, self.store, self.trust, self.refusals = peer_id, dht, store, trust, refusals
        self.authority = RunAuthority(store, trust)
        self._proofs: dict[tuple[str, int, int, float, bytes], str | None] = {}
        """(run, term, epoch, issued_at, signer) -> why that assignment is refused (None: it is proven)."""
        self._leaders: dict[tuple[str, int], bytes] = {}
        """(run, term) -> the key proven to hold that term's lease."""
        self._stale: dict[tuple[str, int, int, float], str] = {}
        """(run, term, epoch, issued_at) -> why that assignment is not current."""
        self._enders: dict[tuple[str, bytes, float], bool] = {}
        """(run, signer, updated) of a record ending its run -> whether its signer may end it."""
        self.last_ignored: dict | None = None
        """The last assignment found not current and why, for /status."""
        self._older_said: set[tuple[int, int, float]] = set()
        self._verdicts: dict[tuple[str, int, int, int, int], tuple[float, str | None]] = {}
        """(run, term, epoch, replica, stage) -> (when judged, `left_out`'s verdict)."""

    def say_older(self, found: list[Assignment], held: Assignment) -> None:
        """Log, once each, the assignments of the held one's run older than it: e.g. what a deposed
        coordinator still signs at its lower term."""
        for x in found:
            if x.run_id == held.run_id and (x.term, x.epoch) < (held.term, held.epoch):
                if (x.term, x.epoch, x.issued_at) not in self._older_said:
                    self._older_said.add((x.term, x.epoch, x.issued_at))
                    log.info(
                        "ignoring stale assignment of run %s term %d epoch %d (holding term %d epoch %d)",
                        x.run_id,
                        x.term,
                        x.epoch,
                        held.term,
                        held.epoch,
                    )

    def signed(self) -> list[Signed[Assignment]]:
        """This node's assignments in the DHT that a trusted key signed, with their signers."""
        found = self.trust.filter(
            self.dht.get_all(keys.assignment_key(self.peer_id), Assignment).values(), self.refusals
        )
        for s in found:
            if s.body.peer_id != self.peer_id:
                log.warning("ignoring assignment for %s found under this node's key", s.body.peer_id)
        return [s for s in found if s.body.peer_id == self.peer_id]

    def found(self) -> list[Assignment]:
        """This node's assignments in the DHT that a trusted key signed."""
        return [s.body for s in self.signed()]

    def proven(self, signed: list[Signed[Assignment]]) -> list[Assignment]:
        """The assignments of `signed` whose signer directs their run now (`RunAuthority.check`); each
        refusal is logged once per signer and reason, counted by reason and shown in /status. Judged once
        per assignment (a store that does not answer judges nothing: asked again at the next poll)."""
        out = []
        for s in signed:
            a = s.body
            key = (a.run_id, a.term, a.epoch, a.issued_at, s.signer)
            if key not in self._proofs:
                try:
                    self.authority.check(s)
                    why = None
                except Untrusted as e:
                    why = e.why
                    self.refusals.note(s.signer_id, e)
                    self._ignored(a, why)
                except StoreError as e:
                    log.info("run %s: cannot judge an assignment now: %s", a.run_id, e)
                    continue
                if len(self._proofs) >= MAX_JUDGED:
                    self._proofs.clear()
                    self._leaders.clear()
                self._proofs[key] = why
                if why is None:
                    self._leaders[(a.run_id, a.term)] = s.signer
            if self._proofs[key] is None:
                out.append(a)
        return out

    def _ignored(self, a: Assignment, why: str) -> None:
        self.last_ignored = {
            "run_id": a.run_id,
            "term": a.term,
            "epoch": a.epoch,
            "replica": a.replica,
            "stage": a.stage,
            "reason": why,
        }

    @staticmethod
    def newest(found: list[Assignment]) -> list[Assignment]:
        """The newest (term, epoch) of each run in `found`, the most recently issued first: within a run a
        deposed coordinator (lower term) loses whatever its clock says; terms of different runs do not
        compare."""
        best: dict[str, Assignment] = {}
        for a in found:
            if a.run_id not in best or (a.term, a.epoch) > (best[a.run_id].term, best[a.run_id].epoch):
                best[a.run_id] = a
        return sorted(best.values(), key=lambda a: -a.issued_at)

    def run_state(self, run_id: str) -> str | None:
        """The run's state in its newest trusted record in the DHT (None: no record). A record that ends the
        run counts only when the operator or the run's lease holder signed it: a certified key that does
        not lead the run (a deposed leader) cannot stop its nodes."""
        found = self.trust.filter(self.dht.get_all(keys.RUNS_KEY, RunRecord).values(), self.refusals)
        recs = sorted((s for s in found if s.body.spec.run_id == run_id), key=lambda s: -s.body.updated)
        for s in recs:
            if s.body.state not in ENDED or self._may_end(s):
                return s.body.state
        return None

    def _may_end(self, s: Signed[RunRecord]) -> bool:
        """Whether `s`, a record ending its run, was signed by the operator or the run's lease holder
        (judged once per record; a store that does not answer judges it not, for now)."""
        if s.signer in self.trust.operators:
            return True
        rec = s.body
        key = (rec.spec.run_id, s.signer, rec.updated)
        if key not in self._enders:
            try:
                self.authority.check_holder(rec.spec.run_id, s.signer_id)
                ok = True
            except Untrusted as e:
                why = f"RunRecord of run {rec.spec.run_id} ({rec.state}) signed by {s.signer_id}: {e.why}"
                self.refusals.note(s.signer_id, Untrusted(e.reason, why, e.why))
                ok = False
            except StoreError as e:
                log.info("run %s: cannot judge its %s record now: %s", rec.spec.run_id, rec.state, e)
                return False
            if len(self._enders) >= MAX_JUDGED:
                self._enders.clear()
            self._enders[key] = ok
        return self._enders[key]

    def newer_in_archive(self, a: Assignment) -> tuple[int, int] | None:
        """The (term, epoch) of an assignment of `a`'s run at `a`'s term and a newer epoch, signed by that
        term's leader (any trusted key while none is proven), from the store's archives (None: none is)."""
        newer = self._newer_archive(a)
        return None if not newer else max((b.term, b.epoch) for b in newer)

    def left_out(self, a: Assignment) -> str | None:
        """Why `a`, the assignment a worker trains under, no longer holds its slot: the newest archive of
        its term at a newer epoch (signed as `newer_in_archive` counts) gives this node no slot, or another
        one (its replica dropped out, its slot went to another node). None: that archive keeps the slot
        (only other replicas' signers changed: the DHT brings the new assignment), no newer archive is
        there, or it could not be read now (asked again at the next round: a store outage or junk under an
        archive name stops nobody). Costs one LIST, and a GET per newer archive; the round owner asks
        before it applies each round's fragment, so a verdict is reused for LEFT_OUT_TTL_S."""
        key = (a.run_id, a.term, a.epoch, a.replica, a.stage)
        now = time.monotonic()
        cached = self._verdicts.get(key)
        if cached is not None and now - cached[0] < LEFT_OUT_TTL_S:
            return cached[1]
        try:
            newer = self._newer_archive(a, judge_all=True)
        except Exception as e:  # advisory: a check that cannot be made must not end a healthy worker
            log.info("run %s: cannot read its assignment archives now: %s", a.run_id, e)
            return None
        why = None
        if newer:
            epoch = max((b.term, b.epoch) for b in newer)
            mine = [b for b in newer if (b.term, b.epoch) == epoch and b.peer_id == self.peer_id]
            if not any((b.replica, b.stage) == (a.replica, a.stage) for b in mine):
                why = (
                    f"left out of run {a.run_id} replica {a.replica} stage {a.stage}: term {epoch[0]} epoch "
                    f"{epoch[1]} gives this node {'another slot' if mine else 'no slot'} (its replica dropped "
                    "out, or its slot went to another node); the rounds of its slot are no longer this "
                    "node's to apply"
                )
        if len(self._verdicts) >= MAX_JUDGED:
            self._verdicts.clear()
        self._verdicts[key] = (now, why)
        return why

    def _newer_archive(self, a: Assignment, judge_all: bool = False) -> list[Assignment]:
        """The assignments of `a`'s run in the newest archive of `a`'s term at a newer epoch that holds
        any signed by that term's leader (any trusted key while none is proven) and whose newest is its
        name's (term, epoch) (an older archive copied under a newer name says nothing); [] when none does.
        judge_all: a newer archive the store would not give raises StoreError instead of being passed
        over (the verdict would rest on an older one)."""
        leader = self._leaders.get((a.run_id, a.term))
        newer = sorted(
            (slot, key)
            for key in self.store.list(keys.assign_prefix(a.run_id))
            if (slot := keys.parse_assign_key(a.run_id, key)) is not None
            and slot[0] == a.term
            and slot[1] > a.epoch
        )
        for slot, key in reversed(newer[-ARCHIVE_READS:]):
            try:
                blob = self.store.get(key, max_bytes=MAX_ARCHIVE_BYTES)
                if blob is None:
                    continue
                found = [
                    b.body
                    for b in open_archive(blob, self.trust)
                    if b.body.run_id == a.run_id
                    and (b.body.term, b.body.epoch) > (a.term, a.epoch)
                    and leader in (None, b.signer)
                ]
            except StoreError as e:
                if judge_all:
                    raise
                log.info("run %s: ignoring assignment archive %s: %s", a.run_id, key, e)
                continue
            except (ProtocolError, ValueError) as e:  # ValueError: a bad signature
                log.info("run %s: ignoring assignment archive %s: %s", a.run_id, key, e)
                continue
            if found and max((b.term, b.epoch) for b in found) == slot:
                return found
        return []

    def pick(self, held: Assignment | None) -> Assignment | None:
        """The assignment to act on now when one is newer than `held` (None: carry on as before): of the
        proven ones, the most recently issued current one; a release (stage -1) is taken as it is."""
        signed = self.signed()
        if held is not None:
            self.say_older([s.body for s in signed], held)
        for a in self.newest(self.proven(signed)):
            if held is not None and a.run_id == held.run_id and (a.term, a.epoch) <= (held.term, held.epoch):
                return None
            if a.stage == -1 or self.why_not_current(a) is None:
                return a
        return None

    def why_not_current(self, a: Assignment) -> str | None:
        """Why `a` is not to be acted on (the run is over, a newer epoch superseded it), or None; said
        once per assignment in the log."""
        key = (a.run_id, a.term, a.epoch, a.issued_at)
        if key in self._stale:
            return self._stale[key]
        why = None
        state = self.run_state(a.run_id)
        if state in ENDED:
            why = f"run {a.run_id} is {state}"
        elif (newer := self.newer_in_archive(a)) is not None:
            why = (
                f"superseded by term {newer[0]} epoch {newer[1]} of run {a.run_id} (its replica dropped out, "
                "or its slot went to another node); waiting for a current assignment"
            )
        if why is not None:
            if len(self._stale) >= MAX_JUDGED:
                self._stale.clear()
            self._stale[key] = why
            self._ignored(a, why)
            log.info(
                "ignoring the assignment of run %s replica %d stage %d (term %d, epoch %d): %s",
                a.run_id,
                a.replica,
                a.stage,
                a.term,
                a.epoch,
                why,
            )
        return why


class NodeDaemon:
    def __init__(self, cfg: NodeConfig, identity: Identity) -> None:
        self.cfg, self.identity = cfg, identity
        if not cfg.operator_key:  # no trust root, no assignments: a stranger could point the stage anywhere
            raise ValueError("operator_key is required: the node trusts runs and assignments from it alone")
        if cfg.store is None:  # every stage syncs through the store: without one no assignment can run
            raise ValueError(
                "store is required (--store-endpoint URL, or [store] endpoint_url): every stage exchanges "
                "its outer-sync fragments and checkpoints there "
                "(example: --store-endpoint https://ACCOUNT.r2.cloudflarestorage.com)"
            )
        try:
            self.device, self._device_claim = resolve_device(cfg.device)
        except DeviceError as e:
            raise ValueError(str(e)) from e
        # the operator's key and the coordinator keys it certified (protocol/trust/delegation.py); refusals are
        # logged once per signer and reason
        self.trust = OperatorTrust.of({public_key_of_peer_id(cfg.operator_key)})
        self.refusals = RefusalLog(log)
        self.stop_event = threading.Event()
        self._advert_wake = threading.Event()  # set on state changes: publish now, not at the next refresh
        self.node_metrics = NodeMetrics()
        self._metrics = WorkerMetrics()
        self.assignment: Assignment | None = None
        self._stop_reason: str | None = None
        self.notice = Notice(  # SIGTERM (node/preemption.py)
            cfg.preempt_notice_s,
            training=lambda: self._worker_thread is not None and self._worker_thread.is_alive(),
            checkpointed=lambda: self.metrics.anchor_round,
            stop=self.stop_event.set,
        )
        self.coordinator_role: CoordinatorChild | None = None
        self._worker_thread: threading.Thread | None = None
        self._worker: StageWorker | None = None
        self.mail_key = mail_key_hex(identity) if cfg.store.grants else ""
        """Advertised when this node writes through grants: what the coordinator seals them to."""
        try:
            self.store = ObjectStore(cfg.store)
        except StoreError as e:  # e.g. a remote store and no credentials anywhere
            raise ValueError(str(e)) from e
        self.data = DataSource(cfg.data_root, self.store)  # corpora stay open across assignments
        # ports were checked free by the preflight (node/preflight.py); one taken since is named by its flag
        with contextlib.ExitStack() as undo:  # a start that fails half-way closes what it opened
            if self._device_claim is not None:
                undo.callback(self._device_claim.close)
            try:
                self.server = listen(cfg.host, cfg.port)
            except OSError as e:
                refuse_if_taken(e, "--port", cfg.host, cfg.port)
                raise
            # hellos addressed to us only
            self.shaper = Shaper(bandwidth_mbps=cfg.emulate_mbps, delay_ms=cfg.emulate_delay_ms)
            self.acceptor = Acceptor(  # trust: only neighbours a trusted assignment names are held
                self.server, peer_id=self.identity.peer_id, probe_shaper=self.shaper, trust=self.trust
            )
            undo.callback(self.acceptor.close)
            try:
                self.dht = DHTClient(identity, bootstrap=cfg.bootstrap, host=cfg.host, port=cfg.dht_port)
            except Exception as e:  # a taken --dht-port is no fault of the bootstrap peer
                refuse_if_taken(e, "--dht-port", cfg.host, cfg.dht_port)
                raise
            undo.callback(self.dht.shutdown)
            self.reach = Reachability(cfg, identity, self.dht, self.acceptor)  # and the relayed fallback
            undo.callback(self.reach.close)
            refuse_live_twin(self.dht, self.peer_id)  # before our own health server answers for our id
            if cfg.coordinator_eligible:  # its config is checked here: a wrong one stops this start
                role = role_config(cfg, cfg.bootstrap or self.dht.visible_maddrs()[:1])
                log_path = Path(cfg.key_file).expanduser().with_name(f"coordinator-{self.peer_id[-8:]}.log")
                self.coordinator_role = CoordinatorChild(role, log_path)
            self.prober = link_prober(self)
            self.source = AssignmentSource(self.peer_id, self.dht, self.store, self.trust, self.refusals)
            log.info("node trains on %s", describe(self.device))  # past the checks that refuse a start
            try:
                self.health = HealthServer(cfg.host, cfg.health_port, self.status, self.prometheus)
            except RuntimeError as e:
                refuse_if_taken(e, "--health-port", cfg.host, cfg.health_port)
                raise
            undo.callback(self.health.close)
            # measured before any run exists, so placement sees both figures; the default precision's ranks
            self.tflops_fp32 = measure_tflops(self.device, torch.float32)
            self.tflops_bf16 = measure_tflops(self.device, torch.bfloat16)
            self.default_precision = resolve_precision("auto", self.device)
            self.tflops = self.tflops_bf16 if self.default_precision == "bf16" else self.tflops_fp32
            self.ref_block, self.ref_block_s = measure_reference_block(self.device, self.default_precision)
            self.store_mbps = measure_store_mbps(self.store)
            self._advert_thread = threading.Thread(target=self._advert_loop, name="advert", daemon=True)
            self.reach.check()  # the first advert says whether neighbours can dial this node
            self.reach.start(changed=self._advert_wake.set)
            try:  # advertised before "ready": a second process with this peer id started now finds it
                self.dht.publish(keys.NODES_KEY, self.advert(), cfg.advert_ttl_s)
            except Exception as e:  # the advert loop retries
                log.warning("first advert failed (will retry): %s", e)
            undo.pop_all()  # started: shutdown() closes all of it

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    @property
    def metrics(self) -> WorkerMetrics:
        """The current assignment's live figures."""
        return self._metrics

    @metrics.setter
    def metrics(self, new: WorkerMetrics) -> None:
        # the old assignment's counts go into the node's running totals: Prometheus counters never go back
        if new is not self._metrics:
            self.node_metrics.retire(self._metrics)
        self._metrics = new

    def prometheus(self) -> bytes:
        """GET /metrics: node/metrics.py's families, rendered now."""
        rejected: dict[str, dict[str, int]] = {
            "dht_record": dict(self.dht.rejected),
            "signer": dict(self.refusals.by_reason),
            "pipeline_hello": {"refused": self.acceptor.rejected},
            "fragment": {
                "screen": sum(
                    t.counters["fragments_rejected"] for t in self.node_metrics.totals(self.metrics).values()
                )
            },
        }
        health = getattr(self, "health", None)
        if health is not None:
            rejected["http"] = dict(health.rejected)
        families = node_families(
            self.status(), self.metrics, self.node_metrics, store=self.store, rejected=rejected, http=health
        )
        return render(families)

    # --- advert -----------------------------------------------------------------------------------
    def advert(self) -> NodeAdvert:
        m = self.metrics
        return NodeAdvert(
            peer_id=self.peer_id,
            version=VERSION,
            device=device_name(self.device),
            memory_gb=round(memory_gb(self.device), 2),
            tflops=round(self.tflops, 4),
            tflops_fp32=round(self.tflops_fp32, 4),
            tflops_bf16=round(self.tflops_bf16, 4),
            ref_block=self.ref_block,
            ref_block_s=round(self.ref_block_s, 6),
            price_per_hour=self.cfg.price_per_hour,
            host=self.cfg.announce_host or self.cfg.host,
            port=self.cfg.announce_port or self.acceptor.port,
            health_port=self.health.port,
            reachable=self.reach.reachable is not False,
            relay_addr=self.reach.relay_addr,
            link_transport=dict(m.link_transport),  # the current (or last) assignment's links
            store_mbps=round(self.store_mbps, 1),
            coordinator_eligible=self.cfg.coordinator_eligible,
            peer_mbps={p: round(m.mbps, 1) for p, m in self.prober.advertised()},
            peer_rtt_ms={p: round(m.rtt_ms, 2) for p, m in self.prober.advertised()},
            free_memory_gb=round(self._free_bytes() / GB, 2),
            state=m.state,  # type: ignore[arg-type]
            error=m.error[:ADVERT_ERROR_CHARS] if m.state == "failed" else "",
            run_id=m.run_id,
            replica=m.replica,
            stage=m.stage,
            epoch=self.assignment.epoch if self.assignment else 0,
            step=m.step,
            # the advert's units: nats per token, bits per byte
            loss=None if m.train_loss_bits_per_token is None else m.train_loss_bits_per_token * LN2,
            val_bpb=m.validation_loss_bits_per_byte,
            tokens_per_s=round(m.tokens_per_s, 1),
            bytes_pipe=m.bytes_pipe_sent + m.bytes_pipe_recv,
            bytes_store=m.bytes_store_up + m.bytes_store_down,
            timestamp=dht_time(),
            mail_key=self.mail_key,
            expert_load=dict(list(m.expert_load.items())[:MAX_ADVERT_LAYERS]),
        )

    def _advert_loop(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.dht.publish(keys.NODES_KEY, self.advert(), self.cfg.advert_ttl_s)
            except Exception as e:  # the DHT being briefly unreachable must not kill the node
                log.warning("advert refresh failed (will retry): %s", e)
            self._advert_wake.wait(min(self.cfg.advert_ttl_s / 3, 5.0))
            self._advert_wake.clear()

    def status(self) -> dict:
        """GET /status: `node_status`."""
        return node_status(self)

    # --- assignments ------------------------------------------------------------------------------
    def _poll_assignment(self) -> Assignment | None:
        """The assignment to act on now, if it differs from the one held (AssignmentSource: current ones
        only); None to carry on as before."""
        cur = self.assignment
        a = self.source.pick(cur)
        if a is None or a.stage == -1:  # nothing newer, or released by the coordinator
            return a
        if (
            cur is not None
            and self._worker is not None
            and _same_slot(cur, a)
            and self._worker_thread
            and self._worker_thread.is_alive()
        ):
            # only other replicas' signers changed (one was rebuilt after churn): keep training
            self._worker.update_stage_peers(a)
            self.assignment = a
            log.info(
                "run %s: epoch %d updates the other replicas' signers; training goes on", a.run_id, a.epoch
            )
            return None
        return a

    def _free_bytes(self) -> int:
        """Memory a new stage could use now (the caching allocator's idle blocks count as free)."""
        if self.device.type == "cuda" and not (self._worker_thread and self._worker_thread.is_alive()):
            torch.cuda.empty_cache()
        return free_memory_bytes(self.device)

    def _start_worker(self, a: Assignment) -> None:
        reason = memory_refusal(a, self.device, self._free_bytes())
        if reason is not None:
            self.assignment = a  # answered: not reconsidered at every poll
            self.metrics = WorkerMetrics(
                state="failed", run_id=a.run_id, replica=a.replica, stage=a.stage, error=reason
            )
            self._advert_wake.set()
            log.error("refusing run %s replica %d stage %d: %s", a.run_id, a.replica, a.stage, reason)
            return
        self.assignment = a
        self._stop_reason = None
        self.metrics = WorkerMetrics(state="assigned", run_id=a.run_id, replica=a.replica, stage=a.stage)
        assert self.cfg.store is not None  # __init__ refused a node without one
        # with grants the worker writes only the keys its coordinator granted it, each once
        inbox = GrantInbox(self.cfg.store, self.identity, self.trust, a.run_id) if self.mail_key else None
        self._worker = worker = StageWorker(
            a,
            identity=self.identity,
            store=self.store if inbox is None else inbox.store,
            acceptor=self.acceptor,
            data=self.data,
            metrics=self.metrics,
            should_stop=lambda: self._stop_reason or self.notice.reason(),
            device=self.device,
            compile=self.cfg.compile,
            node_shaper=self.shaper,
            operator=self.trust,
            left_out=self._left_out,
            fallback=self.reach.fallback,
        )

        def run() -> None:
            try:
                if inbox is not None and not inbox.wait(GRANT_WAIT_S, lambda: self._stop_reason is not None):
                    log.warning(
                        "run %s: no grant mail from the coordinator within %.0f s; starting anyway (each write "
                        "asks for mails again, one without a grant fails)",
                        a.run_id,
                        GRANT_WAIT_S,
                    )
                reason = worker.run()
                log.info("run %s replica %d stage %d: %s", a.run_id, a.replica, a.stage, reason)
            except (LinkError, ProtocolError, StoreError, TimeoutError) as e:  # the swarm around us failed
                if self._run_ended(a):  # a neighbour stopped first and closed our link
                    self.metrics.state, self.metrics.error = "idle", ""
                    log.info(
                        "run %s replica %d stage %d: %s",
                        a.run_id,
                        a.replica,
                        a.stage,
                        self._stop_reason
                        or self.notice.reason()
                        or "the run ended, or a newer epoch left it out",
                    )
                else:
                    self._worker_failed(a, str(e))
            except DataError as e:  # this node's copy of the corpus or tokenizer: refused, said why
                self._worker_failed(a, f"DataError: {e}")
            except Exception as e:  # anything else (a malformed checkpoint, NaN weights, a bug)
                log.exception("worker of run %s crashed", a.run_id)
                self._worker_failed(a, f"{type(e).__name__}: {e}")

        log.info(
            "assigned to run %s: replica %d, stage %d, layers %s (term %d, epoch %d)",
            a.run_id,
            a.replica,
            a.stage,
            a.layers,
            a.term,
            a.epoch,
        )
        self._worker_thread = threading.Thread(target=run, name="worker", daemon=True)
        self._worker_thread.start()

    def _leave(self) -> None:
        """After a notice, once the worker ended: advertise "leaving" now, then stop the node."""
        self.metrics.state = "leaving"
        try:
            self.dht.publish(keys.NODES_KEY, self.advert(), self.cfg.advert_ttl_s)
        except Exception as e:  # the slot then frees after the churn grace, as for a lost node
            log.warning("could not advertise leaving: %s", e)
        log.info("left the run after a notice; stopping")
        self.stop_event.set()

    def _run_ended(self, a: Assignment) -> bool:
        """Whether the node stopped the worker, the run ended (stopped, done, failed) or a newer epoch left
        this node out: a link broken by a neighbour that stopped first is then no failure."""
        if self._stop_reason is not None or self.notice.reason() is not None:
            return True
        try:
            return self.source.run_state(a.run_id) in ENDED or self._left_out() is not None
        except Exception as e:  # the DHT did not answer: report the failure as it is
            log.warning("cannot read the state of run %s: %s", a.run_id, e)
            return False

    def _left_out(self) -> str | None:
        """Why the held assignment's slot is no longer this node's (`AssignmentSource.left_out`), or None."""
        a = self.assignment
        return None if a is None or a.stage == -1 else self.source.left_out(a)

    def _worker_failed(self, a: Assignment, reason: str) -> None:
        """Report a failed assignment: `failed` with the reason in /status and in the DHT advert (the
        coordinator rebuilds around it), and stay ready for new work."""
        self.metrics.state, self.metrics.error = "failed", reason
        self._advert_wake.set()
        log.error(
            "run %s replica %d stage %d failed: %s (waiting for a new assignment)",
            a.run_id,
            a.replica,
            a.stage,
            reason,
        )

    def _stop_worker(self, reason: str, timeout_s: float = 60.0) -> None:
        t = self._worker_thread
        if t is None or not t.is_alive():
            return
        self._stop_reason = reason
        t.join(min(timeout_s, 10.0))  # a worker between steps stops by itself
        if t.is_alive() and self._worker is not None:
            self._worker.abort()  # one blocked on a dead link is unblocked by closing its links
            t.join(timeout_s)
        if t.is_alive():
            log.warning("worker did not stop within %.0f s", timeout_s)

    # --- main loop --------------------------------------------------------------------------------
    def serve(self) -> None:
        if self.coordinator_role is not None:  # the coordinator role, as a supervised child
            self.coordinator_role.start()
        self._advert_thread.start()
        self.prober.start()
        last_run_check = 0.0
        while not self.stop_event.is_set():
            if self.notice.pending:  # under notice: no new work; leave once the worker is done
                t = self._worker_thread
                if t is None or not t.is_alive():
                    self._leave()
                    break
                self.stop_event.wait(min(self.cfg.poll_s, 0.2))
                continue
            try:
                new = self._poll_assignment()
                if new is not None:
                    self._stop_worker("reassigned")
                    if new.stage == -1:
                        self.assignment, self.metrics = new, WorkerMetrics()
                    else:
                        self._start_worker(new)
                a, t = self.assignment, self._worker_thread
                if a is not None and t is not None and t.is_alive() and time.monotonic() - last_run_check > 2:
                    last_run_check = time.monotonic()
                    state = self.source.run_state(a.run_id)
                    if state in ENDED and self._stop_reason is None:  # stopped, or over without this slot
                        why = "stopped by operator" if state in ("stopping", "stopped") else f"run {state}"
                        log.info("run %s: %s; stopping its worker", a.run_id, why)
                        self._stop_reason = why
            except Exception as e:  # keep serving: a bad record or a DHT hiccup must not kill the node
                log.warning("assignment poll failed (will retry): %s", e)
            self.stop_event.wait(self.cfg.poll_s)

    def shutdown(self) -> None:
        """Ordered clean-up: worker, advert, acceptor, health, DHT."""
        self.stop_event.set()
        self._advert_wake.set()
        if self.coordinator_role is not None:
            self.coordinator_role.stop()
        self._stop_worker("node shutting down", timeout_s=30)
        self.reach.close()  # before the acceptor: no relayed connection is adopted after it closed
        self.acceptor.close()
        self.health.close()
        self.dht.shutdown()
        if self._device_claim is not None:
            self._device_claim.close()


def link_prober(d: NodeDaemon) -> LinkProber:
    """Measures links while the node is idle; a peer nobody can dial is measured through the relay."""
    cfg = d.cfg
    return LinkProber(
        d.identity,
        d.dht,
        d.shaper,
        every_s=cfg.probe_every_s,
        peers=cfg.probe_peers,
        nbytes=cfg.probe_bytes,
        busy=lambda: d.metrics.state in ("assigned", "training"),
        measured=d._advert_wake.set,
        stop=d.stop_event,
        relayed=lambda advert: socket_for(d.reach.fallback, advert),
    )


def node_status(d: NodeDaemon) -> dict:
    """GET /status of a node: what it measured, its coordinator role, links, assignment and metrics."""
    a = d.assignment
    return {
        "peer_id": d.peer_id,
        "state": d.metrics.state,
        "pipeline": f"{d.cfg.announce_host or d.cfg.host}:{d.cfg.announce_port or d.acceptor.port}",
        "device": describe(d.device),
        "precision": d.metrics.precision or d.default_precision,
        "free_memory_gb": round(free_memory_bytes(d.device) / 1e9, 2),
        "tflops": d.tflops,
        "tflops_fp32": d.tflops_fp32,
        "tflops_bf16": d.tflops_bf16,
        "ref_block": d.ref_block,
        "ref_block_s": d.ref_block_s,
        "store_mbps": d.store_mbps,
        "coordinator_role": None
        if d.coordinator_role is None
        else {"pid": d.coordinator_role.pid, "restarts": d.coordinator_role.restarts},
        "reachability": d.reach.status(),
        "links": {
            p: {"mbps": round(m.mbps, 1), "rtt_ms": round(m.rtt_ms, 2)} for p, m in d.prober.advertised()
        },
        "assignment": None
        if a is None
        else {"run_id": a.run_id, "term": a.term, "epoch": a.epoch, "replica": a.replica, "stage": a.stage},
        "ignored_assignment": d.source.last_ignored,
        "metrics": d.metrics.as_dict(),
    }

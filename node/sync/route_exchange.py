"""The routing statistics' per-step barrier (issue 24): every replica of an MoE run agrees, for every inner
step, on the set of replicas' routing counts that moves the expert bias (node/sync/expert_bias.py), so the balancing
state is one on every replica by construction.

    publish(step, counts)  -> our signed RouteCounts at keys.route_key(run, group, step, replica), once
    agreed(step)           -> the step's agreed set and its summed counts, the same on every replica

The channel is the object store, as the outer rounds' is: one small write-once object per (layer group,
step, replica), a LIST of the step's prefix and a GET of each slot's record. The set is decided by
node/sync/round_rule.py `decide_step` from the store's own timestamps: no replica chooses it. It is a
barrier: a replica that needs step t's set (at step t + D, D = model.moe.stats_delay) waits until every
live replica's counts of step t are in (final at once), or, with one missing, until the store's clock
passes the quorum's arrival + W + M (W = model.moe.stats_timeout_s). A replica whose own counts missed
the set (cut off, slow, restarted) still applies the set's update when it reads it, so every replica's
bias moves alike; one whose reads fail waits until the store answers again (it must not train on a bias
the others do not hold).

Trust. A record counts only if a node of its slot signed it, for this run, group, step and slot, with the
tokens its shape trains per step, each layer's counts summing to tokens x top_k and none above tokens (a
token visits an expert once): a hostile replica can only move its own tokens between experts, 1/R of the
load the bias follows. One key per slot is what lets the set be final the moment all are in; it also
means a node that could write another slot's key could blank that slot's counts for a step, which the
run's store grants (each node writes only its own keys) rule out.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from node.sync.round_rule import STORE_MARGIN_S, decide_step, majority
from protocol import keys
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity, peer_id_of
from protocol.messages import MAX_ROUTE_RECORD_BYTES, RouteCounts
from protocol.net.store import ObjectStore, StoreError
from protocol.runspec import RunSpec
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = MAX_ROUTE_RECORD_BYTES


@dataclass
class RouteStats:
    """What the barrier cost and saw, for /status and /metrics."""

    steps: int = 0
    """Steps whose agreed set this replica applied."""
    settle_s: float = 0.0
    """Time from asking for a step's set until it was final (in the background: see Balancer.stall_s)."""
    bytes_up: int = 0
    bytes_down: int = 0
    rejected: int = 0
    """Records that failed validation (bad signature, slot, shape or counts), each counted once."""
    missing: int = 0
    """Live slots absent from a step's final set (late, cut off, or their record refused)."""
    not_published: int = 0
    """Our records that did not land (store error, or the key already held a record)."""
    last_members: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Agreed:
    """One step's agreed routing counts, the same on every replica."""

    step: int
    members: tuple[int, ...]
    counts: np.ndarray
    """(layers, experts) int64: the members' counts summed."""


class RouteExchange:
    """One replica's per-step barrier for one layer group of an MoE run."""

    def __init__(
        self,
        store: ObjectStore,
        identity: Identity,
        spec: RunSpec,
        *,
        group: int,
        replica: int,
        signers: dict[int, str],
        former: dict[int, set[str]] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        poll_s: float = 0.005,
        poll_max_s: float = 0.25,
    ) -> None:
        """signers: the group's signer by replica now (the live slots); former: nodes that held a slot
        before (their records of the steps they trained still count)."""
        self.store, self.identity, self.spec = store, identity, spec
        self.group, self.replica = group, replica
        a, b = spec.layer_groups()[group]
        self.layers = [i for i in range(a, b) if spec.model.is_moe_layer(i)]
        self.cancelled, self.poll_s, self.poll_max_s = cancelled, poll_s, poll_max_s
        self.stats = RouteStats()
        self._lock = threading.Lock()
        self._signers: dict[int, str] = {}
        self._former: dict[int, set[str]] = {}
        self.set_signers(signers, former)
        self._bad: set[str] = set()
        """Keys whose record was refused (written once, so they stay refused)."""
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="route-get")
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop waiting (a set still being read gives None) and free the reading threads."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def set_signers(self, signers: dict[int, str], former: dict[int, set[str]] | None = None) -> None:
        """The group's slots changed (a replica rebuilt or dropped): the old signer of a slot stays one."""
        with self._lock:
            for r, old in self._signers.items():
                if signers.get(r) != old:
                    self._former.setdefault(r, set()).add(old)
            for r, ps in (former or {}).items():
                self._former.setdefault(r, set()).update(ps)
            self._signers = dict(signers)

    def _slot_signers(self, r: int) -> set[str]:
        with self._lock:
            now = self._signers.get(r)
            return ({now} if now else set()) | self._former.get(r, set())

    # --- our record ----------------------------------------------------------------------------------
    def publish(self, step: int, counts: np.ndarray) -> bool:
        """Put our counts of `step` ((layers, experts) integers) once; False if they did not land (the step's
        key already holds a record, ours from before a restart or our predecessor's, or the store failed)."""
        spec = self.spec
        body = RouteCounts(
            run_id=spec.run_id,
            group=self.group,
            step=step,
            replica=self.replica,
            tokens=spec.tokens_per_step(self.replica),
            experts=spec.model.moe.experts,
            layers=self.layers,
            counts=np.ascontiguousarray(counts, dtype="<u4").tobytes(),
        )
        data = seal(self.identity, body)
        key = keys.route_key(spec.run_id, self.group, step, self.replica)
        try:
            landed = self.store.put_if_absent(key, data) is not None
        except StoreError as e:
            log.warning("routing counts of step %d (group %d) not published: %s", step, self.group, e)
            landed = False
        with self._lock:
            if landed:
                self.stats.bytes_up += len(data)
            else:
                self.stats.not_published += 1
        return landed

    # --- the agreed set ------------------------------------------------------------------------------
    def _read(self, r: int, key: str, step: int) -> np.ndarray | None:
        """Slot r's counts at `key` if its record is valid, else None (and the key is never read again)."""
        spec, moe = self.spec, self.spec.model.moe
        data = self.store.get(key, MAX_RECORD_BYTES)
        if data is None:
            return None
        with self._lock:
            self.stats.bytes_down += len(data)
        try:
            signed = open_envelope(data, RouteCounts, max_bytes=MAX_RECORD_BYTES)
            rec, signer = signed.body, peer_id_of(signed.signer)
            why = None
            tokens = spec.tokens_per_step(r)
            if signer not in self._slot_signers(r):
                why = f"signed by {signer}, not a node of replica {r}'s slot"
            elif (rec.run_id, rec.group, rec.replica) != (spec.run_id, self.group, r):
                why = f"it is for run {rec.run_id} group {rec.group} replica {rec.replica}"
            elif rec.layers != self.layers or rec.experts != moe.experts or rec.tokens != tokens:
                why = (
                    f"it holds layers {rec.layers} x {rec.experts} experts of {rec.tokens} tokens, the slot "
                    f"trains layers {self.layers} x {moe.experts} experts of {tokens} tokens a step"
                )
            counts = np.frombuffer(rec.counts, dtype="<u4").astype(np.int64).reshape(len(self.layers), -1)
            if why is None and rec.step != step:
                why = f"it is for step {rec.step}"
            if why is None and ((counts.sum(axis=1) != tokens * moe.top_k).any() or (counts > tokens).any()):
                why = f"its counts are not {tokens} tokens routed to {moe.top_k} experts each, once"
        except (ProtocolError, ValueError) as e:
            why = str(e)
        if why is not None:
            with self._lock:
                self._bad.add(key)
                self.stats.rejected += 1
            log.warning("routing counts at %s refused: %s", key, why)
            return None
        return counts

    def agreed(self, step: int) -> Agreed | None:
        """The agreed set of `step` and its summed counts, once final; waits for it (the barrier), retrying
        through store errors. None only when cancelled (the worker is stopping) or closed."""
        spec = self.spec
        prefix = keys.route_prefix(spec.run_id, self.group, step)
        window = math.ceil(spec.model.moe.stats_timeout_s)
        found: dict[int, np.ndarray] = {}
        delay = self.poll_s
        t0 = time.perf_counter()
        try:
            while not self.cancelled() and not self._closed.is_set():
                live = set(self._signers)
                q = spec.sync.quorum or majority(len(live))
                try:
                    listing = self.store.list_stamped(prefix)
                    listed = {
                        r: key
                        for r in sorted(live)
                        if (key := keys.route_key(spec.run_id, self.group, step, r)) in listing.objects
                        and key not in self._bad
                    }
                    todo = [(r, key) for r, key in listed.items() if r not in found]  # GETs in parallel
                    read = self._pool.map(lambda rk: self._read(rk[0], rk[1], step), todo)
                    for (r, _), counts in zip(todo, read, strict=True):
                        if counts is not None:
                            found[r] = counts
                    stamps = {r: listing.objects[key].t for r, key in listed.items() if r in found}
                    d = decide_step(stamps, live, quorum=q, window_s=window, now_s=listing.now_s)
                except StoreError as e:
                    log.warning("routing counts of step %d (group %d): %s; retrying", step, self.group, e)
                    d = None
                if d is not None and d.final:
                    members = tuple(sorted(d.members))
                    total = np.zeros((len(self.layers), spec.model.moe.experts), np.int64)
                    for r in members:
                        total += found[r]
                    with self._lock:
                        self.stats.steps += 1
                        self.stats.missing += len(live - d.members)
                        self.stats.last_members = list(members)
                    return Agreed(step, members, total)
                if (
                    d is not None and d.settles_at_s is not None
                ):  # a slot is missing: sleep to the settle time
                    delay = max(delay, min(self.poll_max_s, d.settles_at_s - listing.now_s))
                time.sleep(delay)
                delay = min(2 * delay, self.poll_max_s)
            return None
        finally:
            with self._lock:
                self.stats.settle_s += time.perf_counter() - t0


__all__ = ["Agreed", "RouteExchange", "RouteStats", "STORE_MARGIN_S"]

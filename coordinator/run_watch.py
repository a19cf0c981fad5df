"""Watching a placed run through its nodes' adverts: done when every slot is done or gone; a replica that
lost a node is rebuilt, or drops out while the others go on; failed when every replica is lost; a stopping
run is stopped once no node trains for it."""

from __future__ import annotations

import logging
import time

from coordinator.managed_run import ManagedRun
from coordinator.run_placer import RunPlacer
from coordinator.run_publisher import RunPublisher
from coordinator.run_views import dropped_out_reason
from protocol.messages import NodeAdvert
from protocol.net.dht_client import dht_time

log = logging.getLogger("coordinator.service")  # the coordinator's lines, under the one name they had
MAX_REBUILDS_AFTER_FAILURE = 1
"""A replica whose node reports failed is restarted this many times within FAILURE_WINDOW_GRACES churn
graces; then it drops out (a bad data path fails the same way every time, at once) until its next rejoin.
Failures further apart are each rebuilt at once: on a host that faults now and then (a neighbour killed
one minute, a link cut the next) every one of them is a node's first."""
FAILURE_WINDOW_GRACES = 10
REJOIN_AFTER_GRACES = 6
"""A dropped replica is placed again (its own nodes if healthy, else free ones) this many churn graces after
it dropped out, the wait doubling with each rejoin that drops out again within twice its wait (at most
MAX_REJOIN_WAIT_S): a transient fault (a neighbour killed, a link cut, no spare node yet) costs the
replica a wait, not the rest of the run; a fault a rebuild does not fix costs one try per wait."""
MAX_REJOIN_WAIT_S = 1800.0


def note_failure(run: ManagedRun, peer: str, reason: str) -> None:
    """Count a node's failure once per epoch (status and the run's reason quote it)."""
    seen = run.failures.setdefault(peer, [])
    if not seen or seen[-1][0] != run.epoch:
        again = bool(seen) and seen[-1][1] == reason  # the same failure, counted again at a new epoch
        seen.append((run.epoch, reason))
        run.failed_at.setdefault(peer, []).append(time.monotonic())
        if again:
            return
        slot = next(
            (rs for rs, p in (run.placement.slots.items() if run.placement else ()) if p == peer), None
        )
        where = f" (replica {slot[0]}, stage {slot[1]})" if slot else ""
        run.note_event("fault", f"node {peer[-8:]}{where}: {reason}")


def dropped_summary(run: ManagedRun) -> str:
    """The replicas out of the run and why (the last reason each of their nodes gave); empty if none."""
    pl = run.placement
    why: dict[int, list[str]] = {}
    for r in sorted(run.dropped_out()):
        for s in range(run.record.spec.stages_of(r)):
            peer = pl.slots.get((r, s)) if pl else None
            if peer and run.failures.get(peer):
                why.setdefault(r, []).append(f"node {peer[-8:]}: {run.failures[peer][-1][1]}")
        why.setdefault(r, [])
    return dropped_out_reason({r: "; ".join(w) for r, w in why.items()})


def failure_summary(run: ManagedRun) -> str:
    """Every replica lost: the distinct reasons the nodes gave, the most frequent first."""
    counts: dict[str, int] = {}
    for seen in run.failures.values():
        for _, reason in seen:
            counts[reason] = counts.get(reason, 0) + 1
    ranked = sorted(counts, key=lambda r: -counts[r])
    return "every replica lost a node: " + "; ".join(ranked) if ranked else "every replica lost a node"


class RunWatch:
    """Watches runs, rebuilding through `placer` and saying what happened through `publisher`; a node's
    advert missing for churn_grace_s (or its failure standing that long) breaks its slot."""

    def __init__(self, placer: RunPlacer, publisher: RunPublisher, *, churn_grace_s: float) -> None:
        self.placer, self.publisher, self.churn_grace_s = placer, publisher, churn_grace_s
        self.last_advert: dict[str, NodeAdvert] = {}
        """Each node's newest advert seen: a DHT read that misses one (a peer holding it stalled) does not
        make the node gone; its age does."""

    def watch(self, run: ManagedRun, adverts: dict[str, NodeAdvert], read_at: float | None = None) -> None:
        """Mark the run done when every slot is done or gone; rebuild replicas that lost a node.

        A slot is broken when its node's advert has been missing for churn_grace_s, or the node reports
        `failed` on the current epoch (e.g. its neighbour crashed and the link broke). A broken replica is
        rebuilt with free nodes (re-placing only its holes) and resumes from the latest consensus
        checkpoint; the other replicas keep training and only learn the new signer (no restart). Without
        free nodes the replica drops out and the others continue.

        `read_at`: the DHT time `adverts` were read at (default now). An advert's age is judged against it,
        not against the time the watch runs: a tick slowed by a stalling store must not age every advert."""
        spec, pl = run.record.spec, run.placement
        assert pl is not None
        now, dnow = time.monotonic(), dht_time() if read_at is None else read_at
        self._back(run, adverts, dnow)
        done, gone, failed, stale, left = 0, set(), set(), set(), set()
        for peer in pl.slots.values():
            a = adverts.get(peer)
            if a is not None:
                self.last_advert[peer] = a
            a = self.last_advert.get(peer)  # (absent from this read: as old as the last one seen)
            if a is not None and a.state == "leaving":  # given notice and gone: no grace to wait out
                gone.add(peer)
                left.add(peer)
                continue
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
                    note_failure(run, peer, a.error or "no reason given")
                if now - run.missing_since.setdefault(peer, now) > self.churn_grace_s:
                    failed.add(peer)
        for peer in gone:
            why = "its node left (a stop notice)" if peer in left else "its node stopped advertising"
            note_failure(run, peer, why if peer in left else f"{why} (process or host down)")
        stale_replicas = {r for (r, s), p in pl.slots.items() if p in stale}
        broken = {
            r for (r, s), p in pl.slots.items() if p in gone or (p in failed and r not in stale_replicas)
        }
        # a replica that failed again soon after one rebuild fails for a reason a rebuild does not fix (its
        # data path, its spec): it drops out (until its rejoin) instead of being restarted forever
        hopeless = {
            r
            for (r, s), p in pl.slots.items()
            if r in broken
            and p in failed
            and sum(now - t <= FAILURE_WINDOW_GRACES * self.churn_grace_s for t in run.failed_at.get(p, []))
            > MAX_REBUILDS_AFTER_FAILURE
        }
        for peer in {p for (r, s), p in pl.slots.items() if r in hopeless} & (gone | failed):
            run.missing_since[peer] = -1.0
        broken -= hopeless
        run.hopeless |= hopeless
        if broken and not self.placer.rebuild(run, adverts, gone, broken):
            for peer in gone | failed:
                if run.missing_since.get(peer) != -1.0:
                    log.warning(
                        "run %s: node %s is lost and no free node can replace it; its replica drops "
                        "out, the others continue",
                        spec.run_id,
                        peer[-8:],
                    )
                run.missing_since[peer] = -1.0
        dropped = {r for (r, s), p in pl.slots.items() if run.missing_since.get(p) == -1.0}
        for (r, _s), p in pl.slots.items():  # a dropped replica's other nodes are out with it (one that
            if r in dropped:  # failed at the old epoch would never be counted again, and the run never done)
                run.missing_since[p] = -1.0
        lost = {p for p, t in run.missing_since.items() if t == -1.0}
        self._drop_out(run, adverts, dropped)
        if not done and self._rejoin(run, adverts, dropped, now):
            return
        self.publisher.set_reason(run, dropped_summary(run))
        if done and done + len(lost & set(pl.slots.values())) >= len(pl.slots):
            self.publisher.set_state(run, "done", reason=dropped_summary(run))
        elif (
            not done
            and {r for (r, s), p in pl.slots.items() if p in lost} >= {r for r, s in pl.slots}
            and (run.hopeless >= {r for r, s in pl.slots})
        ):  # every replica failed again soon after its rebuild; one whose node vanished waits for nodes
            self.publisher.set_state(run, "failed", reason=failure_summary(run))

    def _back(self, run: ManagedRun, adverts: dict[str, NodeAdvert], dnow: float) -> None:
        """Nodes counted lost that advertise again, training this run at its epoch (their adverts were
        late, nobody was told: no new epoch since), are in their slots again."""
        for peer, since in list(run.missing_since.items()):
            a = adverts.get(peer)
            if (
                since == -1.0
                and a is not None
                and dnow - a.timestamp <= self.churn_grace_s
                and (a.run_id, a.epoch, a.state) == (run.record.spec.run_id, run.epoch, "training")
            ):
                del run.missing_since[peer]
                log.info(
                    "run %s: node %s is back, training at epoch %d",
                    run.record.spec.run_id,
                    peer[-8:],
                    run.epoch,
                )

    def _rejoin(self, run: ManagedRun, adverts: dict[str, NodeAdvert], dropped: set[int], now: float) -> bool:
        """Place the dropped replicas whose wait is over again (`REJOIN_AFTER_GRACES`); True if it did."""
        pl = run.placement
        assert pl is not None
        for r in set(run.rejoin_at) - dropped:  # placed again by another rebuild meanwhile
            del run.rejoin_at[r]
        for r in dropped - set(run.rejoin_at):
            if now - run.rejoined_at.get(r, -1e18) > 2 * self._rejoin_wait(run, r):
                run.rejoins[r] = 0  # it trained through a whole wait since its last rejoin: start over
            run.rejoin_at[r] = now + self._rejoin_wait(run, r)
        due = {r for r in dropped if now >= run.rejoin_at[r]}
        if not due or run.record.state != "running":
            return False
        slots = {p for (r, _), p in pl.slots.items() if r in due}
        fresh = dht_time() - 2 * self.churn_grace_s
        healthy = {  # idle, or still at work on this run under an epoch it was dropped from
            p
            for p in slots
            if (a := adverts.get(p)) is not None
            and a.timestamp >= fresh
            and (a.state in ("idle", "failed", "done") or a.run_id == run.record.spec.run_id)
        }
        if not self.placer.rebuild(run, adverts, slots, due, reusable=healthy):
            for r in due:  # no nodes fit yet: look again after one grace
                run.rejoin_at[r] = now + self.churn_grace_s
            return False
        for r in due:
            run.rejoins[r] = run.rejoins.get(r, 0) + 1
            run.rejoined_at[r] = now
            del run.rejoin_at[r]
        return True

    def _rejoin_wait(self, run: ManagedRun, r: int) -> float:
        return min(REJOIN_AFTER_GRACES * self.churn_grace_s * 2 ** run.rejoins.get(r, 0), MAX_REJOIN_WAIT_S)

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
        run.note_event("fault", f"replica(s) {sorted(dropped)} dropped out")
        log.info(
            "run %s: replica(s) %s dropped out; replicas %s go on without waiting for them (epoch %d)",
            run.record.spec.run_id,
            sorted(dropped),
            sorted({r for r, _ in survivors}),
            run.epoch,
        )
        self.publisher.assign(run, adverts, survivors)

    def watch_stop(self, run: ManagedRun, adverts: dict[str, NodeAdvert]) -> None:
        """A stopping run is stopped once none of its nodes trains for it any more."""
        pl = run.placement
        if pl is None or all(
            (a := adverts.get(p)) is None or a.run_id != run.record.spec.run_id or a.state != "training"
            for p in pl.slots.values()
        ):
            self.publisher.set_state(run, "stopped")


__all__ = ["MAX_REBUILDS_AFTER_FAILURE", "RunWatch", "dropped_summary", "failure_summary", "note_failure"]

"""The soak's faults (scripts/soak.py): a seeded schedule, the injectors, and each fault's recovery.

Every kind is what a spot or volunteer GPU host does to a run:

- node_kill: SIGKILL a training node; its host comes back with the same key 5-15 s later;
- node_stop: SIGSTOP a training node for 5-20 s, then SIGCONT (a hung host, a long GC, a live migration);
- preempt: SIGTERM a training node (a spot host's notice); it trains to its checkpoint and leaves; the host
  comes back 5-15 s after it exited;
- coordinator_kill / coordinator_stop: the same to the leading coordinator (the coordinator-eligible node's
  child process that holds the run's lease); its node restarts a killed one by itself;
- store_503 / store_stall: for 10-30 s the store answers every request 503 SlowDown, or holds it unanswered
  for 5 s and closes it (`scripts/fault_proxy.py` in front of the store, every process behind it);
- link_slow / link_cut: one replica's pipeline link paced at 5 Mbit/s for 20-40 s, or cut (every
  connection closed, new ones refused) for 10-20 s (`scripts/link_proxy.py` in front of each node's port);
- join: a new node joins mid-run (a fresh identity; it waits as a spare).

A fault's recovery is measured from its injection to the first poll, after the fault ended, at which every
replica it hit has all its stages training and has advanced a step since the fault ended ("training
again"); a fault that hit no replica (a spare's, a join) recovers at once.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scripts.soak import SoakSwarm

KINDS = (
    "node_kill",
    "node_stop",
    "preempt",
    "coordinator_kill",
    "coordinator_stop",
    "store_503",
    "store_stall",
    "link_slow",
    "link_cut",
    "join",
)
MAX_JOINS = 3
"""Nodes a soak adds at most (each is one more process on the host's cores)."""
LINK_SLOW_MBPS = 5.0
PREEMPT_GIVE_UP_S = 40.0
"""A preempted node still running this long after its notice is killed (a spot host's grace ends)."""
RECOVERY_GIVE_UP_S = 300.0
"""A fault whose replicas do not train again this long after it ended counts as not recovered."""


@dataclass
class Fault:
    kind: str
    at_s: float
    """Planned injection, seconds after the soak's window opened."""
    duration_s: float = 0.0
    """How long the fault lasts (stop, store, link); a kill's or preemption's host-down time."""
    target: str = ""
    """The process hit (node name), or the replica ("r0") for a link."""
    replicas: list[int] = field(default_factory=list)
    """The replicas it hit (what recovery waits for)."""
    injected: float = 0.0
    ended: float | None = None
    recovered: float | None = None
    note: str = ""
    _after_end: dict[int, int] = field(default_factory=dict)
    """Replica -> its step at the first complete poll after the fault ended."""

    def figures(self, t0: float) -> dict:
        rec = None if self.recovered is None else round(self.recovered - self.injected, 1)
        return {
            "kind": self.kind,
            "at_s": round(self.injected - t0, 1),
            "duration_s": round((self.ended or self.injected) - self.injected, 1),
            "target": self.target,
            "replicas": self.replicas,
            "recovery_s": rec,
            "note": self.note,
        }


def schedule(
    seed: int, window_s: float, n: int, kinds: tuple[str, ...], warmup_s: float, cooldown_s: float
) -> list[Fault]:
    """`n` faults over [warmup_s, window_s - cooldown_s], evenly spaced with seeded jitter; every kind
    at least twice where n allows, the rest drawn at random (joins at most MAX_JOINS)."""
    rng = random.Random(seed)
    picks = [k for _ in range(2) for k in kinds][:n]
    extra = [k for k in kinds if k != "join"] or list(kinds)
    while len(picks) < n:
        picks.append(rng.choice(extra))
    rng.shuffle(picks)
    joins = [i for i, k in enumerate(picks) if k == "join"]
    for i in joins[MAX_JOINS:]:
        picks[i] = rng.choice(extra)
    span = max(window_s - cooldown_s - warmup_s, 1.0)
    gap = span / max(n, 1)
    durations = {
        "node_kill": (5, 15),
        "preempt": (5, 15),
        "node_stop": (5, 20),
        "coordinator_stop": (10, 20),
        "store_503": (10, 30),
        "store_stall": (10, 30),
        "link_slow": (20, 40),
        "link_cut": (10, 20),
    }
    out = []
    for i, kind in enumerate(picks):
        lo, hi = durations.get(kind, (0, 0))
        at = warmup_s + i * gap + rng.uniform(0, 0.3 * gap)
        out.append(Fault(kind, round(at, 1), round(rng.uniform(lo, hi), 1)))
    return out


class Injector:
    """Applies a `Fault` to a running `SoakSwarm` and ends it; `poll` is called every second with the
    run's nodes by (replica, stage) so that a fault's end and its recovery are timed."""

    def __init__(self, swarm: SoakSwarm, seed: int) -> None:
        self.swarm = swarm
        self.rng = random.Random(seed + 1)
        self.active: list[Fault] = []
        self.done: list[Fault] = []
        self._restart_at: dict[int, float] = {}
        """Node index -> when its host comes back (a killed or preempted node)."""

    # --- choosing a target ----------------------------------------------------------------------------
    def _training_node(self, placed: dict[tuple[int, int], dict]) -> tuple[int, dict] | None:
        """(node index, its metrics) of a random training node that is not down already."""
        busy = {i for f in self.active for i in self._indices(f)}
        options = [
            (i, m)
            for (r, s), m in sorted(placed.items())
            if (i := m["_node"]) not in busy and m["state"] == "training"
        ]
        return self.rng.choice(options) if options else None

    @staticmethod
    def _indices(f: Fault) -> list[int]:
        m = re.fullmatch(r"node(\d+)", f.target.split("-")[0])
        return [int(m.group(1))] if m else []

    # --- injecting and ending -------------------------------------------------------------------------
    def inject(self, f: Fault, placed: dict[tuple[int, int], dict]) -> bool:
        """Start fault `f` now; False if it has no target (e.g. nothing trains yet: try again later)."""
        sw, now = self.swarm, time.monotonic()
        if f.kind in ("node_kill", "node_stop", "preempt"):
            got = self._training_node(placed)
            if got is None:
                return False
            i, m = got
            proc = sw.current[i]
            f.target, f.replicas = proc.name, [m["replica"]]
            if f.kind == "node_kill":
                proc.kill()
                self._restart_at[i] = now + f.duration_s
            elif f.kind == "node_stop":
                os.killpg(proc.proc.pid, signal.SIGSTOP)
            else:
                proc.proc.send_signal(signal.SIGTERM)
                self._restart_at[i] = float("inf")  # once it has exited: see `tick`
        elif f.kind in ("coordinator_kill", "coordinator_stop"):
            leader = sw.leader()
            if leader is None:
                return False
            i, pid = leader
            f.target, f.replicas = f"coordinator of node{i} (pid {pid})", sorted({r for r, _ in placed})
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if f.kind == "coordinator_kill" else signal.SIGSTOP)
            f.note = str(pid)
        elif f.kind in ("store_503", "store_stall"):
            sw.store_proxy.rule = (lambda m, p: "503") if f.kind == "store_503" else (lambda m, p: "stall")
            f.target, f.replicas = "store", sorted({r for r, _ in placed})
        elif f.kind in ("link_slow", "link_cut"):
            links = sorted((r, s) for r, s in placed if (r, s + 1) in placed)
            if not links:
                return False
            r, s = self.rng.choice(links)
            ends = [placed[(r, s)]["_node"], placed[(r, s + 1)]["_node"]]
            for i in ends:  # both ends' relays: whichever end dialed, the link goes through one of them
                px = sw.link_proxies[i]
                px.slow(LINK_SLOW_MBPS) if f.kind == "link_slow" else px.cut()
            f.target, f.replicas, f.note = f"r{r} link s{s}-s{s + 1}", [r], ",".join(map(str, ends))
        elif f.kind == "join":
            node = sw.join()
            f.target, f.ended = node.name, now
        f.injected = now
        if f.kind in ("node_kill", "coordinator_kill"):
            f.ended = now if f.kind == "coordinator_kill" else None
        self.active.append(f)
        return True

    def _end(self, f: Fault, now: float) -> None:
        sw = self.swarm
        if f.kind == "node_stop":
            i = self._indices(f)[0]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sw.current[i].proc.pid, signal.SIGCONT)
        elif f.kind == "coordinator_stop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(f.note), signal.SIGCONT)
        elif f.kind in ("store_503", "store_stall"):
            sw.store_proxy.rule = lambda m, p: "pass"
        elif f.kind in ("link_slow", "link_cut"):
            for i in map(int, f.note.split(",")):
                sw.link_proxies[i].restore()
        f.ended = now

    def tick(self, placed: dict[tuple[int, int], dict]) -> None:
        """End the faults whose time is up, bring hosts back, time recoveries."""
        now = time.monotonic()
        for f in self.active:
            if f.ended is not None:
                continue
            if f.kind in ("node_kill", "preempt"):
                i = self._indices(f)[0]
                proc = self.swarm.current[i]
                if f.kind == "preempt" and self._restart_at[i] == float("inf"):
                    if proc.alive and now - f.injected > PREEMPT_GIVE_UP_S:
                        f.note = f"still running {PREEMPT_GIVE_UP_S:.0f} s after its notice: killed; "
                        proc.kill()
                    if not proc.alive:
                        f.note += f"exited {proc.proc.returncode} after {now - f.injected:.1f} s"
                        self._restart_at[i] = now + f.duration_s
                if now >= self._restart_at[i]:
                    self.swarm.restart_node(i)
                    f.ended = now
            elif now - f.injected >= f.duration_s:
                self._end(f, now)
        for f in list(self.active):
            if f.ended is not None and self._recovered(f, placed, now):
                self.active.remove(f)
                self.done.append(f)

    def _recovered(self, f: Fault, placed: dict[tuple[int, int], dict], now: float) -> bool:
        if now - (f.ended or now) > RECOVERY_GIVE_UP_S:
            f.note += " (not recovered)"
            return True
        steps = {}
        for r in f.replicas:
            stages = [m for (rr, _), m in placed.items() if rr == r]
            if not stages or len(stages) < self.swarm.stages or any(m["state"] != "training" for m in stages):
                return False
            steps[r] = min(m["step"] for m in stages)
        for r, step in steps.items():
            f._after_end.setdefault(r, step)
        if all(steps[r] > f._after_end[r] for r in f.replicas):
            f.recovered = now
            return True
        return False

    def end_all(self) -> None:
        """The window closed: end every fault still running (SIGCONT, the store and links back)."""
        now = time.monotonic()
        for f in self.active:
            if f.ended is None and f.kind not in ("node_kill", "preempt"):
                self._end(f, now)

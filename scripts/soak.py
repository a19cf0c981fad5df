"""A chaos soak: a localhost swarm trains for a stated time while seeded faults hit it, beside the same
swarm undisturbed; one JSON line of figures at the end.

  python -m scripts.soak --minutes 30 --seed 1          # ~30 min undisturbed, then ~30 min under faults
  python -m scripts.soak --minutes 2 --baseline-minutes 0 --faults 4 --kinds node_kill,store_503,link_cut,preempt

The swarm is the production configuration on one host: 2 replicas x 2 stages plus 1 spare (flags), no
standalone coordinator (the first two nodes are coordinator-eligible and elect one), every node writing
only through the coordinator's scoped grants (read-only store keys elsewhere) to a store that checks
signatures as R2 does, all-to-all SparseLoCo exchange, subspace-compressed pipeline links. Every process
reaches the store through a fault proxy and every node's pipeline port through a link relay, so the
store and the links can fail while the processes run on; the faults are scripts/chaos.py's.

Figures (docs/reliability.md defines each):
- goodput: tokens the consensus applied per second over the window (each round's agreed contributions'
  claimed tokens, from the nodes' `applied_history`), and its ratio to the undisturbed arm's;
- recoveries: each fault's time from injection to its replicas training again;
- rounds lost: rounds in which the consensus applied nothing, and those of them no fault explains (not
  within a fault or the round after it ended); tokens lost: tokens trained that no round applied
  (replayed steps of a rebuilt replica, a round's work cut off);
- consensus: every stage's anchor digest equal across replicas at every round they both checkpointed;
- validation bits per byte at the last step both arms validated, and each arm's last;
- $/Mtok with faults: the pool's cost (every node process alive, $0.10/h each) over the tokens applied;
- errors: every ERROR line or traceback any process logged.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coordinator.run_figures import CumulativeCounters
from protocol.process.cli_errors import bad_input, run_cli
from scripts.chaos import KINDS, Fault, Injector, schedule
from scripts.fault_proxy import FaultProxy
from scripts.link_proxy import LinkProxy
from scripts.local_swarm import (
    LOCAL_CHURN_GRACE_S,
    LOCAL_LEASE_S,
    NODE_PRICE_PER_HOUR,
    Swarm,
    _get_status,
    _raise_interrupt,
    preflight,
)
from scripts.local_swarm import (
    parse_args as swarm_args,
)
from scripts.procs import Child, ProcessFailed
from scripts.store_front import FULL_KEY, READ_ONLY_KEY

RUN_STEPS = 1_000_000
"""total_steps of a soak's run: it trains until the window closes (the learning rate stays at its peak)."""
SETTLE_S = 150.0
"""After the window: how long the replicas get to reach a common checkpointed round for the comparison."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--minutes", type=float, default=30.0, help="the window under faults (default 30)")
    ap.add_argument(
        "--baseline-minutes",
        type=float,
        help="the undisturbed arm's window, run first in the same invocation (default: --minutes; 0: none, "
        "goodput is then not compared unless --baseline gives it)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        help="the undisturbed arm's figures from an earlier soak (its soak.json or baseline.json)",
    )
    ap.add_argument("--seed", type=int, default=1, help="the fault schedule's seed (default 1)")
    ap.add_argument(
        "--faults", type=int, help="faults to inject (default: about 0.8 per minute, at least 20 for 30 min)"
    )
    ap.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"fault kinds, comma-separated (default all: {','.join(KINDS)})",
    )
    ap.add_argument(
        "--warmup-s", type=float, default=60.0, help="training before the first fault (default 60)"
    )
    ap.add_argument("--replicas", type=int, default=2, help="pipeline replicas (default 2)")
    ap.add_argument("--stages", type=int, default=2, help="stages per replica (default 2)")
    ap.add_argument("--spares", type=int, default=1, help="spare nodes (default 1)")
    ap.add_argument(
        "--eligible", type=int, default=2, help="coordinator-eligible nodes among them (default 2)"
    )
    ap.add_argument("--H", type=int, default=10, help="inner steps per round (default 10)")
    ap.add_argument("--out", type=Path, help="folder for logs and figures (default runs/soak-<time>)")
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        raise bad_input("--kinds", args.kinds, f"kinds are {', '.join(KINDS)}", "--kinds node_kill,store_503")
    args.kinds = kinds
    if args.minutes <= 0:
        raise bad_input("--minutes", args.minutes, "must be positive", "--minutes 30")
    if args.eligible < 1 or args.eligible > args.replicas * args.stages + args.spares:
        raise bad_input(
            "--eligible", args.eligible, "must be between 1 and the number of nodes", "--eligible 2"
        )
    if args.baseline_minutes is None:
        args.baseline_minutes = 0.0 if args.baseline else args.minutes
    if args.faults is None:
        args.faults = max(2 * len(kinds), round(0.8 * args.minutes))
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SoakSwarm(Swarm):
    """The soak's swarm: store behind a fault proxy, each node's pipeline port behind a link relay,
    elected coordinators, scoped grants; nodes restart with their own key (a host coming back)."""

    def __init__(self, out: Path, replicas: int, stages: int, spares: int, eligible: int) -> None:
        super().__init__(out, replicas * stages + spares, coordinator=False)
        self.stages, self.eligible = stages, eligible
        self.link_proxies: dict[int, LinkProxy] = {}
        self.current: dict[int, Child] = {}
        """Node index -> its live (or last) process."""
        self.starts: dict[int, int] = {}
        self.health_of: dict[int, str] = {}
        self.node_seconds = 0.0
        """Node processes alive x seconds (the pool's cost)."""

    def start(self, ready_timeout_s: float = 120, before_nodes: Callable[[], None] | None = None) -> None:
        store = self._spawn("store", ["-m", "scripts.embedded_store", "--front"])
        self.store_proxy = FaultProxy(store.wait_for(r"STORE (\S+)", ready_timeout_s).group(1))
        self.store_proxy.stall_s = 5.0
        self.store_url = self.store_proxy.url
        self._start_swarm(ready_timeout_s, before_nodes)

    def add_node(self, i: int, *, store_url: str | None = None, name: str | None = None) -> Child:
        from protocol.identity import Identity
        from protocol.trust.delegation import issue

        proxy = self.link_proxies.setdefault(i, LinkProxy())
        proxy.upstream_port = free_port()
        flags = ["--port", str(proxy.upstream_port), "--announce-port", str(proxy.port), "--store-grants"]
        if i < self.eligible:  # the store's full keys: its coordinator issues the grants
            cert = self.out / f"node{i}.cert"
            if not cert.exists():
                peer = Identity.load_or_create(self.out / f"node{i}.key").peer_id
                cert.write_bytes(issue(self.operator, peer, expires_at=time.time() + 7 * 86400))
            flags += ["--coordinator-eligible", "--coordinator-certificate", str(cert)]
            flags += ["--coordinator-lease-s", f"{LOCAL_LEASE_S:g}"]
            flags += ["--coordinator-churn-grace-s", f"{LOCAL_CHURN_GRACE_S:g}"]
            flags += ["--store-access-key", FULL_KEY[0], "--store-secret-key", FULL_KEY[1]]
        else:
            flags += ["--store-access-key", READ_ONLY_KEY[0], "--store-secret-key", READ_ONLY_KEY[1]]
        self.node_args[i] = flags
        node = super().add_node(i, store_url=store_url, name=name)
        self.current[i] = node
        self.health_of.pop(i, None)
        return node

    def restart_node(self, i: int) -> Child:
        """Node i's host comes back: the same key, a new process."""
        self.starts[i] = self.starts.get(i, 0) + 1
        return self.add_node(i, name=f"node{i}-r{self.starts[i]}")

    def join(self) -> Child:
        return self.add_node(len(self.link_proxies))

    def health_url(self, i: int) -> str | None:
        if i not in self.health_of:
            m = re.search(r"health=(\S+)/health", self.current[i].log_text())
            if m:
                self.health_of[i] = m.group(1)
        return self.health_of.get(i)

    def poll(self, pool: ThreadPoolExecutor) -> dict[int, dict]:
        """Node index -> its /status, for every live node that answers within 2 s."""
        live = {i: h for i, c in self.current.items() if c.alive and (h := self.health_url(i))}
        got = pool.map(lambda h: _get_status(f"{h}/status", timeout_s=2.0), live.values())
        return {i: st for i, st in zip(live, got, strict=True) if st}

    def leader(self) -> tuple[int, int] | None:
        """(node index, coordinator pid) of the candidate that took the newest lease term."""
        from protocol.identity import Identity

        best = None
        for i in range(self.eligible):
            peer = Identity.load_or_create(self.out / f"node{i}.key").peer_id
            log = self.out / f"coordinator-{peer[-8:]}.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            for term in re.findall(r"took the lease \(term (\d+)\)", text):
                if best is None or int(term) > best[1]:
                    best = (i, int(term))
        if best is None or not self.current[best[0]].alive:
            return None
        pid = _coordinator_pid(self.current[best[0]].proc.pid)
        return (best[0], pid) if pid else None

    def stop(self) -> dict[str, int | None]:
        for px in self.link_proxies.values():
            px.restore()
        self.store_proxy.rule = lambda m, p: "pass"
        codes = super().stop()
        for px in self.link_proxies.values():
            px.close()
        self.store_proxy.close()
        return codes


def _coordinator_pid(node_pid: int) -> int | None:
    import psutil

    try:
        for child in psutil.Process(node_pid).children():
            if "coordinator.cli" in " ".join(child.cmdline()):
                return child.pid
    except psutil.Error:
        return None
    return None


def placed_nodes(statuses: dict[int, dict], run_id: str) -> dict[tuple[int, int], dict]:
    """(replica, stage) -> the metrics of the node holding it under the newest assignment (a node back
    from SIGSTOP may still claim a slot it lost), with "_node": its index."""
    best: dict[tuple[int, int], tuple[tuple[int, int], dict]] = {}
    for i, st in statuses.items():
        a, m = st.get("assignment"), st["metrics"]
        if not a or a["run_id"] != run_id or m["run_id"] != run_id or m["state"] in ("failed", "idle"):
            continue
        key, rank = (m["replica"], m["stage"]), (a["term"], a["epoch"])
        if key not in best or rank > best[key][0]:
            best[key] = (rank, {**m, "_node": i})
    return {k: m for k, (_, m) in best.items()}


class Ledger:
    """What the consensus took in, round by round, and what the nodes trained and cost."""

    def __init__(self) -> None:
        self.by_stage: dict[tuple[int, int], int] = {}
        """(stage, round) -> tokens the stage's agreed set claimed (equal on every replica's stage; stages
        may differ: a replica's fragment can make one stage's set and miss the other's)."""
        self.seen_at: dict[int, float] = {}
        self.trained = CumulativeCounters()
        self.val: dict[int, list[float]] = {}
        """Step -> validation bits per byte of the replicas' last stages."""
        self._val_seen: set[tuple[int, int, int]] = set()
        self.anchors: dict[tuple[int, int], dict[str, set[int]]] = {}
        """(stage, round) -> anchor sha256 -> the replicas that showed it (replays included)."""
        self.mismatch: list[str] = []

    def observe(self, statuses: dict[int, dict], run_id: str, stages: int, now: float) -> None:
        for st in statuses.values():
            m = st["metrics"]
            if m["run_id"] != run_id:
                continue
            if m["stage"] == 0:
                self.trained.observe(st["peer_id"], {"tokens": m["tokens"]})
            for rnd, tokens in m.get("applied_history") or []:
                key = (m["stage"], rnd)
                self.seen_at.setdefault(rnd, now)
                if key not in self.by_stage:
                    self.by_stage[key] = tokens
                elif self.by_stage[key] != tokens:
                    self.mismatch.append(
                        f"stage {key[0]} round {rnd}: {tokens} tokens on r{m['replica']}, {self.by_stage[key]} seen"
                    )
            if m["stage"] == stages - 1:
                for step, bpb in m["val_history"]:
                    if (step, m["replica"], int(bpb * 1e9)) not in self._val_seen:
                        self._val_seen.add((step, m["replica"], int(bpb * 1e9)))
                        self.val.setdefault(step, []).append(bpb)
            for rnd, digest in m.get("anchor_history") or []:
                self.anchors.setdefault((m["stage"], rnd), {}).setdefault(digest, set()).add(m["replica"])

    @property
    def applied(self) -> dict[int, int]:
        """Round -> tokens the consensus applied in it: the mean over the stages that applied it."""
        per: dict[int, list[int]] = {}
        for (_, rnd), tokens in self.by_stage.items():
            per.setdefault(rnd, []).append(tokens)
        return {r: round(sum(t) / len(t)) for r, t in per.items()}

    def tokens_in(self, t0: float, t1: float) -> int:
        return sum(t for r, t in self.applied.items() if t0 <= self.seen_at[r] <= t1)

    def lost_rounds(self) -> list[int]:
        """Rounds between the first and the last applied in which some stage's consensus took nothing."""
        if not self.by_stage:
            return []
        stages = {s for s, _ in self.by_stage}
        first = max(min(r for s, r in self.by_stage if s == st) for st in stages)
        last = min(max(r for s, r in self.by_stage if s == st) for st in stages)  # every stage got there
        return [r for r in range(first, last + 1) if any(not self.by_stage.get((s, r)) for s in stages)]

    def consensus(self) -> dict:
        """Rounds compared (a stage's anchor checkpointed by at least two replicas) and those whose
        digests differ."""
        compared = [k for k, d in self.anchors.items() if len(set().union(*d.values())) >= 2]
        differ = sorted(k for k in compared if len(self.anchors[k]) > 1)
        return {
            "rounds_compared": len(compared),
            "rounds_differing": [f"s{s}r{r}" for s, r in differ],
            "last_round_compared": max((r for _, r in compared), default=None),
        }

    def common_round(self, stage: int, replicas: int) -> int:
        """The newest round of `stage` whose anchor every one of `replicas` replicas showed (-1: none)."""
        full = [
            r
            for (s, r), d in self.anchors.items()
            if s == stage and len(set().union(*d.values())) >= replicas
        ]
        return max(full, default=-1)


ERROR_LINE = re.compile(r"\bERROR\b|\bCRITICAL\b|^Traceback")


def logged_errors(out: Path) -> list[dict]:
    """Every ERROR / CRITICAL line and traceback in the arm's logs, once per (process, message)."""
    seen, errors = set(), []
    for log in sorted(out.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if ERROR_LINE.search(line):
                key = (log.stem, re.sub(r"\d+", "N", line)[:160])
                if key not in seen:
                    seen.add(key)
                    errors.append({"process": log.stem, "line": line[:300]})
    return errors


def explain_lost(lost: list[int], ledger: Ledger, faults: list[Fault]) -> dict[int, str]:
    """Lost round -> the fault in effect around it ("" when none: lost to no fault)."""
    seen = sorted(ledger.seen_at.items())
    gaps = [b[1] - a[1] for a, b in zip(seen, seen[1:], strict=False) if b[0] == a[0] + 1]
    round_s = sorted(gaps)[len(gaps) // 2] if gaps else 10.0
    out = {}
    for r in lost:
        before = max((t for rr, t in seen if rr < r), default=0.0)
        after = min((t for rr, t in seen if rr > r), default=float("inf"))
        hit = next(
            (
                f
                for f in faults
                if f.injected - round_s <= after
                and before <= (f.recovered or f.ended or f.injected) + round_s
            ),
            None,
        )
        out[r] = f"{hit.kind} at {hit.target}" if hit else ""
    return out


def run_arm(name: str, args: argparse.Namespace, minutes: float, faults: list[Fault]) -> dict:
    """One swarm trains `minutes` from its first step while `faults` hit it; its figures."""
    out = args.out / name
    run_id = f"soak-{name}-{time.strftime('%H%M%S')}"
    prep = preflight(swarm_args([
        "--replicas", str(args.replicas), "--stages", str(args.stages), "--steps", str(RUN_STEPS),
        "--H", str(args.H), "--run-id", run_id, "--no-calibrate",
    ]))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    toml = out / "run.toml"
    toml.write_text(prep.run_toml)
    swarm = SoakSwarm(out, args.replicas, args.stages, args.spares, args.eligible)
    injector, ledger, pending = Injector(swarm, args.seed), Ledger(), list(faults)
    window, slipped = 60 * minutes, 0.0
    print(f"soak {name}: run {run_id}, {len(faults)} faults over {minutes:g} min; logs in {out}/", flush=True)
    try:
        swarm.start()
        swarm.launch(toml)
        with ThreadPoolExecutor(16) as pool:
            t_launch = last = last_print = time.monotonic()
            t0: float | None = None
            settle_until: float | None = None
            ends: dict[int, int] = {}
            while True:
                now = time.monotonic()
                sts = swarm.poll(pool)
                placed = placed_nodes(sts, run_id)
                ledger.observe(sts, run_id, args.stages, now)
                swarm.node_seconds += (now - last) * sum(c.alive for c in swarm.current.values())
                last = now
                if t0 is None:
                    if any(m["step"] >= 1 for m in placed.values()):
                        t0 = now
                    elif now - t_launch > 300:
                        raise ProcessFailed(f"run {run_id} did not start training within 300 s")
                elif settle_until is None and now - t0 >= window:
                    settle_until, t_end = now + SETTLE_S, now
                    injector.end_all()
                    ends = {
                        s: max((r for (ss, r) in ledger.anchors if ss == s), default=0)
                        for s in range(args.stages)
                    }
                elif settle_until is None and pending and now - t0 >= pending[0].at_s and not injector.active:
                    f = pending[0]
                    if injector.inject(f, placed):
                        slipped = max(slipped, now - t0 - f.at_s)
                        print(
                            f"[{now - t0:6.0f}s] FAULT {f.kind} {f.target} ({f.duration_s:g} s)", flush=True
                        )
                        pending.pop(0)
                injector.tick(placed)
                for f in injector.done:
                    if not getattr(f, "_printed", False):
                        f._printed = True  # type: ignore[attr-defined]
                        rec = f.figures(t0 or now)["recovery_s"]
                        print(
                            f"[{now - (t0 or now):6.0f}s] recovered from {f.kind} {f.target}: {rec} s {f.note}",
                            flush=True,
                        )
                if settle_until is not None:
                    caught_up = all(ledger.common_round(s, args.replicas) >= ends[s] for s in ends)
                    if (caught_up and not injector.active) or now > settle_until:
                        break
                if now - last_print >= 10:
                    last_print = now
                    print(_progress_line(now - (t0 or now), placed, ledger, len(injector.done)), flush=True)
                time.sleep(max(0.0, 1.0 - (time.monotonic() - now)))
        assert t0 is not None
        trained = ledger.trained.total("tokens")
    finally:
        swarm.stop()
    applied = ledger.tokens_in(t0, t_end)
    lost = ledger.lost_rounds()
    hits = injector.done + injector.active
    why = explain_lost(lost, ledger, hits)
    beyond = [r for r, v in why.items() if not v]  # no fault near it
    for label in {v for v in why.values() if v}:  # a fault that cost more than the one round it hit
        beyond += sorted(r for r, v in why.items() if v == label)[1:]
    cons = ledger.consensus()
    usd = swarm.node_seconds / 3600 * NODE_PRICE_PER_HOUR
    val_last = max(ledger.val) if ledger.val else None
    return {
        "window_s": round(t_end - t0, 1),
        "tokens_applied": applied,
        "goodput_tokens_per_s": round(applied / (t_end - t0), 1),
        "rounds_applied": len([r for r, t in ledger.seen_at.items() if t0 <= t <= t_end]),
        "rounds_lost": lost,
        "rounds_lost_beyond_fault": sorted(beyond),
        "tokens_trained": trained,
        "tokens_lost": trained - sum(ledger.applied.values()),
        "consensus_identical": not cons["rounds_differing"]
        and not ledger.mismatch
        and cons["rounds_compared"] > 0,
        "consensus": cons,
        "applied_mismatches": ledger.mismatch[:10],
        "val_bpb": {str(s): round(sum(v) / len(v), 4) for s, v in sorted(ledger.val.items())},
        "val_bpb_last": round(sum(ledger.val[val_last]) / len(ledger.val[val_last]), 4)
        if val_last is not None
        else None,
        "node_hours": round(swarm.node_seconds / 3600, 3),
        "usd_per_mtok": round(usd / (applied / 1e6), 4) if applied else None,
        "faults": [f.figures(t0) for f in hits],
        "faults_not_injected": len(pending),
        "schedule_slip_s": round(slipped, 1),
        "errors": logged_errors(out),
    }


def _progress_line(
    elapsed: float, placed: dict[tuple[int, int], dict], ledger: Ledger, recovered: int
) -> str:
    steps: dict[int, int] = {}
    for (r, _), m in placed.items():
        steps[r] = min(steps.get(r, m["step"]), m["step"])
    applied = ledger.applied
    tok = sum(applied.values())
    return (
        f"[{elapsed:6.0f}s] replicas at steps {dict(sorted(steps.items()))}  rounds applied {len(applied)}  "
        f"{tok / 1e6:.2f} M tokens applied  faults recovered {recovered}"
    )


def summary(args: argparse.Namespace, soak: dict, base: dict | None) -> dict:
    """The soak's JSON line: the faulted arm's figures against the undisturbed one's."""
    recs = [f["recovery_s"] for f in soak["faults"] if f["recovery_s"] is not None]
    by_kind: dict[str, list[float]] = {}
    for f in soak["faults"]:
        by_kind.setdefault(f["kind"], []).append(f["recovery_s"])
    common = sorted(set(soak["val_bpb"]) & set(base["val_bpb"]), key=int) if base else []
    out = {
        "minutes": args.minutes,
        "seed": args.seed,
        "faults": len(soak["faults"]),
        "faults_by_kind": {k: len(v) for k, v in sorted(by_kind.items())},
        "recovery_s_by_kind": {k: v for k, v in sorted(by_kind.items())},
        "recovery_s_median": sorted(recs)[len(recs) // 2] if recs else None,
        "recovery_s_max": max(recs, default=None),
        "not_recovered": sum(f["recovery_s"] is None for f in soak["faults"]),
        "goodput_tokens_per_s": soak["goodput_tokens_per_s"],
        "baseline_goodput_tokens_per_s": base["goodput_tokens_per_s"] if base else None,
        "goodput": round(soak["goodput_tokens_per_s"] / base["goodput_tokens_per_s"], 4)
        if base and base["goodput_tokens_per_s"]
        else None,
        "rounds_lost": soak["rounds_lost"],
        "rounds_lost_beyond_fault": soak["rounds_lost_beyond_fault"],
        "tokens_lost": soak["tokens_lost"],
        "baseline_tokens_lost": base["tokens_lost"] if base else None,
        "consensus_identical": soak["consensus_identical"],
        "val_bpb_step": int(common[-1]) if common else None,
        "val_bpb_at_step": soak["val_bpb"][common[-1]] if common else None,
        "baseline_val_bpb_at_step": base["val_bpb"][common[-1]] if common and base else None,
        "val_bpb_last": soak["val_bpb_last"],
        "baseline_val_bpb_last": base["val_bpb_last"] if base else None,
        "usd_per_mtok": soak["usd_per_mtok"],
        "baseline_usd_per_mtok": base["usd_per_mtok"] if base else None,
        "errors": len(soak["errors"]),
        "baseline_errors": len(base["errors"]) if base else None,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    return run_cli("soak", _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed soak still stops every process it started
    args.out = args.out or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")
    base = None
    if args.baseline:  # a soak's soak.json, or the baseline.json its undisturbed arm wrote
        given = json.loads(args.baseline.read_text())
        base = given.get("baseline_arm", given)
    if args.baseline_minutes > 0:
        base = run_arm("baseline", args, args.baseline_minutes, [])
        (args.out / "baseline.json").write_text(json.dumps(base, indent=1))  # kept if the soak arm fails
    window = 60 * args.minutes
    faults = schedule(
        args.seed, window, args.faults, args.kinds, args.warmup_s, cooldown_s=min(60.0, window / 5)
    )
    soak = run_arm("soak", args, args.minutes, faults)
    line = summary(args, soak, base)
    (args.out / "soak.json").write_text(
        json.dumps({"summary": line, "soak_arm": soak, "baseline_arm": base}, indent=1)
    )
    for e in soak["errors"]:
        print(f"  logged: {e['process']}: {e['line']}", file=sys.stderr)
    print(
        json.dumps({**line, "baseline_arm": base and {k: v for k, v in base.items() if k != "errors"}}),
        flush=True,
    )
    ok = line["consensus_identical"] and not line["rounds_lost_beyond_fault"] and not line["not_recovered"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

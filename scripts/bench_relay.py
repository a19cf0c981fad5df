"""Relayed pipeline links (the NAT fallback) against direct TCP: throughput and CPU per byte.

  python -m scripts.bench_relay [--frame-kib 256] [--total-mib 32] [--repeats 3] [--cut-every-mib 8]

One pipeline `Link` pair (node/pipeline/transport.py) on loopback, first over a direct TCP connection, then
over the relayed fallback (node/pipeline/fallback.py): a `Relay` (its own p2pd) and two `Fallback`s (a p2pd
each), the dialer's local socket bridged to a libp2p stream through the relay's circuit and out of the
server's p2pd into the socket its `accept` gets (node/pipeline/relay_bridge.py). Link a sends `--total-mib`
MiB in frames of `--frame-kib` KiB from a thread; link b receives them in the main thread, and the frames
must arrive identical and in order (SHA-256 of the stream, checked after the timed transfer).

Figures, each the median of `--repeats` transfers on the same link pair: MB/s (1e6 bytes of frame payload a
second), and CPU seconds per MB: this process (getrusage: the Links' threads, the bridges' event loops) plus
every p2pd below it (psutil, else /proc), taken around the timed transfer only. The relay's own
p2pd is also given alone: what forwarding costs the relay's operator. The cut variant is one relayed
transfer with `Fallback.cut_all()` every `--cut-every-mib` MiB sent (the relay resetting the stream, as at
its byte limit), the session resuming each time with nothing lost. `resumes` counts the dialing session's
new streams in a transfer: the cuts, and every reset the relay makes of its own (`relayed_resumes`, the
uncut transfers' median). A table goes to stderr and one JSON line, last, to stdout. About 5 s here, or
about a minute when the relay resets the relayed connection every ~64 KB (`relayed_resumes` in the
thousands; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable

from node.pipeline.fallback import Fallback, Relay
from node.pipeline.relay_bridge import BridgeSession
from node.pipeline.transport import Link, connect, listen

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a dependency here, /proc is the fallback
    psutil = None

TICK = os.sysconf("SC_CLK_TCK")
RELAY_CHECK = [True]
"""--no-relay-check: the relay as p2pd starts it, circuits reset every ~64 KB in most starts (fallback.Relay)."""


# ---- CPU accounting ------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(ppid, utime + stime in seconds) from /proc/<pid>/stat, None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    # fields[0] is field 3 (state): ppid is field 4, utime and stime fields 14 and 15
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _is_p2pd(argv: list[str]) -> bool:
    return bool(argv) and os.path.basename(argv[0]) == "p2pd"


def p2pd_cpu() -> dict[int, float]:
    """CPU seconds so far of each p2pd process descended from this one, by pid."""
    me = os.getpid()
    if psutil is not None:
        out = {}
        for p in psutil.Process(me).children(recursive=True):
            try:
                if _is_p2pd(p.cmdline()):
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        return out
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (s := _proc_stat(int(name))) is not None:
            stats[int(name)] = s
    out = {}
    for pid, (_, cpu) in stats.items():
        if pid == me or not _is_p2pd(_argv(pid)):
            continue
        up = pid
        while up in stats and up not in (0, 1, me):
            up = stats[up][0]
        if up == me:
            out[pid] = cpu
    return out


def own_cpu() -> float:
    """This process's CPU seconds, every thread (getrusage: microseconds, not clock ticks)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---- one transfer ------------------------------------------------------------------------------------


def make_frames(frame_bytes: int, total_bytes: int) -> tuple[list[bytes], str]:
    """Distinct frames (each starts with its index), and the SHA-256 of their concatenation."""
    base = os.urandom(frame_bytes)
    frames = [i.to_bytes(8, "big") + base[8:] for i in range(max(1, total_bytes // frame_bytes))]
    return frames, digest_of(frames)


def digest_of(frames: list[bytes]) -> str:
    h = hashlib.sha256()
    for f in frames:
        h.update(f)
    return h.hexdigest()


def transfer(
    a: Link,
    b: Link,
    frames: list[bytes],
    digest: str,
    *,
    relay_pid: int | None = None,
    session: BridgeSession | None = None,
    every_frames: int = 0,
    cut: Callable[[], int] | None = None,
) -> dict[str, float]:
    """Send `frames` a -> b; MB/s and CPU s/MB (this process + p2pd children; the relay's p2pd alone), and
    the relayed session's resumes meanwhile and the cuts made."""
    got: list[bytes] = []
    failed: list[BaseException] = []
    cuts = [0]

    def send() -> None:
        try:
            for i, f in enumerate(frames, 1):
                a.send(f, timeout_s=60)
                if cut is not None and every_frames and i % every_frames == 0 and i < len(frames):
                    cuts[0] += cut()
        except BaseException as e:  # reported by the main thread
            failed.append(e)

    r0 = session.resumes if session is not None else 0
    p0, c0 = p2pd_cpu(), own_cpu()
    t0 = time.perf_counter()
    sender = threading.Thread(target=send, name="bench-send", daemon=True)
    sender.start()
    for _ in frames:
        if failed:
            raise RuntimeError(f"sending failed: {failed[0]}") from failed[0]
        got.append(b.recv(timeout_s=60))
    wall = time.perf_counter() - t0
    c1, p1 = own_cpu(), p2pd_cpu()
    sender.join(10)
    if digest_of(got) != digest:
        raise AssertionError("the frames did not arrive identical and in order")
    mb = sum(map(len, frames)) / 1e6
    children = sum(p1[pid] - p0.get(pid, 0.0) for pid in p1)
    relay = p1.get(relay_pid, 0.0) - p0.get(relay_pid, 0.0) if relay_pid is not None else 0.0
    return {
        "mb_s": mb / wall,
        "cpu_s_per_mb": (c1 - c0 + children) / mb,
        "p2pd_cpu_s_per_mb": children / mb,
        "relay_cpu_s_per_mb": relay / mb,
        "resumes": (session.resumes - r0) if session is not None else 0,
        "cuts": cuts[0],
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


# ---- the two transports --------------------------------------------------------------------------------


def bench_direct(frames: list[bytes], digest: str, repeats: int) -> dict[str, float]:
    srv = listen("127.0.0.1", 0)
    c = connect("127.0.0.1", srv.getsockname()[1], timeout_s=10)
    s, _ = srv.accept()
    a, b = Link(c, "a"), Link(s, "b")
    try:
        transfer(a, b, frames[: max(1, len(frames) // 8)], digest_of(frames[: max(1, len(frames) // 8)]))
        return median_of([transfer(a, b, frames, digest) for _ in range(repeats)])
    finally:
        a.close()
        b.close()
        srv.close()


def bench_relayed(
    frames: list[bytes], digest: str, repeats: int, cut_every_frames: int
) -> tuple[dict[str, float], dict[str, float]]:
    relay = Relay("127.0.0.1", 0, check=RELAY_CHECK[0])
    relay_pid = relay.p2p._child.pid if relay.p2p._child is not None else None
    got: list[tuple[object, str]] = []
    srv = cli = None
    a = b = None
    try:
        srv = Fallback(relay.address, accept=lambda s, addr: got.append((s, addr)))
        cli = Fallback(relay.address)
        sock, session = cli.dial(srv.address, "bench", timeout_s=30)
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        if not got:
            raise RuntimeError("the server side never got the relayed link")
        a, b = Link(sock, "a"), Link(got[0][0], "b")  # type: ignore[arg-type]
        warm = frames[: max(1, len(frames) // 8)]
        transfer(a, b, warm, digest_of(warm), relay_pid=relay_pid)
        plain = median_of(
            [transfer(a, b, frames, digest, relay_pid=relay_pid, session=session) for _ in range(repeats)]
        )
        cut = transfer(
            a,
            b,
            frames,
            digest,
            relay_pid=relay_pid,
            session=session,
            every_frames=cut_every_frames,
            cut=cli.cut_all,
        )
        return plain, cut
    finally:
        for link in (a, b):
            if link is not None:
                link.close()
        for f in (cli, srv):
            if f is not None:
                f.close()
        relay.close()


def _replica_tokens_per_s(links: tuple[Link, Link], steps: int) -> float:
    """A 2-stage replica (a dense link: every activation and gradient crosses it whole), one stage per
    thread, trained `steps` AdamW steps over `links`: tokens/s after one warm-up step."""
    import torch

    from node.model import build_stage
    from node.pipeline.schedule import PipelineStage
    from node.subspace_model import boundary_codecs
    from protocol.runspec import ModelSpec, PipelineSpec, RunSpec

    spec = RunSpec(
        run_id="bench-relay",
        model=ModelSpec(d_model=128, n_layers=4, n_heads=4, d_ff=352, seq_len=128),
        pipeline=PipelineSpec(link_k=[]),
    )
    batch, M = 8, 4
    ranges = spec.layer_ranges()
    started = [0.0, 0.0]

    def stage(index: int) -> None:
        torch.manual_seed(0)
        module = build_stage(spec.model, ranges, index)
        codec_in, codec_out = boundary_codecs(module, spec.model, spec.pipeline, ranges, index)
        prev, nxt = (None, links[0]) if index == 0 else (links[1], None)
        pipe = PipelineStage(
            module, stage=index, n_stages=2, prev=prev, next=nxt, codec_in=codec_in, codec_out=codec_out,
            recv_timeout_s=120,
        )  # fmt: skip
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(steps + 1):
            if step == 1:
                started[index] = time.perf_counter()
            tokens = (
                torch.randint(0, 256, (batch, spec.model.seq_len + 1), generator=g) if index == 0 else None
            )
            opt.zero_grad()
            pipe.train_step(step, tokens, M)
            opt.step()

    torch.set_num_threads(1)
    threads = [threading.Thread(target=stage, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return steps * batch * spec.model.seq_len / (time.perf_counter() - min(started))


def bench_replica(steps: int) -> tuple[float, float]:
    """Tokens/s of the same replica over direct TCP and over the relay."""
    srv = listen("127.0.0.1", 0)
    c = connect("127.0.0.1", srv.getsockname()[1], timeout_s=10)
    direct = _replica_tokens_per_s((Link(c, "s1"), Link(srv.accept()[0], "s0")), steps)
    srv.close()
    relay = Relay("127.0.0.1", 0, check=RELAY_CHECK[0])
    got: list[object] = []
    server = Fallback(relay.address, accept=lambda s, addr: got.append(s))
    client = Fallback(relay.address)
    try:
        sock, _ = client.dial(server.address, "replica", timeout_s=30)
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        relayed = _replica_tokens_per_s((Link(sock, "s1"), Link(got[0], "s0")), steps)  # type: ignore[arg-type]
    finally:
        client.close()
        server.close()
        relay.close()
    return direct, relayed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frame-kib", type=int, default=256, help="frame size in KiB (default 256)")
    ap.add_argument("--total-mib", type=int, default=32, help="MiB sent per transfer (default 32)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="transfers per transport, median taken (default 3)"
    )
    ap.add_argument(
        "--cut-every-mib", type=int, default=8, help="cut variant: reset the relayed stream this often (8)"
    )
    ap.add_argument(
        "--replica-steps",
        type=int,
        default=10,
        help="steps of the 2-stage replica per transport (10; 0: skip)",
    )
    ap.add_argument(
        "--no-relay-check",
        action="store_true",
        help="use the relay's first start as it comes (most reset circuits every ~64 KB: see Relay)",
    )
    ap.add_argument(
        "--check", action="store_true", help="validate the flags, print one JSON line, start and time nothing"
    )
    args = ap.parse_args(argv)
    RELAY_CHECK[0] = not args.no_relay_check
    if min(args.frame_kib, args.total_mib, args.repeats, args.cut_every_mib) < 1 or args.replica_steps < 0:
        ap.error(
            "--frame-kib, --total-mib, --repeats and --cut-every-mib must be at least 1, --replica-steps 0 or more"
        )
    if args.check:
        print(json.dumps({"check": "ok", "bench": "relay", "relay_checked": RELAY_CHECK[0]}))
        return
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # asyncio warns on every write to a stream the relay just reset (the bridge resumes on a new one): one
    # line per write, thousands a run; the resumes are counted and reported instead
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    frame_bytes = args.frame_kib << 10
    frames, digest = make_frames(frame_bytes, args.total_mib << 20)
    cut_every = max(1, (args.cut_every_mib << 20) // frame_bytes)

    t0 = time.perf_counter()
    direct = bench_direct(frames, digest, args.repeats)
    relayed, cut = bench_relayed(frames, digest, args.repeats, cut_every)
    replica = bench_replica(args.replica_steps) if args.replica_steps else (0.0, 0.0)
    elapsed = time.perf_counter() - t0

    print(f"{'path':<16} {'MB/s':>8} {'CPU s/MB':>9} {'p2pd s/MB':>10} {'relay s/MB':>11}", file=sys.stderr)
    for name, r in (("direct TCP", direct), ("relayed", relayed), ("relayed + cuts", cut)):
        print(
            f"{name:<16} {r['mb_s']:>8.1f} {r['cpu_s_per_mb']:>9.4f} {r['p2pd_cpu_s_per_mb']:>10.4f} "
            f"{r['relay_cpu_s_per_mb']:>11.4f}",
            file=sys.stderr,
        )
    print(
        f"resumes per transfer: {relayed['resumes']:.0f} relayed, {cut['resumes']} with {cut['cuts']} cuts; "
        f"{elapsed:.0f} s in all",
        file=sys.stderr,
    )
    r4 = lambda x: round(x, 4)  # noqa: E731
    print(
        json.dumps(
            {
                "bench": "relay",
                "relay_checked": RELAY_CHECK[0],
                "frame_kib": args.frame_kib,
                "total_mib": args.total_mib,
                "repeats": args.repeats,
                "direct_mb_s": round(direct["mb_s"], 1),
                "relayed_mb_s": round(relayed["mb_s"], 1),
                "relayed_cut_mb_s": round(cut["mb_s"], 1),
                "cut_every_mib": args.cut_every_mib,
                "cuts": cut["cuts"],
                "resumes": cut["resumes"],
                "relayed_resumes": round(relayed["resumes"]),
                "direct_cpu_s_per_mb": r4(direct["cpu_s_per_mb"]),
                "relayed_cpu_s_per_mb": r4(relayed["cpu_s_per_mb"]),
                "relayed_p2pd_cpu_s_per_mb": r4(relayed["p2pd_cpu_s_per_mb"]),
                "relay_cpu_s_per_mb": r4(relayed["relay_cpu_s_per_mb"]),
                "mb_s_ratio": r4(relayed["mb_s"] / direct["mb_s"]),
                "cpu_ratio": round(relayed["cpu_s_per_mb"] / direct["cpu_s_per_mb"], 2),
                "replica_direct_tokens_s": round(replica[0]),
                "replica_relayed_tokens_s": round(replica[1]),
                "replica_ratio": r4(replica[1] / replica[0]) if replica[0] else None,
                "seconds": round(elapsed, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

"""Pipeline throughput over shaped links: unshaped dense, shaped dense, shaped subspace (k/d = 1/8).

  python -m scripts.bench_pipeline                     # about 2.5 minutes on 2 idle cores
  python -m scripts.bench_pipeline --quick             # a smoke run (seconds, figures not meaningful)
  python -m scripts.bench_pipeline --check             # build every variant's run spec, start nothing
  python -m scripts.bench_pipeline --bandwidth-mbps 20 --delay-ms 10 --microbatches 16 --extra-in-flight 2

A 2-stage pipeline of the small Llama (d=256, 4 layers, 4 heads, d_ff=688, seq 256; layers 0-1 + embedding
on stage 0, layers 2-3 + head on stage 1) trains with AdamW on standard-library byte batches. Stage 0 runs
in this process, stage 1 in a child OS process; they talk over real TCP (node/pipeline/transport.py `Link`), one
message per microbatch per direction (protocol/codecs/subspace.py wire format). Each microbatch is b=8
sequences of L=256 tokens; a step is M microbatches (batch M*b) inside the worker's own inner step
(node/inner_step.py: the run's lr schedule with peak --lr over --steps, project_grads_, clipping to the
run's train.grad_clip, AdamW, project_weights_), on each stage. One torch thread per process.

Variants, each with its own model, optimizer and TCP connection:
  unshaped_dense   plain model, dense fp32 links (k = d), no shaping
  shaped_k32       the subspace-constrained model, link_k=[32] (k/d = 1/8), over links shaped to
                   --bandwidth-mbps per direction + --delay-ms one way
  (--compare-1f1b adds shaped_k32_1f1b: the same as shaped_k32 with plain 1F1B, no extra in-flight)
  shaped_dense     the plain model over the same shaped links
They run back to back step by step: round r is step r of every variant, in the order listed in even
rounds and reversed in odd ones (`round_order`). On a shared machine other work can take a core for tens
of seconds and halve a variant's speed; interleaving puts each unshaped/shaped pair of steps seconds
apart, so both see the same load, and alternating the order lets neither always follow the other. The
tax is the median over the measured rounds of 1 - t(unshaped_dense) / t(shaped_k32) (step times of the
same round), with its spread over the rounds (`tax_spread`: min, max, interquartile range); tokens/s are
over all measured steps. The first --warmup rounds are left out; more --steps, more rounds.

Shaping is the in-process `Shaper` on both ends (each end paces what it sends and delays what it
receives). With --tc-shaped the bandwidth comes from `tc tbf` on the path to --shaped-host instead
(scripts/netns_swarm.sh) and only the delay stays in process (this kernel has no netem).

Prints a table on stderr (bytes per microbatch per direction from the codec and from Link.bytes_sent,
4-byte frame prefix included; link and compute ms per microbatch; tokens/s; waits) and one JSON line last
on stdout:
  payload_fraction = forward wire bytes per microbatch, shaped_k32 / shaped_dense (token ids, the 32-byte
                     header and the frame prefix included in both)
  tax              = 1 - tokens/s(shaped_k32) / tokens/s(unshaped_dense), median of the paired rounds
Goals (DESIGN section 7): payload_fraction <= 0.13, tax <= 0.10.

Defaults and why: 20 Mbit/s per direction + 10 ms one way. A dense fp32 microbatch is 2.1 MB each way,
840 ms on such a link against ~300-400 ms of compute per stage and microbatch here, so dense links
dominate (shaped_dense runs at under half the unshaped speed); at k=32 it is 264 KB, 106 ms. M=16
microbatches per step amortize what no schedule hides inside a synchronous step: the first forward and
the last gradient each cross the link once per step (~2 (106 + 10) ms). --extra-in-flight 2 lets stage 0
run two forwards further ahead than 1F1B, which covers the per-microbatch round trip of
2 (tx + delay) (node/pipeline/schedule.py; --compare-1f1b measures plain 1F1B next to it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from node.data.corpus import Corpus
from node.device import resolve_precision
from node.inner_step import InnerOptimizer, inner_step, make_optimizer, prepare_stage
from node.model import Stage, build_stage
from node.pipeline.schedule import PipelineStage, StepStats
from node.pipeline.transport import Link, LinkError, Shaper, connect, listen
from node.subspace_model import boundary_codecs, constrain_stage
from protocol.codecs.subspace import Kind
from protocol.framing import recv_frame, send_frame
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[1]
MODEL = ModelSpec(d_model=256, n_layers=4, n_heads=4, d_ff=688, seq_len=256)
FRAME_PREFIX = 4  # protocol/framing.py length prefix
READY = "BENCH-STAGE1-READY"


@dataclass(kw_only=True, frozen=True)
class Variant:
    name: str
    link_k: list[int]
    """[] = dense links; [32] = k/d = 1/8."""
    shaped: bool
    extra_in_flight: int


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """What both stages must agree on for one variant; sent as the first frame of each connection."""

    variant: Variant
    bandwidth_mbps: float
    """In-process shaper bandwidth per direction (0 = none: unshaped, or shaped by tc)."""
    delay_ms: float
    steps: int
    M: int
    b: int
    lr: float
    wire_dtype: str
    recv_timeout_s: float

    def spec(self) -> RunSpec:
        """The run this variant trains: the run defaults (warm-up, clipping, weight decay, precision) with
        this bench's steps, batch, microbatches, peak lr and links."""
        pipeline = PipelineSpec(link_k=list(self.variant.link_k), wire_dtype=self.wire_dtype)  # type: ignore[arg-type]
        train = TrainSpec(total_steps=self.steps, batch_size=self.M * self.b, microbatches=self.M, lr=self.lr)
        return RunSpec(run_id="bench-pipeline", model=MODEL, stages=2, train=train, pipeline=pipeline)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> RunConfig:
        return RunConfig(**{**raw, "variant": Variant(**raw["variant"])})


@dataclass
class Node:
    module: Stage
    pipe: PipelineStage
    opt: InnerOptimizer
    train: TrainSpec


def build_node(cfg: RunConfig, index: int, link: Link) -> Node:
    spec = cfg.spec()
    ranges = spec.layer_ranges()
    module = build_stage(spec.model, ranges, index)
    constrain_stage(module, spec.model, spec.pipeline, ranges, index)  # no-op with dense links
    cpu = torch.device("cpu")
    prepare_stage(module, cpu, resolve_precision(spec.train.precision, cpu))
    codec_in, codec_out = boundary_codecs(module, spec.model, spec.pipeline, ranges, index)
    pipe = PipelineStage(
        module,
        stage=index,
        n_stages=2,
        prev=link if index == 1 else None,
        next=link if index == 0 else None,
        codec_in=codec_in,
        codec_out=codec_out,
        recv_timeout_s=cfg.recv_timeout_s,
        extra_in_flight=cfg.variant.extra_in_flight,
    )
    return Node(module, pipe, make_optimizer(module, spec.train), spec.train)


def train_step(node: Node, step: int, batch: torch.Tensor | None, M: int) -> StepStats:
    return inner_step(node.module, node.opt, node.train, step, lambda: node.pipe.train_step(step, batch, M))


def shaper(cfg: RunConfig) -> Shaper:
    return Shaper(bandwidth_mbps=cfg.bandwidth_mbps, delay_ms=cfg.delay_ms)


# --- stage 1: the child process ----------------------------------------------------------------------


def round_order(step: int, n: int) -> list[int]:
    """The variants' order in round `step`: as listed in even rounds, reversed in odd ones, so no variant
    always runs right after another (a load that builds up or fades within a round favours neither)."""
    return list(range(n)) if step % 2 == 0 else list(range(n - 1, -1, -1))


def spread(xs: list[float]) -> dict[str, float]:
    """The rounds' spread of a ratio: min, max and the interquartile range (median in `tax`)."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"min": round(min(xs), 4), "max": round(max(xs), 4), "iqr": round(q[2] - q[0], 4)}


def serve_stage1(listen_host: str, accept_timeout_s: float) -> None:
    """Serve one session after another. A session is `count` connections, one per variant; the first frame
    of each (raw, before shaping) is {"cfg": RunConfig, "index": i, "count": n}. Step r of every variant in
    index order, as stage 0 does; then each link answers with one JSON frame of stage 1's figures.
    A {"done": true} frame ends the loop."""
    torch.set_num_threads(1)
    srv = listen(listen_host, 0)
    srv.settimeout(accept_timeout_s)
    print(f"{READY} {srv.getsockname()[1]}", flush=True)
    while True:
        cfgs: list[RunConfig] = []
        links: list[Link] = []
        count = 1
        while len(links) < count:
            conn, _ = srv.accept()
            conn.settimeout(accept_timeout_s)
            hello = json.loads(recv_frame(conn))
            if hello.get("done"):
                conn.close()
                return
            if hello["index"] != len(links):
                raise RuntimeError(f"connection {hello['index']} of a session arrived as {len(links)}")
            count = hello["count"]
            cfg = RunConfig.from_dict(hello["cfg"])
            cfgs.append(cfg)
            links.append(Link(conn, f"stage0 ({cfg.variant.name})", shaper=shaper(cfg)))
        nodes = [build_node(cfg, 1, link) for cfg, link in zip(cfgs, links, strict=True)]
        stats: list[list[StepStats]] = [[] for _ in nodes]
        for step in range(cfgs[0].steps):
            for i in round_order(step, len(nodes)):  # as stage 0 steps them
                stats[i].append(train_step(nodes[i], step, None, cfgs[i].M))
        for link, st in zip(links, stats, strict=True):
            link.flush()
            result = {
                "bytes_sent": link.bytes_sent,
                "losses": [x.loss for x in st],
                "wait_s": [x.wait_s for x in st],
                "compute_s": [x.compute_s for x in st],
            }
            link.send(json.dumps(result).encode())
            link.flush()
            link.close()


# --- stage 0: this process ---------------------------------------------------------------------------


class Child:
    """Stage 1 as an OS process in its own session (optionally behind a command prefix such as
    `ip netns exec NS`); its stdout is read line by line on a thread, stderr goes to a log file."""

    def __init__(self, prefix: list[str], listen_host: str, accept_timeout_s: float) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="bench_stage1_", suffix=".log", delete=False)  # noqa: SIM115
        args = ["--stage1", "--listen-host", listen_host, "--accept-timeout-s", str(accept_timeout_s)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "scripts.bench_pipeline", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def tail(self, n: int = 20) -> str:
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-n:])

    def wait_ready(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"stage 1 exited with {self.proc.wait()} before it was ready:\n{self.tail()}"
                )
            if line.startswith(READY):
                return int(line.split()[1])
        raise RuntimeError(f"stage 1 not ready within {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 10.0) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        finally:
            self.log.close()
            if self.proc.returncode == 0:
                os.unlink(self.log.name)


def run_session(
    cfgs: list[RunConfig], hosts: list[str], port: int, corpus: Corpus, warmup: int, bandwidth_mbps: float
) -> list[dict[str, Any]]:
    """Step r of every variant in turn (r = 0..steps-1), each over its own connection; per-variant figures."""
    links: list[Link] = []
    try:
        for i, (cfg, host) in enumerate(zip(cfgs, hosts, strict=True)):
            sock = connect(host, port, timeout_s=30)
            send_frame(sock, json.dumps({"cfg": asdict(cfg), "index": i, "count": len(cfgs)}).encode())
            links.append(Link(sock, f"stage1@{host} ({cfg.variant.name})", shaper=shaper(cfg)))
        nodes = [build_node(cfg, 0, link) for cfg, link in zip(cfgs, links, strict=True)]
        L, steps = MODEL.seq_len, cfgs[0].steps
        step_s: list[list[float]] = [[] for _ in cfgs]
        stats: list[list[StepStats]] = [[] for _ in cfgs]
        for step in range(steps):
            for i in round_order(step, len(cfgs)):
                node, cfg = nodes[i], cfgs[i]
                batch = corpus.train_batch(0, 0, step, cfg.M * cfg.b, L)  # (M b, L+1): same data for all
                t = time.perf_counter()
                stats[i].append(train_step(node, step, batch, cfg.M))
                step_s[i].append(time.perf_counter() - t)
                print(f"  step {step} {cfg.variant.name}: {step_s[i][-1]:.2f} s", file=sys.stderr)
        fwd_sent = [link.bytes_sent for link in links]
        remote = [json.loads(link.recv(cfg.recv_timeout_s)) for link, cfg in zip(links, cfgs, strict=True)]
    finally:
        for link in links:
            link.close()
    rows = []
    for i, cfg in enumerate(cfgs):
        n_mb = steps * cfg.M
        codec = nodes[i].pipe.codec_out
        assert codec is not None
        ac = codec.codec  # type: ignore[attr-defined]
        measured = step_s[i][warmup:]
        n = len(measured)
        fwd_mb, bwd_mb = fwd_sent[i] / n_mb, remote[i]["bytes_sent"] / n_mb
        shaped_bw = bandwidth_mbps if cfg.variant.shaped else 0.0
        rows.append(
            {
                "name": cfg.variant.name,
                "k": ac.k,
                "extra_in_flight": cfg.variant.extra_in_flight,
                "tokens_per_s": n * cfg.M * cfg.b * L / sum(measured),
                "step_s": measured,
                "fwd_wire_bytes_per_mb": fwd_mb,
                "bwd_wire_bytes_per_mb": bwd_mb,
                "fwd_codec_bytes_per_mb": ac.nbytes(cfg.b, Kind.FORWARD) + FRAME_PREFIX,
                "bwd_codec_bytes_per_mb": ac.nbytes(cfg.b, Kind.BACKWARD) + FRAME_PREFIX,
                "tx_ms_per_mb": fwd_mb * 8 / (shaped_bw * 1e6) * 1e3 if shaped_bw > 0 else 0.0,
                "compute_s_per_mb": max(
                    sum(x.compute_s for x in stats[i][warmup:]), sum(remote[i]["compute_s"][warmup:])
                )
                / (n * cfg.M),
                "wait_s_per_step": [
                    sum(x.wait_s for x in stats[i][warmup:]) / n,
                    sum(remote[i]["wait_s"][warmup:]) / n,
                ],
                "loss_first_last": [remote[i]["losses"][0], remote[i]["losses"][-1]],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], warmup: int) -> None:
    base = rows[0]  # unshaped_dense
    head = (
        "| variant | k | extra | fwd B/mb wire (codec) | bwd B/mb wire (codec) | link ms/mb | compute ms/mb "
        "| tokens/s | vs unshaped | wait s/step s0, s1 | loss first->last |"
    )
    print(head, file=sys.stderr)
    print("|" + "---|" * 11, file=sys.stderr)
    for r in rows:
        print(
            f"| {r['name']} | {r['k']} | {r['extra_in_flight']} "
            f"| {r['fwd_wire_bytes_per_mb']:,.0f} ({r['fwd_codec_bytes_per_mb']:,}) "
            f"| {r['bwd_wire_bytes_per_mb']:,.0f} ({r['bwd_codec_bytes_per_mb']:,}) "
            f"| {r['tx_ms_per_mb']:.0f} | {r['compute_s_per_mb'] * 1e3:.0f} "
            f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.3f} "
            f"| {r['wait_s_per_step'][0]:.2f}, {r['wait_s_per_step'][1]:.2f} "
            f"| {r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f} |",
            file=sys.stderr,
        )
    print("\nstep times by round (s), and 1 - t(unshaped) / t(variant) of the same round:", file=sys.stderr)
    print(
        "| round | "
        + " | ".join(r["name"] for r in rows)
        + " | "
        + " | ".join(f"tax {r['name']}" for r in rows[1:])
        + " |",
        file=sys.stderr,
    )
    print("|" + "---|" * (2 * len(rows)), file=sys.stderr)
    for j, t0 in enumerate(base["step_s"]):
        times = " | ".join(f"{r['step_s'][j]:.2f}" for r in rows)
        taxes = " | ".join(f"{1 - t0 / r['step_s'][j]:.3f}" for r in rows[1:])
        print(f"| {warmup + j} | {times} | {taxes} |", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidth-mbps", type=float, default=20.0, help="shaped links, per direction (20)")
    p.add_argument("--delay-ms", type=float, default=10.0, help="shaped links, one way (10)")
    p.add_argument("--microbatches", type=int, default=16, help="M microbatches per step (16)")
    p.add_argument("--micro-batch", type=int, default=8, help="b sequences per microbatch (8)")
    p.add_argument("--steps", type=int, default=5, help="rounds: steps per variant, warm-up included (5)")
    p.add_argument("--warmup", type=int, default=1, help="rounds left out of the figures (1)")
    p.add_argument("--extra-in-flight", type=int, default=2, help="forwards stage 0 runs ahead of 1F1B (2)")
    p.add_argument("--k", type=int, default=32, help="subspace width of the compressed variant (32 = d/8)")
    p.add_argument("--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--compare-1f1b", action="store_true", help="add shaped_k32 with plain 1F1B (extra 0)")
    p.add_argument("--quick", action="store_true", help="smoke run: M=2, b=2, 2 steps, 1 warm-up")
    p.add_argument(
        "--check",
        action="store_true",
        help="build every variant's run spec, print one JSON line, start nothing",
    )
    p.add_argument("--host", default="127.0.0.1", help="stage 1's address for the unshaped variant")
    p.add_argument("--shaped-host", default=None, help="stage 1's address for shaped variants (--host)")
    p.add_argument("--listen-host", default="127.0.0.1", help="where stage 1 listens (0.0.0.0 in netns)")
    p.add_argument("--tc-shaped", action="store_true", help="bandwidth is set by tc on --shaped-host's path")
    p.add_argument(
        "--stage1-prefix", default="", help="command prefix for stage 1, e.g. 'ip netns exec crucible-b'"
    )
    p.add_argument("--stage1", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--accept-timeout-s", type=float, default=120.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage1:
        serve_stage1(args.listen_host, args.accept_timeout_s)
        return 0
    if args.quick:
        args.microbatches, args.micro_batch, args.steps, args.warmup = 2, 2, 2, 1
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup {args.warmup} must be in 0..steps-1 ({args.steps - 1})")
    if args.bandwidth_mbps <= 0 or args.delay_ms < 0:
        p.error("--bandwidth-mbps must be > 0 and --delay-ms >= 0")
    shaped_host = args.shaped_host or args.host
    e = args.extra_in_flight
    base_v = Variant(name="unshaped_dense", link_k=[], shaped=False, extra_in_flight=e)
    comp_v = Variant(name=f"shaped_k{args.k}", link_k=[args.k], shaped=True, extra_in_flight=e)
    f1b_v = Variant(name=f"shaped_k{args.k}_1f1b", link_k=[args.k], shaped=True, extra_in_flight=0)
    dense_v = Variant(name="shaped_dense", link_k=[], shaped=True, extra_in_flight=e)
    variants = [base_v, comp_v, *([f1b_v] if args.compare_1f1b else []), dense_v]
    cfgs = [
        RunConfig(
            variant=v,
            bandwidth_mbps=args.bandwidth_mbps if v.shaped and not args.tc_shaped else 0.0,
            delay_ms=args.delay_ms if v.shaped else 0.0,
            steps=args.steps,
            M=args.microbatches,
            b=args.micro_batch,
            lr=args.lr,
            wire_dtype=args.wire_dtype,
            recv_timeout_s=120.0,
        )
        for v in variants
    ]
    hosts = [shaped_host if v.shaped else args.host for v in variants]
    try:
        prefix = shlex.split(args.stage1_prefix)
        specs = {c.variant.name: c.spec() for c in cfgs}  # both stages build their stage from this spec
    except ValueError as err:
        p.error(f"--stage1-prefix/--k/--microbatches/--micro-batch: {err}")
    if args.check:
        links = {name: spec.pipeline.link_k for name, spec in specs.items()}
        print(json.dumps({"check": "ok", "bench": "pipeline", "variants": links, "hosts": hosts}))
        return 0
    torch.set_num_threads(1)

    child = Child(prefix, args.listen_host, args.accept_timeout_s)
    try:
        port = child.wait_ready(60)
        corpus = Corpus.load("stdlib", 0.01)
        t = time.perf_counter()
        rows = run_session(cfgs, hosts, port, corpus, args.warmup, args.bandwidth_mbps)
        print(f"session: {time.perf_counter() - t:.0f} s", file=sys.stderr)
        with contextlib.closing(connect(args.host, port, timeout_s=10)) as s:
            send_frame(s, json.dumps({"done": True}).encode())
    except (LinkError, OSError, RuntimeError) as err:
        print(f"bench failed: {err}\nstage 1 log tail:\n{child.tail()}", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        child.stop()
        return 1
    child.stop()

    by = {r["name"]: r for r in rows}
    base, comp, dense = by[base_v.name], by[comp_v.name], by[dense_v.name]

    def round_taxes(name: str) -> list[float]:
        pairs = zip(base["step_s"], by[name]["step_s"], strict=True)
        return [round(1 - t_a / t_v, 4) for t_a, t_v in pairs]

    print(
        f"\nb={args.micro_batch} x L={MODEL.seq_len} per microbatch, M={args.microbatches} per step, "
        f"shaped: {args.bandwidth_mbps:g} Mbit/s per direction ({'tc tbf' if args.tc_shaped else 'in-process'}) "
        f"+ {args.delay_ms:g} ms one way; extra in flight {e}; {args.steps - args.warmup} measured rounds",
        file=sys.stderr,
    )
    print_table(rows, args.warmup)
    out = {
        "bench": "pipeline",
        "model": {"d": MODEL.d_model, "n_layers": MODEL.n_layers, "seq_len": MODEL.seq_len, "stages": 2},
        "b": args.micro_batch,
        "L": MODEL.seq_len,
        "M": args.microbatches,
        "k": args.k,
        "wire_dtype": args.wire_dtype,
        "bandwidth_mbps": args.bandwidth_mbps,
        "delay_ms": args.delay_ms,
        "shaping": "tc-tbf" if args.tc_shaped else "in-process",
        "extra_in_flight": e,
        "payload_fraction": round(comp["fwd_wire_bytes_per_mb"] / dense["fwd_wire_bytes_per_mb"], 5),
        "payload_fraction_bwd": round(comp["bwd_wire_bytes_per_mb"] / dense["bwd_wire_bytes_per_mb"], 5),
        "tax": round(statistics.median(round_taxes(comp_v.name)), 4),
        "tax_per_round": round_taxes(comp_v.name),
        "tax_spread": spread(round_taxes(comp_v.name)),
        "tax_all_steps": round(1 - comp["tokens_per_s"] / base["tokens_per_s"], 4),
        "shaped_dense_tax": round(statistics.median(round_taxes(dense_v.name)), 4),
        "tokens_per_s": {r["name"]: round(r["tokens_per_s"], 1) for r in rows},
        "fwd_bytes_per_mb": {r["name"]: round(r["fwd_wire_bytes_per_mb"]) for r in rows},
        "bwd_bytes_per_mb": {r["name"]: round(r["bwd_wire_bytes_per_mb"]) for r in rows},
        "link_ms_per_mb": {
            "dense": round(dense["tx_ms_per_mb"], 1),
            f"k{args.k}": round(comp["tx_ms_per_mb"], 1),
        },
        "compute_ms_per_mb": round(base["compute_s_per_mb"] * 1e3, 1),
        "steps": args.steps,
        "warmup": args.warmup,
        "quick": args.quick,
    }
    if args.compare_1f1b:
        out["tax_1f1b"] = round(statistics.median(round_taxes(f1b_v.name)), 4)
        out["tax_1f1b_per_round"] = round_taxes(f1b_v.name)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The planner's calibration step for one host, and its prediction of the local swarm (issue #5).

The planner (coordinator/plan/planner.py) predicts GPU pools from datasheet peaks. The local swarm runs
N = R x S node processes, one torch thread each, on the C cores of one machine, so three things are
measured here before its prediction means anything:

1. **Compute.** Each stage's real inner step (node/stage_probe.py: forward + backward of M microbatches
   through the run's boundary codecs, then clipping and AdamW), one thread, alone: t_s CPU seconds
   (the process's CPU clock, so other work preempting it on a busy machine does not count). In the
   planner's FLOPs/token convention (`stage_work`, 6N + 14 L d s) that is an effective rate
   eff_s = work_s x B s / t_s. The CPU's "peak" is one thread's fp32 matmul (`measure_cpu_tflops`), and

       ceiling = sum_s work_s x B s / sum_s t_s / peak        # achievable MFU of a stage on this CPU

2. **CPU sharing.** The N probes then run at once, taking w_i wall seconds per step: C_eff =
   sum_i t_{s_i} / w_i is how many cores' worth of alone-speed work they really get (C on an idle
   machine; less under other work, cache or memory-bandwidth contention). The kernel's fair scheduler
   shares the C cores equally among runnable threads, at most one core each, so with m other runnable
   threads (other work on the machine, in equivalents) a busy node process runs at

       phi = min(1, C / (n_busy + m))            of its alone speed;  m = N (C / C_eff - 1) >= 0

   (the calibration is this formula at n_busy = N). In the run the processes also wait (pipeline
   bubble, links, outer sync) and the runnable ones share what they leave. With n_busy = sum of busy
   fractions t_s / (phi step_r), phi solves

       D(phi) + m phi = C,    D(phi) = sum_{r,s} t_s / step_r(phi)   (cores the swarm's work keeps busy)

   or phi = 1 when D(1) + m <= C (not saturated). step_r(phi) is planner.predict's step with every
   host's compute at phi x its alone speed; the left side rises with phi, so bisection finds the root.
   This mean-field model ignores moments when fewer than C threads happen to be runnable.

3. **Links.** The run spec's shaper (bandwidth_mbps per direction, delay_ms one way, so rtt = 2 delay)
   in series with the loopback TCP path it paces frames onto, measured: 1/bw = 1/shaped + 1/loopback.
   The store's PUT/GET rate when an endpoint is given (the swarm's embedded moto server), else loopback.

Reported: tokens/s from planner.predict at phi (one cost model); MFU against the machine (C cores x
peak, so the figure does not depend on how the cores were shared); tax = 1 - MFU / ceiling; $/Mtok at
the nodes' advertised price per node-hour.

crucible-swarm calibrates before it starts its nodes: a node times its matmul and reference block as it
starts (its advert, which the coordinator's prediction and placement use), and the probes here would take
the cores those timings need.

  python -m scripts.calibrate_local runs/<run>/run.toml [--store-endpoint http://127.0.0.1:PORT]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from coordinator.plan.accelerators import measure_cpu_tflops
from coordinator.plan.links import shaped_link
from coordinator.plan.planner import (
    HostGroup,
    Layout,
    ModelShape,
    Pool,
    Prediction,
    RunSettings,
    economics,
    predict,
    stage_work,
)
from coordinator.plan.spec import run_settings
from protocol.runspec import RunSpec, load_run_spec
from protocol.schema import to_dict

NODE_USD_PER_HOUR = 0.10
"""What every local swarm node advertises (`crucible-node join --price-per-hour 0.10`)."""


class CalibrationError(RuntimeError):
    """A probe failed or timed out; the message quotes what it printed."""


@dataclass(kw_only=True, frozen=True)
class Calibration:
    """What was measured on this host for one run spec (see the module docstring for the symbols)."""

    cores: int
    """C: CPU cores this process may run on; the machine's peak is C x matmul_tflops."""
    processes: int
    """N = R x S: node processes that share the cores."""
    stage_step_s: tuple[float, ...]
    """t_s: CPU seconds of one inner step of stage s, one thread, alone."""
    shared_step_s: tuple[float, ...]
    """Wall seconds of that step with all N probes running at once (mean over replicas)."""
    shared_cpu_step_s: tuple[float, ...]
    """CPU seconds of it meanwhile (above t_s when sharing cores costs cache or memory bandwidth)."""
    capacity: float
    """C_eff = sum over the N probes of t_s / shared wall seconds: cores' worth of alone-speed work."""
    other_cores: float = 0.0
    """CPU used by everything but the probes meanwhile (the swarm's idle daemons, other work)."""
    matmul_tflops: float
    """One thread's dense fp32 matmul rate: the CPU's peak per core."""
    link_mbps: float
    """Each direction: the shaper's rate in series with loopback (loopback alone when unshaped)."""
    rtt_ms: float
    """Round trip: 2 x the shaper's one-way delay + the loopback round trip."""
    store_mbps: float
    """Object store PUT/GET rate (loopback rate when no store was measured)."""
    loopback_mbps: float
    loopback_rtt_ms: float
    usd_per_node_hour: float = NODE_USD_PER_HOUR

    def __post_init__(self) -> None:
        if self.cores < 1 or self.processes < 1 or self.capacity <= 0 or self.matmul_tflops <= 0:
            raise ValueError("calibration needs cores, processes >= 1 and capacity, matmul_tflops > 0")
        if not self.stage_step_s or min(self.stage_step_s) <= 0:
            raise ValueError("calibration needs a positive step time for every stage")
        if min(self.link_mbps, self.store_mbps) <= 0 or self.rtt_ms < 0:
            raise ValueError("calibration needs link_mbps, store_mbps > 0 and rtt_ms >= 0")

    @property
    def other_threads(self) -> float:
        """m: runnable threads of other work, in equivalents, that explain C_eff (module docstring)."""
        if self.capacity >= min(self.cores, self.processes):
            return 0.0
        return self.processes * (self.cores / self.capacity - 1.0)


@dataclass(kw_only=True, frozen=True)
class LocalSwarmModel:
    """The planner's answer for the local swarm, with the sharing it was solved at."""

    prediction: Prediction
    """planner.predict at phi; MFU, tax and peak replaced by the machine's (module docstring)."""
    phi: float
    """Speed of a busy process as a fraction of alone (1 = a core of its own)."""
    busy: float
    """n_busy: node processes computing at an average moment."""
    other_threads: float
    """m: other runnable threads they share the cores with."""
    ceiling: float
    """Achievable MFU of a stage on this CPU (one thread)."""
    settings: RunSettings
    layout: Layout


# ----------------------------------------------------------------------------------- measurements
def cpu_cores() -> int:
    """Cores this process may use (affinity, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def measure_loopback(nbytes: int = 8 << 20, frame: int = 512 << 10, pings: int = 20) -> tuple[float, float]:
    """(Mbit/s, round trip ms) of a TCP connection on 127.0.0.1: `nbytes` in `frame`-sized sends, then
    `pings` one-byte round trips (median)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo() -> None:
        conn, _ = srv.accept()
        with conn:
            got = 0
            while got < nbytes:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    return
                got += len(chunk)
            conn.sendall(b"k")
            for _ in range(pings):
                conn.sendall(conn.recv(1))

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payload = b"\0" * frame
            t0 = time.perf_counter()
            for _ in range(nbytes // frame):
                c.sendall(payload)
            c.recv(1)  # the receiver has everything
            mbps = nbytes * 8 / (time.perf_counter() - t0) / 1e6
            rtts = []
            for _ in range(pings):
                t1 = time.perf_counter()
                c.sendall(b"p")
                c.recv(1)
                rtts.append(time.perf_counter() - t1)
    finally:
        srv.close()
    t.join(5)
    return mbps, sorted(rtts)[len(rtts) // 2] * 1e3


def measure_store(endpoint: str, nbytes: int) -> float:
    """Mbit/s of one PUT and one GET of `nbytes` to the S3 endpoint (bytes moved over the time of both)."""
    import uuid

    from protocol.net.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(endpoint_url=endpoint))
    key, data = f"_calibrate/{uuid.uuid4().hex}", os.urandom(nbytes)
    t0 = time.perf_counter()
    store.put(key, data)
    store.get(key)
    seconds = time.perf_counter() - t0
    store.delete(key)
    return 2 * nbytes * 8 / seconds / 1e6


class _Probe:
    """One `python -m node.stage_probe` child (line protocol in its module docstring)."""

    def __init__(self, spec: RunSpec, stage: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.stage = stage
        self.stderr = tempfile.TemporaryFile()  # a file, not a pipe: warnings can never block the probe
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node.stage_probe"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            start_new_session=True,
            env=env,
        )
        self._send(json.dumps({"spec": to_dict(spec), "stage": stage, "threads": 1}))

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _read(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        out: list[str] = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout_s)
        if not out or not out[0]:
            self.close()
            self.stderr.seek(0)
            err = self.stderr.read()[-2000:].decode(errors="replace")
            raise CalibrationError(
                f"stage probe {self.stage} gave no answer within {timeout_s:.0f} s "
                f"(exit {self.proc.poll()}): {err.strip() or 'no output'}"
            )
        return out[0].strip()

    def wait_ready(self, timeout_s: float) -> None:
        line = self._read(timeout_s)
        if line != "READY":
            raise CalibrationError(f"stage probe {self.stage} said {line!r} instead of READY")

    def start_run(self, seconds: float) -> None:
        self._send(f"run {seconds}")

    def result(self, timeout_s: float) -> tuple[float, float]:
        """(wall, CPU) seconds per step of the last `run`."""
        got = json.loads(self._read(timeout_s))
        return float(got["step_s"]), float(got["cpu_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send("quit")
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdin:
            try:
                self.proc.stdin.close()  # flushes what _send buffered
            except BrokenPipeError:  # the probe exited between poll() and the flush: nothing to tell it
                pass
        if self.proc.stdout:
            self.proc.stdout.close()


@dataclass(kw_only=True, frozen=True)
class ProbeTimes:
    """What `probe_stages` measured (Calibration's fields of the same names)."""

    stage_step_s: tuple[float, ...]
    shared_step_s: tuple[float, ...]
    shared_cpu_step_s: tuple[float, ...]
    capacity: float
    other_cores: float


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _process_cpu_s(pid: int) -> float:
    import psutil

    try:
        c = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return c.user + c.system


def probe_stages(
    spec: RunSpec, *, alone_s: float = 2.0, shared_s: float = 4.0, ready_timeout_s: float = 180.0
) -> ProbeTimes:
    """Time R x S probe processes, one thread each: replica 0's probes one at a time (the others idle
    on their stdin), then all N together."""
    R, S = spec.replicas, spec.stages
    probes = [_Probe(spec, s) for _ in range(R) for s in range(S)]
    try:
        for p in probes:
            p.wait_ready(ready_timeout_s)
        alone = []
        for p in probes[:S]:
            p.start_run(alone_s)
            alone.append(p.result(alone_s * 20 + 60)[1])
        t0, busy0 = time.perf_counter(), _busy_cpu_s()
        probe0 = sum(_process_cpu_s(p.proc.pid) for p in probes)
        for p in probes:
            p.start_run(shared_s)
        shared = [p.result(shared_s * 20 + 60) for p in probes]  # probe i = r S + s
        probe_cpu = sum(_process_cpu_s(p.proc.pid) for p in probes) - probe0
        other = max(0.0, (_busy_cpu_s() - busy0 - probe_cpu) / (time.perf_counter() - t0))
    finally:
        for p in probes:
            p.close()

    def per_stage(j: int) -> tuple[float, ...]:
        return tuple(sum(shared[r * S + s][j] for r in range(R)) / R for s in range(S))

    return ProbeTimes(
        stage_step_s=tuple(alone),
        shared_step_s=per_stage(0),
        shared_cpu_step_s=per_stage(1),
        capacity=sum(alone[i % S] / wall for i, (wall, _) in enumerate(shared)),
        other_cores=other,
    )


def link_figures(spec: RunSpec, loopback_mbps: float, loopback_rtt_ms: float) -> tuple[float, float]:
    """(Mbit/s, rtt ms) of a pipeline link: the shaper in series with loopback (module docstring)."""
    return shaped_link(loopback_mbps, loopback_rtt_ms, spec.pipeline.bandwidth_mbps, spec.pipeline.delay_ms)


def calibrate(
    spec: RunSpec,
    *,
    store_endpoint: str | None = None,
    alone_s: float = 2.0,
    shared_s: float = 4.0,
    usd_per_node_hour: float = NODE_USD_PER_HOUR,
) -> Calibration:
    """Measure compute (alone and shared), loopback, and the store for `spec` on this host."""
    loop_mbps, loop_rtt = measure_loopback()
    mbps, rtt = link_figures(spec, loop_mbps, loop_rtt)
    store_mbps = loop_mbps
    if store_endpoint:
        shape = ModelShape.from_spec(spec.model)
        store_mbps = measure_store(store_endpoint, max(1 << 20, 4 * shape.n_params // spec.stages))
    times = probe_stages(spec, alone_s=alone_s, shared_s=shared_s)
    return Calibration(
        cores=cpu_cores(),
        processes=spec.replicas * spec.stages,
        stage_step_s=times.stage_step_s,
        shared_step_s=times.shared_step_s,
        shared_cpu_step_s=times.shared_cpu_step_s,
        capacity=times.capacity,
        other_cores=times.other_cores,
        matmul_tflops=measure_cpu_tflops(threads=1, repeats=10),
        link_mbps=mbps,
        rtt_ms=rtt,
        store_mbps=store_mbps,
        loopback_mbps=loop_mbps,
        loopback_rtt_ms=loop_rtt,
        usd_per_node_hour=usd_per_node_hour,
    )


# ------------------------------------------------------------------------------------- prediction
def local_swarm_model(spec: RunSpec, cal: Calibration) -> LocalSwarmModel:
    """Solve the CPU sharing phi (module docstring, point 2) and predict at it."""
    if len(cal.stage_step_s) != spec.stages or cal.processes != spec.replicas * spec.stages:
        raise ValueError(
            f"calibration is for {cal.processes} processes and {len(cal.stage_step_s)} stages; the run has "
            f"{spec.replicas} x {spec.stages}: calibrate again for this run spec"
        )
    shape = ModelShape.from_spec(spec.model)
    R, S = spec.replicas, spec.stages
    layers = tuple(b - a for a, b in spec.layer_ranges())
    tokens_step = spec.train.batch_size * spec.model.seq_len  # B s, per replica and inner step
    work = stage_work(shape, layers)  # FLOPs per token of each stage
    eff = [w * tokens_step / t for w, t in zip(work, cal.stage_step_s, strict=True)]  # FLOP/s, alone
    peak = cal.matmul_tflops * 1e12
    ceiling = min(1.0, sum(work) * tokens_step / sum(cal.stage_step_s) / peak)
    settings = run_settings(spec, ceiling)

    def model_at(phi: float) -> tuple[Prediction, Layout, float]:
        groups = tuple(
            HostGroup(
                name=f"stage{s}",
                count=R,
                tflops=phi * eff[s] / ceiling / 1e12,
                usd_per_gpu_hour=cal.usd_per_node_hour,
                link_mbps=cal.link_mbps,
                rtt_ms=cal.rtt_ms,
                store_mbps=cal.store_mbps,
            )
            for s in range(S)
        )
        hosts = Pool(hosts=groups).expand()
        layout = Layout(
            replicas=tuple(tuple(hosts[s * R + r] for s in range(S)) for r in range(R)), layers=layers
        )
        pred = predict(shape, layout, settings)
        demand = sum(t / step for step in pred.step_s for t in cal.stage_step_s)
        return pred, layout, demand

    C, m = float(cal.cores), cal.other_threads
    pred, layout, demand = model_at(1.0)
    phi = 1.0
    if demand + m > C:  # saturated: bisect D(phi) + m phi = C, increasing in phi
        lo, hi = 0.0, 1.0
        while hi - lo > 1e-9:
            phi = (lo + hi) / 2
            pred, layout, demand = model_at(phi)
            lo, hi = (phi, hi) if demand + m * phi < C else (lo, phi)
    econ = economics(
        tokens_per_s=pred.tokens_per_s,
        n_gpus=cal.processes,
        peak_tflops_per_gpu=cal.cores * cal.matmul_tflops / cal.processes,
        flops_per_token=pred.flops_per_token,
        usd_per_gpu_hour=cal.usd_per_node_hour,
        ceiling=ceiling,
    )
    machine = replace(
        pred,
        effective_mfu=econ.effective_mfu,
        tax=econ.tax,
        peak_tflops=cal.cores * cal.matmul_tflops,
        usd_per_mtok=econ.usd_per_mtok,
    )
    return LocalSwarmModel(
        prediction=machine,
        phi=phi,
        busy=demand / phi,
        other_threads=m,
        ceiling=ceiling,
        settings=settings,
        layout=layout,
    )


def predict_local_swarm(spec: RunSpec, calibration: Calibration) -> Prediction:
    """planner.predict for the local swarm described by `calibration` (see `local_swarm_model`).

    tokens/s, step_s, links and breakdown are the planner's (the breakdown as shares of the node
    processes' time); effective_mfu, tax and peak_tflops are against the machine's C cores.
    """
    return local_swarm_model(spec, calibration).prediction


def describe(cal: Calibration, model: LocalSwarmModel) -> str:
    """Human-readable lines: what was measured and what the planner predicts from it."""
    p = model.prediction
    ln = p.links[0] if p.links else None
    link = (
        f"link {cal.link_mbps:,.0f} Mbit/s, rtt {cal.rtt_ms:.2f} ms, k={ln.k}, "
        f"{ln.bytes_per_microbatch / 1e3:.0f} kB/message ({ln.transfer_s * 1e3:.1f} ms)"
        if ln
        else "no pipeline links"
    )
    steps = " / ".join(f"{t:.3f}" for t in cal.stage_step_s)
    shared = " / ".join(f"{t:.3f}" for t in cal.shared_step_s)
    return "\n".join(
        [
            f"  calibration: {cal.processes} node processes on {cal.cores} cores; one thread: matmul "
            f"{cal.matmul_tflops * 1e3:.1f} GFLOP/s, stage step {steps} CPU s alone (ceiling "
            f"{model.ceiling:.1%}), {shared} s with all {cal.processes} busy: capacity {cal.capacity:.2f} cores "
            f"(other work {cal.other_cores:.2f} cores, {cal.other_threads:.1f} threads)",
            f"  {link}; store {cal.store_mbps:,.0f} Mbit/s",
            f"  calibrated prediction: {p.tokens_per_s:,.0f} tokens/s (busy node processes {model.busy:.2f}, each at "
            f"{model.phi:.0%} of a core), MFU {p.effective_mfu:.1%} of {p.peak_tflops * 1e3:.0f} GFLOP/s, "
            f"tax {p.tax:.1%}, ${p.usd_per_hour:.2f}/h, ${p.usd_per_mtok:,.3f}/Mtok",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.calibrate_local",
        description="Calibrate the planner on this host for a run spec and predict the local swarm.",
        epilog="example: python -m scripts.calibrate_local runs/swarm-1/run.toml "
        "--store-endpoint http://127.0.0.1:5000",
    )
    ap.add_argument("run_toml", help="run spec (example: docs/examples/run.toml)")
    ap.add_argument("--store-endpoint", help="S3 endpoint to measure (example: http://127.0.0.1:5000)")
    ap.add_argument("--json", action="store_true", help="print the calibration as JSON")
    args = ap.parse_args(argv)
    try:
        spec = load_run_spec(args.run_toml)
        cal = calibrate(spec, store_endpoint=args.store_endpoint)
    except (ValueError, CalibrationError) as e:
        print(f"calibrate: {e}", file=sys.stderr)
        return 2
    model = local_swarm_model(spec, cal)
    print(json.dumps(to_dict(cal), indent=2) if args.json else describe(cal, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

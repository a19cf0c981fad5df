"""GPU benchmark of the node's own code: stage MFU, SparseLoCo on the device, low-bandwidth tax.

  python -m scripts.bench_gpu                          # on a GPU host: a few minutes
  python -m scripts.bench_gpu --smoke                  # all three parts, tiny, on the CPU (seconds)
  python -m scripts.bench_gpu --no-compile --json-out runs/bench_gpu.json
  python -m scripts.bench_gpu --check                  # build every part's spec, print one JSON line

Runs where only torch, numpy and msgpack are importable (no hivemind, boto3, moto, cryptography, base58,
psutil, no object store): it imports the stage, the inner step, the pipeline schedule, the links and the
codecs, nothing that signs or talks to a DHT or a store.

1. stage: a middle stage (no embedding, no head) of `--layers` Llama-3-8B-width blocks (d 4096, 32 heads,
   d_ff 14336, plain MHA), microbatch `--microbatch` x seq `--seq`, trained through `node.inner_step`
   (the worker's own step: fused AdamW, clipping, bf16 autocast over fp32 master weights; torch.compile
   on CUDA unless --no-compile). MFU = tokens/s x (6 N_stage + 12 l d s) / peak, peak from
   coordinator/plan/accelerators.py (the datasheet's dense bf16 figure; on the CPU a measured matmul).
2. sparseloco: `protocol.codecs.sparseloco_device.error_feedback_step_device` on an `--ef-params`-parameter stage
   of 8B-shaped matrices: seconds from (e, Delta) on the device to kept indices and codes on the host;
   then, separately, the host's Golomb coding (`pack_payload`), and how many inner steps of such a stage
   that coding needs (it runs on the I/O thread during the tau steps of overlap); an inner step is M
   (--M) microbatches at part 1's time per microbatch, scaled to the stage's parameters. Also checks that the same
   fragment decodes bit-identically on the device and on the CPU, and aggregates identically.
3. pipeline: two stage processes sharing the device, over loopback TCP through `node.pipeline.transport.Link`,
   subspace links k = d/8 with bfloat16 on the wire, the transport's shaper at --bandwidth-mbps per
   direction + --delay-ms one way against the same pair unshaped: tax = 1 - tokens/s(shaped) /
   tokens/s(unshaped). M microbatches per step, extra_in_flight as given.

Prints progress on stderr and one JSON line last on stdout, also written to --json-out. A part that fails
records its error in the JSON and the others still run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from coordinator.plan.accelerators import ACCELERATORS, measure_cpu_tflops
from coordinator.plan.planner import ATTENTION_COEF_PALM, ModelShape
from node.device import describe, resolve_device, resolve_precision, synchronize
from node.inner_step import inner_step, make_optimizer, prepare_stage
from node.model import Stage, build_stage
from node.pipeline.schedule import PipelineStage
from node.pipeline.transport import Link, Shaper, connect, listen
from node.subspace_model import boundary_codecs, constrain_stage
from node.sync.aggregation import aggregate
from protocol.codecs.sparseloco import SparseLoCoConfig, decompress, error_feedback_step
from protocol.codecs.sparseloco_device import decompress_to, error_feedback_step_device
from protocol.codecs.sparseloco_format import pack_payload
from protocol.memory import GB, stage_memory
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, TrainSpec
from protocol.sync_settings import AggregationSettings

ROOT = Path(__file__).resolve().parents[1]
READY = "BENCH-GPU-STAGE1-READY"
RESULT = "BENCH-GPU-RESULT"
PARTS = ("stage", "sparseloco", "pipeline")


def log(msg: str) -> None:
    print(f"[bench_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_spec(a: argparse.Namespace, n_layers: int) -> ModelSpec:
    return ModelSpec(
        vocab=256, d_model=a.d_model, n_layers=n_layers, n_heads=a.n_heads, d_ff=a.d_ff, seq_len=a.seq
    )


def peak_tflops(device: torch.device, override: float) -> tuple[float, str]:
    """The MFU denominator: --peak-tflops, else the accelerator table's entry for this GPU's name."""
    if override > 0:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return measure_cpu_tflops(), "measured CPU matmul"
    name = torch.cuda.get_device_name(device).lower()
    for key in sorted(ACCELERATORS, key=len, reverse=True):
        family = key.split("-")[0]
        if family in name and (("pcie" in key) == ("pcie" in name)):
            return ACCELERATORS[key].peak_tflops, f"accelerator table: {key}"
    raise ValueError(f"no accelerator table entry for {name!r}; pass --peak-tflops")


# --- 1. stage MFU ----------------------------------------------------------------------------------------


def bench_stage(a: argparse.Namespace, device: torch.device, precision: str) -> dict[str, Any]:
    ms = model_spec(a, a.layers + 2)
    module = Stage(ms, 1, 1 + a.layers, first=False, last=False)  # a middle stage: no embedding, no head
    prepare_stage(module, device, precision, compile=a.compile)  # type: ignore[arg-type]
    train = TrainSpec(total_steps=10**6, batch_size=a.microbatch, microbatches=1, warmup_steps=1, lr=1e-4)
    opt = make_optimizer(module, train)
    g = torch.Generator(device=device).manual_seed(0)
    x = 0.02 * torch.randn(a.microbatch, a.seq, a.d_model, device=device, generator=g)  # (b, L, d)
    grad_out = 1e-3 * torch.randn(x.shape, device=device, generator=g)

    def forward_backward() -> None:
        module(x.detach().requires_grad_(True)).backward(grad_out)

    t = time.perf_counter()
    inner_step(module, opt, train, 0, forward_backward)
    synchronize(device)
    first_s = time.perf_counter() - t
    for step in range(1, a.warmup):
        inner_step(module, opt, train, step, forward_backward)
    synchronize(device)
    t = time.perf_counter()
    for step in range(a.steps):
        inner_step(module, opt, train, a.warmup + step, forward_backward)
    synchronize(device)
    step_s = (time.perf_counter() - t) / a.steps
    shape = ModelShape.from_spec(ms)
    n_stage = a.layers * shape.layer_params
    flops_per_token = 6 * n_stage + ATTENTION_COEF_PALM * a.layers * a.d_model * a.seq
    tokens_per_s = a.microbatch * a.seq / step_s
    peak, peak_from = peak_tflops(device, a.peak_tflops)
    tflops = tokens_per_s * flops_per_token / 1e12
    out = {
        "layers": a.layers,
        "microbatch": a.microbatch,
        "seq": a.seq,
        "params": n_stage,
        "compiled": bool(a.compile and device.type == "cuda"),
        "first_step_s": round(first_s, 2),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(tflops, 2),
        "peak_tflops": peak,
        "peak_from": peak_from,
        "mfu": round(tflops / peak, 4),
    }
    return out


# --- 2. SparseLoCo on the device -------------------------------------------------------------------------


def ef_shapes(a: argparse.Namespace, n_params: int) -> list[tuple[int, int]]:
    """8B-shaped matrices (wq, wk, wv, wo, w_gate, w_up, w_down per layer) until n_params are reached."""
    d, f = a.d_model, a.d_ff
    layer = [(d, d)] * 4 + [(f, d), (f, d), (d, f)]
    shapes: list[tuple[int, int]] = []
    while sum(r * c for r, c in shapes) < n_params:
        shapes.extend(layer)
    return shapes


def bench_sparseloco(a: argparse.Namespace, device: torch.device, step_s_per_param: float) -> dict[str, Any]:
    cfg = SparseLoCoConfig(beta=0.95)
    shapes = ef_shapes(a, a.ef_params)
    n = sum(r * c for r, c in shapes)
    g = torch.Generator(device=device).manual_seed(1)
    delta = [1e-3 * torch.randn(s, device=device, generator=g) for s in shapes]
    e = [torch.zeros(s, device=device) for s in shapes]
    cf, e = error_feedback_step_device(e, delta, cfg)  # warm-up (allocator, kernels)
    times = []
    for _ in range(a.ef_repeats):
        synchronize(device)
        t = time.perf_counter()
        cf, e = error_feedback_step_device(e, delta, cfg)  # ends with codes and indices on the host
        times.append(time.perf_counter() - t)
    device_s = min(times)
    t = time.perf_counter()
    payload = pack_payload(cf)
    host_s = time.perf_counter() - t
    # an inner step of a stage this size: M microbatches (part 3's --M) at part 1's time per microbatch
    step_s = step_s_per_param * n * a.M
    steps_needed = math.ceil(host_s / step_s) if step_s > 0 else None
    # the reference numpy path on the host, on a slice, for the ratio
    ref_shapes = shapes[: max(1, len(shapes) // 8)]
    ref_n = sum(r * c for r, c in ref_shapes)
    ref_delta = [d.cpu() for d in delta[: len(ref_shapes)]]
    t = time.perf_counter()
    error_feedback_step([torch.zeros(s) for s in ref_shapes], ref_delta, cfg)
    ref_s = time.perf_counter() - t
    del e, delta
    # the same bytes decode identically on the device and the CPU, and aggregate identically on the host
    few = [torch.randn(s, device=device, generator=g) for s in (shapes[0], shapes[-1])]
    cfs = [
        error_feedback_step_device([torch.zeros_like(t) for t in few], [t * (1 + r) for t in few], cfg)[0]
        for r in range(2)
    ]  # two replicas' fragments of a (d, d) and a (d, d_ff) matrix
    on_cpu = [decompress(c) for c in cfs]
    on_dev = [[t.cpu() for t in decompress_to(c, device)] for c in cfs]
    decode_equal = all(
        torch.equal(x, y) for xs, ys in zip(on_cpu, on_dev, strict=True) for x, y in zip(xs, ys, strict=True)
    )
    agg_cfg = AggregationSettings()
    agg_cpu = aggregate(dict(enumerate(on_cpu)), agg_cfg).tensors
    agg_dev = aggregate(dict(enumerate(on_dev)), agg_cfg).tensors
    aggregate_equal = all(torch.equal(x, y) for x, y in zip(agg_cpu, agg_dev, strict=True))
    return {
        "params": n,
        "device_s": round(device_s, 4),
        "device_gbps": round(n * 4 / device_s / 1e9, 2),
        "host_coding_s": round(host_s, 6),
        "payload_bytes": len(payload),
        "ratio_vs_fp32": round(n * 4 / len(payload), 1),
        "inner_step_s_at_this_size": round(step_s, 4),
        "microbatches_per_step": a.M,
        "host_coding_inner_steps": steps_needed,
        "tau": a.tau,
        "host_coding_within_tau": steps_needed is not None and steps_needed <= a.tau,
        "reference_cpu_gbps": round(ref_n * 4 / ref_s / 1e9, 3),
        "decode_cuda_equals_cpu": decode_equal,
        "aggregate_cuda_equals_cpu": aggregate_equal,
    }


# --- 3. two stage processes over shaped TCP --------------------------------------------------------------


def pipeline_spec(a: argparse.Namespace) -> RunSpec:
    ms = model_spec(a, 2 * a.pipe_layers)
    return RunSpec(
        run_id="bench-gpu",
        stages=2,
        model=ms,
        train=TrainSpec(
            total_steps=10**6, batch_size=a.M * a.microbatch, microbatches=a.M, warmup_steps=1, lr=1e-4
        ),
        pipeline=PipelineSpec(
            link_k=[a.d_model // 8], wire_dtype="bfloat16", extra_in_flight=a.extra_in_flight
        ),
    )


def run_stage(a: argparse.Namespace, stage: int, port: int, shaped: bool) -> None:
    """A child process: one stage of the pair; stage 1 listens, stage 0 connects and times the steps."""
    device, _ = resolve_device(a.device)
    precision = resolve_precision("auto", device)
    spec = pipeline_spec(a)
    shaper = Shaper(bandwidth_mbps=a.bandwidth_mbps, delay_ms=a.delay_ms) if shaped else Shaper()
    if stage == 1:
        srv = listen("127.0.0.1", 0)
        srv.settimeout(600)
        print(f"{READY} {srv.getsockname()[1]}", flush=True)
        sock, _ = srv.accept()
    else:
        sock = connect("127.0.0.1", port, timeout_s=600)
    link = Link(sock, f"stage {1 - stage}", shaper=shaper)
    ranges = spec.layer_ranges()
    module = build_stage(spec.model, ranges, stage)
    constrain_stage(module, spec.model, spec.pipeline, ranges, stage)
    prepare_stage(module, device, precision, compile=a.compile)
    codec_in, codec_out = boundary_codecs(module, spec.model, spec.pipeline, ranges, stage)
    pipe = PipelineStage(
        module,
        stage=stage,
        n_stages=2,
        prev=link if stage == 1 else None,
        next=link if stage == 0 else None,
        codec_in=codec_in,
        codec_out=codec_out,
        recv_timeout_s=600,
        extra_in_flight=a.extra_in_flight,
        device=device,
    )
    opt = make_optimizer(module, spec.train)
    g = torch.Generator().manual_seed(2)
    step_s, waits = [], []
    for step in range(a.warmup + a.steps):
        batch = (
            torch.randint(0, spec.model.vocab, (spec.train.batch_size, a.seq + 1), generator=g)
            if stage == 0
            else None
        )
        t = time.perf_counter()
        stats = inner_step(module, opt, spec.train, step, lambda: pipe.train_step(step, batch, a.M))  # noqa: B023
        synchronize(device)
        step_s.append(time.perf_counter() - t)
        waits.append(stats.wait_s)
        log(f"stage {stage} {'shaped' if shaped else 'unshaped'} step {step}: {step_s[-1]:.3f} s")
    link.flush(60)
    link.close()
    est = stage_memory(spec, stage, precision)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    res = {"step_s": step_s, "wait_s": waits, "bytes_sent": link.bytes_sent}
    res["memory_peak_gb"] = round(peak / GB, 2)  # what the allocator held at most (0 on the CPU)
    res["memory_estimate_gb"] = round((est.total - est.outer_state) / GB, 2)  # no outer sync here
    print(RESULT + " " + json.dumps(res), flush=True)


def _child(a: argparse.Namespace, stage: int, port: int, shaped: bool) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "scripts.bench_gpu", "--child-stage", str(stage), "--child-port", str(port)]
    argv += ["--child-shaped"] if shaped else []
    argv += a.passthrough
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.smoke:
        env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def _result(p: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    out, _ = p.communicate(timeout=timeout_s)
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"stage process exited {p.returncode} without a result")


def run_pair(a: argparse.Namespace, shaped: bool) -> dict[str, Any]:
    s1 = _child(a, 1, 0, shaped)
    try:
        assert s1.stdout is not None
        line = s1.stdout.readline()
        if not line.startswith(READY):
            raise RuntimeError(f"stage 1 did not start: {line!r}")
        s0 = _child(a, 0, int(line.split()[1]), shaped)
        try:
            r0 = _result(s0, a.pair_timeout_s)
        finally:
            if s0.poll() is None:
                s0.kill()
        r1 = _result(s1, 60)
    finally:
        if s1.poll() is None:
            s1.kill()
    measured = r0["step_s"][a.warmup :]
    step_s = sorted(measured)[len(measured) // 2]  # median
    tokens = a.M * a.microbatch * a.seq
    return {
        "step_s_median": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "wait_s_per_step": [round(sum(r["wait_s"][a.warmup :]) / len(measured), 4) for r in (r0, r1)],
        "fwd_bytes_per_mb": r0["bytes_sent"] // ((a.warmup + a.steps) * a.M),
        "memory_peak_gb": [r0["memory_peak_gb"], r1["memory_peak_gb"]],
        "memory_estimate_gb": [r0["memory_estimate_gb"], r1["memory_estimate_gb"]],
    }


def bench_pipeline(a: argparse.Namespace) -> dict[str, Any]:
    unshaped = run_pair(a, shaped=False)
    shaped = run_pair(a, shaped=True)
    spec = pipeline_spec(a)
    return {
        "layers_per_stage": a.pipe_layers,
        "M": a.M,
        "microbatch": a.microbatch,
        "extra_in_flight": a.extra_in_flight,
        "k": a.d_model // 8,
        "wire_dtype": spec.pipeline.wire_dtype,
        "bandwidth_mbps": a.bandwidth_mbps,
        "delay_ms": a.delay_ms,
        "unshaped": unshaped,
        "shaped": shaped,
        "tax": round(1 - shaped["tokens_per_s"] / unshaped["tokens_per_s"], 4),
    }


# --- main ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench_gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="all three parts, tiny, on the CPU (a CI check)")
    ap.add_argument(
        "--check", action="store_true", help="build every part's specs, print one JSON line, run nothing"
    )
    ap.add_argument("--device", default="auto", help="auto|cuda|cuda:N|cpu (default auto)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="do not torch.compile (CUDA)")
    ap.add_argument("--parts", default="stage,sparseloco,pipeline", help="comma-separated parts to run")
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--n-heads", type=int, default=32)
    ap.add_argument("--d-ff", type=int, default=14336)
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    ap.add_argument("--microbatch", type=int, default=4, help="sequences per microbatch (default 4)")
    ap.add_argument("--layers", type=int, default=4, help="part 1: layers of the middle stage (default 4)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="MFU denominator (default: table)")
    ap.add_argument("--ef-params", type=float, default=1.95e9, help="part 2: stage parameters (1.95e9)")
    ap.add_argument("--ef-repeats", type=int, default=3)
    ap.add_argument("--tau", type=int, default=2, help="part 2: overlap steps the host coding must fit in")
    ap.add_argument("--pipe-layers", type=int, default=2, help="part 3: layers per stage (default 2)")
    ap.add_argument("--M", type=int, default=24, help="part 3: microbatches per step (default 24)")
    ap.add_argument("--extra-in-flight", type=int, default=4, help="part 3 (default 4)")
    ap.add_argument("--bandwidth-mbps", type=float, default=1000.0, help="part 3 shaper (default 1000)")
    ap.add_argument("--delay-ms", type=float, default=25.0, help="part 3 one-way delay (default 25)")
    ap.add_argument("--pair-timeout-s", type=float, default=600.0)
    ap.add_argument("--json-out", type=Path, default=ROOT / "runs" / "bench_gpu.json")
    ap.add_argument("--child-stage", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--child-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-shaped", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke:  # tiny shapes, CPU: every code path, no meaningful figure
        a.device, a.compile = "cpu", False
        a.d_model, a.n_heads, a.d_ff, a.seq, a.microbatch = 64, 4, 172, 32, 2
        a.layers, a.warmup, a.steps, a.ef_params, a.ef_repeats = 2, 1, 2, 2e5, 1
        a.pipe_layers, a.M, a.extra_in_flight, a.bandwidth_mbps, a.delay_ms = 1, 4, 2, 50.0, 2.0
    a.ef_params = int(a.ef_params)
    a.parts = [p for p in a.parts.split(",") if p]
    unknown = sorted(set(a.parts) - set(PARTS))
    if unknown or not a.parts:
        ap.error(f"--parts: unknown part(s) {unknown}; choose from {','.join(PARTS)}")
    keep = ("device", "d_model", "n_heads", "d_ff", "seq", "microbatch", "warmup", "steps")
    keep += ("pipe_layers", "M", "extra_in_flight", "bandwidth_mbps", "delay_ms")
    a.passthrough = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keep]
    a.passthrough += [] if a.compile else ["--no-compile"]
    return a


def check(a: argparse.Namespace) -> dict[str, Any]:
    """--check: the specs each selected part builds (stage, the pair's run spec and its memory estimate,
    the SparseLoCo config), nothing allocated or started. `auto` is not resolved (that claims a GPU): it
    stands for cuda:0 where torch sees a GPU."""
    if a.device == "auto":
        device = torch.device("cuda", 0) if torch.cuda.device_count() else torch.device("cpu")
    else:
        device = resolve_device(a.device)[0]
    precision = resolve_precision("auto", device)
    out: dict[str, Any] = {"check": "ok", "bench": "gpu", "device": str(device), "parts": a.parts}
    if "stage" in a.parts:
        ms = model_spec(a, a.layers + 2)  # and the TrainSpec bench_stage trains under
        TrainSpec(total_steps=10**6, batch_size=a.microbatch, microbatches=1, warmup_steps=1, lr=1e-4)
        out["stage_params"] = a.layers * ModelShape.from_spec(ms).layer_params
        if device.type == "cuda":
            out["peak_tflops"] = peak_tflops(device, a.peak_tflops)[0]
    if "sparseloco" in a.parts:
        out["ef_params"] = sum(r * c for r, c in ef_shapes(a, a.ef_params))
    if "pipeline" in a.parts:
        spec = pipeline_spec(a)
        est = [stage_memory(spec, s, precision) for s in range(spec.stages)]
        out["pipeline_memory_estimate_gb"] = [round((e.total - e.outer_state) / GB, 2) for e in est]
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.check:
        try:
            print(json.dumps(check(a)))
        except ValueError as e:  # DeviceError is one too
            raise SystemExit(f"bench_gpu: error: {e}") from None
        return 0
    if a.child_stage >= 0:
        if a.smoke or a.device == "cpu":
            torch.set_num_threads(1)
        run_stage(a, a.child_stage, a.child_port, a.child_shaped)
        return 0
    device, _ = resolve_device(a.device)
    precision = resolve_precision("auto", device)
    a.passthrough = [f"--device={device}" if x.startswith("--device=") else x for x in a.passthrough]
    log(f"device {describe(device)}, precision {precision}, compile {a.compile and device.type == 'cuda'}")
    parts = set(a.parts)
    result: dict[str, Any] = {"device": describe(device), "precision": precision, "torch": torch.__version__}
    scale = {"step_s_per_param": 0.0}  # part 1's step time per parameter, for part 2's overlap check

    def save() -> None:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result) + "\n")

    for part, run in (
        ("stage", lambda: bench_stage(a, device, precision)),
        ("sparseloco", lambda: bench_sparseloco(a, device, scale["step_s_per_param"])),
        ("pipeline", lambda: bench_pipeline(a)),
    ):
        if part not in parts:
            continue
        log(f"part {part} ...")
        t = time.perf_counter()
        try:
            result[part] = run()
        except Exception as e:  # record and go on: one failing part must not hide the others' figures
            result[part] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        result[part]["wall_s"] = round(time.perf_counter() - t, 1)
        if part == "stage" and "step_s" in result[part]:
            scale["step_s_per_param"] = result[part]["step_s"] / result[part]["params"]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"part {part}: {json.dumps(result[part])[:600]}")
        save()
    print(json.dumps(result), flush=True)
    failed = [p for p in parts if "error" in result.get(p, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

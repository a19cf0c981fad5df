"""Quality cost of the subspace constraint: a 2-stage pipeline with a k/d = 1/8 link vs the dense one.

  python -m scripts.bench_subspace_quality [--quick] [--steps 300] [--k 32] [--wire-dtype float32] [--check]

Both arms train the same Llama-style model (d=256, 4 layers, seq 256, batch 8 by default) from the same
seeds on the same standard-library token stream with AdamW; every boundary crossing goes through the
real codec as bytes (Z forward, G_Z backward; the dense arm through the same codec at k = d). Reports
validation bits-per-byte (loss / ln 2; byte vocabulary, so bits per token = bits per byte) of both arms and
the relative gap, as a table on stderr and one JSON line last on stdout. Each stage takes the worker's own
inner step (node/inner_step.py: lr schedule, project_grads_, clipping, AdamW, project_weights_) under a
`TrainSpec` built from the flags.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from node.data.corpus import Corpus
from node.device import resolve_precision
from node.inner_step import InnerOptimizer, inner_step, lr_at, make_optimizer, prepare_stage
from node.model import Stage, build_stage, lm_loss
from node.subspace_model import boundary_codecs, constrain_stage, off_subspace
from protocol.codecs.subspace import SubspaceBoundary
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, TrainSpec

CPU = torch.device("cpu")


@dataclass
class Arm:
    name: str
    stages: list[Stage]
    codecs: list[tuple[SubspaceBoundary | None, SubspaceBoundary | None]]
    opts: list[InnerOptimizer]
    wire_fwd: int = 0
    wire_bwd: int = 0
    train_s: float = 0.0


def build_arm(
    name: str, spec: ModelSpec, pspec: PipelineSpec, ranges: list[tuple[int, int]], train: TrainSpec
) -> Arm:
    stages = [build_stage(spec, ranges, s) for s in range(len(ranges))]
    for s, stage in enumerate(stages):
        constrain_stage(stage, spec, pspec, ranges, s)  # no-op for the dense arm
        prepare_stage(stage, CPU, resolve_precision(train.precision, CPU))
    codecs = [boundary_codecs(stage, spec, pspec, ranges, s) for s, stage in enumerate(stages)]
    opts: list[InnerOptimizer] = [make_optimizer(st, train) for st in stages]
    return Arm(name, stages, codecs, opts)


def forward(arm: Arm, tokens: torch.Tensor, step: int, kind: str) -> tuple[torch.Tensor, list, list]:
    """Run the pipeline; each boundary crosses as an encoded message. Returns loss, sent outputs, leaves."""
    x: torch.Tensor = tokens[:, :-1]  # (b, L) token ids
    outs, leaves = [], []
    for s, stage in enumerate(arm.stages):
        out = stage(x)
        if s == len(arm.stages) - 1:
            return lm_loss(out, tokens), outs, leaves
        codec_out, codec_in = arm.codecs[s][1], arm.codecs[s + 1][0]
        assert codec_out is not None and codec_in is not None
        msg = codec_out.pack_fwd(kind, step, 0, out, tokens)
        arm.wire_fwd = len(msg)
        _, _, _, X_hat, tokens = codec_in.unpack_fwd(msg)
        x = X_hat.requires_grad_(kind == "train")  # (b, L, d) leaf on the receiving stage
        outs.append(out)
        leaves.append(x)
    raise AssertionError("unreachable")


def train_step(arm: Arm, tokens: torch.Tensor, step: int, train: TrainSpec) -> float:
    """One inner step of every stage. The whole pipeline's forward/backward runs once; around it, each
    stage's `inner_step` zeroes its gradients first and then projects, clips and steps its own parameters
    (each stage is one node: clipping is per stage). Stage s's inner_step wraps stage s+1's, so the
    forward/backward sits innermost; the stages' steps touch disjoint parameters, so their order is free."""

    def forward_backward() -> float:
        loss, outs, leaves = forward(arm, tokens, step, "train")
        loss.backward()
        for s in reversed(range(len(arm.stages) - 1)):
            codec_in, codec_out = arm.codecs[s + 1][0], arm.codecs[s][1]
            assert codec_in is not None and codec_out is not None
            msg = codec_in.pack_bwd(step, 0, leaves[s].grad)  # G_Z = G_X U
            arm.wire_bwd = len(msg)
            outs[s].backward(codec_out.unpack_bwd(msg)[2])  # G_Z U^T
        return float(loss.detach())

    t0 = time.perf_counter()
    run: Callable[[], float] = forward_backward
    for stage, opt in reversed(list(zip(arm.stages, arm.opts, strict=True))):
        run = partial(inner_step, stage, opt, train, step, run)
    loss = run()
    arm.train_s += time.perf_counter() - t0
    return loss


@torch.no_grad()
def evaluate(arm: Arm, batches: list[torch.Tensor]) -> float:
    """Mean validation loss in bits per byte."""
    nats = sum(float(forward(arm, b, i, "eval")[0]) for i, b in enumerate(batches)) / len(batches)
    return nats / math.log(2)


def bench_model(args: argparse.Namespace) -> ModelSpec:
    """The benches' Llama of --d-model, --n-layers and --seq-len: 4 heads, SwiGLU width 8d/3 rounded to 8."""
    return ModelSpec(
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=4,
        d_ff=round(8 * args.d_model / 3 / 8) * 8,
        seq_len=args.seq_len,
    )


def arm_specs(args: argparse.Namespace, train: TrainSpec) -> dict[str, RunSpec]:
    """The 2-stage run each arm trains: dense links, and one k-wide subspace link (the spec checks k <= d)."""
    model = bench_model(args)
    links = {"dense": [], "subspace": [args.k]}
    return {
        name: RunSpec(
            run_id=f"bench-subspace-{name}",
            stages=2,
            model=model,
            train=train,
            pipeline=PipelineSpec(link_k=k, wire_dtype=args.wire_dtype),
            layer_split=[model.n_layers // 2, model.n_layers - model.n_layers // 2],
        )
        for name, k in links.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30 steps, 2 eval batches (a smoke run)")
    ap.add_argument(
        "--check", action="store_true", help="build both arms' run specs, print one JSON line, train nothing"
    )
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per arm (default 300)")
    ap.add_argument("--k", type=int, default=32, help="subspace width of the single link (default 32 = d/8)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--wire-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--eval-batches", type=int, default=8, help="validation batches of --batch sequences")
    ap.add_argument("--data-seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    steps, eval_batches, warmup = args.steps, args.eval_batches, args.warmup
    if args.quick:
        steps, eval_batches, warmup = 30, 2, 5
    try:
        train = TrainSpec(
            total_steps=steps,
            batch_size=args.batch,
            microbatches=1,
            lr=args.lr,
            warmup_steps=warmup,
            weight_decay=0.0,
            grad_clip=args.grad_clip,
            data_seed=args.data_seed,
        )
        specs = arm_specs(args, train)
    except ValueError as e:
        ap.error(f"--steps/--batch/--k/--d-model/--n-layers: {e}")
    spec, ranges = specs["dense"].model, specs["dense"].layer_ranges()
    if args.check:
        links = {name: rs.pipeline.link_k for name, rs in specs.items()}
        out = {"check": "ok", "bench": "subspace_quality", "arms": links, "ranges": ranges, "steps": steps}
        print(json.dumps({**out, "params": spec.n_params}))
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    corpus = Corpus.load("stdlib", 0.02)
    val = corpus.val_batches(eval_batches, args.batch, spec.seq_len)
    arms = [build_arm(name, rs.model, rs.pipeline, ranges, train) for name, rs in specs.items()]
    log = sys.stderr
    print(
        f"# d={spec.d_model} layers={spec.n_layers} seq={spec.seq_len} batch={args.batch} steps={steps} "
        f"k={args.k} (k/d={args.k / spec.d_model:.4f}) wire={args.wire_dtype} params={spec.n_params:,} "
        f"train bytes={len(corpus.train):,} val bytes={len(corpus.val):,}",
        file=log,
    )
    start_bpb = {a.name: evaluate(a, val) for a in arms}
    for step in range(steps):
        tokens = corpus.train_batch(args.data_seed, 0, step, args.batch, spec.seq_len)  # same for both arms
        losses = [train_step(a, tokens, step, train) for a in arms]
        if step % 50 == 0 or step == steps - 1:
            print(
                f"step {step:4d}  lr {lr_at(step, train):.2e}  "
                f"train bpb dense {losses[0] / math.log(2):.4f}  subspace {losses[1] / math.log(2):.4f}",
                file=log,
                flush=True,
            )
    end_bpb = {a.name: evaluate(a, val) for a in arms}
    dense, sub = end_bpb["dense"], end_bpb["subspace"]
    gap = (sub - dense) / dense
    print(
        f"\n{'arm':<10}{'val bpb start':>15}{'val bpb end':>13}{'fwd B/msg':>11}{'bwd B/msg':>11}{'train s':>9}",
        file=log,
    )
    for a in arms:
        print(
            f"{a.name:<10}{start_bpb[a.name]:>15.4f}{end_bpb[a.name]:>13.4f}{a.wire_fwd:>11,}{a.wire_bwd:>11,}"
            f"{a.train_s:>9.1f}",
            file=log,
        )
    print(f"relative gap (subspace - dense) / dense: {gap * 100:+.2f}%", file=log)
    sub_arm = arms[1]
    result = {
        "bench": "subspace_quality",
        "d_model": spec.d_model,
        "n_layers": spec.n_layers,
        "seq_len": spec.seq_len,
        "batch": args.batch,
        "steps": steps,
        "k": args.k,
        "wire_dtype": args.wire_dtype,
        "eval_tokens": eval_batches * args.batch * spec.seq_len,
        "val_bpb_dense": round(dense, 5),
        "val_bpb_subspace": round(sub, 5),
        "rel_gap": round(gap, 5),
        "fwd_bytes_dense": arms[0].wire_fwd,
        "fwd_bytes_subspace": sub_arm.wire_fwd,
        "bwd_bytes_dense": arms[0].wire_bwd,
        "bwd_bytes_subspace": sub_arm.wire_bwd,
        "off_subspace": max(off_subspace(s) for s in sub_arm.stages),
        "train_s_dense": round(arms[0].train_s, 1),
        "train_s_subspace": round(sub_arm.train_s, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SparseLoCo replicas of a subspace-constrained pipeline: what keeping the anchor in span(U) changes.

  python -m scripts.bench_subspace_sync [--quick] [--steps 120] [--replicas 2] [--k 32] [--check]

R replicas of the 2-stage pipeline of `bench_subspace_quality` (the worker's inner step, every boundary
crossing the real link codec as bytes) each sync their stages through the real `OuterSync` with the run
spec's SparseLoCo codec and robust aggregation, against the embedded S3 server (moto) on loopback;
replicas step in lockstep. Three arms from the same seeds and batches:

  dense        link_k = d: nothing is constrained (the reference)
  subspace     link_k = k, Delta_bar and error feedback projected onto span(U_k) (node/subspace_model.py
               `Confinement`: what the worker runs)
  unprojected  link_k = k, the anchor left to drift off span(U_k) (builds before the projection)

The consensus (the anchor, which export and validation read) is evaluated through the k-wide links; the
JSON line reports its validation bits per byte, the largest relative off-span norm of a constrained
anchor, and the share of the error feedback's norm that lies off the span when the next top-k reads it
(what top-k would spend on components the model cannot use). `--check` builds every arm's run spec and exits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

from node.data.corpus import Corpus
from node.subspace_model import Confinement, confinement, project_weights_
from node.sync.outer_sync import OuterSync
from node.sync.sparseloco_sync import SparseLoCoCodec, make_sync_parts
from protocol.identity import Identity
from protocol.net.store import ObjectStore
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, SyncSpec, TrainSpec
from scripts.bench_subspace_quality import Arm, build_arm, evaluate, train_step
from scripts.embedded_store import embedded_store

ARMS = ("dense", "subspace", "unprojected")


@dataclass
class ArmResult:
    name: str
    val_bpb: float
    off_span: float
    ef_off_span: float
    rounds: int
    train_s: float


def arm_spec(name: str, args: argparse.Namespace, model: ModelSpec, train: TrainSpec) -> RunSpec:
    """The run spec of one arm (raises ValueError for settings the swarm would refuse)."""
    k = model.d_model if name == "dense" else args.k
    return RunSpec(
        run_id=f"bench-span-{name}-{int(time.time() * 1000) % 10**9}",
        replicas=args.replicas,
        stages=2,
        model=model,
        train=train,
        sync=SyncSpec(H=args.H, P=args.P, tau=args.tau, beta=args.beta, alpha=1.0, timeout_s=60.0),
        pipeline=PipelineSpec(link_k=[k]),
    )


def ef_off_span(syncs: list[OuterSync], spans: list[Confinement | None]) -> float:
    """sqrt(sum ||(I - P) e||^2 / sum ||e||^2) over the constrained tensors of one replica's stages, of
    the error feedback as the next top-k sees it (an arm that confines projects it first)."""
    off = tot = 0.0
    for sy, cf in zip(syncs, spans, strict=True):
        codec = sy.codec
        if cf is None or not isinstance(codec, SparseLoCoCodec):
            continue
        for f, e in codec.e.items():
            for i, t in zip(sy.fragments[f], e, strict=True):  # f: (group, fragment)
                if sy.confine is not None:
                    t = t.clone()
                    sy.confine.local_(i, t)
                if i in cf.by_index:
                    n2 = float(t.double().norm() ** 2)
                    off += cf.off_span(i, t) ** 2 * n2
                    tot += n2
    return math.sqrt(off / tot) if tot else 0.0


def run_arm(
    name: str, spec: RunSpec, corpus: Corpus, val: list[torch.Tensor], store: ObjectStore
) -> ArmResult:
    ranges = spec.layer_ranges()
    ids = [[Identity.from_seed(bytes([1 + 2 * r + s]) * 32) for s in range(2)] for r in range(spec.replicas)]
    replicas: list[Arm] = []
    syncs: list[list[OuterSync]] = []
    # each stage's constraints, also for the unprojected arm (which measures them but does not apply them)
    shape = build_arm(name, spec.model, spec.pipeline, ranges, spec.train)
    spans = [confinement(stage) for stage in shape.stages]
    for r in range(spec.replicas):
        torch.manual_seed(0)  # every replica starts from the same weights
        arm = build_arm(f"{name}-r{r}", spec.model, spec.pipeline, ranges, spec.train)
        row = []
        for s, stage in enumerate(arm.stages):
            parts = make_sync_parts(spec, ids[r][s])
            sy = OuterSync(
                list(stage.parameters()),
                store=store,
                codec=parts.codec,
                aggregate=parts.aggregate,
                run_id=spec.run_id,
                stage=s,
                replica=r,
                stage_peers={q: ids[q][s].peer_id for q in range(spec.replicas)},
                schedule=spec.sync.schedule(),
                alpha=spec.sync.alpha,
                momentum=parts.momentum,
                timeout_s=spec.sync.timeout_s,
                poll_s=0.002,
                confine=confinement(stage) if name != "unprojected" else None,
            )
            row.append(sy)
        replicas.append(arm)
        syncs.append(row)
    t, m = spec.train, spec.model
    t0 = time.perf_counter()
    for step in range(t.total_steps):
        losses = [
            train_step(arm, corpus.train_batch(t.data_seed, r, step, t.batch_size, m.seq_len), step, t)
            for r, arm in enumerate(replicas)
        ]
        for row in syncs:
            for sy in row:
                sy.capture_due(step + 1)
        for arm, row in zip(replicas, syncs, strict=True):
            for stage, sy in zip(arm.stages, row, strict=True):
                if sy.apply_due(step + 1):
                    project_weights_(stage)  # the worker's after_apply
        if step % 20 == 0 or step == t.total_steps - 1:
            mean = sum(losses) / len(losses) / math.log(2)
            print(f"{name:<12} step {step:4d}  train bpb {mean:.4f}", file=sys.stderr, flush=True)
    for row in syncs:
        for sy in row:
            sy.finish()
    train_s = time.perf_counter() - t0
    for row in syncs[1:]:
        for a, b in zip(syncs[0], row, strict=True):
            if a.anchor_digest() != b.anchor_digest():
                raise AssertionError(f"{name}: replicas ended with different consensus weights")
    consensus = replicas[0]
    with torch.no_grad():  # the anchor, as export and the swarm's validation read it
        for stage, sy in zip(consensus.stages, syncs[0], strict=True):
            for p, w in zip(stage.parameters(), sy.anchor, strict=True):
                p.copy_(w)
    off = 0.0
    for sy, cf in zip(syncs[0], spans, strict=True):
        if cf is not None:
            off = max(off, *(cf.off_span(i, sy.anchor[i]) for i in cf.by_index))
    return ArmResult(
        name,
        evaluate(consensus, val),
        off,
        ef_off_span(syncs[0], spans),
        syncs[0][0].stats.rounds_applied // spec.sync.P,
        train_s,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 steps, H = 5, 1 eval batch (a smoke run)")
    ap.add_argument("--check", action="store_true", help="build every arm's run spec, print it, exit")
    ap.add_argument("--steps", type=int, default=120, help="inner steps per replica (default 120)")
    ap.add_argument("--replicas", type=int, default=2, help="R (default 2)")
    ap.add_argument("--k", type=int, default=32, help="subspace width of the link (default 32 = d/8)")
    ap.add_argument("--H", type=int, default=10, help="inner steps per round (default 10, the swarm's)")
    ap.add_argument("--P", type=int, default=1, help="streaming fragments (default 1)")
    ap.add_argument("--tau", type=int, default=0, help="overlap steps (default 0)")
    ap.add_argument("--beta", type=float, default=0.7, help="error-feedback decay (default 0.7, the swarm's)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.H, args.eval_batches, args.seq_len = 20, 5, 1, 64
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        ap.error(f"--arms {args.arms!r}: choose from {','.join(ARMS)}")
    model = ModelSpec(d_model=256, n_layers=4, n_heads=4, d_ff=688, seq_len=args.seq_len)
    try:
        train = TrainSpec(
            total_steps=args.steps, batch_size=args.batch, microbatches=1, lr=3e-3, warmup_steps=20
        )
        specs = {a: arm_spec(a, args, model, train) for a in arms}
    except ValueError as e:
        ap.error(str(e))
    if args.check:
        print(json.dumps({"bench": "subspace_sync", "check": "ok", "arms": arms}))
        return 0
    torch.set_num_threads(args.threads)
    corpus = Corpus.load("stdlib", 0.02)
    val = corpus.val_batches(args.eval_batches, args.batch, model.seq_len)
    results = []
    with embedded_store("bench-subspace-sync") as store:
        for a in arms:
            results.append(run_arm(a, specs[a], corpus, val, store))
    print(
        f"\n{'arm':<12}{'val bpb':>9}{'anchor off-span':>17}{'EF off-span':>13}{'rounds':>8}", file=sys.stderr
    )
    for r in results:
        print(
            f"{r.name:<12}{r.val_bpb:>9.4f}{r.off_span:>17.2e}{r.ef_off_span:>13.3f}{r.rounds:>8}",
            file=sys.stderr,
        )
    out: dict[str, object] = {
        "bench": "subspace_sync",
        "replicas": args.replicas,
        "steps": args.steps,
        "H": args.H,
        "k": args.k,
        "beta": args.beta,
        "seq_len": model.seq_len,
    }
    for r in results:
        out[f"val_bpb_{r.name}"] = round(r.val_bpb, 5)
        out[f"anchor_off_span_{r.name}"] = float(f"{r.off_span:.3g}")
        out[f"ef_off_span_{r.name}"] = round(r.ef_off_span, 4)
        out[f"train_s_{r.name}"] = round(r.train_s, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

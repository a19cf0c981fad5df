"""f hostile replicas of R: final bits per byte with and without robust aggregation (issues 10 and 21).

  python -m scripts.bench_attack                          # the recorded run: 3 seeds, 4 replicas, 20 rounds
  python -m scripts.bench_attack --seeds 1 --attacks flip --rules trimmed,none     # one cell
  python -m scripts.bench_attack --replicas 5 --hostile 2 --seeds 1        # f = 2 of 2f + 1
  python -m scripts.bench_attack --check              # build every run's spec, train nothing

For every seed, in one process and through one in-process S3 server (moto), the SparseLoCo arm of
`scripts.bench_quality` (the real `OuterSync`, SparseLoCo codec and `make_sync_parts` aggregation) runs:

- honest, under each aggregation rule of --rules (`sync.robust`: the default "trimmed", the old default
  "none" (run without the absolute max_abs / max_norm bounds too), optionally "clip_median");
- for each attack of --attacks, the same with the last --hostile replicas (R-f..R-1) each uploading forged
  fragments of its own update, signed with its own valid key, in outer rounds --rounds (1-based): "x100"
  (scales x100), "flip" (all values negated) and "floatmax" (values up to 1e38). The aggregation holds
  f hostile of R >= 2f + 1; beyond that (2 of 4) it still bounds their influence.

The seed sets both the data stream and the initial weights. The figure is the consensus weights' final
validation bits per byte; the gap of an attacked run is taken against the honest run of the same seed
under the same rule, and "defended" is the default rule. A run whose weights stop being finite counts as
diverged (null). A table on stderr, one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from node.data.corpus import Corpus
from node.sync.sparseloco_sync import make_sync_parts
from protocol.identity import Identity
from protocol.runspec import ModelSpec, SyncSpec, TrainSpec
from scripts.bench_quality import ATTACKS, Attack, Result, Setup, arm_spec, parse_rounds, run_outer
from scripts.bench_subspace_quality import bench_model
from scripts.embedded_store import embedded_store

RULES = ("trimmed", "clip_median", "none")


class _Counter(logging.Handler):
    """Counts the aggregator's warnings, summed over the replicas (each aggregates every round): "bounded"
    (a contribution clamped or scaled below half) and "left out" (rejected, e.g. by the agreement screen)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.bounded = self.left_out = 0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.bounded += msg.startswith("aggregation bounded")
        self.left_out += msg.startswith("aggregation left out")


def setup(args: argparse.Namespace, model: ModelSpec, seed: int, steps: int) -> Setup:
    """One seed's runs: the seed sets both the data stream and the initial weights."""
    train = TrainSpec(
        total_steps=steps,
        batch_size=args.batch,
        microbatches=1,
        lr=args.lr,
        warmup_steps=args.warmup,
        weight_decay=0.0,
        grad_clip=1.0,
        data_seed=seed,
    )
    return Setup(model=replace(model, init_seed=seed), replicas=args.replicas, train=train)


def check(setups: dict[int, Setup], base: SyncSpec, rules: list[str], attacks: list[str]) -> dict[str, Any]:
    """--check: every (seed, rule) run's spec, codec and aggregation built as run_outer builds them,
    without data, store or training (an attack changes only what the hostile replica uploads)."""
    if importlib.util.find_spec("moto") is None:
        raise SystemExit("bench_attack needs moto for its in-process S3 server: pip install -e '.[swarm]'")
    ident = Identity.from_seed(bytes([1]) * 32)
    runs = []
    for seed, s in setups.items():
        for rule in rules:
            make_sync_parts(arm_spec("sparseloco", rule_sync(base, rule), s), ident)
            runs += [f"{seed}/{kind}/{rule}" for kind in ["honest", *attacks]]
    return {"check": "ok", "bench": "robust_aggregation_attack", "runs": runs, "H": base.H}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3", help="data and init seeds (default 1,2,3)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"subset of {','.join(ATTACKS)}")
    ap.add_argument(
        "--rules", default="trimmed,none", help=f"sync.robust values, subset of {','.join(RULES)}"
    )
    ap.add_argument("--rounds", default="3-8", help="1-based outer rounds of the attack (default 3-8)")
    ap.add_argument("--replicas", type=int, default=4, help="R (default 4)")
    ap.add_argument(
        "--hostile", type=int, default=1, help="f: replicas R-f..R-1 are hostile (default 1; 1 <= f < R)"
    )
    ap.add_argument("--outer-rounds", type=int, default=20, help="outer rounds per run (default 20)")
    ap.add_argument("--H", type=int, default=5, help="inner steps per outer round (default 5)")
    ap.add_argument("--beta", type=float, default=0.7, help="SparseLoCo error-feedback decay (default 0.7)")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per replica per step (default 8)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-batches", type=int, default=32, help="validation batches of --batch sequences")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--check", action="store_true", help="build every run's spec, print one JSON line, train nothing"
    )
    args = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
        first, last = parse_rounds(args.rounds)
    except ValueError as e:
        ap.error(str(e))
    attacks = [a for a in args.attacks.split(",") if a]
    rules = [r for r in args.rules.split(",") if r]
    if set(attacks) - set(ATTACKS) or set(rules) - set(RULES) or not rules:
        ap.error(f"--attacks from {','.join(ATTACKS)}; --rules from {','.join(RULES)}")
    if not 1 <= args.hostile < args.replicas:
        ap.error(f"--hostile {args.hostile} must be in 1..{args.replicas - 1} (--replicas {args.replicas})")
    hostile = list(range(args.replicas - args.hostile, args.replicas))
    if last > args.outer_rounds:
        ap.error(f"--rounds {args.rounds} ends after the last of {args.outer_rounds} outer rounds")
    try:
        model = bench_model(args)
        steps = args.outer_rounds * args.H
        base_sync = SyncSpec(
            method="sparseloco", H=args.H, k=64, beta=args.beta, aggregation="per_coordinate"
        )
        setups = {seed: setup(args, model, seed, steps) for seed in seeds}
    except ValueError as e:
        ap.error(str(e))
    if args.check:
        try:
            print(json.dumps(check(setups, base_sync, rules, attacks)))
        except ValueError as e:
            ap.error(str(e))
        return 0
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr, format="%(message)s")
    log = logging.getLogger("bench_attack")
    log.setLevel(logging.INFO)
    counter = _Counter()
    agg_log = logging.getLogger("node.sync.sparseloco_sync")
    agg_log.addHandler(counter)
    agg_log.setLevel(logging.WARNING)
    agg_log.propagate = False  # one warning per bounded contribution per replica: counted, not printed

    corpus = Corpus.load("stdlib", 0.02)
    val = corpus.val_batches(args.eval_batches, args.batch, model.seq_len)
    print(
        f"# R={args.replicas} rounds={args.outer_rounds} H={args.H} d={model.d_model} "
        f"layers={model.n_layers} "
        f"params={model.n_params:,} attack rounds {first}-{last} by replicas {hostile} "
        f"({'within' if args.replicas >= 2 * args.hostile + 1 else 'beyond'} R >= 2f + 1); "
        f"seeds {seeds}; default rule {SyncSpec.robust}",
        file=sys.stderr,
        flush=True,
    )

    bpb: dict[str, dict[str, dict[str, float | None]]] = {}  # attack -> rule -> seed -> bpb
    events: dict[str, dict[str, list[int]]] = {}  # attack -> rule -> [bounded, left out] over seeds
    diverged: dict[str, dict[str, dict[str, int]]] = {}  # attack -> rule -> seed -> last finite step
    with embedded_store("bench-attack") as store:
        t_all = time.perf_counter()
        for seed, s in setups.items():
            for kind in ["honest", *attacks]:
                attack = (
                    None
                    if kind == "honest"
                    else Attack(
                        kind=kind, replica=hostile[0], first=first, last=last, colluders=tuple(hostile[1:])
                    )
                )
                for rule in rules:
                    counter.bounded = counter.left_out = 0
                    r: Result = run_outer(
                        "sparseloco", rule_sync(base_sync, rule), s, corpus, val, store, log, attack
                    )
                    v = r.val_bpb if math.isfinite(r.val_bpb) else None
                    bpb.setdefault(kind, {}).setdefault(rule, {})[str(seed)] = (
                        None if v is None else round(v, 5)
                    )
                    if r.diverged_at is not None:
                        diverged.setdefault(kind, {}).setdefault(rule, {})[str(seed)] = r.diverged_at
                    ev = events.setdefault(kind, {}).setdefault(rule, [0, 0])
                    ev[0] += counter.bounded
                    ev[1] += counter.left_out
                    shown = f"{v:.4f}" if v is not None else f"diverged after step {r.diverged_at}"
                    log.info(
                        "seed %d %-8s %-11s val bpb %s (%.0f s; contributions bounded %d, left out %d)",
                        seed,
                        kind,
                        rule,
                        shown,
                        r.train_s,
                        counter.bounded,
                        counter.left_out,
                    )
    total_s = time.perf_counter() - t_all

    def gap(kind: str, rule: str, seed: str) -> float | None:
        a, h = bpb[kind][rule][seed], bpb["honest"][rule][seed]
        return None if a is None or h is None else round(a / h - 1, 5)

    gaps = {
        kind: {rule: {str(sd): gap(kind, rule, str(sd)) for sd in seeds} for rule in rules}
        for kind in attacks
    }
    default = SyncSpec.robust
    worst = [g for k in attacks for g in gaps[k].get(default, {}).values()]
    passed = (bool(worst) and all(g is not None and g <= 0.02 for g in worst)) if default in rules else None
    honest_vs_none = (
        {str(sd): _ratio(bpb["honest"][default][str(sd)], bpb["honest"]["none"][str(sd)]) for sd in seeds}
        if default in rules and "none" in rules
        else None
    )
    print(
        f"\n{'attack':<10}{'rule':<13}" + "".join(f"{'seed ' + str(sd):>20}" for sd in seeds), file=sys.stderr
    )
    for kind in ["honest", *attacks]:
        for rule in rules:
            cells = []
            for sd in seeds:
                v = bpb[kind][rule][str(sd)]
                g = gaps[kind][rule][str(sd)] if kind != "honest" else None
                cell = (
                    "diverged" if v is None else f"{v:.4f}" + (f" ({g * 100:+.2f}%)" if g is not None else "")
                )
                cells.append(f"{cell:>20}")
            print(f"{kind:<10}{rule:<13}" + "".join(cells), file=sys.stderr)
    print(f"total {total_s:.0f} s", file=sys.stderr)
    out = {
        "bench": "robust_aggregation_attack",
        "replicas": args.replicas,
        "hostile_replicas": hostile,
        "within_2f_plus_1": args.replicas >= 2 * args.hostile + 1,
        "outer_rounds": args.outer_rounds,
        "attack_rounds": [first, last],
        "H": args.H,
        "beta": args.beta,
        "d_model": model.d_model,
        "n_layers": model.n_layers,
        "params": model.n_params,
        "seeds": seeds,
        "default_rule": default,
        "val_bpb": bpb,
        "gap_vs_honest_same_rule": gaps,
        "honest_default_vs_none": honest_vs_none,
        "diverged_after_step": diverged,
        "bounded_and_left_out": events,
        "defended_within_2pct": passed,
        "total_s": round(total_s, 1),
    }
    print(json.dumps(out))
    return 0


def rule_sync(base: SyncSpec, rule: str) -> SyncSpec:
    """base under `sync.robust = rule`; "none" is the old default, without the absolute bounds too."""
    if rule == "none":
        return replace(base, robust="none", max_abs=0.0, max_norm=0.0)
    return replace(base, robust=rule)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b - 1, 5)


if __name__ == "__main__":
    sys.exit(main())

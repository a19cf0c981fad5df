"""f hostile replicas of R: final bits per byte with and without robust aggregation (issues 10 and 21).

  python -m scripts.bench_attack                          # the 1-of-4 run: 3 seeds, 4 replicas, 20 rounds
  python -m scripts.bench_attack --matrix                 # issue 21: 2 of 5 and 3 of 7, 5 attacks; and 1 of 4
  python -m scripts.bench_attack --quick                  # CI-sized: 2 of 5, 1 round, 2 attacks, 1 seed
  python -m scripts.bench_attack --seeds 1 --attacks flip --rules trimmed,none     # one cell
  python -m scripts.bench_attack --replicas 5 --hostile 2 --seeds 1        # f = 2 of 2f + 1
  python -m scripts.bench_attack --configs 5:2,7:3 --rules trimmed         # several (R, f) in one run
  python -m scripts.bench_attack --check              # build every run's spec, train nothing

For every (R, f) of --configs (or --replicas and --hostile), every seed, in one process and through one
in-process S3 server (moto), the SparseLoCo arm of `scripts.bench_quality` (the real `OuterSync`, SparseLoCo
codec and `make_sync_parts` aggregation) runs:

- honest, under each aggregation rule of --rules (`sync.robust`: the default "trimmed", the old default
  "none" (run without the absolute max_abs / max_norm bounds too), optionally "clip_median");
- for each attack of --attacks, the same with the last f replicas (R-f..R-1) each uploading forged
  fragments, signed with its own valid key, in outer rounds --rounds (1-based): "x100" (its own update
  x100), "flip" (its own update negated), "floatmax" (values up to 1e38), "reversed" (minus the round's
  honest mean, the same from every colluder) and "orthogonal" (its own update negated on the coordinates
  no honest replica sent: orthogonal to the honest mean); the last two at the honest replicas' median norm
  (`scripts.bench_quality.forge_against`). The aggregation holds f hostile of R >= 2f + 1; beyond that
  (2 of 4) it still bounds their influence.

The seed sets both the data stream and the initial weights. The figure is the consensus weights' final
validation bits per byte; the gap of an attacked run is taken against the honest run of the same seed
under the same rule (the same R replicas, all honest), reported per (R, f, attack, rule) with its mean and
spread over the seeds; "defended" is the default rule, within 1% on every seed, with no honest replica
ever left out of an aggregation (each replica's "aggregation left out replica N" warnings are counted by
N). A run whose weights stop being finite counts as diverged (null). A table on stderr, one JSON line last
on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from node.data.corpus import Corpus
from node.sync.sparseloco_sync import make_sync_parts
from protocol.identity import Identity
from protocol.net.store import ObjectStore
from protocol.runspec import ModelSpec, SyncSpec, TrainSpec
from scripts.bench_quality import ATTACKS, Attack, Result, Setup, arm_spec, parse_rounds, run_outer
from scripts.bench_subspace_quality import bench_model
from scripts.embedded_store import embedded_store

RULES = ("trimmed", "clip_median", "none")
GOAL = 0.01
"""Acceptance (issue 21): an attacked run's final bits per byte within 1% of the same replicas all honest."""
MATRIX = {"configs": "5:2,7:3,4:1", "rules": "trimmed", "outer_rounds": 40, "jobs": 3, "threads": 1}
"""--matrix: issue 21's acceptance run (every attack, 3 seeds) under the default rule, 40 rounds (the
attack's 6 rounds are 15% of the run; at 20 rounds losing 2 of 5 replicas' updates for 30% of it costs
0.6-1.2% by itself, whatever the rule: docs/benchmarks.md); 3 cells at once, one torch thread each (3 x 2
threads on 2 cores spent 3x the CPU time)."""
QUICK = {
    "configs": "5:2",
    "seeds": "1",
    "attacks": "reversed,orthogonal",
    "rules": "trimmed",
    "outer_rounds": 1,
    "rounds": "1",
    "eval_batches": 4,
}
"""--quick: the suite's smoke run (tests/test_benches.py), well under a minute."""
RUN_TIMEOUT_S = 900.0
"""--jobs: the most one run may take in a child (times the runs the child makes) before it is killed."""


class _Counter(logging.Handler):
    """Counts the aggregator's warnings, summed over the replicas (each aggregates every round): "bounded"
    (a contribution clamped or scaled below half) and "left out" (rejected, e.g. by the agreement screen),
    the latter also by the replica left out."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reset()

    def reset(self) -> None:
        self.bounded = self.left_out = 0
        self.left_out_by: Counter[int] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.bounded += msg.startswith("aggregation bounded")
        if msg.startswith("aggregation left out"):
            self.left_out += 1
            if isinstance(record.args, tuple) and record.args and isinstance(record.args[0], int):
                self.left_out_by[record.args[0]] += 1


@dataclass(frozen=True)
class Config:
    """R replicas, the last f of them hostile."""

    R: int
    f: int

    @property
    def hostile(self) -> list[int]:
        return list(range(self.R - self.f, self.R))

    @property
    def within(self) -> bool:
        """R >= 2f + 1: the bound the aggregation holds."""
        return self.R >= 2 * self.f + 1


def parse_configs(text: str) -> list[Config]:
    """ "5:2,7:3" -> [Config(5, 2), Config(7, 3)]: R:f pairs, 1 <= f < R."""
    out = []
    for part in (p for p in text.split(",") if p):
        a, _, b = part.partition(":")
        try:
            c = Config(int(a), int(b))
        except ValueError:
            raise ValueError(f"--configs {part!r} must be R:f (example: 5:2,7:3)") from None
        if not 1 <= c.f < c.R:
            raise ValueError(f"--configs {part!r}: f={c.f} must be in 1..{c.R - 1} (R={c.R})")
        out.append(c)
    if not out:
        raise ValueError("--configs names no R:f pair (example: 5:2,7:3)")
    return out


def setup(args: argparse.Namespace, model: ModelSpec, replicas: int, seed: int, steps: int) -> Setup:
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
    return Setup(model=replace(model, init_seed=seed), replicas=replicas, train=train)


def check(
    setups: dict[tuple[Config, int], Setup], base: SyncSpec, rules: list[str], attacks: list[str]
) -> dict[str, Any]:
    """--check: every (config, seed, rule) run's spec, codec and aggregation built as run_outer builds them,
    without data, store or training (an attack changes only what the hostile replicas upload)."""
    if importlib.util.find_spec("moto") is None:
        raise SystemExit("bench_attack needs moto for its in-process S3 server: pip install -e '.[swarm]'")
    ident = Identity.from_seed(bytes([1]) * 32)
    runs = []
    for (c, seed), s in setups.items():
        for rule in rules:
            make_sync_parts(arm_spec("sparseloco", rule_sync(base, rule), s), ident)
            runs += [f"{c.R}:{c.f}/{seed}/{kind}/{rule}" for kind in ["honest", *attacks]]
    return {"check": "ok", "bench": "robust_aggregation_attack", "runs": runs, "H": base.H}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_attack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    ap.add_argument(
        "--configs",
        help="R:f pairs run one after another, instead of --replicas/--hostile (example: 5:2,7:3)",
    )
    ap.add_argument(
        "--matrix",
        action="store_true",
        help="issue 21's acceptance run: "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in MATRIX.items())
        + " (about 45 minutes on 2 cores; a flag given too wins)",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized: "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
        + " (under a minute)",
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
        "--jobs",
        type=int,
        default=1,
        help="run the (R, f, seed) cells in this many child processes at once (default 1: in this one); "
        "a round mostly waits on the store's clock, so 3 take little more time than 1",
    )
    ap.add_argument("--cell", action="store_true", help=argparse.SUPPRESS)  # a --jobs child: raw JSON
    ap.add_argument(
        "--check", action="store_true", help="build every run's spec, print one JSON line, train nothing"
    )
    return ap


def summarize(gaps: list[float | None]) -> dict[str, Any]:
    """Mean, sample standard deviation and range over the seeds of an attacked run's gap (None: a seed
    diverged, and the whole cell counts as failed)."""
    if not gaps or any(g is None for g in gaps):
        return {"n": len(gaps), "mean": None, "std": None, "min": None, "max": None}
    vals = [g for g in gaps if g is not None]
    return {
        "n": len(vals),
        "mean": round(statistics.fmean(vals), 5),
        "std": round(statistics.stdev(vals), 5) if len(vals) > 1 else 0.0,
        "min": min(vals),
        "max": max(vals),
    }


def run_cell(
    c: Config,
    seed: int,
    s: Setup,
    base: SyncSpec,
    rules: list[str],
    attacks: list[str],
    rounds: tuple[int, int],
    ctx: tuple[Corpus, list[torch.Tensor], ObjectStore, logging.Logger, _Counter],
) -> dict[str, Any]:
    """Every (honest or attack, rule) run of one (R, f) and seed: kind -> rule -> what it measured."""
    corpus, val, store, log, counter = ctx
    first, last = rounds
    hostile = c.hostile
    cell: dict[str, Any] = {
        "val_bpb": {},
        "diverged_after_step": {},
        "bounded_and_left_out": {},
        "honest_left_out": {},
    }
    t0 = time.perf_counter()
    for kind in ["honest", *attacks]:
        attack = (
            None
            if kind == "honest"
            else Attack(kind=kind, replica=hostile[0], first=first, last=last, colluders=tuple(hostile[1:]))
        )
        for rule in rules:
            counter.reset()
            r: Result = run_outer("sparseloco", rule_sync(base, rule), s, corpus, val, store, log, attack)
            v = round(r.val_bpb, 5) if math.isfinite(r.val_bpb) else None
            wrong = sum(n for j, n in counter.left_out_by.items() if j not in hostile)
            for key, value in [
                ("val_bpb", v),
                ("diverged_after_step", r.diverged_at),
                ("bounded_and_left_out", [counter.bounded, counter.left_out]),
                ("honest_left_out", wrong),
            ]:
                cell[key].setdefault(kind, {})[rule] = value
            shown = f"{v:.4f}" if v is not None else f"diverged after step {r.diverged_at}"
            log.info(
                "R=%d f=%d seed %d %-10s %-11s val bpb %s (%.0f s; contributions bounded %d, left out %d, "
                "of them honest %d)",
                c.R,
                c.f,
                seed,
                kind,
                rule,
                shown,
                r.train_s,
                counter.bounded,
                counter.left_out,
                wrong,
            )
    cell["total_s"] = round(time.perf_counter() - t0, 1)
    return cell


def combine(
    c: Config, cells: dict[int, dict[str, Any]], rules: list[str], attacks: list[str]
) -> dict[str, Any]:
    """One (R, f)'s cells (seed -> `run_cell`) as its figures: bits per byte by seed, the gaps against the
    honest run of the same seed and rule, their mean and spread, and what was left out."""
    seeds = [str(sd) for sd in cells]
    kinds = ["honest", *attacks]
    bpb = {k: {r: {sd: cells[int(sd)]["val_bpb"][k][r] for sd in seeds} for r in rules} for k in kinds}
    diverged = {
        k: {
            r: {
                sd: cells[int(sd)]["diverged_after_step"][k][r]
                for sd in seeds
                if cells[int(sd)]["diverged_after_step"][k][r] is not None
            }
            for r in rules
        }
        for k in kinds
    }
    events = {
        k: {
            r: [sum(cells[int(sd)]["bounded_and_left_out"][k][r][i] for sd in seeds) for i in (0, 1)]
            for r in rules
        }
        for k in kinds
    }
    honest_out = {
        k: {r: sum(cells[int(sd)]["honest_left_out"][k][r] for sd in seeds) for r in rules} for k in kinds
    }

    def gap(kind: str, rule: str, seed: str) -> float | None:
        return _ratio(bpb[kind][rule][seed], bpb["honest"][rule][seed])

    gaps = {k: {r: {sd: gap(k, r, sd) for sd in seeds} for r in rules} for k in attacks}
    summary = {k: {r: summarize(list(gaps[k][r].values())) for r in rules} for k in attacks}
    default = SyncSpec.robust
    if default in rules and attacks:
        per_seed = [g for k in attacks for g in gaps[k][default].values()]
        means = [summary[k][default]["mean"] for k in attacks]
        mean_ok: bool | None = all(m is not None and m <= GOAL for m in means)
        seed_ok: bool | None = all(g is not None and g <= GOAL for g in per_seed)
        within_2pct: bool | None = all(g is not None and g <= 0.02 for g in per_seed)
    else:
        mean_ok = seed_ok = within_2pct = None
    return {
        "replicas": c.R,
        "hostile_replicas": c.hostile,
        "within_2f_plus_1": c.within,
        "val_bpb": bpb,
        "gap_vs_honest_same_rule": gaps,
        "gap_summary": summary,
        "honest_default_vs_none": {sd: gap_of(bpb, default, "none", sd) for sd in seeds}
        if default in rules and "none" in rules
        else None,
        "diverged_after_step": diverged,
        "bounded_and_left_out": events,
        "honest_left_out": honest_out,
        "defended_within_1pct": mean_ok,
        "every_seed_within_1pct": seed_ok,
        "defended_within_2pct": within_2pct,
        "honest_never_left_out": all(honest_out[k][default] == 0 for k in kinds)
        if default in rules
        else None,
        "total_s": round(sum(cells[int(sd)]["total_s"] for sd in seeds), 1),
    }


def gap_of(bpb: dict[str, Any], rule: str, other: str, seed: str) -> float | None:
    """The honest run under `rule` against the honest run under `other`, same seed."""
    return _ratio(bpb["honest"][rule][seed], bpb["honest"][other][seed])


def cell_argv(args: argparse.Namespace, c: Config, seed: int) -> list[str]:
    """The command line of one (R, f) and seed run in a child process (--jobs): the resolved flags."""
    flags = {
        "attacks": args.attacks,
        "rules": args.rules,
        "rounds": args.rounds,
        "outer-rounds": args.outer_rounds,
        "H": args.H,
        "beta": args.beta,
        "d-model": args.d_model,
        "n-layers": args.n_layers,
        "seq-len": args.seq_len,
        "batch": args.batch,
        "lr": args.lr,
        "warmup": args.warmup,
        "eval-batches": args.eval_batches,
        "threads": args.threads,
        "configs": f"{c.R}:{c.f}",
        "seeds": seed,
    }
    argv = [sys.executable, "-m", "scripts.bench_attack", "--cell"]
    for k, v in flags.items():
        argv += [f"--{k}", str(v)]
    return argv


def run_child(argv: list[str], timeout_s: float, children: list[subprocess.Popen[str]]) -> dict[str, Any]:
    """One cell in its own process group (its stderr goes to ours; `children` lists it until it ends, for
    the parent to kill if it stops first); the cell's JSON line."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    children.append(p)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise RuntimeError(f"{' '.join(argv[2:])} ran past {timeout_s:.0f} s; killed") from None
    finally:
        children.remove(p)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:])} exited with {p.returncode} (its stderr is above)")
    cell: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return cell


def print_table(res: dict[str, Any], rules: list[str], attacks: list[str], seeds: list[int]) -> None:
    """One (R, f)'s bits per byte, the gaps, their mean and spread, on stderr."""
    bpb, gaps, summary = res["val_bpb"], res["gap_vs_honest_same_rule"], res["gap_summary"]
    print(
        f"\nR={res['replicas']} hostile {res['hostile_replicas']}\n{'attack':<12}{'rule':<13}"
        + "".join(f"{'seed ' + str(sd):>20}" for sd in seeds)
        + f"{'gap mean +- std':>20}{'honest out':>12}",
        file=sys.stderr,
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
            if kind == "honest":
                mean = "-"
            elif (sm := summary[kind][rule])["mean"] is None:
                mean = "diverged"
            else:
                mean = f"{sm['mean'] * 100:+.2f}% +- {sm['std'] * 100:.2f}"
            out = res["honest_left_out"][kind][rule]
            print(f"{kind:<12}{rule:<13}" + "".join(cells) + f"{mean:>20}{out:>12}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick and args.matrix:
        ap.error("--quick and --matrix: choose one")
    if args.quick or args.matrix:  # the preset's values as defaults: a flag given explicitly still wins
        ap.set_defaults(**(QUICK if args.quick else MATRIX))
        args = ap.parse_args(argv)
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x]
        first, last = parse_rounds(args.rounds)
        configs = parse_configs(args.configs) if args.configs else None
    except ValueError as e:
        ap.error(str(e))
    if configs is None:
        if not 1 <= args.hostile < args.replicas:
            ap.error(
                f"--hostile {args.hostile} must be in 1..{args.replicas - 1} (--replicas {args.replicas})"
            )
        configs = [Config(args.replicas, args.hostile)]
    attacks = [a for a in args.attacks.split(",") if a]
    rules = [r for r in args.rules.split(",") if r]
    if set(attacks) - set(ATTACKS) or set(rules) - set(RULES) or not rules or not seeds:
        ap.error(f"--attacks from {','.join(ATTACKS)}; --rules from {','.join(RULES)}; --seeds not empty")
    if last > args.outer_rounds:
        ap.error(f"--rounds {args.rounds} ends after the last of {args.outer_rounds} outer rounds")
    try:
        model = bench_model(args)
        steps = args.outer_rounds * args.H
        base_sync = SyncSpec(
            method="sparseloco", H=args.H, k=64, beta=args.beta, aggregation="per_coordinate"
        )
        setups = {(c, seed): setup(args, model, c.R, seed, steps) for c in configs for seed in seeds}
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

    log.info(
        "# configs %s rounds=%d H=%d d=%d layers=%d params=%s attack rounds %d-%d; seeds %s; attacks %s; "
        "rules %s (default %s)",
        " ".join(f"{c.R}:{c.f}" for c in configs),
        args.outer_rounds,
        args.H,
        model.d_model,
        model.n_layers,
        f"{model.n_params:,}",
        first,
        last,
        seeds,
        ",".join(attacks),
        ",".join(rules),
        SyncSpec.robust,
    )
    t_all = time.perf_counter()
    cells: dict[tuple[Config, int], dict[str, Any]] = {}
    if args.jobs > 1 and len(setups) > 1:  # the rounds mostly wait on the store's clock: overlap them
        limit = RUN_TIMEOUT_S * (1 + len(attacks)) * len(rules)
        children: list[subprocess.Popen[str]] = []
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` below runs
        try:
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                futs = {key: pool.submit(run_child, cell_argv(args, *key), limit, children) for key in setups}
                cells = {key: f.result() for key, f in futs.items()}
        finally:
            for p in list(children):  # a cell failed or we were interrupted: no child outlives us
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    else:
        corpus = Corpus.load("stdlib", 0.02)
        val = corpus.val_batches(args.eval_batches, args.batch, model.seq_len)
        with embedded_store("bench-attack") as store:
            for (c, seed), s in setups.items():
                ctx = (corpus, val, store, log, counter)
                cells[c, seed] = run_cell(c, seed, s, base_sync, rules, attacks, (first, last), ctx)
    if args.cell:
        (cell,) = cells.values()
        print(json.dumps(cell))
        return 0
    results = []
    for c in configs:
        res = combine(c, {seed: cells[c, seed] for seed in seeds}, rules, attacks)
        print_table(res, rules, attacks, seeds)
        results.append(res)
    total_s = time.perf_counter() - t_all
    print(f"total {total_s:.0f} s", file=sys.stderr)

    def every(key: str) -> bool | None:
        vals = [r[key] for r in results]
        return None if any(v is None for v in vals) else all(vals)

    out = {
        "bench": "robust_aggregation_attack",
        "configs": [f"{c.R}:{c.f}" for c in configs],
        "outer_rounds": args.outer_rounds,
        "attack_rounds": [first, last],
        "H": args.H,
        "beta": args.beta,
        "d_model": model.d_model,
        "n_layers": model.n_layers,
        "params": model.n_params,
        "seeds": seeds,
        "attacks": attacks,
        "rules": rules,
        "default_rule": SyncSpec.robust,
        "defended_within_1pct": every("defended_within_1pct"),
        "every_seed_within_1pct": every("every_seed_within_1pct"),
        "honest_never_left_out": every("honest_never_left_out"),
        "runs": results,
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

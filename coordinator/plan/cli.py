"""`crucible-coordinator plan`: predict tokens/s, MFU, tax and $/Mtok of a pool, or price a measurement.

Wiring: `coordinator/cli.py` calls `add_parser(subparsers)`; the parsed namespace carries `func=run`.
Every quantity must be positive (a few may be 0, said in their help); "auto" is the absence of a flag, or
the word `auto` for --replicas, --stages and --k. A host group without a price is planned, its dollar
figures shown as n/a, with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from coordinator.plan.accelerators import ACCELERATORS
from coordinator.plan.planner import (
    MODELS,
    STORE_RTT_MS,
    Economics,
    HostGroup,
    Pool,
    Prediction,
    ReferenceCluster,
    RunSettings,
    auto_stages,
    economics,
    get_model,
    naive_layout,
    predict,
    route_round_trips,
)
from coordinator.plan.shapes import ShapeComparison, ShapePlan, compare_shapes
from protocol.process.cli_errors import (
    ArgumentParser,
    UsageError,
    bad_input,
    check_keys,
    check_positive,
    load_toml,
    run_cli,
)
from protocol.process.logs import add_log_args, setup_logging
from protocol.schema import SchemaError, from_dict

DESCRIPTION = """\
Predict tokens/s, effective MFU, low-bandwidth tax (1 - MFU/ceiling) and $/Mtok for R replicas x S
stages of a GPU pool, and compare with a reserved cluster. With --measured-tokens-per-s, also price a
measured throughput on the same GPUs. When the pool's hosts differ in memory, also a mixed-shape
placement (each memory class at the fewest stages it fits) beside the best uniform one: a planning
figure, which the swarm runs when the run spec states those shapes ([[shapes]] with stages; the coordinator
does not pick them itself). Formulas: docs/economics.md."""

EXAMPLES = """\
examples:
  # predict an 8B run over a mixed pool, 4 stages, replicas from the pool size
  crucible-coordinator plan --model 8b --pool docs/examples/pool_8b.toml --stages 4
  # a pool mixing 80 GB and 40 GB GPUs: also a mixed-shape placement beside the best uniform one
  crucible-coordinator plan --model 72b --pool docs/examples/pool_mixed_memory.toml
  # a 32B-total, top-8 MoE on H100 and A100 servers, its object store 9,000 miles away (300 ms)
  crucible-coordinator plan --model moe-32b --pool docs/examples/pool_moe.toml --store-rtt-ms 300
  # price Test Run 003 from its measured throughput, against AWS p4de.24xlarge Capacity Blocks
  crucible-coordinator plan --model 8b --gpus 48 --accelerator a100-80gb --usd-per-gpu-hour 1.17 \\
      --replicas 12 --stages 4 --measured-tokens-per-s 130100 \\
      --reference-usd-per-hour 17.712 --reference-gpus 8
"""


def _count_or_auto(text: str) -> int | None:
    """--replicas/--stages/--k: a whole number, or `auto` (the same as leaving the flag out)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number or 'auto' (example: 12; leave the flag out for auto)"
        ) from None


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; sets `func=run`."""
    p = subparsers.add_parser(
        "plan",
        help="predict tokens/s, effective MFU, low-bandwidth tax and $/Mtok for a pool",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", default="8b", choices=sorted(MODELS), help="model preset (example: --model 8b)")
    m.add_argument(
        "--seq-len", type=int, help="override the preset's sequence length (example: --seq-len 8192)"
    )
    pool = p.add_argument_group("pool: a TOML file, or one homogeneous group given inline")
    pool.add_argument(
        "--pool", help="pool file with [[hosts]] tables (example: --pool docs/examples/pool_8b.toml)"
    )
    pool.add_argument("--gpus", type=int, help="inline pool: number of single-GPU hosts (example: --gpus 48)")
    pool.add_argument(
        "--accelerator",
        default="a100-80gb",
        choices=sorted(ACCELERATORS),
        help="inline pool: accelerator, default a100-80gb (example: --accelerator h100-sxm)",
    )
    pool.add_argument(
        "--tflops",
        type=float,
        help="inline pool: measured TFLOP/s per GPU; default: the accelerator's table figure (example: 0.15)",
    )
    pool.add_argument(
        "--link-mbps", type=float, default=1000.0, help="inline pool: link Mbit/s (example: 500)"
    )
    pool.add_argument(
        "--rtt-ms", type=float, default=30.0, help="inline pool: link RTT in ms, may be 0 (example: 80)"
    )
    pool.add_argument(
        "--store-mbps", type=float, default=1000.0, help="inline pool: store Mbit/s (example: 400)"
    )
    pool.add_argument(
        "--usd-per-gpu-hour", type=float, help="price per GPU-hour; overrides the pool file (example: 1.17)"
    )
    t = p.add_argument_group("topology and schedule")
    t.add_argument(
        "--replicas",
        type=_count_or_auto,
        help="R; default (or auto): as many as the pool fills (example: --replicas 12)",
    )
    t.add_argument(
        "--stages",
        type=_count_or_auto,
        help="S; default (or auto): the fewest whose stages fit memory, activations in flight included "
        "(example: --stages 4)",
    )
    t.add_argument(
        "--microbatches", type=int, default=16, help="M per inner step (example: --microbatches 16)"
    )
    t.add_argument("--microbatch-size", type=int, default=1, help="b, sequences per microbatch (example: 2)")
    t.add_argument(
        "--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule (example: gpipe)"
    )
    t.add_argument(
        "--k",
        type=_count_or_auto,
        help="subspace rank on every link; default (or auto): chosen per link (example: --k 512)",
    )
    t.add_argument("--k-min", type=int, default=32, help="floor of the chosen k (example: --k-min 40)")
    t.add_argument(
        "--extra-in-flight",
        type=int,
        default=0,
        help="1F1B microbatches in flight beyond S, may be 0 (example: 4)",
    )
    s = p.add_argument_group("SparseLoCo")
    s.add_argument("--H", type=int, default=30, help="inner steps per outer round (example: --H 30)")
    s.add_argument("--tau", type=int, default=2, help="overlap steps, 0 <= tau < H (example: --tau 2)")
    s.add_argument("--fragments", type=int, default=4, help="P, streamed fragments (example: --fragments 4)")
    s.add_argument("--compression-ratio", type=float, default=200.0, help="dense/wire bytes (example: 146)")
    _add_routing_args(p)
    e = p.add_argument_group("economics")
    e.add_argument(
        "--ceiling", type=float, default=0.65, help="compute ceiling MFU (example: --ceiling 0.65)"
    )
    e.add_argument("--measured-tokens-per-s", type=float, help="price this measured rate (example: 130100)")
    e.add_argument("--reference-usd-per-hour", type=float, help="reserved instance $/h (example: 17.712)")
    e.add_argument("--reference-gpus", type=int, default=8, help="GPUs per reference instance (example: 8)")
    e.add_argument("--reference-tflops", type=float, help="reference GPU peak; default ours (example: 989)")
    e.add_argument("--reference-mfu", type=float, help="MFU it sustains; default --ceiling (example: 0.55)")
    e.add_argument("--reference-name", default="reference", help="label (example: 'AWS p4de.24xlarge CB')")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the report")
    add_log_args(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    p.set_defaults(func=run)
    return p


def _add_routing_args(p: argparse.ArgumentParser) -> None:
    """The MoE routing barrier's inputs: the store's round trip and how far the barrier may lag."""
    g = p.add_argument_group("MoE routing barrier (a store round trip per request, every inner step)")
    g.add_argument(
        "--store-rtt-ms",
        type=float,
        help=f"round trip of one object-store request, ms, may be 0; overrides the pool file (default "
        f"{STORE_RTT_MS:g}, a store in the hosts' region; 9,000 miles away: 300) (example: --store-rtt-ms 300)",
    )
    g.add_argument(
        "--stats-delay",
        type=int,
        default=1,
        help="D, steps the barrier may lag (model.moe.stats_delay) (example: --stats-delay 2)",
    )


_QUANTITIES = (
    # (flag, example, may be 0)
    ("--seq-len", "--seq-len 8192", False),
    ("--gpus", "--gpus 48", False),
    ("--tflops", "--tflops 0.15", False),
    ("--link-mbps", "--link-mbps 500", False),
    ("--rtt-ms", "--rtt-ms 80", True),
    ("--store-mbps", "--store-mbps 400", False),
    ("--store-rtt-ms", "--store-rtt-ms 300", True),
    ("--usd-per-gpu-hour", "--usd-per-gpu-hour 1.17", False),
    ("--replicas", "--replicas 12, or --replicas auto", False),
    ("--stages", "--stages 4, or --stages auto", False),
    ("--microbatches", "--microbatches 16", False),
    ("--microbatch-size", "--microbatch-size 2", False),
    ("--k", "--k 512, or --k auto", False),
    ("--k-min", "--k-min 40", False),
    ("--extra-in-flight", "--extra-in-flight 4", True),
    ("--H", "--H 30", False),
    ("--tau", "--tau 2", True),
    ("--fragments", "--fragments 4", False),
    ("--compression-ratio", "--compression-ratio 146", False),
    ("--stats-delay", "--stats-delay 2", False),
    ("--ceiling", "--ceiling 0.65", False),
    ("--measured-tokens-per-s", "--measured-tokens-per-s 130100", False),
    ("--reference-usd-per-hour", "--reference-usd-per-hour 17.712", False),
    ("--reference-gpus", "--reference-gpus 8", False),
    ("--reference-tflops", "--reference-tflops 989", False),
    ("--reference-mfu", "--reference-mfu 0.55", False),
)
"""Every number `plan` takes, checked before planning: negative is never meaningful, and 0 is a
mistake except where said (a price of 0 would print $0/Mtok; --replicas 0 once meant "auto")."""


def check_args(args: argparse.Namespace) -> None:
    """Reject a negative or zero quantity (naming the flag), and a fraction above 1."""
    for flag, example, may_be_zero in _QUANTITIES:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        check_positive(flag, value, example, allow_zero=may_be_zero)
    for flag, value in (("--ceiling", args.ceiling), ("--reference-mfu", args.reference_mfu)):
        if value is not None and value > 1:
            raise bad_input(flag, value, "is a fraction of peak: must be in (0, 1]", f"{flag} 0.55")
    if args.pool and args.gpus is not None:
        raise UsageError(
            "give --pool FILE or --gpus N, not both (example: --pool docs/examples/pool_8b.toml)"
        )


def load_pool_file(path: str) -> Pool:
    """The --pool file, with errors that name it and list valid keys; a host group without
    `usd_per_gpu_hour` gets 0, which `plan` reports as no price."""
    example = "--pool docs/examples/pool_8b.toml"
    if not Path(path).expanduser().exists():
        raise bad_input("--pool", path, "no such file", example)
    data = load_toml("--pool", path)
    check_keys(f"--pool {path}", data, ["hosts"])
    hosts = data.get("hosts")
    if isinstance(hosts, list):
        valid = [f.name for f in dataclasses.fields(HostGroup)]
        for i, group in enumerate(hosts):
            if isinstance(group, dict):
                check_keys(
                    f"--pool {path}: [[hosts]] #{i + 1} ({group.get('name', 'no name')})", group, valid
                )
                group.setdefault("usd_per_gpu_hour", 0.0)
    try:
        return from_dict(Pool, data)
    except SchemaError as e:
        raise bad_input("--pool", path, str(e).removeprefix("Pool."), example) from e


def _pool(args: argparse.Namespace) -> Pool:
    if args.pool:
        return load_pool_file(args.pool)
    if not args.gpus:
        raise UsageError("give --pool FILE or --gpus N (example: --gpus 48 --accelerator a100-80gb)")
    return Pool(
        hosts=(
            HostGroup(
                name=args.accelerator if not args.tflops else "measured",
                count=args.gpus,
                accelerator="" if args.tflops else args.accelerator,
                tflops=args.tflops or 0.0,
                usd_per_gpu_hour=args.usd_per_gpu_hour or 0.0,
                link_mbps=args.link_mbps,
                rtt_ms=args.rtt_ms,
                store_mbps=args.store_mbps,
            ),
        )
    )


@dataclasses.dataclass(kw_only=True, frozen=True)
class PlanResult:
    """What `plan` computed; `as_json` is the --json line."""

    model: str
    n_params: int
    n_active_params: int
    """Parameters a token goes through: FLOPs/token and MFU count these (n_params for a dense model)."""
    replicas: int
    stages: int
    unused_hosts: int
    prediction: Prediction
    reference: ReferenceCluster | None
    predicted: Economics
    """Economics of the predicted throughput (against the reference, if one was given)."""
    measured: Economics | None
    """Economics of --measured-tokens-per-s on the same placed GPUs."""
    unpriced: tuple[str, ...] = ()
    """Host groups placed without a price: every dollar figure is then unknown (n/a; null in JSON)."""
    device: str = "GPU"
    """What the placed hosts compute on: GPU, CPU, or device (a mix, or a measured peak only); the report's
    noun for `prediction.n_gpus`."""
    shapes: ShapeComparison | None = None
    """Mixed-shape placement beside the best uniform one; None unless the pool's hosts differ in memory."""
    stats_delay: int = 1
    """D of an MoE run's routing barrier (--stats-delay)."""

    def as_json(self) -> str:
        d = dataclasses.asdict(dataclasses.replace(self, shapes=None))  # shapes: a summary, not every host
        if self.unpriced:  # $0/h is not a price: null what depends on it
            d["prediction"].update(usd_per_hour=None, usd_per_mtok=None)
            for e in (d["predicted"], d["measured"]):
                for name in (
                    "usd_per_hour",
                    "usd_per_mtok",
                    "saving",
                    "break_even_tokens_per_s",
                    "break_even_mfu",
                ):
                    if e is not None:
                        e[name] = None
        d["shapes"] = None if self.shapes is None else _shapes_json(self.shapes)
        return json.dumps(d, separators=(",", ":"))

    def warning(self) -> str | None:
        """One line for stderr when a placed host group has no price."""
        if not self.unpriced:
            return None
        groups = ", ".join(repr(g) for g in self.unpriced)
        return (
            f"warning: no price for host group(s) {groups} (usd_per_gpu_hour missing or 0): $/Mtok and $/h "
            "shown as n/a (example: usd_per_gpu_hour = 1.10 in the pool file, or --usd-per-gpu-hour 1.17)"
        )


def plan(args: argparse.Namespace) -> PlanResult:
    """Predict the pool's run and price it (and a measurement); raises UsageError (or ValueError from the
    planner) on bad input."""
    check_args(args)
    shape = get_model(args.model)
    if args.seq_len:
        shape = dataclasses.replace(shape, seq_len=args.seq_len)
    settings = RunSettings(
        microbatches=args.microbatches,
        microbatch_size=args.microbatch_size,
        schedule=args.schedule,
        k=args.k,
        k_min=args.k_min,
        extra_in_flight=args.extra_in_flight,
        ceiling=args.ceiling,
        H=args.H,
        fragments=args.fragments,
        tau=args.tau,
        compression_ratio=args.compression_ratio,
        stats_delay=args.stats_delay,
    )
    pool = _pool(args)
    hosts = pool.expand(args.usd_per_gpu_hour, args.store_rtt_ms)
    S = args.stages if args.stages is not None else auto_stages(shape, hosts, settings)
    R = args.replicas if args.replicas is not None else len(hosts) // S
    if R < 1:
        raise UsageError(
            f"{len(hosts)} hosts cannot hold one replica of {S} stages: add hosts or lower --stages"
        )
    layout = naive_layout(shape, hosts, R, S, settings)
    unpriced = sorted(
        {h.name.rsplit("#", 1)[0] for row in layout.replicas for h in row if h.usd_per_hour <= 0}
    )
    pred = predict(shape, layout, settings)
    shapes = compare_shapes(shape, hosts, settings, planned=layout)
    accelerator = {g.name: g.accelerator for g in pool.hosts}
    placed = {accelerator[h.name.rsplit("#", 1)[0]] for row in layout.replicas for h in row}
    device = "CPU" if placed == {"cpu"} else "GPU" if "cpu" not in placed and "" not in placed else "device"
    ref = None
    if args.reference_usd_per_hour is not None:
        ref = ReferenceCluster.from_instance(
            usd_per_hour=args.reference_usd_per_hour,
            gpus=args.reference_gpus,
            mfu=args.reference_mfu if args.reference_mfu is not None else args.ceiling,
            name=args.reference_name,
        )
        ref = dataclasses.replace(ref, peak_tflops_per_gpu=args.reference_tflops)

    def price(tokens_per_s: float) -> Economics:
        return economics(
            tokens_per_s=tokens_per_s,
            n_gpus=pred.n_gpus,
            peak_tflops_per_gpu=pred.peak_tflops / pred.n_gpus,  # means: exact for a mixed pool
            flops_per_token=pred.flops_per_token,
            usd_per_gpu_hour=pred.usd_per_hour / pred.n_gpus,
            ceiling=args.ceiling,
            reference=ref,
        )

    return PlanResult(
        model=args.model,
        n_params=shape.n_params,
        n_active_params=shape.n_active_params,
        replicas=R,
        stages=S,
        unused_hosts=len(hosts) - R * S,
        prediction=pred,
        reference=ref,
        predicted=price(pred.tokens_per_s),
        measured=price(args.measured_tokens_per_s) if args.measured_tokens_per_s is not None else None,
        unpriced=tuple(unpriced),
        device=device,
        shapes=shapes,
        stats_delay=settings.stats_delay,
    )


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} "


def _count(n: int, noun: str) -> str:
    """`1 stage`, `4 stages`, `1 CPU`, `48 GPUs`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _k(x: float) -> str:
    return f"{x / 1e3:,.1f}K" if x < 1e6 else f"{x / 1e6:,.2f}M"


NO_PRICE = "n/a (no price)"


def report(res: PlanResult) -> str:
    """The human-readable plan; dollar figures read n/a when a placed host group has no price."""
    p, b = res.prediction, res.prediction.breakdown
    priced = not res.unpriced

    def usd(x: float, digits: int, per: str) -> str:
        return f"${x:,.{digits}f}/{per}" if priced else f"$/{per} {NO_PRICE}"

    ks = sorted({ln.k for ln in p.links})
    slowest = max((ln.transfer_s for ln in p.links), default=0.0)
    moe = p.route.bytes_per_step > 0  # a stage holds MoE layers: the routing barrier runs
    params = _si(res.n_params).replace("G", "B") + " params"
    if moe:
        params += f" ({_si(res.n_active_params).replace('G', 'B')} active)"
    mfu = f"MFU {p.effective_mfu:.1%}" + (" on active params" if moe else "")
    lines = [
        f"model      {res.model}: {params}, {_si(p.flops_per_token)}FLOP/token",
        f"topology   {_count(res.replicas, 'replica')} x {_count(res.stages, 'stage')} on "
        f"{_count(p.n_gpus, res.device)} ({_count(res.unused_hosts, 'host')} unused); "
        f"layers/stage {'/'.join(map(str, p.layers))}",
        f"links      k {', '.join(map(str, ks)) or 'n/a (one stage)'}; slowest message {slowest * 1e3:.0f} ms; "
        f"{sum(not ln.hidden for ln in p.links)} of {len(p.links)} not hidden by compute",
        f"sync       fragment transfer {p.fragment_transfer_s:.2f} s vs overlap window {p.overlap_window_s:.2f} s",
        *([_routing_line(res)] if moe else []),
        f"predicted  {_k(p.tokens_per_s)} tokens/s | {mfu} | tax {p.tax:.1%} | "
        f"{usd(p.usd_per_mtok, 4, 'Mtok')} | {usd(p.usd_per_hour, 2, 'h')}",
        f"breakdown  compute {b.compute:.1%} | imbalance {b.imbalance:.1%} | bubble {b.bubble:.1%} | "
        f"link wait {b.link_wait:.1%} | sync wait {b.sync_wait:.1%}"
        + (f" | route wait {b.route_wait:.1%}" if moe else ""),
    ]
    if res.measured is not None:
        m = res.measured
        lines.append(
            f"measured   {_k(m.tokens_per_s)} tokens/s | MFU {m.effective_mfu:.1%} | tax {m.tax:.1%} | "
            f"{usd(m.usd_per_mtok, 4, 'Mtok')}"
        )
    for label, e in (("predicted", res.predicted), ("measured", res.measured)):
        if res.reference is None or e is None or e.saving is None:
            continue
        assert e.reference_tokens_per_s and e.break_even_tokens_per_s and e.break_even_mfu is not None
        if not priced:
            lines.append(
                f"vs {res.reference.name} ({label}): {_k(e.reference_tokens_per_s)} tokens/s at "
                f"{res.reference.mfu:.0%} MFU, ${e.reference_usd_per_mtok:.4f}/Mtok; ours {NO_PRICE}"
            )
            continue
        lines.append(
            f"vs {res.reference.name} ({label}): {_k(e.reference_tokens_per_s)} tokens/s at "
            f"{res.reference.mfu:.0%} MFU, ${e.reference_usd_per_mtok:.4f}/Mtok; ours {abs(e.saving):.1%} {'cheaper' if e.saving >= 0 else 'dearer'}; "
            f"break-even {_k(e.break_even_tokens_per_s)} tokens/s ({e.break_even_mfu:.1%} MFU)"
        )
    lines += [f"warning    {w}" for w in p.warnings]
    if res.shapes is not None:
        lines += _shapes_report(res.shapes, p.warnings)
    return "\n".join(lines)


def _routing_line(res: PlanResult) -> str:
    """The MoE routing barrier: its store time per step, what D - 1 steps leave of it, its bytes, and
    what the fastest replica waits for the slowest."""
    r = res.prediction.route
    return (
        f"routing    barrier {r.barrier_s:.3f} s a step ({route_round_trips(res.replicas)} store round trips, "
        f"{r.bytes_per_step / 1e3:.1f} kB a stage); stall {r.stall_s:.3f} s/step at D = {res.stats_delay}; "
        f"the slowest replica paces the rest (+{r.pace_s:.3f} s/step)"
    )


MIXED_NOTE = (
    "a planning figure: the swarm runs it when the run spec states those shapes ([[shapes]] with stages); "
    "the coordinator does not pick them itself"
)


def _group_names(plan: ShapePlan, g: int) -> str:
    """The pool's host groups that serve shape g (host names are `group#i`), and their memory a host."""
    hosts = [h for row in plan.groups[g].layout.replicas for h in row]
    names = ", ".join(sorted({h.name.rsplit("#", 1)[0] for h in hosts}))
    lo, hi = min(h.memory_gb for h in hosts), max(h.memory_gb for h in hosts)
    return f"{names} ({lo:.0f} GB a host)" if lo == hi else f"{names} ({lo:.0f}-{hi:.0f} GB a host)"


def _shapes_json(c: ShapeComparison) -> dict[str, Any]:
    """The --json form of the comparison: figures and shapes, not the hosts of every replica."""

    def arm(plan: ShapePlan) -> dict[str, Any]:
        shapes = [
            dict(
                hosts=sorted({h.name.rsplit("#", 1)[0] for row in g.layout.replicas for h in row}),
                memory_gb=g.memory_gb,
                replicas=g.replicas,
                stages=g.stages,
                layers=list(g.layout.layers),
                tokens_per_s=g.prediction.tokens_per_s,
                warnings=list(g.prediction.warnings),
            )
            for g in plan.groups
        ]
        return dict(
            shapes=shapes,
            replicas=plan.replicas,
            tokens_per_s=plan.tokens_per_s,
            effective_mfu=plan.effective_mfu,
            tax=plan.tax,
            usd_per_hour=plan.usd_per_hour if plan.priced else None,
            usd_per_mtok=plan.usd_per_mtok if plan.priced else None,
            n_gpus=plan.n_gpus,
            unused_hosts=plan.unused_hosts,
        )

    return dict(
        mixed=arm(c.mixed),
        uniform=arm(c.uniform),
        uniform_is_planned=c.uniform_is_planned,
        mixed_gain=c.mixed_gain,
        note=MIXED_NOTE,
    )


def _shapes_report(c: ShapeComparison, printed: Sequence[str]) -> list[str]:
    """The report's mixed-shape section: each arm's shapes, its figures, the warnings not already
    printed (`printed`), then which predicts more. Dollar figures read n/a for an arm that places a host
    without a price."""
    lines = []
    for label, plan in (("mixed", c.mixed), ("uniform", c.uniform)):
        same = " (the plan above)" if label == "uniform" and c.uniform_is_planned else ""
        for i, g in enumerate(plan.groups):
            shape = (
                f"{_count(g.replicas, 'replica')} x {_count(g.stages, 'stage')} on {_group_names(plan, i)}"
            )
            lines.append(
                f"{label if i == 0 else '':<10} {shape}, layers/stage {'/'.join(map(str, g.layout.layers))}: "
                f"{_k(g.prediction.tokens_per_s)} tokens/s{same}"
            )
        usd = (
            f"${plan.usd_per_mtok:,.4f}/Mtok | ${plan.usd_per_hour:,.2f}/h"
            if plan.priced
            else f"$/Mtok {NO_PRICE}"
        )
        lines.append(
            f"{'':<10} {_k(plan.tokens_per_s)} tokens/s | MFU {plan.effective_mfu:.1%} | "
            f"tax {plan.tax:.1%} | {usd} | {_count(plan.unused_hosts, 'host')} unused"
        )
        lines += [
            f"{'':<10} warning ({label}, {g.stages} stages): {w}"
            for g in plan.groups
            for w in g.prediction.warnings
            if w not in printed
        ]
    more = "more" if c.mixed_gain >= 0 else "fewer"
    verdict = f"mixed-shape predicts {abs(c.mixed_gain):.1%} {more} tokens/s than the best uniform"
    if c.mixed.priced and c.uniform.priced:
        cheaper = c.mixed.usd_per_mtok / c.uniform.usd_per_mtok - 1.0
        verdict += f", at {abs(cheaper):.1%} {'lower' if cheaper <= 0 else 'higher'} $/Mtok"
    lines.append(f"shapes     {verdict}; {MIXED_NOTE}")
    return lines


def run(args: argparse.Namespace) -> int:
    """Print the plan (or one JSON line with --json), and a warning line on stderr for a missing price;
    0 on success. Bad input raises UsageError (exit 2 through `run_cli`)."""
    try:
        out = plan(args)
    except ValueError as e:  # the planner's checks: a pool too small, a model that does not fit
        raise UsageError(str(e)) from e
    if (warning := out.warning()) is not None:
        print(f"crucible-coordinator plan: {warning}", file=sys.stderr, flush=True)
    print(out.as_json() if args.json else report(out))
    return 0


def _main(argv: list[str] | None) -> int:
    parser = ArgumentParser(prog="crucible-coordinator")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry, the same as `crucible-coordinator plan ...`."""
    return run_cli("crucible-coordinator", _main, None if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())

"""Planner: one cost model for tokens/s, effective MFU, low-bandwidth tax and $/Mtok of a topology.

The CLI (`crucible-coordinator plan`) prints it; placement (coordinator/placement.py) scores candidate
topologies with it. Units: seconds, bits/s as Mbit/s (1e6), bytes, FLOPs; `peak` is dense bf16 tensor
FLOP/s (accelerators.py).

Definitions (DESIGN section 7)::

    effective MFU = tokens/s x FLOPs/token / (sum of peak FLOP/s of every placed GPU)
    tax           = 1 - MFU / ceiling            # ceiling: achievable MFU of a tuned local stage (0.65)
    $/Mtok        = (sum of $/h) / (tokens/s x 3600) x 1e6

FLOPs/token is `ModelShape.flops_per_token`, F = 6 N + 14 L d s (coordinator/plan/inputs.py says why).

The planner is split along its seams; this module is the prediction and re-exports the rest, so
`from coordinator.plan.planner import ...` keeps working:

- coordinator/plan/inputs.py     model shapes, pools and pool files, run settings
- coordinator/plan/links.py      boundary message bytes, transfer time, choose_k
- coordinator/plan/layout.py     Layout, per-stage work/params/memory, layer balancing, naive layout
- coordinator/plan/schedule.py   the pipeline schedule replayed op by op
- coordinator/plan/economics.py  $/Mtok and the reference-cluster comparison
- coordinator/plan/shapes.py     mixed-shape placement (replicas of different stage counts) beside the
                                 best uniform one; it imports this module, so it is not re-exported
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from coordinator.plan.economics import Economics, ReferenceCluster, economics, usd_per_mtok
from coordinator.plan.inputs import (
    ATTENTION_COEF_FLASH,
    ATTENTION_COEF_PALM,
    MEMORY_HEADROOM,
    MODELS,
    STORE_RTT_MS,
    Host,
    HostGroup,
    ModelShape,
    Pool,
    RunSettings,
    get_model,
    load_pool,
)
from coordinator.plan.layout import (
    Layout,
    auto_stages,
    balance_layers,
    naive_layout,
    stage_memory_bytes,
    stage_params,
    stage_work,
)
from coordinator.plan.links import activation_bytes, choose_k, id_bytes, transfer_s
from coordinator.plan.schedule import schedule_step, warmup_forwards
from protocol import memory

__all__ = [
    "ATTENTION_COEF_FLASH",
    "ATTENTION_COEF_PALM",
    "MEMORY_HEADROOM",
    "MODELS",
    "ROUTE_COUNT_BYTES",
    "ROUTE_RECORD_OVERHEAD_BYTES",
    "STORE_RTT_MS",
    "Breakdown",
    "Economics",
    "Host",
    "HostGroup",
    "Layout",
    "LINK_WARN_SHARE",
    "LinkPlan",
    "ModelShape",
    "Pool",
    "Prediction",
    "ReferenceCluster",
    "RouteFigures",
    "RunSettings",
    "activation_bytes",
    "auto_stages",
    "balance_layers",
    "boundary_k",
    "choose_k",
    "economics",
    "get_model",
    "id_bytes",
    "Figures",
    "figures",
    "figures_at",
    "load_pool",
    "naive_layout",
    "placed_figures",
    "predict",
    "replica_step_s",
    "route_barrier_s",
    "route_record_bytes",
    "route_round_trips",
    "route_stall_s",
    "schedule_step",
    "stage_memory_bytes",
    "stage_params",
    "stage_work",
    "transfer_s",
    "usd_per_mtok",
    "warmup_forwards",
]


LINK_WARN_SHARE = 0.02
"""`predict` warns about links whose transfers add more than this share to their replica's step."""
ROUTE_COUNT_BYTES = 4
"""Bytes of one routing count on the wire (protocol.messages.RouteCounts: little-endian uint32)."""
ROUTE_RECORD_OVERHEAD_BYTES = 300
"""A routing record's signed envelope beyond its counts (measured: 228 bytes for 1 layer, 281 for 48)."""


@dataclass(kw_only=True, frozen=True)
class LinkPlan:
    """One pipeline boundary of one replica (stage `boundary` -> `boundary + 1`)."""

    replica: int
    boundary: int
    k: int
    bytes_per_microbatch: int
    transfer_s: float
    """Serialization time of one message, each direction (links are full duplex)."""
    rtt_ms: float
    hidden: bool
    """Compute hides the transfer: replayed with this link's messages instantaneous (latency kept),
    the step is shorter by no more than 2 transfer_s, the first forward's and the last backward's,
    which no schedule can hide."""
    added_s: float = 0.0
    """What this link's transfers add to its replica's step: the step minus the step replayed with this
    link's messages instantaneous (latency kept)."""


@dataclass(kw_only=True, frozen=True)
class Breakdown:
    """Where the placed GPUs' time goes, as fractions of it (sum 1; compute = MFU / ceiling)."""

    compute: float
    """Work at the ceiling, as if perfectly balanced."""
    imbalance: float
    """Faster stages waiting on the replica's slowest stage."""
    bubble: float
    """Pipeline fill and drain, (S-1)/(M+S-1) of a balanced step."""
    link_wait: float
    """Transfers and latency that compute does not hide."""
    sync_wait: float
    """SparseLoCo fragment transfers still in flight when the overlap window closes."""
    route_wait: float = 0.0
    """MoE: the routing barrier, its store round trips not hidden and the wait for the slowest replica."""


@dataclass(kw_only=True, frozen=True)
class RouteFigures:
    """An MoE run's routing barrier, per inner step (`_route`); zeros for a dense model."""

    barrier_s: float = 0.0
    """Store time of one barrier at the slowest stage, before D - 1 steps hide it."""
    stall_s: float = 0.0
    """Seconds the barrier adds to every inner step, max(0, barrier_s - (D - 1) step)."""
    pace_s: float = 0.0
    """Seconds per step the fastest replica waits for the slowest (the barrier holds every replica to
    the slowest one's pace)."""
    bytes_per_step: int = 0
    """Bytes the busiest stage moves through the store per inner step (its record up, R - 1 down)."""


@dataclass(kw_only=True, frozen=True)
class Prediction:
    """The model's answer for one layout and settings."""

    tokens_per_s: float
    effective_mfu: float
    tax: float
    """1 - MFU / ceiling."""
    usd_per_hour: float
    usd_per_mtok: float
    n_gpus: int
    peak_tflops: float
    """Sum over placed hosts."""
    flops_per_token: float
    layers: tuple[int, ...]
    step_s: tuple[float, ...]
    """Inner-step time of each replica (M microbatches), sync wait included."""
    breakdown: Breakdown
    links: tuple[LinkPlan, ...]
    fragment_transfer_s: float
    """Slowest stage's fragment upload+download time (one fragment, all peers' copies)."""
    overlap_window_s: float
    """tau inner steps of the slowest replica: the time a fragment transfer can hide behind."""
    warnings: tuple[str, ...]
    n_active_params: int = 0
    """Parameters a token goes through, what flops_per_token counts (all of them for a dense model)."""
    route: RouteFigures = RouteFigures()
    """MoE: the routing barrier per inner step (zeros for a dense model)."""


@dataclass(kw_only=True, frozen=True)
class _ReplicaStep:
    seconds: dict[str, float]  # Breakdown field -> seconds per inner step; they sum to step_s
    step_s: float
    links: list[LinkPlan]
    fragment_transfer_s: float


@dataclass(kw_only=True, frozen=True)
class _Links:
    """A replica's stage compute and boundary messages, before the schedule is replayed."""

    t_c: list[float]
    """Compute of each stage per microbatch, forward + backward."""
    rtt: list[float]
    """Round trip of each boundary, seconds."""
    ks: list[int]
    sizes: list[int]
    t_x: list[float]


def _link_budget(t_c: list[float], rtt: list[float], settings: RunSettings) -> float:
    """Seconds a boundary message may take and still hide behind compute (the automatic k's target)."""
    S, M = len(t_c), settings.microbatches
    slot = max(t_c)
    W = min(M, S + settings.extra_in_flight)  # microbatches stage 0 keeps in flight under 1F1B
    budget = slot  # steady state: under GPipe a message only has to keep up with the slot
    if settings.schedule == "1f1b" and S > 1:
        # A microbatch's round trip, sum t_c + sum (rtt + 2 t_x), must fit in W slots; the slack
        # left after compute and latency is shared evenly by the 2 (S-1) messages.
        budget = min(slot, max(0.0, W * slot - sum(t_c) - sum(rtt)) / (2 * (S - 1)))
    fill_cap = settings.fill_share * (M + S - 1) * slot / (2 * max(1, S - 1))
    return min(budget, fill_cap)


def _wire(shape: ModelShape, settings: RunSettings) -> dict[str, int]:
    return dict(
        bytes_per_value=settings.bytes_per_value,
        token_id_bytes=settings.token_id_bytes or id_bytes(shape.vocab),
        header_bytes=settings.header_bytes,
    )


def _auto_k(shape: ModelShape, settings: RunSettings, mbps: float, budget_s: float) -> int:
    """The automatic k of one link: the largest that serializes within `budget_s`, floored at k_min."""
    tokens_mb, d = settings.microbatch_size * shape.seq_len, shape.d_model
    fit = choose_k(
        d_model=d, tokens=tokens_mb, bandwidth_mbps=mbps, compute_s=budget_s, **_wire(shape, settings)
    )
    return min(max(fit or 0, settings.k_min), d)


def _links(
    shape: ModelShape,
    hosts: tuple[Host, ...],
    layers: tuple[int, ...],
    settings: RunSettings,
    mbps: tuple[float, ...] | None,
    rtt_ms: tuple[float, ...] | None,
) -> _Links:
    """Stage compute and boundary messages of one replica (`predict` for the formulas); a link's
    bandwidth and round trip are the measured ones when given, else its two hosts' figures."""
    S, d = len(hosts), shape.d_model
    tokens_mb = settings.microbatch_size * shape.seq_len
    wire = _wire(shape, settings)
    work = stage_work(shape, layers)
    t_c = [work[s] * tokens_mb / (hosts[s].compute_tflops(settings.ceiling) * 1e12) for s in range(S)]
    if mbps is None:
        mbps = tuple(min(hosts[i].link_mbps, hosts[i + 1].link_mbps) for i in range(S - 1))
    if rtt_ms is None:
        rtt_ms = tuple(max(hosts[i].rtt_ms, hosts[i + 1].rtt_ms) for i in range(S - 1))
    rtt = [x / 1e3 for x in rtt_ms]
    budget = None if settings.k else _link_budget(t_c, rtt, settings)
    ks, sizes, t_x = [], [], []
    for i in range(S - 1):  # boundary i: stage i -> i + 1
        k = min(settings.k, d) if settings.k else _auto_k(shape, settings, mbps[i], budget or 0.0)
        ks.append(k)
        sizes.append(activation_bytes(k=k, d_model=d, tokens=tokens_mb, **wire))
        t_x.append(transfer_s(sizes[-1], mbps[i]))
    return _Links(t_c=t_c, rtt=rtt, ks=ks, sizes=sizes, t_x=t_x)


def _replay(ln: _Links, settings: RunSettings, t_x: list[float], delay: list[float]) -> float:
    """The node's schedule replayed: forward = 1/3 of a microbatch's compute (2N of the 6N FLOPs)."""
    f, b = [t / 3 for t in ln.t_c], [2 * t / 3 for t in ln.t_c]
    return schedule_step(f, b, t_x, delay, settings.microbatches, settings.schedule, settings.extra_in_flight)


def _sync_wait(
    shape: ModelShape,
    hosts: tuple[Host, ...],
    layers: tuple[int, ...],
    settings: RunSettings,
    R: int,
    step: float,
) -> tuple[float, float]:
    """(sync wait per inner step, slowest fragment transfer): every stage streams P fragments per H
    steps; the stage that blocks longest stalls all."""
    sync, t_f_max = 0.0, 0.0
    P, H, tau = settings.fragments, settings.H, settings.tau
    for s, n_params in enumerate(stage_params(shape, layers)):
        copies = settings.fragment_copies(R)  # all-to-all: R - 1 down; butterfly: one message of two
        t_f = transfer_s(n_params * 4 / settings.compression_ratio / P * copies, hosts[s].store_mbps)
        t_f_max = max(t_f_max, t_f)
        late = P * max(0.0, t_f - tau * step)
        backlog = P * t_f - H * step  # the I/O loop cannot keep up with one fragment every q steps
        sync = max(sync, max(late, backlog, 0.0) / H)
    return sync, t_f_max


def route_record_bytes(shape: ModelShape, start: int, end: int) -> int:
    """Bytes of one replica's routing record for blocks [start, end) (node/sync/route_exchange.py): a
    count per MoE layer and expert, and the signed envelope; 0 when the blocks hold no MoE layer."""
    m = shape.moe_blocks(start, end)
    return m * shape.experts * ROUTE_COUNT_BYTES + ROUTE_RECORD_OVERHEAD_BYTES if m else 0


def route_round_trips(R: int) -> int:
    """Store requests one routing barrier makes in turn: PUT ours, LIST the step's prefix, then GET the
    R - 1 others' records at once (node/sync/route_exchange.py reads them in parallel); 2 alone."""
    return 3 if R > 1 else 2


def route_barrier_s(
    shape: ModelShape, hosts: tuple[Host, ...], layers: tuple[int, ...], R: int
) -> tuple[float, int]:
    """(store seconds of one routing barrier, bytes per step) at a replica's slowest stage. Each stage
    with MoE layers, every inner step (node/sync/route_exchange.py)::

        t_barrier = 3 x store_rtt + R x record_bytes x 8 / store_bps   # route_round_trips(R)
                    # our record up, the R - 1 others' down

    (0.0, 0) for a dense model."""
    t_max, bytes_max, start = 0.0, 0, 0
    for h, n in zip(hosts, layers, strict=True):
        b = route_record_bytes(shape, start, start + n)
        start += n
        if b:
            t = route_round_trips(R) * h.store_rtt_ms / 1e3 + transfer_s(R * b, h.store_mbps)
            t_max, bytes_max = max(t_max, t), max(bytes_max, R * b)
    return t_max, bytes_max


def route_stall_s(barrier_s: float, step_s: float, settings: RunSettings) -> float:
    """What the barrier adds to an inner step of step_s: the set of step t is needed before step
    t + D (D = settings.stats_delay), so D - 1 steps of compute hide it: max(0, t_barrier - (D-1) step).
    The barriers of consecutive steps are taken to overlap (each its own requests)."""
    return max(0.0, barrier_s - (settings.stats_delay - 1) * step_s)


def replica_step_s(
    shape: ModelShape,
    hosts: tuple[Host, ...],
    layers: tuple[int, ...],
    settings: RunSettings,
    *,
    replicas: int,
    link_mbps: tuple[float, ...] | None = None,
    link_rtt_ms: tuple[float, ...] | None = None,
) -> float:
    """One replica's inner step, sync wait included: `predict`'s step_s for it, without the breakdown
    (one schedule replay instead of S + 1). Placement scores candidate replicas with it;
    M x b x s / replica_step_s is the replica's tokens/s. `replicas`: R of the run (fragments to fetch,
    routing records to read). MoE: the replica's own barrier stall; `predict` also paces every replica at
    the slowest one's step, which a per-replica score cannot see."""
    ln = _links(shape, hosts, layers, settings, link_mbps, link_rtt_ms)
    step = _replay(ln, settings, ln.t_x, [rt / 2 for rt in ln.rtt])
    if shape.experts:  # as `predict` holds a replica: the barrier's stall, then the sync wait against it
        step += route_stall_s(route_barrier_s(shape, hosts, layers, replicas)[0], step, settings)
    return step + _sync_wait(shape, hosts, layers, settings, replicas, step)[0]


def boundary_k(shape: ModelShape, layout: Layout, settings: RunSettings) -> tuple[int, ...]:
    """k of every boundary for the run as a whole: the same in every replica (stage weights are averaged
    across replicas and constrained to the boundaries' subspaces), so the smallest of the replicas'
    automatic k (`choose_k` on each replica's link budget, floored at `settings.k_min`): the slowest
    measured link a boundary crosses sets its k, so bytes_per_microbatch(k) / bandwidth fits the
    compute that hides it. `settings.k` is ignored: this is how to choose it."""
    S = len(layout.layers)
    ks = [shape.d_model] * (S - 1)
    for r, hosts in enumerate(layout.replicas):
        mbps = layout.link_mbps[r] if layout.link_mbps else None
        rtt = layout.link_rtt_ms[r] if layout.link_rtt_ms else None
        ln = _links(shape, hosts, layout.layers, replace(settings, k=None), mbps, rtt)
        ks = [min(a, b) for a, b in zip(ks, ln.ks, strict=True)]
    return tuple(ks)


def _replica_step(
    shape: ModelShape,
    hosts: tuple[Host, ...],
    r: int,
    R: int,
    layers: tuple[int, ...],
    settings: RunSettings,
    mbps: tuple[float, ...] | None = None,
    rtt_ms: tuple[float, ...] | None = None,
) -> _ReplicaStep:
    """One replica's inner step; see `predict` for the formulas."""
    S, M = len(hosts), settings.microbatches
    tokens_mb = settings.microbatch_size * shape.seq_len
    ln = _links(shape, hosts, layers, settings, mbps, rtt_ms)
    t_x, slot = ln.t_x, max(ln.t_c)
    half_rtt = [rt / 2 for rt in ln.rtt]
    step = _replay(ln, settings, t_x, half_rtt)
    step_ideal_links = _replay(ln, settings, [0.0] * (S - 1), [0.0] * (S - 1))
    added = [
        step - _replay(ln, settings, [0.0 if j == i else x for j, x in enumerate(t_x)], half_rtt)
        for i in range(S - 1)
    ]
    links = [
        LinkPlan(
            replica=r,
            boundary=i,
            k=ln.ks[i],
            bytes_per_microbatch=ln.sizes[i],
            transfer_s=t_x[i],
            rtt_ms=ln.rtt[i] * 1e3,
            hidden=added[i] <= 2 * t_x[i] + 1e-6 * step,
            added_s=max(0.0, added[i]),
        )
        for i in range(S - 1)
    ]
    sync, t_f_max = _sync_wait(shape, hosts, layers, settings, R, step)
    ideal = (
        M
        * tokens_mb
        * shape.flops_per_token()
        / (sum(h.compute_tflops(settings.ceiling) for h in hosts) * 1e12)
    )
    seconds = dict(
        compute=ideal,
        imbalance=M * slot - ideal,
        bubble=step_ideal_links - M * slot,
        link_wait=step - step_ideal_links,
        sync_wait=sync,
    )
    return _ReplicaStep(seconds=seconds, step_s=step + sync, links=links, fragment_transfer_s=t_f_max)


@dataclass(kw_only=True, frozen=True)
class Figures:
    """Effective MFU, tax and $/Mtok of a layout at a given tokens/s (predicted, or measured live)."""

    effective_mfu: float
    tax: float
    usd_per_mtok: float | None
    """None at 0 tokens/s."""


def figures(shape: ModelShape, layout: Layout, settings: RunSettings, tokens_per_s: float) -> Figures:
    """The module docstring's definitions at `tokens_per_s`: what `predict` reports for its prediction
    and what the coordinator's dashboard reports for the tokens/s the nodes measure."""
    return placed_figures(shape, [h for rep in layout.replicas for h in rep], settings, tokens_per_s)


def placed_figures(
    shape: ModelShape, placed: Sequence[Host], settings: RunSettings, tokens_per_s: float
) -> Figures:
    """`figures` over a list of placed hosts: a mixed-shape run has no single Layout (shapes.py)."""
    peak_total = sum(h.peak_tflops for h in placed)
    mfu = tokens_per_s * shape.flops_per_token() / (peak_total * 1e12) if peak_total > 0 else 0.0
    usd = sum(h.usd_per_hour for h in placed)
    return Figures(
        effective_mfu=mfu,
        tax=1.0 - mfu / settings.ceiling,
        usd_per_mtok=usd_per_mtok(usd, tokens_per_s) if tokens_per_s > 0 else None,
    )


def figures_at(fig: Figures, fig_tokens_per_s: float, tokens_per_s: float) -> Figures:
    """`figures` of the same layout at another tokens/s, from its figures at `fig_tokens_per_s`: MFU is
    proportional to tokens/s (the layout's peaks and FLOPs/token do not change), $/Mtok inversely (nor do
    its $/h), and tax = 1 - MFU / ceiling with ceiling = MFU / (1 - tax). For a measured tokens/s next to
    a prediction that gives only its figures (crucible-swarm's report beside the coordinator's)."""
    if not fig_tokens_per_s > 0 or not fig.effective_mfu > 0 or not fig.tax < 1:
        raise ValueError(
            f"figures at {fig_tokens_per_s} tokens/s (MFU {fig.effective_mfu}) cannot be rescaled"
        )
    ratio = tokens_per_s / fig_tokens_per_s
    mfu = fig.effective_mfu * ratio
    ceiling = fig.effective_mfu / (1.0 - fig.tax)
    usd = fig.usd_per_mtok / ratio if fig.usd_per_mtok is not None and tokens_per_s > 0 else None
    return Figures(effective_mfu=mfu, tax=1.0 - mfu / ceiling, usd_per_mtok=usd)


def _memory_warnings(shape: ModelShape, layout: Layout, settings: RunSettings) -> list[str]:
    """Hosts whose stage state (weights, gradients, optimizer), or state and activations, pass
    MEMORY_HEADROOM of their memory: one warning for each, naming the first such host."""
    S = len(layout.layers)
    warnings = []
    params = stage_params(shape, layout.layers)
    state = settings.state_bytes_per_param()
    over = [
        h.name
        for rep in layout.replicas
        for s, h in enumerate(rep)
        if params[s] * state > MEMORY_HEADROOM * memory.GB * h.memory_gb > 0
    ]
    if over:
        warnings.append(
            f"stage state exceeds 90% of memory on {len(over)} host(s), e.g. {over[0]}: use more stages"
        )
    need = stage_memory_bytes(shape, layout.layers, settings)
    full = [
        (h, s)
        for rep in layout.replicas
        for s, h in enumerate(rep)
        if h.name not in over and need[s] > MEMORY_HEADROOM * memory.GB * h.memory_gb > 0
    ]
    if full:
        h, s = full[0]
        warnings.append(
            f"with activations (no recomputation, {settings.in_flight(S, s)} microbatches in flight) stage "
            f"memory exceeds 90% on {len(full)} host(s), e.g. {h.name}: stage {s} needs {need[s] / memory.GB:.1f} "
            f"of {h.memory_gb:.0f} GB; lower microbatch_size or extra_in_flight, or use more stages"
        )
    return warnings


def _link_warnings(steps: list[_ReplicaStep]) -> list[str]:
    """The link messages that add to their replica's step, in one warning (none if no link does)."""
    # a link is worth a warning when its transfers cost the step more than LINK_WARN_SHARE of it: on a
    # fast link (loopback, a datacenter) a message that the schedule cannot fully hide still costs nothing
    links = [ln for st in steps for ln in st.links]
    step_of = {r: st.step_s for r, st in enumerate(steps)}
    slow = [ln for ln in links if not ln.hidden and ln.added_s > LINK_WARN_SHARE * step_of[ln.replica]]
    if not slow:
        return []
    return [
        f"{len(slow)} of {len(links)} link messages add to the step (up to "
        f"{max(ln.added_s / step_of[ln.replica] for ln in slow):.0%} of it; k down to "
        f"{min(ln.k for ln in slow)}): add bandwidth, lower k, or (1F1B) raise extra_in_flight to cover "
        "the round trips"
    ]


def _store_warnings(layout: Layout, settings: RunSettings, steps: list[_ReplicaStep]) -> list[str]:
    """Each replica whose slowest store link cannot move a fragment in the time the schedule gives it."""
    warnings = []
    for r, (hosts, st) in enumerate(zip(layout.replicas, steps, strict=True)):
        # each replica's store links against the fragment schedule: a fragment every H/P steps, each
        # overlapping tau steps (tau = 0: no overlap asked for; sync_wait already counts the wait)
        t_f, per_frag = st.fragment_transfer_s, settings.H / settings.fragments * st.step_s
        over_window = settings.tau > 0 and t_f > settings.tau * st.step_s
        if over_window or t_f > per_frag:
            slow_store = min(hosts, key=lambda h: h.store_mbps)
            budget = min(per_frag, settings.tau * st.step_s) if over_window else per_frag
            warnings.append(
                f"replica {r}: a fragment takes {t_f:.1f} s at its slowest store link ({slow_store.name}, "
                f"{slow_store.store_mbps:.0f} Mbit/s), over the {budget:.1f} s the fragment schedule gives "
                f"it (tau x step {settings.tau * st.step_s:.1f} s, H/P steps {per_frag:.1f} s): raise tau, H "
                "or P, or place nodes with faster store links"
            )
    return warnings


def predict(
    shape: ModelShape,
    layout: Layout,
    settings: RunSettings,
    *,
    run_replicas: int | None = None,
    replica_microbatches: Sequence[int] = (),
) -> Prediction:
    """Predict throughput, MFU, tax and price of `layout` (module docstring for F and the definitions).

    `replica_microbatches`: M of each replica where the run's [[shapes]] give replicas their own (a
    larger batch: more tokens per step, a smaller bubble share); empty: every replica `settings.microbatches`.

    `run_replicas`: R of the whole run when `layout` is only part of it (one shape of a mixed-shape run,
    coordinator/plan/shapes.py): every replica fetches the fragments of all R - 1 others. None: the
    layout's own replicas are the run.

    Per replica, with t_c[s] the compute of stage s per microbatch and t_x[l] a link's message time::

        t_c[s]  = work[s] x b s / rate[s]                   # forward t_c / 3, backward 2 t_c / 3
        rate[s] = the host's sustained rate (reference block) if measured, else peak[s] x ceiling
        step    = schedule_step(t_c / 3, 2 t_c / 3, t_x, rtt / 2) + sync_wait   # replayed op by op:
                  (M + S - 1) t_c for balanced stages on ideal links; in steady state a microbatch takes
                  T = max(max t_c, max t_x, (sum t_c + sum (rtt + 2 t_x)) / W), W = S (+extra) in flight
        sync    = max(P max(0, t_f - tau step), P t_f - H step) / H   # per inner step, per stage
        t_f     = params_s x 4 / ratio / P x max(1, R - 1) x 8 / store_bps  # up 1 copy, down R-1
                  (sync.topology = "butterfly": x 2, one partner's message of two parts)

    Replicas never wait on each other (DESIGN section 2), so tokens/s sums over replicas; the
    breakdown weights each replica's seconds by its share of the pool's peak.

    MoE (`shape.experts`): a routing barrier across replicas ends every inner step; `_route` paces them.
    """
    R, S = len(layout.replicas), len(layout.layers)
    R_run = R if run_replicas is None else run_replicas
    if R_run < R:
        raise ValueError(f"run_replicas={run_replicas} is fewer than the layout's {R} replicas")
    if sum(layout.layers) != shape.n_layers or any(len(rep) != S for rep in layout.replicas):
        raise ValueError(f"layout must give every replica {S} stages and sum to {shape.n_layers} layers")
    if replica_microbatches and len(replica_microbatches) != R:
        raise ValueError(f"{len(replica_microbatches)} microbatch counts for {R} replicas")
    per = [replace(settings, microbatches=m) for m in replica_microbatches] or [settings] * R
    F = shape.flops_per_token()
    placed = [h for rep in layout.replicas for h in rep]
    peak_total = sum(h.peak_tflops for h in placed)
    steps = [
        _replica_step(
            shape,
            hosts,
            r,
            R_run,
            layout.layers,
            per[r],
            layout.link_mbps[r] if layout.link_mbps else None,
            layout.link_rtt_ms[r] if layout.link_rtt_ms else None,
        )
        for r, hosts in enumerate(layout.replicas)
    ]
    route = RouteFigures()
    if shape.experts:
        steps, route = _route(shape, layout, per, R_run, steps)
    parts = dict.fromkeys(("compute", "imbalance", "bubble", "link_wait", "sync_wait", "route_wait"), 0.0)
    for hosts, st in zip(layout.replicas, steps, strict=True):
        weight = sum(h.peak_tflops for h in hosts) / peak_total  # this replica's share of GPU time
        for name, sec in st.seconds.items():
            parts[name] += sec / st.step_s * weight
    tokens_per_s = sum(
        st_r.microbatches * st_r.microbatch_size * shape.seq_len / st.step_s
        for st_r, st in zip(per, steps, strict=True)
    )
    usd_per_hour = sum(h.usd_per_hour for h in placed)
    fig = figures(shape, layout, settings, tokens_per_s)
    links = [ln for st in steps for ln in st.links]
    t_frag = max(st.fragment_transfer_s for st in steps)
    window = settings.tau * min(st.step_s for st in steps)

    warnings = [
        *_memory_warnings(shape, layout, max(per, key=lambda x: x.microbatches)),  # the largest batch
        *_link_warnings(steps),
        *_store_warnings(layout, settings, steps),
    ]
    return Prediction(
        tokens_per_s=tokens_per_s,
        effective_mfu=fig.effective_mfu,
        tax=fig.tax,
        usd_per_hour=usd_per_hour,
        usd_per_mtok=usd_per_mtok(usd_per_hour, tokens_per_s),
        n_gpus=sum(h.gpus for h in placed),
        peak_tflops=peak_total,
        flops_per_token=F,
        layers=layout.layers,
        step_s=tuple(st.step_s for st in steps),
        breakdown=Breakdown(**parts),
        links=tuple(links),
        fragment_transfer_s=t_frag,
        overlap_window_s=window,
        warnings=tuple(warnings),
        n_active_params=shape.n_active_params,
        route=route,
    )


def _route(
    shape: ModelShape,
    layout: Layout,
    per: list[RunSettings],
    R: int,
    steps: list[_ReplicaStep],
) -> tuple[list[_ReplicaStep], RouteFigures]:
    """An MoE run's steps: every inner step ends at a routing barrier across replicas (node/sync/expert_bias.py), so
    no replica gets more than D - 1 steps ahead and all keep the slowest one's pace; the barrier's own
    store time (`route_barrier_s`) adds what D - 1 steps do not hide, and the SparseLoCo sync wait is
    counted against the step so held (a longer step, a longer overlap window)::

        paced = max over replicas of the schedule's step (compute and links, before the sync wait)
        stall = max(0, max_r t_barrier_r - (D - 1) x paced)          # route_stall_s
        step  = paced + stall + max_r sync(paced + stall)            # every replica's

    A replica's time beyond its own step and sync wait is its route_wait."""
    base = [st.step_s - st.seconds["sync_wait"] for st in steps]  # the schedule's step: compute, links
    paced = max(base)
    barriers = [route_barrier_s(shape, hosts, layout.layers, R) for hosts in layout.replicas]
    barrier = max(t for t, _ in barriers)
    stall = route_stall_s(barrier, paced, per[0])
    held = paced + stall
    sync = [
        _sync_wait(shape, hosts, layout.layers, st_r, R, held)[0]
        for hosts, st_r in zip(layout.replicas, per, strict=True)
    ]
    period = held + max(sync)  # a replica still waiting on its fragments holds the next barrier
    out = [
        replace(
            st,
            seconds={**st.seconds, "sync_wait": w, "route_wait": period - b - w},
            step_s=period,
        )
        for st, b, w in zip(steps, base, sync, strict=True)
    ]
    return out, RouteFigures(
        barrier_s=barrier,
        stall_s=stall,
        pace_s=paced - min(base),
        bytes_per_step=max(b for _, b in barriers),
    )

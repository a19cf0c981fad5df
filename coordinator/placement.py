"""Placement: live adverts -> R replicas x S stages, scored by the planner (one cost model).

Objective: the run's predicted tokens/s, the planner's sum over replicas of M b s / step_r, where
step_r is `coordinator.plan.planner.replica_step_s` of replica r's hosts: its pipeline schedule replayed
with each stage's compute t_c[s] = work[s] b s / rate from the node's advert (the sustained rate of
its reference block, else tflops x ceiling), and each boundary's message time
t_x = bytes_per_microbatch(k) / bandwidth over the link it crosses, plus the SparseLoCo sync wait from
each node's store bandwidth. Ties go to the lower $/h. Tokens/s,
not tokens per dollar: R x S is fixed by the run spec, and every placed node is paid whatever it runs.

Bandwidth: a link's is what its two ends measured of each other (`NodeAdvert.peer_mbps`, the smaller
of the two directions when both did), round trips likewise (`peer_rtt_ms`, the larger). Pools are
sparse (each node probes a bounded sample of peers), so an unmeasured pair gets the smaller of the two
nodes' median measurements (a path is as fast as its slower access link), and a node that measured
nothing gets `CostModel.default_mbps`. A run with an in-process shaper (`pipeline.bandwidth_mbps`,
`delay_ms`) has every link paced by it on top (`plan_links.shaped_link`).

Search. Small pools (at most `EXACT_CHAINS` ordered S-chains) are solved exactly: every chain is
scored, and the best R disjoint chains are found by branch and bound. Larger pools are built replica
by replica, fastest nodes first (so a replica's stages have similar speed: the slowest stage paces a
replica, and replicas never wait on each other): each stage takes, from a window of the fastest free
nodes, the one that keeps the replica's steady-state period max(max t_c, max t_x, round trip / W)
lowest, so slow links are routed around; each replica is then scored exactly against the plain
fastest-first chain and the better kept. Re-placement after churn only fills the holes: untouched
slots keep their nodes, and each hole takes the free node that scores its replica best.

Memory. Given each stage's estimated need (protocol/memory.py), a node whose advert states its free
memory (`free_memory_gb > 0`) is only put on a stage that fits it (`protocol.memory.fits`: 90% of the
free memory). The search keeps enough fitting nodes back for the stages fewest nodes can hold; if it
still runs short, slots are matched by Kuhn's augmenting paths over the same ranking, so a placement is
found whenever one exists.

Reachability. Each link is dialed by its upstream stage, so a node on a stage > 0 must take inbound
connections: one whose reachability check failed (`NodeAdvert.reachable` false, node/pipeline/reachability.py)
is placed there only when it named a relay (`relay_addr`: its upstream neighbour dials it through the relay),
and otherwise only on a replica's first stage, which dials and is never dialed. The fitter checks both
rules, so the search, the matching and the repair of holes all keep them.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from coordinator.plan.inputs import MODELS, Host, ModelShape, RunSettings, compute_tflops, sustained_tflops
from coordinator.plan.layout import Layout, balance_layers, stage_work
from coordinator.plan.links import activation_bytes, id_bytes, shaped_link
from coordinator.plan.planner import Prediction, boundary_k, predict, replica_step_s
from coordinator.plan.spec import run_settings
from protocol.memory import GB, fits, precision_for_device, stage_memory
from protocol.messages import NodeAdvert
from protocol.runspec import RunSpec

Slot = tuple[int, int]  # (replica, stage)
NeedBytes = Sequence[int] | Mapping[str, Sequence[int]]
"""Bytes each stage needs: one list for every node, or one list per precision ("fp32", "bf16"), picked
for each node by `protocol.memory.precision_for_device(advert.device)`."""


class PlacementError(RuntimeError):
    """Not enough suitable nodes; the message says how many are missing."""


@dataclass(frozen=True)
class Placement:
    slots: dict[Slot, str]
    """(replica, stage) -> peer id."""
    tokens_per_s: float = field(default=0.0, compare=False)
    """The objective: predicted tokens/s of the run on these nodes (0 = not scored)."""

    def peer(self, replica: int, stage: int) -> str:
        return self.slots[(replica, stage)]


def stage_needs(spec: RunSpec) -> NeedBytes:
    """Estimated memory of every stage of `spec` (protocol.memory.stage_memory): one list when the spec
    fixes train.precision, else one per precision, for each node to be judged in its own."""
    precisions = ("fp32", "bf16") if spec.train.precision == "auto" else (spec.train.precision,)
    needs = {p: [stage_memory(spec, s, p).total for s in range(spec.stages)] for p in precisions}
    return needs if len(needs) > 1 else needs[precisions[0]]


def _rank_key(a: NodeAdvert) -> tuple[float, float, float, str]:
    return (-a.tflops, -a.store_mbps, a.price_per_hour, a.peer_id)


def _need_of(need_bytes: NeedBytes, a: NodeAdvert, stage: int) -> int:
    if isinstance(need_bytes, Mapping):
        return need_bytes[precision_for_device(a.device)][stage]
    return need_bytes[stage]


def dialable(a: NodeAdvert) -> bool:
    """Whether an upstream neighbour can open a pipeline link to `a`: directly, or through its relay."""
    return a.reachable or bool(a.relay_addr)


def _fitter(need_bytes: NeedBytes | None, stages: int) -> Callable[[NodeAdvert, int], bool]:
    """fit(advert, stage): the advert's free memory holds the stage (unknown free memory always does), and
    a stage > 0 is only given to a node its upstream neighbour can dial (`dialable`)."""
    if need_bytes is not None:
        lists = need_bytes.values() if isinstance(need_bytes, Mapping) else [need_bytes]
        if any(len(n) != stages for n in lists):
            raise ValueError(f"need_bytes must give one figure per stage ({stages})")

    def fit(a: NodeAdvert, stage: int) -> bool:
        if stage > 0 and not dialable(a):
            return False
        if need_bytes is None or a.free_memory_gb <= 0:
            return True
        return fits(_need_of(need_bytes, a, stage), int(a.free_memory_gb * GB)) is None

    return fit


def _augment(root: Slot, fit: list[list[bool]], owner: dict[int, Slot]) -> bool:
    """Kuhn's augmenting path from `root` (iterative DFS): slot -> fitting node -> the slot owning it
    -> ...; on reaching a free node every slot on the path moves to the node it was reached through."""
    n = len(fit[0]) if fit else 0
    seen: set[int] = set()
    stack: list[tuple[Slot, Iterator[int]]] = [(root, iter(range(n)))]
    path: list[int] = []  # path[k]: the node stack[k]'s slot takes
    while stack:
        slot, it = stack[-1]
        for i in it:
            if i in seen or not fit[slot[1]][i]:
                continue
            seen.add(i)
            path.append(i)
            if i not in owner:
                for (sl, _), node in zip(stack, path, strict=True):
                    owner[node] = sl
                return True
            stack.append((owner[i], iter(range(n))))
            break
        else:
            stack.pop()
            if path:
                path.pop()
    return False


def _match(
    slots: list[Slot], ranked: list[NodeAdvert], fit_fn: Callable[[NodeAdvert, int], bool]
) -> dict[Slot, str] | None:
    """Slots (in dealing order) -> peer ids of `ranked` nodes, or None if no assignment fits them all."""
    stages = sorted({s for _, s in slots})
    fit = [[False] * len(ranked) for _ in range(max(stages, default=-1) + 1)]
    for s in stages:
        fit[s] = [fit_fn(a, s) for a in ranked]
    owner: dict[int, Slot] = {}  # node index -> slot
    nxt = dict.fromkeys(stages, 0)  # per stage: nodes before this index are taken or do not fit
    for slot in slots:
        s, row = slot[1], fit[slot[1]]
        while nxt[s] < len(ranked) and (nxt[s] in owner or not row[nxt[s]]):
            nxt[s] += 1  # a taken node stays taken (augmenting only moves it between slots)
        if nxt[s] < len(ranked):
            owner[nxt[s]] = slot
        elif not _augment(slot, fit, owner):
            return None
    return {slot: ranked[i].peer_id for i, slot in owner.items()}


def _shortfall(
    what: str,
    slots: list[Slot],
    ranked: list[NodeAdvert],
    need_bytes: NeedBytes | None,
    fit_fn: Callable[[NodeAdvert, int], bool],
) -> PlacementError:
    """The error when the nodes are there but do not fit their slots: too little memory (how many fit,
    what the biggest stage needs) or too few reachable for the stages that are dialed."""
    stages = sorted({s for _, s in slots})
    later = [s for s in stages if s > 0]
    closed = [a for a in ranked if not dialable(a)]
    dialed = sum(s > 0 for _, s in slots)
    if later and closed and len(ranked) - len(closed) < dialed:
        return PlacementError(
            f"{what}: {len(closed)} of {len(ranked)} free nodes are not reachable (behind NAT, with no relay), "
            f"so they can only take a replica's first stage; {dialed} slot(s) on later stages need a node its "
            f"upstream neighbour can dial, and {len(ranked) - len(closed)} can be: open or forward those "
            "nodes' pipeline port (or --announce-host/--announce-port), or start them with --relay"
        )
    if need_bytes is None:  # every node fits every stage's memory: the reachable ones ran out elsewhere
        return PlacementError(
            f"{what}: no placement gives every later stage a reachable node ({len(closed)} of "
            f"{len(ranked)} free nodes are behind NAT with no relay): open their pipeline port or use --relay"
        )
    lists = dict(need_bytes) if isinstance(need_bytes, Mapping) else {"": need_bytes}
    big = max(stages, key=lambda s: max(n[s] for n in lists.values()))
    need_big = " or ".join(f"{n[big] / GB:.1f} GB" + (f" in {p}" if p else "") for p, n in lists.items())
    n_any = sum(any(fit_fn(a, s) for s in stages) for a in ranked)
    n_big = sum(fit_fn(a, big) for a in ranked)
    wanted = sum(s == big for _, s in slots)
    return PlacementError(
        f"{what}: only {n_any} of {len(ranked)} free nodes have the free memory for a stage; the biggest, "
        f"stage {big}, needs {need_big} and {n_big} node(s) fit it ({wanted} needed): use more stages, "
        "fewer microbatches in flight, or nodes with more memory"
        + (f" ({len(closed)} node(s) behind NAT with no relay can only take a first stage)" if closed else "")
    )


EXACT_LAYOUTS = 20_000
"""Pools with at most this many distinct layouts (n! / (n - R S)! / R!) are placed exactly."""
WINDOW = 8
"""Free nodes beyond S that a replica's greedy construction weighs for each stage."""
EXACT_MOVES = 32
"""Runs with at most this many replicas score every improving move by the replay; larger ones screen
moves by the steady-state period first."""
REPAIR_SCORED = 16
"""Free nodes scored exactly for one hole (the best by the steady-state period of the hole's stage)."""
MIN_MBPS = 1e-3
"""A measured 0 Mbit/s (unreachable) is scored as this, so the link is avoided rather than divided by."""
MIN_TFLOPS = 1e-6
"""An unmeasured speed (0) is scored as this: such a node is placed last."""


@dataclass(kw_only=True, frozen=True)
class CostModel:
    """What placement scores with: the planner's model, layer split and settings for the run."""

    shape: ModelShape
    """The run's model (coordinator.plan.inputs.ModelShape)."""
    layers: tuple[int, ...]
    """Layers per stage, the same in every replica; sums to shape.n_layers."""
    settings: RunSettings
    """Schedule, microbatches, link k and sync cadence (coordinator.plan.spec.run_settings for a spec)."""
    default_mbps: float = 1000.0
    """Mbit/s of a link, or to the store, that nothing measured."""
    default_rtt_ms: float = 0.0
    """Round trip of a link that nothing measured (0: unknown latency is not charged)."""
    shaper_mbps: float = 0.0
    """The run's in-process link shaper (`pipeline.bandwidth_mbps`, 0 = none): every pipeline link is
    this rate in series with what was measured (`plan_links.shaped_link`)."""
    shaper_delay_ms: float = 0.0
    """The shaper's one-way delay (`pipeline.delay_ms`), added twice to every link's round trip."""
    replica_microbatches: tuple[int, ...] = ()
    """M of each replica where the run's [[shapes]] differ (`RunSpec.microbatches_of`); empty: every
    replica runs `settings.microbatches`."""

    def __post_init__(self) -> None:
        if not self.layers or min(self.layers) < 1 or sum(self.layers) != self.shape.n_layers:
            raise ValueError(
                f"cost model layers {self.layers} must be >= 1 each and sum to n_layers={self.shape.n_layers}"
            )
        if self.shaper_mbps < 0 or self.shaper_delay_ms < 0:
            raise ValueError(
                f"cost model shaper_mbps={self.shaper_mbps} and shaper_delay_ms={self.shaper_delay_ms} must be "
                ">= 0 (0: no shaper)"
            )
        if self.default_mbps <= 0 or self.default_rtt_ms < 0:
            raise ValueError(
                "cost model default_mbps must be > 0 and default_rtt_ms >= 0 (example: 1000, 20)"
            )

    @classmethod
    def from_spec(cls, spec: RunSpec) -> CostModel:
        """The run's own model, layer split and settings (the planner's reading of a run spec)."""
        return cls(
            shape=ModelShape.from_spec(spec.model),
            layers=tuple(b - a for a, b in spec.layer_ranges()),
            settings=run_settings(spec, ceiling=RunSettings().ceiling),
            shaper_mbps=spec.pipeline.bandwidth_mbps,
            shaper_delay_ms=spec.pipeline.delay_ms,
            replica_microbatches=tuple(spec.microbatches_of(r) for r in range(spec.replicas))
            if spec.shapes
            else (),
        )

    @classmethod
    def default(cls, stages: int) -> CostModel:
        """Without a run spec: Llama-3-8B's shape split evenly over `stages`, links at k = d/8."""
        shape = MODELS["8b"]
        if not 1 <= stages <= shape.n_layers:
            raise ValueError(f"stages must be between 1 and {shape.n_layers} (got {stages})")
        bounds = [round(i * shape.n_layers / stages) for i in range(stages + 1)]
        layers = tuple(bounds[i + 1] - bounds[i] for i in range(stages))
        return cls(shape=shape, layers=layers, settings=RunSettings(k=shape.d_model // 8))


class _Nodes:
    """Candidates as the cost model sees them: a Host each, compute per stage, links, memory fits."""

    def __init__(
        self,
        adverts: Sequence[NodeAdvert],
        cost: CostModel,
        replicas: int,
        fit: Callable[[NodeAdvert, int], bool] | None = None,
    ) -> None:
        self.adverts, self.cost, self.R = list(adverts), cost, replicas
        shape, st, S = cost.shape, cost.settings, len(cost.layers)
        tokens = st.microbatch_size * shape.seq_len
        idx = {a.peer_id: i for i, a in enumerate(self.adverts)}
        self.mbps = [{idx[p]: max(x, MIN_MBPS) for p, x in a.peer_mbps.items() if p in idx} for a in adverts]
        self.rtt_ms = [{idx[p]: x for p, x in a.peer_rtt_ms.items() if p in idx} for a in adverts]
        self.typ_mbps = [
            max(statistics.median(a.peer_mbps.values()), MIN_MBPS) if a.peer_mbps else cost.default_mbps
            for a in adverts
        ]
        self.typ_rtt_ms = [
            statistics.median(a.peer_rtt_ms.values()) if a.peer_rtt_ms else cost.default_rtt_ms
            for a in adverts
        ]
        self.hosts = [
            Host(
                name=a.peer_id,
                gpus=1,
                peak_tflops=max(a.tflops, MIN_TFLOPS),
                memory_gb=a.memory_gb,
                usd_per_hour=a.price_per_hour,
                link_mbps=self.typ_mbps[i],
                rtt_ms=self.typ_rtt_ms[i],
                store_mbps=a.store_mbps or cost.default_mbps,
                sustained_tflops=sustained_tflops(a.ref_block, a.ref_block_s),
            )
            for i, a in enumerate(self.adverts)
        ]
        work = stage_work(shape, cost.layers)
        rate = [h.compute_tflops(st.ceiling) * 1e12 for h in self.hosts]
        self.t_c = [[work[s] * tokens / r for s in range(S)] for r in rate]  # (n, S) seconds per microbatch
        k = min(st.k or st.k_min, shape.d_model)  # the automatic k's floor: where a slow link starts to cost
        wire = dict(
            bytes_per_value=st.bytes_per_value,
            token_id_bytes=st.token_id_bytes or id_bytes(shape.vocab),
            header_bytes=st.header_bytes,
        )
        self.msg_bits = 8.0 * activation_bytes(k=k, d_model=shape.d_model, tokens=tokens, **wire)
        self.W = min(st.microbatches, S + st.extra_in_flight) if st.schedule == "1f1b" else 0
        fit_fn = fit or (lambda a, s: True)
        self.fit = [[fit_fn(a, s) for a in self.adverts] for s in range(S)]

    def link(self, i: int, j: int) -> tuple[float, float]:
        """(Mbit/s, rtt ms) of the link i - j: as measured (the slower direction, the longer round trip),
        else the smaller of the two nodes' median bandwidths and the larger of their median round trips;
        through the run's shaper when it has one (`CostModel.shaper_mbps`)."""
        x, y = self.mbps[i].get(j), self.mbps[j].get(i)
        if x is None and y is None:
            mbps = min(self.typ_mbps[i], self.typ_mbps[j])
        else:
            mbps = min(v for v in (x, y) if v is not None)
        u, v = self.rtt_ms[i].get(j), self.rtt_ms[j].get(i)
        if u is None and v is None:
            rtt = max(self.typ_rtt_ms[i], self.typ_rtt_ms[j])
        else:
            rtt = max(w for w in (u, v) if w is not None)
        return shaped_link(mbps, rtt, self.cost.shaper_mbps, self.cost.shaper_delay_ms)

    def score(self, chain: Sequence[int], replica: int | None = None) -> float:
        """The objective for one replica (stage s on node chain[s]): the planner's tokens/s, at
        `replica`'s own microbatch count where the run's shapes give it one (None: the run's)."""
        links = [self.link(a, b) for a, b in itertools.pairwise(chain)]
        c = self.cost
        st = c.settings
        if replica is not None and c.replica_microbatches:
            st = replace(st, microbatches=c.replica_microbatches[replica])
        step = replica_step_s(
            c.shape,
            tuple(self.hosts[i] for i in chain),
            c.layers,
            st,
            replicas=self.R,
            link_mbps=tuple(m for m, _ in links),
            link_rtt_ms=tuple(r for _, r in links),
        )
        return st.microbatches * st.microbatch_size * c.shape.seq_len / step

    def price(self, chain: Sequence[int]) -> float:
        return sum(self.adverts[i].price_per_hour for i in chain)

    def extend(self, state: tuple[float, float], chain: Sequence[int], node: int) -> tuple[float, float]:
        """Steady-state period of a partial chain grown by `node` at the next stage, as (T, round trip):
        T = max(max t_c, max t_x, (sum t_c + sum (rtt + 2 t_x)) / W), the planner's closed form
        (planner.predict's docstring) that the search ranks candidates with; the replay scores them."""
        T, trip = state
        t = self.t_c[node][len(chain)]
        T, trip = max(T, t), trip + t
        if chain:
            mbps, rtt = self.link(chain[-1], node)
            t_x = self.msg_bits / (mbps * 1e6)
            T, trip = max(T, t_x), trip + rtt / 1e3 + 2 * t_x
        return (max(T, trip / self.W) if self.W else T), trip


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """(tokens/s, $/h): more tokens/s, or as many (to 1e-9) for less money."""
    if a[0] > b[0] * (1 + 1e-9):
        return True
    return a[0] >= b[0] * (1 - 1e-9) and a[1] < b[1] - 1e-12


def _layouts(n: int, R: int, S: int, limit: int) -> int:
    """Distinct layouts of n nodes into R unordered replicas of S ordered stages, n! / (n - R S)! / R!,
    counted up to `limit` (limit + 1 means more)."""
    if R * S > n:
        return 0
    count = 1
    for i in range(R * S):
        count *= n - i
        if count > limit * math.factorial(R):
            return limit + 1
    return count // math.factorial(R)


def _exact(nodes: _Nodes, R: int, S: int) -> list[tuple[int, ...]] | None:
    """The best R disjoint chains: every fitting chain scored, then branch and bound over them."""
    n = len(nodes.adverts)
    chains = [c for c in itertools.permutations(range(n), S) if all(nodes.fit[s][i] for s, i in enumerate(c))]
    scored = sorted(((nodes.score(c), nodes.price(c), c) for c in chains), key=lambda x: (-x[0], x[1]))
    masks = [sum(1 << i for i in c) for _, _, c in scored]
    best: list = [(-math.inf, math.inf), None]

    def dfs(start: int, used: int, picked: list[int], total: float, price: float) -> None:
        if len(picked) == R:
            if _better((total, price), best[0]):
                best[0], best[1] = (total, price), list(picked)
            return
        need = R - len(picked)
        for j in range(start, len(scored)):
            if total + need * scored[j][0] < best[0][0] * (1 - 1e-9):
                return  # sorted: no later chain lifts the total enough
            if masks[j] & used:
                continue
            picked.append(j)
            dfs(j + 1, used | masks[j], picked, total + scored[j][0], price + scored[j][1])
            picked.pop()

    dfs(0, 0, [], 0.0, 0.0)
    return None if best[1] is None else [scored[j][2] for j in best[1]]


def _greedy(nodes: _Nodes, R: int, S: int, order: list[int]) -> list[tuple[int, ...]] | None:
    """Replica by replica, fastest free nodes first: each stage takes the window's node that keeps the
    steady-state period lowest (`_Nodes.extend`); the chain is kept if the replay scores it above the
    plain fastest-first chain, else that one. None when the memory fits run out (`_match` then decides)."""
    used = [False] * len(nodes.adverts)
    left = [R] * S  # slots of each stage still to fill
    free_fit = [sum(row) for row in nodes.fit]  # free nodes that fit each stage

    def spare(c: int, s: int) -> bool:
        """Taking c for stage s leaves every other stage c fits as many fitting nodes as it has slots."""
        return all(free_fit[t] > left[t] for t in range(S) if t != s and nodes.fit[t][c])

    def take(chain: tuple[int, ...]) -> None:
        for s, c in enumerate(chain):
            used[c] = True
            left[s] -= 1
            for t in range(S):
                free_fit[t] -= nodes.fit[t][c]

    head, out = 0, []
    for _ in range(R):
        while head < len(order) and used[order[head]]:
            head += 1
        window: list[int] = []
        j = head
        while j < len(order) and len(window) < S + WINDOW:
            if not used[order[j]]:
                window.append(order[j])
            j += 1
        options = []
        for mode in ("period", "plain"):
            chain: list[int] = []
            state = (0.0, 0.0)
            for s in range(S):
                ok = [c for c in window if c not in chain and nodes.fit[s][c] and spare(c, s)]
                if not ok:  # the window has none: the fastest free node anywhere that fits
                    ok = [
                        c for c in order if not used[c] and c not in chain and nodes.fit[s][c] and spare(c, s)
                    ][:1]
                if not ok:
                    return None
                if mode == "plain":
                    pick = ok[0]
                else:
                    pick = min(ok, key=lambda c: nodes.extend(state, chain, c)[0])  # ties: the faster
                state = nodes.extend(state, chain, pick)
                chain.append(pick)
            options.append(tuple(chain))
        best = max(dict.fromkeys(options), key=lambda c: (nodes.score(c), -nodes.price(c)))
        take(best)
        out.append(best)
    return out


def _period(nodes: _Nodes, chain: Sequence[int]) -> float:
    state, prefix = (0.0, 0.0), list[int]()
    for c in chain:
        state = nodes.extend(state, prefix, c)
        prefix.append(c)
    return state[0]


def _improve(nodes: _Nodes, chains: list[tuple[int, ...]], spare: list[int]) -> list[tuple[int, ...]]:
    """Swap passes over the greedy result: two slots of a replica, a slot of replica r and one of r + 1,
    or a slot and a spare free node trade nodes when the planner scores the pair of replicas higher.
    Moves are screened by the steady-state period (1 / T summed) unless the run has at most
    `EXACT_MOVES` replicas, where every move is scored by the replay; two passes at most."""
    ch = [list(c) for c in chains]
    R, S = len(ch), len(ch[0])
    score = [nodes.score(c) for c in ch]
    per = [_period(nodes, c) for c in ch]
    screen = R > EXACT_MOVES

    def attempt(r: int, q: int) -> bool:
        """ch[r] and ch[q] were just changed in place: keep the change if it scores higher."""
        pr, pq = _period(nodes, ch[r]), _period(nodes, ch[q]) if q != r else 0.0
        if screen and 1 / pr + (1 / pq if q != r else 0.0) <= (
            1 / per[r] + (1 / per[q] if q != r else 0.0)
        ) * (1 + 1e-9):
            return False
        sr = nodes.score(ch[r])
        sq = nodes.score(ch[q]) if q != r else 0.0
        if sr + sq <= (score[r] + (score[q] if q != r else 0.0)) * (1 + 1e-9):
            return False
        score[r], per[r] = sr, pr
        if q != r:
            score[q], per[q] = sq, pq
        return True

    for _ in range(2):
        moved = False
        for r in range(R):
            for s in range(S):
                for q in (r, r + 1) if r + 1 < R else (r,):
                    for t in range(s + 1 if q == r else 0, S):
                        a, b = ch[r][s], ch[q][t]
                        if not (nodes.fit[t][a] and nodes.fit[s][b]):
                            continue
                        ch[r][s], ch[q][t] = b, a
                        if attempt(r, q):
                            moved = True
                        else:
                            ch[r][s], ch[q][t] = a, b
                for i, f in enumerate(spare):
                    a = ch[r][s]
                    if not nodes.fit[s][f]:
                        continue
                    ch[r][s] = f
                    if attempt(r, r):
                        spare[i], moved = a, True
                    else:
                        ch[r][s] = a
        if not moved:
            break
    return [tuple(c) for c in ch]


def _chains_to_slots(nodes: _Nodes, chains: list[tuple[int, ...]]) -> tuple[dict[Slot, str], float]:
    """Replicas numbered fastest first, and where the run's shapes differ the fastest chains go to the
    replicas of the most microbatches (the largest batches); returns the slots and the objective."""
    scored = sorted(((nodes.score(c), c) for c in chains), key=lambda x: -x[0])
    mb = nodes.cost.replica_microbatches
    order = sorted(range(len(chains)), key=lambda r: (-mb[r], r)) if mb else list(range(len(chains)))
    slots = {
        (r, s): nodes.adverts[i].peer_id
        for r, (_, c) in zip(order, scored, strict=True)
        for s, i in enumerate(c)
    }
    return slots, sum(nodes.score(c, r) for r, (_, c) in zip(order, scored, strict=True))


def place(
    adverts: list[NodeAdvert],
    replicas: int,
    stages: int,
    *,
    min_store_mbps: float = 0.0,
    need_bytes: NeedBytes | None = None,
    cost: CostModel | None = None,
) -> Placement:
    """Choose R*S free nodes maximising the predicted tokens/s (module docstring); raise PlacementError
    if there are too few, or too few with the memory for their stage (`need_bytes`: each stage's
    estimated bytes, see `stage_needs`; None: not checked). `cost`: the run's (`CostModel.from_spec`);
    None scores with `CostModel.default(stages)`."""
    candidates = sorted((a for a in adverts if a.store_mbps >= min_store_mbps), key=_rank_key)
    need = replicas * stages
    if len(candidates) < need:
        raise PlacementError(
            f"need {need} free nodes for {replicas} replicas x {stages} stages, found {len(candidates)}"
            + (f" with >= {min_store_mbps} Mbit/s to the store" if min_store_mbps else "")
        )
    cost = cost or CostModel.default(stages)
    if len(cost.layers) != stages:
        raise ValueError(f"cost model has {len(cost.layers)} stages, the placement {stages}")
    fit = _fitter(need_bytes, stages)
    nodes = _Nodes(candidates, cost, replicas, fit)
    order = list(range(len(candidates)))  # ranked: fastest first
    if _layouts(len(candidates), replicas, stages, EXACT_LAYOUTS) <= EXACT_LAYOUTS:
        chains = _exact(nodes, replicas, stages)
    else:
        chains = _greedy(nodes, replicas, stages, order)
        if chains is not None:
            placed = {i for c in chains for i in c}
            spare = [i for i in order if i not in placed][: 2 * stages]
            chains = _improve(nodes, chains, spare)
        if chains is None:  # memory is tight: match slots replica by replica over the ranking
            slot_order = [(r, s) for r in range(replicas) for s in range(stages)]
            matched = _match(slot_order, candidates, fit)
            if matched is not None:
                idx = {a.peer_id: i for i, a in enumerate(candidates)}
                chains = [tuple(idx[matched[(r, s)]] for s in range(stages)) for r in range(replicas)]
    if chains is None:  # memory or reachability leave some slot without a node
        order_slots = [(r, s) for s in range(stages) for r in range(replicas)]
        raise _shortfall(
            f"need {need} nodes for {replicas} replicas x {stages} stages",
            order_slots,
            candidates,
            need_bytes,
            fit,
        )
    slots, tokens_per_s = _chains_to_slots(nodes, chains)
    return Placement(slots, tokens_per_s)


def _hole_order(
    nodes: _Nodes, known: Mapping[int, int | None], s: int, free: list[int], whole: bool
) -> list[int]:
    """Free nodes (indices into `nodes`) for a hole at stage s, best first: by the period of the hole's
    stage and its links to its known neighbours (`_Nodes.extend`'s terms), and when every other stage of
    the replica is known (`whole`), the best `REPAIR_SCORED` of them by the replica's planner score."""

    def period(c: int) -> float:
        T = nodes.t_c[c][s]
        for a, b in ((known.get(s - 1), c), (c, known.get(s + 1))):
            if a is not None and b is not None:
                T = max(T, nodes.msg_bits / (nodes.link(a, b)[0] * 1e6))
        return T

    ranked = sorted((c for c in free if nodes.fit[s][c]), key=lambda c: (period(c), c))
    if not whole:
        return ranked
    S = len(nodes.cost.layers)

    def key(c: int) -> tuple[float, float]:
        chain = [c if t == s else known[t] for t in range(S)]
        return -nodes.score(chain), nodes.adverts[c].price_per_hour  # type: ignore[arg-type]

    return sorted(ranked[:REPAIR_SCORED], key=key) + ranked[REPAIR_SCORED:]


def repair(
    current: Placement,
    alive: set[str],
    free: list[NodeAdvert],
    *,
    need_bytes: NeedBytes | None = None,
    cost: CostModel | None = None,
    adverts: Mapping[str, NodeAdvert] | None = None,
) -> tuple[Placement, set[Slot]]:
    """Refill the slots whose node is gone, each with the free node that fits its stage's memory and
    scores its replica best (`adverts`: the surviving nodes' adverts, for their speed and links; without
    them a hole is judged by its own stage); returns the new placement and the slots that changed (only
    those, and their pipeline neighbours, need new assignments). Untouched slots keep their nodes."""
    holes = sorted(slot for slot, peer in current.slots.items() if peer not in alive)
    pool = sorted(free, key=_rank_key)
    if len(pool) < len(holes):
        raise PlacementError(
            f"{len(holes)} slot(s) lost their node, only {len(pool)} free node(s) to refill them"
        )
    slots = dict(current.slots)
    if not holes:
        return Placement(slots), set()
    S = 1 + max(s for _, s in current.slots)
    R = 1 + max(r for r, _ in current.slots)
    fit = _fitter(need_bytes, S)
    if _match(holes, pool, fit) is None:
        raise _shortfall(f"{len(holes)} slot(s) lost their node", holes, pool, need_bytes, fit)
    cost = cost or CostModel.default(S)
    survivors = [a for p, a in (adverts or {}).items() if p in alive and p in set(slots.values())]
    nodes = _Nodes(pool + survivors, cost, R, fit)
    where = {a.peer_id: i for i, a in enumerate(nodes.adverts)}
    taken: set[int] = set()
    for n, (r, s) in enumerate(holes):
        known = {t: where.get(slots[(r, t)]) for t in range(S) if (r, t) not in holes[n:]}
        whole = all(known.get(t) is not None for t in range(S) if t != s)
        rest = holes[n + 1 :]

        ranked = _hole_order(nodes, known, s, [i for i in range(len(pool)) if i not in taken], whole)
        for c in ranked:  # the best that leaves the other holes a fitting node each
            others = [a for i, a in enumerate(pool) if i not in taken and i != c]
            if not rest or _match(rest, others, fit) is not None:
                taken.add(c)
                slots[(r, s)] = pool[c].peer_id
                break
        else:  # unreachable: the matching above found a node for every hole
            raise PlacementError(f"slot {(r, s)} found no free node that fits")
    return Placement(slots), set(holes)


def placement_layout(placement: Placement, adverts: Mapping[str, NodeAdvert], cost: CostModel) -> Layout:
    """The planner's Layout of a placement: each slot's host from its advert, each boundary's measured
    bandwidth and round trip (as placement scores them). For `planner.predict` and `boundary_k`."""
    R = 1 + max(r for r, _ in placement.slots)
    S = len(cost.layers)
    peers = sorted(set(placement.slots.values()))
    missing = [p for p in peers if p not in adverts]
    if missing:
        raise ValueError(f"no advert for placed node(s) {missing[:3]}: pass the adverts of every placed node")
    nodes = _Nodes([adverts[p] for p in peers], cost, R)
    idx = {p: i for i, p in enumerate(peers)}
    chains = [[idx[placement.peer(r, s)] for s in range(S)] for r in range(R)]
    links = [[nodes.link(a, b) for a, b in itertools.pairwise(c)] for c in chains]
    return Layout(
        replicas=tuple(tuple(nodes.hosts[i] for i in c) for c in chains),
        layers=cost.layers,
        link_mbps=tuple(tuple(m for m, _ in row) for row in links),
        link_rtt_ms=tuple(tuple(t for _, t in row) for row in links),
    )


def predict_placement(placement: Placement, adverts: Mapping[str, NodeAdvert], cost: CostModel) -> Prediction:
    """The planner's prediction for a placement from the placed nodes' adverts (`placement_layout`, then
    `planner.predict`): the one figure the coordinator logs at placement and its dashboard shows, and
    that crucible-swarm prints beside what it measures (it reads it from the dashboard's API)."""
    layout = placement_layout(placement, adverts, cost)
    mb = cost.replica_microbatches[: len(layout.replicas)]
    return predict(cost.shape, layout, cost.settings, replica_microbatches=mb)


def choose_boundary_k(
    placement: Placement, adverts: Mapping[str, NodeAdvert], cost: CostModel
) -> tuple[int, ...]:
    """k of every pipeline boundary for the run, chosen at launch from the nodes placed: the slowest
    measured link each boundary crosses, in any replica, sets it, so that bytes_per_microbatch(k) /
    bandwidth fits the compute that hides it (`coordinator.plan.planner.boundary_k`, floored at the settings'
    k_min). The same k in every replica: stage weights are averaged across replicas."""
    return boundary_k(cost.shape, placement_layout(placement, adverts, cost), cost.settings)


def compute_rate(a: NodeAdvert, ceiling: float) -> float:
    """TFLOP/s a node runs a stage's FLOPs at: its reference block's sustained rate when it advertised
    one, else its matmul peak x ceiling."""
    return compute_tflops(sustained_tflops(a.ref_block, a.ref_block_s), max(a.tflops, MIN_TFLOPS), ceiling)


def choose_layer_split(
    placement: Placement, adverts: Mapping[str, NodeAdvert], cost: CostModel
) -> tuple[int, ...]:
    """Layers per stage for the run, chosen at launch from the nodes placed: each stage is as fast as
    its slowest node over the replicas (`compute_rate`) and holds what its smallest node's memory
    takes; the planner's balance (min-max stage time, `plan_layout.balance_layers`) splits the layers.
    The same split in every replica: stage weights are averaged across replicas."""
    S = len(cost.layers)
    stages: list[list[NodeAdvert]] = [[] for _ in range(S)]
    for (_, s), peer in placement.slots.items():
        if peer not in adverts:
            raise ValueError(f"no advert for placed node {peer}: pass the adverts of every placed node")
        stages[s].append(adverts[peer])
    return balance_layers(
        cost.shape,
        [min(compute_rate(a, cost.settings.ceiling) for a in nodes) for nodes in stages],
        [min(a.memory_gb for a in nodes) for nodes in stages],
    )

"""Placement: live adverts -> R replicas x S stages.

Greedy: free nodes are ranked by measured TFLOP/s (then store bandwidth, then price), the
fastest R*S are taken, and dealt so that every replica gets a similar mix (replica r, stage s takes rank
s*R + r), keeping replicas' step times close since the slowest stage paces each pipeline.
Re-placement after churn only fills the holes: untouched slots keep their nodes.

Memory. Given each stage's estimated need (protocol/memory.py), a node whose advert states its free
memory (`free_memory_gb > 0`) is only put on a stage that fits it (`protocol.memory.fits`: 90% of the
free memory). Slots are dealt in the order above, each to the best-ranked free node that fits it; a slot
that finds none takes a node from an earlier slot that another fitting node can replace (an augmenting
path, Kuhn's bipartite matching), so a placement is found whenever one exists, and with memory to spare
the result is exactly the dealing above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

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


def _fitter(need_bytes: NeedBytes | None, stages: int) -> Callable[[NodeAdvert, int], bool]:
    """fit(advert, stage): the advert's free memory holds the stage (unknown free memory always does)."""
    if need_bytes is not None:
        lists = need_bytes.values() if isinstance(need_bytes, Mapping) else [need_bytes]
        if any(len(n) != stages for n in lists):
            raise ValueError(f"need_bytes must give one figure per stage ({stages})")

    def fit(a: NodeAdvert, stage: int) -> bool:
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
    need_bytes: NeedBytes,
    fit_fn: Callable[[NodeAdvert, int], bool],
) -> PlacementError:
    """The error when the nodes are there but their memory is not: how many fit, what the biggest stage needs."""
    stages = sorted({s for _, s in slots})
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
    )


def place(
    adverts: list[NodeAdvert],
    replicas: int,
    stages: int,
    *,
    min_store_mbps: float = 0.0,
    need_bytes: NeedBytes | None = None,
) -> Placement:
    """Choose R*S free nodes; raise PlacementError if there are too few, or too few with the memory for
    their stage (`need_bytes`: each stage's estimated bytes, see `stage_needs`; None: not checked)."""
    candidates = sorted((a for a in adverts if a.store_mbps >= min_store_mbps), key=_rank_key)
    need = replicas * stages
    if len(candidates) < need:
        raise PlacementError(
            f"need {need} free nodes for {replicas} replicas x {stages} stages, found {len(candidates)}"
            + (f" with >= {min_store_mbps} Mbit/s to the store" if min_store_mbps else "")
        )
    fit = _fitter(need_bytes, stages)
    order = [(r, s) for s in range(stages) for r in range(replicas)]  # slot (r, s) takes rank s*R + r
    slots = _match(order, candidates, fit)
    if slots is None:
        assert need_bytes is not None  # without a memory check every node fits every slot
        raise _shortfall(
            f"need {need} nodes for {replicas} replicas x {stages} stages", order, candidates, need_bytes, fit
        )
    return Placement(slots)


def repair(
    current: Placement,
    alive: set[str],
    free: list[NodeAdvert],
    *,
    need_bytes: NeedBytes | None = None,
) -> tuple[Placement, set[Slot]]:
    """Refill the slots whose node is gone with the best free nodes that fit their stage's memory;
    returns the new placement and the slots that changed (only those, and their pipeline neighbours,
    need new assignments)."""
    holes = sorted(slot for slot, peer in current.slots.items() if peer not in alive)
    pool = sorted(free, key=_rank_key)
    if len(pool) < len(holes):
        raise PlacementError(
            f"{len(holes)} slot(s) lost their node, only {len(pool)} free node(s) to refill them"
        )
    slots = dict(current.slots)
    if not holes:
        return Placement(slots), set()
    fit = _fitter(need_bytes, 1 + max(s for _, s in current.slots))
    refill = _match(holes, pool, fit)
    if refill is None:
        assert need_bytes is not None
        raise _shortfall(f"{len(holes)} slot(s) lost their node", holes, pool, need_bytes, fit)
    slots.update(refill)
    return Placement(slots), set(holes)

"""Mixed-shape placement (issue 22): replicas of different stage counts in one run, as a planning figure.

A host with more memory holds a replica in fewer stages, and fewer stages mean a smaller pipeline bubble
and fewer links to cross. For a pool whose hosts differ in memory, `compare_shapes` forms such a
placement (each memory class at the fewest stages that fit it) and the best uniform one (every replica
the same stage count) to set beside it. There is one cost model: each shape is priced by `predict` with
R the run's replica count (every replica fetches the fragments of all the others); the run's tokens/s is
the sum over replicas (they never wait on each other, DESIGN section 2) and MFU and $/Mtok are the
planner's definitions over every placed host (`placed_figures`).

The swarm runs replicas of different stage counts when the run spec states them ([[shapes]] with stages,
coordinator/plan/layout_classes.py places them); the coordinator does not choose them from a pool itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.plan.inputs import Host, ModelShape, RunSettings
from coordinator.plan.layout import Layout, auto_stages, naive_layout
from coordinator.plan.planner import Prediction, placed_figures, predict


@dataclass(kw_only=True, frozen=True)
class ShapeGroup:
    """The replicas of one shape: R x S hosts sharing one layer split."""

    memory_gb: float
    """Memory per host of the class the shape was chosen for (hosts from a larger class may join it)."""
    layout: Layout
    prediction: Prediction
    """`predict` of `layout` with R = the whole run's replicas."""

    @property
    def replicas(self) -> int:
        return len(self.layout.replicas)

    @property
    def stages(self) -> int:
        return len(self.layout.layers)


@dataclass(kw_only=True, frozen=True)
class ShapePlan:
    """A run made of one or more shapes, and its figures (the planner's definitions, summed over shapes)."""

    groups: tuple[ShapeGroup, ...]
    tokens_per_s: float
    effective_mfu: float
    tax: float
    usd_per_hour: float
    usd_per_mtok: float
    n_gpus: int
    unused_hosts: int

    @property
    def replicas(self) -> int:
        return sum(g.replicas for g in self.groups)

    @property
    def priced(self) -> bool:
        """Every placed host has a price: else $/h and $/Mtok are unknown, not low."""
        return all(h.usd_per_hour > 0 for g in self.groups for rep in g.layout.replicas for h in rep)


@dataclass(kw_only=True, frozen=True)
class ShapeComparison:
    """The mixed-shape placement of a pool beside the best uniform one."""

    mixed: ShapePlan
    uniform: ShapePlan
    uniform_is_planned: bool = False
    """The best uniform placement is the layout `plan` printed (its `planned` layout)."""

    @property
    def mixed_gain(self) -> float:
        """Mixed tokens/s over uniform tokens/s, minus 1 (negative: uniform predicts more)."""
        return self.mixed.tokens_per_s / self.uniform.tokens_per_s - 1.0


def memory_classes(hosts: Sequence[Host]) -> list[float]:
    """The pool's distinct memories per host, largest first."""
    return sorted({h.memory_gb for h in hosts}, reverse=True)


def shape_plan(
    shape: ModelShape,
    layouts: Sequence[Layout],
    memory_gb: Sequence[float],
    settings: RunSettings,
    n_hosts: int,
) -> ShapePlan:
    """Price a run made of `layouts` (one per shape) with the planner's per-replica model."""
    R = sum(len(lay.replicas) for lay in layouts)
    preds = [predict(shape, lay, settings, run_replicas=R) for lay in layouts]
    tokens = sum(p.tokens_per_s for p in preds)
    placed = [h for lay in layouts for rep in lay.replicas for h in rep]
    fig = placed_figures(shape, placed, settings, tokens)
    usd = sum(h.usd_per_hour for h in placed)
    return ShapePlan(
        groups=tuple(
            ShapeGroup(memory_gb=m, layout=lay, prediction=p)
            for m, lay, p in zip(memory_gb, layouts, preds, strict=True)
        ),
        tokens_per_s=tokens,
        effective_mfu=fig.effective_mfu,
        tax=fig.tax,
        usd_per_hour=usd,
        usd_per_mtok=fig.usd_per_mtok or 0.0,
        n_gpus=sum(h.gpus for h in placed),
        unused_hosts=n_hosts - len(placed),
    )


def auto_layout(shape: ModelShape, hosts: Sequence[Host], settings: RunSettings) -> Layout | None:
    """What `plan` places on `hosts` with stages and replicas automatic (`auto_stages`, R = hosts // S,
    `naive_layout`); None when they cannot hold one replica."""
    try:
        S = auto_stages(shape, list(hosts), settings)
    except ValueError:
        return None
    return naive_layout(shape, list(hosts), len(hosts) // S, S, settings)


def _placed(layout: Layout) -> set[str]:
    return {h.name for rep in layout.replicas for h in rep}


def mixed_layouts(
    shape: ModelShape, hosts: Sequence[Host], settings: RunSettings
) -> tuple[list[Layout], list[float]]:
    """One shape per memory class, largest first, each at the fewest stages its hosts fit (`auto_layout`).
    The hosts a class leaves over (too few for another replica) join the next smaller class: they hold
    whatever its hosts hold. Returns the layouts and the memory each was chosen for."""
    layouts: list[Layout] = []
    memories: list[float] = []
    carry: list[Host] = []
    for mem in memory_classes(hosts):
        group = carry + [h for h in hosts if h.memory_gb == mem]
        layout = auto_layout(shape, group, settings)
        if layout is None:
            carry = group
            continue
        carry = [h for h in group if h.name not in _placed(layout)]
        layouts.append(layout)
        memories.append(mem)
    return layouts, memories


def uniform_layouts(shape: ModelShape, hosts: Sequence[Host], settings: RunSettings) -> list[Layout]:
    """Candidate uniform runs: for each memory class m, `auto_layout` of the hosts with at least m GB.
    The smallest m is `plan`'s own automatic layout; larger ones leave the small hosts out."""
    out = []
    for mem in memory_classes(hosts):
        layout = auto_layout(shape, [h for h in hosts if h.memory_gb >= mem], settings)
        if layout is not None:
            out.append(layout)
    return out


def compare_shapes(
    shape: ModelShape, hosts: Sequence[Host], settings: RunSettings, planned: Layout | None = None
) -> ShapeComparison | None:
    """The mixed-shape placement beside the best uniform one (most tokens/s among `uniform_layouts` and
    `planned`, the layout `plan` printed); None when every host has the same memory (nothing to mix) or
    no shape fits."""
    if len(memory_classes(hosts)) < 2:
        return None
    layouts, memories = mixed_layouts(shape, hosts, settings)
    candidates = uniform_layouts(shape, hosts, settings) + ([planned] if planned is not None else [])
    if not layouts or not candidates:
        return None
    n = len(hosts)
    uniform = [
        shape_plan(shape, [lay], [min(h.memory_gb for rep in lay.replicas for h in rep)], settings, n)
        for lay in candidates
    ]
    best = max(uniform, key=lambda u: u.tokens_per_s)
    return ShapeComparison(
        mixed=shape_plan(shape, layouts, memories, settings, n),
        uniform=best,
        uniform_is_planned=planned is not None and best.groups[0].layout == planned,
    )

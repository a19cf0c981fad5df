"""Aggregation of decoded SparseLoCo contributions across replicas (DESIGN section 3, arXiv 2508.15706).

    Delta_bar = aggregate({decode(c_j) : j in A})          A = the replicas whose fragment arrived

- `mean_over_arrivals` (the paper):  Delta_bar = (1/|A|) sum_{j in A} Delta_j
- `per_coordinate_mean` (Templar):    Delta_bar[i] = sum_j Delta_j[i] / #{j : Delta_j[i] != 0}, 0 if none;
  with sparse contributions a coordinate only one replica chose is not diluted by 1/|A|.
- `median_norm_clip`:                 Delta_j <- Delta_j * min(1, median_l ||Delta_l|| / ||Delta_j||)
- `screen`:                           drop contributions with the wrong shapes, NaN/inf, a value beyond
                                      `max_abs` or a norm beyond `max_norm`, saying why.

Every replica must compute the same Delta_bar bit for bit, so nothing here depends on arrival order:
contributions are taken in ascending replica id and summed one after another in float32 (elementwise
IEEE adds, identical on every host); norms are summed in float64 and clip factors rounded to float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

Contributions = Mapping[int, Sequence[torch.Tensor]]
"""Replica id -> that replica's decoded pseudo-gradient, one dense tensor per parameter."""


@dataclass(frozen=True)
class Rejection:
    """A contribution left out of the aggregate, and why."""

    replica: int
    reason: str


@dataclass(kw_only=True, frozen=True)
class AggregationConfig:
    """How decoded contributions become Delta_bar."""

    method: Literal["mean", "per_coordinate"] = "per_coordinate"
    """"mean": mean over arrivals (paper); "per_coordinate": divide each coordinate by the number of
    contributions nonzero there (Templar; 4.4% vs 24% bits-per-byte gap in the DESIGN's 4-replica trial)."""
    clip_to_median_norm: bool = False
    """Scale every contribution whose L2 norm exceeds the median norm down to it."""
    max_abs: float | None = None
    """Reject a contribution holding any |value| above this (None: no bound)."""
    max_norm: float | None = None
    """Reject a contribution whose L2 norm (over all its tensors) exceeds this (None: no bound)."""

    def __post_init__(self) -> None:
        if self.method not in ("mean", "per_coordinate"):
            raise ValueError(f"AggregationConfig.method={self.method!r} must be 'mean' or 'per_coordinate'")
        for name in ("max_abs", "max_norm"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"AggregationConfig.{name}={v!r} must be a positive finite number or None")


@dataclass(frozen=True)
class Aggregate:
    """Delta_bar and what went into it."""

    tensors: list[torch.Tensor]
    """Delta_bar, float32, one tensor per parameter (zeros if nothing was used)."""
    used: tuple[int, ...]
    """Replica ids that were aggregated, ascending."""
    rejected: tuple[Rejection, ...]
    """Replica ids left out, ascending, with the reason."""
    clip: Mapping[int, float] = field(default_factory=dict)
    """Factor each used contribution was scaled by (1.0 unless clipped)."""


def _ordered(contribs: Contributions) -> list[tuple[int, Sequence[torch.Tensor]]]:
    return sorted(contribs.items(), key=lambda kv: kv[0])


def norm(tensors: Sequence[torch.Tensor]) -> float:
    """L2 norm over all tensors, squares summed in float64 by numpy's pairwise sum (not BLAS, whose
    order depends on the host)."""
    total = 0.0
    for t in tensors:
        a = t.detach().cpu().reshape(-1).to(torch.float64).numpy()
        total += float(np.square(a).sum())
    return math.sqrt(total)


def screen(
    contribs: Contributions,
    shapes: Sequence[Sequence[int]] | None = None,
    *,
    max_abs: float | None = None,
    max_norm: float | None = None,
) -> tuple[dict[int, list[torch.Tensor]], list[Rejection]]:
    """Split contributions into (accepted as float32, rejected with the reason), by ascending replica id.

    shapes: the expected parameter shapes; by default those of the lowest-id contribution.
    """
    ordered = _ordered(contribs)
    if shapes is None and ordered:
        shapes = [tuple(t.shape) for t in ordered[0][1]]
    want = [tuple(s) for s in shapes or []]
    ok: dict[int, list[torch.Tensor]] = {}
    rejected: list[Rejection] = []
    for j, ts in ordered:
        got = [tuple(t.shape) for t in ts]
        if got != want:
            rejected.append(Rejection(j, f"shapes {got} do not match the expected {want}"))
            continue
        ts32 = [t.detach().cpu().to(torch.float32) for t in ts]
        reason = None
        for i, t in enumerate(ts32):
            if not bool(torch.isfinite(t).all()):
                reason = f"tensor {i} holds NaN or inf"
                break
            if max_abs is not None and t.numel() and float(t.abs().max()) > max_abs:
                reason = f"tensor {i} holds |value| {float(t.abs().max()):.4g} > max_abs {max_abs:.4g}"
                break
        if reason is None and max_norm is not None and (n := norm(ts32)) > max_norm:
            reason = f"norm {n:.4g} > max_norm {max_norm:.4g}"
        if reason is None:
            ok[j] = ts32
        else:
            rejected.append(Rejection(j, reason))
    return ok, rejected


def median_norm_clip(contribs: Contributions) -> tuple[dict[int, list[torch.Tensor]], dict[int, float]]:
    """Scale each contribution to at most the median L2 norm (the lower median for an even count).

    Returns the clipped contributions and the factor applied to each (float32-rounded, 1.0 if unclipped).
    """
    ordered = _ordered(contribs)
    norms = {j: norm(ts) for j, ts in ordered}
    if not norms:
        return {}, {}
    med = sorted(norms.values())[(len(norms) - 1) // 2]
    out: dict[int, list[torch.Tensor]] = {}
    factors: dict[int, float] = {}
    for j, ts in ordered:
        f = float(np.float32(med / norms[j])) if norms[j] > med else 1.0
        factors[j] = f
        out[j] = [t.float() * f for t in ts] if f != 1.0 else [t.float() for t in ts]
    return out, factors


def _sum(ordered: list[tuple[int, Sequence[torch.Tensor]]]) -> list[torch.Tensor]:
    acc = [t.detach().float().clone() for t in ordered[0][1]]
    for _, ts in ordered[1:]:
        for a, t in zip(acc, ts, strict=True):
            a += t.float()  # sequential in replica order: the same bits whatever the arrival order
    return acc


def mean_over_arrivals(contribs: Contributions) -> list[torch.Tensor]:
    """(1/|A|) sum_j Delta_j over the contributions given (arXiv 2508.15706)."""
    ordered = _ordered(contribs)
    if not ordered:
        raise ValueError("mean_over_arrivals: no contributions")
    return [a / len(ordered) for a in _sum(ordered)]


def per_coordinate_mean(contribs: Contributions) -> list[torch.Tensor]:
    """sum_j Delta_j[i] / #{j : Delta_j[i] != 0} per coordinate, 0 where no contribution is nonzero."""
    ordered = _ordered(contribs)
    if not ordered:
        raise ValueError("per_coordinate_mean: no contributions")
    acc = _sum(ordered)
    counts = [torch.zeros_like(a) for a in acc]
    for _, ts in ordered:
        for c, t in zip(counts, ts, strict=True):
            c += t != 0
    return [a / c.clamp_min(1) for a, c in zip(acc, counts, strict=True)]


def aggregate(
    contribs: Contributions,
    cfg: AggregationConfig = AggregationConfig(),  # noqa: B008  (frozen, so a shared default is safe)
    shapes: Sequence[Sequence[int]] | None = None,
) -> Aggregate:
    """screen -> optional median-norm clip -> mean, as `cfg` says. Zeros (and `used == ()`) when every
    contribution is rejected; the caller then skips the outer step."""
    ok, rejected = screen(contribs, shapes, max_abs=cfg.max_abs, max_norm=cfg.max_norm)
    if shapes is None:
        first = _ordered(contribs)[:1]
        shapes = [tuple(t.shape) for t in first[0][1]] if first else None
    if not ok:
        if shapes is None:
            raise ValueError("aggregate: no contributions and no shapes to return zeros of")
        zeros = [torch.zeros(tuple(s)) for s in shapes]
        return Aggregate(tensors=zeros, used=(), rejected=tuple(rejected))
    factors = {j: 1.0 for j in ok}
    if cfg.clip_to_median_norm:
        ok, factors = median_norm_clip(ok)
    mean = per_coordinate_mean(ok) if cfg.method == "per_coordinate" else mean_over_arrivals(ok)
    return Aggregate(tensors=mean, used=tuple(sorted(ok)), rejected=tuple(rejected), clip=factors)


__all__ = [
    "Aggregate",
    "AggregationConfig",
    "Contributions",
    "Rejection",
    "aggregate",
    "mean_over_arrivals",
    "median_norm_clip",
    "norm",
    "per_coordinate_mean",
    "screen",
]

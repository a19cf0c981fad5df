"""Aggregation of decoded SparseLoCo contributions across replicas (DESIGN sections 3 and 10).

    Delta_bar = aggregate({decode(c_j) : j in A})          A = the replicas whose fragment arrived

Averaging (`AggregationSettings.aggregation`, protocol/sync_settings.py; SparseLoCo, arXiv 2508.15706):

- `mean_over_arrivals` (the paper):  Delta_bar = (1/|A|) sum_{j in A} Delta_j
- `per_coordinate_mean` (Templar):    Delta_bar[i] = sum_j Delta_j[i] / #{j : Delta_j[i] != 0}, 0 if none;
  with sparse contributions a coordinate only one replica chose is not diluted by 1/|A|.

Bounded influence of one replica (`AggregationSettings.robust`, DESIGN section 10; on by default):

- `screen`:            drop contributions with the wrong shapes, NaN/inf, or beyond the absolute
                       `max_abs` / `max_norm` (on by default, far above any honest update), saying why.
- `clamp_to_median_max_abs`:  per tensor t, B_t = min(max_abs_ratio * med_l max_i |Delta_l,t[i]|, float32
                       max); Delta_j,t <- clamp(Delta_j,t, -B_t, B_t)     (decoded values near float max)
- `median_norm_clip`:  Delta_j <- Delta_j * min(1, max_norm_ratio * med_l ||Delta_l|| / ||Delta_j||)
- `agreement_screen`:  A_j = the cosine down to which a majority of the round agrees with Delta_j
                       (pairwise), tau = max(min_agreement, 1/4 x the round's median A); while some
                       A_j <= tau, leave out the one pointing most away from the others' geometric median
                       z_-j (Weiszfeld on their Gram matrix) and recompute; never half or more of the round
- `trimmed_mean`:      at each coordinate, of the n_i values sent there (all |A| for "mean"), drop the
                       b_i = min(ceil(trim * n_i), floor((n_i - 1) / 2)) smallest and largest and average
                       the rest (arXiv 1803.01498): with trim 0.25 the median of 3, the middle two of 4.

Weights (issue 22: the tokens each contribution trained on, w_j): the averages become
sum_j w_j Delta_j / sum_j w_j (per coordinate: over the w_j of the replicas that sent i), and the trimmed
mean still trims by count, then averages the kept values weighted, so a heavy contribution cannot buy its
way past the trim. Equal weights give the unweighted averages bit for bit. The weights are the exchange's
(node/sync/exchange.py `Contribution.weight`: the signed, bounded token claims) under
`sync.weighting = "tokens"`.

"clip_median" = clamp + clip, then `aggregation`'s average; "trimmed" (the default) = clamp + clip +
agreement screen + trimmed mean; "none" = the screen and `aggregation`'s average only. Medians are lower
medians (the ((n-1)//2)-th smallest): with one hostile replica among 3 or 4 the scale is an honest
one's, among 2 the smaller one's. Magnitudes are bounded by scaling down, not by rejection: an honest
replica that is merely unusual this round (fresh error feedback after a restart, an odd batch) keeps
its direction, and a hostile one's influence is bounded either way (its norm by the clip, each value by
the clamp). Direction is the one thing scaling cannot bound, so a contribution that a majority of the
round does not agree with (pointing away from it, or orthogonal to it) is left out whole, and the trim
bounds each coordinate sent by at least 3 replicas.

The bound (DESIGN section 10): f hostile replicas of n >= 2f + 1, colluding or not. Every honest
contribution is then agreed with by its n - f > n/2 honest peers, so it is never left out, and a hostile
one stays only if enough honest ones agree with it: one pointing away from them or orthogonal to them is
left out, however its colluders agree with each other. Beyond it (2 colluders of 4) each honest replica
keeps half the round's support, so nobody is left out and the clip and trim bound the influence.

Every replica must compute the same Delta_bar bit for bit, so nothing here depends on arrival order:
contributions are taken in ascending replica id; the plain averages sum them one after another in float32
(elementwise IEEE adds, identical on every host), the trimmed mean sums in float64 in a fixed order
(replica order, or ascending sorted position where it trims); norms and inner products are summed in
float64 by numpy's pairwise sum over fixed blocks; the geometric median is a fixed number of Weiszfeld
steps over Python floats in replica order; bounds and clip factors are rounded to float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from protocol.sync_settings import AggregationSettings

Contributions = Mapping[int, Sequence[torch.Tensor]]
"""Replica id -> that replica's decoded pseudo-gradient, one dense tensor per parameter."""
Weights = Mapping[int, float]
"""Replica id -> its contribution's weight in the average (issue 22: the tokens it trained on)."""

F32_MAX = float(np.finfo(np.float32).max)
WEISZFELD_STEPS = 64
"""Weiszfeld steps of the geometric median (fixed, so every host stops at the same bits)."""
AGREEMENT_SHARE = 0.25
"""The agreement screen's relative level: a contribution that a majority of the round agrees with only
below this share of the round's own agreement (the lower median of every A_j) is left out. In the
benches (docs/benchmarks.md) honest contributions agree within a factor 1.5 of each other, from 0.15 to
0.3; orthogonal ones score 0."""
_BLOCK = 1 << 20
"""Coordinates per block of the trimmed mean and the inner products (bounds their temporary memory to a
few times R x 8 MiB whatever the tensor's size; fixed, so the float64 sums are the same on every host)."""


@dataclass(frozen=True)
class Rejection:
    """A contribution left out of the aggregate, and why."""

    replica: int
    reason: str


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
    clamped: Mapping[int, int] = field(default_factory=dict)
    """Values of each used contribution clamped to the round's bound (0 unless clamped)."""


def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """<a, b> over all tensors: products in float64, numpy's pairwise sum over fixed blocks (the same
    bits on every host, unlike BLAS)."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        xf, yf = x.detach().reshape(-1), y.detach().reshape(-1)
        for i in range(0, xf.numel(), _BLOCK):
            xs = xf[i : i + _BLOCK].to(torch.float64).numpy()
            total += float(np.multiply(xs, yf[i : i + _BLOCK].to(torch.float64).numpy()).sum())
    return total


def _ordered(contribs: Contributions) -> list[tuple[int, Sequence[torch.Tensor]]]:
    return sorted(contribs.items(), key=lambda kv: kv[0])


def _lower_median(values: Sequence[float]) -> float:
    """The ((n-1)//2)-th smallest: with one outlier among 2, 3 or 4 values, an inlier."""
    return sorted(values)[(len(values) - 1) // 2]


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


def clamp_bound(peaks: Sequence[float], ratio: float) -> float:
    """B_t = ratio * lower median of the peaks, in float64, then at most float32's largest and rounded to
    float32: a bound near float max never becomes inf (which would clamp nothing)."""
    return float(np.float32(min(ratio * _lower_median(peaks), F32_MAX)))


def clamp_to_median_max_abs(
    contribs: Contributions, ratio: float = 4.0
) -> tuple[dict[int, list[torch.Tensor]], dict[int, int]]:
    """Clamp every value of tensor t to +-B_t, B_t = ratio * (lower median over contributions of
    max|Delta_j,t|), rounded to float32. Contributions must be finite (run `screen` first).

    Returns the clamped contributions (float32) and how many values of each were clamped.
    """
    ordered = _ordered(contribs)
    if not ordered:
        return {}, {}
    out: dict[int, list[torch.Tensor]] = {j: [] for j, _ in ordered}
    counts = {j: 0 for j, _ in ordered}
    for i in range(len(ordered[0][1])):
        peaks = [float(ts[i].abs().max()) if ts[i].numel() else 0.0 for _, ts in ordered]
        bound = clamp_bound(peaks, ratio)
        for (j, ts), peak in zip(ordered, peaks, strict=True):
            t = ts[i].detach().float()
            if peak > bound:
                counts[j] += int((t.abs() > bound).sum())
                t = t.clamp(-bound, bound)
            out[j].append(t)
    return out, counts


def median_norm_clip(
    contribs: Contributions, ratio: float = 1.0, reference: Mapping[int, float] | None = None
) -> tuple[dict[int, list[torch.Tensor]], dict[int, float]]:
    """Scale each contribution to at most `ratio` times the median L2 norm (the lower median for an even
    count); reference: each contribution's own scale to take that median of instead of its norm.

    Returns the clipped contributions and the factor applied to each (float32-rounded, 1.0 if unclipped).
    """
    ordered = _ordered(contribs)
    norms = {j: norm(ts) for j, ts in ordered}
    if not norms:
        return {}, {}
    limit = ratio * _lower_median(list((reference or norms).values()))
    out: dict[int, list[torch.Tensor]] = {}
    factors: dict[int, float] = {}
    for j, ts in ordered:
        f = float(np.float32(limit / norms[j])) if norms[j] > limit else 1.0
        factors[j] = f
        out[j] = [t.float() * f for t in ts] if f != 1.0 else [t.float() for t in ts]
    return out, factors


def _gram(ordered: list[tuple[int, Sequence[torch.Tensor]]]) -> dict[tuple[int, int], float]:
    """G[j, l] = <Delta_j, Delta_l>, each pair once, in float64 (`dot`)."""
    G: dict[tuple[int, int], float] = {}
    for a, (j, tj) in enumerate(ordered):
        for q, tq in ordered[a:]:
            G[j, q] = G[q, j] = dot(tj, tq)
    return G


def geometric_median_weights(G: Mapping[tuple[int, int], float], ids: Sequence[int]) -> dict[int, float]:
    """Weights w (sum 1) of the geometric median z = sum_l w_l Delta_l of the contributions `ids`, by
    `WEISZFELD_STEPS` Weiszfeld steps from the mean, computed from the Gram matrix alone:

        ||Delta_j - z||^2 = G_jj - 2 (G w)_j + w^T G w,     w_j <- (1/d_j) / sum_l (1/d_l)

    with d_j floored at 1e-9 of the largest norm (a point the median sits on keeps a finite weight).
    Python floats in `ids` order and a fixed step count: the same bits on every host. The geometric
    median stays within a bounded distance of the honest contributions while fewer than half are
    hostile (breakdown point 1/2)."""
    n = len(ids)
    w = {j: 1.0 / n for j in ids}
    floor = 1e-9 * math.sqrt(max(max(G[j, j] for j in ids), 0.0)) if ids else 0.0
    for _ in range(WEISZFELD_STEPS):
        Gw = {j: sum(G[j, q] * w[q] for q in ids) for j in ids}  # (G w)_j
        zz = sum(w[j] * Gw[j] for j in ids)  # ||z||^2
        inv = {j: 1.0 / max(math.sqrt(max(G[j, j] - 2.0 * Gw[j] + zz, 0.0)), floor, 1e-150) for j in ids}
        total = sum(inv[j] for j in ids)
        w = {j: inv[j] / total for j in ids}
    return w


def majority_agreement(G: Mapping[tuple[int, int], float], ids: Sequence[int]) -> dict[int, float]:
    """A_j: the cosine at which a majority of `ids` (j itself included) agrees with j, i.e. the
    (ceil(n/2) - 1)-th largest cos(Delta_j, Delta_l) over l != j (1.0 for n <= 2: j alone is half). A
    pairwise statistic, so a clique of f < n/2 colluders cannot raise its own: above f - 1 of its partners,
    A_j is a cosine with an honest contribution."""
    need = (len(ids) + 1) // 2 - 1  # partners beyond j itself that make a majority

    def cos(j: int, q: int) -> float:
        den = math.sqrt(max(G[j, j], 0.0) * max(G[q, q], 0.0))
        return G[j, q] / den if den > 0 else 0.0

    out = {}
    for j in ids:
        others = sorted((cos(j, q) for q in ids if q != j), reverse=True)
        out[j] = others[need - 1] if need >= 1 else 1.0
    return out


def agreement_screen(
    contribs: Contributions, min_agreement: float = 0.0
) -> tuple[dict[int, list[torch.Tensor]], list[Rejection], dict[int, float]]:
    """Leave out contributions that a majority of the round does not agree with:

        A_j   = majority_agreement(j)                 (a majority agrees with j down to this cosine)
        rho   = lower median_j A_j                    (the round's own agreement level)
        tau   = max(min_agreement, AGREEMENT_SHARE * rho)
        cos_j = <Delta_j, z_-j> / (||Delta_j|| ||z_-j||),  z_-j the geometric median of the others left

    While some j has A_j <= tau (fewer than half of those left agree with it above tau) and either the
    round agrees (rho > min_agreement) or cos_j < min_agreement, the one with the lowest cos_j (then the
    lowest id) is left out and everything recomputed over the rest; at most floor((n - 1) / 2) of n are
    ever left out; min_agreement = -1 leaves nothing out. With f hostile of n >= 2f + 1 and every honest
    pair agreeing above tau, an honest contribution has A_j above tau (its n - f > n/2 honest peers) and
    is never left out, and rho lies between two honest A's, so tau stays below every honest A while
    those are within 1 / AGREEMENT_SHARE of each other. A hostile contribution stays only if at least
    ceil(n/2) - f honest ones agree with it above tau: one pointing away from them (a sign flip, the honest
    mean reversed) or orthogonal to them is left out, however tightly its colluders agree with each other
    (which moves z_-j, not A_j). Where the round has no agreement to go by (rho <= min_agreement: noise),
    only what also points away from the others' median is left out. Beyond the bound (2 colluders of 4)
    each honest replica still has half the round's support and nobody is left out: the clip and the
    trimmed mean bound the colluders' influence instead. Computed from the Gram matrix (float64, each pair
    once, `geometric_median_weights`).

    Returns (kept, rejections, cos_j of each contribution in the last round it was scored).
    """
    ordered = _ordered(contribs)
    G = _gram(ordered)
    left = [j for j, _ in ordered]
    cap = (len(left) - 1) // 2  # never half or more of the round
    cos: dict[int, float] = {}
    rejected: list[Rejection] = []
    while True:
        for j in left:  # against the others' median: in high dimension a point's own share dominates z
            others = [q for q in left if q != j]
            w = geometric_median_weights(G, others)
            zz = max(sum(w[a] * G[a, q] * w[q] for a in others for q in others), 0.0)
            den = math.sqrt(max(G[j, j], 0.0) * zz)
            cos[j] = sum(G[j, q] * w[q] for q in others) / den if den > 0 else 0.0
        A = majority_agreement(G, left)
        rho = _lower_median(list(A.values()))
        tau = max(min_agreement, AGREEMENT_SHARE * rho)
        out = [j for j in left if A[j] <= tau and (rho > min_agreement or cos[j] < min_agreement)]
        if not out or len(rejected) >= cap or min_agreement <= -1:
            break
        j = min(out, key=lambda q: (cos[q], q))
        rejected.append(
            Rejection(
                j,
                f"direction disagrees with the round: fewer than half of the {len(left)} left agree with it "
                f"above cosine {tau:.3g} (a majority only down to {A[j]:.3g}; the bar is max(min_agreement "
                f"{min_agreement:g}, {AGREEMENT_SHARE:g} x the round's {rho:.3g})); cosine {cos[j]:.3g} with "
                "the others' median",
            )
        )
        left.remove(j)
    kept = {j: list(ts) for j, ts in ordered if j in left}
    return kept, sorted(rejected, key=lambda r: r.replica), cos


def _sum(ordered: list[tuple[int, Sequence[torch.Tensor]]]) -> list[torch.Tensor]:
    acc = [t.detach().float().clone() for t in ordered[0][1]]
    for _, ts in ordered[1:]:
        for a, t in zip(acc, ts, strict=True):
            a += t.float()  # sequential in replica order: the same bits whatever the arrival order
    return acc


def _equal(ordered: list[tuple[int, Sequence[torch.Tensor]]], weights: Weights | None) -> bool:
    """No weights, or the same weight for every contribution: the unweighted averages, bit for bit."""
    return weights is None or len({weights[j] for j, _ in ordered}) <= 1


def _weighted_sum(
    ordered: list[tuple[int, Sequence[torch.Tensor]]], weights: Weights
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sum_j w_j Delta_j, sum_j w_j [Delta_j != 0]) per tensor, float64, in replica order."""
    acc = [torch.zeros(t.shape, dtype=torch.float64) for t in ordered[0][1]]
    mass = [torch.zeros(t.shape, dtype=torch.float64) for t in ordered[0][1]]
    for j, ts in ordered:
        for a, m, t in zip(acc, mass, ts, strict=True):
            a += t.double() * weights[j]
            m += (t != 0).double() * weights[j]
    return acc, mass


def mean_over_arrivals(contribs: Contributions, weights: Weights | None = None) -> list[torch.Tensor]:
    """(1/|A|) sum_j Delta_j over the contributions given (arXiv 2508.15706); with weights w (the tokens
    each trained on), sum_j w_j Delta_j / sum_j w_j."""
    ordered = _ordered(contribs)
    if not ordered:
        raise ValueError("mean_over_arrivals: no contributions")
    if _equal(ordered, weights):
        return [a / len(ordered) for a in _sum(ordered)]
    assert weights is not None
    acc, _ = _weighted_sum(ordered, weights)
    total = sum(weights[j] for j, _ in ordered)
    return [(a / total).float() for a in acc]


def per_coordinate_mean(contribs: Contributions, weights: Weights | None = None) -> list[torch.Tensor]:
    """sum_j Delta_j[i] / #{j : Delta_j[i] != 0} per coordinate, 0 where no contribution is nonzero;
    with weights, sum_j w_j Delta_j[i] / sum_{j : Delta_j[i] != 0} w_j."""
    ordered = _ordered(contribs)
    if not ordered:
        raise ValueError("per_coordinate_mean: no contributions")
    if not _equal(ordered, weights):
        assert weights is not None
        acc64, mass = _weighted_sum(ordered, weights)
        return [
            torch.where(m > 0, a / m.clamp_min(1e-300), 0.0).float() for a, m in zip(acc64, mass, strict=True)
        ]
    acc = _sum(ordered)
    counts = [torch.zeros_like(a) for a in acc]
    for _, ts in ordered:
        for c, t in zip(counts, ts, strict=True):
            c += t != 0
    return [a / c.clamp_min(1) for a, c in zip(acc, counts, strict=True)]


def _trimmed_block(
    X: torch.Tensor, trim: float, per_coordinate: bool, w: torch.Tensor | None
) -> torch.Tensor:
    """Trimmed mean of the columns of X (n, m) float32: float32 (m,). w (n,) float64: each row's weight
    in the average of what is kept (None: equal)."""
    n, m = X.shape
    sent = X != 0 if per_coordinate else torch.ones_like(X, dtype=torch.bool)  # (n, m)
    count = sent.sum(0)  # (m,) n_i
    b = torch.minimum(torch.ceil(count.double() * trim).long(), (count - 1).clamp_min(0) // 2)  # (m,)
    acc = torch.zeros(m, dtype=torch.float64)
    if w is None:  # the default path: no weights, nothing more than the plain trimmed mean computes
        for p in range(n):  # untrimmed columns: float64 sum in replica order
            acc += torch.where(sent[p], X[p].double(), 0.0)
        cols = torch.nonzero(b > 0).reshape(-1)  # (m_t,) columns where something is trimmed
        if len(cols):
            Y = torch.where(sent[:, cols], X[:, cols], math.inf).sort(dim=0).values  # (n, m_t) sent first
            bt, ct = b[cols], count[cols]
            part = torch.zeros(len(cols), dtype=torch.float64)
            for p in range(n):  # float64 sum in ascending position order of the kept middle
                part += torch.where((bt <= p) & (p < ct - bt), Y[p].double(), 0.0)
            acc[cols] = part
        return (acc / (count - 2 * b).clamp_min(1)).float()
    W = torch.where(sent, w[:, None], 0.0)  # (n, m) each sent value's weight
    for p in range(n):
        acc += torch.where(sent[p], X[p].double() * W[p], 0.0)
    mass = W.sum(0)
    cols = torch.nonzero(b > 0).reshape(-1)
    if len(cols):  # the same trim by count; stable, so ties keep replica order (and weights) everywhere
        Y, order = torch.where(sent[:, cols], X[:, cols], math.inf).sort(dim=0, stable=True)
        Ws = W[:, cols].gather(0, order)  # (n, m_t) weights in sorted order
        bt, ct = b[cols], count[cols]
        part = torch.zeros(len(cols), dtype=torch.float64)
        part_mass = torch.zeros(len(cols), dtype=torch.float64)
        for p in range(n):
            keep = (bt <= p) & (p < ct - bt)
            part += torch.where(keep, Y[p].double() * Ws[p], 0.0)
            part_mass += torch.where(keep, Ws[p], 0.0)
        acc[cols], mass[cols] = part, part_mass
    return torch.where(mass > 0, acc / mass.clamp_min(1e-300), 0.0).float()


def trimmed_mean(
    contribs: Contributions,
    trim: float = 0.25,
    *,
    per_coordinate: bool = True,
    weights: Weights | None = None,
) -> list[torch.Tensor]:
    """Coordinate-wise trimmed mean: of the n_i values at coordinate i (the nonzero ones if
    `per_coordinate`, else all |A|), drop the b_i = min(ceil(trim * n_i), floor((n_i - 1) / 2)) smallest
    and largest and average the rest (Yin et al. 2018, arXiv 1803.01498); 0 where nothing was sent. With
    weights the trim still counts values (a heavy contribution cannot buy its way past it) and the rest
    are averaged weighted: sum_kept w_j Delta_j[i] / sum_kept w_j."""
    ordered = _ordered(contribs)
    if not ordered:
        raise ValueError("trimmed_mean: no contributions")
    if not 0 <= trim < 0.5:
        raise ValueError(f"trimmed_mean: trim={trim!r} must be in [0, 0.5)")
    w = None
    if not _equal(ordered, weights):
        assert weights is not None
        w = torch.tensor([float(weights[j]) for j, _ in ordered], dtype=torch.float64)
    out = []
    for i, first in enumerate(ordered[0][1]):
        flat = [ts[i].detach().reshape(-1).float() for _, ts in ordered]
        res = torch.empty(first.numel(), dtype=torch.float32)
        for a in range(0, first.numel(), _BLOCK):
            X = torch.stack([f[a : a + _BLOCK] for f in flat])  # (n, m)
            res[a : a + X.shape[1]] = _trimmed_block(X, trim, per_coordinate, w)
        out.append(res.view(first.shape))
    return out


def aggregate(
    contribs: Contributions,
    cfg: AggregationSettings = AggregationSettings(),  # noqa: B008  (frozen, so a shared default is safe)
    shapes: Sequence[Sequence[int]] | None = None,
    weights: Weights | None = None,
) -> Aggregate:
    """screen -> (robust) clamp -> median-norm clip -> (trimmed) agreement screen -> mean or trimmed
    mean, as `cfg` says; the averages weigh each contribution by `weights` (None: equally). Zeros (and
    `used == ()`) when every contribution is rejected; the caller then skips the outer step."""
    # 0 = no absolute bound
    ok, rejected = screen(contribs, shapes, max_abs=cfg.max_abs or None, max_norm=cfg.max_norm or None)
    if shapes is None:
        first = _ordered(contribs)[:1]
        shapes = [tuple(t.shape) for t in first[0][1]] if first else None
    if not ok:
        if shapes is None:
            raise ValueError("aggregate: no contributions and no shapes to return zeros of")
        zeros = [torch.zeros(tuple(s)) for s in shapes]
        return Aggregate(tensors=zeros, used=(), rejected=tuple(rejected))
    factors = {j: 1.0 for j in ok}
    clamped = {j: 0 for j in ok}
    rule = cfg.robust
    if rule != "none":
        ok, clamped = clamp_to_median_max_abs(ok, cfg.max_abs_ratio)
        ok, factors = median_norm_clip(ok, cfg.max_norm_ratio)
    if rule == "trimmed":
        ok, disagree, _ = agreement_screen(ok, cfg.min_agreement)
        rejected = sorted([*rejected, *disagree], key=lambda r: r.replica)
        if not ok:
            zeros = [torch.zeros(tuple(s)) for s in shapes or []]
            return Aggregate(tensors=zeros, used=(), rejected=tuple(rejected))
    per_coordinate = cfg.aggregation == "per_coordinate"
    if rule == "trimmed":
        mean = trimmed_mean(ok, cfg.trim, per_coordinate=per_coordinate, weights=weights)
    else:
        mean = per_coordinate_mean(ok, weights) if per_coordinate else mean_over_arrivals(ok, weights)
    return Aggregate(
        tensors=mean, used=tuple(sorted(ok)), rejected=tuple(rejected), clip=factors, clamped=clamped
    )


__all__ = [
    "F32_MAX",
    "Aggregate",
    "Contributions",
    "Rejection",
    "Weights",
    "aggregate",
    "agreement_screen",
    "clamp_bound",
    "clamp_to_median_max_abs",
    "dot",
    "geometric_median_weights",
    "majority_agreement",
    "mean_over_arrivals",
    "median_norm_clip",
    "norm",
    "per_coordinate_mean",
    "screen",
    "trimmed_mean",
]

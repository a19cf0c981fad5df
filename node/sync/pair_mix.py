"""The pair result of one butterfly exchange (issue 23), computed bit-identically by both ends of a pair.

Once replicas have mixed with different partners their anchors differ, so a pseudo-gradient alone does not
let two ends agree on a result. Each end i of pair (i, k) sends, for one fragment, one signed message of
two parts, compressed by the SparseLoCo codec:

    c_i = Q(e_i)       e_i = beta e_i + Delta_i        the pseudo-gradient, with the codec's error feedback
    z_i = Q(A_i - B)                                   its anchor's difference from the pair's base B
    t_i = base_tag(B)                                  8 bytes of B's digest (both ends must hold one B)

B is the pair result of the pair's previous exchange of this fragment (both ends computed it, so both hold
it), or the run's initial weights before the pair first met. From the decoded parts (c', z'), both ends
compute, on the host in float64 in replica order (lower first):

    screen    each part finite and within the absolute bounds (max_abs, max_norm); else no pair result
    agree     cos(c'_i, c'_k) >= gamma and cos(z'_i, z'_k) >= gamma (gamma = sync.pair_agreement; a part
              that is zero at either end pushes nothing and passes); else no pair result ("disagreed")
    clip      each end's message m' = (c', z') to rho x min(s_i, s_k),  s = ||m'|| + L ||c'||
              (L = ceil(log2 N): an anchor difference holds up to L other pairs' results)
    P       = B + (z'_i + z'_k) / 2 - alpha (w_i c'_i + w_k c'_k) / (w_i + w_k)
              (per coordinate over the ends that sent it, under sync.aggregation = "per_coordinate")

and each end keeps what its own z' did not carry (the anchor difference's error feedback stays in its
anchor, so nothing of it is lost and it is sent again at the next exchange, to whichever partner):

    A_i <- P + ((A_i - B) - z'_i)                      = A_i + (z'_k - z'_i) / 2 - alpha c_bar

The pair rule's bound: with two contributions no majority exists, so each end's message is clipped to rho
times the smaller of the two ends' scales s (both ends compute the same factors, so P stays one). A
hostile partner h then moves an honest end p's anchor, beyond what p's own parts do, by at most

    || z'_h / 2 - alpha w_h c'_h / (w_p + w_h) || <= rho (1/2 + alpha w_h / (w_p + w_h)) s_p,
    s_p = ||(c'_p, z'_p)|| + L ||c'_p||

per exchange, whatever it sends (x100, a sign flip, float max): its norm is p's own times rho. Mixing only
averages, so over later exchanges that displacement spreads over the replicas without growing in sum.

The clip bounds one exchange; a forger that pushes the same way at every exchange (a sign flip, every
round) adds its pushes up. Two honest ends' messages point the same way: both pseudo-gradients descend
one loss, and both anchor differences carry the same swarm's progress since the pair last met (measured
with 8 honest replicas: cosines of at least 0.04 for c and 0.08 for z; a flipped message's are negative).
So the agreement rule: a pair whose parts point apart (cosine below gamma, default 0) gives no result.
Neither end can tell which of the two is hostile, so both skip, and each end's Delta goes back to its
error feedback, for its next partner. A hostile partner can then only push an honest end where the
honest end's own message already points (gamma >= 0), or across it, by at most the clip's bound.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from node.sync.aggregation import Rejection, dot, median_norm_clip, norm, per_coordinate_mean, screen


@dataclass(frozen=True)
class Disagreement(Rejection):
    """The pair's two messages point apart (the agreement rule): a rejection of both ends, not of one."""


def cosine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float | None:
    """cos(a, b) in float64 in a fixed order (the same bits at both ends), None when either is zero."""
    na, nb = norm(a), norm(b)
    return dot(a, b) / (na * nb) if na > 0 and nb > 0 else None


def disagreement(ok: Mapping[int, Sequence[torch.Tensor]], n: int, agreement: float) -> list[Rejection]:
    """The agreement rule on the two screened messages (n tensors of c, then n of z): one Disagreement per
    end if either part's cosine is below `agreement`, else []."""
    lo, hi = sorted(ok)
    for part, cut in (("pseudo-gradients", slice(0, n)), ("anchor differences", slice(n, 2 * n))):
        cos = cosine(ok[lo][cut], ok[hi][cut])
        if cos is not None and cos < agreement:
            why = (
                f"replicas {lo} and {hi}'s {part} point apart (cosine {cos:.3f} < sync.pair_agreement "
                f"{agreement:g}); neither end can tell which is hostile, so both skip the exchange"
            )
            return [Disagreement(lo, why), Disagreement(hi, why)]
    return []


@dataclass(frozen=True)
class PairResult:
    """What one exchange of a fragment gives both ends of the pair."""

    tensors: list[torch.Tensor]
    """P: the pair result, float32 on the CPU (the pair's next base), the same bits at both ends."""
    c: dict[int, list[torch.Tensor]]
    """Each end's pseudo-gradient part as P used it (clipped), float32."""
    z: dict[int, list[torch.Tensor]]
    """Each end's anchor-difference part as P used it (clipped), float32."""
    factors: dict[int, float]
    """Each end's clip factor (its whole message); 1.0 unless clipped."""

    @property
    def sha256(self) -> str:
        """Digest of P's float32 bytes: both ends of a pair publish it, and it must match."""
        return digest(self.tensors)


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' float32 bytes, in order, wherever they live."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


TAG_LEN = 8
"""Bytes of the base's digest a pair message carries (`base_tag`)."""


def base_tag(base: Sequence[torch.Tensor]) -> torch.Tensor:
    """The last tensor of a pair message: the first TAG_LEN bytes of `digest(base)`, each + 1 (1..256, so the
    codec's dense 1-D path, fp16 of v / max|v|, gives them back exactly after rounding). Both ends send the
    digest of the base they hold, so a pair whose bases differ (one end restored an older one, or one end
    applied an exchange the other skipped) finds out, at both ends, from the same bytes."""
    raw = bytes.fromhex(digest(base))[:TAG_LEN]
    return torch.tensor([b + 1 for b in raw], dtype=torch.float32)


def tag_bytes(tag: torch.Tensor) -> bytes:
    """`base_tag`'s bytes from a decoded tag tensor (b"" if it is not one)."""
    if tuple(tag.shape) != (TAG_LEN,) or not bool(torch.isfinite(tag).all()):
        return b""
    vals = torch.round(tag.detach().cpu().double()).long() - 1
    return bytes(int(v) for v in vals) if bool(((vals >= 0) & (vals <= 255)).all()) else b""


def pair_result(
    contribs: Mapping[int, Sequence[torch.Tensor]],
    base: Sequence[torch.Tensor],
    *,
    alpha: float,
    ratio: float,
    max_abs: float,
    max_norm: float,
    weights: Mapping[int, float] | None = None,
    per_coordinate: bool = False,
    reach: int = 1,
    agreement: float = -1.0,
) -> tuple[PairResult | None, list[Rejection]]:
    """P from the two ends' decoded messages (replica -> [c tensors..., z tensors...], n of each for the
    fragment's n parameters of `base`'s shapes), or (None, why) when a message fails the screen: the
    exchange is then skipped by both ends. weights: each end's token weight (None: equal).
    per_coordinate: c_bar per coordinate over the ends that sent it (`sync.aggregation =
    "per_coordinate"`: two sparse messages rarely overlap, so a plain mean would halve the outer step).
    reach: L, the butterfly's stages (the rounds between two meetings of a pair, at most 2 L).
    agreement: gamma of the agreement rule (-1: off), Disagreements when it fails."""
    if len(contribs) != 2:
        raise ValueError(f"a pair result needs the two ends' messages, got {sorted(contribs)}")
    n = len(base)
    shapes = [tuple(t.shape) for t in base] * 2
    ok, rejected = screen(contribs, shapes, max_abs=max_abs, max_norm=max_norm)
    if rejected:
        return None, rejected
    disagreed = disagreement(ok, n, agreement)
    if disagreed:
        return None, disagreed
    # of two scales the lower median is the smaller. An end's anchor difference holds what it took from
    # other pairs since this pair last met, up to L of them, so its own pseudo-gradient L times over
    # counts in its scale: an end whose anchor has not moved since (a replica with one partner, N = 3 or
    # 2^k + 1, sends z = 0 every time) must not stop the other's anchor difference from crossing
    scale = {j: norm(ts) + reach * norm(ts[:n]) for j, ts in ok.items()}
    clipped, factors = median_norm_clip(ok, ratio, reference=scale)
    c = {j: ts[:n] for j, ts in clipped.items()}
    z = {j: ts[n:] for j, ts in clipped.items()}
    lo, hi = sorted(ok)
    w = {j: float((weights or {}).get(j, 1.0)) for j in (lo, hi)}
    if per_coordinate:
        cbars = [t.double() for t in per_coordinate_mean({lo: c[lo], hi: c[hi]}, w if weights else None)]
    else:
        cbars = [
            (w[lo] * a.double() + w[hi] * b.double()) / (w[lo] + w[hi])
            for a, b in zip(c[lo], c[hi], strict=True)
        ]
    out = []
    for i, b in enumerate(base):
        zbar = (z[lo][i].double() + z[hi][i].double()) / 2
        out.append((b.detach().cpu().double() + zbar - alpha * cbars[i]).float())
    return PairResult(out, c, z, {j: factors[j] for j in (lo, hi)}), []


def anchor_after(
    anchor: Sequence[torch.Tensor], base: Sequence[torch.Tensor], result: PairResult, me: int
) -> list[torch.Tensor]:
    """A_me <- P + ((A_me - B) - z'_me): the pair result plus what our own anchor difference did not carry
    (float32, on the CPU; the caller moves it where the anchor lives)."""
    return [
        p + ((a.detach().cpu().float() - b.detach().cpu().float()) - zc)
        for p, a, b, zc in zip(result.tensors, anchor, base, result.z[me], strict=True)
    ]


__all__ = [
    "TAG_LEN",
    "Disagreement",
    "PairResult",
    "anchor_after",
    "base_tag",
    "cosine",
    "digest",
    "disagreement",
    "pair_result",
    "tag_bytes",
]

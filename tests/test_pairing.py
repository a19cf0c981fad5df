"""Butterfly mixing's building blocks (issue 23): the pairing rule (protocol/pairing.py) and the pair result
with its pair trust rule (node/sync/pair_mix.py)."""

from __future__ import annotations

import pytest
import torch

from node.sync.aggregation import norm
from node.sync.pair_mix import Disagreement, anchor_after, pair_result
from protocol.codecs.sparseloco import SparseLoCoConfig, compress, decompress
from protocol.pairing import butterfly_stages, exchanges_to_mix, pairs, partner, vouched_base

BOUNDS = {"alpha": 1.0, "ratio": 2.0, "max_abs": 1e3, "max_norm": 1e5}


@pytest.mark.parametrize("n", range(2, 34))
def test_pairing_is_symmetric_and_mixes_within_two_L(n: int) -> None:
    L = butterfly_stages(n)
    for rnd in range(2 * L):
        for f in range(3):
            for i in range(n):
                p = partner(i, rnd, f, n)
                assert p is None or (p != i and partner(p, rnd, f, n) == i)
    for f in range(3):
        mix = exchanges_to_mix(n, f)
        assert mix == L if n & (n - 1) == 0 else L <= mix <= 2 * L


def test_each_fragment_of_a_round_has_its_own_pairing() -> None:
    assert pairs(0, 0, 8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert pairs(0, 1, 8) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert pairs(1, 0, 8) == pairs(0, 1, 8)  # the stage advances per round as well
    assert partner(2, 0, 2, 6) is None and partner(6 ^ 4, 0, 2, 6) is None  # 2-6 and 3-7 sit out


def test_pairing_refuses_what_it_cannot_pair() -> None:
    with pytest.raises(ValueError, match="at least 2 replicas"):
        partner(0, 0, 0, 1)
    with pytest.raises(ValueError, match="not one of the run's 4"):
        partner(4, 0, 0, 4)


def _message(c: list[torch.Tensor], z: list[torch.Tensor]) -> list[torch.Tensor]:
    return [*c, *z]


def test_both_ends_compute_the_same_pair_result() -> None:
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(8, 8, generator=g), torch.randn(8, generator=g)]
    a = _message(
        [torch.randn(8, 8, generator=g) * 1e-2, torch.randn(8, generator=g) * 1e-2],
        [torch.randn(8, 8, generator=g) * 1e-3, torch.randn(8, generator=g) * 1e-3],
    )
    b = _message(
        [torch.randn(8, 8, generator=g) * 1e-2, torch.randn(8, generator=g) * 1e-2],
        [torch.randn(8, 8, generator=g) * 1e-3, torch.randn(8, generator=g) * 1e-3],
    )
    at_3, _ = pair_result({3: a, 5: b}, base, weights={3: 2.0, 5: 1.0}, **BOUNDS)
    at_5, _ = pair_result({5: b, 3: a}, base, weights={5: 1.0, 3: 2.0}, **BOUNDS)
    assert at_3 is not None and at_5 is not None and at_3.sha256 == at_5.sha256
    want = base[0].double() + (a[2].double() + b[2].double()) / 2 - (2 * a[0].double() + b[0].double()) / 3
    assert torch.allclose(at_3.tensors[0].double(), want, atol=1e-6)
    assert at_3.factors == {3: 1.0, 5: 1.0}  # honest parts of like norm: nothing clipped


def test_lossless_butterfly_reaches_the_mean_in_L_exchanges_and_conserves_the_sum() -> None:
    """With no training (c = 0) and exact anchor differences, L exchanges are the butterfly all-reduce."""
    n, g = 8, torch.Generator().manual_seed(2)
    init = [torch.randn(16, 16, generator=g)]
    anchors = [[init[0] + torch.randn(16, 16, generator=g) * 0.1] for _ in range(n)]
    mean = sum(a[0].double() for a in anchors) / n
    bases: dict[tuple[int, int], list[torch.Tensor]] = {}
    for rnd in range(butterfly_stages(n)):
        for lo, hi in pairs(rnd, 0, n):
            b = bases.get((lo, hi), init)
            msg = {j: [torch.zeros(16, 16), anchors[j][0] - b[0]] for j in (lo, hi)}
            res, rej = pair_result(msg, b, **BOUNDS)
            assert res is not None and not rej
            anchors[lo], anchors[hi] = (
                anchor_after(anchors[lo], b, res, lo),
                anchor_after(anchors[hi], b, res, hi),
            )
            bases[lo, hi] = res.tensors
    for a in anchors:
        assert torch.allclose(a[0].double(), mean, atol=1e-5)


def test_compressed_anchor_differences_lose_nothing() -> None:
    """z' = Q(A - B) carries part of the difference; what it does not stays in each end's anchor, so the
    pair's sum is conserved and the spread shrinks exchange after exchange."""
    n, g, cfg = 4, torch.Generator().manual_seed(3), SparseLoCoConfig(k=64, chunk=256)
    init = [torch.randn(32, 32, generator=g)]
    anchors = [[init[0] + torch.randn(32, 32, generator=g) * 0.1] for _ in range(n)]
    total = sum(a[0].double() for a in anchors)
    bases: dict[tuple[int, int], list[torch.Tensor]] = {}

    def spread() -> float:
        m = sum(a[0].double() for a in anchors) / n
        return max(float((a[0].double() - m).norm()) for a in anchors)

    before = spread()
    for rnd in range(6):
        for lo, hi in pairs(rnd, 0, n):
            b = bases.get((lo, hi), init)
            msg = {
                j: [torch.zeros(32, 32), decompress(compress([anchors[j][0] - b[0]], cfg))[0]]
                for j in (lo, hi)
            }
            res, _ = pair_result(msg, b, **BOUNDS)
            assert res is not None
            anchors[lo], anchors[hi] = (
                anchor_after(anchors[lo], b, res, lo),
                anchor_after(anchors[hi], b, res, hi),
            )
            bases[lo, hi] = res.tensors
    assert torch.allclose(sum(a[0].double() for a in anchors), total, atol=1e-4)
    assert spread() < 0.8 * before


@pytest.mark.parametrize("kind", ["x100", "flip"])
def test_a_hostile_partner_moves_an_honest_end_by_at_most_the_pair_bound(kind: str) -> None:
    g = torch.Generator().manual_seed(4)
    base = [torch.randn(8, 8, generator=g)]
    anchor = [base[0] + torch.randn(8, 8, generator=g) * 1e-2]
    honest = [torch.randn(8, 8, generator=g) * 1e-2, anchor[0] - base[0]]
    other = [torch.randn(8, 8, generator=g) * 1e-2, torch.randn(8, 8, generator=g) * 1e-2]
    hostile = [t * 100 for t in other] if kind == "x100" else [-t for t in other]
    res, _ = pair_result({0: honest, 1: hostile}, base, **BOUNDS)
    assert res is not None
    moved = anchor_after(anchor, base, res, 0)
    own_only = [anchor[0] - BOUNDS["alpha"] * res.c[0][0] / 2 - res.z[0][0] / 2]  # what our parts alone do
    scale = norm(honest) + 1 * norm(honest[:1])  # s_p = ||m_p|| + L ||c_p|| (reach L = 1 here)
    bound = BOUNDS["ratio"] * (1 / 2 + BOUNDS["alpha"] / 2) * scale  # rho (1/2 + alpha/2) s_p
    assert norm([moved[0] - own_only[0]]) <= bound * (1 + 1e-6)
    if kind == "x100":
        assert res.factors[1] < 0.1 and res.factors[0] == 1.0


def _honest_pair(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Two honest ends' messages: pseudo-gradients of one loss (a shared direction plus each end's noise)
    and anchor differences that carry the same progress since the pair's base."""
    g = torch.Generator().manual_seed(seed)
    descent, progress = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    ends = [
        [
            (descent + torch.randn(8, 8, generator=g)) * 1e-2,
            (progress + torch.randn(8, 8, generator=g)) * 1e-3,
        ]
        for _ in range(2)
    ]
    return [torch.randn(8, 8, generator=g)], ends[0], ends[1]


@pytest.mark.parametrize("forged", ["flip", "flip c", "flip z", "flip c, z / 1000"])
def test_messages_that_point_apart_give_no_pair_result_at_either_end(forged: str) -> None:
    """The agreement rule: whatever the sign-flip forger scales its message to (the clip's bound holds per
    exchange, not over rounds), a part pointing away from the other end's stops the exchange at both."""
    base, honest, other = _honest_pair(5)
    c, z = other
    hostile = {
        "flip": [-c, -z],
        "flip c": [-c, z],
        "flip z": [c, -z],
        "flip c, z / 1000": [-c, z / 1000],
    }[forged]
    for a, b in ((2, 6), (6, 2)):
        res, why = pair_result({a: honest, b: hostile}, base, **BOUNDS, agreement=0.0)
        assert res is None and [type(r) for r in why] == [Disagreement] * 2
        assert {r.replica for r in why} == {2, 6} and "point apart" in why[0].reason
    assert pair_result({2: honest, 6: hostile}, base, **BOUNDS, agreement=-1.0)[0] is not None  # off


def test_honest_ends_agree_and_a_part_that_is_zero_passes() -> None:
    base, a, b = _honest_pair(6)
    res, why = pair_result({0: a, 1: b}, base, **BOUNDS, agreement=0.0)
    assert res is not None and why == []
    still = [b[0], torch.zeros(8, 8)]  # an anchor that has not moved since the base (z = 0) pushes nothing
    assert pair_result({0: a, 1: still}, base, **BOUNDS, agreement=0.0)[0] is not None


def test_a_message_beyond_the_absolute_bounds_gives_no_pair_result() -> None:
    base = [torch.zeros(4, 4)]
    ok = [torch.full((4, 4), 1e-3), torch.full((4, 4), 1e-3)]
    bad = [torch.full((4, 4), 1e30), torch.full((4, 4), 1e-3)]
    res, rejected = pair_result({0: ok, 1: bad}, base, **BOUNDS)
    assert res is None and [r.replica for r in rejected] == [1] and "max_abs" in rejected[0].reason
    nan = [torch.full((4, 4), float("nan")), torch.zeros(4, 4)]
    assert pair_result({0: ok, 1: nan}, base, **BOUNDS)[0] is None


def test_a_pair_message_carries_error_feedback_on_its_pseudo_gradient_only() -> None:
    from node.sync.exchange import FragmentId
    from node.sync.sparseloco_sync import SparseLoCoCodec
    from protocol.identity import Identity

    g = torch.Generator().manual_seed(5)
    ident = Identity.from_seed(b"\x07" * 32)
    codec = SparseLoCoCodec(ident, SparseLoCoConfig(k=16, chunk=256, beta=0.5))
    fid = FragmentId("run", 0, 0, 3, 1)
    delta = [torch.randn(32, 32, generator=g), torch.randn(32, generator=g)]
    diff = [torch.randn(32, 32, generator=g) * 1e-2, torch.randn(32, generator=g) * 1e-2]
    data, own = codec.encode_pair(fid, delta, diff, tokens=5)()
    shapes = [t.shape for t in delta] * 2
    receiver = SparseLoCoCodec(Identity.from_seed(b"\x08" * 32), codec.cfg)
    got = receiver.decode(fid, data, shapes, ident.peer_id)
    assert len(got.tensors) == 4 and got.tokens == 5
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, own.tensors, strict=True))
    e = codec.residual(0, 0)
    assert len(e) == 2 and torch.allclose(e[0], delta[0] - got.tensors[0])  # Delta's residual kept
    assert float((got.tensors[2] - diff[0]).norm()) < float(diff[0].norm())  # A - B carried in part
    codec.restore(fid, got.tensors)  # a skipped exchange: the Delta part back, the other not
    assert torch.allclose(codec.residual(0, 0)[0], delta[0], atol=1e-6)


# --- the butterfly run's model: vouched pair bases -----------------------------------------------------
def test_vouched_base_takes_the_newest_base_both_ends_hold_alike() -> None:
    holdings = {
        0: ("a", {1: (4, "x"), 2: (5, "y")}),
        1: ("b", {0: (4, "x"), 3: (5, "z")}),
        2: ("c", {0: (5, "y")}),
        3: ("d", {1: (5, "z")}),
    }
    assert vouched_base(holdings) == (0, 2)  # round 5 beats 4; (0, 2) before (1, 3)


def test_vouched_base_refuses_one_sided_claims_and_one_signer_for_both_ends() -> None:
    # replica 3 claims a newer base with 0 that 0 does not hold; 1 and 2 are the same node
    holdings = {
        0: ("a", {1: (2, "x"), 3: (2, "q")}),
        1: ("n", {0: (2, "x"), 2: (9, "w")}),
        2: ("n", {1: (9, "w")}),
        3: ("d", {0: (9, "forged")}),
    }
    assert vouched_base(holdings) == (0, 1)
    assert vouched_base({0: ("a", {1: (3, "x")}), 1: ("b", {0: (3, "other")})}) is None
    assert vouched_base({0: ("a", {1: (3, "x")}), 1: ("b", {0: (2, "x")})}) is None  # rounds differ
    assert vouched_base({0: ("a", {1: (3, "x")})}) is None


def _spread_after_mixing(n: int, ratio: float) -> float:
    """n replicas training (random pseudo-gradients) and mixing with exact messages for 40 rounds: the
    largest distance of a replica's anchor from replica 0's."""
    g = torch.Generator().manual_seed(n)
    start = [torch.zeros(6, 6)]
    anchors = {r: [t.clone() for t in start] for r in range(n)}
    bases: dict[tuple[int, int], list[torch.Tensor]] = {}
    for rnd in range(40):
        for lo, hi in pairs(rnd, 0, n):
            base = bases.get((lo, hi), start)
            msgs = {r: [torch.randn(6, 6, generator=g) * 1e-2, anchors[r][0] - base[0]] for r in (lo, hi)}
            res, _ = pair_result(msgs, base, **{**BOUNDS, "ratio": ratio}, reach=butterfly_stages(n))
            assert res is not None
            for r in (lo, hi):
                anchors[r] = anchor_after(anchors[r], base, res, r)
            bases[lo, hi] = res.tensors
    return max(norm([anchors[r][0] - anchors[0][0]]) for r in range(n))


@pytest.mark.parametrize("n", [3, 5, 6, 8])
def test_the_pair_rule_does_not_hold_back_mixing_for_any_replica_count(n: int) -> None:
    """A replica with one partner (N = 3, 5: replica 2^k) sends z = 0 at every exchange; the pair rule's
    bound (rho x the smaller scale, s = ||m|| + L ||c||) must still let its partner's anchor difference
    cross: the replicas stay as close as they do with no bound at all (clipping z to rho x the smaller z norm
    left them 4.5x as far apart for N = 3, 2.9x for N = 5)."""
    bounded, free = _spread_after_mixing(n, BOUNDS["ratio"]), _spread_after_mixing(n, 1e3)
    assert bounded <= 1.5 * free, (bounded, free)


def test_per_coordinate_pair_mean_does_not_halve_what_only_one_end_sent() -> None:
    base = [torch.zeros(2, 2)]
    a = [torch.tensor([[1.0, 0.0], [2.0, 0.0]]), torch.zeros(2, 2)]
    b = [torch.tensor([[3.0, 4.0], [0.0, 0.0]]), torch.zeros(2, 2)]
    bounds = {**BOUNDS, "ratio": 1e3}
    res, _ = pair_result({0: a, 1: b}, base, per_coordinate=True, **bounds)
    plain, _ = pair_result({0: a, 1: b}, base, **bounds)
    assert res is not None and plain is not None
    # -alpha c_bar: (1 + 3) / 2 where both sent, 4 and 2 where one did, 0 where none did
    assert torch.equal(res.tensors[0], -torch.tensor([[2.0, 4.0], [2.0, 0.0]]))
    assert torch.equal(plain.tensors[0], -torch.tensor([[2.0, 2.0], [1.0, 0.0]]))

"""Token-weighted averages (issue 22): each contribution weighs by the tokens it trained on.

    mean:            sum_j w_j Delta_j / sum_j w_j
    per coordinate:  sum_j w_j Delta_j[i] / sum_{j : Delta_j[i] != 0} w_j
    trimmed:         the trim counts values (as unweighted); the kept ones are averaged weighted

Equal weights give the unweighted averages bit for bit, so a run of uniform replicas is unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from node.sync.aggregation import aggregate, mean_over_arrivals, per_coordinate_mean, trimmed_mean
from protocol.sync_settings import AggregationSettings


def _sparse(n: int, seed: int = 0) -> dict[int, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {
        j: [
            torch.randn(6, 9, generator=g) * (torch.rand(6, 9, generator=g) > 0.5),
            torch.randn(5, generator=g),
        ]
        for j in range(n)
    }


WEIGHTS = {0: 2.0, 1: 1.0, 2: 1.0, 3: 2.0}


@pytest.mark.parametrize("average", ["mean", "per_coordinate", "trimmed"])
def test_equal_weights_are_the_unweighted_average_bit_for_bit(average: str) -> None:
    c = _sparse(4)
    for w in ({j: 1.0 for j in c}, {j: 4096.0 for j in c}):
        if average == "mean":
            a, b = mean_over_arrivals(c), mean_over_arrivals(c, w)
        elif average == "per_coordinate":
            a, b = per_coordinate_mean(c), per_coordinate_mean(c, w)
        else:
            a, b = trimmed_mean(c), trimmed_mean(c, weights=w)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_weighted_means_follow_their_formulas() -> None:
    c = _sparse(4, seed=1)
    total = sum(WEIGHTS.values())
    mean = mean_over_arrivals(c, WEIGHTS)
    for i in range(2):
        want = sum(c[j][i].double() * WEIGHTS[j] for j in c) / total
        assert torch.allclose(mean[i].double(), want, atol=1e-6)
    per = per_coordinate_mean(c, WEIGHTS)
    for i in range(2):
        num = sum(c[j][i].double() * WEIGHTS[j] for j in c)
        den = sum((c[j][i] != 0).double() * WEIGHTS[j] for j in c)
        want = torch.where(den > 0, num / den.clamp_min(1e-300), 0.0)
        assert torch.allclose(per[i].double(), want, atol=1e-6)
    assert not torch.allclose(mean[0], mean_over_arrivals(c)[0])  # the weights changed something


def test_weighted_trimmed_mean_trims_by_count_and_weighs_the_rest() -> None:
    c = _sparse(4, seed=2)
    got = trimmed_mean(c, 0.25, weights=WEIGHTS)[0].reshape(-1)
    X = torch.stack([c[j][0].reshape(-1) for j in range(4)])
    for i in range(X.shape[1]):
        vals = sorted((float(X[j, i]), WEIGHTS[j]) for j in range(4) if X[j, i] != 0)
        if not vals:
            assert float(got[i]) == 0.0
            continue
        b = min(math.ceil(0.25 * len(vals)), (len(vals) - 1) // 2)
        kept = vals[b : len(vals) - b]
        want = sum(v * w for v, w in kept) / sum(w for _, w in kept)
        assert abs(float(got[i]) - want) < 1e-6


def test_a_heavy_contribution_cannot_buy_its_way_past_the_trim() -> None:
    """One replica claiming 1,000x the others' weight with values far outside theirs: the trim still
    drops its extreme values at every coordinate sent by 3 or more, whatever its weight."""
    honest = {j: [torch.full((64,), 0.01 * (j + 1))] for j in range(3)}
    hostile = {**honest, 3: [torch.full((64,), 50.0)]}
    w = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1000.0}
    out = trimmed_mean(hostile, 0.25, per_coordinate=False, weights=w)[0]
    assert float(out.abs().max()) <= 0.03 + 1e-6  # within the honest values


@pytest.mark.parametrize("robust", ["none", "clip_median", "trimmed"])
def test_aggregate_is_identical_whatever_the_dict_order_with_weights(robust: str) -> None:
    cfg = AggregationSettings(robust=robust)
    c = _sparse(4, seed=3)
    ref = aggregate(c, cfg, weights=WEIGHTS).tensors
    shuffled = {j: c[j] for j in (2, 0, 3, 1)}
    w = {j: WEIGHTS[j] for j in (3, 1, 0, 2)}
    got = aggregate(shuffled, cfg, weights=w).tensors
    assert all(torch.equal(x, y) for x, y in zip(ref, got, strict=True))

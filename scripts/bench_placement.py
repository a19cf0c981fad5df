"""Placement at scale: time to place and the planner's tokens/s, against random and greedy placement.

  python -m scripts.bench_placement [--sizes 100,1000,10000] [--stages 4] [--use 0.8] [--seed 0] [--check]

Synthetic pools of n nodes: speeds from four accelerator tiers (80, 150, 312, 990 TFLOP/s, +-20%,
prices in proportion), free memory to spare, store bandwidth 200-2000 Mbit/s. Every node sits in one of
four regions and has an access link of log-normal bandwidth (median 500 Mbit/s, 50 to 10,000); the true
bandwidth of a pair is the slower access link, capped at 100 Mbit/s between regions, with a 5 ms round
trip inside a region and 80 ms across. The matrix is sparse as the swarm's is: each node advertises what
it measured to a bounded sample of 16 peers (a few percent below the truth). The run is Llama-3-8B's
shape (`CostModel.default`, k = d/8 on every link), S stages and R = use x n / S replicas.

Three placements of the same pool, each scored by `planner.predict` with the *true* link of every
boundary (what placement did not see, it had to estimate):

- placement   coordinator.placement.place (the planner's objective; module docstring)
- greedy      the old placement: nodes ranked by TFLOP/s, the fastest R x S dealt so that replica r,
              stage s takes rank s R + r
- random      R x S nodes drawn at random, in random slots

A table goes to stderr and one JSON line, last, to stdout: place_s_{n} (seconds `place` took), and
gain_vs_random / gain_vs_greedy (tokens/s of placement / baseline - 1, at the largest size).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time

from coordinator.placement import CostModel, Placement, place, placement_layout
from coordinator.plan.planner import predict
from protocol.messages import NodeAdvert

TIERS = (80.0, 150.0, 312.0, 990.0)
REGIONS = 4
SAMPLE = 16
CROSS_REGION_MBPS = 100.0
RTT_MS = (5.0, 80.0)  # inside a region, across


class Pool:
    """A synthetic pool: adverts with sparse measurements, and the true link of every pair."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.region = [rng.randrange(REGIONS) for _ in range(n)]
        self.access = [
            min(10_000.0, max(50.0, rng.lognormvariate(6.2, 1.0))) for _ in range(n)
        ]  # ~500 median
        ids = [f"node{i:05d}" for i in range(n)]
        self.adverts = []
        for i in range(n):
            peers = rng.sample(range(n), min(SAMPLE, n - 1) + 1)
            peers = [j for j in peers if j != i][:SAMPLE]
            tflops = rng.choice(TIERS) * rng.uniform(0.8, 1.2)
            self.adverts.append(
                NodeAdvert(
                    peer_id=ids[i],
                    version="bench",
                    device="cuda:0",
                    memory_gb=80.0,
                    tflops=tflops,
                    price_per_hour=round(tflops / 200.0, 3),
                    host="10.0.0.1",
                    port=1,
                    health_port=2,
                    store_mbps=rng.uniform(200.0, 2000.0),
                    peer_mbps={ids[j]: self.mbps(i, j) * rng.uniform(0.9, 1.0) for j in peers},
                    peer_rtt_ms={ids[j]: self.rtt_ms(i, j) for j in peers},
                )
            )
        self.index = {a.peer_id: i for i, a in enumerate(self.adverts)}

    def mbps(self, i: int, j: int) -> float:
        bw = min(self.access[i], self.access[j])
        return bw if self.region[i] == self.region[j] else min(bw, CROSS_REGION_MBPS)

    def rtt_ms(self, i: int, j: int) -> float:
        return RTT_MS[self.region[i] != self.region[j]]

    def tokens_per_s(self, pl: Placement, cost: CostModel) -> float:
        """planner.predict of the placement with every boundary's true bandwidth and round trip."""
        layout = placement_layout(pl, {a.peer_id: a for a in self.adverts}, cost)
        true = [[self.index[h.name] for h in rep] for rep in layout.replicas]
        layout = type(layout)(
            replicas=layout.replicas,
            layers=layout.layers,
            link_mbps=tuple(tuple(self.mbps(a, b) for a, b in itertools.pairwise(c)) for c in true),
            link_rtt_ms=tuple(tuple(self.rtt_ms(a, b) for a, b in itertools.pairwise(c)) for c in true),
        )
        return predict(cost.shape, layout, cost.settings).tokens_per_s


def greedy(adverts: list[NodeAdvert], R: int, S: int) -> Placement:
    """The placement this replaces: rank by TFLOP/s (then store bandwidth, price), deal rank s R + r."""
    ranked = sorted(adverts, key=lambda a: (-a.tflops, -a.store_mbps, a.price_per_hour, a.peer_id))
    return Placement({(r, s): ranked[s * R + r].peer_id for s in range(S) for r in range(R)})


def random_placement(adverts: list[NodeAdvert], R: int, S: int, seed: int) -> Placement:
    chosen = random.Random(seed).sample(adverts, R * S)
    return Placement({(r, s): chosen[r * S + s].peer_id for r in range(R) for s in range(S)})


def replicas(n: int, S: int, use: float) -> int:
    """R = use x n / S replicas (at least one) of S stages from a pool of n."""
    return max(1, int(use * n) // S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", default="100,1000,10000", help="pool sizes, comma-separated (example: 100,1000)"
    )
    ap.add_argument("--stages", type=int, default=4, help="pipeline stages S (example: 4)")
    ap.add_argument("--use", type=float, default=0.8, help="share of the pool placed: R = use x n / S")
    ap.add_argument("--seed", type=int, default=0, help="pool seed (example: 0)")
    ap.add_argument(
        "--check", action="store_true", help="validate the flags, print one JSON line, place nothing"
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r} must be comma-separated integers (example: 100,1000)")
    S = args.stages
    if S < 1 or not 0 < args.use <= 1:
        ap.error(f"--stages {S} must be at least 1 and --use {args.use} in (0, 1]")
    layouts = {n: replicas(n, S, args.use) for n in sizes}
    short = [n for n, R in layouts.items() if R * S > n]
    if short:
        ap.error(f"--sizes {short}: a pool must hold R x S = max(1, use n / S) x {S} nodes")
    try:
        cost = CostModel.default(S)
    except ValueError as e:
        ap.error(f"--stages: {e}")
    if args.check:  # the layouts and the cost model, without building a pool
        out_check = {"check": "ok", "bench": "placement", "replicas": layouts, "layers": list(cost.layers)}
        print(json.dumps(out_check))
        return 0
    out: dict[str, float] = {}
    print(
        f"{'nodes':>6} {'R x S':>9} {'place s':>8} {'placement':>11} {'greedy':>11} {'random':>11}",
        file=sys.stderr,
    )
    for n in sizes:
        pool = Pool(n, args.seed)
        R = layouts[n]
        t = time.perf_counter()
        pl = place(pool.adverts, R, S, cost=cost)
        place_s = time.perf_counter() - t
        ours = pool.tokens_per_s(pl, cost)
        base_greedy = pool.tokens_per_s(greedy(pool.adverts, R, S), cost)
        base_random = pool.tokens_per_s(random_placement(pool.adverts, R, S, args.seed), cost)
        print(
            f"{n:>6} {f'{R} x {S}':>9} {place_s:>8.3f} {ours:>11,.0f} {base_greedy:>11,.0f} {base_random:>11,.0f}",
            file=sys.stderr,
        )
        out[f"place_s_{n}"] = round(place_s, 4)
        out[f"tokens_per_s_{n}"] = round(ours, 1)
        out["gain_vs_greedy"] = round(ours / base_greedy - 1, 4)
        out["gain_vs_random"] = round(ours / base_random - 1, 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

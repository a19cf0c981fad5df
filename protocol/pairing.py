"""Butterfly pairings of replicas (issue 23; butterfly mixing, Zhao and Canny): which replica each one
exchanges a fragment with in one round, instead of reading every other replica's fragment.

    L       = ceil(log2 N)                 (N >= 2 replicas of the run)
    s(r, f) = (r + f) mod L                (the butterfly stage of round r's exchange of fragment f)
    p(i)    = i XOR 2^s(r, f)              (replica i's partner; none when p(i) >= N)

Offsetting the stage by the fragment index gives each fragment of a round its own pairing, so one slow
replica is not every fragment's partner at once. For N a power of two an update reaches all N replicas
after L consecutive exchanges of a fragment (the butterfly all-reduce's reach); for any other N the pairs
whose partner index is N or more sit that exchange out (the rule is the same for every replica, so both
ends agree nobody is missing), and reaching all N takes `exchanges_to_mix(N)` exchanges, at most 2 L.
Every participant computes this from the run's replica count alone: nobody chooses a pairing.
"""

from __future__ import annotations

from collections.abc import Mapping

PairHoldings = Mapping[int, tuple[str, Mapping[int, tuple[int, str]]]]
"""For one parameter: replica -> (the signer of the checkpoint holding it, partner -> (the round of the
exchange that made the pair's base, the base's sha256)), as butterfly checkpoints carry them."""


def butterfly_stages(n: int) -> int:
    """L = ceil(log2 n): the butterfly's stages for n >= 2 replicas."""
    if n < 2:
        raise ValueError(f"butterfly mixing needs at least 2 replicas, got {n}")
    return (n - 1).bit_length()


def partner(replica: int, rnd: int, fragment: int, n: int) -> int | None:
    """Replica `replica`'s partner in round `rnd`'s exchange of `fragment` among n replicas, or None when
    the butterfly pairs it with an index of n or more (it sits that exchange out)."""
    if not 0 <= replica < n:
        raise ValueError(f"replica {replica} is not one of the run's {n} replicas")
    p = replica ^ (1 << ((rnd + fragment) % butterfly_stages(n)))
    return p if p < n else None


def pairs(rnd: int, fragment: int, n: int) -> list[tuple[int, int]]:
    """Round `rnd`'s pairs for `fragment`, each (lower, higher), ascending."""
    out = []
    for i in range(n):
        p = partner(i, rnd, fragment, n)
        if p is not None and i < p:
            out.append((i, p))
    return out


def exchanges_to_mix(n: int, fragment: int = 0, first_round: int = 0) -> int:
    """How many consecutive exchanges of `fragment`, from `first_round`, it takes until every replica's
    update has reached every replica (reach sets merged pairwise, as the pair result merges them)."""
    reach = [{i} for i in range(n)]
    for t in range(4 * butterfly_stages(n)):
        for lo, hi in pairs(first_round + t, fragment, n):
            reach[lo] = reach[hi] = reach[lo] | reach[hi]
        if all(len(r) == n for r in reach):
            return t + 1
    raise AssertionError(
        f"the butterfly of {n} replicas did not mix within {4 * butterfly_stages(n)} exchanges"
    )


def vouched_base(holdings: PairHoldings) -> tuple[int, int] | None:
    """The butterfly run's model, one parameter at a time (issue 23: no two replicas' anchors are equal, so
    the all-to-all rule "two replicas' checkpoints sign the same anchor" cannot hold): the pair base that
    both ends' checkpoints hold alike (the same round and digest under each other's index), signed by two
    different nodes: a pair result, which the pair rule bounds, never one node's own tensor. The newest
    such round wins, ties to the lowest pair; (replica, partner) whose checkpoint to take it from, or None
    when no two checkpoints vouch for one."""
    best: tuple[int, int, int] | None = None
    for r, (signer, held) in sorted(holdings.items()):
        for p, (rnd, sha) in sorted(held.items()):
            if p <= r or p not in holdings:
                continue
            their_signer, theirs = holdings[p]
            if their_signer == signer or theirs.get(r) != (rnd, sha):
                continue
            if best is None or (-rnd, r, p) < best:
                best = (-rnd, r, p)
    return None if best is None else (best[1], best[2])


__all__ = ["PairHoldings", "butterfly_stages", "exchanges_to_mix", "pairs", "partner", "vouched_base"]

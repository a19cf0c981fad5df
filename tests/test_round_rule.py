"""The round rule's arithmetic on its own (node/sync/round_rule.py): the cutoff a final decision reports,
S = { j : t_j <= C } (what lets the late window work from cutoffs alone), and late entries committed once,
in the first round whose cutoff they meet, within k rounds. Pure functions, many random rounds."""

from __future__ import annotations

import random

from node.sync.round_rule import STORE_MARGIN_S, decide, late_entries, majority


def test_the_cutoff_is_the_deadline_or_the_last_arrival_with_every_slot_in() -> None:
    live = {0, 1, 2}
    some = decide({0: 10, 1: 11}, live, quorum=2, window_s=5, now_s=100)
    assert (some.deadline_s, some.cutoff_s, some.members) == (16, 16, frozenset({0, 1}))
    every = decide({0: 10, 1: 11, 2: 12}, live, quorum=2, window_s=5, now_s=14)
    assert (every.cutoff_s, every.final, every.settles_at_s) == (12, True, 12 + STORE_MARGIN_S)
    late = decide({0: 10, 1: 11, 2: 40}, live, quorum=2, window_s=5, now_s=100)
    assert (late.cutoff_s, late.members) == (16, frozenset({0, 1}))
    below = decide({0: 10}, live, quorum=2, window_s=5, now_s=100)
    assert below.cutoff_s is None and below.members == frozenset()


def test_a_final_set_is_every_slot_stamped_by_its_cutoff() -> None:
    """S = { j : t_j <= C } on 5,000 random rounds: the late window needs only the cutoffs."""
    rng = random.Random(7)
    for _ in range(5000):
        live = set(range(rng.randint(1, 7)))
        stamps = {j: rng.randint(0, 30) for j in live if rng.random() < 0.85}
        d = decide(stamps, live, quorum=majority(len(live)), window_s=rng.randint(0, 8), now_s=10**6)
        if d.cutoff_s is None:
            continue
        assert d.final and d.members == frozenset(j for j, t in stamps.items() if t <= d.cutoff_s)


def test_late_entries_are_committed_once_in_the_first_round_whose_cutoff_they_meet() -> None:
    """Random runs of 12 rounds, k = 1..3: every fragment that missed its own set is committed in exactly
    the first round R <= r + k with t <= C_R, and never again; one later than C_(r+k) is never committed."""
    rng = random.Random(11)
    for _ in range(300):
        k, live = rng.randint(1, 3), {0, 1, 2, 3}
        cut: list[int] = []
        stamps: list[dict[int, int]] = []
        start = 0
        for _ in range(12):  # each round starts after the last one's cutoff, some slots straggle
            st = {j: start + rng.choice([0, 0, 1, 2, rng.randint(3, 20)]) for j in live}
            d = decide(st, live, quorum=3, window_s=2, now_s=10**6)
            assert d.cutoff_s is not None
            cut.append(d.cutoff_s)
            stamps.append(st)
            start = d.cutoff_s + 1
        committed: dict[tuple[int, int], int] = {}
        for R in range(len(cut)):
            for r0 in range(max(0, R - k), R):
                for j in late_entries(stamps[r0], live, cutoff_s=cut[R], before=cut[r0:R]):
                    assert (r0, j) not in committed, "committed twice"
                    committed[r0, j] = R
        for r0, st in enumerate(stamps):
            for j, t in st.items():
                rounds = [R for R in range(r0 + 1, min(len(cut), r0 + k + 1)) if t <= cut[R]]
                expect = rounds[0] if t > cut[r0] and rounds else None
                assert committed.get((r0, j)) == expect, (r0, j, t, cut)

"""Late fragments committed, not lost (issue 22): which earlier rounds' fragments a round's set commits, by
node/sync/round_rule.py `late_entries`, and our own fragments waiting in the window.

A fragment that misses its round's set is committed in the first of the next k = `sync.max_late_rounds`
rounds whose cutoff it meets, by every replica alike (they read the same LastModified). Its sender keeps it
out of error feedback until the window has closed: committed late, it is never restored (so never applied
twice); not committed by round r + k, it is restored then (so never lost). The exchange
(node/sync/round_exchange.py) reads the store; this keeps what the rule needs between rounds: each recent
round's set and cutoff, and ours still waiting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from node.sync.exchange import FragmentId
from node.sync.round_rule import STORE_MARGIN_S, Decision, late_entries

Ours = tuple[list[torch.Tensor], str]
"""Our contribution as receivers decode it, and the sha256 of its wire bytes."""
FirstValid = Callable[
    [FragmentId, set[int], Ours | None], tuple[dict[int, tuple[int, list[torch.Tensor]]], int] | None
]
"""(round's fid, slots, ours in that round) -> (slot -> (t_j, its first valid fragment decoded), the LIST's
store clock), or None if the store could not be read now."""
DecideRound = Callable[[dict[int, int], set[int], int], Decision]
"""(slot -> t_j, live slots, store clock) -> the round rule's decision (the exchange's quorum and W)."""


@dataclasses.dataclass
class Committed:
    """What a round's set takes from earlier rounds, the same on every replica."""

    late: dict[int, list[tuple[int, list[torch.Tensor]]]]
    """Slot -> [(earlier round, its fragment decoded)], oldest first."""
    restore: list[list[torch.Tensor]]
    """Ours whose window closed with this round uncommitted: back to error feedback."""
    ours_committed: list[int]
    """Rounds of ours this round commits."""


class LateWindow:
    """One stage's late window for one replica (`replica`), k rounds wide."""

    def __init__(self, k: int, replica: int) -> None:
        self.k, self.replica = k, replica
        self.settled: dict[tuple[int, int], tuple[frozenset[int], int]] = {}
        """(fragment, round) -> (S, C) of the recent rounds this replica settled or read back."""
        self.waiting: dict[tuple[int, int], Ours] = {}
        """(fragment, round) -> our fragment that missed that round's set and may still be committed."""

    def hold(self, fid: FragmentId, ours: Ours) -> bool:
        """Our fragment missed `fid`'s set: keep it out of error feedback while the window is open.
        False (restore it now) when there is no window (k = 0)."""
        if self.k == 0:
            return False
        self.waiting[fid.fragment, fid.round] = ours
        return True

    def commit(
        self,
        fid: FragmentId,
        decision: Decision,
        live: set[int],
        first_valid: FirstValid,
        decide: DecideRound,
    ) -> Committed | None:
        """The late entries round `fid.round` commits, given its final `decision`; None if a round it needs
        could not be read now (ask again: the answer does not depend on when). Records this round's S and C
        for the rounds after it."""
        if decision.cutoff_s is None:
            raise ValueError("a round below quorum commits nothing")
        out = Committed({}, [], [])
        R = fid.round
        for r0 in range(max(0, R - self.k), R):
            prev = self._round(fid, r0, live, first_valid, decide)
            if prev is None:
                return None
            ours = self.waiting.get((fid.fragment, r0))
            need = live - prev[0]
            if not need:
                continue
            got = first_valid(dataclasses.replace(fid, round=r0), need, ours)
            if got is None or got[1] < decision.cutoff_s + STORE_MARGIN_S:
                return None  # a LIST older than this round's cutoff + M could miss a late fragment
            found, _ = got
            between = []
            for r in range(r0 + 1, R):
                c = self._round(fid, r, live, first_valid, decide)
                if c is None:
                    return None
                between.append(c[1])
            stamps = {j: t for j, (t, _) in found.items()}
            for j in sorted(late_entries(stamps, prev[0], live, cutoff_s=decision.cutoff_s, between=between)):
                out.late.setdefault(j, []).append((r0, found[j][1]))
                if ours is not None and j == self.replica and found[j][1] is ours[0]:
                    out.ours_committed.append(r0)
        for r0 in range(max(0, R - self.k), R):  # ours: committed, or its window closes with this round
            ours = self.waiting.get((fid.fragment, r0))
            if ours is not None and (r0 in out.ours_committed or r0 == R - self.k):
                del self.waiting[fid.fragment, r0]
                if r0 not in out.ours_committed:
                    out.restore.append(ours[0])
        self.settled[fid.fragment, R] = (decision.members, decision.cutoff_s)
        for f, r in [k for k in self.settled if k[0] == fid.fragment and k[1] < R - self.k]:
            del self.settled[f, r]
        return out

    def _round(
        self, fid: FragmentId, r: int, live: set[int], first_valid: FirstValid, decide: DecideRound
    ) -> tuple[frozenset[int], int] | None:
        """(S_r, C_r): as settled here, or (a replica that started since) read back from the store."""
        known = self.settled.get((fid.fragment, r))
        if known is not None:
            return known
        got = first_valid(dataclasses.replace(fid, round=r), set(live), self.waiting.get((fid.fragment, r)))
        if got is None:
            return None
        d = decide({j: t for j, (t, _) in got[0].items()}, live, got[1])
        if not d.final or d.cutoff_s is None:
            return None
        self.settled[fid.fragment, r] = (d.members, d.cutoff_s)
        return self.settled[fid.fragment, r]


__all__ = ["Committed", "LateWindow"]

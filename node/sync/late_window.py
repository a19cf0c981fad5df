"""Late fragments committed, not lost (issue 22): which earlier rounds' fragments a round's set commits, by
node/sync/round_rule.py `late_entries`, and our own fragments waiting in the window.

A fragment that misses its round's set is committed in the first of the next k = `sync.max_late_rounds`
rounds whose cutoff it meets, by every replica alike (they read the same LastModified). Its sender keeps it
out of error feedback until the window has closed: committed late, it is never restored (so never applied
twice); not committed by round r + k, it is restored then (so never lost). The exchange
(node/sync/round_exchange.py) reads the store; this keeps what the rule needs between rounds: each recent
round's cutoff C (consensus state, the same on every replica: checkpoints carry it, so a replica that
resumes decides with the cutoffs the others hold, not with ones re-derived under a later view), and ours
still waiting (local: lost on a restart, never applied twice).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from node.sync.exchange import Contribution, FragmentId
from node.sync.round_rule import STORE_MARGIN_S, Decision, late_entries

log = logging.getLogger("node.sync.round_exchange")  # the exchange's lines, under the one name they had

Ours = tuple[Contribution, str]
"""Our contribution as receivers decode it, and the sha256 of its wire bytes."""
FirstValid = Callable[
    [FragmentId, set[int], Ours | None], tuple[dict[int, tuple[int, Contribution]], int] | None
]
"""(round's fid, slots, ours in that round) -> (slot -> (t_j, its first valid fragment decoded), the LIST's
store clock), or None if the store could not be read now."""
DecideRound = Callable[[dict[int, int], set[int], int], Decision]
"""(slot -> t_j, live slots, store clock) -> the round rule's decision (the exchange's quorum and W)."""
UNKNOWN = -(2**62)
"""A cutoff this replica could not establish: no fragment is committed against it."""
CUTOFFS = "late_cutoffs"
"""The state key of the recent rounds' cutoffs: int64 rows (fragment, round, C)."""


@dataclasses.dataclass
class Committed:
    """What a round's set takes from earlier rounds, the same on every replica."""

    late: dict[int, list[tuple[int, Contribution]]]
    """Slot -> [(earlier round, its fragment decoded)], oldest first."""
    restore: list[tuple[int, Contribution]]
    """(round, ours) whose window closed with this round uncommitted: back to error feedback."""
    ours_committed: list[int]
    """Rounds of ours this round commits."""


class LateWindow:
    """One stage's late window for one replica (`replica`), k rounds wide. Each fragment's rounds run one at
    a time (the outer loop applies round r before it captures r + 1); different fragments' may overlap on
    the I/O threads, so nothing here iterates a dict another fragment's round may grow."""

    def __init__(self, k: int, replica: int) -> None:
        self.k, self.replica = k, replica
        self.cutoffs: dict[tuple[int, int], int] = {}
        """(fragment, round) -> C of the recent rounds: settled here, read from a checkpoint, or read back."""
        self.members: dict[tuple[int, int], frozenset[int]] = {}
        """(fragment, round) -> S of the rounds settled here (only to skip LISTs when nobody was late)."""
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
        """The late entries round `fid.round` commits, given its final `decision` over `live`; None if a
        round it needs could not be read now (ask again: the answer does not depend on when). Records this
        round's C for the rounds after it."""
        if decision.cutoff_s is None:
            raise ValueError("a round below quorum commits nothing")
        out = Committed({}, [], [])
        R, f = fid.round, fid.fragment
        for r0 in range(max(0, R - self.k), R):
            before = [self._cutoff(fid, r, live, first_valid, decide) for r in range(r0, R)]
            if any(c is None for c in before):
                return None
            if any(c == UNKNOWN for c in before):
                continue  # said in _cutoff; nothing of r0 is committed by this replica
            known = self.members.get((f, r0))
            need = live - known if known is not None else set(live)
            if not need:
                continue
            ours = self.waiting.get((f, r0))
            got = first_valid(dataclasses.replace(fid, round=r0), need, ours)
            if got is None or got[1] < decision.cutoff_s + STORE_MARGIN_S:
                return None  # a LIST older than this round's cutoff + M could miss a late fragment
            found = got[0]
            stamps = {j: t for j, (t, _) in found.items()}
            cuts = [c for c in before if c is not None]
            for j in sorted(late_entries(stamps, live, cutoff_s=decision.cutoff_s, before=cuts)):
                out.late.setdefault(j, []).append((r0, found[j][1]))
                if ours is not None and j == self.replica and found[j][1] is ours[0]:
                    out.ours_committed.append(r0)
        for key in sorted(k for k in list(self.waiting) if k[0] == f and k[1] < R):
            if key[1] in out.ours_committed or key[1] <= R - self.k:  # committed, or its window closed
                ours = self.waiting.pop(key)
                if key[1] not in out.ours_committed:
                    out.restore.append((key[1], ours[0]))
        self.cutoffs[f, R], self.members[f, R] = decision.cutoff_s, decision.members
        for key in [k for k in list(self.cutoffs) if k[0] == f and k[1] < R - self.k]:
            self.cutoffs.pop(key, None)
            self.members.pop(key, None)
        return out

    def _cutoff(
        self, fid: FragmentId, r: int, live: set[int], first_valid: FirstValid, decide: DecideRound
    ) -> int | None:
        """C_r: as settled here or checkpointed; else (a replica that started without them) read back from
        the store under today's view, or UNKNOWN where that view cannot decide it (the live slots or the
        quorum changed since): then this replica commits nothing of that round. None: not readable now."""
        known = self.cutoffs.get((fid.fragment, r))
        if known is not None:
            return known
        got = first_valid(dataclasses.replace(fid, round=r), set(live), None)
        if got is None:
            return None
        d = decide({j: t for j, (t, _) in got[0].items()}, live, got[1])
        if not d.final or d.cutoff_s is None:
            log.warning(
                "run %s stage %d fragment %d: round %d's cutoff is not in this replica's state and cannot be "
                "read back under the current view; it commits none of that round's late fragments",
                fid.run_id,
                fid.stage,
                fid.fragment,
                r,
            )
            self.cutoffs[fid.fragment, r] = UNKNOWN
            return UNKNOWN
        self.cutoffs[fid.fragment, r] = d.cutoff_s
        return d.cutoff_s

    def state(self) -> dict[str, torch.Tensor]:
        """The recent rounds' cutoffs, for checkpoints (every replica holds the same)."""
        rows = sorted((f, r, c) for (f, r), c in list(self.cutoffs.items()) if c != UNKNOWN)
        return {CUTOFFS: torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state()`; a checkpoint without it (an older build) leaves the cutoffs to be read back."""
        self.cutoffs.clear()
        self.members.clear()
        self.waiting.clear()  # ours of before the checkpoint: its error feedback does not hold them
        rows = state.get(CUTOFFS)
        if rows is not None:
            for f, r, c in rows.reshape(-1, 3).tolist():
                self.cutoffs[int(f), int(r)] = int(c)


__all__ = ["CUTOFFS", "Committed", "LateWindow", "Ours"]

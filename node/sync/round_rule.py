"""The rule that decides a round's agreed set from what the store itself says (issue 21): no replica, and no
writer of any one key, chooses it. Every replica reads the round with one LIST and computes the same set:

    t_r  = LastModified of slot r's first valid fragment       (store clock, whole seconds; (t, key) order)
    q    = quorum: a majority of the stage's live slots unless the run spec names one
    D    = t_(q) + W                                           (the q-th smallest t_r; W = sync.timeout_s)
    S    = { r live : t_r <= D }                               (|S| >= q by construction)

and takes S as final once the store's clock (the LIST's own Date) reads at least C + M, with the cutoff
C = D, or, with every live slot in, C = max_r t_r: an object whose LastModified is M seconds older than a
LIST is in it (S3 and R2 list strongly consistently; M covers the one-second rounding both ways), so no
later LIST can show an earlier fragment that would change a t_r, the q-th arrival or S.

Late entries (issue 22; `sync.max_late_rounds` = k, default 1). A slot's fragment of round R - b
(1 <= b <= k) that missed its round's set is committed in round R's, by the same arithmetic on one LIST of
round R - b taken after round R is final:

    L_R(R - b) = { j live : C_(R'') < t_j(R - b) <= C_R for every R - b <= R'' < R }

(S_(R-b) = { j : t_j <= C_(R-b) }, so only the cutoffs are needed, and they are the same on every
replica: checkpoints carry them). A fragment is committed in the first round whose cutoff it meets, once;
later than C_(R-b+k) it is never committed and goes back to its sender's error feedback. A slot's late and on-time fragments in one round are one
contribution (summed). The late entries need no new key and no new writer: every replica reads them from
the same LastModified, so they are agreed exactly as S is.

Why this rule (rather than a record signed by one writer, or a quorum of signed votes):
- LastModified is written by the store, not by the uploader; keys are write-once, and with grants each
  node can write only its own slots' keys, so nobody but the store moves a timestamp and nobody can
  squat, replace or delete another slot's fragment.
- One early uploader cannot pull the deadline forward: D hangs on the q-th arrival, so f < q hostile
  slots uploading early (even rounds ahead) move it at most to the (q - f)-th honest arrival; withholding
  moves it at most to the q-th honest one. Every honest fragment that lands within W of the first honest
  one is in S; S always holds at least q - f honest fragments.
- Liveness needs no one in particular: no coordinator, no record writer; a round below quorum waits (the
  coordinator rebuilds or drops a lost replica, the slots shrink); giving up would split it from a
  replica that reaches the round once its quorum is in.

What it assumes: a PUT completes within M of the LastModified the store gives it (true of a small
fragment; an upload trickled over longer could be listed by some replicas and not others), and replicas
agree on the stage's live slots and their signers (they read the same signed assignments; in the seconds
after a reassignment two replicas can differ, as with any rule).
"""

from __future__ import annotations

from dataclasses import dataclass

STORE_MARGIN_S = 2
"""M: seconds of store clock after which a LIST shows every object with an earlier LastModified."""


def majority(live: int) -> int:
    """The default quorum: more than half of the live slots."""
    return live // 2 + 1


@dataclass(frozen=True)
class Decision:
    """What one LIST of a round decides."""

    members: frozenset[int]
    """S: the slots whose fragments the round applies (empty while below quorum)."""
    deadline_s: int | None
    """D on the store's clock; None while fewer than q slots have a valid fragment."""
    final: bool
    """No later LIST can change `members`."""
    settles_at_s: int | None
    """The store time at which a LIST would be final, if nothing more arrives (None: below quorum)."""
    cutoff_s: int | None = None
    """C: every fragment stamped at or before it is in a final LIST (settles_at_s - M; None: below quorum).
    A late fragment of an earlier round counts in this round if stamped by C (`late_entries`)."""


def decide(
    stamps: dict[int, int],
    live: set[int],
    *,
    quorum: int,
    window_s: int,
    now_s: int,
    margin_s: int = STORE_MARGIN_S,
) -> Decision:
    """S from the t_r of the live slots that have a valid fragment (`stamps`, slot -> t_r), the live slots,
    the quorum q, W (`window_s`) and the LIST's store clock `now_s`."""
    arrived = sorted(t for r, t in stamps.items() if r in live)
    if quorum < 1 or len(arrived) < quorum:
        return Decision(frozenset(), None, False, None)
    deadline = arrived[quorum - 1] + window_s
    members = frozenset(r for r, t in stamps.items() if r in live and t <= deadline)
    cutoff = min(deadline, max(arrived)) if len(arrived) == len(live) else deadline
    return Decision(members, deadline, now_s >= cutoff + margin_s, cutoff + margin_s, cutoff)


def decide_step(
    stamps: dict[int, int],
    live: set[int],
    *,
    quorum: int,
    window_s: int,
    now_s: int,
    margin_s: int = STORE_MARGIN_S,
) -> Decision:
    """The agreed set of one inner step's small records (issue 24: the routing counts of
    node/sync/route_exchange.py), by `decide`'s arithmetic, with one difference that makes a per-step
    barrier cheap: each slot has exactly one key per step, written once, so the moment every live slot's
    record is in (valid), no later LIST can change a t_r, the q-th arrival or S, and the set is final at
    once instead of M seconds after the last arrival. With a slot missing it is final as `decide`'s is,
    at C + M with C = D."""
    d = decide(stamps, live, quorum=quorum, window_s=window_s, now_s=now_s, margin_s=margin_s)
    if d.deadline_s is not None and live and live <= set(stamps):
        return Decision(d.members, d.deadline_s, True, now_s, d.cutoff_s)
    return d


def late_entries(stamps: dict[int, int], live: set[int], *, cutoff_s: int, before: list[int]) -> set[int]:
    """L_R(R - b): the live slots whose round R - b fragment (`stamps`, slot -> t_j(R - b), its first valid
    one) is stamped by round R's cutoff C_R and after every cutoff from its own round's to the last one's
    (`before`: C_(R-b), ..., C_(R-1)). Past C_(R-b) it missed its own set (S = { j : t_j <= C }); past the
    ones between it was not committed earlier."""
    return {j for j, t in stamps.items() if j in live and t <= cutoff_s and all(t > c for c in before)}


__all__ = ["STORE_MARGIN_S", "Decision", "decide", "decide_step", "late_entries", "majority"]

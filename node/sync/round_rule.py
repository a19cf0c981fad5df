"""The rule that decides a round's agreed set from what the store itself says (issue 21): no replica, and no
writer of any one key, chooses it. Every replica reads the round with one LIST and computes the same set:

    t_r  = LastModified of slot r's first valid fragment       (store clock, whole seconds; (t, key) order)
    q    = quorum: a majority of the stage's live slots unless the run spec names one
    D    = t_(q) + W                                           (the q-th smallest t_r; W = sync.timeout_s)
    S    = { r live : t_r <= D }                               (|S| >= q by construction)

and takes S as final once the store's clock (the LIST's own Date) reads at least D + M, or, with every live
slot in, at least max_r t_r + M: an object whose LastModified is M seconds older than a LIST is in it
(S3 and R2 list strongly consistently; M covers the one-second rounding both ways), so no later LIST can
show an earlier fragment that would change a t_r, the q-th arrival or S.

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
    settles = min(deadline, max(arrived)) + margin_s if len(arrived) == len(live) else deadline + margin_s
    return Decision(members, deadline, now_s >= settles, settles)


__all__ = ["STORE_MARGIN_S", "Decision", "decide", "majority"]

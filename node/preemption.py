"""A node's stop notice (SIGTERM), served as a spot host's preemption notice (issue 26).

A training node does not stop at its next step: it trains on to its next round's checkpoint, for at most
`--preempt-notice-s`, so the node that replaces it resumes from that checkpoint and no round is replayed;
then the daemon advertises "leaving" (the coordinator re-places the slot at its next tick instead of
after the churn grace) and stops. An idle node, or a notice of 0 s, stops at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("node.daemon")  # the daemon's lines, under the one name they had


class Notice:
    """The notice a node is serving, if any."""

    def __init__(
        self,
        notice_s: float,
        *,
        training: Callable[[], bool],
        checkpointed: Callable[[], int],
        stop: Callable[[], None],
    ) -> None:
        """training: whether a worker is running; checkpointed: the last round it checkpointed; stop: stop
        the node now."""
        self.notice_s, self.training, self.checkpointed, self.stop = notice_s, training, checkpointed, stop
        self._given: tuple[float, int] | None = None
        """(when, the last checkpointed round then)."""

    @property
    def pending(self) -> bool:
        return self._given is not None

    def give(self) -> None:
        """SIGTERM: stop now if idle, else serve the notice (the worker asks `reason` at every step)."""
        if not self.training() or self.notice_s <= 0:
            self.stop()
            return
        self._given = (time.monotonic(), self.checkpointed())
        log.warning(
            "notice to stop: training on to the next checkpoint (at most %.0f s), then leaving the run",
            self.notice_s,
        )

    def reason(self) -> str | None:
        """The worker's stop reason under the notice: once a checkpoint newer than the notice is taken, or
        the notice has run out; None otherwise."""
        if self._given is None:
            return None
        at, rnd = self._given
        if self.checkpointed() > rnd:
            return f"preempted: left after the checkpoint of round {self.checkpointed()}"
        if time.monotonic() - at > self.notice_s:
            return f"preempted: no checkpoint within the {self.notice_s:.0f} s notice"
        return None


__all__ = ["Notice"]

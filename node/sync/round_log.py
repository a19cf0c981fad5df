"""What a round of the exchange (node/sync/round_exchange.py) says and counts once it is settled: the
slots it left out and why ours was not used, and what it committed late (node/sync/late_window.py)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

from node.sync.exchange import Contribution, FragmentCodec, FragmentId, SyncStats
from node.sync.late_window import Committed, LateWindow, Ours
from node.sync.round_reader import RoundReader
from node.sync.round_rule import Decision
from protocol import keys


class Settling(Protocol):
    """What these lines read of the exchange that settled the round (node/sync/round_exchange.py)."""

    stats: SyncStats
    lock: threading.Lock
    timeout_s: float
    late: LateWindow
    reader: RoundReader
    cancelled: Callable[[], bool]

    @property
    def codec(self) -> FragmentCodec: ...

    @property
    def cut_off_s(self) -> float: ...


log = logging.getLogger("node.sync.round_exchange")  # the exchange's lines, under the one name they had


def report_round(
    ex: Settling,
    fid: FragmentId,
    contribs: dict[int, Contribution],
    settled: tuple[Decision, dict[int, str]] | None,
    bad: set[str],
    ours: Ours,
    expected: set[int],
    started: float,
) -> None:
    """Count and say what the round left out: our fragment (and why), and the slots that missed it."""
    me, live = fid.replica, ex.reader.slots()
    if settled is None:
        log.warning(
            "run %s stage %d round %d fragment %d: %s; the round applies nothing",
            fid.run_id,
            fid.stage,
            fid.round,
            fid.fragment,
            "the worker stopped while it waited for a quorum"
            if ex.cancelled()
            else f"the store did not answer a LIST for {ex.cut_off_s:.0f} s",
        )
    if contribs.get(me) is not ours[0]:
        with ex.lock:
            ex.stats.not_uploaded += 1
        own_key = keys.fragment_key(
            fid.run_id, fid.stage, fid.fragment, fid.round, me, ex.codec.signer, ours[1]
        )
        why_not_ours = (
            "the round was not settled"
            if settled is None
            else "a valid fragment of this slot was already in the store (from before a restart)"
            if me in contribs
            else "it reached the store after the round's deadline (the quorum's arrival + "
            f"{math.ceil(ex.timeout_s)} s on the store's clock)"
            if me in settled[1]
            else "our fragment's key already held other bytes"  # only someone who knew our bytes
            if own_key in bad
            else "the object store did not take it"
        )
        log.warning(
            "our fragment %s was not used: %s; %s",
            fid,
            why_not_ours,
            f"a later round's set may commit it (sync.max_late_rounds = {ex.late.k})"
            if settled is not None and me not in contribs and ex.late.k
            else "it stays in error feedback for a later round",
        )
    missing = (expected | live) - set(contribs) - {me}
    if missing and settled is not None:
        with ex.lock:
            ex.stats.missing += len(missing)
        gone = missing - live
        log.warning(
            "run %s stage %d round %d fragment %d: replicas %s did not arrive %s; aggregating %s",
            fid.run_id,
            fid.stage,
            fid.round,
            fid.fragment,
            sorted(missing),
            f"(dropped out after {time.monotonic() - started:.1f} s)"
            if gone == missing
            else f"within {ex.timeout_s:.0f} s of the quorum",
            sorted(contribs),
        )


def report_late(ex: Settling, fid: FragmentId, late: Committed) -> None:
    """Count and say what this round committed late, and which of ours went back to error feedback."""
    with ex.lock:
        ex.stats.late_committed += sum(len(v) for v in late.late.values())
        ex.stats.late_expired += len(late.restore)
    if late.late:
        log.info(
            "run %s stage %d round %d fragment %d: commits late fragments (replica: rounds) %s%s",
            fid.run_id,
            fid.stage,
            fid.round,
            fid.fragment,
            {r: [q for q, _ in v] for r, v in sorted(late.late.items())},
            f"; ours of rounds {late.ours_committed}" if late.ours_committed else "",
        )
    for rnd, _ in late.restore:
        log.warning(
            "run %s stage %d fragment %d: our fragment of round %d was in no round's set by round %d "
            "(sync.max_late_rounds = %d); it goes back to error feedback",
            fid.run_id,
            fid.stage,
            fid.fragment,
            rnd,
            fid.round,
            ex.late.k,
        )


__all__ = ["report_late", "report_round"]

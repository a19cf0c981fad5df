"""The round exchange: how one stage's replicas agree, through the object store, on the set of fragments a
round applies (DESIGN section 3). It puts our fragment, waits for the others' and returns the agreed set;
the outer loop (node/sync/outer_sync.py) keeps the schedule, the anchor and the apply.

    run(fid, encoding, shapes) -> Exchanged     # what every replica applies for (stage, fragment, round)

The agreed set is decided by node/sync/round_rule.py from what the store itself says (the fragments'
LastModified, read by one LIST once it is final), so no replica and no writer of any single key chooses
it: there is no round record to write first, squat or forge.

Fragment keys are write-once (conditional PUT, If-None-Match): every reader of a key sees the same bytes,
so an object cannot be swapped between two replicas' reads. If our key already holds other bytes
(a faulty writer got there first, or our own upload from before a restart), we treat our slot exactly
as every other replica does: use those bytes if they validate against this slot's signer, leave the
slot out if not. The consensus stays identical, and our unused contribution goes back to the codec
(SparseLoCo's error feedback sends it in a later round). A store that does not answer is retried.

Waiting for the other replicas GETs keys every reader can compute (each signer's primary fragment key)
with exponential backoff; the round is LISTed when the rule can settle it (and while a missing slot's
primary key is squatted).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from node.sync.exchange import (
    Contribution,
    Encoding,
    Exchanged,
    FragmentCodec,
    FragmentId,
    RoundAgreementError,
    RoundSuperseded,
    SyncStats,
)
from node.sync.late_window import Committed, LateWindow, Ours
from node.sync.round_log import report_late, report_round
from node.sync.round_reader import RoundReader
from node.sync.round_rule import Decision, decide, majority
from protocol import keys
from protocol.net.store import ObjectStore, ObjectTooLarge, ObjectUnreadable, StoreError
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)


TOO_LARGE = "too large"
"""What `_Gathered.seen` notes for a key whose object was refused by its size, or that the store would not
serve (no digest was taken)."""
SUPERSEDED_CHECK_S = 5.0
"""How often a round below quorum asks whether this node still holds its slot (at least every timeout_s)."""
QUORUM_WAIT = 10
"""A round below quorum waits, for the missing replicas or for the coordinator to rebuild or drop the lost
ones (the live slots then shrink and so does q), however long that takes: a replica that gave up and
applied nothing would differ from one that reaches the round once its quorum is in (a rebuilt replica
replaying it). Every QUORUM_WAIT x timeout_s of waiting it says so in the log. A stopping worker ends the
wait and applies nothing, as does a replica the store has not answered for that long (cut off from it,
nothing it applies is the consensus anyway)."""


@dataclass
class _Gathered:
    """One replica's view of one round's fragments while it gathers them."""

    valid: dict[str, Contribution] = field(default_factory=dict)
    """Key -> the valid fragment it holds, decoded (ours: our contribution itself)."""
    bad: set[str] = field(default_factory=set)
    """Keys that held no valid fragment of their slot: never read again."""
    seen: dict[str, str] = field(default_factory=dict)
    """Key -> sha256 of the bytes it held when read (or TOO_LARGE); keys are written once, so it stays so."""
    found: dict[int, tuple[str, float]] = field(default_factory=dict)
    """Slot -> (a key holding a valid fragment of it, the store's clock when we found it: t_r is no later)."""


_NOT_OURS: Ours = (Contribution([], 0), "")
"""A round none of ours is waiting in: no key's digest is "", so nothing is taken for ours."""


class _Backoff:
    """The wait between two polls of the store: first_s, doubled after each poll up to cap_s, never past
    the deadline; back to first_s when something arrived (the replicas' uploads come close together)."""

    def __init__(self, first_s: float, cap_s: float) -> None:
        self.first_s, self.cap_s, self.delay_s = first_s, cap_s, first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    def wait(self, deadline: float) -> None:
        time.sleep(max(0.0, min(self.delay_s, deadline - time.monotonic())))
        self.delay_s = min(2 * self.delay_s, self.cap_s)


def stop_if_superseded(superseded: Callable[[], str | None], now: float) -> float:
    """Raise RoundSuperseded when `superseded` says why this node no longer holds its slot; asked once a
    round's set is final, before it is applied, and every SUPERSEDED_CHECK_S (at least timeout_s) while
    below quorum: a replica dropped out while alive must not apply rounds the others decide without it.
    Returns `now` (when it was asked)."""
    if (why := superseded()) is not None:
        raise RoundSuperseded(why)
    return now


class RoundExchange:
    """One stage's round agreement over the store, for one replica (`run` on the outer loop's I/O thread):
    the store all-to-all of node/sync/exchange.py's `Exchange`. Its `reader` knows who may sign each
    replica's slot and lists the round; bytes, rejections and misses are counted in the outer loop's
    `stats` (under `lock`). quorum: the q of node/sync/round_rule.py (0: a majority of the live slots).
    cancelled: the worker is stopping: a round still waiting gives up and applies nothing. max_late_rounds:
    the k of node/sync/late_window.py. superseded: why this node lost its slot (`stop_if_superseded`)."""

    def __init__(
        self,
        store: ObjectStore,
        codec: FragmentCodec,
        *,
        replica: int,
        stage_peers: dict[int, str],
        former_stage_peers: dict[int, set[str]] | None,
        timeout_s: float,
        poll_s: float,
        poll_max_s: float,
        stats: SyncStats,
        lock: threading.Lock,
        quorum: int = 0,
        cancelled: Callable[[], bool] = lambda: False,
        max_late_rounds: int = 1,
        superseded: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store, self.codec, self.replica = store, codec, replica
        self.late = LateWindow(max_late_rounds, replica)
        self._kept: dict[tuple[int, int], _Gathered] = {}  # (fragment, round) -> a recent round's reads but
        # its set's: the late window reads those rounds without GETting or rejecting a key twice
        self.reader = RoundReader(
            store,
            replica=replica,
            signer=codec.signer,
            stage_peers=stage_peers,
            former_stage_peers=former_stage_peers,
            max_bytes=codec.max_fragment_bytes,
        )
        self.timeout_s, self.poll_s, self.poll_max_s = timeout_s, poll_s, poll_max_s
        self.quorum, self.cancelled, self.superseded = quorum, cancelled, superseded
        self.stats, self.lock = stats, lock

    def put_once(self, key: str, data: bytes) -> tuple[bool | None, bytes | None]:
        """Write-once PUT of our fragment: (True, None) if the key holds our bytes, (False, what it holds)
        if it holds other bytes, (None, None) if the store did not answer (try again later)."""
        try:
            if self.store.put_if_absent(key, data) is not None:
                self._count(up=len(data))
                return True, None
        except StoreError as e:
            log.debug("upload of %s failed (retrying until the round settles): %s", key, e)
        try:  # refused, or a PUT whose reply was lost: what does the key hold now?
            stored = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except (ObjectTooLarge, ObjectUnreadable) as e:  # somebody else's object: no valid fragment of ours
            log.warning("our fragment key %s: %s", key, e)
            return False, b""
        except StoreError:
            return None, None
        if stored is None:
            return None, None
        return (True, None) if stored == data else (False, stored)

    def set_stage_peers(
        self, stage_peers: dict[int, str], former: dict[int, set[str]] | None = None
    ) -> set[str]:
        """The signers of this stage's slots changed: see `RoundReader.set_stage_peers`."""
        return self.reader.set_stage_peers(stage_peers, former)

    def state(self) -> dict[str, torch.Tensor]:
        return self.late.state()

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.late.load_state(state)

    @property
    def cut_off_s(self) -> float:
        """Unanswered LISTs for this long end a round's wait for its quorum (QUORUM_WAIT x W)."""
        return QUORUM_WAIT * max(self.timeout_s, 1.0)

    def quorum_of(self, live: set[int]) -> int:
        return self.quorum or majority(len(live))

    def _primary(self, fid: FragmentId, r: int, signer: str) -> str:
        return keys.primary_fragment_key(fid.run_id, fid.stage, fid.fragment, fid.round, r, signer)

    def _get_fragment(self, key: str, g: _Gathered) -> bytes | None:
        """The bytes at `key`, refused (ObjectTooLarge) when larger than any valid fragment; None if absent
        or the store did not answer (asked again at the next poll). Notes in g.seen what the key holds."""
        try:
            blob = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except (ObjectTooLarge, ObjectUnreadable):
            g.seen[key] = TOO_LARGE
            raise
        except StoreError as e:  # transient (503, reset, timeout)
            log.debug("fetch of %s failed (retrying): %s", key, e)
            return None
        if blob is not None:
            self._count(down=len(blob))
            g.seen[key] = keys.content_digest(blob)
        return blob

    def _reject(self, fid: FragmentId, r: int, key: str, why: Exception, g: _Gathered) -> None:
        g.bad.add(key)
        with self.lock:
            self.stats.rejected += 1
        log.warning("rejected an object under replica %d's slot of %s (%s): %s", r, fid, key, why)

    def _valid(
        self,
        fid: FragmentId,
        r: int,
        key: str,
        shapes: list[torch.Size],
        g: _Gathered,
        ours: Ours,
    ) -> bool | None:
        """Whether `key` holds a valid fragment of slot r: its bytes verify against the signer the key
        names (a signer of the slot) and, at a key naming a hash, match that hash. None: not readable now
        (absent, or the store did not answer). A valid one is kept decoded in g.valid (in our slot, our own
        bytes, `ours` = (contribution, sha256), are our contribution itself); an invalid one is rejected,
        once, and never read again."""
        if key in g.valid:
            return True
        if key in g.bad:
            return False
        signer, name = key.rsplit("/", 2)[1:]
        other = FragmentId(fid.run_id, fid.stage, fid.fragment, fid.round, r)
        try:
            if (blob := self._get_fragment(key, g)) is None:
                return None
            if name != keys.PRIMARY_NAME and g.seen[key] != name:
                raise ProtocolError("its bytes do not match the hash its key names (truncated or planted)")
            got = self.codec.decode(other, blob, shapes, signer)
        except (ProtocolError, ObjectTooLarge, ObjectUnreadable) as e:
            self._reject(fid, r, key, e, g)
            return False
        mine = r == fid.replica and (signer, g.seen[key]) == (self.codec.signer, ours[1])
        g.valid[key] = ours[0] if mine else got
        return True

    def _poll(
        self,
        fid: FragmentId,
        live: set[int],
        listing: dict[int, dict[str, list[tuple[int, str]]]] | None,
        shapes: list[torch.Size],
        g: _Gathered,
        ours: Ours,
    ) -> bool:
        """Look for the live slots not found yet (but ours, which we put): each signer's primary key, or
        the keys a fresh `listing` names. True if one was found."""
        arrived = False
        for r in sorted(live - set(g.found) - {fid.replica}):
            if listing is not None:
                candidates = [key for sg in sorted(listing.get(r, {})) for _, key in listing[r][sg]]
            else:
                signers = sorted(s for s in self.reader.signers(r) if self.reader.counts_for(s, r))
                candidates = [self._primary(fid, r, s) for s in signers]
            for key in candidates:
                if self._valid(fid, r, key, shapes, g, ours):
                    g.found[r] = (key, self.store.store_now())
                    arrived = True
                    break
        return arrived

    def _decide(
        self,
        fid: FragmentId,
        live: set[int],
        shapes: list[torch.Size],
        g: _Gathered,
        ours: Ours,
    ) -> tuple[Decision, dict[int, str]] | None:
        """The rule on one fresh LIST of the round: (its decision, slot -> the key of its fragment). None if
        the LIST or a candidate it names could not be read now."""
        got = self._firsts(fid, live, shapes, g, ours)
        if got is None:
            return None
        firsts, now_s = got
        stamps = {r: t for r, (t, _) in firsts.items()}
        return self._rule(stamps, live, now_s), {r: key for r, (_, key) in firsts.items()}

    def _rule(self, stamps: dict[int, int], live: set[int], now_s: int) -> Decision:
        window_s = math.ceil(self.timeout_s)
        return decide(stamps, live, quorum=self.quorum_of(live), window_s=window_s, now_s=now_s)

    def _firsts(
        self,
        fid: FragmentId,
        slots: set[int],
        shapes: list[torch.Size],
        g: _Gathered,
        ours: Ours,
    ) -> tuple[dict[int, tuple[int, str]], int] | None:
        """One fresh LIST of the round: slot -> (t_r, the key of its first valid fragment) for `slots`, and
        the store's clock; None if the LIST or a candidate it names could not be read now."""
        listed = self.reader.listing(fid)
        if listed is None:
            return None
        listing, now_s = listed
        out: dict[int, tuple[int, str]] = {}
        for r in sorted(slots):
            firsts: list[tuple[int, str]] = []  # each signer's first valid fragment
            for sg in sorted(listing.get(r, {})):
                for t, key in listing[r][sg]:
                    ok = self._valid(fid, r, key, shapes, g, ours)
                    if ok is None:
                        return None
                    if ok:
                        firsts.append((t, key))
                        break
            if firsts:  # the slot's: the earliest (a replaced signer's, in a round it took part in)
                out[r] = min(firsts)
        return out, now_s

    def _commit_late(
        self, fid: FragmentId, d: Decision, live: set[int], shapes: list[torch.Size]
    ) -> Committed:
        """What round fid.round's final decision `d` commits from earlier rounds (node/sync/late_window.py),
        read until the store answers; RoundAgreementError if it does not within the grace."""

        first_valid = functools.partial(self._first_valid, shapes=shapes)
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        grace_s = self.cut_off_s  # as long as a round waits on an unanswering store: the answer keeps
        start = self.store.store_now()
        while (done := self.late.commit(fid, d, live, first_valid, self._rule)) is None:
            if self.store.store_now() - start > grace_s:
                raise RoundAgreementError(
                    f"round {fid.round} fragment {fid.fragment}: this replica could not list the earlier rounds "
                    f"whose late fragments it may commit within {grace_s:.0f} s (check the store's health)"
                )
            backoff.wait(math.inf)
        return done

    def _first_valid(
        self, f0: FragmentId, slots: set[int], ours: Ours | None, *, shapes: list[torch.Size]
    ) -> tuple[dict[int, tuple[int, Contribution]], int] | None:
        """late_window.py's `FirstValid` over an earlier round's kept reads (rejected keys stay rejected)."""
        g0 = self._kept.setdefault((f0.fragment, f0.round), _Gathered())
        got = self._firsts(f0, slots, shapes, g0, ours or _NOT_OURS)
        return None if got is None else ({r: (t, g0.valid[k]) for r, (t, k) in got[0].items()}, got[1])

    def _settles_at(self, live: set[int], g: _Gathered) -> float | None:
        """When, on the store's clock, a LIST may settle the round given what polling found (each t_r is
        no later than when we found it); None below quorum."""
        est = {r: int(at) for r, (_, at) in g.found.items()}
        d = decide(est, live, quorum=self.quorum_of(live), window_s=math.ceil(self.timeout_s), now_s=0)
        return None if d.settles_at_s is None else d.settles_at_s + 0.05

    def run(self, fid: FragmentId, encoding: Encoding, shapes: list[torch.Size]) -> Exchanged:
        """I/O thread: finish encoding ours, upload it, gather the other replicas' fragments, and return the
        set node/sync/round_rule.py decides once a LIST of the round is final.

        A slot is filled only by a valid fragment signed by a signer of the replica's slot, found at that
        signer's primary key or at a key that names the signer and the fragment's hash. Anything else under
        the round (a squatter's object, a truncated or forged one, one signed by a stranger) is counted as
        rejected and never read again: planting garbage cannot empty a round. Our own slot is resolved like
        a peer's: if it already holds a valid fragment of ours (uploaded before a restart), that one is the
        slot's, and we do not upload a second. Replicas that settle at different times, or a late, rebuilt
        one replaying the round, read the same final LIST and apply the same set."""
        data, own = encoding()
        me = fid.replica
        ours = (own, keys.content_digest(data))
        g = _Gathered()
        started = time.monotonic()
        said_at = started
        expected = self.reader.slots()  # a replica that drops out while we wait still missed this round
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        settled: tuple[Decision, dict[int, str]] | None = None
        listed_at = -math.inf
        answered_at = started  # the store's last answer to a LIST of the round
        checked_at = started
        while not self.cancelled():
            live = self.reader.slots()
            if me not in g.found:
                self._put_ours(fid, data, shapes, g, ours)
            squatted = any(
                self._primary(fid, r, sg) in g.bad
                for r in live - set(g.found) - {me}
                for sg in self.reader.signers(r)
            )
            below = self._settles_at(live, g) is None  # a hash-named fragment is found only by a LIST
            now = time.monotonic()
            relist = below and now - listed_at >= max(5.0, self.timeout_s)
            listed = self.reader.listing(fid) if squatted or relist else None
            listed_at = now if squatted or relist else listed_at  # asked (a store that does not answer too)
            answered_at = now if listed is not None else answered_at
            if self._poll(fid, live, listed[0] if listed else None, shapes, g, ours):
                backoff.reset()
            want = self._settles_at(live, g)
            if want is not None and self.store.store_now() >= want:
                settled = self._decide(fid, live, shapes, g, ours)
                if settled is not None and settled[0].final:
                    break
                if settled is not None and settled[0].settles_at_s is not None:
                    want = max(want, settled[0].settles_at_s + 0.05)
            if want is None and now - answered_at > self.cut_off_s:
                break  # cut off from the store: nothing this replica applies is the consensus anyway
            if want is None and now - checked_at >= max(self.timeout_s, SUPERSEDED_CHECK_S):
                checked_at = stop_if_superseded(self.superseded, now)
            if want is None and now - said_at >= QUORUM_WAIT * max(self.timeout_s, 1.0):
                said_at = now
                log.warning(
                    "run %s stage %d round %d fragment %d: waiting %.0f s for a quorum (%d of %d live replicas "
                    "have a fragment in, %d needed); the coordinator rebuilds or drops a lost replica",
                    fid.run_id,
                    fid.stage,
                    fid.round,
                    fid.fragment,
                    now - started,
                    len(set(g.found) & live),
                    len(live),
                    self.quorum_of(live),
                )
            grace_s = max(self.timeout_s, 10.0)
            if want is not None and self.store.store_now() - want > grace_s:
                raise RoundAgreementError(  # a quorum is in: only an unreadable store keeps it unsettled
                    f"round {fid.round} fragment {fid.fragment}: a quorum of fragments is in the store but "
                    f"this replica could not list the round or read a fragment it lists within {grace_s:.0f} s "
                    "of the round settling; it cannot apply the agreed set (check the store's health)"
                )
            wake = math.inf if want is None else time.monotonic() + max(0.0, want - self.store.store_now())
            backoff.wait(wake if wake > time.monotonic() else math.inf)  # past it: the next LIST after a poll
        if settled is not None and not settled[0].final:
            settled = None  # below quorum to the end, or the worker stopped while we waited
        if settled is not None:  # decided, but ours to apply only if no newer epoch left us out
            stop_if_superseded(self.superseded, time.monotonic())
        on_time = {} if settled is None else {r: g.valid[settled[1][r]] for r in sorted(settled[0].members)}
        report_round(self, fid, on_time, settled, g.bad, ours, expected, started)
        if settled is None:
            return Exchanged({}, [own.tensors])
        used = {settled[1][r] for r in settled[0].members}
        self._kept[fid.fragment, fid.round] = _Gathered(
            {k: v for k, v in g.valid.items() if k not in used}, set(g.bad) | used, dict(g.seen)
        )
        late = self._commit_late(fid, settled[0], live, shapes)  # the view the decision was made in
        for key in [k for k in list(self._kept) if k[0] == fid.fragment and k[1] < fid.round - self.late.k]:
            self._kept.pop(key, None)
        report_late(self, fid, late)
        held = me not in on_time and self.late.hold(fid, ours)  # in a later round's set, if it lands in time
        mine = [own.tensors] if on_time.get(me) is not own and not held else []
        return _applied(on_time, late, mine)

    def _put_ours(
        self,
        fid: FragmentId,
        data: bytes,
        shapes: list[torch.Size],
        g: _Gathered,
        ours: Ours,
    ) -> None:
        """Upload our fragment to our primary key, or, if that holds anything but a valid fragment of ours,
        to the key naming its hash, and note our slot in g: ours, or a valid fragment of ours already at
        the primary key (from before a restart). Nothing noted: the store did not answer (again at the
        next poll), or both keys held other bytes.

        A node writing through grants (protocol/net/grants.py) writes its primary key only, the one key of
        the round it was granted (nobody else can take it); without a grant for it, after asking for newer
        grants, the upload has failed: the round goes on without ours, and is not tried again."""
        me, signer = fid.replica, self.codec.signer
        primary = self._primary(fid, me, signer)
        by_hash = keys.fragment_key(fid.run_id, fid.stage, fid.fragment, fid.round, me, signer, ours[1])
        granted = self.store.write_once
        if granted and primary not in g.bad and not self.store.may_write(primary):
            log.warning(
                "run %s stage %d round %d fragment %d: no grant to write our fragment %s; the round goes on "
                "without it (is the coordinator issuing grants? see its log)",
                fid.run_id,
                fid.stage,
                fid.round,
                fid.fragment,
                primary,
            )
            g.bad.add(primary)
        for key in (k for k in ((primary,) if granted else (primary, by_hash)) if k not in g.bad):
            state, stored = self.put_once(key, data)
            if state is None:
                return
            if state:
                g.valid[key], g.seen[key] = ours[0], ours[1]
                g.found[me] = (key, self.store.store_now())
                return
            g.seen[key] = keys.content_digest(stored) if stored else TOO_LARGE
            if key == by_hash:
                g.bad.add(key)
                return
            try:
                if not stored:
                    raise ObjectTooLarge("larger than any valid fragment")
                g.valid[key] = self.codec.decode(fid, stored, shapes, signer)
            except (ProtocolError, ObjectTooLarge) as e:
                self._reject(fid, me, key, e, g)
                continue
            g.found[me] = (key, self.store.store_now())
            return

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self.lock:
            self.stats.bytes_up += up
            self.stats.bytes_down += down


def _applied(on_time: dict[int, Contribution], late: Committed, mine: list[list[torch.Tensor]]) -> Exchanged:
    """What a settled round applies: each slot's on-time fragment with the late ones it commits, summed;
    and ours that no round uses (`mine`, and those whose late window closed) back to error feedback."""
    contribs = {
        r: _summed([c for _, c in late.late.get(r, [])] + ([on_time[r]] if r in on_time else []))
        for r in sorted(set(on_time) | set(late.late))
    }
    return Exchanged(
        {r: c.tensors for r, c in contribs.items()},
        mine + [c.tensors for _, c in late.restore],
        {r: [q for q, _ in v] for r, v in late.late.items()},
        tokens={r: c.tokens for r, c in contribs.items()},
        weights={r: c.weight for r, c in contribs.items()},
    )


def _summed(parts: list[Contribution]) -> Contribution:
    """One slot's fragments of one round's set (late ones oldest first, then its on-time one) as one
    contribution: summed in that order, the same bits on every replica; their tokens too, each part's kept."""
    if len(parts) == 1:
        return parts[0]
    acc = [t.detach().float().clone() for t in parts[0].tensors]
    for c in parts[1:]:
        for a, t in zip(acc, c.tensors, strict=True):
            a += t.float()
    return Contribution(
        acc, sum(c.tokens for c in parts), tuple(t for c in parts for t in c.parts or (c.tokens,))
    )

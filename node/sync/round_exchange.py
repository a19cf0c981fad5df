"""The round exchange: how one stage's replicas agree, through the object store, on the set of fragments a
round applies (DESIGN section 3). It puts our fragment, waits for the others' and returns the agreed set;
the outer loop (node/sync/outer_sync.py) keeps the schedule, the anchor and the apply.

    run(fid, encoding, shapes) -> Exchanged     # what every replica applies for (stage, fragment, round)

Fragment keys are write-once (conditional PUT, If-None-Match): every reader of a key sees the same bytes,
so an object cannot be swapped between two replicas' reads. If our key already holds other bytes
(a faulty writer got there first, or our own upload from before a restart), we treat our slot exactly
as every other replica does: use those bytes if they validate against this slot's signer, leave the
slot out if not. The consensus stays identical, and our unused contribution goes back to the codec
(SparseLoCo's error feedback sends it in a later round). A store that does not answer is retried
until the round's deadline.

Waiting for the other replicas GETs keys every reader can compute (the round record, each signer's
primary fragment key) with exponential backoff, and LISTs the round rarely (`RoundReader.listing`).
Whoever settles a round first writes its signed, write-once round record; every replica applies exactly
the set it lists (first writer wins: the rule issue 21 replaces).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from node.sync.exchange import Encoding, Exchanged, FragmentCodec, FragmentId, RoundAgreementError, SyncStats
from node.sync.round_reader import RoundReader
from protocol import keys
from protocol.envelope import seal
from protocol.messages import RecordEntry, RoundRecord
from protocol.net.store import ObjectStore, ObjectTooLarge, StoreError
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)


TOO_LARGE = "too large"
"""What `_Gathered.seen` notes for a key whose object was refused by its size (no digest was taken)."""


@dataclass
class _Gathered:
    """One replica's view of one round's fragments while it gathers them."""

    contribs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Replica -> decoded contribution."""
    used: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Replica -> (signer, sha256) of what contribs holds."""
    bad: set[str] = field(default_factory=set)
    """Keys that held no valid fragment of their slot: never read again."""
    seen: dict[str, str] = field(default_factory=dict)
    """Key -> sha256 of the bytes it held when read (or TOO_LARGE); keys are written once, so it stays so."""


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


class RoundExchange:
    """One stage's round agreement over the store, for one replica (`run` on the outer loop's I/O thread):
    the store all-to-all of node/sync/exchange.py's `Exchange`. Its `reader` knows who may sign each
    replica's slot and reads the round's listing and record; bytes, rejections and misses are counted
    in the outer loop's `stats` (under `lock`)."""

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
    ) -> None:
        self.store, self.codec, self.replica = store, codec, replica
        self.reader = RoundReader(
            store,
            replica=replica,
            signer=codec.signer,
            stage_peers=stage_peers,
            former_stage_peers=former_stage_peers,
            stats=stats,
            lock=lock,
        )
        self.timeout_s, self.poll_s, self.poll_max_s = timeout_s, poll_s, poll_max_s
        self.stats, self._lock = stats, lock

    def put_once(self, key: str, data: bytes) -> tuple[bool | None, bytes | None]:
        """Write-once PUT of our fragment: (True, None) if the key holds our bytes, (False, what it holds)
        if it holds other bytes, (None, None) if the store did not answer (try again later)."""
        try:
            if self.store.put_if_absent(key, data) is not None:
                self._count(up=len(data))
                return True, None
        except StoreError as e:
            log.debug("upload of %s failed (retrying until the round's deadline): %s", key, e)
        try:  # refused, or a PUT whose reply was lost: what does the key hold now?
            stored = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except ObjectTooLarge as e:  # somebody else's oversized object: no valid fragment of ours
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

    def _primary(self, fid: FragmentId, r: int, signer: str) -> str:
        return keys.primary_fragment_key(fid.run_id, fid.stage, fid.fragment, fid.round, r, signer)

    def _get_fragment(self, key: str, g: _Gathered) -> bytes | None:
        """The bytes at `key`, refused (ObjectTooLarge) when larger than any valid fragment; None if absent
        or the store did not answer (asked again at the next poll). Notes in g.seen what the key holds."""
        try:
            blob = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except ObjectTooLarge:
            g.seen[key] = TOO_LARGE
            raise
        except StoreError as e:  # transient (503, reset, timeout)
            log.debug("fetch of %s failed (retrying until the round's deadline): %s", key, e)
            return None
        if blob is not None:
            self._count(down=len(blob))
            g.seen[key] = keys.content_digest(blob)
        return blob

    def _reject(self, fid: FragmentId, r: int, key: str, why: Exception, g: _Gathered) -> None:
        g.bad.add(key)
        with self._lock:
            self.stats.rejected += 1
        log.warning("rejected an object under replica %d's slot of %s (%s): %s", r, fid, key, why)

    def _settle(
        self, fid: FragmentId, used: dict[int, tuple[str, str]], seen_bad: set[bytes]
    ) -> RoundRecord | None:
        """Write our view as the round's record (first writer wins) or adopt the one written first.
        None: no valid record could be had before a second deadline (the key squatted, or the store
        silent); the caller applies its own view."""
        ours = RoundRecord(
            run_id=fid.run_id,
            stage=fid.stage,
            fragment=fid.fragment,
            round=fid.round,
            entries=[RecordEntry(replica=r, signer=sg, digest=d) for r, (sg, d) in sorted(used.items())],
        )
        key = keys.round_record_key(fid.run_id, fid.stage, fid.fragment, fid.round)
        blob = seal(self.codec.identity, ours)
        deadline = time.monotonic() + self.timeout_s
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        while True:
            try:
                if self.store.put_if_absent(key, blob) is not None:
                    with self._lock:
                        self.stats.bytes_records += len(blob)
                    return ours
            except StoreError as e:
                log.debug("writing the round record %s failed (retrying): %s", key, e)
            rec, present = self.reader.record(fid, seen_bad)
            if rec is not None:
                return rec
            if time.monotonic() > deadline or present:
                if present:  # squatted: nobody can write a valid record there
                    log.warning(
                        "round %d fragment %d: no valid round record can be written; applying this "
                        "replica's own view (replicas may differ for this round)",
                        fid.round,
                        fid.fragment,
                    )
                return None
            backoff.wait(deadline)

    def _follow(
        self, fid: FragmentId, rec: RoundRecord, g: _Gathered, shapes: list[torch.Size]
    ) -> dict[int, list[torch.Tensor]]:
        """Exactly the record's set: what we hold already, the rest fetched where its signer put it (the
        signer's primary key if it holds the listed bytes, else the key naming their hash). An entry
        whose bytes are not a valid fragment is left out by every replica alike (all read the same
        bytes); one the store will not give us before a second deadline fails the round."""
        final: dict[int, list[torch.Tensor]] = {}
        deadline = time.monotonic() + self.timeout_s
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        for e in rec.entries:
            if g.used.get(e.replica) == (e.signer, e.digest):
                final[e.replica] = g.contribs[e.replica]
                continue
            other = FragmentId(fid.run_id, fid.stage, fid.fragment, fid.round, e.replica)
            where = [
                self._primary(fid, e.replica, e.signer),
                keys.fragment_key(
                    fid.run_id, fid.stage, fid.fragment, fid.round, e.replica, e.signer, e.digest
                ),
            ]
            try:
                while (blob := self._read_listed(where, e.digest, g)) is None:
                    if time.monotonic() > deadline:
                        raise RoundAgreementError(
                            f"round {fid.round} fragment {fid.fragment}: the agreed record lists replica "
                            f"{e.replica}'s fragment {e.digest}, which the store did not give us (at {where[0]} "
                            f"or {where[1]}) within {self.timeout_s:.0f} s; this replica cannot apply the agreed set"
                        )
                    backoff.wait(deadline)
                final[e.replica] = self.codec.decode(other, blob, shapes, e.signer)
            except ProtocolError as err:
                log.warning(
                    "round %d: the record lists an invalid fragment of replica %d: %s",
                    fid.round,
                    e.replica,
                    err,
                )
        return final

    def _read_listed(self, where: list[str], digest: str, g: _Gathered) -> bytes | None:
        """The bytes of sha256 `digest` from the first key of `where` that holds them; None if none does yet.
        Raises ProtocolError where none can: each key held other bytes when read (keys are written once, so
        they are not asked again), or those very bytes were rejected here."""
        todo = [k for k in where if g.seen.get(k, digest) == digest]
        if not todo or any(k in g.bad for k in todo):
            raise ProtocolError("no key of its signer holds those bytes as a valid fragment")
        for key in todo:
            try:
                blob = self._get_fragment(key, g)
            except ObjectTooLarge:
                continue
            if blob is not None and g.seen[key] == digest:
                return blob
        return None

    def run(self, fid: FragmentId, encoding: Encoding, shapes: list[torch.Size]) -> Exchanged:
        """I/O thread: finish encoding ours, upload it, gather the other replicas' fragments until all
        arrived or the deadline, then agree on the round's set through its write-once round record.

        A slot is settled only by a valid fragment signed by a signer of the replica's slot, found at
        that signer's primary key or at a key that names the signer and the fragment's hash. Anything
        else under the round (a squatter's object, a truncated or forged one, one signed by a stranger) is
        counted as rejected and never read again, and the slot stays open until the deadline: planting
        garbage cannot empty a round. Our own slot is resolved like a peer's: if it already holds a valid
        fragment of ours (uploaded before a restart), every replica may have used that one, so we use it
        too and do not upload a second.

        Whoever settles first (every slot in, or its deadline) writes the set it holds as the round's
        record; every replica that finds a record applies exactly that set, fetching what it lacks, so
        replicas with different deadlines or a late, rebuilt one apply the same set."""
        data, own = encoding()
        me = fid.replica
        own_digest = keys.content_digest(data)
        g = _Gathered()
        bad_records: set[bytes] = set()
        started = time.monotonic()
        deadline = started + self.timeout_s
        expected = self.reader.slots()  # a replica that drops out while we wait still missed this round
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        listed = False
        rec: RoundRecord | None = None
        while True:
            rec, _ = self.reader.record(fid, bad_records)
            if rec is not None:
                break
            waiting = sorted(self.reader.slots() - set(g.contribs))
            squatted = any(
                self._primary(fid, r, sg) in g.bad
                for r in waiting
                if r != me
                for sg in self.reader.signers(r)
            )
            found = self.reader.listing(fid) if not listed or squatted else None
            listed = listed or found is not None
            arrived = False
            for r in waiting:
                if found is not None:
                    candidates = found.get(r, [])
                else:  # our slot is not polled: we put ours there
                    candidates = (
                        [] if r == me else [self._primary(fid, r, s) for s in sorted(self.reader.signers(r))]
                    )
                arrived |= self._take(fid, r, candidates, shapes, g, (own, own_digest))
                if r == me and me not in g.contribs:
                    self._put_ours(fid, data, (own, own_digest), shapes, g)
            if not self.reader.slots() - set(g.contribs) or time.monotonic() > deadline:
                rec = self._settle(fid, g.used, bad_records)
                break
            if arrived:
                backoff.reset()
            backoff.wait(deadline)
        contribs = g.contribs if rec is None else self._follow(fid, rec, g, shapes)
        ours_used = contribs.get(me) is own
        if not ours_used:
            with self._lock:
                self.stats.not_uploaded += 1
            own_key = keys.fragment_key(
                fid.run_id, fid.stage, fid.fragment, fid.round, me, self.codec.signer, own_digest
            )
            why_not_ours = (
                "the round's agreed record, written by the replica that settled it first, does not list it"
                if rec is not None and me not in contribs
                else "a valid fragment of this slot was already in the store (from before a restart)"
                if me in contribs
                else "our fragment's key already held other bytes"  # only someone who knew our bytes
                if own_key in g.bad
                else "the object store did not answer before the deadline"
            )
            log.warning(
                "our fragment %s was not used: %s; it stays in error feedback for a later round",
                fid,
                why_not_ours,
            )
        missing = (expected | self.reader.slots()) - set(contribs) - {me}
        if missing:
            with self._lock:
                self.stats.missing += len(missing)
            gone = missing - self.reader.slots()
            log.warning(
                "run %s stage %d round %d fragment %d: replicas %s did not arrive %s; aggregating %s",
                fid.run_id,
                fid.stage,
                fid.round,
                fid.fragment,
                sorted(missing),
                f"(dropped out after {time.monotonic() - started:.1f} s)"
                if gone == missing
                else f"within {self.timeout_s:.0f} s",
                sorted(contribs),
            )
        return Exchanged(contribs, None if ours_used else own)

    def _take(
        self,
        fid: FragmentId,
        r: int,
        candidates: list[str],
        shapes: list[torch.Size],
        g: _Gathered,
        ours: tuple[list[torch.Tensor], str],
    ) -> bool:
        """Settle slot r in g with the first of `candidates` that holds a valid fragment of it: its bytes
        verify against the signer the key names (a signer of the slot) and, at a key naming a hash, match
        that hash. Each invalid object met before is rejected, once. True if it settled the slot. In our
        slot, our own bytes (a PUT whose reply was lost, a replay) are `ours`, (contribution, sha256)."""
        other = FragmentId(fid.run_id, fid.stage, fid.fragment, fid.round, r)
        for key in (k for k in candidates if k not in g.bad):
            signer, name = key.rsplit("/", 2)[1:]
            try:
                if (blob := self._get_fragment(key, g)) is None:
                    continue
                if name != keys.PRIMARY_NAME and g.seen[key] != name:
                    raise ProtocolError(
                        "its bytes do not match the hash its key names (truncated or planted)"
                    )
                got = self.codec.decode(other, blob, shapes, signer)
            except (ProtocolError, ObjectTooLarge) as e:
                self._reject(fid, r, key, e, g)
                continue
            if r == fid.replica and (signer, g.seen[key]) == (self.codec.signer, ours[1]):
                got = ours[0]
            g.contribs[r], g.used[r] = got, (signer, g.seen[key])
            return True
        return False

    def _put_ours(
        self,
        fid: FragmentId,
        data: bytes,
        ours: tuple[list[torch.Tensor], str],
        shapes: list[torch.Size],
        g: _Gathered,
    ) -> None:
        """Upload our fragment to our primary key, or, if that holds anything but a valid fragment of ours,
        to the key naming its hash, and settle our slot in g with what the round can use: `ours`, or a
        valid fragment of ours already at the primary key (from before a restart). Nothing settled: the
        store did not answer (again at the next poll), or both keys held other bytes."""
        me, signer = fid.replica, self.codec.signer
        primary = self._primary(fid, me, signer)
        by_hash = keys.fragment_key(fid.run_id, fid.stage, fid.fragment, fid.round, me, signer, ours[1])
        for key in (k for k in (primary, by_hash) if k not in g.bad):
            state, stored = self.put_once(key, data)
            if state is None:
                return
            if state:
                g.contribs[me], g.used[me] = ours[0], (signer, ours[1])
                return
            g.seen[key] = keys.content_digest(stored) if stored else TOO_LARGE
            if key == by_hash:
                g.bad.add(key)
                return
            try:
                if not stored:
                    raise ObjectTooLarge("larger than any valid fragment")
                g.contribs[me] = self.codec.decode(fid, stored, shapes, signer)
            except (ProtocolError, ObjectTooLarge) as e:
                self._reject(fid, me, key, e, g)
                continue
            g.used[me] = (signer, g.seen[key])
            return

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.stats.bytes_up += up
            self.stats.bytes_down += down

"""What one stage's rounds hold in the store, as far as the signers of its slots vouch for it: who may sign
each replica's slot, the fragment keys a round lists per slot, and the round's agreed record.

The round exchange (node/sync/round_exchange.py) decides what to fetch, put and agree from these reads;
nothing here writes to the store.
"""

from __future__ import annotations

import logging
import threading

from node.sync.exchange import FragmentId, SyncStats
from protocol import keys
from protocol.envelope import open_envelope
from protocol.messages import RoundRecord
from protocol.net.store import ObjectStore, ObjectTooLarge, StoreError
from protocol.schema import ProtocolError

log = logging.getLogger("node.sync.round_exchange")  # the exchange's lines, under the one name they had

MAX_RECORD_BYTES = 1 << 20
"""A round record lists at most one entry (~130 bytes) per replica."""


class RoundReader:
    """One replica's reads of its stage's rounds. It knows who may sign each replica's slot (the node there
    now and the ones it replaced; ours is `signer`) and counts the invalid records it meets in `stats`
    (under `lock`)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        replica: int,
        signer: str,
        stage_peers: dict[int, str],
        former_stage_peers: dict[int, set[str]] | None,
        stats: SyncStats,
        lock: threading.Lock,
    ) -> None:
        self.store, self.replica, self.signer = store, replica, signer
        self.stage_peers = dict(stage_peers)
        self.former: dict[int, set[str]] = {r: set(v) for r, v in (former_stage_peers or {}).items()}
        self.stats, self._lock = stats, lock

    def set_stage_peers(
        self, stage_peers: dict[int, str], former: dict[int, set[str]] | None = None
    ) -> set[str]:
        """The signers of this stage's slots changed (a replica was rebuilt with a new node, or dropped out
        and is no longer waited for): the old signer of a slot stays known for the rounds it signed
        (round records may list its fragments). Returns every signer now known for the stage."""
        known = {r: set(v) for r, v in self.former.items()}
        for r, old in self.stage_peers.items():
            if stage_peers.get(r) != old:
                known.setdefault(r, set()).add(old)
        for r, peers in (former or {}).items():
            known.setdefault(r, set()).update(peers)
        self.former = known
        self.stage_peers = dict(stage_peers)
        return {*stage_peers.values(), *(p for ps in known.values() for p in ps)}

    def signers(self, r: int) -> set[str]:
        """Every signer whose fragments count for replica r's slot: its node now and the ones it replaced."""
        now = self.signer if r == self.replica else self.stage_peers.get(r)
        return ({now} if now else set()) | self.former.get(r, set())

    def slots(self) -> set[int]:
        return set(self.stage_peers) | {self.replica}

    def listing(self, fid: FragmentId) -> dict[int, list[str]] | None:
        """Fragment keys of this round per replica, keeping only those named by a signer of the replica's
        slot (anything else under the round is not looked at), each signer's primary key first; None if
        the LIST was not answered.

        R2 bills a LIST as a class A operation (12.5x a GET), so the exchange polls the primary keys with
        GETs and lists the round only where no GET can name what is there: once when it starts (what our
        slot holds before we upload; a fragment at a hash-named key from before we got here, written by a
        signer whose primary key was taken or, in a round a resumed run replays, by a build before
        primary keys), and while a missing slot's primary key holds something that is not its signer's
        fragment (the real one is then at a hash-named key)."""
        prefix = keys.sync_prefix(fid.run_id, fid.stage, fid.fragment, fid.round)
        try:
            listed = self.store.list(prefix)
        except StoreError as e:
            log.warning("listing %s failed (polling the primary keys meanwhile): %s", prefix, e)
            return None
        found: dict[int, list[tuple[str, bool, str]]] = {}
        for key in listed:
            parsed = keys.parse_sync_key(prefix, key)
            if parsed is not None and parsed[1] in self.signers(parsed[0]):
                found.setdefault(parsed[0], []).append((parsed[1], parsed[2] is not None, key))
        return {r: [key for *_, key in sorted(ks)] for r, ks in found.items()}

    def record(self, fid: FragmentId, seen_bad: set[bytes]) -> tuple[RoundRecord | None, bool]:
        """(the round's agreed record if one is there and valid, whether any object is at its key).
        A record counts when a signer of this stage's slots signed it for exactly this round and every
        entry names a signer of its slot; an invalid one is logged once (`seen_bad`: the bytes already
        rejected) and read as absent."""
        key = keys.round_record_key(fid.run_id, fid.stage, fid.fragment, fid.round)
        try:
            blob = self.store.get(key, max_bytes=MAX_RECORD_BYTES)
        except ObjectTooLarge as e:
            self._reject_record(fid, str(e), seen_bad, b"too large")
            return None, True
        except StoreError as e:
            log.debug("reading %s failed (retrying): %s", key, e)
            return None, False
        if blob is None:
            return None, False
        try:
            signed = open_envelope(blob, RoundRecord)
            rec = signed.body
            if not any(signed.signer_id in self.signers(r) for r in self.slots()):
                raise ProtocolError(f"signed by {signed.signer_id}, not a node of this stage")
            if (rec.run_id, rec.stage, rec.fragment, rec.round) != (
                fid.run_id,
                fid.stage,
                fid.fragment,
                fid.round,
            ):
                raise ProtocolError("it is the record of another round")
            for entry in rec.entries:
                if entry.signer not in self.signers(entry.replica):
                    raise ProtocolError(
                        f"it lists a fragment of replica {entry.replica} signed by {entry.signer}"
                    )
        except (ProtocolError, ValueError) as e:  # ValueError: a bad signature
            self._reject_record(fid, str(e), seen_bad, blob)
            return None, True
        return rec, True

    def _reject_record(self, fid: FragmentId, why: str, seen_bad: set[bytes], blob: bytes) -> None:
        if blob not in seen_bad:
            seen_bad.add(blob)
            with self._lock:
                self.stats.rejected += 1
            log.warning(
                "round %d fragment %d: the object at the round record's key is not valid: %s",
                fid.round,
                fid.fragment,
                why,
            )


__all__ = ["MAX_RECORD_BYTES", "RoundReader"]

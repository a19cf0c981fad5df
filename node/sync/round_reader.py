"""What one stage's rounds hold in the store, as far as the signers of its slots vouch for it: who may sign
each replica's slot, and the fragment keys a round lists per slot with their store timestamps.

The round exchange (node/sync/round_exchange.py) decides what to fetch, put and agree from these reads;
nothing here writes to the store.
"""

from __future__ import annotations

import logging

from node.sync.exchange import FragmentId
from protocol import keys
from protocol.net.store import ObjectStore, StoreError

log = logging.getLogger("node.sync.round_exchange")  # the exchange's lines, under the one name they had

MAX_CANDIDATES = 4
"""Keys of one signer a reader tries for one slot of one round (its primary key and hash-named ones)."""


class RoundReader:
    """One replica's reads of its stage's rounds. It knows who may sign each replica's slot (the node there
    now and the ones it replaced; ours is `signer`)."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        replica: int,
        signer: str,
        stage_peers: dict[int, str],
        former_stage_peers: dict[int, set[str]] | None,
        max_bytes: int,
    ) -> None:
        self.store, self.replica, self.signer, self.max_bytes = store, replica, signer, max_bytes
        self.stage_peers = dict(stage_peers)
        self.former: dict[int, set[str]] = {r: set(v) for r, v in (former_stage_peers or {}).items()}

    def set_stage_peers(
        self, stage_peers: dict[int, str], former: dict[int, set[str]] | None = None
    ) -> set[str]:
        """The signers of this stage's slots changed (a replica was rebuilt with a new node, or dropped out
        and is no longer waited for): the old signer of a slot stays known for the rounds it signed
        (a round may hold its fragments). Returns every signer now known for the stage."""
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

    def counts_for(self, signer: str, r: int) -> bool:
        """Whether `signer`'s fragments count for slot r: a signer of the slot that holds no other slot of
        this stage now (a node moved to another slot cannot also fill the one it left)."""
        if signer not in self.signers(r):
            return False
        holds = {self.replica: self.signer, **self.stage_peers}
        return all(q == r for q, s in holds.items() if s == signer)

    def listing(self, fid: FragmentId) -> tuple[dict[int, dict[str, list[tuple[int, str]]]], int] | None:
        """The round's candidate fragments, slot -> signer -> [(LastModified, key)], and the store's clock
        when it answered; None if the LIST was not answered. A signer's list is its primary key first, then
        its hash-named keys in (t, key) order, at most MAX_CANDIDATES: what one signer plants costs a reader
        that many GETs, and cannot crowd another signer out. Listed only: keys a signer that counts for the
        slot names (`counts_for`), single-part objects (S3 dates a multipart object when its upload was
        created: a signer could backdate it past the deadline) of at most `max_bytes`, in the STANDARD
        storage class (an archived object is listed but cannot be read). Anything else under the round is
        not looked at.

        R2 bills a LIST as a class A operation (12.5x a GET), so the exchange polls the primary keys with
        GETs and lists the round only to decide it (node/sync/round_rule.py), and while a missing slot's
        primary key holds something that is not its signer's fragment (the real one is then at a
        hash-named key)."""
        prefix = keys.sync_prefix(fid.run_id, fid.stage, fid.fragment, fid.round)
        try:
            listed = self.store.list_stamped(prefix)
        except StoreError as e:
            log.warning("listing %s failed (polling the primary keys meanwhile): %s", prefix, e)
            return None
        found: dict[int, dict[str, list[tuple[bool, int, str]]]] = {}
        for key, o in listed.objects.items():
            parsed = keys.parse_sync_key(prefix, key)
            if parsed is None or not self.counts_for(parsed[1], parsed[0]):
                continue
            if "-" in o.etag or o.size > self.max_bytes or o.storage_class not in ("STANDARD", ""):
                log.debug("not a candidate fragment (multipart, too large or archived): %s", key)
                continue
            found.setdefault(parsed[0], {}).setdefault(parsed[1], []).append(
                (parsed[2] is not None, o.t, key)
            )
        return {
            r: {sg: [(t, key) for _, t, key in sorted(ks)[:MAX_CANDIDATES]] for sg, ks in by.items()}
            for r, by in found.items()
        }, listed.now_s


__all__ = ["MAX_CANDIDATES", "RoundReader"]

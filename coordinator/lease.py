"""A run's coordinator lease: linearizable through the store's conditional writes (DESIGN section 5).

Acquire: PUT If-None-Match:* when no lease exists, or PUT If-Match:<etag> over an expired, untrusted or
garbage one, always at a term above every term known (fencing: terms strictly increase). Renew: PUT
If-Match:<etag> of our own lease. Losing either race returns None: another coordinator won. Every message
the holder signs carries the term, and nodes ignore lower terms.

A lease counts when the operator signed it or a coordinator it certified for the run did (the lease carries
the holder's certificate; protocol/delegation.py): two different certified keys of one operator take the
lease over from each other, and the terms still strictly increase.

Beside the lease, the run's two other objects in the store that coordinate its coordinators and its
operator: the run record ({run}/spec, `launch`, `stored_record`) and the stop request ({run}/control,
`request_stop`). Light imports only: `crucible-coordinator launch` and `stop` use them without torch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol import keys
from protocol.delegation import OperatorTrust
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Lease, RunControl, RunRecord
from protocol.net.store import ObjectStore, ObjectTooLarge
from protocol.schema import ProtocolError

if TYPE_CHECKING:  # hivemind: only `launch` is handed a DHT client
    from protocol.net.dht_client import DHTClient

log = logging.getLogger(__name__)


MAX_LEASE_S = 600.0
"""A lease claiming to run longer than this past now is not believed (treated as expired): leases are
renewed every few seconds, so only a forged or broken one reaches that far (a year-30,000 expiry)."""
MAX_LEASE_BYTES = 64 * 1024


@dataclass
class HeldLease:
    lease: Lease
    etag: str


def _highest_term(store: ObjectStore, run_id: str) -> int:
    """The highest term ever claimed ({run}/terms/{term}, write-once) or published under
    ({run}/assign/{term}-{epoch}): a new term must exceed it even when the lease object itself was lost
    or overwritten with garbage."""
    terms = [0]
    for prefix in (keys.terms_prefix(run_id), keys.assign_prefix(run_id)):
        for key in store.list(prefix):
            head = key.rsplit("/", 1)[-1].split("-", 1)[0]
            if head.isdigit():
                terms.append(int(head))
    return max(terms)


def _valid_lease(data: bytes, run_id: str, trust: OperatorTrust, now: float) -> Lease | None:
    """The lease in `data` if it is a lease of this run signed by a trusted coordinator and believable."""
    try:
        lease = trust.open(data, Lease, now).body
    except (ProtocolError, ValueError) as e:  # garbage, a stranger's signature, a broken envelope
        log.warning("run %s: the lease object is not a trusted coordinator's lease (%s)", run_id, e)
        return None
    if lease.run_id != run_id or not math.isfinite(lease.expires_at) or lease.term < 1:
        log.warning(
            "run %s: the lease object names run %r, term %d, expiry %r",
            run_id,
            lease.run_id,
            lease.term,
            lease.expires_at,
        )
        return None
    if lease.expires_at > now + MAX_LEASE_S:
        log.warning(
            "run %s: the lease claims to run until %.0f, over %.0f s ahead: not believed",
            run_id,
            lease.expires_at,
            MAX_LEASE_S,
        )
        return Lease(run_id=run_id, term=lease.term, holder=lease.holder, expires_at=0.0)
    return lease


def try_acquire(
    store: ObjectStore,
    identity: Identity,
    run_id: str,
    duration_s: float,
    now: float | None = None,
    trusted: OperatorTrust | set[bytes] | None = None,
    certificate: bytes = b"",
) -> HeldLease | None:
    """Take the run's lease if nobody holds a live one; None if one is live or another won the race.

    Terms strictly increase: every acquisition takes term = (highest term known) + 1, where the known
    terms are the current lease's (if it is a trusted, believable lease) and those of published
    assignments; so a second process with our key cannot share our term, a takeover after a crash is a
    new term, and a garbage or forged lease object cannot reset the term. A live lease is respected
    whoever holds it, ourselves included: only `renew`, with the ETag we hold, extends a lease.
    trusted: whose leases count: the operator's trust rule, or public keys (default: our own, i.e.
    coordinators signing with the operator's key). certificate: ours, carried in the lease we sign (empty
    when `identity` is the operator's key). now: the clock (tests inject skew)."""
    now = time.time() if now is None else now
    trust = OperatorTrust.of({identity.public_key} if trusted is None else trusted)
    key = keys.lease_key(run_id)
    try:
        found = store.get_with_etag(key, max_bytes=MAX_LEASE_BYTES)
    except ObjectTooLarge as e:
        log.warning("run %s: %s", run_id, e)
        info = store.head(key)  # an oversized object: overwrite it without reading it
        etag_only = None if info is None else info.etag
        found = None if etag_only is None else (b"", etag_only)
    floor = _highest_term(store, run_id)
    if found is None:
        term = floor + 1
    else:
        current = _valid_lease(found[0], run_id, trust, now)
        if current is not None and current.expires_at > now:
            return None
        term = max(floor, current.term if current else 0) + 1
    if store.put_if_absent(keys.term_key(run_id, term), identity.peer_id.encode()) is None:
        return None  # another coordinator claimed this term first: it won the race
    lease = Lease(
        run_id=run_id,
        term=term,
        holder=identity.peer_id,
        expires_at=now + duration_s,
        certificate=certificate,
    )
    blob = seal(identity, lease)
    etag = store.put_if_absent(key, blob) if found is None else store.put_if_match(key, blob, found[1])
    return HeldLease(lease, etag) if etag else None


def renew(
    store: ObjectStore, identity: Identity, held: HeldLease, duration_s: float, now: float | None = None
) -> HeldLease | None:
    """Extend our lease (with the certificate it was taken with); None if it was taken over (deposed)."""
    now = time.time() if now is None else now
    lease = Lease(
        run_id=held.lease.run_id,
        term=held.lease.term,
        holder=identity.peer_id,
        expires_at=now + duration_s,
        certificate=held.lease.certificate,
    )
    etag = store.put_if_match(keys.lease_key(held.lease.run_id), seal(identity, lease), held.etag)
    return HeldLease(lease, etag) if etag else None


# --- the run's record and stop request ------------------------------------------------------------
def launch(
    dht: DHTClient, store: ObjectStore, identity: Identity, record: RunRecord, ttl_s: float = 60.0
) -> None:
    """Publish a pending run for the coordinators (signed by the operator), in the store and the DHT. A
    stop request left from an earlier launch of the run is removed first: it would stop this one at once."""
    store.ensure_bucket()
    store.delete(keys.control_key(record.spec.run_id))
    store.put(keys.spec_key(record.spec.run_id), seal(identity, record))
    dht.publish(keys.RUNS_KEY, record, ttl_s, signer=identity, name=record.spec.run_id)


def stored_record(store: ObjectStore, run_id: str, trust: OperatorTrust) -> RunRecord | None:
    """The run's record in the store ({run}/spec: written by `launch`, then by its coordinators at each
    placement and state change), if the operator or a coordinator it certified signed it (checked as of
    when it was signed: a finished run's coordinator certificates may have expired since); None if there
    is none. Raises ValueError when the object is unreadable or signed by someone else."""
    blob = store.get(keys.spec_key(run_id), max_bytes=1 << 20)
    if blob is None:
        return None
    try:
        signed = open_envelope(blob, RunRecord)
        rec = trust.admit(signed, signed.body.updated).body
    except (ProtocolError, ValueError) as e:
        raise ValueError(
            f"the store's record of run {run_id!r} ({keys.spec_key(run_id)}) is refused: {e}"
        ) from e
    if rec.spec.run_id != run_id:
        raise ValueError(f"the store's record at {keys.spec_key(run_id)} names run {rec.spec.run_id!r}")
    return rec


def request_stop(store: ObjectStore, identity: Identity, run_id: str) -> None:
    """Ask the run's coordinator to stop it (signed: `Coordinator._check_control` ignores anyone else's)."""
    store.put(
        keys.control_key(run_id),
        seal(identity, RunControl(run_id=run_id, action="stop", issued_at=time.time())),
    )

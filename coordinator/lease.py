"""A run's coordinator lease: linearizable through the store's conditional writes (DESIGN section 5).

Acquire: PUT If-None-Match:* when no lease exists, or PUT If-Match:<etag> over an expired one (term + 1).
Renew: PUT If-Match:<etag> of our own lease. Losing either race returns None: another coordinator won.
Every message the holder signs carries the term, and nodes ignore lower terms.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from protocol import keys
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Lease
from protocol.schema import ProtocolError
from protocol.store import ObjectStore

log = logging.getLogger(__name__)


@dataclass
class HeldLease:
    lease: Lease
    etag: str


def try_acquire(
    store: ObjectStore, identity: Identity, run_id: str, duration_s: float, now: float | None = None
) -> HeldLease | None:
    """Take (or keep) the run's lease; None if another live coordinator holds it or won the race."""
    now = time.time() if now is None else now
    key = keys.lease_key(run_id)
    found = store.get_with_etag(key)
    if found is None:
        lease = Lease(run_id=run_id, term=1, holder=identity.peer_id, expires_at=now + duration_s)
        etag = store.put_if_absent(key, seal(identity, lease))
        return HeldLease(lease, etag) if etag else None
    data, etag = found
    try:
        current = open_envelope(data, Lease).body
    except ProtocolError as e:
        log.warning("run %s: lease object is corrupt (%s); taking it over", run_id, e)
        current = Lease(run_id=run_id, term=0, holder="", expires_at=0.0)
    if current.holder != identity.peer_id and current.expires_at > now:
        return None
    term = current.term if current.holder == identity.peer_id else current.term + 1
    lease = Lease(run_id=run_id, term=term, holder=identity.peer_id, expires_at=now + duration_s)
    new_etag = store.put_if_match(key, seal(identity, lease), etag)
    return HeldLease(lease, new_etag) if new_etag else None


def renew(
    store: ObjectStore, identity: Identity, held: HeldLease, duration_s: float, now: float | None = None
) -> HeldLease | None:
    """Extend our lease; None if it was taken over (we have been deposed)."""
    now = time.time() if now is None else now
    lease = Lease(
        run_id=held.lease.run_id, term=held.lease.term, holder=identity.peer_id, expires_at=now + duration_s
    )
    etag = store.put_if_match(keys.lease_key(held.lease.run_id), seal(identity, lease), held.etag)
    return HeldLease(lease, etag) if etag else None

"""A run's coordinator lease: linearizable through the store's conditional writes (DESIGN section 5).

Acquire: PUT If-None-Match:* when no lease exists, or PUT If-Match:<etag> over an expired, untrusted or
garbage one, always at a term above every term known (fencing: terms strictly increase). Renew: PUT
If-Match:<etag> of our own lease. Losing either race returns None: another coordinator won. Every message
the holder signs carries the term, and nodes ignore lower terms.

A lease counts when the operator signed it or a coordinator it certified for the run did (the lease carries
the holder's certificate; protocol/trust/delegation.py): two different certified keys of one operator take the
lease over from each other, and the terms still strictly increase.

Anyone with the store's credentials may write any key, so the terms a new term must exceed count only when
a trusted coordinator signed them (`highest_term`): a term claim `{run}/terms/{term:06d}` is a sealed
`TermClaim` of that run and term (its certificate checked as of the claim; `open_claim` in
protocol/trust/run_authority.py, the nodes' reading too), an archive
`{run}/assign/{term:06d}-{epoch:06d}` holds assignments of that run and term (checked as of their issue);
both under a canonical name, in 1..MAX_TERM and within MAX_TERM_STEP of the highest term counted below
them. Anything else there is ignored and counted, and a junk object at the key of the term to claim is
replaced (If-Match), so no object a store writer can put stops a failover.

Beside the lease, the run's other objects in the store that coordinate its coordinators and its operator:
the run record ({run}/spec, `launch`, `stored_record`), the launch itself ({run}/launch, written only by
`launch`: nodes take a run only when the operator signed it, protocol/trust/run_authority.py) and the stop
request ({run}/control, `request_stop`). Light imports only: `crucible-coordinator launch` and `stop` use
them without torch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol import keys
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Lease, RunControl, RunRecord, TermClaim
from protocol.net.store import ObjectStore, ObjectTooLarge
from protocol.schema import ProtocolError, describe
from protocol.trust.assignment_archive import MAX_ARCHIVE_BYTES, decode_archive
from protocol.trust.delegation import OperatorTrust, RefusalLog, Untrusted
from protocol.trust.run_authority import MAX_CLAIM_BYTES, MAX_LEASE_BYTES, claim_refusal

if TYPE_CHECKING:  # hivemind: only `launch` is handed a DHT client
    from protocol.net.dht_client import DHTClient

log = logging.getLogger(__name__)


MAX_LEASE_S = 600.0
"""A lease claiming to run longer than this past now is not believed (treated as expired): leases are
renewed every few seconds, so only a forged or broken one reaches that far (a year-30,000 expiry)."""
MAX_TERM = 2**53 - 1
"""The highest term that counts: terms reach the dashboard and /status as JSON numbers, exact to 2**53."""
MAX_TERM_STEP = 1024
"""A term counts only within this many terms above the highest term counted below it (the floor walks up
from 0). Honest terms rise by 1 per takeover, so only a forged or broken signer jumps further, and even a
trusted one would need 2**53 / 1024 (8.8e12) objects to use up the terms."""
MAX_ARCHIVES_CHECKED = 4
"""Archives of one term read to find one that counts (the newest epochs first)."""


@dataclass
class HeldLease:
    lease: Lease
    etag: str


def ignore(ignored: RefusalLog, run_id: str, key: str, reason: str, why: str) -> None:
    """Count a store object that does not count for the run (by reason) and log it once per key and reason."""
    first = ignored.first(key, reason)
    log.log(
        logging.WARNING if first else logging.DEBUG,
        "run %s: ignoring %s: %s",
        run_id,
        describe(key, 120),
        why,
    )


def _claim_counts(
    store: ObjectStore, run_id: str, key: str, term: int, trust: OperatorTrust, ignored: RefusalLog
) -> bool:
    try:
        blob = store.get(key, max_bytes=MAX_CLAIM_BYTES)
    except ObjectTooLarge as e:
        ignore(ignored, run_id, key, "term_claim_size", str(e))
        return False
    refusal = None if blob is None else claim_refusal(blob, run_id, term, trust)
    if refusal is not None:
        ignore(ignored, run_id, key, *refusal)
    return blob is not None and refusal is None


def _archive_counts(
    store: ObjectStore,
    run_id: str,
    term: int,
    found: list[tuple[int, str]],
    trust: OperatorTrust,
    ignored: RefusalLog,
) -> bool:
    """Whether one of the newest MAX_ARCHIVES_CHECKED archives of `term` holds an assignment of the run at
    that term signed by a trusted coordinator (as of its issue)."""
    for _, key in sorted(found, reverse=True)[:MAX_ARCHIVES_CHECKED]:
        try:
            blob = store.get(key, max_bytes=MAX_ARCHIVE_BYTES)
            assignments = [] if blob is None else decode_archive(blob, trust, as_issued=True)
        except ObjectTooLarge as e:
            ignore(ignored, run_id, key, "archive_size", str(e))
            continue
        except Untrusted as e:
            ignore(ignored, run_id, key, "archive_untrusted", str(e))
            continue
        except (ProtocolError, ValueError) as e:
            ignore(ignored, run_id, key, "archive_unsigned", f"not a signed assignment archive ({e})")
            continue
        if any(a.run_id == run_id and a.term == term for a in assignments):
            return True
        if blob is not None:
            ignore(
                ignored, run_id, key, "archive_mismatch", f"it holds no assignment of term {term} of the run"
            )
    return False


def highest_term(
    store: ObjectStore, run_id: str, trust: OperatorTrust, ignored: RefusalLog, *, lease_term: int = 0
) -> int:
    """The highest term that counts (module docstring): the current lease's (`lease_term`, a trusted
    lease's), a term claim's ({run}/terms/{term:06d}) or an archive's ({run}/assign/{term:06d}-{epoch:06d}):
    a new term must exceed it even when the lease object itself was lost or overwritten with garbage.

    Walking up from 0, the highest term within MAX_TERM_STEP of the floor that verifies becomes the floor,
    until none in reach does; so only objects in reach are read (one claim when all is well). Everything
    else under the two prefixes is ignored and counted in `ignored` by reason: a name these keys never
    have (non-canonical, non-numeric), a term above MAX_TERM or out of reach, an oversized, unsigned or
    wrongly signed body, one of another run or term."""
    claims: dict[int, str] = {}
    archives: dict[int, list[tuple[int, str]]] = {}
    for key in store.list(keys.terms_prefix(run_id)):
        term = keys.parse_term_key(run_id, key)
        if term is None:
            ignore(ignored, run_id, key, "term_claim_name", "not the name of a term claim")
        elif not 1 <= term <= MAX_TERM:
            ignore(ignored, run_id, key, "term_claim_range", f"term {term} is outside 1..{MAX_TERM}")
        else:
            claims[term] = key
    for key in store.list(keys.assign_prefix(run_id)):
        slot = keys.parse_assign_key(run_id, key)
        if slot is None:
            ignore(ignored, run_id, key, "archive_name", "not the name of an assignment archive")
        elif not (1 <= slot[0] <= MAX_TERM and slot[1] <= MAX_TERM):
            ignore(ignored, run_id, key, "archive_range", f"term or epoch {slot} is outside 1..{MAX_TERM}")
        else:
            archives.setdefault(slot[0], []).append((slot[1], key))
    known = set(claims) | set(archives) | ({lease_term} if 1 <= lease_term <= MAX_TERM else set())
    floor, refused = 0, set[int]()
    while reach := sorted((t for t in known - refused if floor < t <= floor + MAX_TERM_STEP), reverse=True):
        for term in reach:
            if (
                term == lease_term
                or (term in claims and _claim_counts(store, run_id, claims[term], term, trust, ignored))
                or (term in archives and _archive_counts(store, run_id, term, archives[term], trust, ignored))
            ):
                floor = term
                break
            refused.add(term)
        else:
            break
    for term in sorted(t for t in known - refused if t > floor):  # beyond reach of every term that counts
        why = f"term {term} is more than {MAX_TERM_STEP} above term {floor}, the highest that counts"
        for key in [claims[term]] if term in claims else []:
            ignore(ignored, run_id, key, "term_claim_range", why)
        for _, key in archives.get(term, []):
            ignore(ignored, run_id, key, "archive_range", why)
    return floor


def _put_claim(store: ObjectStore, run_id: str, term: int, blob: bytes, trust: OperatorTrust) -> bool:
    """Write our claim of `term` (write-once); False when another coordinator's claim is there: it won the
    race. An object at the key that is no claim (junk: `highest_term` ignored it) is replaced, If-Match its
    ETag, so that of two coordinators replacing it one wins."""
    key = keys.term_key(run_id, term)
    if store.put_if_absent(key, blob) is not None:
        return True
    try:
        found = store.get_with_etag(key, max_bytes=MAX_CLAIM_BYTES)
    except ObjectTooLarge:
        info = store.head(key)  # replaced unread
        found = None if info is None else (b"", info.etag)
    if found is None:  # deleted since
        return store.put_if_absent(key, blob) is not None
    if claim_refusal(found[0], run_id, term, trust) is None:
        return False
    return store.put_if_match(key, blob, found[1]) is not None


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
    ignored: RefusalLog | None = None,
) -> HeldLease | None:
    """Take the run's lease if nobody holds a live one; None if one is live or another won the race.

    Terms strictly increase: every acquisition takes term = (highest term that counts) + 1, where the
    terms that count are the current lease's (if it is a trusted, believable lease), those of trusted
    coordinators' term claims and those of their archived assignments (`highest_term`); so a second process with our key cannot share our term, a takeover after a crash is a
    new term, and a garbage or forged lease object cannot reset the term. A live lease is respected
    whoever holds it, ourselves included: only `renew`, with the ETag we hold, extends a lease.
    trusted: whose leases count: the operator's trust rule, or public keys (default: our own, i.e.
    coordinators signing with the operator's key). certificate: ours, carried in the lease we sign (empty
    when `identity` is the operator's key). now: the clock (tests inject skew). ignored: where the objects
    under {run}/terms/ and {run}/assign/ that do not count are counted (the coordinator's; default: none)."""
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
    current = None if found is None else _valid_lease(found[0], run_id, trust, now)
    if current is not None and current.expires_at > now:
        return None
    ignored = RefusalLog(log) if ignored is None else ignored
    term = highest_term(store, run_id, trust, ignored, lease_term=current.term if current else 0) + 1
    if term > MAX_TERM:
        log.error("run %s: no term is left below %d: the run cannot fail over", run_id, MAX_TERM)
        return None
    claim = TermClaim(
        run_id=run_id, term=term, holder=identity.peer_id, claimed_at=now, certificate=certificate
    )
    if not _put_claim(store, run_id, term, seal(identity, claim), trust):
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
    stop request left from an earlier launch of the run is removed first: it would stop this one at once.
    The launch itself stays at {run}/launch, which only this writes: nodes take the run's assignments only
    when the operator signed it (protocol/trust/run_authority.py); {run}/spec is rewritten by its coordinators."""
    store.ensure_bucket()
    store.delete(keys.control_key(record.spec.run_id))
    blob = seal(identity, record)
    store.put(keys.launch_key(record.spec.run_id), blob)
    store.put(keys.spec_key(record.spec.run_id), blob)
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

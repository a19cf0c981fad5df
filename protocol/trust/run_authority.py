"""Who directs a run's nodes: the run's launch and its lease, as the store holds them (issue 21).

A certificate (protocol/trust/delegation.py) lets a key sign for a run; it neither launches the run nor makes the
key its leader. With `a` an assignment of run `r` signed by `s`, a node acts on `a` only when

    launched(r)   {r}/launch holds a RunRecord of r signed by an operator key, or by a key the operator
                  certified for r alone (`OperatorTrust.admit_launch`)
    leads(s, a)   the store's lease {r}/lease is a trusted Lease of r signed by its holder, the holder is s
                  and its term is a.term (a higher one: s was deposed; a lower one: s never held a.term);
                  the claim {r}/terms/{a.term}, where it is a valid claim, is s's too;
                  and claimed_at - SKEW_S <= a.issued_at <= lease.expires_at + SKEW_S (issued while s held it)

Why the store and not the message: a certified key can sign any term and any date, and a lease or a term
claim of its own. What it cannot do through the store's conditional writes is take a live lease from its
holder (coordinator/lease.py: only `renew`, with the holder's ETag, extends it; a takeover waits for the
lease to expire and takes the next term). So the message's term and dates prove nothing alone; the term
must be the lease's and the dates must lie within it. A deposed leader's lower term, a certified
stranger's higher one, and an old term replayed with a backdated `issued_at` all meet a lease that names
another term or another holder. What stays trusted (docs/reliability.md, "Terms with proof"): the store's
conditional writes, i.e. the holders of its write credentials.

A record that ends the run (stopping, stopped, done, failed) counts for a node only when the operator or
the lease holder signed it (`check_holder`). The coordinator reads term claims the same way
(coordinator/lease.py): `open_claim` is the one definition of a valid claim.
"""

from __future__ import annotations

import time

from protocol import keys
from protocol.envelope import Signed, open_envelope
from protocol.messages import Assignment, Lease, RunRecord, TermClaim
from protocol.net.store import ObjectStore, ObjectTooLarge
from protocol.schema import ProtocolError, describe
from protocol.trust.delegation import SKEW_S, OperatorTrust, Untrusted, utc

MAX_LEASE_BYTES = 64 * 1024
MAX_CLAIM_BYTES = 16 * 1024
"""A term claim is about 1.4 KB with a certificate; a larger object there is junk, refused from its size."""
MAX_LAUNCH_BYTES = 1 << 20
"""A launch is a RunRecord with its spec: a few KB."""
MAX_LAUNCHED = 1024
"""Runs remembered as launched (then forgotten all at once, and read again)."""

NOT_LAUNCHED = "not launched"
NO_LEASE = "no lease"
DEPOSED = "deposed"
NOT_LEADER = "not the lease holder"
OUTSIDE_LEASE = "issued outside its lease"
REASONS = (NOT_LAUNCHED, NO_LEASE, DEPOSED, NOT_LEADER, OUTSIDE_LEASE)
"""Why an assignment a trusted key signed is not acted on, as `Untrusted.reason` names it (the launcher's
own refusals keep protocol/trust/delegation.py's reasons)."""


class NotAClaim(ValueError):
    """An object at a term claim's key that is no valid claim of that term; `reason` is a metrics label."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason, self.why = reason, why


def open_claim(blob: bytes, run_id: str, term: int, trust: OperatorTrust) -> Signed[TermClaim]:
    """The claim of `term` of `run_id` in `blob`, signed by a trusted coordinator (its certificate checked
    as of the claim: it may have expired since). Raises NotAClaim naming why not."""
    try:
        signed = open_envelope(blob, TermClaim, max_bytes=MAX_CLAIM_BYTES)
    except (ProtocolError, ValueError) as e:  # garbage, an unsigned body, a bad signature
        raise NotAClaim("term_claim_unsigned", f"not a signed term claim ({e})") from e
    claim = signed.body
    if claim.run_id != run_id or claim.term != term:
        raise NotAClaim("term_claim_mismatch", f"it claims term {claim.term} of run {describe(claim.run_id)}")
    try:
        trust.admit(signed, claim.claimed_at)
    except ValueError as e:
        raise NotAClaim("term_claim_untrusted", str(e)) from e
    return signed


def claim_refusal(blob: bytes, run_id: str, term: int, trust: OperatorTrust) -> tuple[str, str] | None:
    """Why `blob` is not a claim of `term` of `run_id` by a trusted coordinator, as (reason, detail); None
    when it is one."""
    try:
        open_claim(blob, run_id, term, trust)
    except NotAClaim as e:
        return e.reason, e.why
    return None


class RunAuthority:
    """The module's rule, read from `store` with `trust`: `check` one signed assignment. A run found
    launched is remembered (a launch is not taken back); every other reading is made again each time."""

    def __init__(self, store: ObjectStore, trust: OperatorTrust) -> None:
        self.store, self.trust = store, trust
        self._launched: set[str] = set()

    def check_launch(self, run_id: str, now: float | None = None) -> None:
        """Raise Untrusted unless the run's launch in the store is the operator's (module docstring).
        StoreError (the store did not answer) is raised as it is: nothing is decided."""
        if run_id in self._launched:
            return
        key = keys.launch_key(run_id)

        def refuse(why: str) -> Untrusted:
            why = f"run {run_id} was not launched by the operator: {why}"
            return Untrusted(NOT_LAUNCHED, why, why)

        try:
            blob = self.store.get(key, max_bytes=MAX_LAUNCH_BYTES)
        except ObjectTooLarge as e:
            raise refuse(f"{key} is no launch ({e})") from None
        if blob is None:
            raise refuse(
                f"there is no {key} in the store (the operator launches runs: crucible-coordinator launch)"
            )
        try:
            launch = self.trust.admit_launch(open_envelope(blob, RunRecord, max_bytes=MAX_LAUNCH_BYTES), now)
        except Untrusted as e:
            why = f"run {run_id} was not launched by the operator: {e}"
            raise Untrusted(e.reason, why, why) from None
        except (ProtocolError, ValueError) as e:  # garbage, an unsigned body, a bad signature
            raise refuse(f"{key} is not a signed launch ({e})") from None
        if launch.body.run_id != run_id:
            raise refuse(f"{key} launches run {describe(launch.body.run_id)}")
        if len(self._launched) >= MAX_LAUNCHED:
            self._launched.clear()
        self._launched.add(run_id)

    def lease(self, run_id: str, now: float) -> Lease:
        """The run's lease in the store if it is a trusted coordinator's, signed by the holder it names;
        raises Untrusted (NO_LEASE) otherwise."""
        key = keys.lease_key(run_id)

        def refuse(why: str) -> Untrusted:
            why = f"run {run_id} has no lease a trusted coordinator holds: {why}"
            return Untrusted(NO_LEASE, why, why)

        try:
            blob = self.store.get(key, max_bytes=MAX_LEASE_BYTES)
        except ObjectTooLarge as e:
            raise refuse(str(e)) from None
        if blob is None:
            raise refuse(f"there is no {key} in the store")
        try:
            signed = self.trust.open(blob, Lease, now, max_bytes=MAX_LEASE_BYTES)
        except (ProtocolError, ValueError) as e:  # garbage, a stranger's signature, a broken envelope
            raise refuse(f"{key} is refused ({e})") from None
        lease = signed.body
        if lease.run_id != run_id or lease.holder != signed.signer_id or lease.term < 1:
            raise refuse(
                f"{key} names run {describe(lease.run_id)}, term {lease.term} and holder "
                f"{describe(lease.holder, 60)}, and was signed by {signed.signer_id}"
            )
        return lease

    def check_holder(self, run_id: str, signer: str, now: float | None = None) -> None:
        """Raise Untrusted (NO_LEASE, NOT_LEADER) unless the key `signer` (a peer id) holds the run's lease
        now, whatever its term: who may end the run (its records' states) besides the operator."""
        lease = self.lease(run_id, time.time() if now is None else now)
        if lease.holder != signer:
            why = (
                f"{signer} does not hold the run's lease: it is at term {lease.term}, held by {lease.holder}"
            )
            raise Untrusted(NOT_LEADER, why, why)

    def claim(self, run_id: str, term: int) -> Signed[TermClaim] | None:
        """The valid claim of `term` in the store, or None: a missing or junk object there decides nothing
        (the lease does; a store writer who deletes a claim must not stop the run)."""
        try:
            blob = self.store.get(keys.term_key(run_id, term), max_bytes=MAX_CLAIM_BYTES)
            return None if blob is None else open_claim(blob, run_id, term, self.trust)
        except (ObjectTooLarge, NotAClaim):
            return None

    def check(self, signed: Signed[Assignment], now: float | None = None) -> None:
        """Raise Untrusted, naming the reason, unless `signed` (admitted by `trust` already) is an
        assignment of a launched run by the holder of its term's lease, issued within that lease (module
        docstring). StoreError is raised as it is: nothing is decided."""
        now = time.time() if now is None else now
        a, s = signed.body, signed.signer_id
        what = f"Assignment of run {a.run_id} term {a.term} epoch {a.epoch} signed by {s}"

        def refuse(reason: str, why: str) -> Untrusted:
            return Untrusted(reason, f"{what}: {why}", why)

        try:
            self.check_launch(a.run_id, now)
            lease = self.lease(a.run_id, now)
        except Untrusted as e:
            raise refuse(e.reason, str(e)) from None
        held = f"the run's lease is at term {lease.term}, held by {lease.holder}"
        if lease.term > a.term:
            raise refuse(DEPOSED, f"term {a.term} is over: {held}")
        if lease.term < a.term or lease.holder != s:
            raise refuse(NOT_LEADER, f"{s} does not hold the lease of term {a.term}: {held}")
        if a.issued_at > lease.expires_at + SKEW_S:
            raise refuse(
                OUTSIDE_LEASE,
                f"it is dated {utc(a.issued_at)}, after the lease of term {a.term} ran out at {utc(lease.expires_at)}",
            )
        claim = self.claim(a.run_id, a.term)
        if claim is not None and claim.signer_id != s:
            raise refuse(NOT_LEADER, f"term {a.term} was claimed by {claim.signer_id}, not by {s}")
        if claim is not None and a.issued_at < claim.body.claimed_at - SKEW_S:
            raise refuse(
                OUTSIDE_LEASE,
                f"it is dated {utc(a.issued_at)}, before term {a.term} was claimed at {utc(claim.body.claimed_at)}",
            )


__all__ = [
    "MAX_CLAIM_BYTES",
    "MAX_LEASE_BYTES",
    "REASONS",
    "NotAClaim",
    "RunAuthority",
    "claim_refusal",
    "open_claim",
]

"""Trust by delegation: the operator's key certifies coordinator keys, so it never sits on a coordinator host.

A certificate is a `Delegation` (subject peer id, role, run scope, validity window) sealed by the operator's
key (protocol/envelope.py). A coordinator carries its certificate in everything it signs (the `certificate`
field of Assignment, RunRecord, Lease and RunControl), so every signed object is checked on its own, offline,
by anyone who knows the operator's peer id. With O the operator keys, an object of run `run` signed by key
`s` carrying certificate `c` is trusted at time `now` iff

    s in O                                                        (the operator signed it itself)
    or  c opens as a Delegation d sealed by a key in O,
        d.subject = peer_id(s),  d.role = "coordinator",  d.run in {run, "*"},
        d.issued_at - SKEW_S <= now < d.expires_at

A run's launch is held to one more condition (`admit_launch`): a certificate must be for that run alone,
d.run = run; a coordinator certified for "*" leads the runs the operator launched, it launches none.

Every reader applies this one rule (`OperatorTrust`): nodes (assignments, run records), coordinators (run
records, leases, the assignment archive, control objects), `status` and `launch --watch`. A refusal is an
`Untrusted` error whose `reason` is one of REASONS; readers log each (signer, reason) once (`RefusalLog`).
Checkpoints and fragments are signed by node keys and checked against assignments, not against this rule.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol, TypeVar

from protocol.envelope import MAX_ENVELOPE_BYTES, Signed, open_envelope, seal
from protocol.identity import Identity, SignatureError, peer_id_of, public_key_of_peer_id
from protocol.messages import ANY_RUN, Delegation
from protocol.schema import ProtocolError, UntrustedSigner, describe

ROLE_COORDINATOR = "coordinator"
SKEW_S = 300.0
"""Clock skew allowed before a certificate's issued_at (the operator's laptop may run a few minutes ahead)."""

UNCERTIFIED = "uncertified"
FORGED = "forged certificate"
NOT_OPERATOR = "certificate not signed by the operator"
OTHER_KEY = "certificate for another key"
WRONG_ROLE = "wrong role"
WRONG_SCOPE = "wrong scope"
EXPIRED = "expired"
NOT_YET_VALID = "not yet valid"
FUTURE_DATED = "dated in the future"
NOT_LAUNCHER = "not a launcher of the run"
REASONS = (
    UNCERTIFIED,
    FORGED,
    NOT_OPERATOR,
    OTHER_KEY,
    WRONG_ROLE,
    WRONG_SCOPE,
    EXPIRED,
    NOT_YET_VALID,
    FUTURE_DATED,
    NOT_LAUNCHER,
)
"""Why a signer is not trusted, as `Untrusted.reason` names it."""
_MAX_LOGGED = 4096


def signed_at(body: object) -> float | None:
    """When a signed object says it was made: `issued_at` (assignments, stop requests), `updated` (run
    records) or `claimed_at` (term claims); None for objects that carry no such date (leases)."""
    for name in ("issued_at", "updated", "claimed_at"):
        value = getattr(body, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


class Untrusted(UntrustedSigner):
    """A validly signed object whose signer the operator did not certify for it; `reason` is one of REASONS
    (or of protocol/trust/run_authority.py's, for a certified signer that does not direct the run)."""

    def __init__(self, reason: str, message: str, why: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.why = why or message
        """The refusal without who signed what: "its certificate expired at 2026-12-31T00:00:00Z"."""


class Certified(Protocol):
    """What a coordinator signs: it names its run and carries the signer's certificate."""

    @property
    def run_id(self) -> str: ...

    @property
    def certificate(self) -> bytes: ...


C = TypeVar("C", bound=Certified)


def utc(t: float) -> str:
    """A Unix time as 2026-12-31T00:00:00Z (for messages and the certify CLI)."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def issue(
    operator: Identity, subject: str, *, expires_at: float, run: str = ANY_RUN, now: float | None = None
) -> bytes:
    """A certificate: `subject` (a peer id) may sign as coordinator for `run` ("*": any) until `expires_at`,
    sealed by the operator's key. Raises ValueError (Delegation's checks) for a bad subject, run or window."""
    public_key_of_peer_id(subject)  # SignatureError (a ValueError) unless an Ed25519 peer id
    d = Delegation(
        subject=subject,
        role=ROLE_COORDINATOR,
        run=run,
        issued_at=time.time() if now is None else now,
        expires_at=expires_at,
    )
    return seal(operator, d)


def read_certificate(certificate: bytes) -> Signed[Delegation]:
    """Open a certificate (signature and schema only; who signed it is `OperatorTrust`'s question).
    Raises ProtocolError / SignatureError, both ValueErrors."""
    return open_envelope(certificate, Delegation)


@dataclass(frozen=True)
class OperatorTrust:
    """The operator's key(s), and the rule by which they delegate (module docstring)."""

    operators: frozenset[bytes]
    """Raw Ed25519 public keys of the operator (a node's --operator-key)."""
    role: str = ROLE_COORDINATOR

    @classmethod
    def of(cls, trusted: OperatorTrust | Iterable[bytes]) -> OperatorTrust:
        """`trusted` itself, or the rule for a set of operator public keys."""
        return trusted if isinstance(trusted, OperatorTrust) else cls(frozenset(trusted))

    @classmethod
    def of_peer_ids(cls, *peer_ids: str) -> OperatorTrust:
        return cls(frozenset(public_key_of_peer_id(p) for p in peer_ids))

    def delegation(self, signer: bytes, certificate: bytes, run_id: str, now: float) -> Delegation | None:
        """The Delegation under which `signer` may sign for run `run_id` at `now` (None: `signer` is an
        operator key). Raises Untrusted naming the reason otherwise."""
        if signer in self.operators:
            return None
        who = peer_id_of(signer)

        def refuse(reason: str, why: str) -> Untrusted:
            return Untrusted(
                reason, f"signed by {who}, which is not a trusted key for run {run_id}: {why}", why
            )

        if not certificate:
            raise refuse(UNCERTIFIED, "no certificate from the operator (uncertified)")
        try:
            cert = read_certificate(certificate)
        except (ProtocolError, SignatureError, ValueError) as e:
            raise refuse(FORGED, f"its certificate does not verify (forged certificate: {e})") from e
        d = cert.body
        if cert.signer not in self.operators:
            raise refuse(NOT_OPERATOR, f"its certificate was signed by {cert.signer_id}, not by the operator")
        if d.subject != who:
            raise refuse(OTHER_KEY, f"its certificate is for {describe(d.subject, 60)}, another key")
        if d.role != self.role:
            raise refuse(WRONG_ROLE, f"its certificate is for role {describe(d.role)}, not {self.role!r}")
        if d.run not in (run_id, ANY_RUN):
            raise refuse(WRONG_SCOPE, f"its certificate is for run {d.run!r} only (wrong scope)")
        if now >= d.expires_at:
            raise refuse(EXPIRED, f"its certificate expired at {utc(d.expires_at)}")
        if now < d.issued_at - SKEW_S:
            raise refuse(NOT_YET_VALID, f"its certificate is valid only from {utc(d.issued_at)}")
        return d

    def admit(self, signed: Signed[C], now: float | None = None) -> Signed[C]:
        """`signed` if its signer may sign it and it is not dated beyond `now` + SKEW_S (raises Untrusted
        naming the kind and the reason). The date bound is why a signer's clock cannot buy precedence:
        the newest record, the latest assignment and a stop request are chosen by their date, and one
        dated next year would otherwise win over everything its honest successors sign until then."""
        now = time.time() if now is None else now
        kind = type(signed.body).__name__
        try:
            self.delegation(signed.signer, signed.body.certificate, signed.body.run_id, now)
        except Untrusted as e:
            raise Untrusted(e.reason, f"{kind} {e}", e.why) from None
        _refuse_future(signed, kind, now)
        return signed

    def admit_launch(self, signed: Signed[C], now: float | None = None) -> Signed[C]:
        """`signed`, the launch of its run, if the operator's key signed it or a key the operator certified
        for that run alone: a certificate for every run ("*") lets a coordinator lead the runs the operator
        launched, not start new ones. The certificate is checked as of the launch's date (a finished run's
        may have expired since), and a launch dated beyond `now` + SKEW_S is refused. Raises Untrusted."""
        now = time.time() if now is None else now
        run = signed.body.run_id
        kind = f"the launch of run {run} ({type(signed.body).__name__})"
        _refuse_future(signed, kind, now)
        dated = signed_at(signed.body)
        try:
            d = self.delegation(signed.signer, signed.body.certificate, run, now if dated is None else dated)
        except Untrusted as e:
            raise Untrusted(e.reason, f"{kind} {e}", e.why) from None
        if d is not None and d.run == ANY_RUN:
            why = (
                "its certificate is for every run, and such a key leads runs, it does not launch them: only the "
                f"operator's key, or a key certified for run {run} alone, launches it (crucible-coordinator launch)"
            )
            raise Untrusted(NOT_LAUNCHER, f"{kind} signed by {signed.signer_id}: {why}", why)
        return signed

    def open(
        self, data: bytes, cls: type[C], now: float | None = None, max_bytes: int = MAX_ENVELOPE_BYTES
    ) -> Signed[C]:
        """`open_envelope` (signature, schema) and then this rule: for objects read from the store."""
        return self.admit(open_envelope(data, cls, max_bytes=max_bytes), now)

    def filter(
        self, found: Iterable[Signed[C]], refusals: RefusalLog, now: float | None = None
    ) -> list[Signed[C]]:
        """The records of `found` this rule admits; the others are logged once per signer and reason."""
        now = time.time() if now is None else now
        out = []
        for signed in found:
            try:
                out.append(self.admit(signed, now))
            except Untrusted as e:
                refusals.note(signed.signer_id, e)
        return out


def _refuse_future(signed: Signed[C], kind: str, now: float) -> None:
    """Raise Untrusted (FUTURE_DATED) when `signed` is dated beyond `now` + SKEW_S."""
    dated = signed_at(signed.body)
    if dated is not None and dated > now + SKEW_S:
        why = f"it is dated {utc(dated)}, more than {SKEW_S:.0f} s ahead of this host's clock (run NTP)"
        raise Untrusted(FUTURE_DATED, f"{kind} signed by {signed.signer_id}: {why}", why)


class RefusalLog:
    """Logs each refused signer once per reason (a warning), then at debug level: a node polling every
    second says why it ignores a record once, not every poll."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.seen: set[tuple[str, str]] = set()
        self.count = 0
        """Refusals noted, repeats included."""
        self.by_reason: Counter[str] = Counter()
        """Refusals noted by reason, repeats included (for metrics)."""

    def first(self, signer: str, reason: str) -> bool:
        """Whether (signer, reason) is new; remembers it."""
        self.count += 1
        self.by_reason[reason] += 1
        if (signer, reason) in self.seen:
            return False
        if len(self.seen) >= _MAX_LOGGED:
            self.seen.clear()
        self.seen.add((signer, reason))
        return True

    def note(self, signer: str, error: Untrusted) -> None:
        first = self.first(signer, error.reason)
        self.logger.log(logging.WARNING if first else logging.DEBUG, "ignoring %s", error)


__all__ = [
    "REASONS",
    "ROLE_COORDINATOR",
    "SKEW_S",
    "Certified",
    "OperatorTrust",
    "RefusalLog",
    "Untrusted",
    "issue",
    "read_certificate",
    "utc",
]

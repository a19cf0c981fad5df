"""Grant mail: a coordinator's write grants (protocol/net/grants.py), sealed to the one node they are for.

A presigned URL is a bearer secret, and the DHT and the store are readable by every node, so grants travel
encrypted to their node and signed by who issued them:

    mail key (node):  x = HKDF-SHA256(ikm = Ed25519 seed, info = "crucible grant mail v1"), X = X25519(x)
    seal (issuer):    e fresh, k = HKDF-SHA256(ikm = X25519(e, X), salt = E || X, info = SEAL_INFO)
                      box = E || n || ChaCha20-Poly1305(k, n, msgpack(grants), aad = the mail's header)
    mail:             a GrantMail (run, recipient, term, rounds, box, the issuer's certificate) sealed by the
                      coordinator's key (protocol/envelope.py)

The node advertises X (NodeAdvert.mail_key) and opens a mail only if its signer may sign for the run by the
operator's rule (protocol/trust/delegation.py `OperatorTrust`) and it names this node; the header is the
AEAD's associated data, so a box cannot be moved into another mail. Mails live write-once under
`keys.grants_prefix(run, peer)`; a node reads all of them (`read_mails`) and writes with their union.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from protocol import keys
from protocol.envelope import seal
from protocol.identity import Identity, SignatureError
from protocol.messages import MAX_COUNT, MAX_TIME_S
from protocol.msgpack_limits import unpack_bounded
from protocol.net.grants import MAX_EXPIRES_S, MAX_WIRE_GRANTS, GrantedStore, GrantError, Grants
from protocol.net.store import MIN_PART_BYTES, ObjectStore, StoreError
from protocol.net.store_config import StoreConfig
from protocol.runspec import check_run_id
from protocol.schema import ProtocolError, check_range, describe
from protocol.trust.delegation import OperatorTrust, Untrusted

log = logging.getLogger(__name__)

MAIL_INFO = b"crucible grant mail v1"
"""HKDF info of the node's X25519 mail key, derived from its Ed25519 identity seed."""
SEAL_INFO = b"crucible grant mail seal v1"
"""HKDF info of one mail's ChaCha20-Poly1305 key."""
MAX_MAIL_BYTES = 64 << 20
"""Largest mail a node reads: a window of 32 rounds of a 70B-parameter stage's multipart grants (about
10,000 part URLs of 600 bytes) with room to spare."""
MAX_MAILS_READ = 64
"""Mails a node reads per look, newest first (names sort by first round, then term)."""
MAX_PART_BYTES = 5 << 30
"""S3's largest part (5 GiB)."""
_NONCE = 12


class GrantMailError(ValueError):
    """A mail that is not this node's, does not verify or does not decrypt."""


@dataclass(kw_only=True, frozen=True)
class GrantMail:
    """One coordinator's grants for one node's slot, for rounds first_round .. first_round + rounds - 1."""

    run_id: str
    recipient: str
    """Peer id of the node the box is sealed to."""
    term: int
    """The issuer's lease term (a mail's key names it, so a successor's mails never collide)."""
    replica: int
    stage: int
    first_round: int
    rounds: int
    part_bytes: int
    """The part size the issuer sized the multipart grants for: the node's uploads use it."""
    issued_at: float
    expires_at: float
    """When the grants inside expire (Unix time, the issuer's clock)."""
    box: bytes
    certificate: bytes = b""
    """The issuer's certificate from the operator (empty: the operator's key signed it)."""

    def __post_init__(self) -> None:
        check_run_id("GrantMail.run_id", self.run_id)
        if not (isinstance(self.recipient, str) and 0 < len(self.recipient) <= 128):
            raise ValueError(f"GrantMail.recipient={describe(self.recipient)} is not a peer id")
        for name in ("term", "replica", "stage", "first_round"):
            check_range(f"GrantMail.{name}", getattr(self, name), 0, MAX_COUNT)
        check_range("GrantMail.rounds", self.rounds, 1, 1 << 20)
        check_range("GrantMail.part_bytes", self.part_bytes, MIN_PART_BYTES, MAX_PART_BYTES)
        check_range("GrantMail.issued_at", self.issued_at, 0, MAX_TIME_S)
        check_range(
            "GrantMail.expires_at", self.expires_at, self.issued_at, self.issued_at + MAX_EXPIRES_S + 60
        )

    def aad(self) -> bytes:
        """The header the box is bound to (everything but the box and the certificate)."""
        return msgpack.packb(
            [self.run_id, self.recipient, self.term, self.replica, self.stage, self.first_round, self.rounds]
            + [self.part_bytes, float(self.issued_at), float(self.expires_at)],  # as they decode
            use_bin_type=True,
        )


def mail_private_key(identity: Identity) -> X25519PrivateKey:
    """The node's X25519 mail key, derived from its identity seed (the same key across restarts)."""
    raw = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=MAIL_INFO).derive(identity.seed)
    return X25519PrivateKey.from_private_bytes(raw)


def _raw(public: X25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def mail_key_hex(identity: Identity) -> str:
    """What a node advertises (NodeAdvert.mail_key): its mail public key, 64 hex characters."""
    return _raw(mail_private_key(identity).public_key()).hex()


def _box_key(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=ephemeral + recipient, info=SEAL_INFO).derive(
        shared
    )


def seal_box(grants: Grants, recipient_public: bytes, aad: bytes) -> bytes:
    """`grants` encrypted to `recipient_public` (raw X25519): ephemeral key || nonce || ciphertext."""
    e = X25519PrivateKey.generate()
    ephemeral = _raw(e.public_key())
    k = _box_key(e.exchange(X25519PublicKey.from_public_bytes(recipient_public)), ephemeral, recipient_public)
    nonce = os.urandom(_NONCE)
    plain = msgpack.packb(grants.to_wire(), use_bin_type=True)
    return ephemeral + nonce + ChaCha20Poly1305(k).encrypt(nonce, plain, aad)


def open_box(box: bytes, identity: Identity, aad: bytes) -> Grants:
    """The grants in `box`, sealed to `identity`'s mail key and bound to `aad`. Raises GrantMailError."""
    if len(box) < 32 + _NONCE + 16:
        raise GrantMailError(f"grant mail: a box of {len(box)} bytes is too short")
    x = mail_private_key(identity)
    ephemeral, nonce, ct = box[:32], box[32 : 32 + _NONCE], box[32 + _NONCE :]
    mine = _raw(x.public_key())
    try:
        k = _box_key(x.exchange(X25519PublicKey.from_public_bytes(ephemeral)), ephemeral, mine)
        plain = ChaCha20Poly1305(k).decrypt(nonce, ct, aad)
    except (InvalidTag, ValueError) as e:
        raise GrantMailError("grant mail: the box does not decrypt with this node's mail key") from e
    try:
        wire = unpack_bounded(
            plain, "grants", max_bytes=MAX_MAIL_BYTES, max_values=8 * MAX_WIRE_GRANTS, max_depth=4
        )
        return Grants.from_wire(wire)
    except (ProtocolError, GrantError) as e:
        raise GrantMailError(f"grant mail: {e}") from e


def write_mail(
    store: ObjectStore,
    issuer: Identity,
    grants: Grants,
    *,
    recipient: str,
    recipient_mail_key: str,
    run_id: str,
    term: int,
    replica: int,
    stage: int,
    first_round: int,
    rounds: int,
    part_bytes: int,
    expires_at: float,
    certificate: bytes = b"",
    seq: int = 0,
) -> bool:
    """Seals `grants` to the recipient, signs the mail and writes it once at its key; False if a mail is
    there already. Raises ValueError for a malformed mail key, StoreError when the store refuses."""
    try:
        public = bytes.fromhex(recipient_mail_key)
    except ValueError:
        public = b""
    if len(public) != 32:
        raise ValueError(f"mail key {describe(recipient_mail_key)} is not 64 hex characters (an X25519 key)")
    header = GrantMail(
        run_id=run_id,
        recipient=recipient,
        term=term,
        replica=replica,
        stage=stage,
        first_round=first_round,
        rounds=rounds,
        part_bytes=part_bytes,
        issued_at=time.time(),
        expires_at=expires_at,
        box=b"",
        certificate=certificate,
    )
    mail = replace(header, box=seal_box(grants, public, header.aad()))
    key = keys.grant_mail_key(run_id, recipient, first_round, term, seq)
    return store.put_if_absent(key, seal(issuer, mail)) is not None


def open_mail(
    data: bytes, identity: Identity, trust: OperatorTrust, run_id: str, now: float | None = None
) -> tuple[GrantMail, Grants]:
    """The mail in `data` and its grants, if a key the operator trusts for `run_id` signed it and it is
    sealed to `identity`. Raises GrantMailError (or Untrusted) saying what is wrong."""
    try:
        signed = trust.open(data, GrantMail, now, max_bytes=MAX_MAIL_BYTES)
    except (ProtocolError, SignatureError) as e:
        if isinstance(e, Untrusted):
            raise
        raise GrantMailError(f"grant mail: {e}") from e
    mail = signed.body
    if mail.run_id != run_id or mail.recipient != identity.peer_id:
        raise GrantMailError(
            f"grant mail: for {mail.recipient} in run {mail.run_id}, not for this node in run {run_id}"
        )
    return mail, open_box(mail.box, identity, mail.aad())


def read_mails(
    store: ObjectStore, identity: Identity, trust: OperatorTrust, run_id: str, seen: set[str] | None = None
) -> list[tuple[GrantMail, Grants]]:
    """Every mail for this node under the run's grants prefix it has not read yet (`seen`: the keys read,
    updated here), oldest first. One it cannot open is logged and skipped (and not read again)."""
    seen = set() if seen is None else seen
    names = [k for k in store.list(keys.grants_prefix(run_id, identity.peer_id)) if k not in seen]
    out = []
    for key in sorted(names)[-MAX_MAILS_READ:]:
        try:
            data = store.get(key, max_bytes=MAX_MAIL_BYTES)
        except StoreError as e:
            log.warning("grant mail %s: not readable (%s); asked again later", key, e)
            continue
        seen.add(key)
        if data is None:
            continue
        try:
            out.append(open_mail(data, identity, trust, run_id))
        except (GrantMailError, Untrusted) as e:
            log.warning("grant mail %s refused: %s", key, e)
    return out


class GrantInbox:
    """Feeds a node's GrantedStore with the mails sealed to it for one run: read at the start (`wait`),
    and again whenever a write finds no grant (the store's refill, at most every 2 s)."""

    def __init__(self, cfg: StoreConfig, identity: Identity, trust: OperatorTrust, run_id: str) -> None:
        """cfg: the node's store settings (its credential may be read-only)."""
        self.store = GrantedStore(cfg, refill=self._refill)
        self.identity, self.trust, self.run_id = identity, trust, run_id
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.mails = 0
        """Mails read and taken so far."""

    def refresh(self) -> int:
        """Reads the mails not read yet and adds their grants; returns how many it took."""
        with self._lock:
            try:
                found = read_mails(self.store, self.identity, self.trust, self.run_id, self._seen)
            except StoreError as e:
                log.warning(
                    "run %s: grant mails not listed (%s); asked again at the next write", self.run_id, e
                )
                return 0
            for mail, grants in found:
                self.store.add_grants(grants)
                self.store.part_bytes = mail.part_bytes
            self.mails += len(found)
            return len(found)

    def _refill(self) -> None:
        self.refresh()

    def wait(self, timeout_s: float, cancelled: Callable[[], bool], poll_s: float = 1.0) -> bool:
        """Waits up to `timeout_s` for the first mail; False if none came (writes then ask again)."""
        deadline = time.monotonic() + timeout_s
        while not (self.refresh() or self.mails):
            if cancelled() or time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

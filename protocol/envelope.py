"""Versioned, signed message envelope.

Wire form (msgpack): {"v": version, "kind": str, "signer": 32-byte Ed25519 public key,
"payload": msgpack(body), "sig": signature} plus, for records with a lifetime (DHT records),
"exp": the DHT time (float seconds) after which the record is void.

The signature covers the version, the kind, the expiry and the exact payload bytes, so no canonical
re-encoding of the body is needed to verify:
    without exp: Ed25519(signer, b"crucible/envelope/v{v}\\0" + kind + payload)
    with exp:    Ed25519(signer, b"crucible/envelope/v{v}/exp\\0" + float64_be(exp) + kind + payload)
The two domains differ in their 21st byte, so a signature made for one form never verifies as the other,
and changing `v` changes the signed bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

from protocol.identity import Identity, SignatureError, peer_id_of, verify
from protocol.msgpack_limits import unpack_bounded
from protocol.schema import (  # the errors live in schema, so codecs need no cryptography
    SchemaError,
    UntrustedSigner,
    VersionError,
    describe,
    from_dict,
    to_dict,
)

PROTOCOL_VERSION = 1
_DOMAIN = b"crucible/envelope/v1\x00"
"""The signed prefix of a version-1 envelope without an expiry (see `signed_bytes`)."""
MAX_ENVELOPE_BYTES = 4 << 20
"""Largest envelope `open_envelope` reads unless told otherwise (dense fragments pass their own limit): one
DHT message (hivemind's bound). The largest messages grow with the swarm: an Assignment by 58 bytes per
replica in `stage_peers` and 55 per former peer in `former_stage_peers` (59 KB at 1,000 replicas; 3.5 MB
if each of them was replaced 64 times, the most it remembers), a NodeAdvert by 127 bytes per measured peer
(127 KB at 1,000 peers); the others are under 1.5 KB."""
MAX_BODY_VALUES = 1 << 18
"""Most msgpack values a message body may hold (every key, value and element counts once): an Assignment
holds 2 per replica and 1 per former peer plus about 140 (81,000 in 4 MiB), a NodeAdvert 4 per measured
peer plus 60 (132,000 in 4 MiB), so every valid message that fits in MAX_ENVELOPE_BYTES fits here too."""
MAX_BODY_CONTAINERS = 1 << 16
"""Most arrays and maps among them: an Assignment holds 1 per replica with former peers plus about 10, a
dense fragment 1 per tensor plus 2. A body costs at most 65,536 lists and 200,000 scalars (about 20 MB and
0.3 s at worst), whatever its byte size."""
_ENVELOPE_VALUES = 16
"""The envelope is one map of at most 6 scalar fields: 13 values."""

T = TypeVar("T")


@dataclass(frozen=True)
class Signed(Generic[T]):
    """A verified message body, who signed it, and until when (the signed expiry; None = no expiry)."""

    body: T
    signer: bytes
    expires_at: float | None = None

    @property
    def signer_id(self) -> str:
        return peer_id_of(self.signer)


@dataclass(frozen=True)
class Header:
    """An envelope whose signature verified, before its body is decoded."""

    kind: str
    signer: bytes
    payload: bytes
    expires_at: float | None


def kind_of(cls: type) -> str:
    return cls.__name__


def signed_bytes(version: int, kind: str, expires_at: float | None, payload: bytes) -> bytes:
    """The bytes an envelope's signature covers (module docstring)."""
    if expires_at is None:
        return b"crucible/envelope/v%d\x00" % version + kind.encode() + payload
    return (
        b"crucible/envelope/v%d/exp\x00" % version + struct.pack(">d", expires_at) + kind.encode() + payload
    )


def seal_payload(identity: Identity, kind: str, payload: bytes, *, expires_at: float | None = None) -> bytes:
    """Sign already-packed payload bytes as a `kind` message (what `seal` does after packing the body)."""
    env: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "kind": kind,
        "signer": identity.public_key,
        "payload": payload,
    }
    if expires_at is not None:
        expires_at = float(expires_at)
        if not math.isfinite(expires_at):
            raise ValueError(f"envelope expiry must be a finite DHT time, got {describe(expires_at)}")
        env["exp"] = expires_at
    env["sig"] = identity.sign(signed_bytes(PROTOCOL_VERSION, kind, expires_at, payload))
    return msgpack.packb(env, use_bin_type=True)


def seal(identity: Identity, body: Any, *, expires_at: float | None = None) -> bytes:
    """Sign a message dataclass and pack it into an envelope; `expires_at` (DHT time) is signed with it."""
    payload = msgpack.packb(to_dict(body), use_bin_type=True)
    return seal_payload(identity, kind_of(type(body)), payload, expires_at=expires_at)


def verified_header(data: object, max_bytes: int = MAX_ENVELOPE_BYTES) -> Header:
    """Parse an envelope and check its version and signature (not its body's schema).

    Raises VersionError / SchemaError (ProtocolError) or SignatureError, with the reason."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(f"envelope: expected bytes, got {describe(data)}")
    env = unpack_bounded(data, "envelope", max_bytes=max_bytes, max_values=_ENVELOPE_VALUES, max_depth=1)
    if not isinstance(env, dict):
        raise SchemaError(f"envelope: expected a map at the top level, got {describe(env)}")
    version = env.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise VersionError(
            f"envelope: protocol version {describe(version)}, this build speaks {PROTOCOL_VERSION}; "
            "upgrade the older side"
        )
    for field, tp in (("kind", str), ("signer", bytes), ("payload", bytes), ("sig", bytes)):
        if not isinstance(env.get(field), tp):
            raise SchemaError(f"envelope.{field}: expected {tp.__name__}, got {describe(env.get(field))}")
    if len(env["kind"]) > 64:
        raise SchemaError(f"envelope.kind: {describe(env['kind'])} is not a message kind")
    exp = env.get("exp")
    if exp is not None and (type(exp) is not float or not math.isfinite(exp)):
        raise SchemaError(f"envelope.exp: expected a finite float DHT time, got {describe(exp)}")
    unknown = set(env) - {"v", "kind", "signer", "payload", "sig", "exp"}
    if unknown:
        raise SchemaError(f"envelope: unknown field(s) {', '.join(describe(k) for k in list(unknown)[:5])}")
    signer: bytes = env["signer"]
    verify(signer, signed_bytes(version, env["kind"], exp, env["payload"]), env["sig"])
    return Header(kind=env["kind"], signer=signer, payload=env["payload"], expires_at=exp)


def open_envelope(
    data: bytes, cls: type[T], trusted: set[bytes] | None = None, max_bytes: int = MAX_ENVELOPE_BYTES
) -> Signed[T]:
    """Verify and decode an envelope holding a `cls` message (its body within MAX_BODY_VALUES and
    MAX_BODY_CONTAINERS).

    trusted: if given, the signer's public key must be in it (e.g. the operator key for assignments).
    Raises VersionError / SchemaError / SignatureError / UntrustedSigner with the reason: all ValueErrors,
    all but SignatureError ProtocolErrors.
    """
    header = verified_header(data, max_bytes)
    expected = kind_of(cls)
    if header.kind != expected:
        raise SchemaError(f"envelope.kind: expected {expected!r}, got {describe(header.kind)}")
    if trusted is not None and header.signer not in trusted:
        raise UntrustedSigner(
            f"{expected} signed by {peer_id_of(header.signer)}, which is not a trusted key for it; "
            "check the --operator-key the node was started with"
        )
    body = unpack_bounded(
        header.payload,
        f"{expected} payload",
        max_bytes=max_bytes,
        max_values=MAX_BODY_VALUES,
        max_containers=MAX_BODY_CONTAINERS,
    )
    return Signed(from_dict(cls, body), header.signer, header.expires_at)


__all__ = [
    "PROTOCOL_VERSION",
    "Header",
    "Signed",
    "SignatureError",
    "UntrustedSigner",
    "VersionError",
    "open_envelope",
    "seal",
    "seal_payload",
    "signed_bytes",
    "verified_header",
]

"""Versioned, signed message envelope.

Wire form (msgpack): {"v": version, "kind": str, "signer": 32-byte Ed25519 public key,
"payload": msgpack(body), "sig": Ed25519(signer, DOMAIN + kind + payload)}.
The signature covers the exact payload bytes, so no canonical re-encoding is needed to verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

from protocol.identity import Identity, SignatureError, peer_id_of, verify
from protocol.schema import (  # the errors live in schema, so codecs need no cryptography
    SchemaError,
    UntrustedSigner,
    VersionError,
    from_dict,
    to_dict,
)

PROTOCOL_VERSION = 1
_DOMAIN = b"crucible/envelope/v1\x00"
MAX_ENVELOPE_BYTES = 16 * 1024 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class Signed(Generic[T]):
    """A verified message body and who signed it."""

    body: T
    signer: bytes

    @property
    def signer_id(self) -> str:
        return peer_id_of(self.signer)


def kind_of(cls: type) -> str:
    return cls.__name__


def seal(identity: Identity, body: Any) -> bytes:
    """Sign a message dataclass and pack it into an envelope."""
    kind = kind_of(type(body))
    payload = msgpack.packb(to_dict(body), use_bin_type=True)
    sig = identity.sign(_DOMAIN + kind.encode() + payload)
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "kind": kind, "signer": identity.public_key, "payload": payload, "sig": sig},
        use_bin_type=True,
    )


def verified_signer(data: bytes) -> bytes:
    """Check an envelope's signature (not its body's schema); return the signer's public key."""
    env = msgpack.unpackb(data, raw=False)
    if not isinstance(env, dict) or not all(
        isinstance(env.get(f), bytes) for f in ("signer", "payload", "sig")
    ):
        raise SchemaError("envelope: missing signer, payload or sig")
    if not isinstance(env.get("kind"), str):
        raise SchemaError("envelope.kind: expected str")
    verify(env["signer"], _DOMAIN + env["kind"].encode() + env["payload"], env["sig"])
    return bytes(env["signer"])


def open_envelope(
    data: bytes, cls: type[T], trusted: set[bytes] | None = None, max_bytes: int = MAX_ENVELOPE_BYTES
) -> Signed[T]:
    """Verify and decode an envelope holding a `cls` message.

    trusted: if given, the signer's public key must be in it (e.g. the operator key for assignments).
    Raises VersionError / SchemaError / SignatureError / UntrustedSigner (all ProtocolError) with the reason.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SchemaError(f"envelope: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise SchemaError(f"envelope: {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        env = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise SchemaError(f"envelope: not valid msgpack ({e})") from e
    if not isinstance(env, dict):
        raise SchemaError("envelope: expected a map at the top level")
    version = env.get("v")
    if version != PROTOCOL_VERSION:
        raise VersionError(
            f"envelope: protocol version {version!r}, this build speaks {PROTOCOL_VERSION}; "
            "upgrade the older side"
        )
    for field, tp in (("kind", str), ("signer", bytes), ("payload", bytes), ("sig", bytes)):
        if not isinstance(env.get(field), tp):
            raise SchemaError(
                f"envelope.{field}: expected {tp.__name__}, got {type(env.get(field)).__name__}"
            )
    expected = kind_of(cls)
    if env["kind"] != expected:
        raise SchemaError(f"envelope.kind: expected {expected!r}, got {env['kind']!r}")
    signer: bytes = env["signer"]
    verify(signer, _DOMAIN + env["kind"].encode() + env["payload"], env["sig"])
    if trusted is not None and signer not in trusted:
        raise UntrustedSigner(
            f"{expected} signed by {peer_id_of(signer)}, which is not a trusted key for it; "
            "check the --operator-key the node was started with"
        )
    try:
        body = msgpack.unpackb(env["payload"], raw=False, strict_map_key=True)
    except Exception as e:
        raise SchemaError(f"{expected}: payload is not valid msgpack ({e})") from e
    return Signed(from_dict(cls, body), signer)


__all__ = [
    "PROTOCOL_VERSION",
    "Signed",
    "SignatureError",
    "UntrustedSigner",
    "VersionError",
    "open_envelope",
    "seal",
]

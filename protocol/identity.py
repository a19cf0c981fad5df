"""Ed25519 identities and peer ids.

Every node and coordinator holds an Ed25519 key. Its peer id is the libp2p peer id of that key
(identity multihash of the protobuf-encoded public key, base58), so the id a node signs with is the id
its hivemind DHT peer has: `Identity.write_libp2p_key` gives p2pd the same key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

# libp2p crypto.proto: KeyType Ed25519 = 1; PublicKey{Type=1 (field 1, varint), Data=2 (field 2, bytes)}.
_PB_ED25519_PUBLIC_PREFIX = bytes([0x08, 0x01, 0x12, 0x20])
_PB_ED25519_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])
_IDENTITY_MULTIHASH = bytes([0x00, 0x24])  # multihash code 0x00 (identity), length 36


class SignatureError(ValueError):
    """A signature did not verify, or a key was malformed."""


def peer_id_of(public_key: bytes) -> str:
    """The libp2p peer id ("12D3KooW...") of a raw 32-byte Ed25519 public key."""
    if len(public_key) != 32:
        raise SignatureError(f"Ed25519 public key must be 32 bytes, got {len(public_key)}")
    return base58.b58encode(_IDENTITY_MULTIHASH + _PB_ED25519_PUBLIC_PREFIX + public_key).decode()


def public_key_of_peer_id(peer_id: str) -> bytes:
    """Inverse of `peer_id_of`: Ed25519 peer ids embed their public key."""
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as e:
        raise SignatureError(f"peer id {peer_id!r} is not base58: {e}") from e
    prefix = _IDENTITY_MULTIHASH + _PB_ED25519_PUBLIC_PREFIX
    if len(raw) != len(prefix) + 32 or not raw.startswith(prefix):
        raise SignatureError(f"peer id {peer_id!r} is not an Ed25519 libp2p peer id")
    return raw[len(prefix) :]


def verify(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Raise `SignatureError` unless `signature` is `public_key`'s signature of `message`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as e:
        raise SignatureError(f"signature does not verify for key {peer_id_of(public_key)}") from e


@dataclass(frozen=True)
class Identity:
    """A private Ed25519 key with its public key and peer id."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load a raw 32-byte seed from `path`, creating it (mode 0600) if it does not exist."""
        p = Path(path)
        if p.exists():
            seed = p.read_bytes()
            if len(seed) != 32:
                raise SignatureError(
                    f"identity file {p} holds {len(seed)} bytes, expected a 32-byte Ed25519 seed; "
                    "delete it to generate a new identity"
                )
            return cls.from_seed(seed)
        p.parent.mkdir(parents=True, exist_ok=True)
        ident = cls.generate()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(ident.seed)
        return ident

    @property
    def seed(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )

    @property
    def public_key(self) -> bytes:
        return self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def write_libp2p_key(self, path: str | os.PathLike[str]) -> None:
        """Write the key in libp2p's protobuf form, for hivemind's `identity_path` (same peer id)."""
        Path(path).write_bytes(_PB_ED25519_PRIVATE_PREFIX + self.seed + self.public_key)
        os.chmod(path, 0o600)

"""Thin client over hivemind's DHT for the records both roles use (signed envelopes, with TTLs)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import TypeVar

import hivemind
from hivemind.utils import get_dht_time
from multiaddr import Multiaddr

from protocol.dht_validator import SignedSubkeyValidator, subkey_owner
from protocol.envelope import Signed, open_envelope, seal
from protocol.identity import Identity
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)
T = TypeVar("T")
EXAMPLE_MULTIADDR = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


class BootstrapError(ProtocolError):
    """A bootstrap address is malformed or unreachable."""


def validate_multiaddr(addr: str) -> str:
    """Check a user-supplied bootstrap multiaddr; raise BootstrapError saying what is wrong."""
    try:
        m = Multiaddr(addr)
    except Exception as e:
        raise BootstrapError(
            f"bootstrap address {addr!r} is not a valid multiaddr: {e} (example: {EXAMPLE_MULTIADDR})"
        ) from e
    protocols = [p.name for p in m.protocols()]
    if "p2p" not in protocols or "tcp" not in protocols:
        raise BootstrapError(
            f"bootstrap address {addr!r} must name a TCP port and the peer id (/tcp/PORT/p2p/PEER_ID); "
            f"example: {EXAMPLE_MULTIADDR}"
        )
    return str(m)


class DHTClient:
    """A hivemind DHT peer whose peer id is the node's Ed25519 identity."""

    def __init__(
        self,
        identity: Identity,
        *,
        bootstrap: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        peers = [validate_multiaddr(a) for a in bootstrap or []]
        self.identity = identity
        self._key_dir = tempfile.TemporaryDirectory(prefix="crucible-key-")
        key_path = Path(self._key_dir.name) / "libp2p.key"
        identity.write_libp2p_key(key_path)
        kwargs: dict = {}
        if announce_host:
            kwargs["announce_maddrs"] = [f"/ip4/{announce_host}/tcp/{port}"] if port else None
        try:
            self.dht = hivemind.DHT(
                initial_peers=peers or None,
                host_maddrs=[f"/ip4/{host}/tcp/{port}"],
                identity_path=str(key_path),
                check_if_identity_free=False,
                record_validators=[
                    SignedSubkeyValidator()
                ],  # hivemind parses only RSA keys there; ours are Ed25519
                start=True,
                startup_timeout=startup_timeout_s,
                **{k: v for k, v in kwargs.items() if v},
            )
        except Exception as e:
            self._key_dir.cleanup()
            if peers:
                raise BootstrapError(
                    f"could not join the swarm through {', '.join(peers)}: {e}. Check that the bootstrap peer "
                    "is running and reachable from this host (firewall, address, port), and that the peer id matches"
                ) from e
            raise

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        return [str(a) for a in self.dht.get_visible_maddrs()]

    def publish(
        self, key: str, body: object, ttl_s: float, *, signer: Identity | None = None, name: str = ""
    ) -> bool:
        """Sign `body` (with `signer`, default this peer) and store it until now + ttl_s under the subkey
        `name@SIGNER` (or `SIGNER`): only the signer can write there (SignedSubkeyValidator)."""
        ident = signer or self.identity
        subkey = f"{name}@{ident.peer_id}" if name else ident.peer_id
        data = seal(ident, body)
        return bool(self.dht.store(key, data, expiration_time=get_dht_time() + ttl_s, subkey=subkey))

    def get_all(self, key: str, cls: type[T], trusted: set[bytes] | None = None) -> dict[str, Signed[T]]:
        """All valid signed records under `key`, by subkey; invalid ones are logged and skipped."""
        found = self.dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        out: dict[str, Signed[T]] = {}
        for subkey, item in found.value.items():
            try:
                signed = open_envelope(item.value, cls, trusted)
            except ProtocolError as e:
                log.warning("ignoring DHT record %s/%s: %s", key, subkey, e)
                continue
            if subkey_owner(subkey) != signed.signer_id:
                log.warning(
                    "ignoring DHT record %s/%s: signed by %s, not the subkey's owner",
                    key,
                    subkey,
                    signed.signer_id,
                )
                continue
            out[str(subkey)] = signed
        return out

    def shutdown(self) -> None:
        try:
            self.dht.shutdown()
        finally:
            self._key_dir.cleanup()


def dht_time() -> float:
    return float(get_dht_time())

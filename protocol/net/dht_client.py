"""Thin client over hivemind's DHT for the records both roles use (signed envelopes, with TTLs).

Reading is safe against hostile records: `get_all` drops every record that fails a check (its envelope,
signature, signer, schema, ranges or expiry) and counts it in `rejected`; it never raises for one record,
so a bad record cannot halt a coordinator's tick or a node's poll, which serve everyone else's records.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any, TypeVar

import hivemind
from hivemind.utils import get_dht_time
from multiaddr import Multiaddr

from protocol.envelope import Signed, open_envelope, seal
from protocol.identity import Identity, SignatureError
from protocol.net.dht_validator import SignedSubkeyValidator, subkey_owner
from protocol.process.signals import die_with_parent
from protocol.schema import ProtocolError, describe

log = logging.getLogger(__name__)
T = TypeVar("T")
EXAMPLE_MULTIADDR = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


RECORD_ERRORS: tuple[type[Exception], ...] = (
    ProtocolError,  # SchemaError, VersionError, UntrustedSigner, RecordError
    SignatureError,
    ValueError,
    TypeError,
    RecursionError,
)
"""What reading one hostile record may raise; `get_all` catches these per record."""
_WARNED_MAX = 4096


class BootstrapError(ProtocolError):
    """A bootstrap address is malformed or unreachable."""


class RecordError(ProtocolError):
    """A DHT record's envelope is valid but the record is not: wrong subkey, or it outlives its signed expiry."""


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


class _DHT(hivemind.DHT):
    """hivemind's DHT process, made to die with the process that started it (Linux): a node or
    coordinator killed by SIGKILL or the OOM killer must not leave its DHT peer serving on without it
    (hivemind stops the daemon process only on a clean exit). Only when started from the main thread:
    the kernel sends the signal when the creating *thread* ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._parent_pid = os.getpid()
        self._die_with_parent = threading.current_thread() is threading.main_thread()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        if self._die_with_parent:
            die_with_parent()
            if os.getppid() != self._parent_pid:  # the parent died before prctl took effect
                os._exit(0)
        super().run()


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
        client_mode: bool = False,
        request_timeout_s: float = 60.0,
    ) -> None:
        """client_mode: a short-lived client (status, launch, stop) that asks and stores but serves no
        one's records and takes no place in the routing tables (hivemind's client_mode).
        request_timeout_s: a store or get not answered by then raises TimeoutError (hivemind's calls
        wait forever, e.g. on a DHT process that died while the node shuts down)."""
        self.request_timeout_s = request_timeout_s
        peers = [validate_multiaddr(a) for a in bootstrap or []]
        self.identity = identity
        self.rejected: Counter[str] = Counter()
        """Records `get_all` dropped, by error type (e.g. "SchemaError", "SignatureError")."""
        self._warned: set[tuple[str, str]] = set()
        self._key_dir = tempfile.TemporaryDirectory(prefix="crucible-key-")
        key_path = Path(self._key_dir.name) / "libp2p.key"
        identity.write_libp2p_key(key_path)
        kwargs: dict = {}
        if client_mode:
            kwargs["client_mode"] = True
        if announce_host:
            kwargs["announce_maddrs"] = [f"/ip4/{announce_host}/tcp/{port}"] if port else None
        try:
            self.dht = _DHT(
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
        """Sign `body` (with `signer`, default this peer) with the expiry now + ttl_s, and store it until then
        under the subkey `name@SIGNER` (or `SIGNER`): only the signer can write there, and no copy can
        outlive the signed expiry (SignedSubkeyValidator)."""
        ident = signer or self.identity
        subkey = f"{name}@{ident.peer_id}" if name else ident.peer_id
        expires_at = float(get_dht_time()) + ttl_s
        data = seal(ident, body, expires_at=expires_at)
        stored = self.dht.store(key, data, expiration_time=expires_at, subkey=subkey, return_future=True)
        return bool(stored.result(timeout=self.request_timeout_s))

    def get_all(self, key: str, cls: type[T], trusted: set[bytes] | None = None) -> dict[str, Signed[T]]:
        """All valid signed records under `key`, by subkey (signed by `trusted` keys, if given).

        Invalid records are dropped, counted in `rejected` and logged (a warning the first time a subkey
        fails, debug after that); none raises. Errors reaching the DHT itself do raise."""
        found = self.dht.get(key, latest=True, return_future=True).result(timeout=self.request_timeout_s)
        if found is None:
            return {}
        if not isinstance(found.value, dict):
            self._reject(key, None, RecordError("a plain value where a dictionary of signed records belongs"))
            return {}
        out: dict[str, Signed[T]] = {}
        for subkey, item in found.value.items():
            try:
                out[subkey] = self._open(subkey, item, cls, trusted)
            except RECORD_ERRORS as e:
                self._reject(key, subkey, e)
        return out

    @staticmethod
    def _open(subkey: object, item: Any, cls: type[T], trusted: set[bytes] | None) -> Signed[T]:
        signed = open_envelope(item.value, cls, trusted)
        if subkey_owner(subkey) != signed.signer_id:
            raise RecordError(f"signed by {signed.signer_id}, not by the peer its subkey names")
        exp = item.expiration_time
        if signed.expires_at is None or not exp <= signed.expires_at:
            raise RecordError(
                f"DHT expiration {describe(exp)} lies beyond the signed expiry {describe(signed.expires_at)}"
            )
        return signed

    def _reject(self, key: str, subkey: object, error: BaseException) -> None:
        self.rejected[type(error).__name__] += 1
        shown = describe(subkey, limit=80)
        text = str(error)
        reason = text if len(text) <= 300 else f"{text[:300]}... ({len(text)} chars)"
        first = (key, shown) not in self._warned
        if first:
            if len(self._warned) >= _WARNED_MAX:
                self._warned.clear()
            self._warned.add((key, shown))
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "ignoring DHT record %s/%s: %s: %s",
            key,
            shown,
            type(error).__name__,
            reason,
        )

    def shutdown(self) -> None:
        try:
            self.dht.shutdown()
        finally:
            self._key_dir.cleanup()


def dht_time() -> float:
    return float(get_dht_time())

"""What `crucible-node join` checks before it serves, so a provider's mistake ends in one line that names it.

Before anything heavy starts (this module imports neither torch nor hivemind; boto3 only when a store is
checked): no other process on this host runs with the key file, the listen address and ports are free,
the store answers and takes a write, a bootstrap peer answers. After the DHT is joined: no live process
elsewhere holds this node's peer id. Every network check has a short timeout. A failed check raises
`UsageError` (protocol/process/cli_errors.py): exit 2, one line.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

from protocol import keys
from protocol.messages import NodeAdvert
from protocol.process.cli_errors import UsageError, bad_input, check_port_free, check_reachable, one_line

if TYPE_CHECKING:
    from protocol.net.dht_client import DHTClient
    from protocol.net.store import StoreConfig

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0
"""A TCP connect to the store or a bootstrap peer: a peer that answers at all answers within this."""
STORE_TIMEOUT_S = 5.0
"""Each request of the store probe (connect and read; boto3 retries up to 3 times)."""
HEALTH_TIMEOUT_S = 2.0
"""The GET of a possible twin's /health."""
PROBE_BYTES = b"crucible-node preflight: safe to delete\n"


def hold_key_file(label: str, key_file: Path, peer_id: str) -> IO[str] | None:
    """Hold this host's lock on `key_file` (the file `<key file>.lock`) while the process lives; the
    kernel releases it however the process ends, so a restart after a crash finds it free. A second
    process with the same key file on this host is refused at once, before anything starts (a copy of
    the key on another host is found in the DHT: `refuse_live_twin`). Returns the handle to keep open;
    None where no lock file can be made (a read-only folder): the DHT check still runs."""
    try:
        f = open(key_file.with_name(f"{key_file.name}.lock"), "a+")  # noqa: SIM115 - held while we run
    except OSError as e:
        log.debug("no lock next to %s: %s", key_file, e)
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise bad_input(
            label,
            str(key_file),
            f"another crucible-node (pid {pid}) runs on this host with this key, peer id {peer_id}; "
            "give this one its own key file",
            "--key-file ~/.crucible/node2.key",
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def check_host(label: str, host: str) -> None:
    """An address this host can listen on (bound once on port 0, then released)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as e:
        raise bad_input(
            label, host, f"cannot listen on it ({e.strerror or e}): give an address of this host", "0.0.0.0"
        ) from e


def check_ports(host: str, ports: Sequence[tuple[str, int]]) -> None:
    """Each (label, port) free on `host` and no fixed port given twice (0 = any free port)."""
    seen: dict[int, str] = {}
    for label, port in ports:
        if port and port in seen:
            raise bad_input(
                label, port, f"is also {seen[port]}; give each its own port, or 0 for any free one"
            )
        seen[port] = label
        check_port_free(label, host, port)


def refuse_if_taken(error: BaseException, label: str, host: str, port: int) -> None:
    """Raise the one-line refusal naming `label` when a start failed because `port` was taken since the
    preflight; return (the caller re-raises `error`) when it failed for something else. Looks through
    the causes: the health server wraps the OSError, hivemind quotes p2pd's "address already in use"."""
    if not port:
        return
    e: BaseException | None = error
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.EADDRINUSE) or "address already in use" in str(e):
            raise bad_input(
                label, port, f"already in use on {host} by another process; pick a free one or omit it"
            ) from error
        e = e.__cause__ or e.__context__


def check_bootstrap(label: str, addrs: Sequence[str], timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """At least one bootstrap peer accepts a TCP connection (those given by IP or DNS name); hivemind's
    own join (up to 30 s) then checks the peer id. A peer that does not answer is named with its flag."""
    from multiaddr import Multiaddr

    failures: list[UsageError] = []
    for addr in addrs:
        m = Multiaddr(addr)
        names = [p.name for p in m.protocols()]
        host_proto = next((n for n in names if n in ("ip4", "ip6", "dns", "dns4", "dns6")), None)
        if host_proto is None or "tcp" not in names:
            return  # a relay or another transport: leave it to hivemind
        host, port = m.value_for_protocol(host_proto), int(m.value_for_protocol("tcp"))
        try:
            check_reachable(
                label, addr, host, port, timeout_s, "the bootstrap peer", "could not join the swarm: "
            )
        except UsageError as e:
            failures.append(e)
            continue
        return
    if failures:
        raise failures[0]


def check_store(
    cfg: StoreConfig, peer_id: str, labels: Mapping[str, str], timeout_s: float = STORE_TIMEOUT_S
) -> None:
    """The store answers and takes a write: a small object is put under this node's probe key, then
    deleted (with grants, `cfg.grants`, it answers a LIST instead: the credential may be read-only).
    `labels` name each StoreConfig field as the user gave it (flag or config key)."""
    import botocore.exceptions

    from protocol.net.store import ObjectStore, StoreError

    endpoint, url = labels["endpoint_url"], cfg.endpoint_url
    creds = f"{labels['access_key']} / {labels['secret_key']}"
    try:
        store = ObjectStore(cfg, timeout_s=timeout_s)
    except StoreError as e:  # no credentials for a remote store, or only one of the pair
        raise UsageError(f"store credentials ({creds}): {e}") from e
    from urllib.parse import urlsplit

    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    check_reachable(endpoint, url, u.hostname or "", port, CONNECT_TIMEOUT_S, "the object store")
    key = keys.preflight_key(peer_id)
    try:
        if cfg.grants:
            log.info(
                "store check: a LIST only, no probe write: this node writes through grants (--store-grants)"
            )
            store.list(key)
        else:
            store.put(key, PROBE_BYTES)
            store.delete(key)
    except StoreError as e:
        cause = e.__cause__
        code = ""
        if isinstance(cause, botocore.exceptions.ClientError):
            code = str(cause.response.get("Error", {}).get("Code", ""))
        reason = one_line(str(cause or e))
        if code == "NoSuchBucket":
            raise bad_input(
                labels["bucket"], cfg.bucket, f"no such bucket at {url}; create it or name one that exists"
            ) from e
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"):
            raise UsageError(
                f"store credentials ({creds}, from {store.credential_source}) may not "
                f"{'read' if cfg.grants else 'write to'} bucket "
                f"{cfg.bucket!r} at {url}: {reason}"
            ) from e
        raise bad_input(
            endpoint, url, f"writing a probe object to bucket {cfg.bucket!r} failed: {reason}"
        ) from e


def _get_json(url: str, timeout_s: float) -> dict | None:
    """GET `url` as JSON, straight (no proxy from the environment); None on any failure."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            found = json.load(r)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def refuse_live_twin(dht: DHTClient, peer_id: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Refuse to start beside another live process with this peer id (the same key file): the swarm
    would see one node, and both would take its assignments. A fresh advert under our peer id whose
    health endpoint answers with our peer id is such a process; an advert whose endpoint does not
    answer is the leftover of a process that died, and this one takes its place."""
    try:
        found = dht.get_all(keys.NODES_KEY, NodeAdvert)
    except Exception as e:  # the check must not stop a node when the DHT is slow to answer
        log.warning("could not look for another process with peer id %s in the DHT: %s", peer_id, e)
        return
    twin = found.get(peer_id)
    if twin is None:
        return
    a = twin.body
    host = f"[{a.host}]" if ":" in a.host else a.host
    url = f"http://{host}:{a.health_port}/health"
    answer = _get_json(url, timeout_s)
    if answer is not None and answer.get("peer_id") == peer_id:
        raise UsageError(
            f"another crucible-node with peer id {peer_id} is running (health {url}); give this one its "
            "own --key-file (example: --key-file ~/.crucible/node2.key)"
        )
    log.info(
        "an advert of an earlier process with peer id %s remains, its health endpoint %s does not answer: "
        "this process takes its place",
        peer_id,
        url,
    )

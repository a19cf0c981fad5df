"""What a `crucible-coordinator serve` process is configured with, declared once (protocol/process/settings.py).

The coordinator CLI derives the command's flags from these declarations and parses its command line into a
`ServeConfig`; a coordinator-eligible node builds one from its own settings and starts its coordinator child
from it (`to_argv`, secrets by `to_env`). It lives in protocol/ because both sides use it and node/ never
imports coordinator/. The operator's own key (--operator-key-file) and the log flags are the CLI's, shared
by every command: a node's coordinator signs with the node's key under a certificate, never with that one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.net.store_config import StoreConfig
from protocol.process.cli_errors import EXAMPLE_PEER_ID
from protocol.process.settings import (
    BOOTSTRAP,
    check_fields,
    ipv4,
    optional,
    peer_id,
    positive,
    setting,
    setting_field,
    settings_of,
)

_STORE = {s.key: s for s in settings_of(StoreConfig)}
STORE_FIELDS = {
    s.option.removeprefix("--").replace("-", "_"): s.key
    for s in _STORE.values()
    if s.option and s.key != "grants"
}
"""serve's field for each store setting a flag gives, named after the flag (store_endpoint: --store-endpoint,
StoreConfig's endpoint_url); the region, config-file only, keeps its default, and so does `grants`, a node's
setting: a coordinator holds the full credential and issues the grants."""
STORE_FLAGS = tuple(STORE_FIELDS)
"""The store's settings, which other coordinator commands take too."""


@dataclass(kw_only=True, frozen=True)
class ServeConfig:
    """A coordinator process: the swarm it joins, the store it keeps runs' leases and checkpoints in, the key
    it signs with and its timers. Signing with its own key under a certificate needs key_file, certificate and
    operator_key together (the coordinator CLI checks that, with the operator key file it may sign with)."""

    bootstrap: list[str] = setting_field(BOOTSTRAP)
    host: str = setting(
        "127.0.0.1", "IPv4 address for this process's DHT peer", example="0.0.0.0", check=ipv4
    )
    store_endpoint: str = setting_field(_STORE["endpoint_url"])
    store_bucket: str = setting_field(_STORE["bucket"])
    store_access_key: str = setting_field(_STORE["access_key"])
    store_secret_key: str = setting_field(_STORE["secret_key"])
    store_part_mib: int = setting_field(_STORE["part_mib"])
    store_grant_hours: float = setting_field(_STORE["grant_hours"])
    lease_s: float = setting(
        15.0,
        "run lease duration, renewed every tick; another coordinator takes a lapsed one over",
        metavar="SECONDS",
        check=positive,
    )
    churn_grace_s: float = setting(
        10.0,
        "how long an assigned node may be silent before it counts as gone",
        metavar="SECONDS",
        check=positive,
    )
    key_file: str = setting(
        "",
        "sign with this key (a node's key file, never created) under --certificate, instead of the operator's "
        "key: the operator key need not be on this host",
        example="~/.crucible/node.key",
        metavar="PATH",
        shown="none: the operator's key",
    )
    certificate: str = setting(
        "",
        "the certificate `crucible-coordinator certify` issued for --key-file's peer id; checked at start "
        "(missing, expired, for another key or not signed by --operator-key: one line, exit 2)",
        example="coordinator.cert",
        metavar="PATH",
    )
    operator_key: str = setting(
        "",
        "with --certificate: peer id (12D3KooW...) of the operator whose runs this coordinator serves (the "
        "--operator-key its nodes trust)",
        example=EXAMPLE_PEER_ID,
        metavar="PEER_ID",
        check=optional(peer_id),
    )
    http_host: str = setting(
        "127.0.0.1",
        "address the dashboard and /metrics listen on (0.0.0.0 for every interface)",
        example="0.0.0.0",
        metavar="ADDR",
    )
    http_port: int = setting(
        0,
        "port of the dashboard (/), its API (/api/runs) and Prometheus /metrics; the URL is printed and "
        "published in each run's record for `status`",
        example=8080,
        metavar="PORT",
        shown="0: any free port",
    )

    def __post_init__(self) -> None:
        check_fields(self)


def store_of(given: Any) -> StoreConfig:
    """The store that `given`'s store_* values name: a ServeConfig's, or the parsed flags of a command that
    takes the store's (STORE_FLAGS)."""
    values = {key: getattr(given, name) for name, key in STORE_FIELDS.items()}
    for key, value in values.items():  # a number given as a flag is still the flag's text
        kind = _STORE[key].kind
        if kind in (int, float) and isinstance(value, str):
            try:
                values[key] = kind(value)
            except ValueError:
                raise ValueError(f"{_STORE[key].option} {value!r}: not a number") from None
    return StoreConfig(**values)


def store_fields(store: StoreConfig) -> dict[str, Any]:
    """ServeConfig's store_* values for `store` (its region aside: serve takes the default)."""
    return {name: getattr(store, key) for name, key in STORE_FIELDS.items()}

"""A node's settings, each declared once (protocol/process/settings.py): `crucible-node join`'s flags, the
keys of its config file's [node] and [store] sections, its --help and its errors all come from here.

[node] is `NodeConfig`; [store] is protocol/net/store_config.py's `StoreConfig`, whose fields declare the
store's settings for the coordinator's commands too. Nothing here imports torch, hivemind or boto3: the CLI
checks every value with these declarations before anything heavy is imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.messages import MAX_MBPS, MAX_PRICE_PER_HOUR, MAX_PROBE_BYTES, MAX_RTT_MS
from protocol.net.store_config import StoreConfig
from protocol.process.cli_errors import EXAMPLE_PEER_ID
from protocol.process.logs import LOG_FORMATS, LOG_LEVELS
from protocol.process.settings import (
    BOOTSTRAP,
    Setting,
    a_folder,
    check_fields,
    in_range,
    multiaddr,
    not_empty,
    one_of,
    optional,
    peer_id,
    setting,
    setting_field,
    settings_of,
    tcp_port,
)

NODE_KEY = "~/.crucible/node.key"
"""A joining node's default identity."""
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
ADVERTISED_PEERS = 16
"""Measured links a node advertises (the most recent ones), so the most it probes per round."""


def _fixed_port(what: str) -> str:
    """A port's help: fixed ports below Linux's ephemeral range, which outgoing connections draw from."""
    return (
        f"{what}; a fixed one below 32768: 32768-60999 is where Linux picks the ports of outgoing connections, "
        "so one there may be taken at a restart"
    )


def _device(value: str) -> str | None:
    """auto, cpu, cuda or cuda:N, in any case, spaces around it aside."""
    return None if _DEVICE.fullmatch(value.strip().lower()) else "is not one of auto, cpu, cuda, cuda:N"


@dataclass(kw_only=True, frozen=True)
class NodeConfig:
    """How a node joins the swarm and what it offers: the [node] section of `crucible-node join --config`
    and its flags, and the store ([store]). Built in code or by `node.cli.node_config` from what a user gave."""

    bootstrap: list[str] = setting_field(BOOTSTRAP)
    """DHT peers to join through; empty starts a new swarm (`crucible-node join` requires one)."""
    host: str = setting(
        "127.0.0.1", "address to listen on: 0.0.0.0 on a public host", example="0.0.0.0", check=not_empty
    )
    """Pipeline TCP, DHT and health all listen on it."""
    announce_host: str = setting(
        "",
        "address other nodes dial for pipeline traffic",
        example="203.0.113.20",
        shown="the --host address",
    )
    announce_port: int = setting(
        0,
        "pipeline TCP port other nodes dial, where a NAT, a container or a relay maps it to --port",
        example=31400,
        shown="0: the port the node listens on",
        check=tcp_port,
    )
    port: int = setting(
        0, _fixed_port("pipeline TCP port"), example=31400, shown="0: any free port", check=tcp_port
    )
    relay: str = setting(
        "",
        "multiaddr of a relay (`crucible-node bootstrap --relay-port` prints it): when no peer can dial this "
        "node's pipeline port, its upstream neighbour reaches it through the relay instead (a libp2p stream)",
        example="/ip4/203.0.113.7/tcp/31338/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
        metavar="MULTIADDR",
        shown="none: direct links only",
        check=optional(multiaddr),
    )
    use_relay: bool = setting(
        True,
        "stay direct-only: neither dial nor serve relayed pipeline links, even with --relay",
        example=False,
        flag="--no-relay",
    )
    reachability_peers: int = setting(
        5,
        "peers asked at join to dial this node's pipeline port back (reachable when half of those that answer "
        "succeed; 0: do not check, assume reachable)",
        flag=None,
        check=in_range(0, 16),
    )
    dht_port: int = setting(
        0, _fixed_port("DHT (libp2p) TCP port"), example=31337, shown="0: any free port", check=tcp_port
    )
    health_port: int = setting(
        0,
        _fixed_port("HTTP port for /health, /status, /metrics"),
        example=31401,
        shown="0: any free port",
        check=tcp_port,
    )
    key_file: str = setting(NODE_KEY, "Ed25519 identity seed file, created if missing", check=not_empty)
    """The peer id is derived from it."""
    operator_key: str = setting(
        "",
        "peer id (12D3KooW...) of the operator whose signed runs/assignments are trusted (nothing else is, "
        "but the coordinator keys it certified with `crucible-coordinator certify`)",
        example=EXAMPLE_PEER_ID,
        metavar="PEER_ID",
        required=True,
        check=optional(peer_id),
    )
    """With the coordinator keys it certified (protocol/trust/delegation.py); `crucible-node join` and the daemon
    refuse to start without it."""
    price_per_hour: float = setting(
        0.0,
        "USD per hour this host costs (advertised for placement and $/Mtok)",
        example=1.17,
        check=in_range(
            0,
            MAX_PRICE_PER_HOUR,
            problem=f"must be a finite number of USD per hour, 0 to {MAX_PRICE_PER_HOUR:g}",
        ),
    )
    torch_threads: int = setting(
        0,
        "torch intra-op threads",
        example=8,
        shown="0: torch's choice",
        check=in_range(0, 4096, problem="must be 0 (torch's choice) to 4096"),
    )
    device: str = setting(
        "auto",
        "where stages train: auto (the first CUDA GPU that no other node on this host has claimed, else the "
        "CPU), cuda, cuda:N or cpu",
        example="cuda:1",
        metavar="auto|cuda|cuda:N|cpu",
        check=_device,
    )
    compile: bool = setting(
        True,
        "do not torch.compile the stage on CUDA (compiling costs ~20 s at the first step, then ~20% more MFU)",
        example=False,
        flag="--no-compile",
    )
    log_level: str = setting(
        "INFO",
        f"log level: {', '.join(LOG_LEVELS)}",
        example="DEBUG",
        check=one_of(*LOG_LEVELS, normal=str.upper),
    )
    log_format: str = setting(
        "text",
        "log lines as text or json: one object per line (ts, level, logger, msg, pid)",
        example="json",
        metavar="|".join(LOG_FORMATS),
        check=one_of(*LOG_FORMATS),
    )
    emulate_mbps: float = setting(
        0.0,
        "emulate a slow link for tests on one host: pace this node's pipeline sends and bandwidth probes at "
        "this many Mbit/s (the run spec's [pipeline] shaper still applies; the slower wins)",
        example=20.0,
        shown="0: off",
        check=in_range(0, MAX_MBPS, "Mbit/s"),
    )
    emulate_delay_ms: float = setting(
        0.0,
        "emulated one-way delay on this node's pipeline frames",
        example=5.0,
        shown="0: off",
        check=in_range(0, MAX_RTT_MS, "ms"),
    )
    probe_every_s: float = setting(
        30.0,
        "while idle, measure bandwidth/RTT to a few peers this often, seconds",
        check=in_range(1, 86400, "seconds"),
    )
    probe_peers: int = setting(
        2,
        "peers measured per probe round, the least recently measured first (0: none)",
        check=in_range(0, ADVERTISED_PEERS),
    )
    probe_bytes: int = setting(
        1 << 20,
        "bytes per bandwidth probe",
        flag=None,
        shown="1048576: 1 MiB",
        check=in_range(1024, MAX_PROBE_BYTES, "bytes"),
    )
    coordinator_eligible: bool = setting(
        False,
        "be a candidate coordinator: run `crucible-coordinator serve` as a supervised child that signs with "
        "this node's key under --coordinator-certificate (needs --store-endpoint; node/coordinator_child.py)",
        example=True,
    )
    coordinator_certificate: str = setting(
        "",
        "the certificate the operator issued for this node's peer id (`crucible-coordinator certify`)",
        example="node.cert",
        metavar="PATH",
    )
    coordinator_lease_s: float = setting(
        15.0,
        "lease of the coordinator role, seconds: how soon another candidate takes over a dead leader's runs",
        check=in_range(1, 3600, "seconds"),
    )
    coordinator_churn_grace_s: float = setting(
        10.0,
        "the coordinator role's churn grace, seconds: how long a placed node may be silent before its replica "
        "counts as broken (gone after twice that)",
        check=in_range(1, 3600, "seconds"),
    )
    data_root: str = setting(
        "",
        "folder a run's relative train.data and train.tokenizer resolve under, and where corpus shards fetched "
        "from the store are cached (.crucible-cache); nodes on one host can hold different copies",
        example="/srv/corpora",
        metavar="PATH",
        shown="the working folder; cache in ~/.crucible/cache",
        check=optional(a_folder),
    )

    preempt_notice_s: float = setting(
        10.0,
        "on SIGTERM (a spot host's preemption notice), train on for at most this many seconds to the next "
        "round's checkpoint, then advertise 'leaving' so the coordinator replaces the node at once, and exit "
        "(0: stop at the next step)",
        check=in_range(0, 600, "seconds"),
    )
    advert_ttl_s: float = setting(
        30.0,
        "DHT advert lifetime in seconds, refreshed every third of it (at most 5 s): a coordinator counts a node "
        "gone about two churn graces after its last refresh",
        check=in_range(3, 3600, "seconds"),
    )
    poll_s: float = setting(
        1.0,
        "how often to look for an assignment or a stop request, seconds",
        flag=None,
        check=in_range(0.01, 3600, "seconds"),
    )
    store: StoreConfig | None = None
    """The object store the run synchronises through ([store]: StoreConfig's settings)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.coordinator_eligible and not self.coordinator_certificate:
            raise ValueError(
                "coordinator_eligible needs coordinator_certificate: the operator issues one with "
                "`crucible-coordinator certify PEER_ID --expires 30d --any-run --out node.cert` "
                "(example: --coordinator-certificate node.cert)"
            )
        if self.coordinator_eligible and self.store is None:
            raise ValueError(
                "coordinator_eligible needs a store (--store-endpoint): the leader holds its lease there"
            )


SETTINGS: tuple[Setting, ...] = settings_of(NodeConfig, "node") + settings_of(StoreConfig, "store")
"""Every `join` setting: [node] (NodeConfig), then [store] (StoreConfig)."""

"""`crucible-node`: run a GPU host as a Crucible node.

crucible-node bootstrap                       start the first DHT peer of a new swarm, print its multiaddr
crucible-node join --bootstrap MULTIADDR ...  join a swarm, advertise, train whatever stage is assigned
crucible-node identity                        print this host's peer id (creating its key if needed)

Every input is checked before torch and hivemind are imported (they take seconds) and before anything
starts; `join` then checks this host (key file, ports, device), then the store (required: every stage syncs
through it) and the bootstrap peer (node/preflight.py). A mistake ends with one line that names the flag or
config key, the value, what is wrong and an example, and exit code 2 (protocol/process/cli_errors.py); `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from protocol.identity import Identity, SignatureError
from protocol.messages import MAX_PRICE_PER_HOUR
from protocol.process.cli_errors import (
    EXAMPLE_MULTIADDR,
    EXAMPLE_PEER_ID,
    ArgumentParser,
    UsageError,
    bad_input,
    check_keys,
    check_multiaddr,
    check_peer_id,
    check_url,
    load_toml,
    run_cli,
)
from protocol.process.logs import LOG_FORMATS, LOG_LEVELS, setup_logging, version
from protocol.process.signals import install_stop_signals

log = logging.getLogger("crucible.node")

NODE_KEY = "~/.crucible/node.key"
"""A joining node's default identity."""
BOOTSTRAP_KEY = "~/.crucible/bootstrap.key"
"""The bootstrap peer's default identity: its own, so a bootstrap peer and a node can share a host."""
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _port_help(what: str, example: int) -> str:
    """A port flag's help: fixed ports below Linux's ephemeral range (32768-60999), which outgoing
    connections draw from, so one there may be taken by a connection when the node (re)starts."""
    return (
        f"{what} (default: any free port; a fixed one below 32768, e.g. {example}: 32768-60999 is where "
        "Linux picks the ports of outgoing connections, so one there may be taken at a restart)"
    )


@dataclass(frozen=True)
class Setting:
    """One `join` setting: a key of the config file's [node] or [store] section and, mostly, a flag
    (flags override the file). The parser, the config file's valid keys and the error messages all come
    from `SETTINGS`, so a flag cannot exist without its key."""

    section: str
    key: str
    kind: type
    """str, int, float, bool or list (of str)."""
    example: Any
    """A right value, shown in the error for a wrong one."""
    help: str
    flag: str | None = None
    """None: config file only."""
    metavar: str | None = None
    """What --help shows for the value (default: the key in capitals)."""


SETTINGS: tuple[Setting, ...] = (
    Setting("node", "bootstrap", list, [EXAMPLE_MULTIADDR], "multiaddr of a swarm peer, repeatable "
            f"(required; example: {EXAMPLE_MULTIADDR})", "--bootstrap", "MULTIADDR"),
    Setting("node", "host", str, "0.0.0.0",
            "address to listen on (default 127.0.0.1; use 0.0.0.0 on a public host)", "--host"),
    Setting("node", "announce_host", str, "203.0.113.20",
            "address other nodes dial for pipeline traffic (default: --host)", "--announce-host"),
    Setting("node", "port", int, 31400, _port_help("pipeline TCP port", 31400), "--port"),
    Setting("node", "dht_port", int, 31337, _port_help("DHT (libp2p) TCP port", 31337), "--dht-port"),
    Setting("node", "health_port", int, 31401, _port_help("HTTP port for /health, /status, /metrics", 31401),
            "--health-port"),
    Setting("node", "key_file", str, NODE_KEY,
            f"Ed25519 identity seed file (default {NODE_KEY}; created if missing)", "--key-file"),
    Setting("node", "operator_key", str, EXAMPLE_PEER_ID,
            "required: peer id (12D3KooW...) of the operator whose signed runs/assignments are trusted "
            "(nothing else is, but the coordinator keys it certified with `crucible-coordinator certify`)",
            "--operator-key", "PEER_ID"),
    Setting("node", "price_per_hour", float, 1.17, "USD per hour this host costs (advertised)",
            "--price-per-hour"),
    Setting("node", "torch_threads", int, 8, "torch intra-op threads (default: torch's choice)",
            "--torch-threads"),
    Setting("node", "device", str, "cuda:1",
            "where stages train: auto|cuda|cuda:N|cpu (default auto: the first CUDA GPU that no other node "
            "on this host has claimed, else the CPU)", "--device", "auto|cuda|cuda:N|cpu"),
    Setting("node", "compile", bool, False,
            "do not torch.compile the stage on CUDA (compiling costs ~20 s at the first step, then pays); "
            "in the file: compile = false", "--no-compile"),
    Setting("node", "log_level", str, "INFO", f"log level: {', '.join(LOG_LEVELS)} (default INFO)",
            "--log-level"),
    Setting("node", "log_format", str, "json",
            "log lines as text (default) or json: one object per line (ts, level, logger, msg, pid)",
            "--log-format", "text|json"),
    Setting("node", "emulate_mbps", float, 20.0,
            "emulate a slow link for tests on one host: pace this node's pipeline sends and bandwidth "
            "probes at this many Mbit/s (default 0: off)", "--emulate-mbps"),
    Setting("node", "emulate_delay_ms", float, 5.0,
            "emulated one-way delay on this node's pipeline frames (default 0: off)", "--emulate-delay-ms"),
    Setting("node", "probe_every_s", float, 30.0,
            "while idle, measure bandwidth/RTT to a few peers this often, seconds (default 30)",
            "--probe-every-s"),
    Setting("node", "probe_peers", int, 2, "peers measured per probe round (default 2; 0: none)",
            "--probe-peers"),
    Setting("node", "probe_bytes", int, 1048576, "bytes per bandwidth probe (default 1 MiB)"),
    Setting("node", "coordinator_eligible", bool, True,
            "be a candidate coordinator: run `crucible-coordinator serve` as a supervised child that signs "
            "with this node's key under --coordinator-certificate (needs --store-endpoint)",
            "--coordinator-eligible"),
    Setting("node", "coordinator_certificate", str, "node.cert",
            "the certificate the operator issued for this node's peer id (`crucible-coordinator certify`)",
            "--coordinator-certificate", "PATH"),
    Setting("node", "coordinator_lease_s", float, 15.0,
            "lease of the coordinator role, seconds: how soon another candidate takes over (default 15)",
            "--coordinator-lease-s"),
    Setting("node", "coordinator_churn_grace_s", float, 10.0,
            "the coordinator role's churn grace, seconds: how long a placed node may be silent before its "
            "replica counts as broken (gone after twice that; default 10)", "--coordinator-churn-grace-s"),
    Setting("node", "data_root", str, "/srv/corpora",
            "folder a run's relative train.data and train.tokenizer resolve under, and where corpus shards "
            "fetched from the store are cached (.crucible-cache); nodes on one host can hold different "
            "copies (default: the working folder; cache in ~/.crucible/cache)", "--data-root", "PATH"),
    Setting("node", "advert_ttl_s", float, 30.0,
            "DHT advert lifetime in seconds, refreshed every third of it (at most 5 s): a coordinator "
            "counts a node gone about two churn graces after its last refresh (default 30)",
            "--advert-ttl-s"),
    Setting("node", "poll_s", float, 1.0, "how often to look for an assignment, seconds (default 1)"),
    Setting("store", "endpoint_url", str, "https://ACCOUNT.r2.cloudflarestorage.com",
            "required: S3-compatible endpoint URL the runs sync through (example: "
            "https://ACCOUNT.r2.cloudflarestorage.com); checked at start: it must answer and take a write",
            "--store-endpoint", "URL"),
    Setting("store", "bucket", str, "crucible", "bucket name (default: crucible)", "--store-bucket"),
    Setting("store", "access_key", str, "AKIA...", "access key id (default: $AWS_ACCESS_KEY_ID)",
            "--store-access-key"),
    Setting("store", "secret_key", str, "wJalr...", "secret key (default: $AWS_SECRET_ACCESS_KEY)",
            "--store-secret-key"),
    Setting("store", "region", str, "auto", "region name (default auto, as R2 takes it)"),
)  # fmt: skip
SECTIONS = ("node", "store")
NOT_FOR_DAEMON = {("node", "log_level"), ("node", "log_format")}
"""Settings the CLI uses itself; the rest become NodeConfig (and its StoreConfig)."""


def _dest(s: Setting) -> str:
    return f"{s.section}.{s.key}"


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def build_parser() -> ArgumentParser:
    ap = ArgumentParser(
        prog="crucible-node",
        description="Crucible node: contributes this host's accelerator to distributed pre-training runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  crucible-node join --bootstrap {EXAMPLE_MULTIADDR} \\\n"
        "      --store-endpoint https://ACCOUNT.r2.cloudflarestorage.com --store-bucket crucible \\\n"
        "      --operator-key 12D3KooW... --price-per-hour 1.17",
    )
    _add_debug(ap)  # before the subcommand too: `crucible-node --debug join ...`
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{bootstrap,join,identity}")

    b = sub.add_parser("bootstrap", help="start the first DHT peer of a new swarm and print its multiaddr")
    b.add_argument(
        "--key-file",
        default=BOOTSTRAP_KEY,
        help=f"identity seed file (default {BOOTSTRAP_KEY}; created if missing)",
    )
    b.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    b.add_argument("--dht-port", default="0", help=_port_help("DHT (libp2p) TCP port", 31337))
    b.add_argument("--log-level", default="INFO", help=f"{', '.join(LOG_LEVELS)} (default INFO)")
    b.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text (default) or json: one object per line",
    )
    _add_debug(b)

    j = sub.add_parser(
        "join",
        help="join a swarm and serve assigned pipeline stages",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example: crucible-node join --bootstrap {EXAMPLE_MULTIADDR} \\\n"
        f"    --operator-key {EXAMPLE_PEER_ID} --store-endpoint http://127.0.0.1:9000\n"
        "Every flag can be set in the --config file instead ([node] and [store], docs/examples/node.toml).",
    )
    j.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with [node] and [store] sections (docs/examples/node.toml); flags override it",
    )
    for s in SETTINGS:
        if s.flag is None:
            continue
        metavar = s.metavar or s.key.upper()
        if s.kind is list:
            j.add_argument(s.flag, dest=_dest(s), action="append", metavar=metavar, help=s.help)
        elif s.kind is bool:
            const = not s.flag.startswith("--no-")  # --no-compile turns off; --coordinator-eligible on
            j.add_argument(s.flag, dest=_dest(s), action="store_const", const=const, help=s.help)
        else:
            j.add_argument(s.flag, dest=_dest(s), metavar=metavar, help=s.help)
    _add_debug(j)

    i = sub.add_parser("identity", help="print this host's peer id, creating its key if needed")
    i.add_argument("--key-file", default=NODE_KEY, help=f"identity seed file (default {NODE_KEY})")
    _add_debug(i)
    return ap


# --- settings: the config file and flags, checked --------------------------------------------------
@dataclass
class JoinSettings:
    """The `join` settings as given (file, then flags over it), each with the label of where it came from."""

    values: dict[tuple[str, str], Any] = field(default_factory=dict)
    given: dict[tuple[str, str], Any] = field(default_factory=dict)
    """Each value as the user wrote it (a flag's text), for the error messages."""
    labels: dict[tuple[str, str], str] = field(default_factory=dict)

    def get(self, section: str, key: str, default: Any = None) -> Any:
        return self.values.get((section, key), default)

    def label(self, section: str, key: str) -> str:
        """The flag, or the config key with its file, the value came from; the flag when not given."""
        s = _SETTING[(section, key)]
        return self.labels.get((section, key)) or s.flag or f"[{section}] {key}"

    def example(self, section: str, key: str) -> str:
        s = _SETTING[(section, key)]
        label = self.label(section, key)
        if not label.startswith("--"):
            return f"{key} = {json.dumps(s.example)}"
        if s.kind is bool:
            return label
        if s.kind is list:
            return f"{label} {s.example[0]}"
        return f"{label} {s.example}"

    def refuse(self, section: str, key: str, value: Any, problem: str) -> UsageError:
        return bad_input(self.label(section, key), value, problem, self.example(section, key))


_SETTING = {(s.section, s.key): s for s in SETTINGS}
_KIND_WORDS = {
    str: "a string",
    int: "a whole number",
    float: "a number",
    bool: "true or false",
    list: "a list",
}


def _from_file(st: JoinSettings, path: str) -> None:
    raw = load_toml("--config", path)
    valid = ", ".join(f"[{name}]" for name in SECTIONS)
    for name, table in raw.items():  # a misspelt section would drop what it holds (an operator key)
        if name not in SECTIONS or not isinstance(table, dict):
            what = (
                f"unknown section [{name}]" if isinstance(table, dict) else f"key {name!r} outside a section"
            )
            raise UsageError(f"--config {path}: {what}; valid sections: {valid} (docs/examples/node.toml)")
    for section in SECTIONS:
        table = raw.get(section, {})
        allowed = [s.key for s in SETTINGS if s.section == section]
        check_keys(f"--config {path} [{section}]", table, allowed)
        for key, value in table.items():
            st.labels[(section, key)] = f"[{section}] {key} in {path}"
            st.given[(section, key)] = value
            st.values[(section, key)] = _typed(st, _SETTING[(section, key)], value)


def _typed(st: JoinSettings, s: Setting, value: Any) -> Any:
    """A config file value of the setting's kind (TOML values come typed: an int for a float is fine)."""
    ok = {
        str: isinstance(value, str),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        bool: isinstance(value, bool),
        list: isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
    }[s.kind]
    if not ok:
        what = "a list of strings" if s.kind is list else _KIND_WORDS[s.kind]
        raise st.refuse(s.section, s.key, value, f"must be {what}")
    if s.kind is list and isinstance(value, str):
        return [value]
    return float(value) if s.kind is float else value


def _from_flags(st: JoinSettings, args: argparse.Namespace) -> None:
    for s in SETTINGS:
        value = getattr(args, _dest(s), None) if s.flag else None
        if value is None:
            continue
        st.labels[(s.section, s.key)] = s.flag or ""
        st.given[(s.section, s.key)] = value
        if s.kind in (int, float):
            try:
                number = int(value) if s.kind is int else float(value)
            except ValueError:
                raise st.refuse(s.section, s.key, value, f"not {_KIND_WORDS[s.kind]}") from None
            st.values[(s.section, s.key)] = number
        else:
            st.values[(s.section, s.key)] = value


def _check_settings(st: JoinSettings) -> None:
    """Each value within its rules (the same rules NodeConfig holds to, checked here without torch)."""
    for (section, key), v in st.values.items():
        shown = st.given.get((section, key), v)
        bad = functools.partial(st.refuse, section, key, shown)  # bad(problem) -> the UsageError
        if key in ("port", "dht_port", "health_port") and not 0 <= v <= 65535:
            raise bad("not a TCP port: 1-65535, or 0 for any free port")
        if key == "price_per_hour" and not (math.isfinite(v) and 0 <= v <= MAX_PRICE_PER_HOUR):
            raise bad(f"must be a finite number of USD per hour, 0 to {MAX_PRICE_PER_HOUR:g}")
        if key == "torch_threads" and not 0 <= v <= 4096:
            raise bad("must be 0 (torch's choice) to 4096")
        if key == "advert_ttl_s" and not (math.isfinite(v) and 3 <= v <= 3600):
            raise bad("must be 3 to 3600 seconds")
        if key == "poll_s" and not (math.isfinite(v) and 0.01 <= v <= 3600):
            raise bad("must be 0.01 to 3600 seconds")
        if key == "device" and not _DEVICE.fullmatch(v.strip().lower()):
            raise bad("not one of auto, cpu, cuda, cuda:N")
        if key == "log_level" and v.upper() not in LOG_LEVELS:
            raise bad(f"not one of {', '.join(LOG_LEVELS)}")
        if key == "log_format" and v not in LOG_FORMATS:
            raise bad(f"not one of {', '.join(LOG_FORMATS)}")
        if key in ("host", "key_file", "bucket", "region") and not v.strip():
            raise bad("must not be empty")
        if key == "data_root" and v and not Path(v).expanduser().is_dir():
            raise bad("is not a folder")
        if key == "operator_key":
            check_peer_id(st.label(section, key), v, st.example(section, key))
        if key == "bootstrap":
            for addr in v:
                check_multiaddr(st.label(section, key), addr, EXAMPLE_MULTIADDR)
        if key == "endpoint_url":
            check_url(st.label(section, key), v, "https://ACCOUNT.r2.cloudflarestorage.com")
    if not st.get("node", "bootstrap"):
        raise UsageError(
            f"--bootstrap is required (example: --bootstrap {EXAMPLE_MULTIADDR}), or bootstrap = [...] in "
            "[node] of --config; start a new swarm with `crucible-node bootstrap`"
        )
    if not st.get("node", "operator_key"):
        raise UsageError(
            "--operator-key is required: a node takes runs and assignments only from the operator it "
            "trusts. Give the operator's peer id (the operator prints it with `crucible-coordinator init`; "
            f"example: --operator-key {EXAMPLE_PEER_ID}), or set operator_key in [node]"
        )
    store_keys = [k for (section, k) in st.values if section == "store"]
    if store_keys and not st.get("store", "endpoint_url"):
        raise UsageError(
            f"a store is configured ({', '.join(st.label('store', k) for k in store_keys)}) without an "
            "endpoint: pass --store-endpoint URL (example: --store-endpoint https://ACCOUNT.r2.cloudflarestorage.com)"
        )
    if not st.get("store", "endpoint_url"):  # every stage syncs through it: a node without one takes no work
        raise UsageError(
            "--store-endpoint is required: every stage exchanges its outer-sync fragments and checkpoints "
            "through the run's object store, so a node without one can never take work. Give the "
            "operator's S3-compatible endpoint (example: --store-endpoint "
            "https://ACCOUNT.r2.cloudflarestorage.com --store-bucket crucible), or endpoint_url in [store]"
        )
    if bool(st.get("store", "access_key")) != bool(st.get("store", "secret_key")):
        raise UsageError(
            f"store credentials: give both {st.label('store', 'access_key')} and "
            f"{st.label('store', 'secret_key')}, or neither (to use $AWS_ACCESS_KEY_ID / $AWS_SECRET_ACCESS_KEY)"
        )


def join_settings(args: argparse.Namespace) -> JoinSettings:
    """The config file (if any), then the flags over it, each value checked; no torch, no network."""
    st = JoinSettings()
    if args.config:
        _from_file(st, args.config)
    _from_flags(st, args)
    _check_settings(st)
    return st


def node_config_data(st: JoinSettings) -> dict[str, Any]:
    """The settings as the dict `from_dict(NodeConfig, ...)` takes."""
    data: dict[str, Any] = {
        key: v
        for (section, key), v in st.values.items()
        if section == "node" and (section, key) not in NOT_FOR_DAEMON
    }
    store = {key: v for (section, key), v in st.values.items() if section == "store"}
    if store:
        data["store"] = store
    return data


# --- commands ------------------------------------------------------------------------------------
def _identity(label: str, key_file: str) -> Identity:
    """This host's identity from `key_file` (created if missing); a file that is no key is refused."""
    example = (
        f"{label} ~/.crucible/node2.key" if label.startswith("--") else 'key_file = "~/.crucible/node2.key"'
    )
    path = Path(key_file).expanduser()
    try:
        if path.is_file() and path.stat().st_size != 32:
            raise bad_input(
                label,
                key_file,
                f"holds {path.stat().st_size} bytes, not a 32-byte Ed25519 seed (damaged, or not a key file); "
                "point it at the right file, or delete the file for a new identity (a new peer id)",
                example,
            )
        return Identity.load_or_create(path)
    except (SignatureError, ValueError) as e:
        raise bad_input(label, key_file, f"not an identity seed: {e}", example) from e
    except OSError as e:  # a folder, no permission to read it or to create it
        raise bad_input(label, key_file, f"cannot read or create the identity file: {e.strerror or e}") from e


def _logging(level: str, fmt: str = "text") -> None:
    setup_logging(level, fmt)


def _install_signals(on_stop: Any) -> None:
    # a worker stops at its next step, a checkpoint upload finishes: 15 s, then the stacks and exit
    install_stop_signals(on_stop, grace_s=15.0)


def cmd_identity(args: argparse.Namespace) -> int:
    print(_identity("--key-file", args.key_file).peer_id)
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from node.preflight import check_host, check_ports, hold_key_file, refuse_if_taken

    if args.log_level.upper() not in LOG_LEVELS:
        raise bad_input(
            "--log-level", args.log_level, f"not one of {', '.join(LOG_LEVELS)}", "--log-level INFO"
        )
    try:
        port = int(args.dht_port)
    except ValueError:
        raise bad_input("--dht-port", args.dht_port, "not a whole number", "--dht-port 31337") from None
    if not 0 <= port <= 65535:
        raise bad_input(
            "--dht-port", args.dht_port, "not a TCP port: 1-65535, or 0 for any free port", "--dht-port 31337"
        )
    ident = _identity("--key-file", args.key_file)
    key_lock = hold_key_file("--key-file", Path(args.key_file).expanduser(), ident.peer_id)
    check_host("--host", args.host)
    check_ports(args.host, [("--dht-port", port)])
    _logging(args.log_level, args.log_format)
    import threading

    from protocol.net.dht_client import DHTClient

    try:
        dht = DHTClient(ident, host=args.host, port=port)
    except Exception as e:  # taken since the check above
        refuse_if_taken(e, "--dht-port", args.host, port)
        raise
    stop = threading.Event()
    _install_signals(stop.set)
    for addr in dht.visible_maddrs():
        print(f"BOOTSTRAP {addr}", flush=True)
    print(f"crucible-node bootstrap peer ready: peer_id={dht.peer_id} (Ctrl-C to stop)", flush=True)
    stop.wait()
    dht.shutdown()
    if key_lock is not None:
        key_lock.close()
    return 0


def preflight_join(st: JoinSettings) -> tuple[Identity, IO[str] | None]:
    """The checks before anything starts (module docstring); returns the node's identity and the lock
    on its key file (held while the process lives)."""
    from node.preflight import check_bootstrap, check_host, check_ports, check_store, hold_key_file

    key_label, key_file = st.label("node", "key_file"), st.get("node", "key_file", NODE_KEY)
    ident = _identity(key_label, key_file)
    key_lock = hold_key_file(key_label, Path(key_file).expanduser(), ident.peer_id)
    bootstrap = st.get("node", "bootstrap")
    for addr in bootstrap:
        if addr.rstrip("/").endswith(f"/p2p/{ident.peer_id}"):
            raise bad_input(
                st.label("node", "key_file"),
                st.get("node", "key_file", NODE_KEY),
                f"holds the bootstrap peer's own identity ({ident.peer_id}, {addr}); a node needs its own key",
                f"--key-file {NODE_KEY} (the default)",
            )
    host = st.get("node", "host", "127.0.0.1")
    check_host(st.label("node", "host"), host)
    check_ports(
        host, [(st.label("node", k), st.get("node", k, 0)) for k in ("port", "health_port", "dht_port")]
    )
    device = st.get("node", "device", "auto").strip().lower()
    if device not in ("auto", "cpu"):  # a GPU named outright: ask torch (seconds) whether it is there
        from node.device import DeviceError, resolve_device

        try:
            resolve_device(device)  # claims nothing for a named GPU
        except DeviceError as e:
            raise UsageError(str(e).replace("--device", st.label("node", "device"), 1)) from e
    # this host first (key, ports, device), then the network: the store, the bootstrap peer
    from protocol.net.store import StoreConfig

    store = {k: v for (section, k), v in st.values.items() if section == "store"}
    labels = {s.key: st.label("store", s.key) for s in SETTINGS if s.section == "store"}
    check_store(StoreConfig(**store), ident.peer_id, labels)
    check_bootstrap(st.label("node", "bootstrap"), bootstrap)
    return ident, key_lock


def cmd_join(args: argparse.Namespace) -> int:
    st = join_settings(args)
    _logging(st.get("node", "log_level", "INFO"), st.get("node", "log_format", "text"))
    ident, key_lock = preflight_join(st)

    # the heavy part: torch, hivemind
    from node.daemon import NodeConfig, NodeDaemon
    from protocol.net.dht_client import BootstrapError
    from protocol.schema import SchemaError, from_dict

    try:
        cfg = from_dict(NodeConfig, node_config_data(st))
    except SchemaError as e:  # the checks above hold to the same rules; this is the backstop
        raise UsageError(str(e)) from e
    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    try:
        daemon = NodeDaemon(cfg, ident)
    except BootstrapError as e:
        raise UsageError(f"{st.label('node', 'bootstrap')}: {e}") from e
    except ValueError as e:  # e.g. --device cuda on a host without one
        raise UsageError(str(e)) from e
    _install_signals(daemon.stop_event.set)
    print(
        f"crucible-node ready: peer_id={daemon.peer_id} pipeline={cfg.announce_host or cfg.host}:{daemon.acceptor.port} "
        f"health=http://{cfg.host}:{daemon.health.port}/health device={daemon.device} "
        f"tflops={daemon.tflops:.3f} ref_block_ms={daemon.ref_block_s * 1e3:.1f} store_mbps={daemon.store_mbps:.0f}",
        flush=True,
    )
    try:
        daemon.serve()
    finally:
        daemon.shutdown()
        if key_lock is not None:
            key_lock.close()
    log.info("node stopped cleanly")
    return 0


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "identity":
        return cmd_identity(args)
    if args.command == "bootstrap":
        return cmd_bootstrap(args)
    return cmd_join(args)


def main(argv: list[str] | None = None) -> int:
    return run_cli("crucible-node", _main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""`crucible-node`: run a GPU host as a Crucible node.

crucible-node bootstrap                       start the first DHT peer of a new swarm, print its multiaddr
crucible-node join --bootstrap MULTIADDR ...  join a swarm, advertise, train whatever stage is assigned
crucible-node identity                        print this host's peer id (creating its key if needed)

Every setting is declared once, in node/config.py (the store's in protocol/net/store_config.py): the flags,
the config file's keys, --help and the checks come from there. Every input is checked before torch and
hivemind are imported (they take seconds) and before anything starts; `join` then checks this host (key file,
ports, device), then the store (required: every stage syncs through it) and the bootstrap peer
(node/preflight.py). A mistake ends with one line that names the flag or config key, the value, what is wrong
and an example, and exit code 2 (protocol/process/cli_errors.py); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from node.config import NODE_KEY, SETTINGS, NodeConfig
from protocol.identity import Identity, SignatureError
from protocol.net.store_config import StoreConfig
from protocol.process.cli_errors import (
    EXAMPLE_MULTIADDR,
    EXAMPLE_PEER_ID,
    ArgumentParser,
    UsageError,
    bad_input,
    run_cli,
)
from protocol.process.logs import setup_logging, version
from protocol.process.settings import Setting, SettingValues, add_flags, in_range
from protocol.process.signals import install_stop_signals

log = logging.getLogger("crucible.node")

BOOTSTRAP_KEY = "~/.crucible/bootstrap.key"
"""The bootstrap peer's default identity: its own, so a bootstrap peer and a node can share a host."""
EXAMPLE_FILE = "docs/examples/node.toml"
_NODE = {s.key: s for s in SETTINGS if s.section == "node"}
RELAY_PORT = Setting(
    key="relay_port",
    default=-1,
    help="also serve as the swarm's relay on this TCP port (0: any free port): nodes nobody can dial are reached "
    "through it (`join --relay` takes the address it prints); it forwards their pipeline bytes",
    example=31338,
    shown="-1: no relay",
    check=in_range(-1, 65535, problem="must be -1 (no relay) or a TCP port 0-65535"),
)
RELAY_LIMIT_MB = Setting(
    key="relay_limit_mb",
    default=0,
    help="the relay resets a relayed connection after this many MiB in one direction; relayed links resume "
    "on a new one (tests set it to cut links on purpose)",
    shown="0: p2pd's own limit",
    check=in_range(0, 1 << 20, problem="must be 0 (p2pd's limit) to 1048576 MiB"),
)
BOOTSTRAP_SETTINGS: tuple[Setting, ...] = (
    replace(_NODE["key_file"], default=BOOTSTRAP_KEY, help="identity seed file, created if missing"),
    _NODE["host"],
    _NODE["dht_port"],
    RELAY_PORT,
    RELAY_LIMIT_MB,
    _NODE["log_level"],
    _NODE["log_format"],
)
"""`bootstrap`'s settings: the node's own, flags only (a bootstrap peer has its own key file)."""


def _flags_only(settings: tuple[Setting, ...]) -> tuple[Setting, ...]:
    """Settings as a command without a config file takes them (args.key_file, not args["node.key_file"])."""
    return tuple(replace(s, section="") for s in settings)


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
    add_flags(b, _flags_only(BOOTSTRAP_SETTINGS))
    _add_debug(b)

    file_only = "\n".join(f"  [{s.section}] {s.key}: {s.help_text()}" for s in SETTINGS if s.option is None)
    j = sub.add_parser(
        "join",
        help="join a swarm and serve assigned pipeline stages",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example: crucible-node join --bootstrap {EXAMPLE_MULTIADDR} \\\n"
        f"    --operator-key {EXAMPLE_PEER_ID} --store-endpoint http://127.0.0.1:9000\n"
        f"Every flag can be set in the --config file instead ([node] and [store], {EXAMPLE_FILE}); "
        f"these keys only there:\n{file_only}",
    )
    j.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML file with [node] and [store] sections ({EXAMPLE_FILE}); flags override it",
    )
    add_flags(j, SETTINGS, defaults=False)  # a flag not given leaves the file's value
    _add_debug(j)

    i = sub.add_parser("identity", help="print this host's peer id, creating its key if needed")
    add_flags(i, _flags_only((_NODE["key_file"],)))
    _add_debug(i)
    return ap


# --- settings: the config file and flags, checked --------------------------------------------------
def _check_join(st: SettingValues) -> None:
    """What `join` needs beyond each value's own rules: a swarm, a trust root and a store."""
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
    store_keys = list(st.section("store"))
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


def join_settings(args: argparse.Namespace) -> SettingValues:
    """The config file (if any), then the flags over it, each value checked; no torch, no network."""
    st = SettingValues.of(SETTINGS)
    if args.config:
        st.read_file(args.config, EXAMPLE_FILE)
    st.read_flags(args)
    st.check()
    _check_join(st)
    return st


def node_config(st: SettingValues) -> NodeConfig:
    """The daemon's config from the settings given (the rest: NodeConfig's defaults); a rule that spans
    several settings (an eligible node's certificate) is refused as a UsageError."""
    store = st.section("store")
    try:
        return NodeConfig(**st.section("node"), store=StoreConfig(**store) if store else None)
    except ValueError as e:
        raise UsageError(str(e)) from e


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


def _install_signals(on_stop: Any, extra_s: float = 0.0) -> None:
    # a worker stops at its next step (or, under a preemption notice, after extra_s at most), a checkpoint
    # upload finishes: 15 s more, then the stacks and exit
    install_stop_signals(on_stop, grace_s=15.0 + extra_s)


def cmd_identity(args: argparse.Namespace) -> int:
    print(_identity("--key-file", args.key_file).peer_id)
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from node.preflight import check_host, check_ports, hold_key_file, refuse_if_taken

    st = SettingValues.of(_flags_only(BOOTSTRAP_SETTINGS))
    st.read_flags(args)
    st.check()
    key_file, host, port = st.get("", "key_file"), st.get("", "host"), st.get("", "dht_port")
    ident = _identity("--key-file", key_file)
    key_lock = hold_key_file("--key-file", Path(key_file).expanduser(), ident.peer_id)
    check_host("--host", host)
    check_ports(host, [("--dht-port", port)])
    _logging(st.get("", "log_level"), st.get("", "log_format"))
    import threading

    from protocol.net.dht_client import DHTClient

    try:
        dht = DHTClient(ident, host=host, port=port)
    except Exception as e:  # taken since the check above
        refuse_if_taken(e, "--dht-port", host, port)
        raise
    stop = threading.Event()
    _install_signals(stop.set)
    for addr in dht.visible_maddrs():
        print(f"BOOTSTRAP {addr}", flush=True)
    relay = None
    if st.get("", "relay_port") >= 0:
        from node.pipeline.fallback import Relay

        limit = st.get("", "relay_limit_mb") << 20
        relay = Relay(host, st.get("", "relay_port"), data_limit=limit, check=not limit)
        print(f"RELAY {relay.address}", flush=True)
    print(f"crucible-node bootstrap peer ready: peer_id={dht.peer_id} (Ctrl-C to stop)", flush=True)
    stop.wait()
    if relay is not None:
        relay.close()
    dht.shutdown()
    if key_lock is not None:
        key_lock.close()
    return 0


def preflight_join(st: SettingValues, cfg: NodeConfig) -> tuple[Identity, IO[str] | None]:
    """The checks before anything starts (module docstring); returns the node's identity and the lock
    on its key file (held while the process lives)."""
    from node.preflight import check_bootstrap, check_host, check_ports, check_store, hold_key_file

    key_label = st.label("node", "key_file")
    ident = _identity(key_label, cfg.key_file)
    key_lock = hold_key_file(key_label, Path(cfg.key_file).expanduser(), ident.peer_id)
    for addr in cfg.bootstrap:
        if addr.rstrip("/").endswith(f"/p2p/{ident.peer_id}"):
            raise bad_input(
                key_label,
                cfg.key_file,
                f"holds the bootstrap peer's own identity ({ident.peer_id}, {addr}); a node needs its own key",
                f"--key-file {NODE_KEY} (the default)",
            )
    check_host(st.label("node", "host"), cfg.host)
    check_ports(
        cfg.host, [(st.label("node", k), getattr(cfg, k)) for k in ("port", "health_port", "dht_port")]
    )
    device = cfg.device.strip().lower()
    if device not in ("auto", "cpu"):  # a GPU named outright: ask torch (seconds) whether it is there
        from node.device import DeviceError, resolve_device

        try:
            resolve_device(device)  # claims nothing for a named GPU
        except DeviceError as e:
            raise UsageError(str(e).replace("--device", st.label("node", "device"), 1)) from e
    # this host first (key, ports, device), then the network: the store, the bootstrap peer
    assert cfg.store is not None  # join requires one (_check_join)
    labels = {s.key: st.label("store", s.key) for s in SETTINGS if s.section == "store"}
    check_store(cfg.store, ident.peer_id, labels)
    check_bootstrap(st.label("node", "bootstrap"), cfg.bootstrap)
    return ident, key_lock


def cmd_join(args: argparse.Namespace) -> int:
    st = join_settings(args)
    cfg = node_config(st)
    _logging(cfg.log_level, cfg.log_format)
    ident, key_lock = preflight_join(st, cfg)

    # the heavy part: torch, hivemind
    from node.daemon import NodeDaemon
    from protocol.net.dht_client import BootstrapError

    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    try:
        daemon = NodeDaemon(cfg, ident)
    except BootstrapError as e:
        raise UsageError(f"{st.label('node', 'bootstrap')}: {e}") from e
    except ValueError as e:  # e.g. --device cuda on a host without one
        raise UsageError(str(e)) from e
    _install_signals(daemon.notice.give, extra_s=cfg.preempt_notice_s)
    print(
        f"crucible-node ready: peer_id={daemon.peer_id} pipeline={cfg.announce_host or cfg.host}:{cfg.announce_port or daemon.acceptor.port} "
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

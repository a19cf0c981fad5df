"""`crucible-node`: run a GPU host as a Crucible node.

crucible-node bootstrap                       start the first DHT peer of a new swarm, print its multiaddr
crucible-node join --bootstrap MULTIADDR ...  join a swarm, advertise, train whatever stage is assigned
crucible-node identity                        print this host's peer id (creating its key if needed)
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from protocol.dht_client import EXAMPLE_MULTIADDR, BootstrapError, DHTClient, validate_multiaddr
from protocol.identity import Identity, SignatureError
from protocol.schema import SchemaError, from_dict

log = logging.getLogger("crucible.node")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--key-file",
        default=None,
        help="Ed25519 identity seed file (default ~/.crucible/node.key; created if missing)",
    )
    p.add_argument(
        "--host", default=None, help="address to listen on (default 127.0.0.1; use 0.0.0.0 on a public host)"
    )
    p.add_argument(
        "--dht-port", type=int, default=None, help="DHT (libp2p) TCP port (default: any free port)"
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="crucible-node",
        description="Crucible node: contributes this host's accelerator to distributed pre-training runs.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example:\n  crucible-node join --bootstrap {EXAMPLE_MULTIADDR} \\\n"
        "      --store-endpoint https://ACCOUNT.r2.cloudflarestorage.com --store-bucket crucible \\\n"
        "      --operator-key 12D3KooW... --price-per-hour 1.17",
    )
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bootstrap", help="start the first DHT peer of a new swarm and print its multiaddr")
    _add_common(b)

    j = sub.add_parser(
        "join",
        help="join a swarm and serve assigned pipeline stages",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"example: crucible-node join --bootstrap {EXAMPLE_MULTIADDR} --store-endpoint http://127.0.0.1:9000",
    )
    _add_common(j)
    j.add_argument(
        "--bootstrap",
        action="append",
        default=None,
        metavar="MULTIADDR",
        help=f"multiaddr of a swarm peer, repeatable (example: {EXAMPLE_MULTIADDR})",
    )
    j.add_argument(
        "--config", type=Path, help="TOML file with [node] and [store] sections; flags override it"
    )
    j.add_argument("--port", type=int, default=None, help="pipeline TCP port (default: any free port)")
    j.add_argument(
        "--announce-host",
        default=None,
        help="address other nodes dial for pipeline traffic (default: --host)",
    )
    j.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="HTTP port for /health, /status, /metrics (default: any free port)",
    )
    j.add_argument(
        "--operator-key",
        default=None,
        help="required: peer id (12D3KooW...) of the operator whose signed runs/assignments are trusted "
        "(nothing signed by any other key is accepted)",
    )
    j.add_argument(
        "--price-per-hour", type=float, default=None, help="USD per hour this host costs (advertised)"
    )
    j.add_argument(
        "--store-endpoint",
        default=None,
        help="S3-compatible endpoint URL, e.g. https://ACCOUNT.r2.cloudflarestorage.com",
    )
    j.add_argument("--store-bucket", default=None, help="bucket name (default: crucible)")
    j.add_argument("--store-access-key", default=None, help="access key id (default: $AWS_ACCESS_KEY_ID)")
    j.add_argument("--store-secret-key", default=None, help="secret key (default: $AWS_SECRET_ACCESS_KEY)")
    j.add_argument(
        "--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    j.add_argument(
        "--device",
        default=None,
        metavar="auto|cuda|cuda:N|cpu",
        help="where stages train (default auto: the first CUDA GPU that no other node on this host has "
        "claimed, else the CPU; example: --device cuda:1)",
    )
    j.add_argument(
        "--no-compile",
        dest="compile",
        action="store_const",
        const=False,
        default=None,
        help="do not torch.compile the stage on CUDA (compiling costs ~20 s at the first step, then pays)",
    )

    i = sub.add_parser("identity", help="print this host's peer id, creating its key if needed")
    i.add_argument("--key-file", default=None, help="identity seed file (default ~/.crucible/node.key)")
    return ap


def load_node_config(args: argparse.Namespace) -> Any:
    from node.daemon import NodeConfig

    data: dict[str, Any] = {}
    if getattr(args, "config", None):
        try:
            raw = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"cannot read config {args.config}: {e}") from e
        data = dict(raw.get("node", {}))
        if "store" in raw:
            data["store"] = raw["store"]
    flag_map = {
        "bootstrap": "bootstrap",
        "host": "host",
        "announce_host": "announce_host",
        "port": "port",
        "dht_port": "dht_port",
        "health_port": "health_port",
        "key_file": "key_file",
        "operator_key": "operator_key",
        "price_per_hour": "price_per_hour",
        "torch_threads": "torch_threads",
        "device": "device",
        "compile": "compile",
    }
    for flag, name in flag_map.items():
        v = getattr(args, flag, None)
        if v is not None:
            data[name] = v
    store = dict(data.get("store") or {})
    for flag, name in (
        ("store_endpoint", "endpoint_url"),
        ("store_bucket", "bucket"),
        ("store_access_key", "access_key"),
        ("store_secret_key", "secret_key"),
    ):
        v = getattr(args, flag, None)
        if v is not None:
            store[name] = v
    data["store"] = store or None
    if store and "endpoint_url" not in store:
        raise ValueError("a store is configured without an endpoint: pass --store-endpoint URL")
    known = {f.name for f in fields(NodeConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown [node] setting(s) {sorted(unknown)}; known: {sorted(known)}")
    try:
        return from_dict(NodeConfig, data)
    except SchemaError as e:
        raise ValueError(str(e)) from e


def _identity(key_file: str | None) -> Identity:
    return Identity.load_or_create(Path(key_file or "~/.crucible/node.key").expanduser())


def _install_signals(on_stop: Any) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: on_stop())


def cmd_bootstrap(args: argparse.Namespace) -> int:
    import threading

    ident = _identity(args.key_file)
    dht = DHTClient(ident, host=args.host or "127.0.0.1", port=args.dht_port or 0)
    stop = threading.Event()
    _install_signals(stop.set)
    for addr in dht.visible_maddrs():
        print(f"BOOTSTRAP {addr}", flush=True)
    print(f"crucible-node bootstrap peer ready: peer_id={dht.peer_id} (Ctrl-C to stop)", flush=True)
    stop.wait()
    dht.shutdown()
    return 0


def cmd_join(args: argparse.Namespace) -> int:
    from node.daemon import NodeDaemon

    if not args.bootstrap:
        print(
            f"error: --bootstrap is required (example: --bootstrap {EXAMPLE_MULTIADDR}); "
            "start a new swarm with `crucible-node bootstrap`",
            file=sys.stderr,
        )
        return 2
    try:
        for addr in args.bootstrap:
            validate_multiaddr(addr)
        cfg = load_node_config(args)
    except (BootstrapError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not cfg.operator_key:
        print(
            "error: --operator-key is required: a node takes runs and assignments only from the operator it "
            "trusts. Give the operator's peer id (the operator prints it with `crucible-node identity "
            "--key-file OPERATOR.key`; example: --operator-key 12D3KooW...), or set operator_key in [node]",
            file=sys.stderr,
        )
        return 2
    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    try:
        ident = _identity(cfg.key_file)
    except SignatureError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        daemon = NodeDaemon(cfg, ident)
    except BootstrapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # e.g. --device cuda on a host without one
        print(f"error: {e}", file=sys.stderr)
        return 2
    _install_signals(daemon.stop_event.set)
    print(
        f"crucible-node ready: peer_id={daemon.peer_id} pipeline={cfg.announce_host or cfg.host}:{daemon.acceptor.port} "
        f"health=http://{cfg.host}:{daemon.health.port}/health device={daemon.device} "
        f"tflops={daemon.tflops:.3f} store_mbps={daemon.store_mbps:.0f}",
        flush=True,
    )
    try:
        daemon.serve()
    finally:
        daemon.shutdown()
    log.info("node stopped cleanly")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "botocore", "urllib3", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "identity":
        print(_identity(args.key_file).peer_id)
        return 0
    if args.command == "bootstrap":
        return cmd_bootstrap(args)
    return cmd_join(args)


if __name__ == "__main__":
    sys.exit(main())

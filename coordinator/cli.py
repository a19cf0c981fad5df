"""`crucible-coordinator`: serve as a run coordinator, and launch / watch / stop / export / plan runs.

crucible-coordinator serve  --bootstrap MA --store-endpoint URL --operator-key-file KEY
crucible-coordinator launch run.toml --bootstrap MA --store-endpoint URL --operator-key-file KEY [--watch]
crucible-coordinator status [RUN] --bootstrap MA --operator-key 12D3KooW...
crucible-coordinator stop RUN --bootstrap MA --store-endpoint URL --operator-key-file KEY
crucible-coordinator export RUN --out DIR --operator-key 12D3KooW... --store-endpoint URL [--round N]
crucible-coordinator plan --model 8b --pool pool.toml
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from protocol import keys
from protocol.dht_client import EXAMPLE_MULTIADDR, BootstrapError, DHTClient, validate_multiaddr
from protocol.identity import Identity, SignatureError, public_key_of_peer_id
from protocol.messages import NodeAdvert, RunRecord
from protocol.runspec import load_run_spec
from protocol.store import ObjectStore, StoreConfig, StoreError

log = logging.getLogger("crucible.coordinator")


def _swarm_args(p: argparse.ArgumentParser, *, store: bool, key: bool) -> None:
    p.add_argument(
        "--bootstrap",
        action="append",
        required=True,
        metavar="MULTIADDR",
        help=f"multiaddr of a swarm peer, repeatable (example: {EXAMPLE_MULTIADDR})",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address for this process's DHT peer (default 127.0.0.1)"
    )
    if store:
        p.add_argument(
            "--store-endpoint",
            required=True,
            help="S3-compatible endpoint URL, e.g. https://ACCOUNT.r2.cloudflarestorage.com",
        )
        p.add_argument("--store-bucket", default="crucible", help="bucket (default: crucible)")
        p.add_argument("--store-access-key", default="", help="access key id (default: $AWS_ACCESS_KEY_ID)")
        p.add_argument("--store-secret-key", default="", help="secret key (default: $AWS_SECRET_ACCESS_KEY)")
    if key:
        p.add_argument(
            "--operator-key-file",
            default="~/.crucible/operator.key",
            help="operator's Ed25519 seed; nodes trust its peer id via --operator-key (created if missing)",
        )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="crucible-coordinator",
        description="Crucible run coordinator and operator CLI.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve", help="run a coordinator: take launched runs' leases, place nodes, publish assignments"
    )
    _swarm_args(s, store=True, key=True)
    s.add_argument(
        "--lease-s", type=float, default=15.0, help="run lease duration in seconds (renewed every tick)"
    )
    s.add_argument(
        "--churn-grace-s",
        type=float,
        default=10.0,
        help="how long an assigned node may be silent before it counts as gone",
    )

    la = sub.add_parser("launch", help="launch a run described by a TOML file (see docs/examples/run.toml)")
    la.add_argument("run_toml", type=Path, help="run spec file ([run], [model], [train], [sync], [pipeline])")
    _swarm_args(la, store=True, key=True)
    la.add_argument("--watch", action="store_true", help="follow progress until the run ends")

    st = sub.add_parser("status", help="show runs and nodes")
    st.add_argument("run_id", nargs="?", help="only this run")
    st.add_argument(
        "--operator-key",
        default="",
        metavar="PEER_ID",
        help="peer id (12D3KooW...) of the operator: show only run records it signed; without it, run "
        "records signed by any key are shown, marked unverified",
    )
    _swarm_args(st, store=False, key=False)

    sp = sub.add_parser("stop", help="stop a run (nodes finish their current step and go idle)")
    sp.add_argument("run_id")
    _swarm_args(sp, store=True, key=True)

    ex = sub.add_parser(
        "export",
        help="write a run's consensus as a Hugging Face Llama folder (model.safetensors + config.json)",
        epilog="example: crucible-coordinator export my-run --out ./my-run-hf --operator-key 12D3KooW... "
        "--store-endpoint http://127.0.0.1:9000",
    )
    ex.add_argument("run_id")
    ex.add_argument("--out", required=True, help="folder to write (created; files replaced)")
    ex.add_argument("--round", type=int, default=None, help="outer round (default: the newest checkpointed)")
    ex.add_argument(
        "--operator-key", required=True, help="peer id (12D3KooW...) of the operator that launched the run"
    )
    ex.add_argument("--store-endpoint", required=True, help="S3-compatible endpoint URL")
    ex.add_argument("--store-bucket", default="crucible", help="bucket (default: crucible)")
    ex.add_argument("--store-access-key", default="", help="access key id (default: boto3's chain)")
    ex.add_argument("--store-secret-key", default="", help="secret key (default: boto3's chain)")
    ex.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    from coordinator import plan_cli

    plan_cli.add_parser(sub)
    return ap


def _store(args: argparse.Namespace) -> ObjectStore:
    return ObjectStore(
        StoreConfig(
            endpoint_url=args.store_endpoint,
            bucket=args.store_bucket,
            access_key=args.store_access_key,
            secret_key=args.store_secret_key,
        )
    )


def _dht(args: argparse.Namespace, identity: Identity | None = None) -> DHTClient:
    for a in args.bootstrap:
        validate_multiaddr(a)
    return DHTClient(identity or Identity.generate(), bootstrap=args.bootstrap, host=args.host)


def _operator(args: argparse.Namespace) -> Identity:
    return Identity.load_or_create(Path(args.operator_key_file).expanduser())


UNVERIFIED_NOTE = (
    "note: no --operator-key given: run records signed by ANY key are shown (marked signer=... unverified); "
    "pass --operator-key 12D3KooW... to show only the operator's"
)


def format_status(
    runs: dict[str, RunRecord],
    nodes: dict[str, NodeAdvert],
    only: str | None = None,
    signers: dict[str, str] | None = None,
) -> str:
    """The status table. `signers` (run id -> signer peer id) is given when the run records were not
    checked against the operator key: each run line then names its signer, and a note says so."""
    lines = [UNVERIFIED_NOTE] if signers is not None else []
    for rid, rec in sorted(runs.items()):
        if only and rid != only:
            continue
        sp = rec.spec
        unverified = f"  signer={signers.get(rid, '?')[-8:]} (unverified)" if signers is not None else ""
        lines.append(
            f"run {rid}: {rec.state}  {sp.replicas}x{sp.stages}  {sp.train.total_steps} steps  H={sp.sync.H}  "
            f"sync={sp.sync.method}  term={rec.term}  coordinator={rec.coordinator[-8:] or '-'}{unverified}"
        )
    if only and not lines:
        lines.append(
            f"run {only}: not found in the DHT (launched? its record expires 60 s after its coordinator stops)"
        )
    lines.append(
        f"{'node':<10} {'state':<9} {'run':<16} {'r/s':<5} {'step':>6} {'loss':>7} {'val bpb':>8} {'tok/s':>8} "
        f"{'pipe MB':>8} {'store MB':>8} {'TFLOP/s':>8}"
    )
    for peer, a in sorted(nodes.items(), key=lambda kv: (kv[1].run_id, kv[1].replica, kv[1].stage)):
        if only and a.run_id != only:
            continue
        loss = f"{a.loss:.3f}" if a.loss is not None else "-"
        bpb = f"{a.val_bpb:.3f}" if a.val_bpb is not None else "-"
        rs = f"{a.replica}/{a.stage}" if a.replica >= 0 else "-"
        lines.append(
            f"{peer[-8:]:<10} {a.state:<9} {a.run_id or '-':<16} {rs:<5} {a.step:>6} {loss:>7} {bpb:>8} "
            f"{a.tokens_per_s:>8.0f} {a.bytes_pipe / 1e6:>8.1f} {a.bytes_store / 1e6:>8.1f} {a.tflops:>8.3f}"
        )
    return "\n".join(lines)


def _read_views(
    dht: DHTClient, trusted: set[bytes] | None
) -> tuple[dict[str, RunRecord], dict[str, NodeAdvert], dict[str, str]]:
    """Run records (signed by a `trusted` key; any signer if None), node adverts (each signed by the node
    it describes), and the signer of each run record shown."""
    runs: dict[str, RunRecord] = {}
    signers: dict[str, str] = {}
    for signed in dht.get_all(keys.RUNS_KEY, RunRecord, trusted).values():
        rec = signed.body
        if rec.spec.run_id not in runs or rec.updated > runs[rec.spec.run_id].updated:
            runs[rec.spec.run_id] = rec
            signers[rec.spec.run_id] = signed.signer_id
    nodes = {
        k: v.body
        for k, v in dht.get_all(keys.NODES_KEY, NodeAdvert).items()
        if v.signer_id == k == v.body.peer_id
    }
    return runs, nodes, signers


def _trusted_operator(peer_id: str) -> set[bytes]:
    try:
        return {public_key_of_peer_id(peer_id)}
    except SignatureError as e:
        raise ValueError(f"--operator-key: {e} (give the operator's 12D3KooW... peer id)") from e


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.service import Coordinator

    ident = _operator(args)
    store = _store(args)
    store.ensure_bucket()
    dht = _dht(args)
    coord = Coordinator(ident, dht, store, lease_s=args.lease_s, churn_grace_s=args.churn_grace_s)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: coord.stop_event.set())
    print(f"crucible-coordinator ready: operator={ident.peer_id} dht={dht.peer_id}", flush=True)
    try:
        coord.serve()
    finally:
        dht.shutdown()
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from coordinator.service import launch

    spec = load_run_spec(args.run_toml)
    ident = _operator(args)
    store = _store(args)
    dht = _dht(args)
    try:
        launch(dht, store, ident, RunRecord(spec=spec, state="pending", updated=time.time()))
        print(
            f"launched run {spec.run_id}: {spec.replicas} replicas x {spec.stages} stages, {spec.train.total_steps} steps",
            flush=True,
        )
        if args.watch:
            while True:  # run records count only when signed by this operator (its coordinators sign so)
                runs, nodes, _ = _read_views(dht, {ident.public_key})
                print(format_status(runs, nodes, spec.run_id), flush=True)
                rec = runs.get(spec.run_id)
                if rec and rec.state in ("done", "stopped", "failed"):
                    return 0 if rec.state == "done" else 1
                time.sleep(5)
    finally:
        dht.shutdown()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    trusted = _trusted_operator(args.operator_key) if args.operator_key else None
    dht = _dht(args)
    try:
        runs, nodes, signers = _read_views(dht, trusted)
        print(format_status(runs, nodes, args.run_id, signers=None if trusted else signers))
    finally:
        dht.shutdown()
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from coordinator.service import request_stop

    request_stop(_store(args), _operator(args), args.run_id)
    print(f"stop requested for run {args.run_id}; its coordinator stops the nodes within a few seconds")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from coordinator.export import consensus_states, export_llama

    if args.round is not None and args.round < 1:
        raise ValueError(f"--round {args.round}: rounds count from 1 (example: --round 12)")
    spec, rnd, states = consensus_states(
        _store(args), args.run_id, _trusted_operator(args.operator_key), args.round
    )
    out = Path(args.out).expanduser()
    export_llama(spec, states, out)
    n = sum(int(t.numel()) for st in states for k, t in st.items())
    print(
        f"exported run {spec.run_id} round {rnd}: {out}/model.safetensors ({n:,} values), {out}/config.json"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("hivemind", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    commands = {
        "serve": cmd_serve,
        "launch": cmd_launch,
        "status": cmd_status,
        "stop": cmd_stop,
        "export": cmd_export,
    }
    try:
        if args.command == "plan":
            from coordinator import plan_cli

            return plan_cli.run(args)
        return commands[args.command](args)
    except (BootstrapError, StoreError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

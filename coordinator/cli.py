"""`crucible-coordinator`: the operator's CLI (init, launch, status, stop, export, plan) and a run coordinator.

examples:
  crucible-coordinator init
  crucible-coordinator serve --bootstrap MA --store-endpoint URL
  crucible-coordinator certify PEER_ID --expires 7d --any-run --out CERT
  crucible-coordinator serve --key-file NODE_KEY --certificate CERT --operator-key 12D3KooW... \\
                             --bootstrap MA --store-endpoint URL
  crucible-coordinator launch run.toml --bootstrap MA --store-endpoint URL [--watch]
  crucible-coordinator status [RUN] --bootstrap MA --operator-key 12D3KooW...
  crucible-coordinator stop RUN --store-endpoint URL
  crucible-coordinator export RUN --out DIR --operator-key 12D3KooW... --store-endpoint URL
  crucible-coordinator plan --model 8b --pool pool.toml

MA is a multiaddr (/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...). serve, launch, stop and certify
sign with the operator key, --operator-key-file (default ~/.crucible/operator.key); only `init`
creates it (a key made up by another command would be trusted by no node). A mistake in the
arguments exits 2 with one line naming it; --debug shows tracebacks.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.operator_key import (
    DEFAULT_OPERATOR_KEY_FILE,
    create_operator_key,
    load_certificate,
    load_operator_key,
    load_signing_key,
)
from protocol import keys
from protocol.identity import Identity
from protocol.messages import ANY_RUN, MAX_DELEGATION_S, NodeAdvert, RunRecord
from protocol.process.cli_errors import (
    ArgumentParser,
    UsageError,
    bad_input,
    check_peer_id,
    check_port_free,
    run_cli,
)
from protocol.process.logs import add_log_args, json_line, setup_logging, version
from protocol.process.serve_config import STORE_FLAGS, ServeConfig, store_of
from protocol.process.settings import SettingValues, add_flags, from_args, settings_of
from protocol.process.signals import install_stop_signals
from protocol.runspec import check_run_id, load_run_spec
from protocol.trust.delegation import OperatorTrust, RefusalLog, issue, utc

if TYPE_CHECKING:  # hivemind and boto3 take seconds to import: only the commands that talk import them
    from protocol.net.dht_client import DHTClient
    from protocol.net.store import ObjectStore

log = logging.getLogger("crucible.coordinator")
PROG = "crucible-coordinator"
EPILOG = (__doc__ or "").split("\n\n", 1)[1]
"""The examples and notes of the module docstring (its title is the parser's description)."""
SERVE = {s.key: s for s in settings_of(ServeConfig)}
"""serve's settings (protocol/process/serve_config.py); launch, status, stop and export take the swarm's
and the store's (SHARED) too."""
SHARED = ("bootstrap", "host", *STORE_FLAGS)


def _common_args(p: argparse.ArgumentParser, *, log_default: str = "WARNING") -> None:
    """log_default: INFO for the service (serve), WARNING for one-shot commands (quiet unless wrong)."""
    add_log_args(p, log_default)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _key_file_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--operator-key-file", default=DEFAULT_OPERATOR_KEY_FILE, metavar="PATH", help=help)


def _store_args(p: argparse.ArgumentParser) -> None:
    add_flags(p, [SERVE[k] for k in STORE_FLAGS])


def _swarm_args(
    p: argparse.ArgumentParser, *, store: bool, key: bool, dht: bool = True, log_default: str = "WARNING"
) -> None:
    """dht=False: the command does not use the DHT (stop writes to the store), so --bootstrap is
    accepted but not required."""
    bootstrap = SERVE["bootstrap"]
    if not dht:
        bootstrap = replace(bootstrap, required=False, help=f"{bootstrap.help}; not needed by this command")
    add_flags(p, [bootstrap, SERVE["host"]])
    if store:
        _store_args(p)
    if key:
        _key_file_arg(
            p,
            f"operator key (default {DEFAULT_OPERATOR_KEY_FILE}); never created here: create it once with "
            "`crucible-coordinator init`",
        )
    _common_args(p, log_default=log_default)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(
        prog=PROG,
        description="Crucible run coordinator and operator CLI.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    it = sub.add_parser(
        "init",
        help="create the operator key (once) and print the peer id that providers give their nodes",
        epilog=f"example: {PROG} init --operator-key-file ~/.crucible/operator.key",
    )
    _key_file_arg(
        it, f"where to write the key (default {DEFAULT_OPERATOR_KEY_FILE}); an existing key is kept"
    )
    _common_args(it)

    s = sub.add_parser(
        "serve", help="run a coordinator: take launched runs' leases, place nodes, publish assignments"
    )
    _swarm_args(s, store=True, key=True, log_default="INFO")
    add_flags(s, [setting for key, setting in SERVE.items() if key not in SHARED])
    s.set_defaults(operator_key_file=None)  # given explicitly, or DEFAULT when signing with the operator key

    ce = sub.add_parser(
        "certify",
        help="certify a coordinator's own key for a while (and a run, or any run): it then signs for the "
        "operator without the operator key on its host",
        epilog=f"example: {PROG} certify 12D3KooW... --expires 7d --any-run --out coordinator.cert",
    )
    ce.add_argument("peer_id", metavar="PEER_ID", help="peer id (12D3KooW...) of the coordinator's key")
    ce.add_argument(
        "--expires",
        required=True,
        metavar="WHEN",
        help="a lifetime (90m, 12h, 7d, 2w) or a UTC time (2026-12-31T00:00Z, 2026-12-31); at most 366 days",
    )
    scope = ce.add_mutually_exclusive_group(required=True)
    scope.add_argument("--run", metavar="RUN", help="valid for this run only (example: --run tiny-llama-1)")
    scope.add_argument("--any-run", action="store_true", help="valid for every run of this operator")
    ce.add_argument("--out", required=True, metavar="PATH", help="where to write the certificate (replaced)")
    _key_file_arg(
        ce,
        f"operator key that signs the certificate (default {DEFAULT_OPERATOR_KEY_FILE}); never created here",
    )
    _common_args(ce)

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
        help="peer id (12D3KooW...) of the operator: show only run records it or a coordinator it certified "
        "signed; without it, run records signed by any key are shown, marked unverified",
    )
    _swarm_args(st, store=False, key=False)

    sp = sub.add_parser("stop", help="stop a run (nodes finish their current step and go idle)")
    sp.add_argument("run_id")
    _swarm_args(sp, store=True, key=True, dht=False)

    ex = sub.add_parser(
        "export",
        help=(
            "write a run's consensus as a Hugging Face folder (model.safetensors + config.json): a Llama, "
            "or a GLM-4-MoE for an MoE run"
        ),
        epilog=f"example: {PROG} export my-run --out ./my-run-hf --operator-key 12D3KooW... "
        "--store-endpoint http://127.0.0.1:9000",
    )
    ex.add_argument("run_id")
    ex.add_argument("--out", required=True, help="folder to write (created; files replaced)")
    ex.add_argument(
        "--round",
        type=int,
        default=None,
        help="outer round (default: the newest round two replicas' checkpoints agree on, every stage; in a run "
        "whose replicas differ in split, every layer group)",
    )
    ex.add_argument(
        "--operator-key",
        required=True,
        metavar="PEER_ID",
        help="peer id (12D3KooW...) of the operator that launched the run",
    )
    _store_args(ex)
    _common_args(ex)

    from coordinator.plan import cli as plan_cli

    plan_cli.add_parser(sub)
    return ap


# --------------------------------------------------------------------------------- argument checks
def _check_out(value: str) -> None:
    """--out: a folder that exists or can be created, and written to."""
    example = "--out ./my-run-hf"
    out = Path(value).expanduser()
    if out.exists() and not out.is_dir():
        raise bad_input(
            "--out", value, "is a file; give a folder for model.safetensors and config.json", example
        )
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise bad_input("--out", value, f"cannot be created: {parent} is a file", example)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise bad_input("--out", value, f"cannot be written: {parent} is not writable by this user", example)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_expiry(value: str, now: float) -> float:
    """--expires: a lifetime from now ("7d", "12h") or a UTC time ("2026-12-31T00:00Z"; a time without a
    zone is UTC), in the future and at most MAX_DELEGATION_S away."""
    example = "--expires 7d or --expires 2026-12-31T00:00Z"
    m = _DURATION.fullmatch(value.strip())
    if m:
        at = now + float(m.group(1)) * _UNIT_S[m.group(2)]
    else:
        from datetime import UTC, datetime

        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError as e:
            raise bad_input(
                "--expires", value, "neither a lifetime (90m, 12h, 7d, 2w) nor a UTC time", example
            ) from e
        at = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    if not now < at <= now + MAX_DELEGATION_S:
        raise bad_input(
            "--expires",
            value,
            f"must lie in the future and at most 366 days ahead (it is {utc(at)})",
            example,
        )
    return at


def _check_serve_keys(args: argparse.Namespace) -> None:
    """serve signs with the operator key (--operator-key-file), or with its own key under a certificate
    (--key-file, --certificate, --operator-key): sets args.signer, args.certificate_bytes, args.trust."""
    cfg: ServeConfig = args.serve
    if not (cfg.key_file or cfg.certificate):
        if cfg.operator_key:
            raise UsageError(
                "--operator-key is for a coordinator signing under --certificate; with the operator's own key "
                "(--operator-key-file) leave it out"
            )
        args.signer = load_operator_key(args.operator_key_file or DEFAULT_OPERATOR_KEY_FILE)
        args.certificate_bytes, args.trust = b"", None
        return
    example = "--key-file ~/.crucible/node.key --certificate coordinator.cert --operator-key 12D3KooW..."
    if args.operator_key_file is not None:
        raise UsageError(
            "--operator-key-file and --certificate both given: a coordinator signs either with the operator "
            f"key or with its own certified key (example: {example})"
        )
    for flag, value in (("--key-file", cfg.key_file), ("--certificate", cfg.certificate)):
        if not value:
            raise UsageError(
                f"{flag} is missing: --key-file and --certificate go together (example: {example})"
            )
    if not cfg.operator_key:
        raise UsageError(
            "--certificate needs --operator-key PEER_ID: the operator whose runs this coordinator serves, the "
            f"peer id its nodes trust (example: {example})"
        )
    args.signer = load_signing_key(cfg.key_file)
    args.trust = OperatorTrust.of_peer_ids(cfg.operator_key)
    args.certificate_bytes = load_certificate(cfg.certificate, args.signer, args.trust)


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no network and no heavy import, before any command starts: the flags'
    syntax, the run spec, the operator key. Loads what later steps use (`args.spec`, `args.operator`)."""
    if args.command == "serve":  # every serve flag typed and checked by its declaration
        args.serve = from_args(ServeConfig, args)
    else:  # the ones a command shares with serve
        given = SettingValues.of(SERVE[k] for k in SHARED if hasattr(args, SERVE[k].dest))
        given.read_flags(args)
        given.check()
    if getattr(args, "store_endpoint", None) is not None:
        if bool(args.store_access_key) != bool(args.store_secret_key):
            alone = "--store-access-key" if args.store_access_key else "--store-secret-key"
            raise UsageError(
                f"{alone} given alone: give both --store-access-key and --store-secret-key, or neither "
                "(boto3's chain: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or an AWS profile)"
            )
    if getattr(args, "run_id", None):
        try:
            check_run_id("RUN", args.run_id)
        except ValueError as e:
            raise UsageError(str(e)) from e
    if getattr(args, "operator_key", ""):
        check_peer_id("--operator-key", args.operator_key)
    if args.command == "serve":
        check_port_free("--http-port", args.serve.http_host, args.serve.http_port)
    if getattr(args, "round", None) is not None and args.round < 1:
        raise bad_input("--round", args.round, "rounds count from 1; omit it for the newest", "--round 12")
    if args.command == "export":
        _check_out(args.out)
    if args.command == "launch":
        try:
            args.spec = load_run_spec(args.run_toml)
        except ValueError as e:
            raise UsageError(str(e)) from e
    if args.command == "certify":
        check_peer_id("PEER_ID", args.peer_id)
        if args.run:
            try:
                check_run_id("--run", args.run)
            except ValueError as e:
                raise UsageError(str(e)) from e
        args.expires_at = parse_expiry(args.expires, time.time())
        out = Path(args.out).expanduser()
        if out.is_dir() or not out.parent.is_dir():
            raise bad_input(
                "--out", args.out, "must be a file in an existing folder", "--out coordinator.cert"
            )
    if args.command == "serve":
        _check_serve_keys(args)
    if args.command in ("launch", "stop", "certify"):
        args.operator = load_operator_key(args.operator_key_file)


# ---------------------------------------------------------------------------------------- commands
def _store(args: argparse.Namespace) -> ObjectStore:
    from protocol.net.store import ObjectStore

    return ObjectStore(store_of(args))


def _dht(args: argparse.Namespace, identity: Identity | None = None, *, client: bool = True) -> DHTClient:
    from protocol.net.dht_client import DHTClient

    # status, launch, stop: a client of the DHT, not a peer that others route through (serve is a peer)
    return DHTClient(
        identity or Identity.generate(), bootstrap=args.bootstrap, host=args.host, client_mode=client
    )


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
    from coordinator.run_views import DROPPED_OUT, dropped_out_of

    lines = [UNVERIFIED_NOTE] if signers is not None else []
    dropped = {rid: dropped_out_of(rec.reason) for rid, rec in runs.items()}
    for rid, rec in sorted(runs.items()):
        if only and rid != only:
            continue
        sp = rec.spec
        unverified = f"  signer={signers.get(rid, '?')[-8:]} (unverified)" if signers is not None else ""
        lines.append(
            f"run {rid}: {rec.state}  {sp.replicas}x{sp.stages}  {sp.train.total_steps} steps  H={sp.sync.H}  "
            f"sync={sp.sync.method}  term={rec.term}  coordinator={rec.coordinator[-8:] or '-'}{unverified}"
        )
        if rec.reason:
            lines.append(f"  reason: {rec.reason}")
        if rec.dashboard:
            lines.append(f"  dashboard: {rec.dashboard}")
    if only and not lines:
        lines.append(
            f"run {only}: not found in the DHT (launched? its record expires 60 s after its coordinator stops)"
        )
    lines.append(
        f"{'node':<10} {'state':<11} {'run':<16} {'r/s':<5} {'step':>6} {'b/token':>7} {'val b/B':>8} {'tok/s':>8} "
        f"{'pipe MB':>8} {'store MB':>8} {'TFLOP/s':>8}"
    )
    for peer, a in sorted(nodes.items(), key=lambda kv: (kv[1].run_id, kv[1].replica, kv[1].stage)):
        if only and a.run_id != only:
            continue
        loss = f"{a.loss / math.log(2):.3f}" if a.loss is not None else "-"  # adverts carry nats
        bpb = f"{a.val_bpb:.3f}" if a.val_bpb is not None else "-"
        rs = f"{a.replica}/{a.stage}" if a.replica >= 0 else "-"
        state = DROPPED_OUT if a.replica in dropped.get(a.run_id, ()) else a.state
        lines.append(
            f"{peer[-8:]:<10} {state:<11} {a.run_id or '-':<16} {rs:<5} {a.step:>6} {loss:>7} {bpb:>8} "
            f"{a.tokens_per_s:>8.0f} {a.bytes_pipe / 1e6:>8.1f} {a.bytes_store / 1e6:>8.1f} {a.tflops:>8.3f}"
        )
        if a.state == "failed" and a.error:
            lines.append(f"{'':<10} failed: {a.error}")
    return "\n".join(lines)


def _read_runs(dht: DHTClient, trust: OperatorTrust | None) -> tuple[dict[str, RunRecord], dict[str, str]]:
    """The newest run record of each run in the DHT (`_read_views`), and who signed it."""
    runs: dict[str, RunRecord] = {}
    signers: dict[str, str] = {}
    found = dht.get_all(keys.RUNS_KEY, RunRecord).values()
    for signed in found if trust is None else trust.filter(found, RefusalLog(log)):
        rec = signed.body
        if rec.spec.run_id not in runs or rec.updated > runs[rec.spec.run_id].updated:
            runs[rec.spec.run_id] = rec
            signers[rec.spec.run_id] = signed.signer_id
    return runs, signers


def _read_views(
    dht: DHTClient, trust: OperatorTrust | None
) -> tuple[dict[str, RunRecord], dict[str, NodeAdvert], dict[str, str]]:
    """Run records (signed by the operator or a coordinator it certified for the run; any signer if `trust`
    is None), node adverts (each signed by the node it describes), and the signer of each run record shown."""
    runs, signers = _read_runs(dht, trust)
    nodes = {
        k: v.body
        for k, v in dht.get_all(keys.NODES_KEY, NodeAdvert).items()
        if v.signer_id == k == v.body.peer_id
    }
    return runs, nodes, signers


def cmd_init(args: argparse.Namespace) -> int:
    ident, created = create_operator_key(args.operator_key_file)
    where = args.operator_key_file
    if created:
        print(f"created operator key {where} (mode 0600; back it up: nodes trust this key and no other)")
    else:
        print(f"operator key {where} already exists; kept as it is")
    print(f"operator peer id: {ident.peer_id}")
    print(f"providers start their nodes with: crucible-node join --operator-key {ident.peer_id} ...")
    return 0


def cmd_certify(args: argparse.Namespace) -> int:
    operator: Identity = args.operator
    run = args.run or ANY_RUN
    cert = issue(operator, args.peer_id, expires_at=args.expires_at, run=run)
    out = Path(args.out).expanduser()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(cert)
    os.replace(tmp, out)
    scope = f"run {run}" if args.run else "any run"
    print(f"certified {args.peer_id} as coordinator for {scope} until {utc(args.expires_at)}: wrote {out}")
    print(
        f"on its host: crucible-coordinator serve --key-file NODE_KEY --certificate {out.name} "
        f"--operator-key {operator.peer_id} --bootstrap ... --store-endpoint ..."
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.dashboard import Dashboard
    from coordinator.service import Coordinator

    cfg: ServeConfig = args.serve
    ident: Identity = args.signer
    store = _store(args)
    store.ensure_bucket()
    dht = _dht(args, client=False)
    coord = Coordinator(
        ident,
        dht,
        store,
        lease_s=cfg.lease_s,
        churn_grace_s=cfg.churn_grace_s,
        certificate=args.certificate_bytes,
        trust=args.trust,
    )
    install_stop_signals(coord.stop_event.set)
    if args.certificate_bytes:
        who = f"coordinator={ident.peer_id} certified by operator={cfg.operator_key}"
        signer = {"operator": cfg.operator_key, "coordinator": ident.peer_id}
    else:
        who = f"operator={ident.peer_id}"
        signer = {"operator": ident.peer_id}
    try:
        dashboard = Dashboard(coord, cfg.http_host, cfg.http_port)
    except RuntimeError:
        dht.shutdown()
        raise
    shown = "127.0.0.1" if cfg.http_host in ("0.0.0.0", "") else cfg.http_host
    coord.dashboard_url = f"http://{shown}:{dashboard.port}/"
    ready = f"{PROG} ready: {who} dht={dht.peer_id} dashboard={coord.dashboard_url}"
    if args.log_format == "json":  # a log collector reading the json format parses this line too
        ready = json_line(
            ready, log.name, event="ready", **signer, dht=dht.peer_id, dashboard=coord.dashboard_url
        )
    print(ready, flush=True)
    try:
        coord.serve()
    finally:
        dashboard.close()
        dht.shutdown()
    return 0


def _refuse_finished(args: argparse.Namespace, *found: RunRecord | None) -> None:
    """A run id that finished (done) is not launched again: its coordinator would find every node done
    and nothing would train. `found`: its records, the store's copy (it outlives the DHT's) and the
    DHT's; the newest counts. A stopped or failed run may be launched again: it resumes from its
    checkpoints."""
    newest = max((r for r in found if r is not None), key=lambda r: r.updated, default=None)
    if newest is not None and newest.state == "done":
        raise UsageError(
            f"run {args.spec.run_id} already finished (done at {utc(newest.updated)}); launch it under a new "
            f"run id (run_id in [run] of {args.run_toml})"
        )


def cmd_launch(args: argparse.Namespace) -> int:
    from coordinator.lease import launch, stored_record

    spec = args.spec
    ident: Identity = args.operator
    trust = OperatorTrust.of({ident.public_key})  # its coordinators sign under its certificates
    store = _store(args)
    store.ensure_bucket()  # a new store: launch makes its bucket
    try:
        stored = stored_record(store, spec.run_id, trust)
    except ValueError as e:  # garbage or a stranger's object there: launching writes over it
        log.warning("%s; launching over it", e)
        stored = None
    _refuse_finished(args, stored)  # before joining the DHT: seconds sooner
    dht = _dht(args)
    try:
        _refuse_finished(args, stored, _read_runs(dht, trust)[0].get(spec.run_id))
        launch(dht, store, ident, RunRecord(spec=spec, state="pending", updated=time.time()))
        print(
            f"launched run {spec.run_id}: {spec.replicas} replicas x {spec.stages} stages, "
            f"{spec.train.total_steps} steps; operator {ident.peer_id} (nodes must trust it: --operator-key)",
            flush=True,
        )
        print(
            f"it is pending until a coordinator places it on "
            f"{sum(spec.stages_of(r) for r in range(spec.replicas))} free nodes; "
            f"`{PROG} status {spec.run_id}` shows its state, and what it waits for",
            flush=True,
        )
        if args.watch:
            while True:  # run records count only when signed by this operator (its coordinators sign so)
                runs, nodes, _ = _read_views(dht, trust)
                print(format_status(runs, nodes, spec.run_id), flush=True)
                rec = runs.get(spec.run_id)
                if rec and rec.state in ("done", "stopped", "failed"):
                    return 0 if rec.state == "done" else 1
                time.sleep(5)
    finally:
        dht.shutdown()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    trust = OperatorTrust.of_peer_ids(args.operator_key) if args.operator_key else None
    dht = _dht(args)
    try:
        runs, nodes, signers = _read_views(dht, trust)
        if args.run_id and args.run_id not in runs and all(a.run_id != args.run_id for a in nodes.values()):
            known = ", ".join(sorted(runs)[:10]) or "none"
            signed = f" signed by --operator-key {args.operator_key}" if trust else ""
            raise UsageError(
                f"run {args.run_id!r} not found in the DHT{signed} (runs there: {known}; a record expires "
                f"60 s after its coordinator stops): check the id, or list the runs with `{PROG} status` "
                "without RUN"
            )
        print(format_status(runs, nodes, args.run_id, signers=None if trust else signers))
    finally:
        dht.shutdown()
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from coordinator.lease import request_stop, stored_record

    store, rid = _store(args), args.run_id
    rec = stored_record(store, rid, OperatorTrust.of({args.operator.public_key}))
    if rec is None:
        raise UsageError(
            f"no run {rid!r} in bucket {args.store_bucket} at {args.store_endpoint} (no {keys.spec_key(rid)}): "
            f"check the id and the store; `{PROG} status --bootstrap MULTIADDR` lists the runs"
        )
    if rec.state in ("done", "stopped", "failed"):
        print(f"run {rid} already ended ({rec.state} at {utc(rec.updated)}); nothing to stop")
        return 0
    request_stop(store, args.operator, rid)
    print(f"stop requested for run {rid}; its coordinator stops the nodes within a few seconds")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from coordinator.export import consensus_states, export_llama

    trusted = {check_peer_id("--operator-key", args.operator_key)}
    spec, rnd, states = consensus_states(_store(args), args.run_id, trusted, args.round)
    out = Path(args.out).expanduser()
    export_llama(spec, states, out, origin=f"round {rnd} of run {spec.run_id}")
    n = sum(int(t.numel()) for st in states for k, t in st.items())
    print(
        f"exported run {spec.run_id} round {rnd}: {out}/model.safetensors ({n:,} values), {out}/config.json"
    )
    return 0


def _plan(args: argparse.Namespace) -> int:
    from coordinator.plan import cli as plan_cli

    return plan_cli.run(args)


COMMANDS = {
    "init": cmd_init,
    "certify": cmd_certify,
    "serve": cmd_serve,
    "launch": cmd_launch,
    "status": cmd_status,
    "stop": cmd_stop,
    "export": cmd_export,
    "plan": _plan,
}


def _user_errors() -> tuple[type[Exception], ...]:
    """What a command raises for a bad input it could only find by trying (a bootstrap peer that does not
    answer, a run id not in the store, a store that refuses the endpoint or keys): exit 2, one line.
    The store's error is named only when the store was imported (boto3 is slow to import)."""
    store = sys.modules.get("protocol.net.store")
    return (ValueError,) if store is None else (ValueError, store.StoreError)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    setup_logging(getattr(args, "log_level", "WARNING"), getattr(args, "log_format", "text"))
    try:
        return COMMANDS[args.command](args)
    except _user_errors() as e:
        raise UsageError(str(e)) from e


def main(argv: list[str] | None = None) -> int:
    """Entry point: exit 0 on success, 2 with one line on stderr for a mistake in the input, 1 with one
    line for any other failure (tracebacks with --debug)."""
    return run_cli(PROG, _main, argv)


if __name__ == "__main__":
    sys.exit(main())

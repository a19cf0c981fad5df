"""Issue 12, the operator's side: `crucible-coordinator` as a user types it, in real processes.

Every mistake exits 2 with one line on stderr that names the flag, key or file, within 10 s, without a
traceback; only `init` creates an operator key; `plan` refuses negative and zero quantities and says when
a price is missing. Those cases reach no network: each one stops at a check made before any connection
(the addresses below are never dialled), and the checks run before hivemind or torch is imported.

Issue 19 (a new user's first hour), at the end: a real DHT peer and S3 server in this process and a
coordinator ticked here, no nodes: unknown and finished runs are named, a run waiting for nodes says
why, a replica that dropped out is shown as such, and the dashboard's plots have readable axes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_TOML = ROOT / "docs" / "examples" / "run.toml"
TIMEOUT_S = 10.0
"""The issue's bound on how long a user waits to hear about a mistake."""
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
BOOT = ["--bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"]
STORE = ["--store-endpoint", "http://127.0.0.1:9"]
PEER_ID = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]{44}")


def crucible(home: Path, *argv: str | Path, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """`crucible-coordinator ARGV` with HOME=home (so the default key path is the test's), killed with its
    process group after timeout_s."""
    env = dict(os.environ, HOME=str(home))
    with subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *map(str, argv)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as p:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"crucible-coordinator {argv} ran past {timeout_s} s; stderr: {err}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def usage_error(r: subprocess.CompletedProcess[str], *names: str) -> str:
    """Assert exit 2, one line on stderr naming every one of `names`, no traceback; return the line."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


# ------------------------------------------------------------------------------------- operator key
@pytest.mark.parametrize(
    "argv",
    [
        ["launch", RUN_TOML, *BOOT, *STORE],
        ["stop", "tiny-llama-1", *BOOT, *STORE],
        ["serve", *BOOT, *STORE],
    ],
    ids=["launch", "stop", "serve"],
)
def test_commands_refuse_to_mint_an_operator_key(home: Path, argv: list[str | Path]) -> None:
    line = usage_error(crucible(home, *argv), "--operator-key-file", "~/.crucible/operator.key")
    assert "crucible-coordinator init" in line
    assert not (home / ".crucible").exists()  # nothing created behind the user's back
    key = home / "keys" / "op.key"
    line = usage_error(crucible(home, *argv, "--operator-key-file", key), "--operator-key-file", str(key))
    assert f"crucible-coordinator init --operator-key-file {key}" in line
    assert not key.parent.exists()


def test_init_creates_the_key_once_and_prints_its_peer_id(home: Path) -> None:
    r = crucible(home, "init")
    assert r.returncode == 0 and not r.stderr, r.stderr
    key = home / ".crucible" / "operator.key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_bytes()) == 32
    (peer,) = set(PEER_ID.findall(r.stdout))
    assert "created" in r.stdout and f"--operator-key {peer}" in r.stdout
    seed = key.read_bytes()
    again = crucible(home, "init")
    assert again.returncode == 0 and "already exists" in again.stdout, again.stdout + again.stderr
    assert set(PEER_ID.findall(again.stdout)) == {peer} and key.read_bytes() == seed
    # the key now passes; launch goes on to the next check (a folder given as the run spec)
    usage_error(crucible(home, "launch", home, *BOOT, *STORE), str(home), "folder")


def test_a_key_file_that_is_not_a_key_is_named(home: Path) -> None:
    bad = home / "operator.key"
    bad.write_text("not a seed\n")
    usage_error(
        crucible(home, "stop", "r", *BOOT, *STORE, "--operator-key-file", bad),
        "--operator-key-file",
        "11 bytes",
    )
    usage_error(crucible(home, "init", "--operator-key-file", bad), "--operator-key-file", "11 bytes")
    assert bad.read_text() == "not a seed\n"


# -------------------------------------------------------------------------------------- run spec
@pytest.mark.parametrize(
    ("toml", "names"),
    [
        ('[run]\nrun_id = "a"\n[trian]\nlr = 1e-3\n', ["'trian'", "[train]", "[sync]"]),
        ('[run]\nrun_id = "a"\n[train]\nlrr = 1e-3\n', ["[train]", "'lrr'", "warmup_steps"]),
        ('[run]\nrun_id = "a"\n[sync]\ntau = 50\n', ["sync.tau=50", "0 <= tau"]),
        ('[run]\nrun_id = "a"\n[model]\nd_model = -1\n', ["model.d_model=-1", "[1, 131072]"]),
        ('[run]\nrun_id = "a"\nreplicas = 0\n', ["replicas=0", "positive"]),
        ('[run]\nrun_id = "a"\n[train]\nlr = "fast"\n', ["train.lr", "expected a number"]),
        ('[run]\nrun_id = "a"\n[train\n', ["not valid TOML", "line 3"]),
        ("[run]\nreplicas = 2\n", ["run_id", "example"]),
    ],
    ids=[
        "misspelt-section",
        "misspelt-key",
        "tau-out-of-range",
        "negative-size",
        "zero",
        "type",
        "syntax",
        "no-id",
    ],
)
def test_launch_names_the_bad_part_of_the_run_spec(home: Path, toml: str, names: list[str]) -> None:
    spec = home / "run.toml"
    spec.write_text(toml)
    usage_error(crucible(home, "launch", spec, *BOOT, *STORE), str(spec), *names)


def test_launch_with_a_missing_run_spec(home: Path) -> None:
    usage_error(crucible(home, "launch", home / "nope.toml", *BOOT, *STORE), "nope.toml", "does not exist")


# ------------------------------------------------------------------------------------ swarm flags
def test_bad_store_endpoint(home: Path) -> None:
    usage_error(
        crucible(home, "launch", RUN_TOML, *BOOT, "--store-endpoint", "not-a-url"),
        "--store-endpoint",
        "'not-a-url'",
        "example: --store-endpoint https://ACCOUNT.r2.cloudflarestorage.com",
    )


@pytest.mark.parametrize(
    "addr",
    ["/ip4/1.2.3.4/tcp/x", "/ip4/1.2.3.4/tcp/31337", "1.2.3.4:31337"],
    ids=["port", "no-peer", "host:port"],
)
def test_bad_bootstrap(home: Path, addr: str) -> None:
    usage_error(crucible(home, "status", "--bootstrap", addr), "--bootstrap", repr(addr), f"/p2p/{PEER}")


def test_status_with_a_malformed_operator_key(home: Path) -> None:
    usage_error(
        crucible(home, "status", *BOOT, "--operator-key", "12D3KooWnotapeer"),
        "--operator-key",
        "12D3KooWnotapeer",
        PEER,
    )


def test_export_round_zero_and_out_a_file(home: Path) -> None:
    argv = ["export", "tiny-llama-1", "--operator-key", PEER, *STORE]
    usage_error(crucible(home, *argv, "--out", home / "hf", "--round", "0"), "--round 0", "--round 12")
    a_file = home / "f"
    a_file.write_text("")
    usage_error(crucible(home, *argv, "--out", a_file), "--out", str(a_file), "is a file")


def test_argparse_mistakes_are_one_line_too(home: Path) -> None:
    usage_error(crucible(home, "launch", RUN_TOML, *STORE), "--bootstrap", "required")
    usage_error(
        crucible(home, "launch", RUN_TOML, *BOOT, *STORE, "--log-level", "LOUD"), "--log-level", "LOUD"
    )
    usage_error(crucible(home, "stop", "Bad_Id", *BOOT, *STORE), "'Bad_Id'", "tiny-llama-1")


def test_debug_shows_the_traceback(home: Path) -> None:
    r = crucible(home, "serve", *BOOT, *STORE, "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "--operator-key-file" in r.stderr


def test_arguments_are_checked_before_hivemind_and_torch_are_imported(home: Path) -> None:
    code = (
        "import sys; from coordinator.cli import main; "
        f"rc = main(['launch', {str(RUN_TOML)!r}, '--bootstrap', '/ip4/1.2.3.4/tcp/x', *{STORE!r}]); "
        "heavy = sorted(m for m in ('hivemind', 'torch', 'boto3') if m in sys.modules); "
        "print(rc, heavy)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert r.stdout.strip() == "2 []", r.stdout + r.stderr


# -------------------------------------------------------------------------------------------- plan
PLAN = ["plan", "--model", "tiny", "--gpus", "4", "--stages", "2"]


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--usd-per-gpu-hour", "-1"], ["--usd-per-gpu-hour -1", "> 0", "1.17"]),
        (["--replicas", "0"], ["--replicas 0", ">= 1", "--replicas auto"]),
        (["--link-mbps", "0"], ["--link-mbps 0", "> 0"]),
        (["--microbatches", "-4"], ["--microbatches -4", ">= 1"]),
        (["--ceiling", "1.5"], ["--ceiling 1.5", "(0, 1]"]),
    ],
    ids=["negative-price", "zero-replicas", "zero-bandwidth", "negative-count", "ceiling"],
)
def test_plan_rejects_negative_and_zero_quantities(home: Path, flags: list[str], names: list[str]) -> None:
    r = crucible(home, *PLAN, "--usd-per-gpu-hour", "1.17", *flags)
    usage_error(r, *names)
    assert not r.stdout


def test_plan_replicas_auto_is_the_absent_flag(home: Path) -> None:
    auto = crucible(home, *PLAN, "--usd-per-gpu-hour", "1.17", "--replicas", "auto", "--json")
    absent = crucible(home, *PLAN, "--usd-per-gpu-hour", "1.17", "--json")
    assert auto.returncode == absent.returncode == 0, auto.stderr + absent.stderr
    assert auto.stdout == absent.stdout and '"replicas":2' in auto.stdout


def test_plan_warns_when_a_pool_entry_has_no_price(home: Path) -> None:
    pool = home / "pool.toml"
    pool.write_text(
        '[[hosts]]\nname = "own-a100"\naccelerator = "a100-80gb"\ncount = 4\n'
        "link_mbps = 1000\nrtt_ms = 30\nstore_mbps = 1000\n"
    )
    r = crucible(home, "plan", "--model", "tiny", "--pool", pool, "--stages", "2")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    (warning,) = r.stderr.strip().splitlines()
    assert "warning" in warning and "'own-a100'" in warning and "usd_per_gpu_hour" in warning
    assert "$/Mtok n/a (no price)" in r.stdout and "$0.0000" not in r.stdout
    priced = crucible(
        home, "plan", "--model", "tiny", "--pool", pool, "--stages", "2", "--usd-per-gpu-hour", "1"
    )
    assert priced.returncode == 0 and not priced.stderr and "n/a (no price)" not in priced.stdout
    pool.write_text(pool.read_text() + "colour = 1\n")
    usage_error(crucible(home, "plan", "--pool", pool), str(pool), "'colour'", "usd_per_gpu_hour")


# -------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize(
    "command", ["", "init", "certify", "serve", "launch", "status", "stop", "export", "plan"]
)
def test_help_of_every_subcommand(home: Path, command: str) -> None:
    r = crucible(home, *([command] if command else []), "--help")
    assert r.returncode == 0 and "usage: crucible-coordinator" in r.stdout and not r.stderr, r.stderr
    if command:
        assert "--debug" in r.stdout and "--log-format {text,json}" in r.stdout
        return
    # issue 19: the examples line up (a continued line goes on under its command's arguments) and fit
    lines = r.stdout[r.stdout.index("examples:") :].splitlines()
    examples = [ln for ln in lines if "crucible-coordinator " in ln]
    assert len(examples) >= 9 and all(ln.startswith("  crucible-coordinator ") for ln in examples), examples
    for i, ln in enumerate(lines):
        assert len(ln) <= 100, ln
        if ln.endswith("\\"):
            assert lines[i + 1].startswith(" " * len("  crucible-coordinator serve ")), lines[i + 1]


def test_serve_help_shows_the_timer_defaults(home: Path) -> None:
    r = crucible(home, "serve", "--help")
    flat = " ".join(r.stdout.split())  # argparse wraps to the terminal's width
    assert re.search(r"--lease-s SECONDS [^-]*\(default 15\)", flat), r.stdout
    assert re.search(r"--churn-grace-s SECONDS [^-]*\(default 10\)", flat), r.stdout


def test_every_command_takes_json_logs(home: Path) -> None:
    """--log-format json is accepted by every command (init, plan and certify refused it)."""
    from coordinator.cli import build_parser

    ap = build_parser()
    key = ["--operator-key-file", str(home / "op.key")]
    for argv in (
        ["init", *key],
        ["certify", PEER, "--expires", "7d", "--any-run", "--out", str(home / "c.cert"), *key],
        ["serve", *BOOT, *STORE],
        ["launch", str(RUN_TOML), *BOOT, *STORE],
        ["status", *BOOT],
        ["stop", "r", *STORE],
        ["export", "r", "--out", str(home / "hf"), "--operator-key", PEER, *STORE],
        ["plan", "--model", "tiny", "--gpus", "2"],
    ):
        args = ap.parse_args([*argv, "--log-format", "json", "--log-level", "INFO"])
        assert (args.log_format, args.log_level) == ("json", "INFO"), argv
    r = crucible(home, "init", *key, "--log-format", "json")
    assert r.returncode == 0 and "operator peer id" in r.stdout, r.stderr
    r = crucible(home, "certify", PEER, "--expires", "7d", "--any-run", "--out", home / "c.cert", *key,
                 "--log-format", "json")  # fmt: skip
    assert r.returncode == 0 and (home / "c.cert").exists(), r.stderr
    r = crucible(home, *PLAN, "--usd-per-gpu-hour", "1", "--log-format", "json")
    assert r.returncode == 0 and "topology" in r.stdout, r.stderr


def test_stop_needs_no_bootstrap(tmp_path: Path, moto_store: str) -> None:
    """Issue 13: options a command does not use are not required: `stop` writes the signed stop request to
    the store and never joins the DHT."""
    from protocol.envelope import seal
    from protocol.identity import Identity
    from protocol.keys import spec_key
    from protocol.messages import RunRecord
    from protocol.net.store import ObjectStore, StoreConfig
    from protocol.runspec import RunSpec

    store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible"))
    store.ensure_bucket()
    assert crucible(tmp_path, "init").returncode == 0
    operator = Identity.load_or_create(tmp_path / ".crucible" / "operator.key")
    record = RunRecord(spec=RunSpec(run_id="some-run"), state="running", updated=time.time())
    store.put(spec_key("some-run"), seal(operator, record))  # as launch, then its coordinator, write it
    r = crucible(tmp_path, "stop", "some-run", "--store-endpoint", moto_store)
    assert r.returncode == 0 and "stop requested for run some-run" in r.stdout, r.stderr


def test_every_cli_has_version_and_json_logs_are_one_object_per_line() -> None:
    import io

    from protocol.process.logs import JsonFormatter, setup_logging

    for module, prog in (
        ("coordinator.cli", "crucible-coordinator"),
        ("node.cli", "crucible-node"),
        ("scripts.local_swarm", "crucible-swarm"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and re.fullmatch(rf"{prog} \d+\.\d+\.\d+\S*\n", r.stdout), (
            r.stdout,
            r.stderr,
        )
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("crucible.test.json")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)  # whatever level a command run in-process before left on the root
    try:
        log.warning("run %s: %d nodes", 'a b\n"c"', 4)
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (
        first["msg"] == 'run a b\n"c": 4 nodes'
        and first["level"] == "WARNING"
        and first["logger"] == log.name
    )
    assert second["exc"].startswith("Traceback") and "ValueError: boom" in second["exc"]
    with pytest.raises(ValueError, match="--log-format json"):
        setup_logging("INFO", "yaml")


# ------------------------------------------------------------- issue 19: runs a new user gets wrong
@pytest.fixture(scope="module")
def dht() -> Iterator[Any]:
    """A DHT peer in this process: the CLI's commands bootstrap from it, the coordinator ticked here
    reads and publishes through it."""
    from protocol.identity import Identity
    from protocol.net.dht_client import DHTClient

    peer = DHTClient(Identity.generate())
    try:
        yield peer
    finally:
        peer.shutdown()


def _operator(home: Path) -> Any:
    from protocol.identity import Identity

    assert crucible(home, "init").returncode == 0
    return Identity.load_or_create(home / ".crucible" / "operator.key")


DHT_S = 60.0
"""Commands that join the DHT (hivemind's daemon starts first): seconds more on a loaded host."""


def in_process(
    capsys: pytest.CaptureFixture[str], home: Path, *argv: str | Path
) -> subprocess.CompletedProcess[str]:
    """`crucible-coordinator ARGV` through its entry point in this process, HOME=home: a command that joins
    the DHT, without the 5-10 s of a new interpreter importing hivemind and torch again."""
    from coordinator.cli import main

    saved = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        rc = main([str(a) for a in argv])
    finally:
        if saved is None:
            del os.environ["HOME"]
        else:
            os.environ["HOME"] = saved
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), rc, out.out, out.err)


def test_the_ready_line_is_json_in_json_mode(home: Path, dht: Any, moto_store: str) -> None:
    """`serve --log-format json` printed its ready line as text among JSON log lines: it is one JSON
    object too, with what the text line says (scripts/local_swarm.py reads the text line, which is
    unchanged: tests/test_delegation.py)."""
    from scripts.procs import Child

    operator = _operator(home)
    argv = ["-m", "coordinator.cli", "serve", "--bootstrap", dht.visible_maddrs()[0]]
    child = Child("serve-json", [*argv, "--store-endpoint", moto_store, "--log-format", "json"], home,
                  {"HOME": str(home)})  # fmt: skip
    try:
        line = child.wait_for(r'\{[^\n]*"event": "ready"[^\n]*\}', DHT_S).group(0)
        ready = json.loads(line)
        assert ready["msg"].startswith(f"crucible-coordinator ready: operator={operator.peer_id} dht=")
        assert ready["operator"] == operator.peer_id and ready["dashboard"].startswith("http://127.0.0.1:")
        assert ready["dht"].startswith("12D3KooW") and ready["level"] == "INFO" and ready["pid"] > 0
        assert child.stop(timeout_s=15) == 0
        for ln in child.log_text().splitlines():  # and every other line is a JSON object
            assert isinstance(json.loads(ln), dict), ln
    finally:
        child.stop(timeout_s=5)


def test_unknown_waiting_stopped_and_finished_runs_say_so(
    home: Path, dht: Any, moto_store: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stop` and `status` of a run that does not exist exit 2 naming it; a run launched on too few nodes
    is pending and says why in `status` and the dashboard's API; a run that ended says so to `stop`; a
    finished run id is not launched again (it printed "launched" and nothing happened)."""
    from coordinator.service import Coordinator
    from protocol.envelope import seal
    from protocol.keys import spec_key
    from protocol.messages import RunRecord
    from protocol.net.store import ObjectStore, StoreConfig
    from protocol.runspec import RunSpec

    store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible"))
    store.ensure_bucket()
    operator = _operator(home)
    boot, at = ["--bootstrap", dht.visible_maddrs()[0]], ["--store-endpoint", moto_store]
    usage_error(crucible(home, "stop", "nosuch-run", *at), "'nosuch-run'", "status")
    usage_error(in_process(capsys, home, "status", "nosuch-run", *boot), "'nosuch-run'", "status")

    spec = home / "wide.toml"
    spec.write_text('[run]\nrun_id = "wide-4x2"\nreplicas = 4\nstages = 2\n')
    r = in_process(capsys, home, "launch", spec, *boot, *at)
    assert r.returncode == 0 and "launched run wide-4x2" in r.stdout and "status wide-4x2" in r.stdout, (
        r.stderr
    )
    coord = Coordinator(operator, dht, store)
    coord.tick()  # no node advertises: it waits, and says for what
    waiting = "waiting for nodes: need 8 free nodes for 4 replicas x 2 stages, found 0"
    assert coord.view["runs"]["wide-4x2"]["state"] == "pending"
    assert coord.view["runs"]["wide-4x2"]["reason"].startswith(waiting)  # what the dashboard shows
    r = in_process(capsys, home, "status", "wide-4x2", *boot, "--operator-key", operator.peer_id)
    assert r.returncode == 0 and "run wide-4x2: pending" in r.stdout, r.stdout + r.stderr
    assert f"reason: {waiting}; it starts when enough join" in r.stdout, r.stdout

    r = crucible(home, "stop", "wide-4x2", *at)
    assert r.returncode == 0 and "stop requested" in r.stdout, r.stderr
    coord.tick()
    assert coord.runs["wide-4x2"].record.state == "stopped"
    r = crucible(home, "stop", "wide-4x2", *at)  # the coordinator wrote the end to the store
    assert r.returncode == 0 and re.search(r"already ended \(stopped at \S+Z\); nothing to stop", r.stdout), r

    # a finished run, as its coordinator leaves it in the store (its DHT record expired long ago)
    finished = RunRecord(spec=RunSpec(run_id="finished-1"), state="done", updated=time.time() - 3600)
    store.put(spec_key("finished-1"), seal(operator, finished))
    spec.write_text('[run]\nrun_id = "finished-1"\n')
    line = usage_error(crucible(home, "launch", spec, *boot, *at, timeout_s=DHT_S), "finished-1", str(spec))
    assert "already finished (done at" in line and "new run id" in line, line


def _taken_over_run(dht: Any, store: Any, operator: Any, spec: Any) -> dict[tuple[int, int], Any]:
    """A 2 x 2 run placed at term 1 epoch 3 whose first coordinator died (its lease lapsed 70 s ago, its
    assignment archive in the store, its record in the DHT): the nodes' identities by (replica, stage)."""
    import msgpack

    from coordinator.lease import try_acquire
    from protocol import keys
    from protocol.envelope import seal
    from protocol.identity import Identity
    from protocol.messages import Assignment, RunRecord
    from protocol.net.dht_client import dht_time

    rid = spec.run_id
    nodes = {(r, s): Identity.generate() for r in range(2) for s in range(2)}
    assert try_acquire(store, operator, rid, 30, now=time.time() - 100)
    archive = [
        seal(operator, Assignment(
            run_id=rid, term=1, epoch=3, peer_id=n.peer_id, replica=r, stage=s,
            layers=list(spec.layer_ranges()[s]), spec=spec,
            stage_peers={str(rr): nodes[(rr, s)].peer_id for rr in range(2)},
        ))
        for (r, s), n in nodes.items()
    ]  # fmt: skip
    store.put(keys.assign_key(rid, 1, 3), msgpack.packb(archive))
    record = RunRecord(spec=spec, state="running", term=1, coordinator=operator.peer_id, updated=dht_time())
    assert dht.publish(keys.RUNS_KEY, record, 60, signer=operator, name=rid)
    return nodes


def _advertise(dht: Any, node: Any, slot: tuple[int, int], spec: Any, **fields: Any) -> None:
    """`node`'s advert for `slot` (replica, stage) of `spec`'s run at epoch 3, now; `fields` override."""
    from protocol import keys
    from protocol.messages import NodeAdvert
    from protocol.net.dht_client import dht_time

    replica, stage = slot
    base = dict(
        peer_id=node.peer_id, version="test", device="cpu", memory_gb=16.0, tflops=1.0, price_per_hour=0.5,
        host="127.0.0.1", port=4000 + 2 * replica + stage, health_port=5000, run_id=spec.run_id,
        replica=replica, stage=stage, epoch=3, step=40, tokens_per_s=1470.0, timestamp=dht_time(),
        state="training",
    )  # fmt: skip
    assert dht.publish(keys.NODES_KEY, NodeAdvert(**{**base, **fields}), 60, signer=node)


def _replica_1_loses_its_last_stage(dht: Any, nodes: dict[tuple[int, int], Any], spec: Any) -> None:
    """Replica 0 trains; replica 1's last stage is gone (no advert), its first reports the broken link."""
    for (r, s), n in nodes.items():
        if (r, s) != (1, 1):
            _advertise(dht, n, (r, s), spec, state="failed" if r else "training",
                       error="the link to stage 1 closed" if r else "")  # fmt: skip


def test_a_replica_that_dropped_out_is_shown_as_such(
    home: Path,
    dht: Any,
    moto_store: str,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A 2 x 2 run whose replica 1 lost a node with no free node to replace it (a coordinator takes it over
    from the store): the coordinator logs that it cannot rebuild once, not on every tick; `status` and the
    dashboard show replica 1 as dropped out, not with its failed node's last figures; the dashboard's
    plots, rendered by Chromium, label both axes with a few round ticks (time since the first sample,
    numbers like 2,000)."""

    from coordinator.dashboard import Dashboard
    from coordinator.run_figures import Sample
    from coordinator.service import Coordinator
    from protocol.net.store import ObjectStore, StoreConfig
    from protocol.runspec import ModelSpec, ReplicaShape, RunSpec
    from tests.helpers.observability import chromium, plot_ticks

    store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible"))
    store.ensure_bucket()
    operator = _operator(home)
    rid = "dropping-2x2"
    spec = RunSpec(
        run_id=rid,
        replicas=2,
        stages=2,
        model=ModelSpec(d_model=32, n_layers=2, n_heads=2),
        shapes=[ReplicaShape(replicas=[1], microbatches=8)],  # replica 1 at twice the batch (issue 22)
    )
    nodes = _taken_over_run(dht, store, operator, spec)
    _replica_1_loses_its_last_stage(dht, nodes, spec)
    coord = Coordinator(operator, dht, store)
    t0 = time.time() - 130  # two minutes of history before the takeover, for the plots' axes
    for i in range(128):
        coord.history.add(rid, Sample(
            t=t0 + i, step=i, loss=5.0 - i / 64, val_bpb=None, tokens_per_s=2940.0 * i / 127,
            effective_mfu=0.1, tax=0.8, usd_per_mtok=0.5, bytes_pipe=10**6 * i, bytes_store=10**5 * i,
            nodes_training=4,
        ))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="coordinator.service"):
        for _ in range(4):
            coord.tick()
    run = coord.runs[rid]
    assert run.dropped == {1} and run.record.reason.startswith("replica 1 dropped out: node "), run.record
    assert "its node stopped advertising" in run.record.reason
    rebuilds = [m for m in caplog.messages if "cannot rebuild replicas [1] yet" in m]
    assert len(rebuilds) == 1, caplog.messages  # once, not on each of the 4 ticks
    grid = coord.view["runs"][rid]["grid"]
    assert [c["state"] for c in grid[1]] == ["dropped out"] * 2 and grid[1][0]["tokens_per_s"] == 0
    assert [c["state"] for c in grid[0]] == ["training"] * 2

    r = in_process(capsys, home, "status", rid, "--bootstrap", dht.visible_maddrs()[0])
    assert r.returncode == 0 and f"run {rid}: running" in r.stdout, r.stdout + r.stderr
    assert "reason: replica 1 dropped out: node" in r.stdout, r.stdout
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines() if rid in ln and not ln.startswith("run ")}
    assert "dropped out" in rows[nodes[(1, 0)].peer_id[-8:]], rows
    assert "training" in rows[nodes[(0, 1)].peer_id[-8:]], rows

    board = Dashboard(coord, "127.0.0.1", 0)
    try:
        dom = chromium(
            f"http://127.0.0.1:{board.port}/?run={rid}", "--virtual-time-budget=3000", "--dump-dom"
        )
    finally:
        board.close()
    assert re.search(r'<div id="run-reason">running: replica 1 dropped out: node', dom), dom[:3000]
    cells = re.findall(r'<td class="cell dropped"[^>]*>([^<]*)</td>', dom)
    assert len(cells) == 2 and "dropped out at step 40" in cells[0], cells
    assert "1 (batch 16)" in dom and "0 (batch 8)" in dom  # replicas of different batch sizes say so
    # issue 26: the faults the coordinator saw (a node failed, one gone, the replica out) marked on each plot
    faults = re.findall(r'<path[^>]*class="event fault"[^>]*><title>fault: ([^<]*)</title>', dom)
    assert len(faults) == 5 * 3 and sum("dropped out" in f for f in faults) == 5, faults  # each once
    assert any("(replica 1, stage 1): its node stopped advertising" in f for f in faults), faults
    xs, ys = plot_ticks(dom, "plot-tps")
    assert xs[:3] == ["0s", "30s", "1m"] and len(xs) >= 4, xs
    assert ys[:4] == ["0", "1,000", "2,000", "3,000"], ys
    xs, ys = plot_ticks(dom, "plot-bytes")
    assert ys[-1] == "150" and len(ys) >= 3, ys

    # issue 26: the lost node comes back (its host restarted: same key, idle). Nothing of replica 1 is
    # gone now and its failures were at an old epoch, so no rebuild is due; it stays out until its wait
    # is over (REJOIN_AFTER_GRACES churn graces; set here as if it were), then it is placed again on its
    # own nodes (the placement picks their stages), healthy, and resumes from the consensus checkpoint
    from coordinator.run_watch import REJOIN_AFTER_GRACES

    assert run.rejoin_at[1] - time.monotonic() > (REJOIN_AFTER_GRACES - 1) * coord.watch.churn_grace_s
    _advertise(
        dht, nodes[(1, 1)], (1, 1), spec, run_id="", replica=-1, stage=-1, epoch=0, state="idle", step=0
    )
    epoch = run.epoch
    coord.tick()
    assert run.dropped == {1} and run.epoch == epoch  # not before its wait is over
    run.rejoin_at[1] = 0.0
    coord.tick()
    assert not run.dropped_out() and run.epoch == epoch + 1, (run.dropped, run.epoch)
    assert run.placement is not None
    assert {run.placement.slots[(1, s)] for s in (0, 1)} == {nodes[(1, s)].peer_id for s in (0, 1)}
    assert run.rejoins == {1: 1} and 1 not in run.rejoin_at
    marks = coord.view["runs"][rid]["events"]
    assert marks[-1]["kind"] == "recovery" and "replica(s) [1] rebuilt" in marks[-1]["what"], marks


def test_adverts_are_aged_from_when_the_tick_read_them(home: Path, dht: Any, moto_store: str) -> None:
    """Issue 26 (found by the soak): a tick that the store slowed (a lease renewal held through retries)
    must not age every advert it read before: judged against when they were read, all four nodes of a
    2 x 2 run are live; judged against the time the watch ran, 2.5 s later with a 1 s churn grace, all
    four looked gone and the run failed."""
    from coordinator.service import Coordinator
    from protocol.net.dht_client import dht_time
    from protocol.net.store import ObjectStore, StoreConfig
    from protocol.runspec import ModelSpec, RunSpec

    store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible"))
    store.ensure_bucket()
    operator = _operator(home)
    spec = RunSpec(
        run_id="aged-2x2", replicas=2, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2)
    )
    nodes = _taken_over_run(dht, store, operator, spec)
    for (r, s), n in nodes.items():
        _advertise(dht, n, (r, s), spec)
    coord = Coordinator(operator, dht, store, churn_grace_s=1.0)
    coord.tick()
    run = coord.runs[spec.run_id]
    assert run.placement is not None and run.epoch == 3
    adverts, read_at = coord.adverts(), dht_time()
    time.sleep(2.5)  # the store held the tick this long after the adverts were read
    coord.watch.watch(run, adverts, read_at)
    assert not run.dropped_out() and run.record.state == "running", (run.missing_since, run.record)
    coord.watch.watch(run, adverts)  # the same adverts aged to now: what the coordinator used to do
    assert run.dropped_out() == {0, 1}
    assert run.record.state == "running"  # nodes that vanished are waited for; no failure of theirs
    # their next adverts: training at the run's epoch, nobody told otherwise: back in their slots
    for (r, s), n in nodes.items():
        _advertise(dht, n, (r, s), spec, step=44)
    coord.watch.watch(run, coord.adverts(), dht_time())
    assert not run.dropped_out() and run.epoch == 3 and run.record.state == "running", run.missing_since
    # a DHT read that misses a node's advert (a peer holding it stalled, as a SIGSTOPped host's does):
    # the node is as old as its last advert seen, not gone (the soak's 30-minute run dropped a live replica so)
    partial = {p: a for p, a in coord.adverts().items() if p != nodes[(0, 0)].peer_id}
    coord.watch.watch(run, partial, dht_time())
    assert not run.dropped_out(), run.missing_since


def test_a_rebuild_leaves_a_dropped_replica_s_slots_alone(home: Path, moto_store: str) -> None:
    """Replica 1 dropped out (a node gone, none free; back now, waiting out its rejoin); then replica 0
    loses a node and is rebuilt. The new epoch's assignments are issued to replica 0's slots only: replica
    1's nodes keep their old ones (a newer epoch leaves them out, node/daemon.py
    `AssignmentSource.left_out`), where issuing their slots again at the new epoch had them start those
    slots afresh from their old start step, a replica nobody counts. Its own DHT: idle nodes that other
    tests advertised would fill replica 1."""
    from protocol.identity import Identity
    from protocol.net.dht_client import DHTClient
    from protocol.net.store import ObjectStore, StoreConfig
    from protocol.runspec import ModelSpec, RunSpec

    store = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible"))
    store.ensure_bucket()
    operator = _operator(home)
    spec = RunSpec(
        run_id="rebuild-2x2", replicas=2, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2)
    )
    dht = DHTClient(Identity.generate())
    try:
        _rebuild_with_one_replica_out(dht, store, operator, spec)
    finally:
        dht.shutdown()


def _rebuild_with_one_replica_out(dht: Any, store: Any, operator: Any, spec: Any) -> None:
    from coordinator.service import Coordinator
    from protocol import keys
    from protocol.identity import Identity
    from protocol.trust.assignment_archive import decode_archive
    from protocol.trust.delegation import OperatorTrust

    nodes = _taken_over_run(dht, store, operator, spec)
    _replica_1_loses_its_last_stage(dht, nodes, spec)
    coord = Coordinator(operator, dht, store)
    for _ in range(4):
        coord.tick()
    run = coord.runs[spec.run_id]
    assert run.dropped == {1}, (run.dropped, run.record.reason)
    dropped_at = run.epoch
    # its lost node comes back idle: replica 1 waits out its rejoin (nothing of it to rebuild now)
    _advertise(
        dht, nodes[(1, 1)], (1, 1), spec, run_id="", replica=-1, stage=-1, epoch=0, state="idle", step=0
    )
    coord.tick()
    assert run.dropped == {1} and run.epoch == dropped_at
    fresh = Identity.generate()
    _advertise(dht, fresh, (0, 1), spec, run_id="", replica=-1, stage=-1, epoch=0, state="idle", step=0)
    _advertise(
        dht, nodes[(0, 1)], (0, 1), spec, epoch=run.epoch, state="failed", error="CUDA error: device lost"
    )
    coord.tick()
    run.missing_since[nodes[(0, 1)].peer_id] -= 10 * coord.watch.churn_grace_s  # as if its grace were over
    coord.tick()
    assert run.epoch == dropped_at + 1 and run.dropped == {1}, (run.epoch, run.dropped)
    blob = store.get(keys.assign_key(spec.run_id, run.lease.lease.term, run.epoch))
    assert blob is not None
    archived = decode_archive(blob, OperatorTrust.of({operator.public_key}), as_issued=True)
    epochs = {(a.replica, a.stage): a.epoch for a in archived}
    assert epochs[(0, 0)] == epochs[(0, 1)] == run.epoch, epochs
    assert epochs[(1, 0)] < run.epoch and epochs[(1, 1)] < run.epoch, epochs  # left as they were

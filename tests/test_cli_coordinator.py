"""Issue 12, the operator's side: `crucible-coordinator` as a user types it, in real processes.

Every mistake exits 2 with one line on stderr that names the flag, key or file, within 10 s, without a
traceback; only `init` creates an operator key; `plan` refuses negative and zero quantities and says when
a price is missing. No case reaches the network: each one stops at a check made before any connection
(the addresses below are never dialled), and the checks run before hivemind or torch is imported.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_TOML = ROOT / "docs" / "examples" / "run.toml"
TIMEOUT_S = 10.0
"""The issue's bound on how long a user waits to hear about a mistake."""
PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
BOOT = ["--bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"]
STORE = ["--store-endpoint", "http://127.0.0.1:9"]
PEER_ID = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]{44}")


def crucible(home: Path, *argv: str | Path) -> subprocess.CompletedProcess[str]:
    """`crucible-coordinator ARGV` with HOME=home (so the default key path is the test's), killed with its
    process group after TIMEOUT_S."""
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
            out, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"crucible-coordinator {argv} ran past {TIMEOUT_S} s; stderr: {err}")
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
        "example: http://",
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
        assert "--debug" in r.stdout


def test_stop_needs_no_bootstrap(tmp_path: Path, moto_store: str) -> None:
    """Issue 13: options a command does not use are not required: `stop` writes the signed stop request to
    the store and never joins the DHT."""
    from protocol.store import ObjectStore, StoreConfig

    ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="crucible")).ensure_bucket()
    assert crucible(tmp_path, "init").returncode == 0
    r = crucible(tmp_path, "stop", "some-run", "--store-endpoint", moto_store)
    assert r.returncode == 0 and "stop requested for run some-run" in r.stdout, r.stderr


def test_every_cli_has_version_and_json_logs_are_one_object_per_line() -> None:
    import io
    import json
    import logging

    from protocol.logs import JsonFormatter, setup_logging

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

"""`crucible-node` as a provider types it (issue 12): every mistake ends within 10 s with exit code 2 and one
line on stderr that names the flag or config key and the value, and no traceback; a second process with a
peer id already live in a real local swarm refuses to start, a restart after a crash does not."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.cli import BOOTSTRAP_KEY, NODE_KEY, SETTINGS, build_parser, join_settings, node_config
from protocol.process.cli_errors import EXAMPLE_PEER_ID, UsageError
from scripts.procs import Child

ROOT = Path(__file__).resolve().parent.parent
OPERATOR = EXAMPLE_PEER_ID
ERROR_WITHIN_S = 10.0
TWIN_WITHIN_S = 25.0
"""A refusal that needs the DHT (a live twin elsewhere): joining it takes seconds more on a loaded host."""
pytestmark = pytest.mark.timeout(120)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another process (this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """A HOME of its own, so default key files (~/.crucible/...) land in the test's folder."""
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def node(
    args: list[str], home: Path, timeout_s: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run `crucible-node ARGS`; (result, seconds until the process exited, as a shell prompt returns)."""
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "node.cli", *args],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    t = time.monotonic()
    try:
        p.wait(timeout_s)  # the outputs checked here are a few kB: they fit the pipes
        took = time.monotonic() - t
        out, err = p.communicate(timeout=30)  # a DHT daemon (p2pd) may hold the pipes a moment longer
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    return subprocess.CompletedProcess(args, p.returncode, out, err), took


def refused(args: list[str], home: Path, *named: str, within_s: float = ERROR_WITHIN_S) -> str:
    """Run `crucible-node ARGS`; assert exit 2, one line on stderr naming each of `named`, in time."""
    r, took = node(args, home)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("crucible-node: error: "), line
    for name in named:
        assert name in line, (name, line)
    assert took < within_s, f"{took:.1f} s to: {line}"
    return line


def join(*flags: str, bootstrap: str | None = None, store: str | None = None) -> list[str]:
    """`join` with an operator key, a bootstrap address nothing answers at, a store endpoint (by default
    one nothing answers at: for mistakes found before the store is dialled), and the given flags."""
    boot = ["--bootstrap", bootstrap or f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{OPERATOR}"]
    endpoint = ["--store-endpoint", store or f"http://127.0.0.1:{closed_port()}"]
    return ["join", "--operator-key", OPERATOR, *boot, *endpoint, *flags]


@pytest.fixture(scope="module")
def store_url(moto_store: str) -> str:
    """A real S3 server (moto) holding the default bucket: for joins that get past the store check."""
    from protocol.net.store import ObjectStore, StoreConfig

    ObjectStore(StoreConfig(endpoint_url=moto_store)).ensure_bucket()
    return moto_store


# --- flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (
            ["--store-endpoint", "not-a-url"],
            ["--store-endpoint", "'not-a-url'", "not an http(s) URL", "example"],
        ),
        (
            ["--price-per-hour", "-1"],
            ["--price-per-hour", "'-1'", "0 to 100000", "example: --price-per-hour"],
        ),
        (["--price-per-hour", "nan"], ["--price-per-hour", "'nan'", "finite"]),
        (["--port", "x"], ["--port", "'x'", "not a whole number", "example: --port"]),
        (["--health-port", "70000"], ["--health-port", "70000", "not a TCP port"]),
        (["--device", "gpu"], ["--device", "'gpu'", "cuda:N", "example: --device"]),
        (["--port", "7000", "--health-port", "7000"], ["--health-port", "7000", "also --port"]),
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    ],
)
def test_a_bad_flag_is_named(flags: list[str], named: list[str], home: Path) -> None:
    refused(join(*flags), home, *named)


def test_bootstrap_is_required(home: Path) -> None:
    refused(
        ["join", "--operator-key", OPERATOR], home, "--bootstrap is required", "example: --bootstrap /ip4/"
    )


def test_a_bootstrap_that_is_no_multiaddr(home: Path) -> None:
    line = refused(join(bootstrap="not-a-multiaddr"), home, "--bootstrap", "'not-a-multiaddr'")
    assert "not a valid multiaddr" in line and "/ip4/" in line and "/p2p/" in line


def test_an_unreachable_bootstrap_peer(home: Path, store_url: str) -> None:
    refused(join(store=store_url), home, "--bootstrap", "could not join the swarm", "Connection refused")


def test_join_without_a_store_is_refused(tmp_path: Path, home: Path) -> None:
    """Issue 19: `join` without --store-endpoint ran on as a node that could never take work (every stage
    syncs through the store). It now refuses at once, naming the flag, with an example; so does the
    daemon, before it binds a port."""
    boot = f"/ip4/127.0.0.1/tcp/9/p2p/{OPERATOR}"
    named = ("--store-endpoint is required", "never take work", "example: --store-endpoint https://")
    refused(["join", "--operator-key", OPERATOR, "--bootstrap", boot], home, *named)
    cfg = write(tmp_path, f'[node]\nbootstrap = ["{boot}"]\noperator_key = "{OPERATOR}"\n')
    refused(["join", "--config", cfg], home, *named, "endpoint_url in [store]")
    from node.daemon import NodeConfig, NodeDaemon
    from protocol.identity import Identity

    with pytest.raises(ValueError, match="store is required"):
        NodeDaemon(NodeConfig(device="cpu", operator_key=OPERATOR), Identity.generate())


@pytest.mark.parametrize(
    ("operator", "named"),
    [
        (None, ["--operator-key is required", "example: --operator-key 12D3KooW"]),
        ("12D3KooW...", ["--operator-key", "'12D3KooW...'", "not an Ed25519 peer id"]),
        ("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N", ["--operator-key", "not an Ed25519 peer id"]),
    ],
)
def test_operator_key_missing_or_malformed(operator: str | None, named: list[str], home: Path) -> None:
    flags = ["join", "--bootstrap", f"/ip4/127.0.0.1/tcp/9/p2p/{OPERATOR}"]
    refused(flags + (["--operator-key", operator] if operator else []), home, *named)


def test_a_corrupt_key_file(tmp_path: Path, home: Path) -> None:
    key = tmp_path / "node.key"
    key.write_bytes(b"not a key")
    refused(join("--key-file", str(key)), home, "--key-file", str(key), "9 bytes", "32-byte")
    refused(["identity", "--key-file", str(key)], home, "--key-file", "9 bytes")
    refused(["bootstrap", "--key-file", str(key)], home, "--key-file", "9 bytes")
    refused(["identity", "--key-file", str(tmp_path)], home, "--key-file", "Is a directory")


@pytest.mark.parametrize("flag", ["--port", "--health-port", "--dht-port"])
def test_a_busy_port_is_named_by_its_flag(flag: str, busy_port: int, home: Path) -> None:
    line = refused(join(flag, str(busy_port)), home, flag, str(busy_port), "already in use")
    assert "bootstrap" not in line  # a busy --dht-port used to be blamed on the bootstrap peer


def test_bootstrap_peer_on_a_busy_dht_port(busy_port: int, home: Path) -> None:
    refused(["bootstrap", "--dht-port", str(busy_port)], home, "--dht-port", str(busy_port), "already in use")


def test_a_port_taken_after_the_preflight_is_still_named_by_its_flag() -> None:
    """The race the preflight cannot close: the start itself fails on the port; the error names the flag."""
    from node.preflight import refuse_if_taken

    p2pd = RuntimeError(  # what hivemind raises, wrapped by DHTClient as a bootstrap failure
        "Daemon failed to start: failed to listen on any addresses: "
        "[listen tcp4 127.0.0.1:4001: bind: address already in use]"
    )
    try:
        raise ValueError(
            "could not join the swarm through /ip4/...: check that the bootstrap peer..."
        ) from p2pd
    except ValueError as e:
        with pytest.raises(UsageError, match=r"^--dht-port 4001: already in use on 127.0.0.1"):
            refuse_if_taken(e, "--dht-port", "127.0.0.1", 4001)
    health = RuntimeError("health server could not listen")
    health.__cause__ = OSError(errno.EADDRINUSE, "Address already in use")
    with pytest.raises(UsageError, match=r"^--health-port 8080: already in use"):
        refuse_if_taken(health, "--health-port", "127.0.0.1", 8080)
    refuse_if_taken(RuntimeError("something else"), "--port", "127.0.0.1", 7000)  # not ours to name
    refuse_if_taken(health, "--health-port", "127.0.0.1", 0)  # port 0: the OS picked it, no flag to blame


def test_an_unreachable_store(home: Path) -> None:
    port = closed_port()
    refused(
        join("--store-endpoint", f"http://127.0.0.1:{port}"),
        home,
        "--store-endpoint",
        f"127.0.0.1:{port}",
        "Connection refused",
    )


def test_every_subcommand_has_help(home: Path) -> None:
    for sub in ([], ["bootstrap"], ["join"], ["identity"]):
        r, took = node([*sub, "--help"], home)
        assert r.returncode == 0 and "usage: crucible-node" in r.stdout and not r.stderr, r.stderr
        assert took < ERROR_WITHIN_S
        if sub:
            assert "--debug" in r.stdout
    r, _ = node(["join", "--help"], home)
    for s in SETTINGS:  # every flag of the settings table is listed
        assert s.flag is None or s.flag in r.stdout


def test_debug_shows_the_traceback(home: Path) -> None:
    r, _ = node([*join("--price-per-hour", "-1"), "--debug"], home)
    assert r.returncode != 0 and "Traceback" in r.stderr and "UsageError" in r.stderr


# --- the config file -----------------------------------------------------------------------------
def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return str(path)


def test_a_misspelt_section_is_refused(tmp_path: Path, home: Path) -> None:
    cfg = write(tmp_path, f'[nodes]\noperator_key = "{OPERATOR}"\n')
    refused(["join", "--config", cfg], home, cfg, "unknown section [nodes]", "[node], [store]")


def test_an_unknown_key_is_refused_with_the_valid_ones(tmp_path: Path, home: Path) -> None:
    cfg = write(tmp_path, f'[node]\noperater_key = "{OPERATOR}"\n')
    refused(["join", "--config", cfg], home, cfg, "'operater_key'", "operator_key", "price_per_hour")
    cfg = write(tmp_path, '[store]\nendpoint = "http://127.0.0.1:9000"\n')
    refused(["join", "--config", cfg], home, "[store]", "'endpoint'", "endpoint_url")


def test_a_bad_value_in_the_file_is_named_by_its_key(tmp_path: Path, home: Path) -> None:
    cfg = write(tmp_path, "[node]\nprice_per_hour = -1\n")
    refused(
        ["join", "--config", cfg], home, "[node] price_per_hour", cfg, "-1", "example: price_per_hour = 1.17"
    )
    cfg = write(tmp_path, '[node]\nport = "x"\n')
    refused(["join", "--config", cfg], home, "[node] port", "'x'", "whole number")
    cfg = write(tmp_path, "[node\n")
    refused(["join", "--config", cfg], home, "--config", "not valid TOML", "line 1")
    refused(["join", "--config", str(tmp_path / "missing.toml")], home, "--config", "no such config file")


def test_bootstrap_given_only_in_the_file_is_used(tmp_path: Path, home: Path, store_url: str) -> None:
    """It used to be reported missing: here the join gets past that to dialling it (nothing answers)."""
    boot = f"/ip4/127.0.0.1/tcp/{closed_port()}/p2p/{OPERATOR}"
    cfg = write(
        tmp_path,
        f'[node]\nbootstrap = ["{boot}"]\noperator_key = "{OPERATOR}"\n[store]\nendpoint_url = "{store_url}"\n',
    )
    line = refused(["join", "--config", cfg], home, "[node] bootstrap", cfg, "could not join the swarm")
    assert "required" not in line


def test_flags_override_the_file_and_every_flag_has_a_key(tmp_path: Path) -> None:
    from node.config import NodeConfig
    from protocol.net.store import StoreConfig

    cfg = write(
        tmp_path,
        f'[node]\nbootstrap = ["/ip4/127.0.0.1/tcp/9/p2p/{OPERATOR}"]\noperator_key = "{OPERATOR}"\n'
        'price_per_hour = 1.0\ndevice = "cpu"\n[store]\nendpoint_url = "http://127.0.0.1:9000"\n',
    )
    args = build_parser().parse_args(["join", "--config", cfg, "--price-per-hour", "2.5", "--no-compile"])
    st = join_settings(args)
    node_cfg = node_config(st)
    assert node_cfg.price_per_hour == 2.5 and node_cfg.device == "cpu" and node_cfg.compile is False
    assert node_cfg.store is not None and node_cfg.store.endpoint_url == "http://127.0.0.1:9000"
    assert st.label("node", "price_per_hour") == "--price-per-hour"
    assert st.label("node", "device") == f"[node] device in {cfg}"
    # the table and the daemon's config agree: no NodeConfig field without a key, no key without a field
    import dataclasses

    node_keys = {s.key for s in SETTINGS if s.section == "node"}
    assert node_keys == {f.name for f in dataclasses.fields(NodeConfig)} - {"store"}
    assert {s.key for s in SETTINGS if s.section == "store"} == {
        f.name for f in dataclasses.fields(StoreConfig)
    }


def test_the_example_config_is_valid() -> None:
    args = build_parser().parse_args(["join", "--config", str(ROOT / "docs" / "examples" / "node.toml")])
    node_cfg = node_config(join_settings(args))
    assert node_cfg.bootstrap and node_cfg.operator_key.startswith("12D3KooW") and node_cfg.store is not None


def test_default_key_files_differ_by_role() -> None:
    ap = build_parser()
    assert ap.parse_args(["bootstrap"]).key_file == BOOTSTRAP_KEY != NODE_KEY
    assert ap.parse_args(["identity"]).key_file == NODE_KEY
    with pytest.raises(UsageError, match="--bootstrap is required"):
        join_settings(ap.parse_args(["join", "--operator-key", OPERATOR]))


# --- a real local swarm --------------------------------------------------------------------------
@pytest.mark.slow
def test_a_second_process_with_a_live_peer_id_refuses_and_a_restart_works(tmp_path: Path, home: Path) -> None:
    """A bootstrap peer and a node on one host with their default key files (they used to share one and
    the join failed), the node configured by its file alone. The same `join` again is refused by the key
    file's lock; a copy of the key (as on another host) by the live advert and its health endpoint.
    After the first node is killed its advert is a leftover, and the same key starts again."""
    env = {"HOME": str(home)}
    children: list[Child] = []
    try:
        store = Child("store", ["-m", "scripts.embedded_store"], tmp_path)
        boot = Child("bootstrap", ["-m", "node.cli", "bootstrap"], tmp_path, env)
        children += [store, boot]
        store_url = store.wait_for(r"STORE (\S+)", 60).group(1)
        bootstrap = boot.wait_for(r"BOOTSTRAP (\S+)", 60).group(1)
        cfg = write(
            tmp_path,
            f'[node]\nbootstrap = ["{bootstrap}"]\noperator_key = "{OPERATOR}"\ndevice = "cpu"\n'
            f'torch_threads = 1\n[store]\nendpoint_url = "{store_url}"\n',
        )
        first = Child("node", ["-m", "node.cli", "join", "--config", cfg], tmp_path, env)
        children.append(first)
        peer_id = first.wait_for(r"crucible-node ready: peer_id=(\S+)", 60).group(1)
        health = first.wait_for(r"health=(\S+)", 5).group(1)
        keys = home / ".crucible"
        assert (keys / "bootstrap.key").read_bytes() != (keys / "node.key").read_bytes()

        refused(["join", "--config", cfg], home, "--key-file", "another crucible-node (pid", peer_id)
        key_copy = tmp_path / "copy.key"
        shutil.copy(keys / "node.key", key_copy)
        copy_flags = ["join", "--config", cfg, "--key-file", str(key_copy)]
        refused(
            copy_flags,
            home,
            "another crucible-node with peer id",
            peer_id,
            health,
            "--key-file",
            within_s=TWIN_WITHIN_S,
        )
        assert first.alive
        refused([*copy_flags, "--store-bucket", "no-such-bucket"], home, "--store-bucket", "no such bucket")

        first.kill()  # a crash: its advert stays in the DHT until its TTL runs out
        again = Child("node-again", ["-m", "node.cli", "join", "--config", cfg], tmp_path, env)
        children.append(again)
        assert again.wait_for(r"crucible-node ready: peer_id=(\S+)", 60).group(1) == peer_id
        assert "remains, its health endpoint" in again.log_text()
        assert again.stop() == 0
    finally:
        for c in reversed(children):
            c.stop()

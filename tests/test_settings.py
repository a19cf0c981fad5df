"""Settings declared once (protocol/process/settings.py): each node setting's flag, config key, --help line
and check come from its one declaration, the CLI and NodeConfig refuse a value for the same reason, and the
coordinator child's ServeConfig goes through `serve`'s command line and back unchanged."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from node.cli import SETTINGS, build_parser, join_settings, node_config
from node.config import NodeConfig
from protocol.net.store_config import StoreConfig
from protocol.process.cli_errors import EXAMPLE_MULTIADDR, EXAMPLE_PEER_ID, UsageError
from protocol.process.serve_config import STORE_FIELDS, ServeConfig, store_fields, store_of
from protocol.process.settings import BOOTSTRAP, Setting, settings_of, to_argv, to_env

JOIN = ["join", "--bootstrap", EXAMPLE_MULTIADDR, "--operator-key", EXAMPLE_PEER_ID]
JOIN += ["--store-endpoint", "http://127.0.0.1:9000"]


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse wraps help to $COLUMNS, splitting long words (a multiaddr): none of that here."""
    monkeypatch.setenv("COLUMNS", "1000")


def _help(command: str, parser: argparse.ArgumentParser | None = None) -> str:
    """The --help text of a subcommand of `parser` (crucible-node's by default), its lines joined."""
    ap = parser or build_parser()
    sub = next(a for a in ap._actions if a.dest == "command").choices[command]
    return " ".join(sub.format_help().split())


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: f"{s.section}.{s.key}")
def test_every_node_setting_has_its_key_flag_help_and_a_right_default(s: Setting) -> None:
    assert s.section in ("node", "store") and s.help and "default" not in s.help  # no default in prose
    help_line = " ".join(s.help_text().split())
    text = _help("join")  # a config-file-only key is listed in its epilog
    assert help_line in text and (
        s.option in text if s.option else f"[{s.section}] {s.key}: {help_line}" in text
    )
    if s.shown:
        assert f"(default {s.shown}" in help_line
    elif s.kind in (int, float, str) and s.default != "":
        assert (
            f"(default {s.default:g}"
            if isinstance(s.default, float)
            else f"(default {s.default}" in help_line
        )
    else:
        assert "(required; example: " in help_line if s.required else "default " in help_line
    if not s.required:  # a default obeys its own rule; a required setting has none to obey
        assert s.refusal(s.default) is None
    example = [s.example] if s.kind is list else s.example
    if example is not None and s.key != "data_root":  # an example folder need not exist on this host
        assert s.refusal(example) is None, example


def test_the_node_s_table_is_nodeconfig_and_storeconfig_field_for_field() -> None:
    hints = typing.get_type_hints(NodeConfig)
    kinds = {list[str]: list, str: str, int: int, float: float, bool: bool}
    node, store = settings_of(NodeConfig, "node"), settings_of(StoreConfig, "store")
    assert SETTINGS == node + store
    assert {s.key for s in node} == {f.name for f in dataclasses.fields(NodeConfig)} - {"store"}
    assert [s.key for s in store] == [f.name for f in dataclasses.fields(StoreConfig)]
    for s in node:  # a declaration's kind (its default's type) is the field's annotation
        assert kinds[hints[s.key]] is s.kind, s.key
    for s in store:
        assert typing.get_type_hints(StoreConfig)[s.key] is s.kind, s.key


def test_the_store_and_the_swarm_are_declared_once_for_the_node_and_serve() -> None:
    """serve's store_* settings are StoreConfig's (the same flags, help and checks as join's), named after
    their flags; both roles' bootstrap is BOOTSTRAP."""
    serve = {s.key: s for s in settings_of(ServeConfig)}
    store = {s.key: s for s in settings_of(StoreConfig)}
    assert STORE_FIELDS == {
        "store_endpoint": "endpoint_url",
        "store_bucket": "bucket",
        "store_access_key": "access_key",
        "store_secret_key": "secret_key",
        "store_part_mib": "part_mib",
        "store_grant_hours": "grant_hours",
    }
    for name, key in STORE_FIELDS.items():
        assert dataclasses.replace(serve[name], key=key) == store[key], name
        assert store[key].option == f"--{name.replace('_', '-')}"
    assert store["region"].option is None  # config file only: serve takes the default
    node = {s.key: s for s in settings_of(NodeConfig)}
    assert node["bootstrap"] == serve["bootstrap"] == BOOTSTRAP
    cfg = StoreConfig(endpoint_url="http://127.0.0.1:9000", bucket="b1x", access_key="k", secret_key="s")
    assert store_of(ServeConfig(bootstrap=[EXAMPLE_MULTIADDR], **store_fields(cfg))) == cfg


def test_the_bucket_rule_is_the_same_for_join_serve_and_storeconfig() -> None:
    with pytest.raises(UsageError, match=r"^--store-bucket 'No_Bucket': not a bucket name \(3-63 "):
        join_settings(build_parser().parse_args([*JOIN, "--store-bucket", "No_Bucket"]))
    with pytest.raises(UsageError, match=r"^--store-bucket 'No_Bucket': not a bucket name \(3-63 "):
        _serve_args(["--bootstrap", EXAMPLE_MULTIADDR, *JOIN[-2:], "--store-bucket", "No_Bucket"])
    with pytest.raises(ValueError, match="^bucket 'No_Bucket' not a bucket name .*example: --store-bucket"):
        StoreConfig(endpoint_url="http://127.0.0.1:9000", bucket="No_Bucket")


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--port", "70000", "is not a TCP port"),
        ("--device", "gpu", "is not one of auto, cpu, cuda, cuda:N"),
        ("--probe-peers", "99", "must be 0 to 16"),
        ("--coordinator-lease-s", "0.5", "must be 1 to 3600 seconds"),
        ("--operator-key", "12D3KooWnotapeer", "not an Ed25519 peer id"),
    ],
)
def test_the_cli_and_nodeconfig_refuse_a_value_for_the_same_reason(
    flag: str, value: str, problem: str
) -> None:
    with pytest.raises(UsageError, match=f"^{flag} '{value}': {problem.removeprefix('is ')}"):
        join_settings(build_parser().parse_args([*JOIN, flag, value]))
    key = flag.removeprefix("--").replace("-", "_")
    typed = {s.key: s for s in SETTINGS}[key].kind(value)
    with pytest.raises(ValueError, match=f"^{key} .*{problem}.*example: {flag} "):
        NodeConfig(**{key: typed})


def test_a_config_file_key_is_refused_by_its_key(tmp_path: Path) -> None:
    cfg = tmp_path / "node.toml"
    cfg.write_text("[node]\nprobe_bytes = 10\n")
    with pytest.raises(UsageError, match=r"\[node\] probe_bytes in .*: must be 1024 to 16777216 bytes"):
        join_settings(build_parser().parse_args([*JOIN, "--config", str(cfg)]))


def test_a_rule_across_settings_is_a_usage_error_before_the_daemon_starts() -> None:
    st = join_settings(build_parser().parse_args([*JOIN, "--coordinator-eligible"]))
    with pytest.raises(UsageError, match="coordinator_eligible needs coordinator_certificate"):
        node_config(st)


def _serve_args(argv: list[str]) -> ServeConfig:
    from coordinator.cli import build_parser as coordinator_parser
    from protocol.process.settings import from_args

    config: ServeConfig = from_args(ServeConfig, coordinator_parser().parse_args(["serve", *argv]))
    return config


def test_a_serve_config_goes_through_serve_s_command_line_and_back() -> None:
    cfg = ServeConfig(
        bootstrap=[EXAMPLE_MULTIADDR, EXAMPLE_MULTIADDR.replace("203.0.113.7", "203.0.113.8")],
        host="0.0.0.0",
        store_endpoint="http://127.0.0.1:9000",
        store_bucket="runs",
        store_access_key="AKIA1",
        store_secret_key="secret1",
        lease_s=5.0,
        churn_grace_s=6.5,
        key_file="/keys/node.key",
        certificate="node.cert",
        operator_key=EXAMPLE_PEER_ID,
        http_host="0.0.0.0",
        http_port=8080,
    )
    argv = to_argv(cfg)
    assert "AKIA1" not in argv and "secret1" not in argv  # `ps` shows a command line
    assert to_env(cfg) == {"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": "secret1"}
    assert _serve_args(argv) == dataclasses.replace(cfg, store_access_key="", store_secret_key="")
    minimal = ServeConfig(bootstrap=[EXAMPLE_MULTIADDR], store_endpoint="http://127.0.0.1:9000")
    assert to_argv(minimal) == ["--bootstrap", EXAMPLE_MULTIADDR, "--store-endpoint", "http://127.0.0.1:9000"]
    assert _serve_args(to_argv(minimal)) == minimal and to_env(minimal) == {}


def test_serve_help_lists_every_setting_with_its_default() -> None:
    from coordinator.cli import build_parser as coordinator_parser

    text = _help("serve", coordinator_parser())
    for s in settings_of(ServeConfig):
        assert s.option is not None and " ".join(s.help_text().split()) in text, s.key
        assert "required" in s.help_text() if s.required else "(default " in s.help_text()


def test_a_bad_serve_value_is_refused_by_its_flag_and_by_the_config() -> None:
    with pytest.raises(
        UsageError, match=r"^--lease-s '0': must be a finite number > 0 \(example: --lease-s 15\)"
    ):
        _serve_args(
            ["--bootstrap", EXAMPLE_MULTIADDR, "--store-endpoint", "http://127.0.0.1:9", "--lease-s", "0"]
        )
    with pytest.raises(ValueError, match="^store_bucket 'No_Bucket' not a bucket name"):
        ServeConfig(store_endpoint="http://127.0.0.1:9", store_bucket="No_Bucket")


def test_an_eligible_node_s_coordinator_role_is_its_own_settings(tmp_path: Path) -> None:
    """What the daemon used to spell out as flags: the node's swarm, host, store, key, certificate,
    operator and timers; its store keys by environment."""
    from node.coordinator_child import role_config

    store = StoreConfig(endpoint_url="http://127.0.0.1:9000", bucket="b1x", access_key="k", secret_key="s")
    node = NodeConfig(
        bootstrap=[EXAMPLE_MULTIADDR],
        host="0.0.0.0",
        key_file="~/keys/n.key",
        operator_key=EXAMPLE_PEER_ID,
        store=store,
        coordinator_eligible=True,
        coordinator_certificate="n.cert",
        coordinator_lease_s=5.0,
        coordinator_churn_grace_s=6.0,
    )
    role = role_config(node, node.bootstrap)
    assert _serve_args(to_argv(role)) == dataclasses.replace(role, store_access_key="", store_secret_key="")
    assert (role.key_file, role.certificate, role.operator_key) == (
        str(Path("~/keys/n.key").expanduser()),
        "n.cert",
        EXAMPLE_PEER_ID,
    )
    assert (role.store_endpoint, role.store_bucket, role.lease_s, role.churn_grace_s) == (
        "http://127.0.0.1:9000",
        "b1x",
        5.0,
        6.0,
    )
    assert to_env(role) == {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}

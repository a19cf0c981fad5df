"""Settings declared once: a config dataclass's field says, in one place, a setting's type (its default's),
default, help, example and check; its command-line flag, config-file key, `--help` line and error messages
are derived from that.

    port: int = setting(0, "pipeline TCP port", example=31400, shown="0: any free port", check=tcp_port)

      --port PORT   pipeline TCP port (default 0: any free port; example: 31400)
      [node] port = 31400
      --port '70000': is not a TCP port: 1-65535, or 0 for any free port (example: --port 31400)

A check returns what is wrong with a value, phrased to follow it ("must be 1 to 3600 seconds"), or None.
It runs on what a user typed, in the CLI (before torch or hivemind is imported; the message names the flag
or the key in its file), and again in the dataclass's `__post_init__` (`check_fields`, naming the field), so
a config built in code obeys the rules that one typed by a user does.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from protocol.process.cli_errors import (
    EXAMPLE_MULTIADDR,
    UsageError,
    bad_input,
    check_keys,
    check_multiaddr,
    check_peer_id,
    check_url,
    load_toml,
)
from protocol.schema import describe

Check = Callable[[Any], str | None]
"""What is wrong with a value ("is not a folder"), or None."""
_DECLARATION = "setting"
_KIND_WORDS = {
    str: "a string",
    int: "a whole number",
    float: "a number",
    bool: "true or false",
    list: "a list",
}


def _shown(value: Any) -> str:
    """A value as --help and error examples show it: 15 for 15.0, true for True."""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ", ".join(map(_shown, value)) or "none"
    return str(value) if value not in ("", None) else "none"


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting. Declared on a config dataclass's field with `setting(...)` (its key is the field's name);
    one that two configs hold is declared once and given to each with `setting_field` (BOOTSTRAP, below)."""

    key: str
    default: Any
    """Its type is the setting's: str, int, float, bool, or a list (of str)."""
    help: str
    """What it is, without its default or an example: --help adds both from the fields below."""
    example: Any = None
    """A right value (one item, for a list), shown in --help and in the error for a wrong one."""
    flag: str | None = ""
    """The command-line flag; "" derives it from the key (lease_s: --lease-s); None: config file only."""
    metavar: str | None = None
    """What --help shows for the flag's value (default: the key in capitals)."""
    shown: str | None = None
    """How --help shows the default where the value alone says too little ("0: any free port")."""
    check: Check | None = None
    """For a list, each item's."""
    required: bool = False
    """The command needs a value: --help says so, and argparse asks for the flag where only flags give it."""
    env: str | None = None
    """A secret: never put on a command line (`ps` shows those); `to_env` hands it to a child process in
    this environment variable instead."""
    section: str = ""
    """The config file's section ("node"); "" for a command configured by flags only."""

    @property
    def kind(self) -> type:
        return list if isinstance(self.default, list) else type(self.default)

    @property
    def option(self) -> str | None:
        """The flag, derived unless declared; None for a config-file-only setting."""
        return f"--{self.key.replace('_', '-')}" if self.flag == "" else self.flag

    @property
    def dest(self) -> str:
        """The argparse destination: node.port, or port for a flags-only command."""
        return f"{self.section}.{self.key}" if self.section else self.key

    def help_text(self) -> str:
        """The --help line: what it is, then its default (or that it is required) and an example."""
        if self.kind is bool:
            given = self.option is None or not self.option.startswith("--no-")
            tail = f"in the file: {self.key} = {_shown(given)}; default {_shown(self.default)}"
        elif self.required:
            tail = f"required; example: {_shown(self.example)}"
        else:
            tail = f"default {self.shown or _shown(self.default)}"
            if self.example is not None and self.example != self.default:
                tail += f"; example: {_shown(self.example)}"
        return f"{self.help} ({tail})"

    def example_for(self, label: str) -> str:
        """A right value as the user would give it where `label` (a flag, or a key in a file) says."""
        example = self.default if self.example is None else self.example
        if not label.startswith("--"):
            return f"{self.key} = {json.dumps([example] if self.kind is list else example)}"
        return label if self.kind is bool else f"{label} {_shown(example)}"

    def refusal(self, value: Any) -> tuple[Any, str] | None:
        """(the bad value or item, what is wrong with it) when the check refuses `value`, else None."""
        if self.check is not None:
            for v in value if self.kind is list else [value]:
                if (problem := self.check(v)) is not None:
                    return v, problem
        return None


def setting(default: Any, help: str, **declared: Any) -> Any:
    """A dataclass field declaring a setting (its key is the field's name); `declared`: Setting's fields."""
    return setting_field(Setting(key="", default=default, help=help, **declared))


def setting_field(s: Setting) -> Any:
    """A dataclass field declaring `s`, under the field's name: how two configs hold one setting declared
    once (a `Setting`, or one of another config's: `serve`'s store_bucket is StoreConfig's bucket)."""
    meta = {_DECLARATION: s}
    if isinstance(s.default, list):
        return dataclasses.field(default_factory=lambda: list(s.default), metadata=meta)
    return dataclasses.field(default=s.default, metadata=meta)


def settings_of(cls: Any, section: str = "") -> tuple[Setting, ...]:
    """The settings a config dataclass declares, in field order."""
    return tuple(
        dataclasses.replace(f.metadata[_DECLARATION], key=f.name, section=section)
        for f in dataclasses.fields(cls)
        if _DECLARATION in f.metadata
    )


def check_fields(config: Any) -> None:
    """For a config's __post_init__: a ValueError naming the field, the value and the rule it breaks."""
    for s in settings_of(type(config)):
        if (bad := s.refusal(getattr(config, s.key))) is not None:
            value, problem = bad
            example = s.example_for(s.option or s.key)
            raise ValueError(f"{s.key} {describe(value)} {problem} (example: {example})")


def to_argv(config: Any) -> list[str]:
    """The command line that gives `config` to the command its settings are the flags of: each value that
    is not the default, secrets left out (`to_env`)."""
    argv: list[str] = []
    for s in settings_of(type(config)):
        value = getattr(config, s.key)
        if s.option is None or s.env is not None or value == s.default:
            continue
        if s.kind is list:
            argv += [a for item in value for a in (s.option, str(item))]
        elif s.kind is bool:  # a flag that sets the other value than the default
            argv.append(s.option)
        else:
            argv += [s.option, str(value)]
    return argv


def to_env(config: Any) -> dict[str, str]:
    """The secrets of `config` as the environment variables a child process reads them from."""
    return {
        s.env: getattr(config, s.key) for s in settings_of(type(config)) if s.env and getattr(config, s.key)
    }


def add_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting], *, defaults: bool = True) -> None:
    """A flag for each setting that has one, with its derived help. defaults=False: a flag not given is
    None, so `SettingValues.read_flags` layers only the given ones over a config file."""
    for s in settings:
        if s.option is None:
            continue
        kw: dict[str, Any] = {"dest": s.dest, "help": s.help_text().replace("%", "%%")}
        if s.kind is bool:
            kw.update(action="store_const", const=not s.option.startswith("--no-"))
        else:
            kw.update(metavar=s.metavar or s.key.upper(), action="append" if s.kind is list else "store")
        if defaults:
            kw.update(required=s.required)
            if s.kind is not list:  # argparse would append to a default list
                kw.update(default=s.default)
        parser.add_argument(s.option, **kw)


@dataclasses.dataclass
class SettingValues:
    """Settings as a user gave them (a config file, then flags over it): each value typed, as written
    (for the error messages) and with the label of where it came from (--port, [node] port in FILE)."""

    declared: Mapping[tuple[str, str], Setting]
    values: dict[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    given: dict[tuple[str, str], Any] = dataclasses.field(default_factory=dict)
    labels: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, settings: Iterable[Setting]) -> SettingValues:
        return cls({(s.section, s.key): s for s in settings})

    def get(self, section: str, key: str) -> Any:
        """The value given, else the declared default."""
        return self.values.get((section, key), self.declared[(section, key)].default)

    def section(self, name: str) -> dict[str, Any]:
        """The values given in a section, by key."""
        return {key: v for (section, key), v in self.values.items() if section == name}

    def label(self, section: str, key: str) -> str:
        """The flag, or the config key with its file, the value came from; the flag when not given."""
        s = self.declared[(section, key)]
        return self.labels.get((section, key)) or s.option or f"[{section}] {key}"

    def example(self, section: str, key: str) -> str:
        return self.declared[(section, key)].example_for(self.label(section, key))

    def refuse(self, section: str, key: str, value: Any, problem: str) -> UsageError:
        # a check's problem reads after the field's name ("port 70000 is not a TCP port"); after a flag and
        # its quoted value the CLI's messages drop the verb: "--port '70000': not a TCP port"
        said = problem.removeprefix("is ")
        return bad_input(self.label(section, key), value, said, self.example(section, key))

    def read_file(self, path: str, example_file: str) -> None:
        """The sections of a TOML file, each key checked against the declared ones; `example_file` is
        named in the error for an unknown section."""
        raw = load_toml("--config", path)
        sections = list(dict.fromkeys(section for section, _ in self.declared))
        valid = ", ".join(f"[{name}]" for name in sections)
        for name, table in raw.items():  # a misspelt section would drop what it holds (an operator key)
            if name not in sections or not isinstance(table, dict):
                what = (
                    f"unknown section [{name}]"
                    if isinstance(table, dict)
                    else f"key {name!r} outside a section"
                )
                raise UsageError(f"--config {path}: {what}; valid sections: {valid} ({example_file})")
        for section in sections:
            table = raw.get(section, {})
            check_keys(f"--config {path} [{section}]", table, [k for s, k in self.declared if s == section])
            for key, value in table.items():
                self.labels[(section, key)] = f"[{section}] {key} in {path}"
                self.given[(section, key)] = value
                self.values[(section, key)] = self._typed(self.declared[(section, key)], value)

    def _typed(self, s: Setting, value: Any) -> Any:
        """A config file value of the setting's kind (TOML values come typed: an int for a float is fine)."""
        ok = {
            str: isinstance(value, str),
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, int | float) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            list: isinstance(value, str)
            or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
        }[s.kind]
        if not ok:
            what = "a list of strings" if s.kind is list else _KIND_WORDS[s.kind]
            raise self.refuse(s.section, s.key, value, f"must be {what}")
        if s.kind is list and isinstance(value, str):
            return [value]
        return float(value) if s.kind is float else value

    def read_flags(self, args: argparse.Namespace) -> None:
        """The flags given (not None), over what the file gave; a number is parsed here, named if it is none."""
        for (section, key), s in self.declared.items():
            value = getattr(args, s.dest, None) if s.option else None
            if value is None:
                continue
            self.labels[(section, key)] = s.option or ""
            self.given[(section, key)] = value
            if s.kind in (int, float) and isinstance(value, str):
                try:
                    value = int(value) if s.kind is int else float(value)
                except ValueError:
                    raise self.refuse(section, key, value, f"not {_KIND_WORDS[s.kind]}") from None
            self.values[(section, key)] = value

    def check(self) -> None:
        """Each value given within its declared rules; the first one outside them is refused by its label."""
        for (section, key), v in self.values.items():
            if (bad := self.declared[(section, key)].refusal(v)) is not None:
                item, problem = bad
                shown = item if isinstance(v, list) else self.given.get((section, key), v)
                raise self.refuse(section, key, shown, problem)


def from_args(cls: Any, args: argparse.Namespace) -> Any:
    """The config `cls` of a command configured by flags only, each flag typed and checked (a UsageError
    names a wrong one); `cls(...)` then checks what spans several settings (a ValueError)."""
    given = SettingValues.of(settings_of(cls))
    given.read_flags(args)
    given.check()
    return cls(**given.section(""))


# --- checks ----------------------------------------------------------------------------------------
def in_range(lo: float, hi: float, unit: str = "", problem: str | None = None) -> Check:
    """lo <= value <= hi, and finite: "must be 3 to 3600 seconds" otherwise (or `problem`)."""
    says = problem or f"must be {_shown(lo)} to {_shown(hi)}" + (f" {unit}" if unit else "")
    # an int is finite however large (math.isfinite would overflow converting a huge one)
    return lambda v: None if (isinstance(v, int) or math.isfinite(v)) and lo <= v <= hi else says


tcp_port = in_range(0, 65535, problem="is not a TCP port: 1-65535, or 0 for any free port")


def positive(value: float) -> str | None:
    """A finite number > 0 (protocol/process/cli_errors.py's `check_positive`, as a check)."""
    if math.isfinite(value) and value > 0:
        return None
    return "must be a whole number >= 1" if isinstance(value, int) else "must be a finite number > 0"


def one_of(*choices: str, normal: Callable[[str], str] = str) -> Check:
    """normal(value) is one of `choices` (normal: how the value is read, e.g. str.upper)."""
    return lambda v: None if normal(v) in choices else f"is not one of {', '.join(choices)}"


def matching(pattern: str, problem: str) -> Check:
    """The whole value matches the regular expression."""
    compiled = re.compile(pattern)
    return lambda v: None if compiled.fullmatch(v) else problem


def not_empty(value: str) -> str | None:
    return None if value.strip() else "must not be empty"


def a_folder(value: str) -> str | None:
    return None if Path(value).expanduser().is_dir() else "is not a folder"


def ipv4(value: str) -> str | None:
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return "not an IPv4 address"
    return None


def optional(check: Check) -> Check:
    """`check`, where an empty value (not given) passes."""
    return lambda v: None if v in ("", None) else check(v)


def _problem_of(checker: Callable[[str, Any, str], object]) -> Check:
    """One of protocol/process/cli_errors.py's checkers (flag, value, example) as a check: the problem it
    names, without a flag and an example (bad_input writes them as `{flag} {value!r}: {problem}{hint}`)."""

    def check(value: Any) -> str | None:
        try:
            checker("", value, "")
        except UsageError as e:
            return str(e).removeprefix(f" {value!r}: ")
        return None

    return check


url = _problem_of(check_url)
"""An http(s) endpoint URL with a host."""
multiaddr = _problem_of(check_multiaddr)
"""A peer's multiaddr with a TCP port and a peer id."""
peer_id = _problem_of(check_peer_id)
"""An Ed25519 libp2p peer id (12D3KooW...)."""


# --- settings both roles declare -------------------------------------------------------------------
BOOTSTRAP = Setting(
    key="bootstrap",
    default=[],
    help="multiaddr of a swarm peer, repeatable",
    example=EXAMPLE_MULTIADDR,
    metavar="MULTIADDR",
    required=True,
    check=multiaddr,
)
"""The DHT peers a node (NodeConfig) or a coordinator (protocol/process/serve_config.py) joins through."""

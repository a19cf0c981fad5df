"""One way for every Crucible CLI to report a user's mistake: one line, exit code 2, no traceback.

A mistake (a bad flag, config key, path, port) raises `UsageError` with a message that names the flag
or key, the value, what is wrong and an example of a right one. `run_cli` turns it into one line on
stderr and exit 2; any other exception becomes one line and exit 1, with the traceback only under
`--debug`. Checks here are cheap (no torch, no hivemind), so a CLI can run them before heavy imports.
"""

from __future__ import annotations

import errno
import socket
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

USAGE_EXIT = 2


class UsageError(Exception):
    """The user's input is wrong; the message says which input, what is wrong and how to fix it."""


def bad_input(name: str, value: object, problem: str, example: str | None = None) -> UsageError:
    """`--port 80: in use by another process (example: --port 7000)`."""
    hint = f" (example: {example})" if example else ""
    return UsageError(f"{name} {value!r}: {problem}{hint}")


def run_cli(prog: str, main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call main(argv); user mistakes exit 2 with one line, other failures exit 1 with one line
    (the traceback only with --debug), Ctrl-C exits 130."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        return main(argv)
    except UsageError as e:
        if debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        print(
            f"{prog}: error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
            file=sys.stderr,
            flush=True,
        )
        return 1


def check_url(flag: str, value: str, example: str = "http://127.0.0.1:9000") -> str:
    """An http(s) endpoint URL with a host."""
    u = urlparse(value)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise bad_input(flag, value, "not an http(s) URL with a host", example)
    try:
        u.port  # noqa: B018  (raises ValueError for a port out of range)
    except ValueError as e:
        raise bad_input(flag, value, str(e), example) from e
    return value


def check_port_free(flag: str, host: str, port: int | None) -> None:
    """Refuse a port another process holds (0 / None: the OS picks one, always free)."""
    if not port:
        return
    if not 0 < port < 65536:
        raise bad_input(flag, port, "not a TCP port (1-65535)", f"{flag} 7000")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise bad_input(
                    flag,
                    port,
                    f"already in use on {host} by another process; pick a free one or omit it",
                    None,
                ) from e
            if e.errno == errno.EACCES:
                raise bad_input(
                    flag, port, "needs root (ports below 1024); use a higher one", f"{flag} 7000"
                ) from e
            raise bad_input(flag, port, f"cannot listen on {host}: {e.strerror}", f"{flag} 7000") from e


def check_file(flag: str, value: str | Path, what: str = "file") -> Path:
    """An existing, readable file."""
    p = Path(value).expanduser()
    if not p.exists():
        raise bad_input(flag, str(value), f"no such {what}")
    if not p.is_file():
        raise bad_input(flag, str(value), f"not a {what} (a folder or device)")
    try:
        with p.open("rb"):
            pass
    except OSError as e:
        raise bad_input(flag, str(value), f"cannot be read: {e.strerror}") from e
    return p


def load_toml(flag: str, path: str | Path) -> dict[str, Any]:
    """A TOML file, or a UsageError naming the file and the line of the syntax error."""
    p = check_file(flag, path, "config file")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise bad_input(flag, str(path), f"is not valid TOML: {e}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise bad_input(flag, str(path), f"cannot be read: {e}") from e


def check_keys(where: str, data: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """Reject keys (or sections) a config file may not hold, listing the valid ones: a misspelt
    section would otherwise be ignored silently, and what it holds (an operator key) dropped."""
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise UsageError(
            f"{where}: unknown {'key' if len(unknown) == 1 else 'keys'} {', '.join(map(repr, unknown))}; "
            f"valid: {', '.join(sorted(allowed))}"
        )

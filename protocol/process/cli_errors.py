"""One way for every Crucible CLI to report a user's mistake: one line, exit code 2, no traceback.

A mistake (a bad flag, config key, path, port) raises `UsageError` with a message that names the flag
or key, the value, what is wrong and an example of a right one. `run_cli` turns it into one line on
stderr and exit 2; any other exception becomes one line and exit 1, with the traceback only under
`--debug`. Checks here are cheap (no torch, no hivemind), so a CLI can run them before heavy imports.
"""

from __future__ import annotations

import argparse
import errno
import math
import socket
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlparse

USAGE_EXIT = 2


class UsageError(Exception):
    """The user's input is wrong; the message says which input, what is wrong and how to fix it."""


def bad_input(name: str, value: object, problem: str, example: str | None = None) -> UsageError:
    """`--port 80: in use by another process (example: --port 7000)`."""
    hint = f" (example: {example})" if example else ""
    return UsageError(f"{name} {value!r}: {problem}{hint}")


def one_line(text: str) -> str:
    """`text` with its lines joined by "; " (an error from a library may span several)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


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
        print(f"{prog}: error: {one_line(str(e))}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if debug:
            raise
        print(
            f"{prog}: error: {type(e).__name__}: {one_line(str(e))} (rerun with --debug for the traceback)",
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


EXAMPLE_PEER_ID = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
EXAMPLE_MULTIADDR = f"/ip4/203.0.113.7/tcp/31337/p2p/{EXAMPLE_PEER_ID}"
"""The same example as `protocol.net.dht_client.EXAMPLE_MULTIADDR`, importable without hivemind."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose own mistakes (a missing flag, a bad choice, a value of the wrong type) raise
    UsageError, so `run_cli` prints one line instead of the usage block; subparsers inherit the class.
    Abbreviated flags are off by default: `--operator-key` must not silently mean `--operator-key-file`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def check_multiaddr(flag: str, value: str, example: str = EXAMPLE_MULTIADDR) -> str:
    """A peer's multiaddr with a TCP port and a peer id, as `--bootstrap` takes; the checks of
    `protocol.net.dht_client.validate_multiaddr`, without importing hivemind."""
    from multiaddr import Multiaddr  # light; hivemind (seconds to import) is not needed to parse

    try:
        m = Multiaddr(value)
    except Exception as e:  # the library raises its own parse errors, with the value repeated
        reason = str(e).split(f"{value!r}: ", 1)[-1].split(" (string: ", 1)[0]
        raise bad_input(flag, value, f"not a valid multiaddr: {reason}", example) from e
    protocols = [p.name for p in m.protocols()]
    if "tcp" not in protocols or "p2p" not in protocols:
        raise bad_input(flag, value, "must name a TCP port and the peer id (/tcp/PORT/p2p/PEER_ID)", example)
    return str(m)


def check_peer_id(flag: str, value: str, example: str = EXAMPLE_PEER_ID) -> bytes:
    """An Ed25519 libp2p peer id ("12D3KooW..."); returns its public key."""
    from protocol.identity import SignatureError, public_key_of_peer_id

    try:
        return public_key_of_peer_id(value)
    except SignatureError as e:
        raise bad_input(flag, value, "not an Ed25519 peer id (12D3KooW..., 52 characters)", example) from e


def check_positive(flag: str, value: float | None, example: str, *, allow_zero: bool = False) -> None:
    """A finite number > 0 (>= 0 with allow_zero); None (the flag was not given) passes."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        if isinstance(value, int):
            rule = "a whole number >= 0" if allow_zero else "a whole number >= 1"
        else:
            rule = "a finite number >= 0" if allow_zero else "a finite number > 0"
        raise bad_input(flag, value, f"must be {rule}", example)


def check_reachable(
    flag: str, value: object, host: str, port: int, timeout_s: float, what: str, context: str = ""
) -> None:
    """Refuse unless a TCP connection to host:port opens within timeout_s. `what` names who should
    answer ("the object store"); `context` starts the problem ("could not join the swarm: ")."""
    advice = f"check that {what} is running and reachable from this host (address, port, firewall)"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except TimeoutError as e:
        problem = f"{context}{host}:{port} did not answer within {timeout_s:g} s; {advice}"
        raise bad_input(flag, value, problem) from e
    except OSError as e:
        problem = f"{context}cannot connect to {host}:{port} ({e.strerror or e}); {advice}"
        raise bad_input(flag, value, problem) from e

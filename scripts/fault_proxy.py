"""A fault-injecting HTTP proxy in front of the real S3 server (moto), for store fault tests.

Each client request is read up to its head; `rule(method, path)` then picks what happens to it:
"pass" (or False) forwards it to the upstream server with `Connection: close` and relays the answer byte
for byte; "503" (or True) answers an S3 `503 SlowDown`; "stall" holds the connection unanswered for
`stall_s`, then closes it; "delay" holds it for `delay_s`, then forwards it as "pass" does; "truncate" forwards it but cuts the answer off after half its bytes. Real
sockets on loopback; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

SLOW_DOWN = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>Reduce your request rate</Message></Error>"


class FaultProxy:
    """`http://127.0.0.1:{port}` forwards to `upstream`, failing the requests `rule` picks."""

    def __init__(self, upstream_url: str) -> None:
        host, port = upstream_url.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.rule: Callable[[str, str], bool | str] = lambda method, path: False
        self.stall_s = 5.0
        self.delay_s = 5.0
        self.failed: list[tuple[str, str]] = []
        """(method, path) of every request the proxy did not pass through intact."""
        self.actions: dict[str, int] = {}
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._srv.getsockname()[1]}"
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._srv.close()

    def _accept(self) -> None:
        accept_loop(
            self._srv,
            self._closed,
            lambda c: threading.Thread(target=self._serve, args=(c,), daemon=True).start(),
        )

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        with contextlib.closing(conn):
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            head, _, rest = head.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path = lines[0].decode().split(" ")[:2]
            action = self.rule(method, path)
            action = "503" if action is True else "pass" if action is False else action
            if action != "pass":
                self.failed.append((method, path))
                self.actions[action] = self.actions.get(action, 0) + 1
            if action == "stall":
                self._closed.wait(self.stall_s)
                return
            if action == "delay":  # a slow link: the request reaches the store delay_s late, whole
                self._closed.wait(self.delay_s)
            if action == "503":
                conn.sendall(
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                    + f"Content-Length: {len(SLOW_DOWN)}\r\nConnection: close\r\n\r\n".encode()
                    + SLOW_DOWN
                )
                return
            kept = [ln for ln in lines[1:] if not ln.lower().startswith(b"connection:")]
            request = b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n" + rest
            with socket.create_connection(self.upstream, timeout=10) as up:
                up.sendall(request)
                pump = threading.Thread(target=_copy, args=(conn, up), daemon=True)
                pump.start()  # the rest of the request body, if any
                if action == "truncate":
                    answer = _read_all(up)
                    conn.sendall(answer[: len(answer) // 2])
                else:
                    _copy(up, conn)


def accept_loop(
    srv: socket.socket, closed: threading.Event, on_connection: Callable[[socket.socket], None]
) -> None:
    """Hand each connection `srv` accepts to `on_connection` until `closed` is set or `srv` is closed
    (`srv` has a short timeout, so that `closed` is looked at)."""
    while not closed.is_set():
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        on_connection(conn)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)


def _read_all(src: socket.socket) -> bytes:
    parts = []
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            parts.append(data)
    return b"".join(parts)

"""A TCP relay in front of one node's pipeline port, to slow or cut its links while the swarm runs.

The node listens on its --port and announces the relay's port (--announce-port), so every pipeline
connection its neighbours open to it (frames, hellos, bandwidth probes) passes through here. `slow(mbps)`
paces both directions at that rate from now on, `cut()` closes every live connection and refuses new ones,
`restore()` passes bytes untouched again. Real sockets on loopback; nothing is mocked.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from scripts.fault_proxy import accept_loop


class LinkProxy:
    """`127.0.0.1:{port}` relays to `127.0.0.1:{upstream_port}` (set `upstream_port` before a node
    restarts on a new port)."""

    def __init__(self, upstream_port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.mbps = 0.0
        self.cut_connections = 0
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.2)
        self.port = self._srv.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def slow(self, mbps: float) -> None:
        self.mbps, self.mode = mbps, "slow"

    def cut(self) -> None:
        self.mode = "cut"
        with self._lock:
            live, self._live = list(self._live), set()
        self.cut_connections += len(live) // 2
        for s in live:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def restore(self) -> None:
        self.mode = "pass"

    def close(self) -> None:
        self._closed.set()
        self._srv.close()
        self.cut()

    def _accept(self) -> None:
        accept_loop(self._srv, self._closed, self._open)

    def _open(self, conn: socket.socket) -> None:
        if self.mode == "cut":  # the link is down: the connection opens and dies at once
            conn.close()
            return
        try:
            up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
        except OSError:
            conn.close()
            return
        up.settimeout(None)
        with self._lock:
            self._live |= {conn, up}
        for src, dst in ((conn, up), (up, conn)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.mode == "slow" and self.mbps > 0:  # this chunk's time on a link of that rate
                    time.sleep(len(data) * 8 / (self.mbps * 1e6))
                dst.sendall(data)
        for s in (src, dst):  # one side closed: close the other, as a TCP link does
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._live -= {src, dst}

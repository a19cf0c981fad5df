"""Accepts pipeline connections from upstream neighbours and holds them until the stage worker asks.

The first frame on a connection is a signed `Hello`; connections whose hello is malformed or badly signed
are closed at once (and logged), so a stray or hostile client cannot block the node.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from protocol.envelope import Signed, open_envelope
from protocol.framing import recv_frame
from protocol.messages import Hello
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)
HELLO_MAX_BYTES = 64 * 1024


class Acceptor:
    """Background accept loop on the node's pipeline port."""

    def __init__(
        self, server: socket.socket, *, hello_timeout_s: float = 10.0, keep_s: float = 120.0
    ) -> None:
        self.server = server
        self.hello_timeout_s, self.keep_s = hello_timeout_s, keep_s
        self._held: list[tuple[float, Signed[Hello], socket.socket]] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.rejected = 0
        self._thread = threading.Thread(target=self._loop, name="acceptor", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.getsockname()[1])

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, addr = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn, addr), daemon=True).start()

    def _handshake(self, conn: socket.socket, addr: tuple) -> None:
        try:
            conn.settimeout(self.hello_timeout_s)
            hello = open_envelope(recv_frame(conn, HELLO_MAX_BYTES), Hello)
            if hello.signer_id != hello.body.peer_id:
                raise ProtocolError(
                    f"hello names peer {hello.body.peer_id} but is signed by {hello.signer_id}"
                )
        except (ProtocolError, OSError, ConnectionError) as e:
            self.rejected += 1
            log.warning("rejected pipeline connection from %s: %s", addr, e)
            conn.close()
            return
        with self._cond:
            self._held.append((time.monotonic(), hello, conn))
            self._cond.notify_all()

    def take(
        self,
        run_id: str,
        peer_id: str,
        replica: int,
        stage: int,
        timeout_s: float,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> tuple[Hello, socket.socket]:
        """Wait for the connection from `peer_id` serving (run_id, replica, stage); raise TimeoutError."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                for item in list(self._held):
                    t, hello, conn = item
                    h = hello.body
                    if now - t > self.keep_s:
                        self._held.remove(item)
                        conn.close()
                    elif (h.run_id, h.peer_id, h.replica, h.stage) == (run_id, peer_id, replica, stage):
                        self._held.remove(item)
                        return h, conn
                if now >= deadline or self._stop.is_set() or cancelled():
                    raise TimeoutError(
                        f"upstream neighbour {peer_id} (replica {replica}, stage {stage}) did not connect "
                        f"within {timeout_s:.0f} s"
                    )
                self._cond.wait(min(1.0, deadline - now))

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.server.close()
        with self._cond:
            for _, _, conn in self._held:
                conn.close()
            self._held.clear()
            self._cond.notify_all()

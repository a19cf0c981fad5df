"""Direct TCP links between pipeline neighbours.

A `Link` is one full-duplex framed connection: a sender thread drains a bounded queue (backpressure: the
stage blocks when `queue_depth` frames are in flight) and a receiver thread fills an inbox, so compute
overlaps with bytes on the wire. An optional in-process shaper emulates a WAN link per direction: the
sender paces frames to `bandwidth_mbps` (serialization delay) and the receiver releases each frame
`delay_ms` after it arrived (propagation delay) — this kernel has no netem, and tests run without root.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.framing import DEFAULT_MAX_FRAME_BYTES, ConnectionClosed, FrameError, recv_frame, send_frame

log = logging.getLogger(__name__)


class LinkError(ConnectionError):
    """The link to a pipeline neighbour broke or timed out; the message names the neighbour."""


@dataclass(kw_only=True, frozen=True)
class Shaper:
    """Per-direction WAN emulation: token-bucket bandwidth and fixed one-way delay."""

    bandwidth_mbps: float = 0.0
    """Bits per second / 1e6 on this direction; 0 = unshaped."""
    delay_ms: float = 0.0
    """One-way propagation delay added to every frame."""

    def transmit_s(self, nbytes: int) -> float:
        return 0.0 if self.bandwidth_mbps <= 0 else nbytes * 8 / (self.bandwidth_mbps * 1e6)


_CLOSE = object()


class Link:
    """A framed, shaped, full-duplex connection to one neighbour."""

    def __init__(
        self,
        sock: socket.socket,
        name: str,
        *,
        shaper: Shaper | None = None,
        queue_depth: int = 8,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock, self.name = sock, name
        self.shaper = shaper or Shaper()
        self.max_frame_bytes = max_frame_bytes
        self.bytes_sent = 0
        self.bytes_recv = 0
        self._outbox: queue.Queue[object] = queue.Queue(maxsize=queue_depth)
        self._inbox: queue.Queue[tuple[float, bytes] | BaseException] = queue.Queue()
        self._head: tuple[float, bytes] | BaseException | None = None  # taken from the inbox, not yet due
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name=f"send-{name}", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name=f"recv-{name}", daemon=True)
        self._sender.start()
        self._receiver.start()

    # --- public ---------------------------------------------------------------------------------
    def send(self, payload: bytes | Callable[[], bytes], timeout_s: float | None = None) -> None:
        """Queue a frame; blocks while the queue is full (backpressure).

        payload may be a callable that returns the frame: the sender thread calls it, so a frame whose
        bytes are still being copied off a GPU (protocol.subspace `encode_async`) does not block compute."""
        if isinstance(payload, bytes) and len(payload) > self.max_frame_bytes:
            raise FrameError(f"frame of {len(payload)} bytes exceeds the {self.max_frame_bytes}-byte limit")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            # a dead sender thread never drains the queue: re-check the link while waiting for room
            self._raise_if_broken()
            try:
                self._outbox.put(payload, timeout=0.25)
                return
            except queue.Full:
                if deadline is not None and time.monotonic() > deadline:
                    raise LinkError(
                        f"link to {self.name}: send queue stayed full for {timeout_s} s"
                    ) from None

    def recv(self, timeout_s: float | None = None) -> bytes:
        """Next frame from the neighbour; raises LinkError on close, timeout or a malformed/oversized frame
        from the peer (its __cause__ is then the FrameError, and the link is dropped)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        item = self._head
        self._head = None
        if item is None:
            try:
                item = self._inbox.get(timeout=timeout_s)
            except queue.Empty as e:
                raise LinkError(f"link to {self.name}: nothing received for {timeout_s} s") from e
        if isinstance(item, BaseException):
            self._inbox.put(item)  # keep the error visible to later calls
            raise LinkError(f"link to {self.name} broke: {item}") from item
        ready_at, payload = item
        wait = ready_at - time.monotonic()
        if wait > 0:
            if deadline is not None and ready_at > deadline:
                self._head = item  # still in flight (shaper delay): deliver it on the next call
                time.sleep(max(0.0, deadline - time.monotonic()))
                raise LinkError(f"link to {self.name}: nothing received for {timeout_s} s")
            time.sleep(wait)
        return payload

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued frame has been written to the socket."""
        deadline = time.monotonic() + timeout_s
        while self._outbox.unfinished_tasks and time.monotonic() < deadline:
            self._raise_if_broken()
            time.sleep(0.002)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(queue.Full):
            self._outbox.put_nowait(_CLOSE)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # --- threads --------------------------------------------------------------------------------
    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise LinkError(f"link to {self.name} broke: {self._error}") from self._error
        if self._closed.is_set():
            raise LinkError(f"link to {self.name} is closed")

    def _send_loop(self) -> None:
        free_at = time.monotonic()  # when the emulated wire is free again
        while True:
            item = self._outbox.get()
            try:
                if item is _CLOSE:
                    return
                if callable(item):
                    item = item()
                assert isinstance(item, bytes)
                tx = self.shaper.transmit_s(len(item) + 4)
                if tx > 0:
                    free_at = max(free_at, time.monotonic()) + tx
                    time.sleep(max(0.0, free_at - time.monotonic()))
                self.bytes_sent += send_frame(self.sock, item, self.max_frame_bytes)
            except (OSError, FrameError, ValueError) as e:  # ValueError: a deferred frame refused to encode
                if not self._closed.is_set():
                    self._error = e
                    log.warning("link to %s: send failed: %s", self.name, e)
                return
            finally:
                self._outbox.task_done()

    def _recv_loop(self) -> None:
        delay = self.shaper.delay_ms / 1e3
        while True:
            try:
                payload = recv_frame(self.sock, self.max_frame_bytes)
            except (OSError, FrameError, ConnectionClosed) as e:
                if not self._closed.is_set():
                    self._error = e
                    if isinstance(e, FrameError):
                        # The byte stream is out of step (bad length prefix or truncated frame): drop the
                        # connection, so the peer's link breaks too instead of waiting on a dead stream.
                        log.warning("link to %s: malformed frame, closing: %s", self.name, e)
                        with contextlib.suppress(OSError):
                            self.sock.shutdown(socket.SHUT_RDWR)
                self._inbox.put(e if not self._closed.is_set() else ConnectionClosed("link closed"))
                return
            self.bytes_recv += len(payload) + 4
            self._inbox.put((time.monotonic() + delay, payload))


def connect(
    host: str,
    port: int,
    *,
    timeout_s: float,
    retry_s: float = 0.25,
    cancelled: Callable[[], bool] = lambda: False,
) -> socket.socket:
    """Connect with retries until timeout_s (the neighbour may still be starting) or until cancelled()."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if cancelled():
            raise LinkError(f"connecting to {host}:{port} was cancelled")
        try:
            return socket.create_connection((host, port), timeout=min(5.0, timeout_s))
        except OSError as e:
            last = e
            time.sleep(retry_s)
    raise LinkError(f"could not connect to {host}:{port} within {timeout_s:.0f} s: {last}")


def listen(host: str, port: int) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(64)
    return srv

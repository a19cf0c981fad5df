"""Direct TCP links between pipeline neighbours.

A `Link` is one full-duplex framed connection: a sender thread drains a bounded queue (backpressure: the
stage blocks when `queue_depth` frames are in flight) and a receiver thread fills an inbox, so compute
overlaps with bytes on the wire. The inbox is bounded too (`inbox_frames` frames and `inbox_bytes` bytes,
one frame always admitted): when it is full the receiver stops reading, TCP's window closes, and a peer
that sends faster than this stage consumes, or floods it, is backpressured instead of growing this
node's memory. The 1F1B schedule keeps at most `warmup + 1` microbatches in flight per direction
(node/pipeline/schedule.py), below the default `inbox_frames`, so the bound does not stall a correct peer.

An optional in-process shaper emulates a WAN link per direction: the sender paces frames to
`bandwidth_mbps` (serialization delay) and the receiver releases each frame `delay_ms` after it arrived
(propagation delay) — this kernel has no netem, and tests run without root.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections import deque
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
INBOX_FRAMES = 64
"""Default bound on frames received and not yet taken by `Link.recv`."""
INBOX_BYTES = 1 << 30
"""Default bound on their bytes (1 GiB; a single frame larger than this is still admitted alone)."""


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
        inbox_frames: int = INBOX_FRAMES,
        inbox_bytes: int = INBOX_BYTES,
    ) -> None:
        """inbox_frames, inbox_bytes: bounds on what has been received but not yet taken by recv()."""
        if inbox_frames < 1 or inbox_bytes < 1:
            raise ValueError(
                f"Link inbox bounds must be at least 1 (got inbox_frames={inbox_frames}, "
                f"inbox_bytes={inbox_bytes})"
            )
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # a relayed link is a local socket pair
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock, self.name = sock, name
        self.shaper = shaper or Shaper()
        self.max_frame_bytes = max_frame_bytes
        self.bytes_sent = 0
        self.bytes_recv = 0
        self._outbox: queue.Queue[object] = queue.Queue(maxsize=queue_depth)
        self.inbox_frames, self.inbox_bytes = inbox_frames, inbox_bytes
        self._inbox: deque[tuple[float, bytes]] = deque()  # (due at, payload), oldest first
        self._inbox_nbytes = 0
        self._inbox_cond = threading.Condition()
        self._recv_error: BaseException | None = None  # why the receiver stopped; raised once drained
        self.inbox_full_waits = 0
        """Times the receiver stopped reading because the inbox was full (the peer is backpressured)."""
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
        bytes are still being copied off a GPU (protocol.codecs.subspace `encode_async`) does not block compute."""
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
        with self._inbox_cond:
            while not self._inbox:
                if self._recv_error is not None:  # stays set: later calls raise it too
                    raise LinkError(f"link to {self.name} broke: {self._recv_error}") from self._recv_error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise LinkError(f"link to {self.name}: nothing received for {timeout_s} s")
                self._inbox_cond.wait(left)
            ready_at, payload = self._inbox[0]
            late = deadline is not None and ready_at > deadline
            if not late:  # else still in flight (shaper delay): deliver it on the next call
                self._inbox.popleft()
                self._inbox_nbytes -= len(payload)
                self._inbox_cond.notify_all()
        if late:
            assert deadline is not None
            time.sleep(max(0.0, deadline - time.monotonic()))
            raise LinkError(f"link to {self.name}: nothing received for {timeout_s} s")
        wait = ready_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return payload

    @property
    def inbox_len(self) -> int:
        """Frames received and not yet taken by recv() (at most `inbox_frames`)."""
        with self._inbox_cond:
            return len(self._inbox)

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
        with self._inbox_cond:  # wake a receiver waiting for room and recv() callers
            self._inbox_cond.notify_all()

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
                self._stop_receiving(e if not self._closed.is_set() else ConnectionClosed("link closed"))
                return
            self.bytes_recv += len(payload) + 4
            if not self._admit(payload, due_at=time.monotonic() + delay):
                self._stop_receiving(ConnectionClosed("link closed"))
                return

    def _admit(self, payload: bytes, *, due_at: float) -> bool:
        """Put a received frame in the inbox, waiting (not reading: backpressure) while it is full.
        False if the link was closed meanwhile."""
        with self._inbox_cond:
            waited = False
            while self._inbox and (
                len(self._inbox) >= self.inbox_frames or self._inbox_nbytes + len(payload) > self.inbox_bytes
            ):
                if self._closed.is_set():
                    return False
                if not waited:
                    waited = True
                    self.inbox_full_waits += 1
                self._inbox_cond.wait(0.5)
            if self._closed.is_set():
                return False
            self._inbox.append((due_at, payload))  # due_at: arrival + the shaper's one-way delay
            self._inbox_nbytes += len(payload)
            self._inbox_cond.notify_all()
            return True

    def _stop_receiving(self, why: BaseException) -> None:
        with self._inbox_cond:
            self._recv_error = why
            self._inbox_cond.notify_all()


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
    srv.listen(1024)  # a burst of connections is queued, not dropped (the acceptor caps what it holds)
    return srv

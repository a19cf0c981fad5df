"""A pipeline link's bytes over a libp2p stream that may be reset, resumed on a new stream with nothing lost.

A relayed link (node/pipeline/fallback.py) is a libp2p stream through a circuit relay, and a relay resets
each relayed connection past its byte and time limits (hivemind 1.1.12's p2pd: 4 GiB per direction and
30 min, or 128 KiB and 2 min when go-libp2p's default relay service won the race at its start: `Relay`). The pipeline must not see that: a `Link` (node/pipeline/transport.py) reads and writes one end of
a local socket pair, and a `BridgeSession` carries the other end's bytes over whichever stream is up.

Each side numbers the bytes it sent (`sent_total`) and received (`recv_total`) on the session. Sent bytes
stay in a bounded buffer until the other side acknowledges them; when a stream breaks, the dialing side
opens a new one naming the session, both sides state what they received, and each resends from there. So
every byte arrives once and in order, and a microbatch frame split by a reset is completed, not lost or
doubled. On the wire (inside the stream, after the libp2p security handshake):

    open    dialer -> server: MAGIC (NEW or RESUME), session id (16 bytes), dialer's recv_total (u64)
    reply   server -> dialer: MAGIC, server's recv_total (u64); GONE when it has no such session to resume
    frames  kind (1 byte: D data, A ack, C close), length (u32), payload (data <= CHUNK; ack: u64 total
            received; close: u64 total sent, answered by an ack before the receiver closes)

The server accepts a resume only from the libp2p peer that opened the session (libp2p authenticates peer
ids end to end, through the relay too). A side whose stream stays down for `resume_s` closes its local
socket, and the Link above breaks as a TCP link would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

MAGIC, NEW, RESUME, GONE = b"CRB1", b"CRBN", b"CRBR", b"CRBX"
CHUNK = 1 << 16
"""Largest data frame: what one read of the local socket gives at most."""
ACK_EVERY = 1 << 18
"""Bytes received between two acknowledgements."""
MAX_UNACKED = 64 << 20
"""Sent bytes kept for a resend at most; past it the local side stops reading (backpressure)."""
MAX_INBOUND = 16 << 20
"""Received bytes not yet written to the local socket at most; past it the stream is not read."""
LINGER_S = 300.0
"""A closed side waits this long without progress for the other side to acknowledge what it sent."""
RESUME_S = 30.0
"""How long a session waits for a new stream after its stream broke."""
_FRAME = struct.Struct(">cI")
_U64 = struct.Struct(">Q")
_OPEN = struct.Struct(">4s16sQ")
_REPLY = struct.Struct(">4sQ")

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
T = TypeVar("T")


class BridgeError(ConnectionError):
    """The other side broke the bridge protocol (bad magic, an oversized frame, an impossible offset)."""


class SessionGone(BridgeError):
    """The other side has no such session any more (it closed): nothing to resume."""


def retrieved_task(coro: Awaitable[T]) -> asyncio.Task[T]:
    """`coro` as a task whose exception is always retrieved. Python 3.11's wait_for, cancelled while the
    task it wraps ends with an error (a reconnect told GONE as its session closes), drops that error
    unretrieved, and asyncio then logs it with a traceback ("Task exception was never retrieved") from
    the garbage collector, in whatever thread runs it."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: None if t.cancelled() else t.exception())
    return task


def open_message(session: bytes, recv_total: int, *, resume: bool) -> bytes:
    return _OPEN.pack(RESUME if resume else NEW, session, recv_total)


async def read_open(reader: asyncio.StreamReader) -> tuple[bytes, int, bool]:
    """The dialer's opening: (session id, what the dialer received so far, whether it resumes one)."""
    magic, session, recv_total = _OPEN.unpack(await reader.readexactly(_OPEN.size))
    if magic not in (NEW, RESUME):
        raise BridgeError(f"not a relayed pipeline stream (magic {magic!r}, expected {NEW!r} or {RESUME!r})")
    return session, recv_total, magic == RESUME


async def read_reply(reader: asyncio.StreamReader) -> int:
    magic, recv_total = _REPLY.unpack(await reader.readexactly(_REPLY.size))
    if magic == GONE:
        raise SessionGone("the relayed peer closed this link")
    if magic != MAGIC:
        raise BridgeError(f"the relayed peer answered with magic {magic!r}, expected {MAGIC!r}")
    return int(recv_total)


def reply_message(recv_total: int, *, gone: bool = False) -> bytes:
    return _REPLY.pack(GONE if gone else MAGIC, recv_total)


class BridgeSession:
    """One pipeline link's bytes between a local socket and a sequence of libp2p streams (module docstring).

    `reconnect` (dialing side only) opens a new stream and exchanges the opening: it returns the stream,
    what the other side received and the stream's remote address. The server side waits for the dialer
    to come back instead. Bytes received are counted when they are taken off the stream into a bounded
    inbound buffer, and written to the local socket by a task of their own: a stage that is slow to read
    holds the stream back (backpressure) but never a resume's count."""

    def __init__(
        self,
        local: socket.socket,
        name: str,
        *,
        reconnect: Callable[[int], Awaitable[tuple[Stream, int, str]]] | None = None,
        resume_s: float = RESUME_S,
        on_close: Callable[[BridgeSession], None] = lambda s: None,
    ) -> None:
        local.setblocking(False)
        self.local, self.name = local, name
        self.reconnect, self.resume_s, self.on_close = reconnect, resume_s, on_close
        self.sent = bytearray()  # sent bytes not yet acknowledged, from offset sent_base
        self.sent_base = 0
        self.recv_total = 0
        self.generation = 0
        """Streams attached so far; a resume that finds another attached since it began drops its own."""
        self.resumes = 0
        """Streams after the first: how often the session survived a reset."""
        self.address = ""
        """The current stream's remote multiaddr (a /p2p-circuit one when relayed)."""
        self.closed = False
        self._closing = False  # the local side closed: the session ends once the other side has it all
        self._peer_closed = False  # the other side's close arrived: deliver what is buffered, then end
        self._stream: Stream | None = None
        self._room = asyncio.Event()  # set while the resend buffer has room
        self._room.set()
        self._inbound: deque[bytes] = deque()  # received, counted, not yet written to the local socket
        self._inbound_bytes = 0
        self._inbound_room, self._inbound_ready = asyncio.Event(), asyncio.Event()
        self._inbound_room.set()
        self._unacked_in = 0
        self._progress_at = 0.0  # loop time of the last attach or advancing ack
        self._tasks: list[asyncio.Task[None]] = []  # the local pump and the deliverer
        self._down_task: asyncio.Task[None] | None = None

    @property
    def sent_total(self) -> int:
        return self.sent_base + len(self.sent)

    # --- streams --------------------------------------------------------------------------------
    def received(self) -> int:
        """What this side received, for a resume: the current stream (if any) is dropped first, so no byte
        of it is counted after this."""
        if self._stream is not None:
            self._drop_stream(self._stream)
        return self.recv_total

    def attach(self, stream: Stream, peer_recv: int, address: str) -> asyncio.Task[None] | None:
        """Carry the session over `stream` from now, the other side having received `peer_recv` bytes:
        the bytes it lacks are sent first, then new ones. Returns the task reading the stream (it ends when
        the stream is dropped), or None when the stream was not taken (the session closed, or the opening
        is older than one already attached)."""
        if self.closed or peer_recv < self.sent_base:  # closed meanwhile, or a stale resume: not this one
            _abort(stream)
            return None
        if peer_recv > self.sent_total:
            _abort(stream)
            self.close(f"the other side claims {peer_recv} bytes received, past the {self.sent_total} sent")
            raise BridgeError(f"impossible resume offset {peer_recv}")
        if self._stream is not None:  # a resume that raced the old stream's failure
            self._drop_stream(self._stream)
        if self.generation:
            self.resumes += 1
        self.generation += 1
        self._ack(peer_recv)
        if self._down_task is not None and self._down_task is not asyncio.current_task():
            self._down_task.cancel()
        self._down_task = None
        self._stream, self.address = stream, address
        loop = asyncio.get_running_loop()
        self._progress_at = loop.time()
        writer = stream[1]
        view = memoryview(self.sent)
        for i in range(0, len(view), CHUNK):
            writer.write(_FRAME.pack(b"D", len(view[i : i + CHUNK])) + view[i : i + CHUNK])
        view.release()
        if self._closing:
            writer.write(self._close_frame())
        reading = loop.create_task(self._pump_stream(stream))
        if not self._tasks:
            self._tasks = [loop.create_task(self._pump_local()), loop.create_task(self._deliver())]
        return reading

    def _drop_stream(self, stream: Stream) -> None:
        if self._stream is stream:
            self._stream = None
        _abort(stream)  # not close(): a half-dead stream must not hold a flush up

    def _lost(self, stream: Stream, why: object) -> None:
        if self._stream is not stream or self.closed:
            return
        self._drop_stream(stream)
        if self._peer_closed:  # the other side closed and has its acknowledgement: nothing to resume
            return
        log.info("relayed link %s: stream lost (%s); resuming", self.name, why)
        if self._down_task is None:
            self._down_task = asyncio.get_running_loop().create_task(self._while_down())

    async def _while_down(self) -> None:
        """Dialer: open a new stream until `resume_s` has passed. Server: wait that long for one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.resume_s
        last: BaseException | None = None
        while loop.time() < deadline and not self.closed:
            if self.reconnect is None:
                await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
                continue
            try:
                stream, peer_recv, address = await asyncio.wait_for(
                    retrieved_task(self.reconnect(self.received())), max(0.1, deadline - loop.time())
                )
            except SessionGone as e:
                last = e
                break
            except Exception as e:  # OSError, a timeout, the libp2p client's own errors: try again
                last = e
                await asyncio.sleep(0.25)
                continue
            try:
                self.attach(stream, peer_recv, address)
            except BridgeError:
                pass
            return
        if not self.closed:
            self.close(f"no new stream within {self.resume_s:.0f} s ({last})")

    # --- pumps ----------------------------------------------------------------------------------
    def _send(self, frame: bytes) -> None:
        if self._stream is not None:
            if self._stream[1].transport.is_closing():  # reset under us: asyncio would warn on each write
                self._lost(self._stream, "the stream was reset")
                return
            try:
                self._stream[1].write(frame)
            except Exception as e:  # a transport closed under us: the stream pump sees it too
                self._lost(self._stream, e)

    def _close_frame(self) -> bytes:
        return _FRAME.pack(b"C", _U64.size) + _U64.pack(self.sent_total)

    def _ack(self, total: int) -> None:
        if total > self.sent_base:
            del self.sent[: min(total - self.sent_base, len(self.sent))]
            self.sent_base = total
            self._progress_at = asyncio.get_running_loop().time()
        if len(self.sent) < MAX_UNACKED:
            self._room.set()
        if self._closing and not self.sent:  # the other side has everything: done
            self.close("closed by this side")

    async def _pump_local(self) -> None:
        """Local socket -> resend buffer (and the current stream)."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            await self._room.wait()
            try:
                data = await loop.sock_recv(self.local, CHUNK)
            except OSError as e:
                self.close(f"local socket failed: {e}")
                return
            if not data:
                break
            self.sent += data
            if len(self.sent) >= MAX_UNACKED:
                self._room.clear()
            self._send(_FRAME.pack(b"D", len(data)) + data)
            if self._stream is not None:
                stream = self._stream
                try:
                    await stream[1].drain()
                except Exception as e:
                    self._lost(stream, e)
        if self.closed:
            return
        if self.sent_total == 0 and self.reconnect is None:
            # a served session whose acceptor never answered (a refused hello): nothing to deliver
            self.close("refused by this side")
            return
        # the Link closed: deliver what it sent, then the other side's Link closes too. The session ends on
        # the acknowledgement, when its stream stays down for resume_s (_while_down), or after LINGER_S
        # without progress (a peer that stopped reading for good)
        self._closing = True
        self._send(self._close_frame())  # again after a resume (attach), until acknowledged
        while not self.closed:
            await asyncio.sleep(1.0)
            if loop.time() - self._progress_at > LINGER_S:
                self.close(f"the other side acknowledged nothing for {LINGER_S:.0f} s after the close")

    async def _pump_stream(self, stream: Stream) -> None:
        """Stream -> inbound buffer, acknowledging; acknowledgements and the close from the other side."""
        reader = stream[0]
        try:
            while not self.closed and self._stream is stream:
                await self._inbound_room.wait()  # backpressure: a local side that lags holds the stream
                if self._stream is not stream:
                    return
                kind, n = _FRAME.unpack(await reader.readexactly(_FRAME.size))
                if kind == b"D":
                    if not 0 < n <= CHUNK:
                        raise BridgeError(f"data frame of {n} bytes (1..{CHUNK} allowed)")
                    data = await reader.readexactly(n)
                    if self._stream is not stream:  # replaced meanwhile: the peer resends it
                        return
                    self._inbound.append(data)  # counted with no await between: what a resume states
                    self._inbound_bytes += n
                    self.recv_total += n
                    self._inbound_ready.set()
                    if self._inbound_bytes >= MAX_INBOUND:
                        self._inbound_room.clear()
                    self._unacked_in += n
                    if self._unacked_in >= ACK_EVERY:
                        self._unacked_in = 0
                        self._send(_FRAME.pack(b"A", _U64.size) + _U64.pack(self.recv_total))
                elif kind == b"A":
                    if n != _U64.size:
                        raise BridgeError(f"ack frame of {n} bytes ({_U64.size} expected)")
                    (total,) = _U64.unpack(await reader.readexactly(n))
                    if total > self.sent_total:
                        raise BridgeError(f"ack of {total} bytes, past the {self.sent_total} sent")
                    if self._stream is not stream:
                        return
                    self._ack(total)  # an older ack than a resume's offset changes nothing
                elif kind == b"C":  # after every data frame it covers: all of it was received
                    if n != _U64.size:
                        raise BridgeError(f"close frame of {n} bytes ({_U64.size} expected)")
                    (total,) = _U64.unpack(await reader.readexactly(n))
                    if self._stream is not stream:
                        return
                    if total != self.recv_total:
                        raise BridgeError(f"closed at {total} bytes sent, {self.recv_total} received")
                    self._send(_FRAME.pack(b"A", _U64.size) + _U64.pack(self.recv_total))
                    self._peer_closed = True  # the deliverer ends the session once the buffer is out
                    self._inbound_ready.set()
                else:
                    raise BridgeError(f"unknown frame kind {kind!r}")
        except BridgeError as e:
            log.warning("relayed link %s: %s; closing", self.name, e)
            self.close(str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # IncompleteReadError, OSError, the libp2p client's own errors on a reset
            self._lost(stream, e)

    async def _deliver(self) -> None:
        """Inbound buffer -> local socket, in order; after the other side's close, ends the session."""
        loop = asyncio.get_running_loop()
        while not self.closed:
            if not self._inbound:
                if self._peer_closed:
                    self.close("closed by the other side")
                    return
                self._inbound_ready.clear()
                await self._inbound_ready.wait()
                continue
            data = self._inbound.popleft()
            try:
                await loop.sock_sendall(self.local, data)
            except OSError as e:
                self.close(f"local socket failed: {e}")
                return
            self._inbound_bytes -= len(data)
            if self._inbound_bytes < MAX_INBOUND:
                self._inbound_room.set()

    def cut(self) -> None:
        """Reset the current stream, as a relay at its limit would (tests, benchmarks)."""
        if self._stream is not None:
            self._lost(self._stream, "cut")

    def close(self, why: str = "closed") -> None:
        if self.closed:
            return
        self.closed = True
        log.debug("relayed link %s closed: %s", self.name, why)
        if self._stream is not None:
            self._drop_stream(self._stream)
        current = asyncio.current_task()
        for task in (self._down_task, *self._tasks):
            if task is not None and task is not current:
                task.cancel()
        for event in (self._room, self._inbound_room, self._inbound_ready):
            event.set()
        # after the cancelled tasks let go of the socket (a pending sock_recv is unregistered then)
        asyncio.get_running_loop().call_soon(self._close_local)
        self.on_close(self)

    def _close_local(self) -> None:
        with contextlib.suppress(OSError):
            self.local.shutdown(socket.SHUT_RDWR)
        self.local.close()


def _abort(stream: Stream) -> None:
    with contextlib.suppress(Exception):
        stream[1].transport.abort()

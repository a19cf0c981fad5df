"""Accepts pipeline connections from upstream neighbours and holds them until the stage worker asks.

The first frame on a connection is a signed `Hello`. The pipeline port faces the internet, so everything a
stranger can make it hold is bounded:

- One supervised thread accepts and runs every handshake (non-blocking sockets on a selector). An OSError
  from accept (EMFILE, ENFILE, ECONNABORTED, ENOBUFS, ...) is counted in `accept_errors` and logged, and
  accepting pauses with an exponential backoff (`backoff_max_s`) while handshakes and expiry go on; any
  other error is logged and the loop continues. Only `close()` ends it.
- A connection must deliver its whole Hello frame within `hello_timeout_s` of being accepted: a total
  deadline, not one per recv, so a peer writing one byte every few seconds is dropped.
- At most `max_pending` connections are in their handshake and `max_held` authenticated ones wait for
  `take()`; past either cap the oldest is dropped (a held one the worker is waiting for is kept when
  another can go) and counted in `dropped`. A held connection expires after `keep_s`.
- At most `max_pending_bytes` are announced by the frames of connections in their handshake (a hello
  carries an assignment of up to 4 MiB): past it the oldest such connections are dropped.
- A Hello is bound to its recipient and to a moment: with `peer_id` set, its `to_peer_id` must name this
  node, its `sent_at` must lie within `max_skew_s` of this node's clock, and the same Hello is accepted
  once. A captured Hello therefore replays neither to another node nor, later, to this one. `take()`
  accepts only the caller's (term, epoch) or a newer one, so a connection made for a superseded
  assignment is not handed to the current one.
- Only neighbours are held: with `trust` (the node's rule for assignments) a pipeline hello must carry
  the sender's signed assignment putting this node right downstream of it, not older than the (term,
  epoch) this node holds for the run (node/pipeline/hello_proof.py), or come from the peer a `take()`
  is waiting for right now (the worker's own trusted assignment names it). Identities cost nothing, but
  assignments only a trusted coordinator signs: a flood of fresh keys is refused and evicts no one.
- A probe (`probe_bytes` > 0, run "probe", no assignment) is never held: it is answered on its own
  bounded path (`max_probes` at once, node/pipeline/link_probe.py). Probes and pipeline hellos are
  remembered for replay apart, and only hellos that passed every check are remembered, so a flood of
  probes or fresh hellos cannot flush the memory that stops a neighbour's captured hello from replaying
  (a replay for the neighbour's key would replace its held connection).

Malformed, badly signed, misaddressed, stale, replayed or unproven hellos are refused at once (counted in
`rejected`, and logged), so a stray or hostile client cannot block the node.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from node.pipeline import hello_proof
from node.pipeline.hello_proof import HELLO_MAX_BYTES
from node.pipeline.link_probe import PROBE_RUN_ID, serve_probe
from node.pipeline.transport import Shaper
from protocol.framing import HEADER
from protocol.messages import Hello
from protocol.schema import ProtocolError
from protocol.trust.delegation import OperatorTrust

log = logging.getLogger(__name__)
SEEN_HELLOS_MAX = 4096
"""Hellos remembered for replay detection (within the skew window); the oldest are forgotten first."""

_Key = tuple[str, str, int, int]  # (run_id, peer_id, replica, stage) of the upstream stage


class _Throttled:
    """Logs one kind of event at most once per `every_s`, saying how many were left out: a flood of
    hostile connections must not turn into a flood of log lines (nor slow the accept loop down)."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._next = 0.0
        self._quiet = 0

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._quiet += 1
            return
        if self._quiet:
            msg, args = msg + " (and %d more like it in the last second, not logged)", (*args, self._quiet)
        self._quiet, self._next = 0, now + self.every_s
        log.warning(msg, *args)


class _ReplayWindow:
    """Hellos accepted in the last `keep_s` (twice the skew window: past that a replay's `sent_at` is refused
    anyway), at most SEEN_HELLOS_MAX, the oldest forgotten first."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._seen: OrderedDict[Hello, float] = OrderedDict()  # hello -> monotonic time it may be forgotten

    def refuse_replay(self, h: Hello) -> None:
        now = time.monotonic()
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        if h in self._seen:
            raise ProtocolError(
                f"hello from {h.peer_id} was already used by an earlier connection (replayed)"
            )

    def add(self, h: Hello) -> None:
        if len(self._seen) >= SEEN_HELLOS_MAX:
            self._seen.popitem(last=False)
        self._seen[h] = time.monotonic() + self.keep_s


def _check_bounds(**seconds: float) -> None:
    for name, value in seconds.items():
        if not value > 0:
            raise ValueError(f"Acceptor {name}={value!r} must be a positive number of seconds")


@dataclass
class _Handshake:
    """A connection still sending its Hello frame."""

    conn: socket.socket
    addr: object
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    length: int | None = None
    """The frame's announced length, once its 4-byte header is in (`buf` then holds the body)."""

    def need(self) -> int:
        return (HEADER.size if self.length is None else self.length) - len(self.buf)


@dataclass
class _Held:
    """An authenticated connection waiting for `take()`."""

    since: float
    hello: Hello
    conn: socket.socket

    @property
    def key(self) -> _Key:
        h = self.hello
        return (h.run_id, h.peer_id, h.replica, h.stage)


class Acceptor:
    """Supervised accept loop on the node's pipeline port (module docstring for the bounds)."""

    def __init__(
        self,
        server: socket.socket,
        *,
        peer_id: str | None = None,
        hello_timeout_s: float = 10.0,
        keep_s: float = 120.0,
        max_pending: int = 64,
        max_held: int = 64,
        max_skew_s: float = 60.0,
        backoff_max_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        probe_shaper: Shaper | None = None,
        max_probes: int = 2,
        trust: OperatorTrust | None = None,
        max_pending_bytes: int = 32 << 20,
    ) -> None:
        """peer_id: this node's peer id; hellos must be addressed to it (None: not checked, for tests and
        callers not yet sending addressed hellos). clock: Unix time for `Hello.sent_at` and the assignment
        a hello carries (injectable). trust: the node's rule for assignments; with it only neighbours are
        held (module docstring; None: any validly signed hello is, for tests and callers without one)."""
        _check_bounds(
            hello_timeout_s=hello_timeout_s, keep_s=keep_s, max_skew_s=max_skew_s, backoff_max_s=backoff_max_s
        )
        for name, n in (("max_pending", max_pending), ("max_held", max_held)):
            if n < 1:
                raise ValueError(f"Acceptor {name}={n!r} must be at least 1")
        if max_pending_bytes < HELLO_MAX_BYTES:
            raise ValueError(
                f"Acceptor max_pending_bytes={max_pending_bytes!r} must be at least one hello's {HELLO_MAX_BYTES} bytes"
            )
        if trust is not None and peer_id is None:
            raise ValueError(
                "Acceptor trust needs peer_id: a hello proves its sender a neighbour by an assignment naming "
                "this node's peer id"
            )
        self.server = server
        self.peer_id, self.trust = peer_id, trust
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0  # announced by the frames of connections in their handshake
        self._holds: dict[str, tuple[int, int]] = {}  # run -> the newest (term, epoch) take() was called with
        self.hello_timeout_s, self.keep_s = hello_timeout_s, keep_s
        self.max_pending, self.max_held = max_pending, max_held
        self.max_skew_s, self.backoff_max_s = max_skew_s, backoff_max_s
        self.clock = clock
        self.probe_shaper, self.max_probes = probe_shaper or Shaper(), max_probes
        self._probes_active = 0
        self.probes_served = 0
        """Bandwidth probes answered (authenticated like hellos; node/pipeline/link_probe.py)."""
        self._port = int(server.getsockname()[1])
        self.rejected = 0
        """Connections refused for their hello: malformed, badly signed, misaddressed, stale, replayed,
        incomplete by the deadline, not from a neighbour, or for a superseded (term, epoch)."""
        self.dropped = 0
        """Closed for `max_pending` / `max_pending_bytes` / `max_held`, superseded, or expired (keep_s)."""
        self.accept_errors = self.loop_errors = 0
        """OSErrors from accept() (EMFILE, ECONNABORTED, ...: each pauses accepting briefly); unexpected
        errors the supervised loop survived."""
        self._held: list[_Held] = []
        self._wanted: Counter[_Key] = Counter()  # keys take() is waiting for: evicted last
        # pipeline hellos and probes apart: a probe flood cannot make a neighbour's hello replayable
        self._seen, self._seen_probes = _ReplayWindow(2 * max_skew_s), _ReplayWindow(2 * max_skew_s)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pending: dict[socket.socket, _Handshake] = {}  # accept order: the first is the oldest
        self._adopted: list[tuple[socket.socket, str]] = []  # relayed connections, not yet admitted
        self._sel = selectors.DefaultSelector()
        self._paused_until = 0.0  # accepting resumes at this monotonic time (0: not paused)
        self._backoff_s = 0.0
        self._log_rejected, self._log_dropped, self._log_accept = _Throttled(), _Throttled(), _Throttled()
        if peer_id is None:
            log.warning(
                "pipeline acceptor started without this node's peer id: hellos are not bound to a recipient "
                "or a time, so a captured hello can be replayed; pass peer_id"
            )
        server.setblocking(False)
        self._sel.register(server, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._loop, name="acceptor", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._port

    def adopt(self, conn: socket.socket, addr: str) -> None:
        """Take a connection that came another way (a relayed stream's local socket) as if the port had
        accepted it: the same handshake, rules and caps."""
        with self._cond:
            self._adopted.append((conn, addr))

    @property
    def pending(self) -> int:
        """Connections in their handshake now."""
        return len(self._pending)

    @property
    def held(self) -> int:
        """Authenticated connections waiting for take() now."""
        with self._cond:
            return len(self._held)

    # --- the supervised loop ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._serve_once()
                except Exception as e:  # supervision: whatever went wrong, the port keeps serving
                    if self._stop.is_set():
                        break
                    self._count("loop_errors")
                    log.exception("pipeline acceptor: unexpected %s, continuing", type(e).__name__)
                    self._stop.wait(0.1)
        finally:
            for hs in list(self._pending.values()):
                hs.conn.close()
            self._pending.clear()
            self._pending_bytes = 0
            self._sel.close()
            with contextlib.suppress(OSError):
                self.server.close()

    def _serve_once(self) -> None:
        with self._cond:
            adopted, self._adopted = self._adopted, []
        for conn, addr in adopted:
            self._admit(conn, addr)
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self.server, selectors.EVENT_READ)
        timeout = 0.2  # also how soon close() is noticed
        if self._pending:
            timeout = min(timeout, next(iter(self._pending.values())).deadline - now)
        if self._paused_until:
            timeout = min(timeout, self._paused_until - now)
        for key, _ in self._sel.select(max(0.0, timeout)):
            if self._stop.is_set():
                return
            if key.fileobj is self.server:
                self._accept_ready()
            else:
                self._read(key.fileobj)  # type: ignore[arg-type]
        self._expire(time.monotonic())

    def _accept_ready(self) -> None:
        for _ in range(64):  # at most this many per turn, so handshakes are served under a flood too
            try:
                conn, addr = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE/ENFILE (out of descriptors), ECONNABORTED, ENOBUFS...: not fatal. Pause accepting
                # (the selector would report the waiting connection again at once) and carry on.
                self._backoff_s = min(max(2 * self._backoff_s, 0.05), self.backoff_max_s)
                self._count("accept_errors")
                self._log_accept.warning(
                    "pipeline port %d: accept failed (%s); pausing accepts for %.2f s, %d failures so far",
                    self._port,
                    e,
                    self._backoff_s,
                    self.accept_errors,
                )
                self._sel.unregister(self.server)
                self._paused_until = time.monotonic() + self._backoff_s
                return
            self._backoff_s = 0.0
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: object) -> None:
        while len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending.values()))
            self._count("dropped")
            self._close_pending(oldest)
            self._log_dropped.warning(
                "dropped pipeline connection from %s: %d connections already in their handshake",
                oldest.addr,
                self.max_pending,
            )
        conn.setblocking(False)
        self._pending[conn] = _Handshake(conn, addr, time.monotonic() + self.hello_timeout_s)
        self._sel.register(conn, selectors.EVENT_READ)

    def _close_pending(self, hs: _Handshake) -> None:
        self._close_pending_keep_socket(hs)
        hs.conn.close()

    def _reject(self, hs: _Handshake, why: str) -> None:
        self._count("rejected")  # before the close: a peer that sees the close also sees the count
        self._close_pending(hs)
        self._log_rejected.warning("rejected pipeline connection from %s: %s", hs.addr, why)

    def _read(self, conn: socket.socket) -> None:
        hs = self._pending.get(conn)
        if hs is None:
            return
        try:
            chunk = conn.recv(hs.need())
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._reject(hs, f"read failed: {e}")
            return
        if not chunk:
            self._reject(hs, "closed the connection before its hello was complete")
            return
        hs.buf += chunk
        if hs.length is None and len(hs.buf) == HEADER.size:
            (length,) = HEADER.unpack(hs.buf)
            hs.buf.clear()
            if length > HELLO_MAX_BYTES:
                self._reject(hs, f"hello frame of {length} bytes is over the {HELLO_MAX_BYTES}-byte limit")
                return
            self._reserve(hs, length)
        if hs.length is not None and len(hs.buf) == hs.length:
            self._close_pending_keep_socket(hs)
            try:
                hello = self._authenticate(bytes(hs.buf))
            except ValueError as e:  # ProtocolError, SignatureError and the schema's range errors
                self._count("rejected")
                hs.conn.close()
                self._log_rejected.warning("rejected pipeline connection from %s: %s", hs.addr, e)
                return
            hs.conn.setblocking(True)
            if hello.probe_bytes:
                self._probe(hello, hs)
            else:
                self._hold(hello, hs.conn)

    def _probe(self, hello: Hello, hs: _Handshake) -> None:
        """An authenticated bandwidth probe (node/pipeline/link_probe.py): served on its own thread, at most
        `max_probes` at once (a node probes a few peers per refresh; more is a flood)."""
        with self._cond:
            busy = self._probes_active >= self.max_probes or self.peer_id is None
            if not busy:
                self._probes_active += 1
        if busy:
            self._count("rejected")
            hs.conn.close()
            self._log_rejected.warning(
                "refused probe from %s (%s): %d probes already running",
                hs.addr,
                hello.peer_id[-8:],
                self.max_probes,
            )
            return

        def serve() -> None:
            try:
                serve_probe(hs.conn, hello, self.probe_shaper)
            finally:
                with self._cond:
                    self._probes_active -= 1
                    self.probes_served += 1

        threading.Thread(target=serve, name="probe", daemon=True).start()

    def _close_pending_keep_socket(self, hs: _Handshake) -> None:
        del self._pending[hs.conn]
        self._pending_bytes -= hs.length or 0
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(hs.conn)

    def _reserve(self, hs: _Handshake, length: int) -> None:
        """Count the length `hs` announced against `max_pending_bytes`, dropping the oldest handshakes
        that announced one until it fits (it does once only `hs` is left: the budget holds a whole hello)."""
        hs.length = length
        self._pending_bytes += length
        while self._pending_bytes > self.max_pending_bytes:
            oldest = next(h for h in self._pending.values() if h.length and h is not hs)
            self._count("dropped")
            self._close_pending(oldest)
            self._log_dropped.warning(
                "dropped pipeline connection from %s: hellos in their handshake announce more than %d bytes",
                oldest.addr,
                self.max_pending_bytes,
            )

    def _authenticate(self, frame: bytes) -> Hello:
        h = hello_proof.open_hello(frame, self.peer_id, now=self.clock(), max_skew_s=self.max_skew_s)
        if self.peer_id is None:
            return h
        seen = self._seen_probes if h.probe_bytes else self._seen
        seen.refuse_replay(h)
        if h.probe_bytes:
            if h.run_id != PROBE_RUN_ID:
                raise ProtocolError(
                    f"probe from {h.peer_id} names run {h.run_id!r}: a probe names run {PROBE_RUN_ID!r} "
                    "(node/pipeline/link_probe.py)"
                )
        elif self.trust is not None:  # a neighbour's (node/pipeline/hello_proof.py)
            with self._cond:
                held = self._holds.get(h.run_id)
                waited_for = (h.run_id, h.peer_id, h.replica, h.stage) in self._wanted
            if h.assignment or not waited_for:  # waited for: take() checks the worker's own (term, epoch)
                hello_proof.check(h, self.trust, self.peer_id, now=self.clock(), held=held)
        seen.add(h)  # only what passed every check: a flood of refused hellos flushes nothing
        return h

    def _hold(self, hello: Hello, conn: socket.socket) -> None:
        item = _Held(time.monotonic(), hello, conn)
        with self._cond:
            for old in [i for i in self._held if i.key == item.key]:  # the peer reconnected: keep the newest
                self._held.remove(old)
                self.dropped += 1
                old.conn.close()
            while len(self._held) >= self.max_held:
                victim = next((i for i in self._held if i.key not in self._wanted), self._held[0])
                self._held.remove(victim)
                self.dropped += 1
                victim.conn.close()
                self._log_dropped.warning(
                    "dropped held pipeline connection from %s: %d connections already wait to be taken",
                    victim.hello.peer_id,
                    self.max_held,
                )
            self._held.append(item)
            self._cond.notify_all()

    def _expire(self, now: float) -> None:
        for hs in [hs for hs in self._pending.values() if hs.deadline <= now]:
            got = len(hs.buf) + (HEADER.size if hs.length is not None else 0)
            self._reject(hs, f"hello not complete within {self.hello_timeout_s:g} s ({got} bytes received)")
        with self._cond:
            for item in [i for i in self._held if now - i.since > self.keep_s]:
                self._held.remove(item)
                self.dropped += 1
                item.conn.close()

    def _count(self, name: str) -> None:
        with self._cond:
            setattr(self, name, getattr(self, name) + 1)

    # --- the worker's side ------------------------------------------------------------------------
    def take(
        self,
        run_id: str,
        peer_id: str,
        replica: int,
        stage: int,
        timeout_s: float,
        cancelled: Callable[[], bool] = lambda: False,
        *,
        term: int | None = None,
        epoch: int | None = None,
    ) -> tuple[Hello, socket.socket]:
        """Wait for the connection from `peer_id` serving (run_id, replica, stage); raise TimeoutError.

        term, epoch: the assignment the caller holds; a hello for an older (term, epoch) is refused and its
        connection closed (a newer one is accepted: the upstream node saw the next assignment first)."""
        key = (run_id, peer_id, replica, stage)
        floor = None if term is None and epoch is None else (term or 0, epoch or 0)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if floor is not None:  # what this node holds: hellos for an older one are refused on arrival
                self._holds[run_id] = max(floor, self._holds.get(run_id, floor))
            self._wanted[key] += 1
            try:
                while True:
                    for item in [i for i in self._held if i.key == key]:
                        self._held.remove(item)
                        h = item.hello
                        if floor is not None and (h.term, h.epoch) < floor:
                            self.rejected += 1
                            item.conn.close()
                            log.warning(
                                "refused pipeline connection from %s: its hello is for term %d epoch %d, "
                                "older than the assignment at term %d epoch %d",
                                peer_id,
                                h.term,
                                h.epoch,
                                *floor,
                            )
                            continue
                        return h, item.conn
                    now = time.monotonic()
                    if now >= deadline or self._stop.is_set() or cancelled():
                        raise TimeoutError(
                            f"upstream neighbour {peer_id} (replica {replica}, stage {stage}) did not connect "
                            f"within {timeout_s:.0f} s"
                        )
                    self._cond.wait(min(1.0, deadline - now))
            finally:
                self._wanted[key] -= 1
                if self._wanted[key] <= 0:
                    del self._wanted[key]

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)  # the loop closes the server socket and pending handshakes
        with contextlib.suppress(OSError):
            self.server.close()
        with self._cond:
            for item in self._held:
                item.conn.close()
            self._held.clear()
            self._cond.notify_all()

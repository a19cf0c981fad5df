"""A small hardened HTTP server for the node's health port and the coordinator's dashboard.

aiohttp's low-level server on its own uvloop thread. The port is reachable by anyone, and aiohttp by
itself waits for a request's head as long as a client keeps the connection open. So every connection
gets a deadline: a request must begin (its head fully read and dispatched) within `request_timeout_s` of
the connection opening or of the previous response; past it the connection is closed (counted in
`timed_out`). At most `max_connections` are open: a new one past the cap closes the least recently
active (counted in `dropped`). A thousand half-open requests therefore hold at most `max_connections`
sockets, for at most `request_timeout_s`.

Routes map a path to a handler; a path ending in "/" also serves everything below it (`/api/runs/` serves
`/api/runs/abc`). A handler raises `BadRequest` for a request it cannot answer (an unknown run, a
malformed query): the client gets that 4xx status with `{"error": message}`, never a 500, and the
refusal is counted by reason in `rejected`.

What aiohttp logs about a connection (a malformed request, by default with a traceback at ERROR; a client
gone mid-answer) and a handler's own failures go through one `RequestLog`: at most `log_lines` lines per
`log_interval_s`, then one line counting the rest, so a flood of malformed requests is not a flood of
logs. A malformed request is a client's mistake, not the server's: one WARNING line, no traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

import uvloop
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024
"""Connections the kernel queues before accept: a burst is accepted (and capped) instead of its SYNs
being dropped, which would delay honest clients by TCP's 1 s retransmission."""

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class BadRequest(Exception):
    """A request the handler cannot answer: answered with `status` and the message, counted by `reason`."""

    def __init__(self, message: str, *, status: int = 400, reason: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


def query_int(request: web.BaseRequest, name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter in [lo, hi], or BadRequest naming it."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(
            f"query {name}={raw[:40]!r} is not an integer (example: ?{name}={default})"
        ) from None
    if not lo <= value <= hi:
        raise BadRequest(f"query {name}={value} is out of range [{lo}, {hi}]")
    return value


def check_query(request: web.BaseRequest, allowed: set[str]) -> None:
    """BadRequest for a query parameter the endpoint does not take (a typo is said, not ignored)."""
    unknown = sorted(set(request.query) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "no parameters"
        raise BadRequest(
            f"unknown query parameter(s) {[u[:40] for u in unknown[:5]]}; {request.path[:100]} takes {takes}"
        )


class RequestLog(logging.Logger):
    """The logger aiohttp's connections and the handlers log to: at most `lines` lines per `interval_s`
    pass to `log`, the rest are counted and summed up in one line when the interval ends. A record
    about a malformed request (aiohttp's HttpProcessingError) becomes one WARNING line without its
    traceback. Used on the server's own loop thread only."""

    def __init__(
        self,
        name: str,
        *,
        loop: asyncio.AbstractEventLoop,
        lines: int,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(f"{log.name}.{name}")
        self.server_name, self._loop, self._clock = name, loop, clock
        self.lines, self.interval_s = lines, interval_s
        self._window_start = -float("inf")
        self._in_window = 0
        self.suppressed = 0
        """Lines not logged in the current interval (summed up when it ends)."""

    def handle(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):  # the client's mistake: one line, no traceback
            detail = " ".join(str(exc).split())[:300]
            record = log.makeRecord(
                log.name,
                min(record.levelno, logging.WARNING),  # (aiohttp logs non-HTTP traffic at DEBUG)
                record.pathname,
                record.lineno,
                "%s server: %s: malformed request (%s: %s), answered %d",
                (self.server_name, record.getMessage(), type(exc).__name__, detail, exc.code),
                None,
            )
        if not log.isEnabledFor(record.levelno):
            return
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self._summarize()
            self._window_start, self._in_window = now, 0
        if self._in_window >= self.lines:
            if not self.suppressed:  # the summary comes when the interval ends, even if the flood stops
                self._loop.call_later(self._window_start + self.interval_s - now, self._summarize)
            self.suppressed += 1
            return
        self._in_window += 1
        log.handle(record)

    def _summarize(self) -> None:
        if self.suppressed:
            log.warning(
                "%s server: %d more request errors in %g s not logged (at most %d lines per %g s)",
                self.server_name,
                self.suppressed,
                self.interval_s,
                self.lines,
                self.interval_s,
            )
            self.suppressed = 0


class _GuardedServer(web.Server):
    """aiohttp's low-level server with a cap on open connections and a deadline per request."""

    def __init__(
        self,
        handler: Handler,
        *,
        loop: asyncio.AbstractEventLoop,
        max_connections: int,
        request_timeout_s: float,
        request_log: RequestLog,
    ) -> None:
        # keepalive_timeout: aiohttp's own idle timer, just past ours (belt and braces)
        super().__init__(
            handler,
            loop=loop,
            access_log=None,
            keepalive_timeout=request_timeout_s + 1.0,
            logger=request_log,
        )
        self._ioloop = loop
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        # connection -> its deadline timer (None while a request is being answered); least recently
        # active first, so the cap closes the connection that has been idle or stalled the longest
        self._deadlines: dict[RequestHandler, asyncio.TimerHandle | None] = {}
        self.dropped = 0
        self.timed_out = 0

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(handler, transport)
        self._arm(handler)
        while len(self._deadlines) > self.max_connections:
            oldest = next(iter(self._deadlines))
            self._disarm(oldest)
            self.dropped += 1
            oldest.force_close()

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:  # type: ignore[override]
        self._disarm(handler)
        super().connection_lost(handler, exc)

    def request_started(self, handler: RequestHandler) -> None:
        if handler in self._deadlines:
            self._disarm(handler)
            self._deadlines[handler] = None  # still counted against the cap, most recently active

    def request_finished(self, handler: RequestHandler) -> None:
        if handler in self._deadlines:
            self._arm(handler)

    @property
    def open_connections(self) -> int:
        return len(self._deadlines)

    def _arm(self, handler: RequestHandler) -> None:
        self._disarm(handler)
        self._deadlines[handler] = self._ioloop.call_later(self.request_timeout_s, self._expire, handler)

    def _disarm(self, handler: RequestHandler) -> None:
        timer = self._deadlines.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, handler: RequestHandler) -> None:
        if self._deadlines.pop(handler, None) is not None:
            self.timed_out += 1
            handler.force_close()


class GuardedHTTPServer:
    """Serves `routes` (GET and HEAD only) on host:port from its own thread; `port` is the bound port."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Handler],
        *,
        name: str = "http",
        port_flag: str = "--http-port",
        max_connections: int = 64,
        request_timeout_s: float = 10.0,
        log_lines: int = 10,
        log_interval_s: float = 60.0,
    ) -> None:
        """max_connections: open connections at most (the least recently active is closed past it);
        request_timeout_s: a request must begin within this many seconds of the connection opening or of
        the previous response, else the connection is closed. port_flag: named in the error when the
        port is taken. log_lines, log_interval_s: at most this many lines about failed requests per
        interval, then one line counting the rest."""
        if max_connections < 1:
            raise ValueError(f"{name} server max_connections={max_connections} must be at least 1")
        if not request_timeout_s > 0:
            raise ValueError(f"{name} server request_timeout_s={request_timeout_s} must be a positive number")
        if log_lines < 1 or not log_interval_s > 0:
            raise ValueError(
                f"{name} server log_lines={log_lines}, log_interval_s={log_interval_s}: need at least 1 "
                "line per positive interval"
            )
        self.routes = dict(routes)
        self.max_connections, self.request_timeout_s = max_connections, request_timeout_s
        self.rejected: Counter[str] = Counter()
        """Requests answered with a 4xx, by reason (not_found, method_not_allowed, bad_request, ...)."""
        self.requests: Counter[str] = Counter()
        """Requests answered, by route."""
        self._loop = uvloop.new_event_loop()  # libuv's loop, on its own thread
        self.request_log = RequestLog(name, loop=self._loop, lines=log_lines, interval_s=log_interval_s)
        self._runner: web.ServerRunner | None = None
        self._server: _GuardedServer | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._thread_main, args=(host, port), name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"{name} server did not start on {host}:{port}")
        if self._start_error is not None:
            raise RuntimeError(
                f"{name} server could not listen on {host}:{port}: {self._start_error}; "
                f"choose a free {port_flag} (0 = any)"
            ) from self._start_error

    @property
    def dropped(self) -> int:
        """Connections closed because `max_connections` were open."""
        return self._server.dropped if self._server else 0

    @property
    def timed_out(self) -> int:
        """Connections closed because no request began within `request_timeout_s`."""
        return self._server.timed_out if self._server else 0

    @property
    def open_connections(self) -> int:
        return self._server.open_connections if self._server else 0

    def _thread_main(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(host, port))
        except Exception as e:  # reported by __init__ with the address
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _start(self, host: str, port: int) -> None:
        self._server = _GuardedServer(
            self._dispatch,
            loop=self._loop,
            max_connections=self.max_connections,
            request_timeout_s=self.request_timeout_s,
            request_log=self.request_log,
        )
        self._runner = web.ServerRunner(self._server, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    def _route(self, path: str) -> tuple[str, Handler] | None:
        if path in self.routes:
            return path, self.routes[path]
        for prefix, handler in self.routes.items():
            if prefix.endswith("/") and prefix != "/" and path.startswith(prefix):
                return prefix, handler
        return None

    def _refuse(self, status: int, reason: str, message: str, **headers: str) -> web.Response:
        self.rejected[reason] += 1
        return web.json_response({"error": message}, status=status, headers=headers or None)

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        server, conn = self._server, request.protocol
        assert server is not None
        server.request_started(conn)
        try:
            found = self._route(request.path)
            if found is None:
                paths = ", ".join(sorted(self.routes))
                return self._refuse(404, "not_found", f"no such path {request.path[:200]!r}; try {paths}")
            if request.method not in ("GET", "HEAD"):
                return self._refuse(
                    405,
                    "method_not_allowed",
                    f"{request.method} is not supported; use GET",
                    Allow="GET, HEAD",
                )
            name, handler = found
            try:
                response = await handler(request)
            except BadRequest as e:
                return self._refuse(e.status, e.reason, str(e))
            self.requests[name] += 1
            return response
        except Exception as e:  # a bug, not the client's fault: say so, keep serving
            self.request_log.exception("%s %s failed", request.method, request.path[:200])
            return web.json_response({"error": f"internal error: {type(e).__name__}: {e}"}, status=500)
        finally:
            server.request_finished(conn)

    def close(self, timeout_s: float = 5.0) -> None:
        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)


__all__ = [
    "LISTEN_BACKLOG",
    "BadRequest",
    "GuardedHTTPServer",
    "Handler",
    "RequestLog",
    "check_query",
    "query_int",
]

"""Health and metrics over HTTP (aiohttp's low-level server on its own event loop thread).

GET /health  -> {"status": "ok", "peer_id": ..., "state": ...}
GET /status  -> the node's advert fields and the current assignment's live metrics (JSON)
GET /metrics -> the same numbers in Prometheus text format

The port is reachable by anyone, and aiohttp by itself waits for a request's head as long as a client
keeps the connection open. So every connection gets a deadline: a request must begin (its head fully
read and dispatched) within `request_timeout_s` of the connection opening or of the previous response;
past it the connection is closed (counted in `timed_out`). At most `max_connections` are open: a new
one past the cap closes the least recently active (counted in `dropped`). A thousand half-open
requests therefore hold at most `max_connections` sockets, for at most `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable

import uvloop
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

LISTEN_BACKLOG = 1024
"""Connections the kernel queues before accept: a burst is accepted (and capped) instead of its SYNs
being dropped, which would delay honest clients by TCP's 1 s retransmission."""


def _prometheus(status: dict) -> str:
    lines = []
    for k, v in sorted(status.get("metrics", {}).items()):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        lines.append(f"crucible_{k} {v}")
    return "\n".join(lines) + "\n"


class _GuardedServer(web.Server):
    """aiohttp's low-level server with a cap on open connections and a deadline per request."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        *,
        loop: asyncio.AbstractEventLoop,
        max_connections: int,
        request_timeout_s: float,
    ) -> None:
        # keepalive_timeout: aiohttp's own idle timer, just past ours (belt and braces)
        super().__init__(handler, loop=loop, access_log=None, keepalive_timeout=request_timeout_s + 1.0)
        self._ioloop = loop
        self.max_connections = max_connections
        self.request_timeout_s = request_timeout_s
        # connection -> its deadline timer (None while a request is being answered); least recently
        # active first, so the cap closes the connection that has been idle or stalled the longest
        self._deadlines: dict[RequestHandler, asyncio.TimerHandle | None] = {}
        self.dropped = 0
        self.timed_out = 0

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._arm(handler)
        while len(self._deadlines) > self.max_connections:
            oldest = next(iter(self._deadlines))
            self._disarm(oldest)
            self.dropped += 1
            oldest.force_close()

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
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


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        status: Callable[[], dict],
        *,
        max_connections: int = 64,
        request_timeout_s: float = 10.0,
    ) -> None:
        """max_connections: open connections at most (the least recently active is closed past it);
        request_timeout_s: a request must begin within this many seconds of the connection opening or of
        the previous response, else the connection is closed."""
        if max_connections < 1:
            raise ValueError(f"HealthServer max_connections={max_connections} must be at least 1")
        if not request_timeout_s > 0:
            raise ValueError(f"HealthServer request_timeout_s={request_timeout_s} must be a positive number")
        self.status = status
        self.max_connections, self.request_timeout_s = max_connections, request_timeout_s
        self._routes = {"/health": self._health, "/status": self._status, "/metrics": self._metrics}
        self._loop = uvloop.new_event_loop()  # libuv's loop: the node's one asyncio server, on its own thread
        self._runner: web.ServerRunner | None = None
        self._server: _GuardedServer | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(host, port), name="health", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"health server did not start on {host}:{port}")
        if self._start_error is not None:
            raise RuntimeError(
                f"health server could not listen on {host}:{port}: {self._start_error}; "
                "choose a free --health-port (0 = any)"
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

    def _run(self, host: str, port: int) -> None:
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
        )
        self._runner = web.ServerRunner(self._server, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=LISTEN_BACKLOG)
        await site.start()
        addrs = self._runner.addresses
        self.port = int(addrs[0][1])

    async def _dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        server, conn = self._server, request.protocol
        assert server is not None
        server.request_started(conn)
        try:
            route = self._routes.get(request.path)
            if route is None:
                return web.json_response(
                    {"error": f"no such path {request.path!r}; try /health, /status or /metrics"}, status=404
                )
            if request.method not in ("GET", "HEAD"):
                return web.json_response(
                    {"error": f"{request.method} is not supported; use GET"},
                    status=405,
                    headers={"Allow": "GET"},
                )
            return await route()
        finally:
            server.request_finished(conn)

    async def _health(self) -> web.Response:
        s = self.status()
        return web.json_response({"status": "ok", "peer_id": s.get("peer_id"), "state": s.get("state")})

    async def _status(self) -> web.Response:
        return web.json_response(self.status())

    async def _metrics(self) -> web.Response:
        return web.Response(text=_prometheus(self.status()), content_type="text/plain")

    def close(self, timeout_s: float = 5.0) -> None:
        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

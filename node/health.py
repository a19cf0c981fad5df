"""Health and metrics over HTTP (aiohttp on its own event loop thread).

GET /health  -> {"status": "ok", "peer_id": ..., "state": ...}
GET /status  -> the node's advert fields and the current assignment's live metrics (JSON)
GET /metrics -> the same numbers in Prometheus text format
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from aiohttp import web


def _prometheus(status: dict) -> str:
    lines = []
    for k, v in sorted(status.get("metrics", {}).items()):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        lines.append(f"crucible_{k} {v}")
    return "\n".join(lines) + "\n"


class HealthServer:
    def __init__(self, host: str, port: int, status: Callable[[], dict]) -> None:
        self.status = status
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, args=(host, port), name="health", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"health server did not start on {host}:{port}")

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, host, port)
        self._loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    async def _health(self, _: web.Request) -> web.Response:
        s = self.status()
        return web.json_response({"status": "ok", "peer_id": s.get("peer_id"), "state": s.get("state")})

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=_prometheus(self.status()), content_type="text/plain")

    def close(self, timeout_s: float = 5.0) -> None:
        async def _stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

"""Health and metrics over HTTP (protocol/process/http_server.py: capped connections, a deadline per request).

GET /health  -> {"status": "ok", "peer_id": ..., "state": ...}
GET /status  -> the node's advert fields, its assignment, the last one it ignored and why
                (`ignored_assignment`: superseded by a newer epoch, or its run is over), and the current
                assignment's live metrics (JSON; losses named with their units: train_loss_bits_per_token,
                validation_loss_bits_per_byte)
GET /metrics -> Prometheus text format (node/metrics.py)
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from protocol.process.http_server import GuardedHTTPServer, check_query
from protocol.process.metrics import CONTENT_TYPE


class HealthServer(GuardedHTTPServer):
    def __init__(
        self,
        host: str,
        port: int,
        status: Callable[[], dict],
        metrics: Callable[[], bytes] | None = None,
        *,
        max_connections: int = 64,
        request_timeout_s: float = 10.0,
    ) -> None:
        """status: the /status dict; metrics: the /metrics text (default: none yet)."""
        self.status = status
        self.metrics = metrics or (lambda: b"")
        super().__init__(
            host,
            port,
            {"/health": self._health, "/status": self._status, "/metrics": self._metrics},
            name="health",
            port_flag="--health-port",
            max_connections=max_connections,
            request_timeout_s=request_timeout_s,
        )

    async def _health(self, request: web.BaseRequest) -> web.Response:
        check_query(request, set())
        s = self.status()
        return web.json_response({"status": "ok", "peer_id": s.get("peer_id"), "state": s.get("state")})

    async def _status(self, request: web.BaseRequest) -> web.Response:
        check_query(request, set())
        return web.json_response(self.status())

    async def _metrics(self, request: web.BaseRequest) -> web.Response:
        check_query(request, set())
        return web.Response(body=self.metrics(), headers={"Content-Type": CONTENT_TYPE})

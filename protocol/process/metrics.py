"""Prometheus exposition shared by the node's and the coordinator's /metrics.

Each process renders its figures at scrape time from the state it already keeps (no second copy of the
numbers to drift): a collector function yields metric families, `render` turns them into the text format
with prometheus_client. Names follow Prometheus conventions: `crucible_` prefix, base units in the name
(`_seconds`, `_bytes`, `_ratio`), counters end in `_total`, and what varies (run, replica, stage, peer,
operation, reason) is a label, not part of the name.

The families both roles expose live here, so they are named once: object-store requests, rejected
inputs by source and reason, and the HTTP server's own counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from protocol.net.store import ObjectStore
from protocol.process.http_server import GuardedHTTPServer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Families = Callable[[], Iterable[Metric]]


class _Collector(Collector):
    def __init__(self, families: Families) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return list(self.families())


def render(families: Families) -> bytes:
    """The text exposition of what `families` yields now."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(families))
    return generate_latest(registry)


def gauge(
    name: str, doc: str, value: float | None, labels: Mapping[str, str] | None = None
) -> GaugeMetricFamily:
    """One gauge sample (no sample when value is None: unknown is absent, not 0)."""
    labels = labels or {}
    g = GaugeMetricFamily(name, doc, labels=list(labels))
    if value is not None:
        g.add_metric(list(labels.values()), float(value))
    return g


def store_families(store: ObjectStore | None) -> list[Metric]:
    """Object-store requests by operation and outcome, their latency, and bytes moved."""
    requests = CounterMetricFamily(
        "crucible_store_requests", "S3 API calls by operation and outcome", labels=["operation", "outcome"]
    )
    latency = SummaryMetricFamily(
        "crucible_store_request_seconds", "time spent in S3 API calls, by operation", labels=["operation"]
    )
    moved = CounterMetricFamily(
        "crucible_store_bytes", "object-store payload bytes by direction", labels=["direction"]
    )
    if store is not None:
        calls, seconds = store.ops.snapshot()
        per_op: dict[str, int] = {}
        for (op, outcome), n in sorted(calls.items()):
            requests.add_metric([op, outcome], n)
            per_op[op] = per_op.get(op, 0) + n
        for op, n in sorted(per_op.items()):
            latency.add_metric([op], count_value=n, sum_value=seconds.get(op, 0.0))
        moved.add_metric(["up"], store.bytes_up)
        moved.add_metric(["down"], store.bytes_down)
    return [requests, latency, moved]


def rejected_family(by_source: Mapping[str, Mapping[str, int]]) -> CounterMetricFamily:
    """crucible_rejected_inputs_total{source, reason}: inputs refused (bad records, hellos, fragments,
    untrusted signers, bad HTTP requests), so an operator sees an attack or a misconfiguration."""
    fam = CounterMetricFamily(
        "crucible_rejected_inputs",
        "inputs refused, by where they came from and why",
        labels=["source", "reason"],
    )
    for source, reasons in sorted(by_source.items()):
        for reason, n in sorted(reasons.items()):
            fam.add_metric([source, reason], n)
    return fam


def http_families(server: GuardedHTTPServer | None) -> list[Metric]:
    """The HTTP server's own requests and the connections it closed to protect itself."""
    served = CounterMetricFamily(
        "crucible_http_requests", "HTTP requests answered, by route", labels=["route"]
    )
    closed = CounterMetricFamily(
        "crucible_http_connections_closed",
        "connections closed by the server: over the connection cap (dropped) or no request in time",
        labels=["reason"],
    )
    if server is not None:
        for route, n in sorted(server.requests.items()):
            served.add_metric([route], n)
        closed.add_metric(["dropped"], server.dropped)
        closed.add_metric(["timed_out"], server.timed_out)
    return [served, closed]


__all__ = [
    "CONTENT_TYPE",
    "Families",
    "gauge",
    "http_families",
    "rejected_family",
    "render",
    "store_families",
]

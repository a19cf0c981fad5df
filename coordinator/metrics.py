"""The coordinator's Prometheus metrics (GET /metrics on the dashboard port), rendered at scrape time from
the tick's snapshot: the runs it leads with their live figures (coordinator/run_figures.py), the nodes it
sees by state, what it did (leases, placements, rebuilds, ticks, runs whose handling failed), its store
requests and refused inputs (store keys that do not count for a run's term among them)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protocol.process.http_server import GuardedHTTPServer
from protocol.process.metrics import gauge, http_families, rejected_family, store_families

if TYPE_CHECKING:
    from coordinator.service import Coordinator

LN2 = math.log(2)
_RUN_GAUGES = (
    # sample field -> (metric name, help, factor from the sample's unit to the name's)
    ("step", "crucible_run_step", "inner steps done (the furthest node)", 1.0),
    ("tokens_per_s", "crucible_run_tokens_per_second", "measured tokens/s summed over replicas", 1.0),
    ("effective_mfu", "crucible_run_effective_mfu_ratio", "tokens/s x FLOPs/token / placed peak FLOP/s", 1.0),
    ("tax", "crucible_run_low_bandwidth_tax_ratio", "1 - effective MFU / achievable MFU of a tuned stage", 1.0),
    ("usd_per_mtok", "crucible_run_cost_usd_per_million_tokens", "placed nodes' $/h over measured tokens", 1.0),
    # the sample's loss is in nats per token (coordinator/run_figures.py)
    ("loss", "crucible_run_train_loss_bits_per_token", "mean training loss of the replicas' last stages, bits per token", 1 / LN2),
    ("val_bpb", "crucible_run_validation_loss_bits_per_byte", "mean validation loss, bits per byte of text", 1.0),
    ("bytes_pipe", "crucible_run_pipeline_bytes", "pipeline bytes moved by the nodes' current assignments", 1.0),
    ("bytes_store", "crucible_run_store_bytes", "object-store bytes moved by the nodes' current assignments", 1.0),
    ("nodes_training", "crucible_run_nodes_training", "placed nodes reporting training", 1.0),
)  # fmt: skip


def coordinator_families(coord: Coordinator, http: GuardedHTTPServer | None) -> Iterable[Metric]:
    view = coord.view
    yield gauge(
        "crucible_coordinator_info", "this coordinator (value 1)", 1, {"peer": coord.identity.peer_id}
    )
    events = CounterMetricFamily("crucible_coordinator_events", "what the coordinator did", labels=["event"])
    for name in (
        "ticks",
        "tick_failures",
        "run_failures",
        "leases_taken",
        "leases_lost",
        "placements",
        "rebuilds",
    ):
        events.add_metric([name], coord.events[name])
    yield events
    states = GaugeMetricFamily("crucible_runs", "runs seen in the DHT, by state", labels=["state"])
    for state, n in sorted(Counter(r["state"] for r in view["runs"].values()).items()):
        states.add_metric([state], n)
    yield states
    nodes = GaugeMetricFamily("crucible_nodes", "nodes advertising in the DHT, by state", labels=["state"])
    for state, n in sorted(Counter(a["state"] for a in view["nodes"].values()).items()):
        nodes.add_metric([state], n)
    yield nodes
    led = {rid: r for rid, r in view["runs"].items() if r["led_here"]}
    term = GaugeMetricFamily(
        "crucible_run_term", "lease term this coordinator holds for the run", labels=["run"]
    )
    predicted = GaugeMetricFamily(
        "crucible_run_predicted_tokens_per_second", "the planner's tokens/s for the placement", labels=["run"]
    )
    for rid, r in sorted(led.items()):
        term.add_metric([rid], r["term"])
        if r["prediction"]:
            predicted.add_metric([rid], r["prediction"]["tokens_per_s"])
    yield term
    yield predicted
    for field, name, doc, factor in _RUN_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["run"])
        for rid, r in sorted(led.items()):
            value = (r["latest"] or {}).get(field)
            if value is not None:
                fam.add_metric([rid], value * factor)
        yield fam
    yield from store_families(coord.store)
    rejected = {
        "dht_record": dict(coord.dht.rejected),
        "signer": dict(coord.refusals.by_reason),
        "store_key": dict(coord.ignored.by_reason),
        "http": dict(http.rejected) if http else {},
    }
    yield rejected_family(rejected)
    yield from http_families(http)


__all__ = ["coordinator_families"]

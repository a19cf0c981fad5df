"""The node's Prometheus metrics (GET /metrics on the health port), rendered at scrape time.

Training figures carry the labels run, replica and stage; link figures add the neighbour's peer id. A
node's WorkerMetrics start at zero with each assignment, while a Prometheus counter must only grow for a
given label set: `NodeMetrics.retire` adds a finished assignment's counts to running totals, and a
scrape reports totals + the live assignment.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from node.sync.pair_sync import PAIR_OUTCOMES
from node.worker import WorkerMetrics
from protocol.process.metrics import gauge, http_families, rejected_family, store_families

Labels = tuple[str, str, str]
"""(run, replica, stage) as label values."""

_COUNTERS: dict[str, tuple[str, str]] = {
    # WorkerMetrics field -> (metric name without _total, help)
    "tokens": ("crucible_tokens", "tokens this stage trained on"),
    "compute_s": ("crucible_compute_seconds", "seconds of forward/backward compute"),
    "pipe_wait_s": ("crucible_link_stall_seconds", "seconds the stage waited on its pipeline links"),
    "sync_wait_s": ("crucible_fragment_wait_seconds", "seconds the stage waited on outer-sync fragments"),
    "rounds": ("crucible_outer_rounds", "outer rounds completed"),
}
_FRAGMENT_OUTCOMES = {
    "fragments_rejected": "rejected",
    "fragments_missing": "missing",
    "fragments_not_uploaded": "not_uploaded",
    "fragments_late_committed": "late_committed",
    "fragments_late_expired": "late_expired",
}


_ROUTING = ("steps", "wait_s", "settle_s", "bytes_up", "bytes_down", "rejected", "missing", "not_published")
"""WorkerMetrics.routing's figures (MoE runs: the routing statistics' per-step barrier)."""


def _labels(m: WorkerMetrics) -> Labels:
    return (m.run_id, str(m.replica), str(m.stage))


@dataclass
class _Totals:
    counters: Counter[str] = field(default_factory=Counter)
    link_bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(peer, direction) -> bytes."""


def _counts(m: WorkerMetrics) -> _Totals:
    t = _Totals()
    for name in (*_COUNTERS, *_FRAGMENT_OUTCOMES):
        t.counters[name] = getattr(m, name)
    for outcome in PAIR_OUTCOMES:
        t.counters[f"pair_{outcome}"] = m.pair_exchanges.get(outcome, 0)
    for name in _ROUTING:
        t.counters[f"routing_{name}"] = m.routing.get(name, 0)  # type: ignore[assignment]  # wait_s: float
    for peer, (sent, recv) in m.link_bytes.items():
        t.link_bytes[(peer, "sent")] += sent
        t.link_bytes[(peer, "received")] += recv
    return t


class NodeMetrics:
    """Counters over the node's life, by (run, replica, stage); the node calls `retire` when it drops
    an assignment's WorkerMetrics for a new one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._retired: dict[Labels, _Totals] = {}

    def retire(self, m: WorkerMetrics) -> None:
        if not m.run_id:
            return
        done = _counts(m)
        with self._lock:
            t = self._retired.setdefault(_labels(m), _Totals())
            t.counters.update(done.counters)
            t.link_bytes.update(done.link_bytes)

    def totals(self, live: WorkerMetrics) -> dict[Labels, _Totals]:
        with self._lock:
            out = {k: _Totals(Counter(v.counters), Counter(v.link_bytes)) for k, v in self._retired.items()}
        if live.run_id:
            now = _counts(live)
            t = out.setdefault(_labels(live), _Totals())
            t.counters.update(now.counters)
            t.link_bytes.update(now.link_bytes)
        return out


_RUN_LABELS = ("run", "replica", "stage")
"""The labels of every figure of an assignment (`Labels`)."""


def _host_families(status: dict) -> Iterable[Metric]:
    """What the node measured of its host: device, peak FLOP/s, free memory, store and peer links."""
    yield gauge(
        "crucible_node_info",
        "this node: peer id, device, state (value 1)",
        1,
        {"peer": status["peer_id"], "device": status["device"], "state": status["state"]},
    )
    tflops = GaugeMetricFamily(
        "crucible_node_peak_flops", "measured dense matmul FLOP/s by dtype", labels=["dtype"]
    )
    tflops.add_metric(["fp32"], status["tflops_fp32"] * 1e12)
    tflops.add_metric(["bf16"], status["tflops_bf16"] * 1e12)
    yield tflops
    yield gauge(
        "crucible_node_free_memory_bytes", "accelerator memory free now", status["free_memory_gb"] * 1e9
    )
    yield gauge(
        "crucible_store_upload_bandwidth_bytes_per_second",
        "measured upload bandwidth to the object store",
        status["store_mbps"] * 1e6 / 8,
    )
    bw = GaugeMetricFamily(
        "crucible_peer_bandwidth_bytes_per_second",
        "measured bandwidth to a peer (probe)",
        labels=["peer"],
    )
    rtt = GaugeMetricFamily(
        "crucible_peer_rtt_seconds", "measured round-trip time to a peer", labels=["peer"]
    )
    for peer, link in sorted(status["links"].items()):
        bw.add_metric([peer], link["mbps"] * 1e6 / 8)
        rtt.add_metric([peer], link["rtt_ms"] / 1e3)
    yield bw
    yield rtt


def _assignment_families(live: WorkerMetrics) -> Iterable[Metric]:
    """The gauges of the live assignment (families without samples when the node has none)."""
    step = GaugeMetricFamily(
        "crucible_step", "inner steps done in the current assignment", labels=_RUN_LABELS
    )
    total = GaugeMetricFamily("crucible_total_steps", "inner steps the run trains for", labels=_RUN_LABELS)
    loss = GaugeMetricFamily(
        "crucible_train_loss_bits_per_token",
        "last training loss of a replica's last stage, bits per token",
        labels=_RUN_LABELS,
    )
    bpb = GaugeMetricFamily(
        "crucible_validation_loss_bits_per_byte",
        "last validation loss, bits per byte of text",
        labels=_RUN_LABELS,
    )
    tps = GaugeMetricFamily(
        "crucible_tokens_per_second", "training throughput of this stage", labels=_RUN_LABELS
    )
    weights = GaugeMetricFamily(
        "crucible_round_contribution_tokens",
        "tokens each replica's contribution to the last applied round claimed (signed, bounded by its shape)",
        labels=[*_RUN_LABELS, "contributor"],
    )
    if live.run_id:
        lv = list(_labels(live))
        step.add_metric(lv, live.step)
        total.add_metric(lv, live.total_steps)
        if live.train_loss_bits_per_token is not None:
            loss.add_metric(lv, live.train_loss_bits_per_token)
        if live.validation_loss_bits_per_byte is not None:
            bpb.add_metric(lv, live.validation_loss_bits_per_byte)
        tps.add_metric(lv, live.tokens_per_s)
        for contributor, tokens in live.round_tokens.items():
            weights.add_metric([*lv, contributor], tokens)
    load = GaugeMetricFamily(
        "crucible_expert_load_ratio",
        "MoE: max / mean tokens per expert of a layer in the last step (scope run: the agreed load of "
        "every replica; local: this replica's own)",
        labels=[*_RUN_LABELS, "layer", "scope"],
    )
    if live.run_id:
        for scope, by_layer in (("run", live.expert_load), ("local", live.expert_load_local)):
            for layer, ratio in sorted(by_layer.items()):
                load.add_metric([*lv, layer, scope], ratio)
    yield from (step, total, loss, bpb, tps, weights, load)


def _counter_families(totals: dict[Labels, _Totals]) -> Iterable[Metric]:
    """The counters over the node's life (`NodeMetrics.totals`), by (run, replica, stage)."""
    for fieldname, (name, doc) in _COUNTERS.items():
        fam = CounterMetricFamily(name, doc, labels=_RUN_LABELS)
        for lv3, t in sorted(totals.items()):
            fam.add_metric(list(lv3), t.counters[fieldname])
        yield fam
    frags = CounterMetricFamily(
        "crucible_fragments", "peer fragments by outcome", labels=[*_RUN_LABELS, "outcome"]
    )
    link = CounterMetricFamily(
        "crucible_link_bytes",
        "pipeline bytes by neighbour and direction",
        labels=[*_RUN_LABELS, "peer", "direction"],
    )
    pairs = CounterMetricFamily(
        "crucible_pair_exchanges",
        "butterfly pair exchanges by outcome (sync.topology = butterfly)",
        labels=[*_RUN_LABELS, "outcome"],
    )
    routing_wait = CounterMetricFamily(
        "crucible_routing_wait_seconds",
        "MoE: seconds the stage waited for the routing statistics' agreed sets (the per-step barrier)",
        labels=_RUN_LABELS,
    )
    routing_bytes = CounterMetricFamily(
        "crucible_routing_bytes",
        "MoE: bytes of routing statistics to and from the store",
        labels=[*_RUN_LABELS, "direction"],
    )
    routing_records = CounterMetricFamily(
        "crucible_routing_records",
        "MoE: per-step routing records by outcome (steps: agreed sets applied)",
        labels=[*_RUN_LABELS, "outcome"],
    )
    for lv3, t in sorted(totals.items()):
        c = t.counters
        routing_wait.add_metric(list(lv3), c["routing_wait_s"])
        routing_bytes.add_metric([*lv3, "up"], c["routing_bytes_up"])
        routing_bytes.add_metric([*lv3, "down"], c["routing_bytes_down"])
        for outcome in ("steps", "rejected", "missing", "not_published"):
            routing_records.add_metric([*lv3, outcome], c[f"routing_{outcome}"])
    yield from (routing_wait, routing_bytes, routing_records)
    for lv3, t in sorted(totals.items()):
        for fieldname, outcome in _FRAGMENT_OUTCOMES.items():
            frags.add_metric([*lv3, outcome], t.counters[fieldname])
        for outcome in PAIR_OUTCOMES:
            pairs.add_metric([*lv3, outcome], t.counters[f"pair_{outcome}"])
        for (peer, direction), n in sorted(t.link_bytes.items()):
            link.add_metric([*lv3, peer, direction], n)
    yield frags
    yield pairs
    yield link


def node_families(
    status: dict,
    live: WorkerMetrics,
    node_metrics: NodeMetrics,
    *,
    store: object | None,
    rejected: dict[str, dict[str, int]],
    http: object | None,
) -> Callable[[], Iterable[Metric]]:
    """The families of one scrape (status: the node's /status dict)."""

    def families() -> Iterable[Metric]:
        yield from _host_families(status)
        yield from _assignment_families(live)
        yield from _counter_families(node_metrics.totals(live))
        yield from store_families(store)  # type: ignore[arg-type]
        yield rejected_family(rejected)
        yield from http_families(http)  # type: ignore[arg-type]

    return families


__all__ = ["NodeMetrics", "node_families"]

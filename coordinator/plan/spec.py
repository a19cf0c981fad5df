"""The planner's view of a run spec: the settings placement and predictions use for it."""

from __future__ import annotations

from coordinator.plan.inputs import RunSettings
from protocol.runspec import RunSpec

WIRE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FRAME_HEADER_BYTES = 32 + 4
"""protocol/codecs/subspace.py's activation header (32) and the frame length prefix (4)."""


def sync_compression_ratio(spec: RunSpec) -> float:
    """Dense fp32 bytes / bytes on the wire of one outer-sync fragment: 1 for DiLoCo's dense fp32;
    SparseLoCo's expected ratio for the largest stage (protocol.codecs.sparseloco_format.ratio)."""
    if spec.sync.method != "sparseloco":
        return 1.0
    from protocol.codecs.sparseloco import SparseLoCoConfig
    from protocol.codecs.sparseloco_format import ratio

    m, s = spec.model, spec.sync
    d, f, V = m.d_model, m.d_ff, m.vocab
    layer = [(d,), (d, d), (d, d), (d, d), (d, d), (d,), (f, d), (f, d), (d, f)]  # node/model.py Block
    best = 0.0
    ranges = spec.layer_ranges()
    for i, (a, b) in enumerate(ranges):
        shapes = layer * (b - a)
        shapes += [(V, d)] if i == 0 else []
        shapes += [(d,), (V, d)] if i == len(ranges) - 1 else []
        best = max(best, ratio(shapes, SparseLoCoConfig(chunk=s.chunk, k=s.k, beta=s.beta)))
    return best


def run_settings(spec: RunSpec, ceiling: float) -> RunSettings:
    """The planner's settings for a run spec: its schedule, link width and wire dtype, sync cadence, and
    an MoE run's routing delay."""
    d, S = spec.model.d_model, spec.stages
    link_k = list(spec.pipeline.link_k) or [d] * (S - 1)
    # a link sends min(link_k[b:]) columns (node/subspace_model.py); the planner takes one k: the widest
    wire_k = [min(link_k[b:]) for b in range(S - 1)]
    return RunSettings(
        microbatches=spec.train.microbatches,
        microbatch_size=spec.train.batch_size // spec.train.microbatches,
        schedule="1f1b",
        extra_in_flight=spec.pipeline.extra_in_flight,
        k=max(wire_k, default=d),
        ceiling=ceiling,
        H=spec.sync.H,
        fragments=spec.sync.P,
        tau=spec.sync.tau,
        compression_ratio=sync_compression_ratio(spec),
        topology=spec.sync.topology,
        bytes_per_value=WIRE_BYTES[spec.pipeline.wire_dtype],
        header_bytes=FRAME_HEADER_BYTES,
        stats_delay=spec.model.moe.stats_delay,
    )

"""Layout: who serves which stage, and how many layers each stage owns.

Per-stage work (FLOPs per token), parameters and memory of a layer split; the layer split balanced by
each stage's speed and memory; and the simple fastest-first layout the `plan` CLI uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from coordinator.plan.inputs import (
    ATTENTION_COEF_FLASH,
    MEMORY_HEADROOM,
    Host,
    ModelShape,
    RunSettings,
)
from protocol import memory


@dataclass(kw_only=True, frozen=True)
class Layout:
    """Who serves what: R replicas x S stages of hosts, and the layer range every stage s owns."""

    replicas: tuple[tuple[Host, ...], ...]
    """replicas[r][s] is the host of stage s in replica r."""
    layers: tuple[int, ...]
    """Layers per stage, shared by all replicas (so fragments match across replicas); sums to L."""
    link_mbps: tuple[tuple[float, ...], ...] = ()
    """Measured bandwidth of each boundary, link_mbps[r][i] for stage i -> i + 1 of replica r, Mbit/s
    each direction; empty: the smaller of the two hosts' `link_mbps`."""
    link_rtt_ms: tuple[tuple[float, ...], ...] = ()
    """Measured round trip of each boundary, like `link_mbps`; empty: the larger of the two hosts' `rtt_ms`."""

    def __post_init__(self) -> None:
        S = len(self.layers)
        for name in ("link_mbps", "link_rtt_ms"):
            rows = getattr(self, name)
            if rows and (len(rows) != len(self.replicas) or any(len(row) != S - 1 for row in rows)):
                raise ValueError(
                    f"layout {name} must give each of {len(self.replicas)} replicas {S - 1} links"
                )
        if any(x <= 0 for row in self.link_mbps for x in row) or any(
            x < 0 for row in self.link_rtt_ms for x in row
        ):
            raise ValueError("layout link_mbps must be > 0 and link_rtt_ms >= 0")


def stage_work(
    shape: ModelShape, layers: tuple[int, ...], attention_coef: float = ATTENTION_COEF_FLASH
) -> list[float]:
    """Model FLOPs per token executed by each stage; sums to shape.flops_per_token().

    A layer costs 6 P_layer + coef d s, P_layer its active parameters (an MoE block's top_k experts), and
    the last stage adds the head's 6 x head_params. The 6 V d
    that the convention charges the input embedding is not executed by any stage (a lookup), so it is
    spread over stages pro rata: the ceiling is calibrated in model FLOPs, and charging it all to
    stage 0 would give stage 0 two fewer layers of Llama-3-8B than it can carry.
    """
    work = [_blocks_work(shape, a, n, attention_coef) for a, n in zip(_starts(layers), layers, strict=True)]
    work[-1] += 6.0 * shape.head_params
    scale = shape.flops_per_token(attention_coef) / sum(work)
    return [w * scale for w in work]


def _starts(layers: tuple[int, ...] | list[int]) -> list[int]:
    """First layer of each stage."""
    return [sum(layers[:s]) for s in range(len(layers))]


def _blocks_work(shape: ModelShape, start: int, n: int, attention_coef: float) -> float:
    """FLOPs per token of blocks [start, start + n): 6 P_active + coef d s each, dense and MoE blocks
    counted by kind (a dense model's is n x the dense block's, as it always was)."""
    attention = attention_coef * shape.d_model * shape.seq_len
    m = shape.moe_blocks(start, start + n)
    work = (n - m) * (6.0 * shape.layer_params + attention)
    if m:
        work += m * (6.0 * shape.block_params(moe=True, active=True) + attention)
    return work


def balance_layers(
    shape: ModelShape,
    stage_tflops: list[float],
    stage_memory_gb: list[float] | None = None,
    *,
    state_bytes_per_param: float | None = None,
    activations: RunSettings | None = None,
) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's time, given each stage's (slowest) peak.

    Greedy: every stage starts with one layer, each further layer goes to the stage that would be
    fastest after taking it, among the stages that still fit 90% of `stage_memory_gb` (0 or None:
    unlimited). What must fit: the parameter state, `state_bytes_per_param` per parameter (None:
    `RunSettings().state_bytes_per_param()`, 27); with `activations` given, the stage's whole training
    memory under those settings instead (`stage_memory_bytes`: state, bf16 copies and the activations of
    the microbatches in flight, which grow with S on the first stages). Optimal for min-max over
    increasing costs. An MoE shape's leading dense blocks (`first_dense`) are costed where the split so
    far puts them.
    """
    S = len(stage_tflops)
    if not 1 <= S <= shape.n_layers:
        raise ValueError(f"stages must be between 1 and n_layers={shape.n_layers} (got {S})")
    head = 6.0 * shape.head_params
    mem = stage_memory_gb or [0.0] * S
    per_param = (
        RunSettings().state_bytes_per_param() if state_bytes_per_param is None else state_bytes_per_param
    )
    layers = [1] * S

    def fits(s: int, n: int) -> bool:
        if not mem[s]:
            return True
        start = sum(layers[:s])
        if activations is not None:
            need = float(_stage_memory(shape, start, n, s, S, activations))
        else:
            need = _stage_param_count(shape, start, n, s, S) * per_param
        return need <= MEMORY_HEADROOM * mem[s] * memory.GB

    what = "training memory (activations included)" if activations is not None else "memory"
    if not all(fits(s, 1) for s in range(S)):
        raise ValueError(f"one layer per stage does not fit the {what} of {S} stages; use more stages")
    for _ in range(shape.n_layers - S):
        starts = _starts(layers)
        cost = [
            (_blocks_work(shape, starts[s], n + 1, ATTENTION_COEF_FLASH) + (head if s == S - 1 else 0.0))
            / stage_tflops[s]
            if fits(s, n + 1)
            else math.inf
            for s, n in enumerate(layers)
        ]
        if min(cost) == math.inf:
            raise ValueError(f"{shape.n_layers} layers do not fit the {what} of {S} stages; use more stages")
        layers[cost.index(min(cost))] += 1
    return tuple(layers)


def _stage_param_count(shape: ModelShape, start: int, n: int, s: int, S: int) -> int:
    """Parameters of stage s of S holding blocks [start, start + n): the embedding on the first, the
    head on the last."""
    return (
        shape.blocks_params(start, start + n)
        + (shape.vocab * shape.d_model if s == 0 else 0)
        + (shape.head_params if s == S - 1 else 0)
    )


def stage_params(shape: ModelShape, layers: tuple[int, ...]) -> list[int]:
    """Parameters each stage owns (and syncs): its layers (every expert), the embedding on the first,
    the head on the last."""
    out = [shape.blocks_params(a, a + n) for a, n in zip(_starts(layers), layers, strict=True)]
    out[0] += shape.vocab * shape.d_model
    out[-1] += shape.head_params
    return out


def stage_memory_bytes(shape: ModelShape, layers: tuple[int, ...], settings: RunSettings) -> list[int]:
    """Peak memory of each stage as a node trains it (protocol/memory.py): bf16 state with one bf16
    weight copy per step (the step's microbatches share one autocast region), plus activations without
    recomputation. Grouped-query
    attention is counted as full attention (an upper bound)."""
    starts, S = _starts(layers), len(layers)
    return [_stage_memory(shape, starts[s], n, s, S, settings) for s, n in enumerate(layers)]


def _stage_memory(shape: ModelShape, start: int, n: int, s: int, S: int, settings: RunSettings) -> int:
    """`stage_memory_bytes` of stage s of S holding blocks [start, start + n) (one stage: the layer
    balance asks often). An MoE block's activations are protocol.memory's per-block estimate."""
    per_param = memory.bytes_per_param(
        "bf16", method="sparseloco", captured_share=settings.captured_share(), graphs=0
    )
    last = s == S - 1
    matmul = shape.blocks_matrix_params(start, start + n) + (shape.head_params - shape.d_model if last else 0)
    per_layer = (
        [
            memory.block_activation_bytes_per_token(shape.model_spec, i, "bf16")
            for i in range(start, start + n)
        ]
        if shape.moe_blocks(start, start + n)
        else None
    )
    act = memory.activation_bytes(
        layers=n,
        tokens=settings.microbatch_size * shape.seq_len,
        d_model=shape.d_model,
        d_ff=shape.d_ff,
        vocab=shape.vocab,
        alive=settings.in_flight(S, s),
        last=last,
        precision="bf16",
        per_layer=per_layer,
    )
    n_params = _stage_param_count(shape, start, n, s, S)
    return round(n_params * per_param) + memory.BYTES_PER_PARAM["autocast_copy"] * matmul + act


def naive_layout(
    shape: ModelShape, hosts: list[Host], replicas: int, stages: int, settings: RunSettings | None = None
) -> Layout:
    """A simple placement for the CLI: fastest hosts first, stage s of every replica on similar hosts.

    Hosts are sorted by peak (then price); the first R x S are used, stage s gets the s-th group of R
    so the shared layer split (`balance_layers` on each stage's slowest host) wastes little. The split
    fits each stage's whole training memory under `settings` (default RunSettings()) where it can, else
    only its parameter state (`predict` then warns about the activations). Real placement also weighs
    bandwidth; this only needs to be reasonable.
    """
    return _layout(shape, hosts, replicas, stages, settings or RunSettings(), activations_must_fit=False)


def _layout(
    shape: ModelShape,
    hosts: list[Host],
    replicas: int,
    stages: int,
    settings: RunSettings,
    *,
    activations_must_fit: bool,
) -> Layout:
    if replicas < 1 or stages < 1:
        raise ValueError(f"replicas and stages must be >= 1 (got {replicas} x {stages})")
    if replicas * stages > len(hosts):
        raise ValueError(
            f"{replicas} replicas x {stages} stages need {replicas * stages} hosts; the pool has {len(hosts)}"
        )
    ranked = sorted(hosts, key=lambda h: (-h.peak_tflops, h.usd_per_hour / h.gpus))[: replicas * stages]
    groups = [ranked[s * replicas : (s + 1) * replicas] for s in range(stages)]
    tflops = [min(h.peak_tflops for h in g) for g in groups]
    mem = [min(h.memory_gb for h in g) for g in groups]
    try:
        layers = balance_layers(shape, tflops, mem, activations=settings)
    except ValueError:
        if activations_must_fit:
            raise
        layers = balance_layers(shape, tflops, mem, state_bytes_per_param=settings.state_bytes_per_param())
    return Layout(
        replicas=tuple(tuple(groups[s][r] for s in range(stages)) for r in range(replicas)), layers=layers
    )


def auto_stages(shape: ModelShape, hosts: list[Host], settings: RunSettings | None = None) -> int:
    """Fewest stages S for which `naive_layout` with R = hosts // S fits every stage's memory: its whole
    training memory (activations of the microbatches in flight included) where some S allows that, else
    its parameter state alone (`predict` then warns about the activations)."""
    settings = settings or RunSettings()
    top = min(shape.n_layers, len(hosts))
    for activations_must_fit in (True, False):
        for S in range(1, top + 1):
            try:
                _layout(shape, hosts, len(hosts) // S, S, settings, activations_must_fit=activations_must_fit)
                return S
            except ValueError:
                continue
    raise ValueError("the model's parameter state does not fit the pool at any stage count")

"""Planner: one cost model for tokens/s, effective MFU, low-bandwidth tax and $/Mtok of a topology.

The CLI (`crucible-coordinator plan`) prints it; placement scores candidate topologies with it. Units:
seconds, bits/s as Mbit/s (1e6), bytes, FLOPs; `peak` is dense bf16 tensor FLOP/s (accelerators.py).

Definitions (DESIGN section 7)::

    effective MFU = tokens/s x FLOPs/token / (sum of peak FLOP/s of every placed GPU)
    tax           = 1 - MFU / ceiling            # ceiling: achievable MFU of a tuned local stage (0.65)
    $/Mtok        = (sum of $/h) / (tokens/s x 3600) x 1e6

FLOPs/token convention (`ModelShape.flops_per_token`)::

    F = 6 N + 14 L d s

N counts *every* parameter, input embedding and (untied) LM head included; L layers, d model width,
s sequence length. 6N is the matmul work of forward + backward (2N + 4N). 14 L d s is attention's
QK^T and AV (4 L d s forward, non-causal count) times 3.5, FlashAttention's forward+backward accounting
(its backward recomputes the scores: 2.5x forward). How it was chosen: Test Run 003 (Llama-3-8B shape,
N = 8.03e9, s = 4096, 48 A100 at 312 TFLOP/s, 130.1K tokens/s) gives

    6N + 14 L d s -> F = 55.70 GFLOP -> MFU 48.39%, tax 25.56%   (published: 48.3%, 25.6%)
    6N + 12 L d s -> F = 54.62 GFLOP -> MFU 47.45%, tax 27.00%   (PaLM appendix B / nanoGPT)

PaLM's 12 L d s lands within 2% on MFU but 5.5% off on the tax, so the FlashAttention count is the
default and `attention_coef=12` gives PaLM's. The sequence length of Test Run 003 is not published;
s = 4096 reproduces it (s = 8192 would give 54.9%).
"""

from __future__ import annotations

import functools
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coordinator.accelerators import get_accelerator, peak_tflops
from protocol import memory
from protocol.runspec import ModelSpec
from protocol.schema import SchemaError, from_dict

ATTENTION_COEF_FLASH = 14.0
ATTENTION_COEF_PALM = 12.0
MEMORY_HEADROOM = 0.9
"""Share of a host's memory a stage may plan to use (as protocol.memory.fits)."""


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """A Llama-style decoder: RMSNorm, GQA attention, SwiGLU MLP, RoPE (no learned positions)."""

    n_layers: int
    """L, transformer blocks."""
    d_model: int
    """d, residual width (the pipeline boundary width, the k of a dense link)."""
    n_heads: int
    """Query heads; head dim = d / n_heads."""
    n_kv_heads: int
    """Key/value heads (GQA); equal to n_heads for plain multi-head attention."""
    d_ff: int
    """SwiGLU hidden width (three d x d_ff matrices)."""
    vocab: int
    """V, vocabulary size."""
    seq_len: int
    """s, tokens per sequence."""
    tied_embeddings: bool = False
    """LM head shares the input embedding matrix (Llama-3 does not)."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1 (got {getattr(self, name)})")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model d_model={self.d_model} must divide by n_heads={self.n_heads}, "
                f"and n_heads by n_kv_heads={self.n_kv_heads}"
            )

    @property
    def layer_params(self) -> int:
        """Wq, Wo (d x d) + Wk, Wv (d x kv_dim) + SwiGLU (3 d d_ff) + two RMSNorm gains."""
        d, kv_dim = self.d_model, self.d_model // self.n_heads * self.n_kv_heads
        return 2 * d * d + 2 * d * kv_dim + 3 * d * self.d_ff + 2 * d

    @property
    def head_params(self) -> int:
        """Final RMSNorm, plus the LM head when it is not tied to the embedding."""
        return self.d_model + (0 if self.tied_embeddings else self.vocab * self.d_model)

    @property
    def n_params(self) -> int:
        """N, all parameters, embeddings included."""
        return self.n_layers * self.layer_params + self.vocab * self.d_model + self.head_params

    @classmethod
    def from_spec(cls, model: ModelSpec) -> ModelShape:
        """The shape of a run spec's [model] (node/model.py): plain multi-head attention, untied head."""
        return cls(
            n_layers=model.n_layers,
            d_model=model.d_model,
            n_heads=model.n_heads,
            n_kv_heads=model.n_heads,
            d_ff=model.d_ff,
            vocab=model.vocab,
            seq_len=model.seq_len,
        )

    def flops_per_token(self, attention_coef: float = ATTENTION_COEF_FLASH) -> float:
        """F = 6 N + attention_coef x L d s (module docstring: 14 FlashAttention, 12 PaLM)."""
        return 6.0 * self.n_params + attention_coef * self.n_layers * self.d_model * self.seq_len


MODELS: dict[str, ModelShape] = {
    # Llama-3-8B (Meta, 2024): 8.03e9 parameters, untied head; s = 4096 reproduces Test Run 003.
    "8b": ModelShape(
        n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=128256, seq_len=4096
    ),
    # Qwen2-72B shape (72.7e9 parameters; its small q/k/v biases are left out), at s = 4096.
    "72b": ModelShape(
        n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=29568, vocab=152064, seq_len=4096
    ),
    # The project's CPU model (DESIGN section 8): 3.3e6 parameters, byte-level vocab.
    "tiny": ModelShape(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, d_ff=688, vocab=256, seq_len=256),
}


def get_model(name: str) -> ModelShape:
    """A preset from MODELS; raises ValueError naming the presets."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)} (example: --model 8b)")
    return MODELS[name]


# ---------------------------------------------------------------------------------------------- pool
@dataclass(kw_only=True, frozen=True)
class HostGroup:
    """`count` identical hosts; one host serves one stage (its GPUs shard the stage locally)."""

    name: str
    """Label used in reports, e.g. `a100-eu`."""
    count: int = 1
    """Number of identical hosts in the group."""
    gpus: int = 1
    """Accelerators per host."""
    accelerator: str = ""
    """Key in accelerators.ACCELERATORS (e.g. `a100-80gb`); may be empty when `tflops` is given."""
    tflops: float = 0.0
    """Measured peak TFLOP/s per accelerator; overrides the table when > 0."""
    memory_gb: float = 0.0
    """Memory per accelerator in GB; 0 takes the table's figure."""
    usd_per_gpu_hour: float
    """Rental price per accelerator-hour."""
    link_mbps: float
    """Bandwidth to pipeline neighbours, each direction, Mbit/s; a link gets the smaller of its two ends."""
    rtt_ms: float
    """Round-trip time to pipeline neighbours; a link gets the larger of its two ends."""
    store_mbps: float
    """Bandwidth to the object store, each direction, Mbit/s."""

    def __post_init__(self) -> None:
        where = f"host group {self.name!r}"
        if not self.name:
            raise ValueError('host group needs a non-empty name (example: name = "a100-eu")')
        if self.count < 1 or self.gpus < 1:
            raise ValueError(f"{where}: count and gpus must be >= 1 (got {self.count}, {self.gpus})")
        if self.tflops < 0 or self.memory_gb < 0 or self.usd_per_gpu_hour < 0 or self.rtt_ms < 0:
            raise ValueError(f"{where}: tflops, memory_gb, usd_per_gpu_hour and rtt_ms must be >= 0")
        if self.link_mbps <= 0 or self.store_mbps <= 0:
            raise ValueError(f"{where}: link_mbps and store_mbps must be > 0 (example: link_mbps = 1000)")
        if self.accelerator:
            get_accelerator(self.accelerator)  # raises with the list of known names
        elif self.tflops <= 0:
            raise ValueError(f'{where}: give `accelerator` (example: "a100-80gb") or a measured `tflops`')


@dataclass(kw_only=True, frozen=True)
class Host:
    """One machine of the pool, per-host totals (a stage's compute, memory and price)."""

    name: str
    gpus: int
    peak_tflops: float
    memory_gb: float
    usd_per_hour: float
    link_mbps: float
    rtt_ms: float
    store_mbps: float


@dataclass(kw_only=True, frozen=True)
class Pool:
    """The machines available to a run, as written in `pool.toml` (`[[hosts]]` tables)."""

    hosts: tuple[HostGroup, ...]
    """Host groups; names must be unique."""

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ValueError("pool has no hosts: add at least one [[hosts]] table")
        names = [g.name for g in self.hosts]
        if len(set(names)) != len(names):
            raise ValueError(f"pool host group names must be unique (got {names})")

    def expand(self, usd_per_gpu_hour: float | None = None) -> list[Host]:
        """One Host per machine; `usd_per_gpu_hour` overrides every group's price (what-if pricing)."""
        out = []
        for g in self.hosts:
            per_gpu = g.tflops if g.tflops > 0 else peak_tflops(g.accelerator)
            mem = g.memory_gb or (get_accelerator(g.accelerator).memory_gb if g.accelerator else 0.0)
            price = g.usd_per_gpu_hour if usd_per_gpu_hour is None else usd_per_gpu_hour
            for i in range(g.count):
                out.append(
                    Host(
                        name=f"{g.name}#{i}",
                        gpus=g.gpus,
                        peak_tflops=per_gpu * g.gpus,
                        memory_gb=mem * g.gpus,
                        usd_per_hour=price * g.gpus,
                        link_mbps=g.link_mbps,
                        rtt_ms=g.rtt_ms,
                        store_mbps=g.store_mbps,
                    )
                )
        return out


def load_pool(path: str | Path) -> Pool:
    """Read a pool TOML file; every problem is a ValueError that names the file and the field."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read pool file {str(path)!r}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"pool file {str(path)!r} is not valid TOML: {e}") from e
    try:
        return from_dict(Pool, data)
    except SchemaError as e:
        raise ValueError(f"pool file {str(path)!r}: {e}") from e


# ------------------------------------------------------------------------------------------ settings
@dataclass(kw_only=True, frozen=True)
class RunSettings:
    """Schedule and wire parameters of a run (symbols as in DESIGN sections 3-4)."""

    microbatches: int = 16
    """M, microbatches per inner step and replica (gradient accumulation)."""
    microbatch_size: int = 1
    """b, sequences per microbatch."""
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """1F1B keeps S (+ extra_in_flight) microbatches in flight; GPipe keeps all M (more memory)."""
    extra_in_flight: int = 0
    """1F1B warm-up microbatches beyond S at stage 0: activation memory spent to cover link round trips."""
    k: int | None = None
    """Subspace rank on every link; None chooses the largest k that hides behind compute, per link."""
    k_min: int = 32
    """Floor of the automatic k, taken even when it does not fit (quality guard; node0 runs 8B at k=40)."""
    fill_share: float = 0.02
    """Share of a step the automatic k may spend on fill/drain serialization (2 (S-1) t_x per step,
    paid in every schedule: the first microbatch's messages are on the critical path)."""
    ceiling: float = 0.65
    """Achievable MFU of a tuned local stage (Team PyTorch at IBM and Meta, 2024, on A100)."""
    H: int = 30
    """Inner steps per outer round."""
    fragments: int = 4
    """P, fragments a stage's parameters are streamed in."""
    tau: int = 2
    """Inner steps of overlap between a fragment's capture and its application (0 <= tau < H)."""
    compression_ratio: float = 200.0
    """SparseLoCo dense-fp32 bytes / bytes on the wire (DESIGN goal >= 200)."""
    bytes_per_value: int = 2
    """Activation dtype on the wire (bf16)."""
    token_id_bytes: int | None = None
    """Per token id sent with a compressed payload; None: the smallest uint holding the vocab (1, 2, 4)."""
    header_bytes: int = 256
    """Per message framing, signature and shape header."""

    def state_bytes_per_param(self) -> float:
        """Bytes per parameter a stage must hold, from protocol/memory.py's table: bf16 autocast (fp32
        weights, grads, AdamW; one bf16 copy), SparseLoCo anchor and error feedback, captured theta of the
        fragments pending under tau. 27 at the defaults (tau = 2 of H = 30, P = 4: a quarter pending).
        A limit on layers per stage; activations come on top (`predict` warns about them)."""
        return memory.bytes_per_param("bf16", method="sparseloco", captured_share=self.captured_share())

    def captured_share(self) -> float:
        """Share of a stage's parameters held as captured theta (protocol.memory.captured_share)."""
        return memory.captured_share(self.H, self.fragments, self.tau)

    def in_flight(self, S: int, s: int) -> int:
        """Microbatch graphs alive at once on stage s of S: the schedule's warm-up forwards + 1 (1F1B,
        `warmup_forwards`), or all M (GPipe)."""
        if self.schedule == "gpipe":
            return self.microbatches
        return min(warmup_forwards(S, s, self.extra_in_flight) + 1, self.microbatches)

    def __post_init__(self) -> None:
        if min(self.microbatches, self.microbatch_size, self.H, self.fragments, self.bytes_per_value) < 1:
            raise ValueError("microbatches, microbatch_size, H, fragments and bytes_per_value must be >= 1")
        if not 0 <= self.tau < self.H:
            raise ValueError(f"tau must satisfy 0 <= tau < H (got tau={self.tau}, H={self.H})")
        if self.fragments > self.H:
            raise ValueError(f"fragments P={self.fragments} must be <= H={self.H} (q = floor(H/P) >= 1)")
        if (self.k is not None and self.k < 1) or self.k_min < 1 or self.extra_in_flight < 0:
            raise ValueError(f"k and k_min must be >= 1, extra_in_flight >= 0 (got {self.k}, {self.k_min})")
        if not 0 < self.ceiling <= 1 or self.compression_ratio <= 0 or not 0 < self.fill_share <= 1:
            raise ValueError("ceiling and fill_share must be in (0, 1], compression_ratio > 0")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'gpipe' (got {self.schedule!r})")


# ------------------------------------------------------------------------------------------- links
def activation_bytes(
    *,
    k: int,
    d_model: int,
    tokens: int,
    bytes_per_value: int = 2,
    token_id_bytes: int = 4,
    header_bytes: int = 256,
) -> int:
    """Bytes of one boundary message (one microbatch, one direction).

    k < d sends Z = (X - T[x]) U, (b, L, k), plus the token ids that rebuild T[x] on the far side;
    k = d sends X itself, no ids needed. The backward message (G_Z = G_X U) has the same size.
    """
    if k >= d_model:
        return tokens * d_model * bytes_per_value + header_bytes
    return tokens * (k * bytes_per_value + token_id_bytes) + header_bytes


def id_bytes(vocab: int) -> int:
    """Bytes of the smallest unsigned integer that holds a token id (uint8, uint16 or uint32)."""
    return 1 if vocab <= 1 << 8 else 2 if vocab <= 1 << 16 else 4


def transfer_s(n_bytes: float, mbps: float) -> float:
    """Serialization time of `n_bytes` on a `mbps` Mbit/s link (latency excluded)."""
    return n_bytes * 8.0 / (mbps * 1e6)


def choose_k(
    *,
    d_model: int,
    tokens: int,
    bandwidth_mbps: float,
    compute_s: float,
    bytes_per_value: int = 2,
    token_id_bytes: int = 4,
    header_bytes: int = 256,
    multiple_of: int = 8,
) -> int | None:
    """Largest k (least compression) whose message serializes within `compute_s`; None if none fits.

    With nested bases (the first k columns of one seeded U) any k <= d is valid, so this is the
    closed form of bytes(k) * 8 / bandwidth <= compute_s, rounded down to a multiple of `multiple_of`
    (tensor-core friendly shapes). Returns d when the dense tensor already fits. Placement calls it per
    link with the replica's pipeline slot (its slowest stage's compute time per microbatch).
    """
    wire = dict(bytes_per_value=bytes_per_value, token_id_bytes=token_id_bytes, header_bytes=header_bytes)
    budget = compute_s * bandwidth_mbps * 1e6 / 8.0  # bytes that fit in the compute time
    if activation_bytes(k=d_model, d_model=d_model, tokens=tokens, **wire) <= budget:
        return d_model
    k = math.floor(((budget - header_bytes) / tokens - token_id_bytes) / bytes_per_value)
    k -= k % multiple_of  # k < d here: a dense tensor costs no more than k = d - 1 plus token ids
    return k if k >= 1 else None


# ---------------------------------------------------------------------------------------- layout
@dataclass(kw_only=True, frozen=True)
class Layout:
    """Who serves what: R replicas x S stages of hosts, and the layer range every stage s owns."""

    replicas: tuple[tuple[Host, ...], ...]
    """replicas[r][s] is the host of stage s in replica r."""
    layers: tuple[int, ...]
    """Layers per stage, shared by all replicas (so fragments match across replicas); sums to L."""


def stage_work(
    shape: ModelShape, layers: tuple[int, ...], attention_coef: float = ATTENTION_COEF_FLASH
) -> list[float]:
    """Model FLOPs per token executed by each stage; sums to shape.flops_per_token().

    A layer costs 6 P_layer + coef d s and the last stage adds the head's 6 x head_params. The 6 V d
    that the convention charges the input embedding is not executed by any stage (a lookup), so it is
    spread over stages pro rata: the ceiling is calibrated in model FLOPs, and charging it all to
    stage 0 would give stage 0 two fewer layers of Llama-3-8B than it can carry.
    """
    per_layer = 6.0 * shape.layer_params + attention_coef * shape.d_model * shape.seq_len
    work = [n * per_layer for n in layers]
    work[-1] += 6.0 * shape.head_params
    scale = shape.flops_per_token(attention_coef) / sum(work)
    return [w * scale for w in work]


def balance_layers(
    shape: ModelShape,
    stage_tflops: list[float],
    stage_memory_gb: list[float] | None = None,
    *,
    state_bytes_per_param: float | None = None,
) -> tuple[int, ...]:
    """Layers per stage minimising the slowest stage's time, given each stage's (slowest) peak.

    Greedy: every stage starts with one layer, each further layer goes to the stage that would be
    fastest after taking it, among the stages whose state (`state_bytes_per_param` per parameter; None:
    `RunSettings().state_bytes_per_param()`, 27) still fits 90% of `stage_memory_gb` (0 or None:
    unlimited). Optimal for min-max over increasing costs.
    """
    S = len(stage_tflops)
    if not 1 <= S <= shape.n_layers:
        raise ValueError(f"stages must be between 1 and n_layers={shape.n_layers} (got {S})")
    per_layer = 6.0 * shape.layer_params + ATTENTION_COEF_FLASH * shape.d_model * shape.seq_len
    head = 6.0 * shape.head_params
    mem = stage_memory_gb or [0.0] * S
    per_param = (
        RunSettings().state_bytes_per_param() if state_bytes_per_param is None else state_bytes_per_param
    )
    layers = [1] * S

    def fits(s: int, n: int) -> bool:
        trial = tuple(n if i == s else layers[i] for i in range(S))
        return not mem[s] or stage_params(shape, trial)[s] * per_param <= MEMORY_HEADROOM * mem[s] * memory.GB

    if not all(fits(s, 1) for s in range(S)):
        raise ValueError(f"one layer per stage does not fit the memory of {S} stages; use more stages")
    for _ in range(shape.n_layers - S):
        cost = [
            ((n + 1) * per_layer + (head if s == S - 1 else 0.0)) / stage_tflops[s]
            if fits(s, n + 1)
            else math.inf
            for s, n in enumerate(layers)
        ]
        if min(cost) == math.inf:
            raise ValueError(f"{shape.n_layers} layers do not fit the memory of {S} stages; use more stages")
        layers[cost.index(min(cost))] += 1
    return tuple(layers)


def stage_params(shape: ModelShape, layers: tuple[int, ...]) -> list[int]:
    """Parameters each stage owns (and syncs): its layers, the embedding on the first, head on the last."""
    out = [n * shape.layer_params for n in layers]
    out[0] += shape.vocab * shape.d_model
    out[-1] += shape.head_params
    return out


def stage_memory_bytes(shape: ModelShape, layers: tuple[int, ...], settings: RunSettings) -> list[int]:
    """Peak memory of each stage as a node trains it (protocol/memory.py): bf16 state with one bf16
    weight copy per step (the step's microbatches share one autocast region), plus activations without
    recomputation. Grouped-query
    attention is counted as full attention (an upper bound)."""
    S, tokens = len(layers), settings.microbatch_size * shape.seq_len
    per_param = memory.bytes_per_param(
        "bf16", method="sparseloco", captured_share=settings.captured_share(), graphs=0
    )
    out = []
    for s, n_params in enumerate(stage_params(shape, layers)):
        alive = settings.in_flight(S, s)
        matmul = layers[s] * (shape.layer_params - 2 * shape.d_model) + (
            shape.head_params - shape.d_model if s == S - 1 else 0
        )
        act = memory.activation_bytes(
            layers=layers[s],
            tokens=tokens,
            d_model=shape.d_model,
            d_ff=shape.d_ff,
            vocab=shape.vocab,
            alive=alive,
            last=s == S - 1,
            precision="bf16",
        )
        out.append(round(n_params * per_param) + memory.BYTES_PER_PARAM["autocast_copy"] * matmul + act)
    return out


def naive_layout(
    shape: ModelShape, hosts: list[Host], replicas: int, stages: int, settings: RunSettings | None = None
) -> Layout:
    """A simple placement for the CLI: fastest hosts first, stage s of every replica on similar hosts.

    Hosts are sorted by peak (then price); the first R x S are used, stage s gets the s-th group of R
    so the shared layer split (`balance_layers` on each stage's slowest host, with the state bytes of
    `settings`, default RunSettings()) wastes little. Real placement also weighs bandwidth; this only
    needs to be reasonable.
    """
    if replicas < 1 or stages < 1:
        raise ValueError(f"replicas and stages must be >= 1 (got {replicas} x {stages})")
    if replicas * stages > len(hosts):
        raise ValueError(
            f"{replicas} replicas x {stages} stages need {replicas * stages} hosts; the pool has {len(hosts)}"
        )
    ranked = sorted(hosts, key=lambda h: (-h.peak_tflops, h.usd_per_hour / h.gpus))[: replicas * stages]
    groups = [ranked[s * replicas : (s + 1) * replicas] for s in range(stages)]
    layers = balance_layers(
        shape,
        [min(h.peak_tflops for h in g) for g in groups],
        [min(h.memory_gb for h in g) for g in groups],
        state_bytes_per_param=(settings or RunSettings()).state_bytes_per_param(),
    )
    return Layout(
        replicas=tuple(tuple(groups[s][r] for s in range(stages)) for r in range(replicas)), layers=layers
    )


def auto_stages(shape: ModelShape, hosts: list[Host], settings: RunSettings | None = None) -> int:
    """Fewest stages S for which `naive_layout` with R = hosts // S fits every stage's memory."""
    for S in range(1, min(shape.n_layers, len(hosts)) + 1):
        try:
            naive_layout(shape, hosts, len(hosts) // S, S, settings)
            return S
        except ValueError:
            continue
    raise ValueError("the model's parameter state does not fit the pool at any stage count")


# -------------------------------------------------------------------------------------- prediction
@dataclass(kw_only=True, frozen=True)
class LinkPlan:
    """One pipeline boundary of one replica (stage `boundary` -> `boundary + 1`)."""

    replica: int
    boundary: int
    k: int
    bytes_per_microbatch: int
    transfer_s: float
    """Serialization time of one message, each direction (links are full duplex)."""
    rtt_ms: float
    hidden: bool
    """Compute hides the transfer: replayed with this link's messages instantaneous (latency kept),
    the step is shorter by no more than 2 transfer_s, the first forward's and the last backward's,
    which no schedule can hide."""


@dataclass(kw_only=True, frozen=True)
class Breakdown:
    """Where the placed GPUs' time goes, as fractions of it (sum 1; compute = MFU / ceiling)."""

    compute: float
    """Work at the ceiling, as if perfectly balanced."""
    imbalance: float
    """Faster stages waiting on the replica's slowest stage."""
    bubble: float
    """Pipeline fill and drain, (S-1)/(M+S-1) of a balanced step."""
    link_wait: float
    """Transfers and latency that compute does not hide."""
    sync_wait: float
    """SparseLoCo fragment transfers still in flight when the overlap window closes."""


@dataclass(kw_only=True, frozen=True)
class Prediction:
    """The model's answer for one layout and settings."""

    tokens_per_s: float
    effective_mfu: float
    tax: float
    """1 - MFU / ceiling."""
    usd_per_hour: float
    usd_per_mtok: float
    n_gpus: int
    peak_tflops: float
    """Sum over placed hosts."""
    flops_per_token: float
    layers: tuple[int, ...]
    step_s: tuple[float, ...]
    """Inner-step time of each replica (M microbatches), sync wait included."""
    breakdown: Breakdown
    links: tuple[LinkPlan, ...]
    fragment_transfer_s: float
    """Slowest stage's fragment upload+download time (one fragment, all peers' copies)."""
    overlap_window_s: float
    """tau inner steps of the slowest replica: the time a fragment transfer can hide behind."""
    warnings: tuple[str, ...]


@dataclass(kw_only=True, frozen=True)
class _ReplicaStep:
    seconds: dict[str, float]  # Breakdown field -> seconds per inner step; they sum to step_s
    step_s: float
    links: list[LinkPlan]
    fragment_transfer_s: float


def warmup_forwards(S: int, s: int, extra_in_flight: int = 0) -> int:
    """1F1B warm-up forwards of stage s: S - s - 1, plus extra_in_flight x (S - s - 1) / (S - 1) rounded
    up, so stage 0 keeps S + extra in flight and the last stage none.

    What hides a link is the difference between neighbours: stage s waits on B(i) after F(i) for
    (w_s - w_{s+1}) of its own microbatches, and that must cover the round trip to s + 1. Growing the
    warm-up with the distance to the last stage gives every link its share; adding the same `extra`
    to every non-last stage leaves a difference of 1 except at the last link, so with S >= 3 the other
    links still stall every microbatch (the replay shows it: S = 4, rtt + 2 t_x = t_c / 2, extra 4: a
    period of 1.34 t_c against 1.0).
    """
    if not 0 <= s < S:
        raise ValueError(f"stage {s} is outside 0..{S - 1}")
    return S - s - 1 + math.ceil(extra_in_flight * (S - s - 1) / max(1, S - 1))


def schedule_step(
    f: list[float],
    b: list[float],
    t_x: list[float],
    delay: list[float],
    M: int,
    schedule: Literal["1f1b", "gpipe"] = "1f1b",
    extra_in_flight: int = 0,
) -> float:
    """Seconds of one inner step of one replica: its pipeline schedule replayed op by op.

    f[s], b[s]: forward and backward compute of stage s per microbatch; t_x[l], delay[l]: serialization
    and one-way latency of link l (stage l -> l+1), each direction a FIFO of its own (full duplex).
    Stage s runs node/schedule.py's order: 1F1B does `warmup_forwards(S, s, extra_in_flight)` forwards,
    then alternates forward and backward, then drains; GPipe all forwards, then all backwards. An op starts when its stage is free and its input has arrived; a message starts
    serializing when its op ends and the link direction is free, and arrives t_x + delay later::

        F(s, i) starts at max(stage s free, arrival of activation i from s-1)
        B(s, i) starts at max(stage s free, arrival of gradient i from s+1)   (last stage: its F)
        message: start = max(op end, direction free); arrival = start + t_x + delay

    With ideal links and equal stages this is (M + S - 1)(f + b), the textbook bubble. With slow links
    it is exact where a closed form is not: when the round trip binds, the steady state spends
    (sum t_c + sum (rtt + 2 t_x)) / W per microbatch and the bubble is already inside it.
    Cached: replicas on identical hosts cost one replay.
    """
    return _schedule_step(tuple(f), tuple(b), tuple(t_x), tuple(delay), M, schedule, extra_in_flight)


@functools.lru_cache(maxsize=4096)
def _schedule_step(
    f: tuple[float, ...],
    b: tuple[float, ...],
    t_x: tuple[float, ...],
    delay: tuple[float, ...],
    M: int,
    schedule: str,
    extra_in_flight: int,
) -> float:
    S = len(f)
    order: list[list[tuple[str, int]]] = []
    for s in range(S):
        if schedule == "gpipe":
            order.append([("F", i) for i in range(M)] + [("B", i) for i in range(M)])
            continue
        w = min(M, warmup_forwards(S, s, extra_in_flight))
        ops = [("F", i) for i in range(w)]
        for i in range(w, M):
            ops += [("F", i), ("B", i - w)]
        order.append(ops + [("B", i) for i in range(M - w, M)])
    act: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> when its input activation arrives
    grad: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> when its output gradient arrives
    fwd_free, bwd_free = [0.0] * (S - 1), [0.0] * (S - 1)
    free, nxt = [0.0] * S, [0] * S
    left = sum(len(ops) for ops in order)
    while left:
        moved = False
        for s in range(S):
            while nxt[s] < len(order[s]):
                kind, i = order[s][nxt[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else act.get((s, i))
                else:
                    ready = 0.0 if s == S - 1 else grad.get((s, i))
                if ready is None:
                    break  # waits on a neighbour: try the other stages
                end = max(free[s], ready) + (f[s] if kind == "F" else b[s])
                free[s] = end
                if kind == "F" and s < S - 1:
                    start = max(end, fwd_free[s])
                    fwd_free[s] = start + t_x[s]
                    act[(s + 1, i)] = start + t_x[s] + delay[s]
                elif kind == "B" and s > 0:
                    start = max(end, bwd_free[s - 1])
                    bwd_free[s - 1] = start + t_x[s - 1]
                    grad[(s - 1, i)] = start + t_x[s - 1] + delay[s - 1]
                nxt[s] += 1
                left -= 1
                moved = True
        assert moved, "pipeline schedule deadlocked"  # cannot happen: both orders are deadlock-free
    return max(free)


def _replica_step(
    shape: ModelShape, hosts: tuple[Host, ...], r: int, R: int, layers: tuple[int, ...], settings: RunSettings
) -> _ReplicaStep:
    """One replica's inner step; see `predict` for the formulas."""
    S, M, d = len(hosts), settings.microbatches, shape.d_model
    tokens_mb = settings.microbatch_size * shape.seq_len
    wire = dict(
        bytes_per_value=settings.bytes_per_value,
        token_id_bytes=settings.token_id_bytes or id_bytes(shape.vocab),
        header_bytes=settings.header_bytes,
    )
    work = stage_work(shape, layers)
    t_c = [work[s] * tokens_mb / (hosts[s].peak_tflops * 1e12 * settings.ceiling) for s in range(S)]
    slot = max(t_c)
    rtt = [max(hosts[i].rtt_ms, hosts[i + 1].rtt_ms) / 1e3 for i in range(S - 1)]
    W = min(M, S + settings.extra_in_flight)  # microbatches stage 0 keeps in flight under 1F1B
    budget = slot  # steady state: under GPipe a message only has to keep up with the slot
    if settings.schedule == "1f1b" and S > 1:
        # A microbatch's round trip, sum t_c + sum (rtt + 2 t_x), must fit in W slots; the slack
        # left after compute and latency is shared evenly by the 2 (S-1) messages.
        budget = min(slot, max(0.0, W * slot - sum(t_c) - sum(rtt)) / (2 * (S - 1)))
    fill_cap = settings.fill_share * (M + S - 1) * slot / (2 * max(1, S - 1))
    ks, sizes, t_x = [], [], []
    for i in range(S - 1):  # boundary i: stage i -> i + 1
        mbps = min(hosts[i].link_mbps, hosts[i + 1].link_mbps)
        if settings.k:
            k = min(settings.k, d)
        else:
            fit = choose_k(
                d_model=d, tokens=tokens_mb, bandwidth_mbps=mbps, compute_s=min(budget, fill_cap), **wire
            )
            k = min(max(fit or 0, settings.k_min), d)
        ks.append(k)
        sizes.append(activation_bytes(k=k, d_model=d, tokens=tokens_mb, **wire))
        t_x.append(transfer_s(sizes[-1], mbps))
    # the node's schedule replayed: forward = 1/3 of a microbatch's compute (2N of the 6N FLOPs)
    f, b = [t / 3 for t in t_c], [2 * t / 3 for t in t_c]
    half_rtt = [rt / 2 for rt in rtt]

    def replay(tx: list[float], delay: list[float]) -> float:
        return schedule_step(f, b, tx, delay, M, settings.schedule, settings.extra_in_flight)

    step = replay(t_x, half_rtt)
    step_ideal_links = replay([0.0] * (S - 1), [0.0] * (S - 1))
    links = [
        LinkPlan(
            replica=r,
            boundary=i,
            k=ks[i],
            bytes_per_microbatch=sizes[i],
            transfer_s=t_x[i],
            rtt_ms=rtt[i] * 1e3,
            hidden=step - replay([0.0 if j == i else x for j, x in enumerate(t_x)], half_rtt)
            <= 2 * t_x[i] + 1e-6 * step,
        )
        for i in range(S - 1)
    ]
    # SparseLoCo: every stage streams P fragments per H steps; the stage that blocks longest stalls all.
    sync, t_f_max = 0.0, 0.0
    P, H, tau = settings.fragments, settings.H, settings.tau
    for s, n_params in enumerate(stage_params(shape, layers)):
        t_f = transfer_s(n_params * 4 / settings.compression_ratio / P * max(1, R - 1), hosts[s].store_mbps)
        t_f_max = max(t_f_max, t_f)
        late = P * max(0.0, t_f - tau * step)
        backlog = P * t_f - H * step  # the I/O loop cannot keep up with one fragment every q steps
        sync = max(sync, max(late, backlog, 0.0) / H)
    ideal = (
        M
        * tokens_mb
        * shape.flops_per_token()
        / (sum(h.peak_tflops for h in hosts) * 1e12 * settings.ceiling)
    )
    seconds = dict(
        compute=ideal,
        imbalance=M * slot - ideal,
        bubble=step_ideal_links - M * slot,
        link_wait=step - step_ideal_links,
        sync_wait=sync,
    )
    return _ReplicaStep(seconds=seconds, step_s=step + sync, links=links, fragment_transfer_s=t_f_max)


def predict(shape: ModelShape, layout: Layout, settings: RunSettings) -> Prediction:
    """Predict throughput, MFU, tax and price of `layout` (module docstring for F and the definitions).

    Per replica, with t_c[s] the compute of stage s per microbatch and t_x[l] a link's message time::

        t_c[s]  = work[s] x b s / (peak[s] x ceiling)       # forward t_c / 3, backward 2 t_c / 3
        step    = schedule_step(t_c / 3, 2 t_c / 3, t_x, rtt / 2) + sync_wait   # replayed op by op:
                  (M + S - 1) t_c for balanced stages on ideal links; in steady state a microbatch takes
                  T = max(max t_c, max t_x, (sum t_c + sum (rtt + 2 t_x)) / W), W = S (+extra) in flight
        sync    = max(P max(0, t_f - tau step), P t_f - H step) / H   # per inner step, per stage
        t_f     = params_s x 4 / ratio / P x max(1, R - 1) x 8 / store_bps  # up 1 copy, down R-1

    Replicas never wait on each other (DESIGN section 2), so tokens/s sums over replicas; the
    breakdown weights each replica's seconds by its share of the pool's peak.
    """
    R, S = len(layout.replicas), len(layout.layers)
    if sum(layout.layers) != shape.n_layers or any(len(rep) != S for rep in layout.replicas):
        raise ValueError(f"layout must give every replica {S} stages and sum to {shape.n_layers} layers")
    F = shape.flops_per_token()
    placed = [h for rep in layout.replicas for h in rep]
    peak_total = sum(h.peak_tflops for h in placed)
    steps = [
        _replica_step(shape, hosts, r, R, layout.layers, settings) for r, hosts in enumerate(layout.replicas)
    ]
    parts = dict.fromkeys(("compute", "imbalance", "bubble", "link_wait", "sync_wait"), 0.0)
    for hosts, st in zip(layout.replicas, steps, strict=True):
        weight = sum(h.peak_tflops for h in hosts) / peak_total  # this replica's share of GPU time
        for name, sec in st.seconds.items():
            parts[name] += sec / st.step_s * weight
    tokens_per_s = sum(
        settings.microbatches * settings.microbatch_size * shape.seq_len / st.step_s for st in steps
    )
    usd_per_hour = sum(h.usd_per_hour for h in placed)
    mfu = tokens_per_s * F / (peak_total * 1e12)
    links = [ln for st in steps for ln in st.links]
    t_frag = max(st.fragment_transfer_s for st in steps)
    window = settings.tau * min(st.step_s for st in steps)

    warnings = []
    params = stage_params(shape, layout.layers)
    state = settings.state_bytes_per_param()
    over = [
        h.name
        for rep in layout.replicas
        for s, h in enumerate(rep)
        if params[s] * state > MEMORY_HEADROOM * memory.GB * h.memory_gb > 0
    ]
    if over:
        warnings.append(
            f"stage state exceeds 90% of memory on {len(over)} host(s), e.g. {over[0]}: use more stages"
        )
    need = stage_memory_bytes(shape, layout.layers, settings)
    full = [
        (h, s)
        for rep in layout.replicas
        for s, h in enumerate(rep)
        if h.name not in over and need[s] > MEMORY_HEADROOM * memory.GB * h.memory_gb > 0
    ]
    if full:
        h, s = full[0]
        warnings.append(
            f"with activations (no recomputation, {settings.in_flight(S, s)} microbatches in flight) stage "
            f"memory exceeds 90% on {len(full)} host(s), e.g. {h.name}: stage {s} needs {need[s] / memory.GB:.1f} "
            f"of {h.memory_gb:.0f} GB; lower microbatch_size or extra_in_flight, or use more stages"
        )
    slow = [ln for ln in links if not ln.hidden]
    if slow:
        warnings.append(
            f"{len(slow)} of {len(links)} link messages add to the step (k down to {min(ln.k for ln in slow)}): "
            "add bandwidth, lower k, or (1F1B) raise extra_in_flight to cover the round trips"
        )
    if t_frag > window:
        warnings.append(
            f"fragment transfer {t_frag:.1f} s exceeds the overlap window {window:.1f} s: raise tau or store bandwidth"
        )
    return Prediction(
        tokens_per_s=tokens_per_s,
        effective_mfu=mfu,
        tax=1.0 - mfu / settings.ceiling,
        usd_per_hour=usd_per_hour,
        usd_per_mtok=usd_per_mtok(usd_per_hour, tokens_per_s),
        n_gpus=sum(h.gpus for h in placed),
        peak_tflops=peak_total,
        flops_per_token=F,
        layers=layout.layers,
        step_s=tuple(st.step_s for st in steps),
        breakdown=Breakdown(**parts),
        links=tuple(links),
        fragment_transfer_s=t_frag,
        overlap_window_s=window,
        warnings=tuple(warnings),
    )


def usd_per_mtok(usd_per_hour: float, tokens_per_s: float) -> float:
    """$/Mtok = ($/h) / (tokens/s x 3600) x 1e6."""
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


# -------------------------------------------------------------------------------------- economics
@dataclass(kw_only=True, frozen=True)
class ReferenceCluster:
    """A reserved, tightly interconnected cluster to compare against, matched to our GPU count."""

    usd_per_gpu_hour: float
    """E.g. AWS p4de.24xlarge Capacity Block: $17.712/h / 8 GPUs = $2.214."""
    mfu: float
    """MFU it is assumed to sustain (the seed uses the 65% ceiling: generous to the reference)."""
    peak_tflops_per_gpu: float | None = None
    """Its GPUs' peak; None means the same GPUs as ours."""
    name: str = "reference"

    def __post_init__(self) -> None:
        if self.usd_per_gpu_hour <= 0 or not 0 < self.mfu <= 1:
            raise ValueError("reference needs usd_per_gpu_hour > 0 and 0 < mfu <= 1")
        if self.peak_tflops_per_gpu is not None and self.peak_tflops_per_gpu <= 0:
            raise ValueError("reference peak_tflops_per_gpu must be > 0")

    @classmethod
    def from_instance(
        cls, *, usd_per_hour: float, gpus: int, mfu: float, name: str = "reference"
    ) -> ReferenceCluster:
        """From an instance price, e.g. from_instance(usd_per_hour=17.712, gpus=8, mfu=0.65)."""
        if gpus < 1:
            raise ValueError(f"reference instance needs >= 1 GPU (got {gpus})")
        return cls(usd_per_gpu_hour=usd_per_hour / gpus, mfu=mfu, name=name)


@dataclass(kw_only=True, frozen=True)
class Economics:
    """Unit economics of a throughput, ours against the reference cluster of the same GPU count."""

    tokens_per_s: float
    effective_mfu: float
    tax: float
    usd_per_hour: float
    usd_per_mtok: float
    reference_tokens_per_s: float | None
    """None (like the fields below) when no reference was given."""
    reference_usd_per_mtok: float | None
    saving: float | None
    """1 - ours / reference $/Mtok; positive means we are cheaper."""
    break_even_tokens_per_s: float | None
    """Tokens/s the reference would need to match our $/Mtok."""
    break_even_mfu: float | None


def economics(
    *,
    tokens_per_s: float,
    n_gpus: int,
    peak_tflops_per_gpu: float,
    flops_per_token: float,
    usd_per_gpu_hour: float,
    ceiling: float,
    reference: ReferenceCluster | None = None,
) -> Economics:
    """Economics of a measured (or predicted) throughput (seed 000, "An AWS price comparison")::

        MFU          = tokens/s x F / (n x peak)
        ref tokens/s = tokens/s x ref.mfu / MFU          (x ref.peak / peak for other GPUs)
        break-even   = ref $/h / (our $/Mtok x 3600 / 1e6),  its MFU = break-even x F / (n x ref.peak)

    For a mixed pool pass the means: peak = sum of peaks / n, price = sum of $/h / n.
    """
    if tokens_per_s <= 0 or n_gpus < 1 or peak_tflops_per_gpu <= 0 or flops_per_token <= 0:
        raise ValueError("tokens_per_s, n_gpus, peak_tflops_per_gpu and flops_per_token must be > 0")
    peak = n_gpus * peak_tflops_per_gpu * 1e12
    mfu = tokens_per_s * flops_per_token / peak
    usd_h = n_gpus * usd_per_gpu_hour
    ours = usd_per_mtok(usd_h, tokens_per_s)
    base = dict(
        tokens_per_s=tokens_per_s,
        effective_mfu=mfu,
        tax=1.0 - mfu / ceiling,
        usd_per_hour=usd_h,
        usd_per_mtok=ours,
    )
    if reference is None:
        return Economics(
            **base,
            reference_tokens_per_s=None,
            reference_usd_per_mtok=None,
            saving=None,
            break_even_tokens_per_s=None,
            break_even_mfu=None,
        )
    ref_peak = n_gpus * (reference.peak_tflops_per_gpu or peak_tflops_per_gpu) * 1e12
    ref_tps = reference.mfu * ref_peak / flops_per_token
    ref_usd_h = n_gpus * reference.usd_per_gpu_hour
    ref = usd_per_mtok(ref_usd_h, ref_tps)
    break_even = ref_usd_h / (ours * 3600.0 / 1e6) if ours > 0 else math.inf  # free GPUs: never
    return Economics(
        **base,
        reference_tokens_per_s=ref_tps,
        reference_usd_per_mtok=ref,
        saving=1.0 - ours / ref,
        break_even_tokens_per_s=break_even,
        break_even_mfu=break_even * flops_per_token / ref_peak,
    )

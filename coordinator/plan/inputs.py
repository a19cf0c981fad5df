"""Planner inputs: the model's shape, the pool of hosts, and the run's schedule and wire settings.

What `coordinator/plan/planner.py` reads. Units: seconds, bits/s as Mbit/s (1e6), bytes, FLOPs; `peak` is
dense bf16 tensor FLOP/s (accelerators.py).

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

Mixture of experts (issue 24). An MoE block holds a router (E x d), E experts of 3 d f_e each and an
optional shared SwiGLU of 3 d (shared x f_e); a token goes through top_k experts (and the shared one). So
N in F is N_active, the parameters one token's forward multiplies by (MFU is measured on them), while
memory and SparseLoCo's bytes (it syncs every parameter's pseudo-gradient) count all N. The block
counts are protocol.runspec.ModelSpec's (`mlp_matrix_params`): one formula for the node and the planner.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from coordinator.plan.accelerators import get_accelerator, peak_tflops
from coordinator.plan.schedule import warmup_forwards
from protocol import memory
from protocol.reference_block import REFERENCE_BLOCKS
from protocol.runspec import ModelSpec, MoESpec
from protocol.schema import SchemaError, from_dict

ATTENTION_COEF_FLASH = 14.0
ATTENTION_COEF_PALM = 12.0
MEMORY_HEADROOM = 0.9
"""Share of a host's memory a stage may plan to use (as protocol.memory.fits)."""
STORE_RTT_MS = 30.0
"""Round trip of one small request to the object store in the host's own region: the network's round
trip and the store's service time (an assumption, tens of ms for S3 and R2; not measured by the nodes
yet). A store 9,000 miles away: about 150 ms one way, 300 ms. What the MoE routing barrier pays per
request (planner.route_barrier_s)."""


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """A Llama-style decoder: RMSNorm, GQA attention, SwiGLU MLP, RoPE (no learned positions); with
    `experts` > 0, mixture-of-experts blocks from `first_dense` on (protocol.runspec.MoESpec)."""

    n_layers: int
    """L, transformer blocks."""
    d_model: int
    """d, residual width (the pipeline boundary width, the k of a dense link)."""
    n_heads: int
    """Query heads; head dim = d / n_heads."""
    n_kv_heads: int
    """Key/value heads (GQA); equal to n_heads for plain multi-head attention."""
    d_ff: int
    """SwiGLU hidden width of a dense block (three d x d_ff matrices); an expert's when expert_d_ff is 0."""
    vocab: int
    """V, vocabulary size."""
    seq_len: int
    """s, tokens per sequence."""
    tied_embeddings: bool = False
    """LM head shares the input embedding matrix (Llama-3 does not)."""
    experts: int = 0
    """E, routed experts per MoE block (0: every block is dense)."""
    top_k: int = 0
    """Experts each token is routed to (1..E when experts > 0)."""
    expert_d_ff: int = 0
    """f_e, each expert's SwiGLU width (0: d_ff)."""
    first_dense: int = 0
    """Blocks before this one stay dense; blocks first_dense..L-1 are MoE."""
    shared_experts: int = 0
    """Experts every token also goes through, as one SwiGLU of shared_experts x f_e."""

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1 (got {getattr(self, name)})")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model d_model={self.d_model} must divide by n_heads={self.n_heads}, "
                f"and n_heads by n_kv_heads={self.n_kv_heads}"
            )
        if min(self.experts, self.top_k, self.expert_d_ff, self.first_dense, self.shared_experts) < 0:
            raise ValueError("model experts, top_k, expert_d_ff, first_dense and shared_experts must be >= 0")
        if self.experts and not (1 <= self.top_k <= self.experts and self.first_dense < self.n_layers):
            raise ValueError(
                f"model top_k={self.top_k} must be in 1..experts={self.experts} and first_dense="
                f"{self.first_dense} below n_layers={self.n_layers} (example: experts=256, top_k=8)"
            )

    @property
    def layer_params(self) -> int:
        """A dense block's parameters: Wq, Wo (d x d) + Wk, Wv (d x kv_dim) + SwiGLU (3 d d_ff) + two
        RMSNorm gains. An MoE shape has two kinds of block: `block_params`."""
        return self._attention_params + 3 * self.d_model * self.d_ff + 2 * self.d_model

    @property
    def _attention_params(self) -> int:
        d, kv_dim = self.d_model, self.d_model // self.n_heads * self.n_kv_heads
        return 2 * d * d + 2 * d * kv_dim

    @functools.cached_property
    def model_spec(self) -> ModelSpec:
        """The shape as protocol's ModelSpec, whose formulas own an MoE block's feed-forward parameters
        and activation bytes (`mlp_matrix_params`, protocol.memory.block_activation_bytes_per_token).
        Attention is not read from it: it has no grouped-query heads."""
        return ModelSpec(
            vocab=self.vocab,
            d_model=self.d_model,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            seq_len=self.seq_len,
            moe=MoESpec(
                experts=self.experts,
                top_k=self.top_k if self.experts else 2,
                d_ff=self.expert_d_ff,
                first_dense=self.first_dense,
                shared_experts=self.shared_experts,
            ),
        )

    def moe_blocks(self, start: int, end: int) -> int:
        """How many of blocks [start, end) are MoE (they are blocks first_dense..L-1)."""
        return max(0, end - max(start, self.first_dense)) if self.experts else 0

    def block_params(self, *, moe: bool, active: bool = False) -> int:
        """Parameters of a dense (`moe` False) or an MoE block: attention, feed-forward, two norms;
        active: those one token's forward pass multiplies by (an MoE block's top_k experts of E)."""
        if not moe:
            return self.layer_params
        mlp = self.model_spec.mlp_matrix_params(self.first_dense, active=active)
        return self._attention_params + mlp + 2 * self.d_model

    def blocks_params(self, start: int, end: int, *, active: bool = False) -> int:
        """Parameters of blocks [start, end), all of them or (active) those a token goes through."""
        m = self.moe_blocks(start, end)
        dense = (end - start - m) * self.layer_params
        return dense + m * self.block_params(moe=True, active=active) if m else dense

    def blocks_matrix_params(self, start: int, end: int) -> int:
        """Parameters of blocks [start, end)'s matmul weights: what autocast keeps a bf16 copy of. Not
        the norm gains, nor an MoE router (it scores in fp32; protocol.memory.block_matrix_params)."""
        m = self.moe_blocks(start, end)
        return (
            self.blocks_params(start, end)
            - 2 * self.d_model * (end - start)
            - m * self.experts * self.d_model
        )

    @property
    def head_params(self) -> int:
        """Final RMSNorm, plus the LM head when it is not tied to the embedding."""
        return self.d_model + (0 if self.tied_embeddings else self.vocab * self.d_model)

    @property
    def n_params(self) -> int:
        """N, all parameters, embeddings included: what memory and SparseLoCo's bytes count."""
        return self.blocks_params(0, self.n_layers) + self.vocab * self.d_model + self.head_params

    @property
    def n_active_params(self) -> int:
        """N_active, the parameters one token's forward pass goes through (N for a dense model)."""
        return (
            self.blocks_params(0, self.n_layers, active=True) + self.vocab * self.d_model + self.head_params
        )

    @classmethod
    def from_spec(cls, model: ModelSpec) -> ModelShape:
        """The shape of a run spec's [model] (node/model.py): plain multi-head attention, untied head,
        and its [model.moe] blocks."""
        moe = model.moe
        return cls(
            n_layers=model.n_layers,
            d_model=model.d_model,
            n_heads=model.n_heads,
            n_kv_heads=model.n_heads,
            d_ff=model.d_ff,
            vocab=model.vocab,
            seq_len=model.seq_len,
            experts=moe.experts,
            top_k=moe.top_k if moe.experts else 0,
            expert_d_ff=moe.d_ff if moe.experts else 0,
            first_dense=moe.first_dense if moe.experts else 0,
            shared_experts=moe.shared_experts if moe.experts else 0,
        )

    def flops_per_token(self, attention_coef: float = ATTENTION_COEF_FLASH) -> float:
        """F = 6 N_active + attention_coef x L d s (module docstring: 14 FlashAttention, 12 PaLM)."""
        return 6.0 * self.n_active_params + attention_coef * self.n_layers * self.d_model * self.seq_len


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
    # Shaped like seed 003's MoE (~32B total, an MoE layer in every block, 256 experts, top-8, no shared
    # experts; its widths are not published): 31.95e9 parameters, 2.11e9 active per token. Head dim 128,
    # GQA 16/4, Qwen3's vocabulary; d_ff is the experts' width (no dense block).
    "moe-32b": ModelShape(
        n_layers=48,
        d_model=2048,
        n_heads=16,
        n_kv_heads=4,
        d_ff=408,
        vocab=151936,
        seq_len=4096,
        experts=256,
        top_k=8,
    ),
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
    store_rtt_ms: float = STORE_RTT_MS
    """Round trip of one request to the object store, ms (a store 9,000 miles away: 300)."""

    def __post_init__(self) -> None:
        where = f"host group {self.name!r}"
        if not self.name:
            raise ValueError('host group needs a non-empty name (example: name = "a100-eu")')
        if self.count < 1 or self.gpus < 1:
            raise ValueError(f"{where}: count and gpus must be >= 1 (got {self.count}, {self.gpus})")
        if min(self.tflops, self.memory_gb, self.usd_per_gpu_hour, self.rtt_ms, self.store_rtt_ms) < 0:
            raise ValueError(
                f"{where}: tflops, memory_gb, usd_per_gpu_hour, rtt_ms and store_rtt_ms must be >= 0"
            )
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
    sustained_tflops: float = 0.0
    """What the host sustains on training work (its reference block, `sustained_tflops()`); 0 = not
    measured: then peak x ceiling."""
    store_rtt_ms: float = STORE_RTT_MS
    """Round trip of one request to the object store (HostGroup.store_rtt_ms)."""

    def compute_tflops(self, ceiling: float) -> float:
        """The rate a stage's FLOPs run at on this host: measured if it was, else peak x ceiling."""
        return compute_tflops(self.sustained_tflops, self.peak_tflops, ceiling)


def compute_tflops(sustained: float, peak: float, ceiling: float) -> float:
    """The one rule for a stage's compute rate: the sustained rate where measured, else peak x ceiling."""
    return sustained if sustained > 0 else peak * ceiling


def sustained_tflops(
    ref_block: str, ref_block_s: float, attention_coef: float = ATTENTION_COEF_FLASH
) -> float:
    """TFLOP/s a node sustains on training work, from its advertised reference-block time: the block's
    FLOPs in this planner's convention (6 P_layer + coef d s per token) over the measured seconds
    (protocol/reference_block.py). 0 for an unknown block or no measurement."""
    ref = REFERENCE_BLOCKS.get(ref_block)
    if ref is None or not ref_block_s > 0:
        return 0.0
    per_token = 6.0 * ref.layer_params + attention_coef * ref.d_model * ref.seq_len
    return per_token * ref.tokens / ref_block_s / 1e12


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

    def expand(self, usd_per_gpu_hour: float | None = None, store_rtt_ms: float | None = None) -> list[Host]:
        """One Host per machine; `usd_per_gpu_hour` overrides every group's price and `store_rtt_ms`
        every group's store round trip (what-if pricing, a store in another region)."""
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
                        store_rtt_ms=g.store_rtt_ms if store_rtt_ms is None else store_rtt_ms,
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
    topology: str = "all"
    """`sync.topology`: "all" reads the R - 1 other replicas' fragments per exchange; "butterfly" reads
    one partner's message of twice a fragment (pseudo-gradient and anchor difference) and sends one."""

    def fragment_copies(self, R: int) -> int:
        """Fragments' worth of bytes a stage moves through the store per exchange of one fragment (the
        all-to-all: one up, R - 1 down, the download dominating; butterfly: a message of two, down)."""
        return 2 if self.topology == "butterfly" else max(1, R - 1)

    bytes_per_value: int = 2
    """Activation dtype on the wire (bf16)."""
    token_id_bytes: int | None = None
    """Per token id sent with a compressed payload; None: the smallest uint holding the vocab (1, 2, 4)."""
    header_bytes: int = 256
    """Per message framing, signature and shape header."""
    stats_delay: int = 1
    """D of an MoE run's routing barrier (model.moe.stats_delay): the bias of step t + 1 moves by step
    t + 1 - D's agreed counts, so the barrier's store round trips hide behind D - 1 steps."""

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
        if self.stats_delay < 1:
            raise ValueError(f"stats_delay must be >= 1 (got {self.stats_delay}; 1: a barrier every step)")
        if (self.k is not None and self.k < 1) or self.k_min < 1 or self.extra_in_flight < 0:
            raise ValueError(f"k and k_min must be >= 1, extra_in_flight >= 0 (got {self.k}, {self.k_min})")
        if not 0 < self.ceiling <= 1 or self.compression_ratio <= 0 or not 0 < self.fill_share <= 1:
            raise ValueError("ceiling and fill_share must be in (0, 1], compression_ratio > 0")
        if self.topology not in ("all", "butterfly"):
            raise ValueError(f"topology must be 'all' or 'butterfly' (got {self.topology!r})")
        if self.schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"schedule must be '1f1b' or 'gpipe' (got {self.schedule!r})")

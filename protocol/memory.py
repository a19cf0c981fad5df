"""Memory of a pipeline stage, estimated from the run spec before anything is allocated.

One table of bytes per parameter, owned here and used by the planner, placement and the node's refusal
of assignments that do not fit. A stage trains with AdamW, either in "fp32" (plain float32, the CPU
path) or in "bf16" (bf16 autocast over fp32 master weights and fp32 AdamW state, the CUDA path; see
`node/device.py`). Per parameter the stage holds::

    weights 4 + grads 4 + AdamW (m, v) 8                       # both precisions, fp32
    + autocast copy 2                                          # bf16 only (below)
    + anchor 4 + error feedback 4 (SparseLoCo only)            # outer sync, fp32 on the device
    + captured theta 4 x (share of fragments pending, tau > 0) + outer momentum 4 (outer_momentum > 0)

Autocast copies. A matmul saves the bf16 copy of its weight for the backward. `node/pipeline/schedule.py` runs
a step's microbatches inside one autocast region, whose cache casts each matmul weight once per step, so
however many microbatches are in flight the stage holds one bf16 copy of its matmul weights (the
embedding and the norm gains are not cast). (Measured on an H200: with a region per forward, six
microbatches in flight held six copies, 5.8 GB on an 8B-shaped first stage.)

Activations. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv 2205.05198) count s b h (34 + 5 a s / h) bytes per layer in 16-bit for a GPT layer (GeLU MLP of
width 4h, dropout). The same count, done tensor by tensor for `node/model.py`'s block (no dropout;
SwiGLU of width f = d_ff; `F.scaled_dot_product_attention`, flash or memory-efficient, which keeps q, k,
v, the output and a row log-sum-exp instead of the a s^2 scores, so the 5 a s / h term is gone), gives
per token and layer, with d = d_model::

    bf16:  2 RMSNorms: input 4d + x rsqrt(mean x^2) 4d, both fp32               = 16 d
           bf16 casts of a normed input, one per matmul that reads it (3 + 2)    = 10 d
           q, k (after RoPE), v, attention output, and the output's (b, L, d) copy = 10 d
           SwiGLU: gate, silu(gate), up, silu(gate) * up                        =  8 f    -> 36 d + 8 f
    fp32:  norms 2 x 12 d + q, k, v, output 16 d + SwiGLU 16 f                          -> 40 d + 16 f

The residual stream stays fp32 under autocast (a bf16 matmul output added to an fp32 residual is fp32)
and the RMSNorm arithmetic runs on it in fp32; autocast caches casts of weights only, so each matmul
casts its activation input anew. For the Llama-3-8B shape, f = 3.5 d, that is 64 d in bf16 against
Korthikanti's 34 h: SwiGLU and fp32 norms cost more than GeLU and 16-bit norms.

A stage keeps the activations of every microbatch in flight. Stage s of S under 1F1B with
`extra_in_flight` e (node/pipeline/schedule.py) runs `w = min(S - s - 1 + e, M)` warm-up forwards (0 on the last
stage), so `min(w + 1, M)` microbatch graphs are alive when the first backward runs. Beside its layers a
non-last stage keeps each microbatch's fp32 output (4 d per token); the last stage keeps its final norm
and the fp32 cross-entropy of its one microbatch: log-softmax of the (b, L, V) logits (4 V per token,
saved), plus the fp32 logits copy, their gradients and the head's weight gradient while the loss is
differentiated (~8 V per token, transient). The backward of a layer needs room for the gradients of its
saved tensors: counted as one more layer of one microbatch.

Measured (H200, torch 2.11, eager, fused AdamW; 27 stage configurations of d = 1024 and of the
Llama-3-8B shape, first, middle and last, 1 to 6 microbatches in flight, bf16 and fp32 on CUDA):
`torch.cuda.max_memory_allocated` over a training step is 0.82 to 1.02 times this estimate without the
outer state; at the 8B shape 0.98 to 0.99 (tests/test_memory.py pins some). The CPU's fp32 path (its own
attention kernel) was not measured.

Assumptions: eager mode (`torch.compile` fuses the norms and saves less: this is an upper bound there);
grouped-query attention is counted as full attention (an upper bound); GB = 1e9 bytes; the CUDA context
and the allocator's fragmentation are what `fits`'s headroom is for; the outer sync's capture
temporaries (a fragment's theta and Delta) live between inner steps, when the activations are freed,
and are assumed smaller than them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

from protocol.runspec import ModelSpec, RunSpec

Precision = Literal["fp32", "bf16"]
PRECISIONS: Final = ("fp32", "bf16")
GB: Final = 1e9
"""Bytes per GB, as memory_gb and free_memory_gb in adverts and accelerators.py count them."""

BYTES_PER_PARAM: Final[dict[str, int]] = {
    "weights": 4,  # fp32 weights (the master copy under bf16 autocast)
    "grads": 4,  # fp32 .grad, accumulated over the step's microbatches
    "adamw": 8,  # AdamW exp_avg + exp_avg_sq, fp32
    "muon": 4,  # Muon's momentum buffer, fp32 (train.optimizer = "muon": the blocks' 2-D matrices)
    "autocast_copy": 2,  # bf16 only: autocast's cached bf16 cast of a matmul weight, once per step
    "anchor": 4,  # outer sync: the consensus theta the pseudo-gradient is taken from
    "error_feedback": 4,  # SparseLoCo only: e, what compression has not sent yet
    "captured": 4,  # overlap (tau > 0): theta at capture, kept until the fragment is applied
    "outer_momentum": 4,  # outer Nesterov momentum, when outer_momentum > 0
}
"""The one table of bytes per parameter (module docstring)."""


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} must be 'fp32' or 'bf16' (resolve 'auto' first)")


def precision_for_device(device: str, requested: str = "auto") -> Precision:
    """What a node computes in: `requested` if it is "fp32" or "bf16"; for "auto", "bf16" (autocast over
    fp32 master weights) on a CUDA device ("cuda", "cuda:0", "cuda:NVIDIA H200"), else "fp32".

    The node resolves its run's `train.precision` with this, and the coordinator resolves each advert's
    `device` with it, so both estimate the same memory."""
    if requested in PRECISIONS:
        return requested  # type: ignore[return-value]
    if requested != "auto":
        raise ValueError(f"precision {requested!r} is not one of auto, fp32, bf16")
    return "bf16" if device.strip().lower().startswith("cuda") else "fp32"


def bytes_per_param(
    precision: str,
    *,
    method: str = "sparseloco",
    outer_momentum: float = 0.0,
    captured_share: float = 0.0,
    graphs: int = 1,
) -> float:
    """Bytes per parameter of a stage, activations aside: weights, grads and AdamW (16), the bf16 copies
    of `graphs` microbatch graphs (2 each, bf16 only) and the outer-sync state (`outer_bytes_per_param`).

    bf16, SparseLoCo, no overlap or momentum, one graph: 4 + 4 + 8 + 2 + 4 + 4 = 26."""
    _check_precision(precision)
    t = BYTES_PER_PARAM
    copies = graphs * t["autocast_copy"] if precision == "bf16" else 0
    return (
        t["weights"]
        + t["grads"]
        + t["adamw"]
        + copies
        + outer_bytes_per_param(method, outer_momentum, captured_share)
    )


def outer_bytes_per_param(method: str, outer_momentum: float, captured_share: float) -> float:
    """Outer-sync state per parameter: anchor 4, SparseLoCo error feedback 4, captured theta
    4 x `captured_share`, outer momentum 4 when outer_momentum > 0."""
    if method not in ("diloco", "sparseloco"):
        raise ValueError(f"sync method {method!r} must be 'diloco' or 'sparseloco'")
    t = BYTES_PER_PARAM
    return (
        t["anchor"]
        + (t["error_feedback"] if method == "sparseloco" else 0)
        + t["captured"] * captured_share
        + (t["outer_momentum"] if outer_momentum > 0 else 0)
    )


def captured_share(H: int, P: int, tau: int) -> float:
    """Share of a stage's parameters held as captured theta during the inner steps.

    Fragment f is captured at c_f = (f + 1) q, q = floor(H / P), and applied tau steps later
    (node/sync/outer_sync.py); captures come every q steps, so at most ceil(tau / q) of the P fragments (each
    ~1/P of the parameters, dealt round-robin) are pending at once. tau = 0 applies at capture: none."""
    if tau <= 0:
        return 0.0
    q = max(1, H // P)
    return min(P, math.ceil(tau / q)) / P


def in_flight(S: int, s: int, extra_in_flight: int, M: int) -> int:
    """Microbatch graphs alive at once on stage s of S under 1F1B (node/pipeline/schedule.py)::

    w = 0 on the last stage, else min(S - s - 1 + extra_in_flight, M);  alive = min(w + 1, M)
    """
    if not 0 <= s < S:
        raise ValueError(f"stage {s} is outside 0..{S - 1}")
    w = 0 if s == S - 1 else min(S - s - 1 + extra_in_flight, M)
    return min(w + 1, M)


def layer_activation_bytes_per_token(d_model: int, d_ff: int, precision: str) -> int:
    """Bytes one dense transformer block keeps per token for its backward: 36 d + 8 f in bf16, 40 d + 16 f
    in fp32 (module docstring)."""
    _check_precision(precision)
    return 36 * d_model + 8 * d_ff if precision == "bf16" else 40 * d_model + 16 * d_ff


def block_activation_bytes_per_token(model: ModelSpec, layer: int, precision: str) -> int:
    """Bytes block `layer` keeps per token for its backward. A dense block: as above. An MoE block
    (node/sync/expert_bias.py) counts as a dense one whose SwiGLU is as wide as the experts a token visits, top_k + the
    shared width, plus, per routed visit, the token's gathered input and weighted output (2 d, fp32) and
    the router's fp32 logits, scores and choice (12 E). An estimate from the tensors, not yet measured."""
    d = model.d_model
    if not model.is_moe_layer(layer):
        return layer_activation_bytes_per_token(d, model.d_ff, precision)
    moe, f = model.moe, model.expert_d_ff
    width = (moe.top_k + moe.shared_experts) * f
    return layer_activation_bytes_per_token(d, width, precision) + moe.top_k * 8 * d + 12 * moe.experts


def activation_bytes(
    *,
    layers: int,
    tokens: int,
    d_model: int,
    d_ff: int,
    vocab: int,
    alive: int,
    last: bool,
    precision: str,
    per_layer: list[int] | None = None,
) -> int:
    """Activation memory of a stage of `layers` blocks with `alive` microbatches of `tokens` (b L) in
    flight (module docstring)::

        alive x tokens x (sum of the blocks' bytes + 4 d if not last)   # saved tensors, fp32 stage output
        + tokens x the largest block's                                   # backward workspace of one layer
        + tokens x (final norm + 12 V)                  if last         # fp32 cross-entropy of one microbatch

    per_layer: each block's bytes per token (`block_activation_bytes_per_token`); None: `layers` dense
    blocks of width d_ff."""
    if per_layer is None:
        per_layer = [layer_activation_bytes_per_token(d_model, d_ff, precision)] * layers
    out = 0 if last else 4 * d_model
    act = alive * tokens * (sum(per_layer) + out) + tokens * max(per_layer, default=0)
    if last:
        norm = 10 * d_model if precision == "bf16" else 12 * d_model  # as a block's norm
        act += tokens * (norm + 12 * vocab)
    return act


def layer_params(d_model: int, d_ff: int) -> int:
    """Parameters of one dense block as node/model.py builds it: Wq, Wk, Wv, Wo (4 d^2), SwiGLU (3 d d_ff),
    two RMSNorm gains (2 d). A block of a model spec, MoE or not: `ModelSpec.layer_params`."""
    return 4 * d_model * d_model + 3 * d_model * d_ff + 2 * d_model


def stage_params(spec: RunSpec, stage: int, replica: int | None = None) -> int:
    """Parameters stage `stage` of `replica`'s split (None: the run's own) owns (and syncs): its layers,
    the embedding (V d) on the first stage, the final norm (d) and the untied LM head (V d) on the last;
    sums to spec.model.n_params."""
    return _stage_params(spec, stage, replica)[0]


def block_matrix_params(spec: RunSpec, start: int, end: int) -> int:
    """Parameters of blocks [start, end)'s 2-D matrices (attention 4 d^2, the SwiGLU MLP or the experts'):
    what autocast casts in a block, and what Muon trains under train.optimizer = "muon". An MoE block's
    router (E x d) is neither: it scores in fp32 and trains with AdamW (node/sync/expert_bias.py)."""
    m = spec.model
    d = m.d_model
    return sum(
        4 * d * d + m.mlp_matrix_params(i) - (m.moe.experts * d if m.is_moe_layer(i) else 0)
        for i in range(start, end)
    )


def _stage_params(spec: RunSpec, stage: int, replica: int | None = None) -> tuple[int, int]:
    """(all parameters, parameters of matmul weights, the ones autocast casts) of one stage."""
    ranges = spec.layer_ranges(replica)
    S = len(ranges)
    if not 0 <= stage < S:
        raise ValueError(f"stage {stage} is outside 0..{S - 1} of a {S}-stage replica")
    m = spec.model
    d, V = m.d_model, m.vocab
    start, end = ranges[stage]
    params = sum(m.layer_params(i) for i in range(start, end))
    matmul = block_matrix_params(spec, start, end)
    if stage == 0:
        params += V * d  # embedding: a lookup, never cast
    if stage == S - 1:
        params += d + V * d  # final norm + LM head
        matmul += V * d
    return params, matmul


@dataclass(frozen=True)
class StageMemory:
    """Estimated peak memory of one stage, in bytes, by component (module docstring)."""

    stage: int
    precision: Precision
    weights: int
    grads: int
    optimizer: int
    """AdamW exp_avg and exp_avg_sq; under Muon, its momentum for the blocks' matrices."""
    autocast_copies: int
    """bf16 copies of the matmul weights, one per step (0 in fp32)."""
    outer_state: int
    """Anchor, error feedback, captured theta, outer momentum."""
    activations: int
    """Saved tensors of the microbatches in flight, plus the last stage's logits."""
    optimizer_name: str = "AdamW"
    """How `describe` names the optimizer state ("Muon + AdamW" under train.optimizer = "muon")."""

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.autocast_copies
            + self.outer_state
            + self.activations
        )

    def describe(self) -> str:
        """`38.2 GB (weights 4.1, grads 4.1, AdamW 8.2, outer state 8.2, activations 13.6)`: zero parts
        are left out; under 1 GB with three decimals."""
        parts = [
            ("weights", self.weights),
            ("grads", self.grads),
            (self.optimizer_name, self.optimizer),
            ("bf16 copies", self.autocast_copies),
            ("outer state", self.outer_state),
            ("activations", self.activations),
        ]
        digits = 1 if self.total >= GB else 3  # a CPU-sized stage still shows its parts
        inner = ", ".join(f"{name} {b / GB:.{digits}f}" for name, b in parts if b)
        return f"{self.total / GB:.{digits}f} GB ({inner})"


def stage_memory(spec: RunSpec, stage: int, precision: str, replica: int | None = None) -> StageMemory:
    """Estimated peak memory of stage `stage` of `spec`'s `replica` (None: of the run's own split, with the
    most microbatches any replica runs) trained in `precision` ("fp32" or "bf16").

    Microbatch: b = train.batch_size / train.microbatches sequences of L = model.seq_len tokens; in flight:
    `in_flight(S, stage, pipeline.extra_in_flight, M)` with the replica's M (`RunSpec.microbatches_of`);
    outer state from [sync] (method, tau, P, H, outer_momentum)."""
    _check_precision(precision)
    m, sync = spec.model, spec.sync
    params, matmul = _stage_params(spec, stage, replica)
    ranges = spec.layer_ranges(replica)
    start, end = ranges[stage]
    each = range(spec.replicas) if replica is None else [replica]
    S, M = len(ranges), max(spec.microbatches_of(r) for r in each)
    alive = in_flight(S, stage, spec.pipeline.extra_in_flight, M)
    t = BYTES_PER_PARAM
    share = captured_share(sync.H, sync.P, sync.tau)
    muon = spec.train.optimizer == "muon"
    blocks = block_matrix_params(spec, start, end) if muon else 0  # Muon's matrices: one buffer, not two
    optimizer = params * t["adamw"] - blocks * (t["adamw"] - t["muon"])
    return StageMemory(
        stage=stage,
        precision=precision,  # type: ignore[arg-type]
        weights=params * t["weights"],
        grads=params * t["grads"],
        optimizer=optimizer,
        # node/pipeline/schedule.py runs a step's microbatches in one autocast region: one cached copy per step
        autocast_copies=matmul * t["autocast_copy"] if precision == "bf16" else 0,
        outer_state=round(params * outer_bytes_per_param(sync.method, sync.outer_momentum, share)),
        activations=activation_bytes(
            layers=end - start,
            tokens=spec.train.batch_size // spec.train.microbatches * m.seq_len,  # every shape's microbatch
            d_model=m.d_model,
            d_ff=m.d_ff,
            vocab=m.vocab,
            alive=alive,
            last=stage == S - 1,
            precision=precision,
            per_layer=[block_activation_bytes_per_token(m, i, precision) for i in range(start, end)],
        ),
        optimizer_name="Muon + AdamW" if muon else "AdamW",
    )


def fits(need: StageMemory | int, free_bytes: int, headroom: float = 0.9) -> str | None:
    """None if `need` fits within headroom x free_bytes, else a reason naming the figures, e.g.
    "stage 1 needs 38.2 GB (weights 4.1, ...) but the node has 30.0 GB free (90% usable): use more
    stages or a node with more memory"."""
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom {headroom} must be in (0, 1]")
    total = need.total if isinstance(need, StageMemory) else int(need)
    if total <= headroom * free_bytes:
        return None
    what = (
        f"stage {need.stage} needs {need.describe()} in {need.precision}"
        if isinstance(need, StageMemory)
        else f"the stage needs {total / GB:.1f} GB"
    )
    return (
        f"{what} but the node has {free_bytes / GB:.1f} GB free ({headroom:.0%} usable): "
        "use more stages or a node with more memory"
    )


__all__ = [
    "BYTES_PER_PARAM",
    "GB",
    "PRECISIONS",
    "Precision",
    "StageMemory",
    "activation_bytes",
    "block_activation_bytes_per_token",
    "block_matrix_params",
    "bytes_per_param",
    "captured_share",
    "fits",
    "in_flight",
    "layer_activation_bytes_per_token",
    "layer_params",
    "outer_bytes_per_param",
    "precision_for_device",
    "stage_memory",
    "stage_params",
]

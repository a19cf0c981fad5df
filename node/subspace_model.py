"""The constraint that makes subspace-compressed pipeline links exact (DESIGN section 4).

Subspace Networks (arXiv 2506.01260, "Subspace Networks: Scaling Decentralized Training with
Communication-Efficient Model Parallelism"). A link of width k_b sends Z = (X - T[x]) U_b with
U_b = U[:, :k_b] (protocol/codecs/subspace.py); the receiver's X_hat = Z U_b^T + T[x] equals X exactly iff the
residual stream minus T[x] lies in span(U_b). The residual at boundary b is

    X_b = E[x] + T[x] + sum_{layers l before b} (attn.wo_l(...) + mlp.w_down_l(...))

so it suffices that E's rows lie in span(U[:, :min_b k_b]) and every residual writer of layer l lies in
span(U[:, :k(l)]), k(l) = the smallest k of the compressed boundaries after l (nested bases make
span(U[:, :k]) a subspace of every wider link's span). Layers after the last compressed boundary stay
full-rank. Dense links (k = d) impose nothing.

Gradients: the receiver returns only G_X U; the part (I - U U^T) G_X it drops travels back along the
residual skip path only (every branch reads it through a constrained writer, whose Jacobian starts with
U U^T), so it reaches no parameter except the constrained writers themselves, where projecting the
gradient removes it. Hence, per optimizer step:

    project_grads_(stage)     G_W <- U_k U_k^T G_W,   G_E <- G_E U_k U_k^T    (before clipping and step)
    optimizer.step()          AdamW's elementwise 1/sqrt(v) scaling leaves the subspace, so:
    project_weights_(stage)   W   <- U_k U_k^T W,     E   <- E U_k U_k^T

Why project instead of reparameterizing W = U W': parameter names and shapes stay those of the plain
model, so name-seeded init, checkpoints, the dense reference model and SparseLoCo's per-tensor fragments
and 64x64 tiles all work unchanged, and a link's k can be narrowed later by re-projecting (no optimizer
state to reshape). The price is these two calls, two thin (d x k) matmuls per constrained weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from node.model import Stage
from protocol.codecs.subspace import (
    ActivationCodec,
    Layout,
    SubspaceBoundary,
    SubspacePlan,
    basis,
    subspace_plan,
    token_table,
)
from protocol.runspec import ModelSpec, PipelineSpec

Side = Literal["out", "rows"]
"""How a weight writes the residual: nn.Linear (d, n) output columns ("out": W <- U U^T W) or embedding
rows ("rows": E <- E U U^T)."""


@dataclass(frozen=True)
class Constraint:
    name: str
    """Parameter name within the stage (e.g. 'layers.1.attn.wo.weight')."""
    k: int
    side: Side


def constrain_stage(
    stage: Stage,
    model_spec: ModelSpec,
    pipeline_spec: PipelineSpec,
    ranges: list[tuple[int, int]],
    stage_index: int | None = None,
    *,
    layouts: Sequence[Layout] = (),
) -> SubspacePlan:
    """Attach U (buffer `subspace_U`, (d, k_max)) and T (buffer `token_table`, (V, d): the first stage then
    embeds E[x] + T[x]), record which weights are confined to which span, and project them (init).

    stage_index: this stage's index in `ranges`; None for a reference model holding several stages of
    the split (e.g. the whole model in one piece), constrained exactly as its pieces would be.
    layouts: every replica shape's (ranges, link_k) of the run (`RunSpec.layouts`): the spans are the
    model's, the same whatever shape holds the layer. A run with only dense links is left untouched.
    Call once, after building the stage.
    """
    plan = subspace_plan(model_spec, pipeline_spec, ranges, layouts=layouts)
    if stage_index is not None and (stage.start, stage.end) != tuple(ranges[stage_index]):
        raise ValueError(
            f"stage holds layers [{stage.start}, {stage.end}), ranges[{stage_index}] is {ranges[stage_index]}"
        )
    if stage.start not in {a for a, _ in ranges} or stage.end not in {b for _, b in ranges}:
        raise ValueError(f"stage layers [{stage.start}, {stage.end}) do not align with the split {ranges}")
    if plan.k_max is None:
        return plan
    device = next(stage.parameters()).device
    seed = pipeline_spec.projection_seed
    stage.register_buffer("subspace_U", basis(plan.d, plan.k_max, seed).to(device), persistent=False)
    stage.token_table = token_table(model_spec.vocab, plan.d, seed, plan.embed_k).to(device)  # T perp E
    constraints: list[Constraint] = []
    if stage.embed is not None:
        assert plan.embed_k is not None
        constraints.append(Constraint("embed.weight", plan.embed_k, "rows"))
    for layer in range(stage.start, stage.end):
        if layer in plan.write_k:
            for writer in model_spec.residual_writers(layer):  # an MoE block's every expert's w_down too
                constraints.append(Constraint(writer, plan.write_k[layer], "out"))
    stage.subspace_constraints = tuple(constraints)  # type: ignore[assignment]  # plain attribute
    project_weights_(stage)
    return plan


def _constrained(stage: Stage) -> list[tuple[Constraint, torch.nn.Parameter, torch.Tensor]]:
    constraints: tuple[Constraint, ...] = getattr(stage, "subspace_constraints", ())
    if not constraints:
        return []
    params = dict(stage.named_parameters())
    U = stage.get_buffer("subspace_U")
    return [(c, params[c.name], U[:, : c.k]) for c in constraints]


def _project(t: torch.Tensor, U_k: torch.Tensor, side: Side) -> torch.Tensor:
    U_k = U_k.to(t.dtype)
    if side == "out":
        return U_k @ (U_k.T @ t)  # (d, n): U U^T W
    return (t @ U_k) @ U_k.T  # (V, d): E U U^T


@torch.no_grad()
def project_weights_(stage: Stage) -> None:
    """W <- U_k U_k^T W for every constrained writer, E <- E U_k U_k^T; after every optimizer step (and every
    outer SparseLoCo/DiLoCo step: a sparsified, quantized aggregate is not in span(U)). No-op if dense."""
    for c, p, U_k in _constrained(stage):
        p.copy_(_project(p, U_k, c.side))


@torch.no_grad()
def project_grads_(stage: Stage) -> None:
    """G <- the same projection of every constrained weight's .grad; before clipping and the step."""
    for c, p, U_k in _constrained(stage):
        if p.grad is not None:
            p.grad.copy_(_project(p.grad, U_k, c.side))


_BLOCK_VALUES = 1 << 22
"""float64 products held at once by `consensus_projection` (32 MiB): it takes the columns in blocks."""


def _tree_sum(P: torch.Tensor) -> torch.Tensor:
    """sum over dim 0 as a fixed pairwise tree, (m, ...) -> (...): rows i and i + m//2 first, the odd
    last row carried up. Elementwise adds only, so the bits depend on nothing but the inputs."""
    while P.shape[0] > 1:
        h = P.shape[0] // 2
        head = P[:h] + P[h : 2 * h]
        P = torch.cat((head, P[2 * h :])) if P.shape[0] % 2 else head
    return P[0]


@torch.no_grad()
def consensus_projection(t: torch.Tensor, U_k: torch.Tensor, side: Side) -> torch.Tensor:
    """proj(t) as every replica computes it for the consensus, bit for bit on any host: U U^T W ("out") or
    E U U^T ("rows") of a host tensor, in float64, cast to t's dtype.

    A BLAS matmul's summation order depends on the CPU (blocking, SIMD width, threads) and the GPU's on
    its kernels, so neither may touch a consensus. Here each product is formed elementwise and summed as
    a fixed pairwise tree (`_tree_sum`); IEEE multiplies and adds round the same everywhere:

        C = tree_sum_i  U[i, :, None] * X[i, None, :]      # (k, n) = U^T X
        Y = tree_sum_j  U[:, j, None] * C[j, None, :]      # (d, n) = U C

    Cost 2 d k n float64 multiply-adds per weight, memory-bound (d = 256, k = 32: tens of ms for a
    256 x 688 writer); a column block at a time bounds the temporaries to _BLOCK_VALUES.
    """
    if t.device.type != "cpu":
        raise ValueError(f"the consensus projection runs on the host, got a tensor on {t.device}")
    X = (t.double() if side == "out" else t.double().T).contiguous()  # (d, n); rows: (U U^T E^T)^T
    U = U_k.to("cpu", torch.float64).contiguous()  # (d, k)
    d, k = U.shape
    if X.shape[0] != d:
        raise ValueError(f"cannot project a {tuple(t.shape)} {side!r} tensor onto a basis of {d} rows")
    Y = torch.empty_like(X)
    step = max(1, _BLOCK_VALUES // (d * k))
    for c in range(0, X.shape[1], step):
        Xb = X[:, c : c + step]  # (d, b)
        C = _tree_sum(U[:, :, None] * Xb[:, None, :])  # (d, k, b) -> (k, b)
        Y[:, c : c + step] = _tree_sum(U.T[:, :, None] * C[:, None, :])  # (k, d, b) -> (d, b)
    return (Y if side == "out" else Y.T).to(t.dtype).contiguous()


@dataclass(frozen=True)
class Confinement:
    """The stage's constraints as the outer loop sees them: parameter index (in `stage.parameters()`
    order) -> (U_k, side). A sparse, quantized aggregate leaves span(U_k), so the round owner projects
    Delta_bar before the outer step (`consensus`, on the host: the anchor stays in span identically on
    every replica) and the error-feedback buffers (`local_`, where they live: local state, so a device
    matmul is fine), so that no top-k budget goes to components the model cannot use."""

    by_index: dict[int, tuple[torch.Tensor, Side]]

    def consensus(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """proj(t) of parameter i's host tensor, identical on every host; t itself if i is unconstrained."""
        c = self.by_index.get(i)
        return t if c is None else consensus_projection(t, c[0], c[1])

    @torch.no_grad()
    def local_(self, i: int, t: torch.Tensor) -> None:
        """t <- proj(t) in place, on t's device (local state: bits may differ between hosts)."""
        c = self.by_index.get(i)
        if c is not None:
            t.copy_(_project(t, c[0].to(t.device), c[1]))

    def off_span(self, i: int, t: torch.Tensor) -> float:
        """||t - proj(t)|| / ||t|| (0 for an unconstrained parameter)."""
        c = self.by_index.get(i)
        if c is None:
            return 0.0
        t = t.detach().to("cpu", torch.float64)
        return float((t - _project(t, c[0].double(), c[1])).norm() / t.norm().clamp_min(1e-30))


def confinement(stage: Stage) -> Confinement | None:
    """The Confinement of a constrained stage (after constrain_stage), None when every link is dense. U_k
    is kept on the host in float32 (the bits basis() gives every replica)."""
    constraints: tuple[Constraint, ...] = getattr(stage, "subspace_constraints", ())
    if not constraints:
        return None
    index = {name: i for i, (name, _) in enumerate(stage.named_parameters())}
    U = stage.get_buffer("subspace_U").detach().cpu()
    return Confinement({index[c.name]: (U[:, : c.k].contiguous(), c.side) for c in constraints})


@torch.no_grad()
def off_subspace(stage: Stage) -> float:
    """Largest ||W - proj(W)|| / ||W|| over the constrained weights (0 when exact); a health check."""
    worst = 0.0
    for c, p, U_k in _constrained(stage):
        worst = max(worst, float((p - _project(p, U_k, c.side)).norm() / p.norm().clamp_min(1e-30)))
    return worst


def boundary_codecs(
    stage: Stage,
    model_spec: ModelSpec,
    pipeline_spec: PipelineSpec,
    ranges: list[tuple[int, int]],
    stage_index: int,
) -> tuple[SubspaceBoundary | None, SubspaceBoundary | None]:
    """(codec_in, codec_out) for node/pipeline/schedule.py's PipelineStage: the links before and after this stage
    (None at the ends), each plan.wire_k[b] wide. Compressed links use the stage's U[:, :k] and T, so call
    constrain_stage first."""
    plan = subspace_plan(model_spec, pipeline_spec, ranges)
    n_stages = len(ranges)

    def link(b: int) -> SubspaceBoundary:
        k = plan.wire_k[b]
        codec = ActivationCodec(
            d=plan.d,
            k=k,
            vocab=model_spec.vocab,
            seq_len=model_spec.seq_len,
            wire_dtype=pipeline_spec.wire_dtype,
            max_abs=pipeline_spec.wire_max_abs,
        )
        if k == plan.d:
            return SubspaceBoundary(codec, None, None)
        U = getattr(stage, "subspace_U", None)
        if not isinstance(U, torch.Tensor) or stage.token_table is None:
            raise ValueError(
                f"link {b} is compressed (k={k} < d={plan.d}): call constrain_stage(stage, ...) first"
            )
        return SubspaceBoundary(codec, U[:, :k], stage.token_table)

    return (
        link(stage_index - 1) if stage_index > 0 else None,
        link(stage_index) if stage_index < n_stages - 1 else None,
    )

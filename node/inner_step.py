"""The inner step, written once: the worker, the stage probe and every benchmark train through it.

One inner step of a stage (DESIGN sections 3-4), whatever produces the gradients:

    lr      = lr_at(step)                         # linear warm-up, cosine decay to 10% of the peak
    grads   = forward_backward()                  # 1F1B over the pipeline, or a plain loss.backward()
    G_W    <- U U^T G_W                           # project_grads_: subspace-constrained writers only
    clip_grad_norm_(grads, grad_clip)
    AdamW(betas=(0.9, 0.95)).step()               # fused kernel on CUDA; or, under train.optimizer =
                                                  # "muon", Muon for the blocks' 2-D matrices (at
                                                  # train.muon_lr) and AdamW for the rest, one step
    W      <- U U^T W                             # project_weights_: AdamW's scaling leaves span(U)

`prepare_stage` puts a freshly built (and constrained) stage where it trains: on its device, in its
precision (bf16 autocast over fp32 master weights, or fp32), compiled with `torch.compile` on CUDA when
asked. Parameters are built and constrained on the CPU first, so every replica starts from bit-identical
weights whatever device it trains on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch

from node.device import Precision
from node.model import Stage
from node.subspace_model import project_grads_, project_weights_
from protocol.runspec import TrainSpec

ADAMW_BETAS = (0.9, 0.95)
R = TypeVar("R")


def lr_at(step: int, train: TrainSpec, peak: float | None = None) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to 10% of the peak (train.lr unless given)
    at `total_steps`."""
    peak = train.lr if peak is None else peak
    if step < train.warmup_steps:
        return peak * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.total_steps - train.warmup_steps)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """A hidden 2-D matrix of a transformer block (attention, MLP and each expert's weights), which Muon
    orthogonalizes; the embedding, the head, norms, biases and an MoE router (a classifier over experts,
    like the head over tokens) stay with AdamW (the usual split)."""
    return name.startswith("layers.") and p.ndim == 2 and not name.endswith("router.weight")


class InnerOptimizer:
    """The inner optimizer as one object: one torch optimizer (AdamW), or Muon for the blocks' 2-D
    matrices with AdamW for the rest (`train.optimizer = "muon"`), zeroed, stepped and checkpointed
    together. Each param group keeps its own peak lr ("peak_lr"), which `inner_step` schedules."""

    def __init__(self, *parts: torch.optim.Optimizer) -> None:
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict]:
        return {p: st for part in self.parts for p, st in part.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()


def make_optimizer(module: torch.nn.Module, train: TrainSpec) -> InnerOptimizer:
    """The run's inner optimizer (`train.optimizer`): AdamW at train.lr with the run's weight decay, fp32
    state next to the parameters (fused on CUDA); under "muon", torch.optim.Muon at train.muon_lr for the
    blocks' 2-D matrices (`is_muon_matrix`) and that AdamW for the rest."""
    named = list(module.named_parameters())
    muon = [p for n, p in named if train.optimizer == "muon" and is_muon_matrix(n, p)]
    taken = {id(p) for p in muon}
    rest = [p for _, p in named if id(p) not in taken]
    fused = bool(named) and named[0][1].device.type == "cuda"
    parts: list[torch.optim.Optimizer] = []
    if muon:
        parts.append(
            torch.optim.Muon(
                muon, lr=train.muon_lr, weight_decay=train.weight_decay, momentum=train.muon_momentum
            )
        )
    if rest or not muon:
        parts.append(
            torch.optim.AdamW(
                rest, lr=train.lr, betas=ADAMW_BETAS, weight_decay=train.weight_decay, fused=fused or None
            )
        )
    for part in parts:
        for g in part.param_groups:
            g["peak_lr"] = g["lr"]
    return InnerOptimizer(*parts)


def optimizer_tensors(module: torch.nn.Module, opt: InnerOptimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state by parameter name ("optim.<param>.<exp_avg|exp_avg_sq|step>",
    or "optim.<param>.momentum_buffer" for Muon's), for checkpoints; hyperparameters are the run spec's
    and the schedule's, not saved."""
    out = {}
    state = opt.state
    for name, p in module.named_parameters():
        for k, v in state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{name}.{k}"] = v
            else:  # some torch versions keep `step` as a float
                out[f"optim.{name}.{k}"] = torch.tensor(float(v))
    return out


def load_optimizer_tensors(
    module: torch.nn.Module, opt: InnerOptimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Restore `optimizer_tensors()` (the parameters are already where they train); a parameter without
    saved state (none was taken before the checkpoint) keeps none."""
    names = {p: name for name, p in module.named_parameters()}
    for part in opt.parts:
        sd = part.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        params = [p for group in part.param_groups for p in group["params"]]
        for i, p in enumerate(params):  # i: the parameter's index in the part's state dict
            prefix = f"optim.{names[p]}."
            got = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if got:
                state[i] = got
        sd["state"] = state
        part.load_state_dict(sd)  # torch casts the moments to each parameter's device and dtype


def prepare_stage(
    module: Stage, device: torch.device, precision: Precision, *, compile: bool = False
) -> Stage:
    """Move a built, constrained stage to `device`, set its precision, compile it if asked (CUDA only:
    on the CPU the compile time outweighs the gain at the sizes a CPU trains). Returns the module."""
    module.to(device)
    module.set_precision(precision)
    if compile and device.type == "cuda":
        module.compile()  # in place: parameter names and the state dict stay those of the plain module
    return module


def inner_step(
    module: Stage,
    opt: InnerOptimizer,
    train: TrainSpec,
    step: int,
    forward_backward: Callable[[], R],
) -> R:
    """One inner step (module docstring); returns what `forward_backward` returned (loss, StepStats)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, train, g["peak_lr"])
    opt.zero_grad(set_to_none=True)
    out = forward_backward()
    project_grads_(module)
    if train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(module.parameters(), train.grad_clip)
    opt.step()
    project_weights_(module)
    return out


__all__ = [
    "ADAMW_BETAS",
    "InnerOptimizer",
    "inner_step",
    "is_muon_matrix",
    "lr_at",
    "make_optimizer",
    "prepare_stage",
]

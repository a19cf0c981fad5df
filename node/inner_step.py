"""The inner step, written once: the worker, the stage probe and every benchmark train through it.

One inner step of a stage (DESIGN sections 3-4), whatever produces the gradients:

    lr      = lr_at(step)                         # linear warm-up, cosine decay to 10% of the peak
    grads   = forward_backward()                  # 1F1B over the pipeline, or a plain loss.backward()
    G_W    <- U U^T G_W                           # project_grads_: subspace-constrained writers only
    clip_grad_norm_(grads, grad_clip)
    AdamW(betas=(0.9, 0.95)).step()               # fused kernel on CUDA
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


def lr_at(step: int, train: TrainSpec) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay to 10% of the peak at `total_steps`."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.total_steps - train.warmup_steps)
    return train.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(module: torch.nn.Module, train: TrainSpec) -> torch.optim.AdamW:
    """AdamW with the run's lr and weight decay; fp32 state next to the parameters (fused on CUDA)."""
    params = list(module.parameters())
    fused = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(
        params, lr=train.lr, betas=ADAMW_BETAS, weight_decay=train.weight_decay, fused=fused or None
    )


def optimizer_tensors(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state by parameter name ("optim.<param>.<exp_avg|exp_avg_sq|step>"),
    for checkpoints; hyperparameters are the run spec's and the schedule's, not saved."""
    out = {}
    for name, p in module.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{name}.{k}"] = v
            else:  # some torch versions keep `step` as a float
                out[f"optim.{name}.{k}"] = torch.tensor(float(v))
    return out


def load_optimizer_tensors(
    module: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Restore `optimizer_tensors()` (the parameters are already where they train); a parameter without
    saved state (none was taken before the checkpoint) keeps none."""
    sd = opt.state_dict()
    index = {}  # parameter -> its index in the optimizer's state dict
    i = 0
    for group in opt.param_groups:
        for p in group["params"]:
            index[p] = i
            i += 1
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, p in module.named_parameters():
        prefix = f"optim.{name}."
        got = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if got:
            state[index[p]] = got
    sd["state"] = state
    opt.load_state_dict(sd)  # torch casts the moments to each parameter's device and dtype


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
    opt: torch.optim.Optimizer,
    train: TrainSpec,
    step: int,
    forward_backward: Callable[[], R],
) -> R:
    """One inner step (module docstring); returns what `forward_backward` returned (loss, StepStats)."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, train)
    opt.zero_grad(set_to_none=True)
    out = forward_backward()
    project_grads_(module)
    if train.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(module.parameters(), train.grad_clip)
    opt.step()
    project_weights_(module)
    return out


__all__ = ["ADAMW_BETAS", "inner_step", "lr_at", "make_optimizer", "prepare_stage"]

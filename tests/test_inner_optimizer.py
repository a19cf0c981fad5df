"""The inner optimizer (node/inner_step.py): AdamW, or Muon for the blocks' 2-D matrices with AdamW for the
rest (`train.optimizer = "muon"`, issue 24), scheduled, stepped and checkpointed as one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from node.inner_step import (
    inner_step,
    is_muon_matrix,
    load_optimizer_tensors,
    lr_at,
    make_optimizer,
    optimizer_tensors,
)
from node.model import build_full_model, lm_loss
from protocol.runspec import ModelSpec, RunSpec, TrainSpec

MODEL = ModelSpec(d_model=32, n_layers=2, n_heads=2, d_ff=88, seq_len=16)
MUON = TrainSpec(total_steps=40, warmup_steps=2, lr=3e-3, optimizer="muon", muon_lr=0.02, weight_decay=0.01)


def batch(step: int) -> torch.Tensor:
    return torch.randint(
        0, MODEL.vocab, (4, MODEL.seq_len + 1), generator=torch.Generator().manual_seed(step)
    )


def train(model: torch.nn.Module, opt, steps: range, spec: TrainSpec = MUON) -> list[float]:
    def fb(step: int) -> float:
        tokens = batch(step)
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        return float(loss.detach())

    return [inner_step(model, opt, spec, s, lambda s=s: fb(s)) for s in steps]  # type: ignore[arg-type]


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    model = build_full_model(MODEL)
    opt = make_optimizer(model, MUON)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {p: n for n, p in model.named_parameters()}
    in_muon = {names[p] for g in muon.param_groups for p in g["params"]}
    in_adamw = {names[p] for g in adamw.param_groups for p in g["params"]}
    assert in_muon == {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    assert {"embed.weight", "head.weight", "norm.weight", "layers.0.attn_norm.weight"} <= in_adamw
    assert not in_muon & in_adamw and in_muon | in_adamw == set(names.values())
    assert not is_muon_matrix("embed.weight", model.embed.weight)  # type: ignore[union-attr]
    only = make_optimizer(model, TrainSpec())  # the default: AdamW for everything, as before
    assert [type(p) for p in only.parts] == [torch.optim.AdamW]


def test_each_part_follows_the_schedule_at_its_own_peak() -> None:
    model = build_full_model(MODEL)
    opt = make_optimizer(model, MUON)
    train(model, opt, range(5, 6))
    muon, adamw = opt.parts
    assert muon.param_groups[0]["lr"] == pytest.approx(lr_at(5, MUON, MUON.muon_lr))
    assert adamw.param_groups[0]["lr"] == pytest.approx(lr_at(5, MUON))
    assert lr_at(5, MUON, MUON.muon_lr) == pytest.approx(lr_at(5, MUON) * MUON.muon_lr / MUON.lr)


def test_muon_trains_and_resumes_bit_identically_from_its_checkpointed_state() -> None:
    torch.manual_seed(0)
    model = build_full_model(MODEL)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(model, MUON)
    losses = train(model, opt, range(0, 20))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns
    saved = {k: v.clone() for k, v in optimizer_tensors(model, opt).items()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith(".momentum_buffer") for k in saved)  # Muon's state is in the checkpoint
    assert any(k.endswith(".exp_avg_sq") for k in saved)  # and AdamW's
    train(model, opt, range(20, 25))
    resumed = build_full_model(MODEL)
    resumed.load_state_dict(weights)
    again = make_optimizer(resumed, MUON)
    load_optimizer_tensors(resumed, again, saved)
    train(resumed, again, range(20, 25))
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k
    assert not torch.equal(start["layers.0.attn.wq.weight"], weights["layers.0.attn.wq.weight"])


def test_the_run_spec_names_the_optimizer_settings() -> None:
    with pytest.raises(ValueError, match="train.optimizer='sgd' must be 'adamw' or 'muon'"):
        TrainSpec(optimizer="sgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="train.muon_lr"):
        TrainSpec(optimizer="muon", muon_lr=0)
    with pytest.raises(ValueError, match="train.muon_momentum"):
        TrainSpec(optimizer="muon", muon_momentum=1.0)
    spec = RunSpec(run_id="m", train=MUON)
    assert spec.train.optimizer == "muon" and TrainSpec().optimizer == "adamw"


def test_the_memory_estimate_counts_muons_one_buffer() -> None:
    """protocol/memory.py's optimizer state against the real one after a step: AdamW's two moments per
    parameter, Muon's one momentum buffer per block-matrix parameter."""
    from node.model import build_stage
    from protocol.memory import stage_memory

    for optimizer in ("adamw", "muon"):
        spec = RunSpec(run_id="m", stages=1, model=MODEL, train=replace(MUON, optimizer=optimizer))
        stage = build_stage(spec.model, spec.layer_ranges(), 0)
        opt = make_optimizer(stage, spec.train)
        train(stage, opt, range(1))
        real = sum(
            v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if v.numel() > 1
        )
        need = stage_memory(spec, 0, "fp32")
        assert need.optimizer == real, (optimizer, need.optimizer, real)
        assert ("Muon + AdamW" in need.describe()) == (optimizer == "muon")

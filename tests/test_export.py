"""The exported Hugging Face Llama checkpoint computes the swarm's consensus model (fp32, offline).

The reference is the crucible pipeline itself: stage by stage, each boundary crossed through its real
link codec (Z = (X - T[x]) U on the wire, X_hat = Z U^T + T[x] on the other side). Every weight, norms
included, is perturbed away from its init, so a missed fold, a wrong name or an unpermuted RoPE shows.
"""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordinator.export import RMS_NORM_EPS, export_llama, residual_spans
from node.model import Stage, build_stage
from node.subspace_model import boundary_codecs, constrain_stage, project_weights_, subspace_plan
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec

needs_transformers = pytest.mark.skipif(
    find_spec("transformers") is None, reason="transformers is a test extra: pip install -e .[dev]"
)

TOL = 1e-4
MODEL = ModelSpec(vocab=256, d_model=64, n_layers=4, n_heads=4, d_ff=176, seq_len=32, rope_theta=500.0)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def make_spec(stages: int, link_k: list[int]) -> RunSpec:
    return RunSpec(run_id="export-test", stages=stages, model=MODEL, pipeline=PipelineSpec(link_k=link_k))


def trained_stages(spec: RunSpec, seed: int = 0) -> list[Stage]:
    """The stages as the worker builds them, then weights moved far from init (norms too) and projected
    back onto the links' spans, as after an inner or outer step."""
    g = torch.Generator().manual_seed(seed)
    ranges = spec.layer_ranges()
    stages = []
    for s in range(spec.stages):
        stage = build_stage(spec.model, ranges, s)
        constrain_stage(stage, spec.model, spec.pipeline, ranges, s)
        with torch.no_grad():
            for name, p in stage.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
                else:
                    # unit gain per layer: logits of a few nats, rounding not yet chaotic (at gain 2
                    # the swarm's own pipeline and an unsplit forward of these weights differ by 1e-4)
                    p.add_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        project_weights_(stage)
        stages.append(stage.eval())
    return stages


@torch.no_grad()
def pipeline_logits(spec: RunSpec, stages: list[Stage], tokens: torch.Tensor) -> torch.Tensor:
    """tokens (b, L+1) -> (b, L, V): the crucible forward, crossing each link through its codec."""
    ranges = spec.layer_ranges()
    h = stages[0](tokens[:, :-1])  # (b, L, d)
    for s in range(1, spec.stages):
        _, send = boundary_codecs(stages[s - 1], spec.model, spec.pipeline, ranges, s - 1)
        receive, _ = boundary_codecs(stages[s], spec.model, spec.pipeline, ranges, s)
        assert send is not None and receive is not None
        _, _, _, h, _ = receive.unpack_fwd(send.pack_fwd("eval", 0, 0, h, tokens))  # X_hat (b, L, d)
        h = stages[s](h)
    return h  # (b, L, V)


def hf_logits(out: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers  # here, not at import: the offline fixture's environment is set by now

    model = transformers.AutoModelForCausalLM.from_pretrained(  # Llama, or GLM-4-MoE for an MoE run
        out, attn_implementation="eager", dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.no_grad():
        return model(input_ids=tokens[:, :-1]).logits


def sample_tokens(spec: RunSpec) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, spec.model.vocab, (3, spec.model.seq_len + 1), generator=g)  # (b, L+1)


@needs_transformers
@pytest.mark.parametrize(
    "stages,link_k",
    [
        (2, [MODEL.d_model // 8]),  # the swarm's default: k = d/8 on every link
        (3, [MODEL.d_model // 8] * 2),
        (3, [MODEL.d_model, MODEL.d_model // 4]),  # a dense link before a compressed one
        (2, []),  # dense links: no T, nothing constrained
    ],
)
def test_exported_llama_matches_swarm_logits(tmp_path: Path, stages: int, link_k: list[int]) -> None:
    spec = make_spec(stages, link_k)
    model = trained_stages(spec)
    tokens = sample_tokens(spec)
    ref = pipeline_logits(spec, model, tokens)  # (b, L, V)
    assert ref.abs().max() > 1.0  # logits far from uniform: the comparison can fail
    export_llama(spec, [m.state_dict() for m in model], tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    got = hf_logits(tmp_path, tokens)
    diff = float((got - ref).abs().max())
    assert diff <= TOL, f"HF logits differ from the swarm's by {diff:.3g}"

    # the same check fails without each fold: undo one in the exported tensors, reload, compare
    tensors = load_file(tmp_path / "model.safetensors")
    hd = MODEL.d_model // MODEL.n_heads
    within = torch.cat((torch.arange(0, hd, 2), torch.arange(1, hd, 2)))
    unperm = torch.argsort((torch.arange(MODEL.n_heads)[:, None] * hd + within).reshape(-1))
    qk = ("q_proj.weight", "k_proj.weight")
    undo = {"RoPE permutation": {n: t[unperm] if n.endswith(qk) else t for n, t in tensors.items()}}
    if link_k and min(link_k) < MODEL.d_model:
        T = model[0].token_table
        assert T is not None
        undo["token table"] = {
            **tensors,
            "model.embed_tokens.weight": tensors["model.embed_tokens.weight"] - T,
        }
    for what, broken in undo.items():
        save_file(broken, tmp_path / "model.safetensors", metadata={"format": "pt"})
        bad = float((hf_logits(tmp_path, tokens) - ref).abs().max())
        assert bad > 100 * TOL, f"without the {what} the logits still match ({bad:.3g})"


@pytest.mark.parametrize("stages,link_k", [(2, [8]), (3, [8, 16]), (3, [64, 16]), (4, [32, 8, 64]), (2, [])])
def test_spans_follow_the_node_plan(stages: int, link_k: list[int]) -> None:
    """The exporter's restatement of which k confines which writer agrees with node/subspace_model.py."""
    spec = make_spec(stages, link_k)
    plan = subspace_plan(spec.model, spec.pipeline, spec.layer_ranges())
    assert residual_spans(spec) == (plan.embed_k, plan.write_k)
    assert build_stage(spec.model, spec.layer_ranges(), 0).layers["0"].attn_norm.eps == RMS_NORM_EPS


def test_refuses_mismatched_stages(tmp_path: Path) -> None:
    spec = make_spec(2, [8])
    states = [m.state_dict() for m in trained_stages(spec)]
    with pytest.raises(ValueError, match="has 2 stages"):
        export_llama(spec, states[:1], tmp_path)
    with pytest.raises(ValueError, match="stage 0 state dict does not match"):
        export_llama(spec, states[::-1], tmp_path)
    bad = {**states[1], "head.weight": states[1]["head.weight"][:, :8]}
    with pytest.raises(ValueError, match="has shape"):
        export_llama(spec, [states[0], bad], tmp_path)
    nan = {**states[1], "norm.weight": torch.full_like(states[1]["norm.weight"], float("nan"))}
    with pytest.raises(ValueError, match="NaN"):
        export_llama(spec, [states[0], nan], tmp_path)
    # weights of another projection seed lie far off this spec's span: refused, not silently projected
    other = RunSpec(
        run_id="export-test", stages=2, model=MODEL, pipeline=PipelineSpec(link_k=[8], projection_seed=8)
    )
    with pytest.raises(ValueError, match="outside span"):
        export_llama(other, states, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_export_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, coordinator.export; sys.exit('transformers' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    assert subprocess.run([sys.executable, "-c", code], cwd=root, env=env, timeout=60).returncode == 0


def test_an_off_span_consensus_under_its_own_spec_is_named_as_a_drift(tmp_path: Path) -> None:
    """Weights of the run's own spec that drifted off the span (a checkpoint of a build before anchors were
    kept in span) are refused with that reason, not as weights of another spec."""
    spec = make_spec(2, [8])
    states = [m.state_dict() for m in trained_stages(spec)]
    g = torch.Generator().manual_seed(3)
    wo = states[0]["layers.0.attn.wo.weight"]
    states[0]["layers.0.attn.wo.weight"] = (
        wo + 0.5 * wo.norm() * torch.randn(wo.shape, generator=g) / wo.numel() ** 0.5
    )
    with pytest.raises(ValueError, match="outside span") as refused:
        export_llama(spec, states, tmp_path, origin="round 4 of run export-test")
    assert "round 4 of run export-test" in str(refused.value) and "drifted" in str(refused.value)
    assert "not trained with this run spec" not in str(refused.value)
    with pytest.raises(ValueError, match="not trained with this run spec"):
        export_llama(spec, states, tmp_path)


@needs_transformers
def test_the_exported_model_generates_what_the_swarm_model_predicts(tmp_path: Path) -> None:
    """scripts/generate.py on an export: greedy continuation token by token equals the argmax of the
    crucible pipeline's own logits (through the k-wide link) on the growing sequence."""
    from scripts.generate import generate, load, main

    spec = make_spec(2, [MODEL.d_model // 8])
    stages = trained_stages(spec)
    export_llama(spec, [m.state_dict() for m in stages], tmp_path)
    model, context = load(tmp_path)
    assert context == MODEL.seq_len
    prompt = list(b"def ")
    new = generate(model, prompt, 6, context, temperature=0.0)
    seq = list(prompt)
    for tok in new:
        # (1, L+1), the links carry whole sequences: padded after seq, which a causal model does not read
        tokens = torch.tensor([seq + [0] * (MODEL.seq_len + 1 - len(seq))])
        assert int(pipeline_logits(spec, stages, tokens)[0, len(seq) - 1].argmax()) == tok
        seq.append(tok)
    assert main([str(tmp_path), "--prompt", "def ", "--tokens", "8"]) == 0
    assert main([str(tmp_path / "nothing-here")]) == 2

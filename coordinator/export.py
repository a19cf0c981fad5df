"""Export a run's consensus as a Hugging Face checkpoint: `model.safetensors` + `config.json`.

The stages of the consensus (one state dict per stage, as `node.model.build_stage(...).state_dict()`
names them) are merged into the parameters of `transformers.LlamaForCausalLM`, or, for a run with
mixture-of-experts blocks ([model.moe]), of `transformers.Glm4MoeForCausalLM`, which load the folder
offline. Nothing here imports `transformers`: the export runs on coordinator hosts without it.

An MoE block (node/model.py `Router`, `MoE`) routes as DeepSeek-V3 and GLM-4.5 do: s = sigmoid(W_r x) in
fp32, the top_k experts of s + b chosen, their s normalized to sum 1. That is GLM-4-MoE with n_group =
topk_group = 1, norm_topk_prob, routed_scaling_factor 1 and the expert bias b as `e_score_correction_bias`;
its blocks before first_k_dense_replace = moe.first_dense are dense SwiGLUs of intermediate_size = d_ff,
its experts SwiGLUs of moe_intermediate_size, and GLM's always-built shared SwiGLU (width
n_shared_experts x moe_intermediate_size) is ours, or zero-wide when we have none. The expert bias is a
buffer, not a parameter: a checkpoint holds it under "model." only, outside the anchor digest two replicas
sign, so `consensus_states` also asks two nodes' checkpoints to hold it bit for bit (node/sync/expert_bias.py moves it
alike on every replica).

What the crucible model computes that HF Llama does not, and how it is folded (DESIGN section 4,
Subspace Networks, arXiv 2506.01260):

    first stage:   h_0   = E[x] + T[x]                  -> embed_tokens = E + T
    boundary b:    X_hat = (X - T[x]) U_b U_b^T + T[x]  -> identity, once every residual writer lies in
                                                           span(U_k) (E and each attn.wo / mlp.w_down)
    RoPE:          interleaved pairs (q_{2i}, q_{2i+1})  -> half-split pairs (q_i, q_{i+hd/2}) of
                                                           `rotate_half`: permute the rows of wq, wk

T is regenerated from the run's projection seed (`protocol.codecs.subspace.token_table`). The boundary map is
token-dependent and rank-k_b, so HF Llama cannot express it in general; it is the identity exactly when
X - T[x] = E[x] + sum of writer outputs lies in span(U_b), which the swarm maintains by projecting every
constrained writer after each inner and outer step and on loading a checkpoint (`project_weights_`). The
export applies that same projection (W <- U_k U_k^T W, E <- E U_k U_k^T, idempotent on a consensus) and
refuses weights that lie far off the span: those come from another run spec (link_k, projection_seed), or,
under the run's own spec, from a checkpoint whose anchor drifted (builds before the outer step kept the
anchor in span: node/sync/outer_sync.py, `consensus_projection`).

Permutation: with hd the head width, head h's rows are reordered to
`h*hd + [0, 2, ..., hd-2, 1, 3, ..., hd-1]`. Then HF's first half holds the even components, the second
the odd ones, and rotate_half's pair (i, i + hd/2) with frequency theta^(-2i/hd) is crucible's pair
(2i, 2i+1) with the same frequency. q.k is unchanged (q and k permuted alike); v and wo are untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from coordinator.lease import stored_record
from protocol import keys
from protocol.checkpoint import (
    Checkpoint,
    CheckpointMissing,
    CheckpointRefused,
    SignedManifest,
    anchor_sha256,
    checkpoint_rounds,
    checkpoint_step,
    group_anchor_sha256,
    newest_round,
    param_group,
    read_manifest,
    read_round,
    slot_signers,
    tensor_sha256,
)
from protocol.codecs.subspace import basis, subspace_plan, token_table
from protocol.messages import Assignment
from protocol.net.store import ObjectStore
from protocol.pairing import vouched_base
from protocol.runspec import ModelSpec, RunSpec
from protocol.trust.assignment_archive import read_archive
from protocol.trust.delegation import OperatorTrust

RMS_NORM_EPS = 1e-6
"""node/model.py's RMSNorm epsilon (its default; the model never passes another)."""
OFF_SPAN_TOL = 1e-3
"""Largest ||W - U_k U_k^T W|| / ||W|| a constrained weight may have before the export refuses it. A
consensus is projected after every step (off-span ~1e-7, fp32 rounding); weights of another projection
seed or link_k are ~sqrt(1 - k/d) off the span."""

EXPERT_BIAS = "mlp.router.expert_bias"
"""An MoE block's expert bias, within layers.{i}.: a float32 buffer of shape (E,), no anchor of its own."""

# crucible name (within layers.{i}.) -> HF name (within model.layers.{i}.)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}
SWIGLU_NAMES = {
    "w_gate.weight": "gate_proj.weight",
    "w_up.weight": "up_proj.weight",
    "w_down.weight": "down_proj.weight",
}
# an MoE block's (within layers.{i}.mlp.) -> Glm4MoeForCausalLM's (within model.layers.{i}.mlp.)
ROUTER_NAMES = {"router.weight": "gate.weight", "router.expert_bias": "gate.e_score_correction_bias"}
SWIGLU_HOLDERS = {"experts": "experts", "shared": "shared_experts"}


def export_parts(spec: RunSpec) -> list[tuple[int, int]]:
    """The [start, end) layers of each state dict the export takes, in order: one per stage when the run's
    replicas share one split (`spec.layer_ranges()`), one per layer group when their splits differ
    (`spec.layer_groups()`, `spec.mixed_layout`: the unit its consensus is agreed in, whichever stage of
    whichever replica holds it). The embedding goes with the first, the final norm and head with the last."""
    return spec.layer_groups() if spec.mixed_layout else spec.layer_ranges()


def _swiglu_shapes(prefix: str, d: int, f: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}w_gate.weight": (f, d),
        f"{prefix}w_up.weight": (f, d),
        f"{prefix}w_down.weight": (d, f),
    }


def layer_shapes(m: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Name (within layers.{layer}.) -> shape of block `layer`'s state dict (node/model.py `Block`): the
    attention and norms, then a dense SwiGLU, or an MoE block's router, expert bias (a buffer), E experts
    and shared SwiGLU (when moe.shared_experts > 0)."""
    d = m.d_model
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (d,),
        "attn.wq.weight": (d, d),
        "attn.wk.weight": (d, d),
        "attn.wv.weight": (d, d),
        "attn.wo.weight": (d, d),
        "mlp_norm.weight": (d,),
    }
    if not m.is_moe_layer(layer):
        return shapes | _swiglu_shapes("mlp.", d, m.d_ff)
    E, f = m.moe.experts, m.expert_d_ff
    shapes |= {"mlp.router.weight": (E, d), EXPERT_BIAS: (E,)}
    for e in range(E):
        shapes |= _swiglu_shapes(f"mlp.experts.{e}.", d, f)
    if m.moe.shared_experts:
        shapes |= _swiglu_shapes("mlp.shared.", d, m.moe.shared_experts * f)
    return shapes


def expected_shapes(spec: RunSpec, stage: int) -> dict[str, tuple[int, ...]]:
    """State name -> shape of part `stage` of `spec` (`export_parts`: a stage, or a layer group of a
    mixed-layout run), as build_stage names them (global layer ids): its parameters and expert biases."""
    m = spec.model
    d, V = m.d_model, m.vocab
    ranges = export_parts(spec)
    start, end = ranges[stage]
    shapes: dict[str, tuple[int, ...]] = {}
    if stage == 0:
        shapes["embed.weight"] = (V, d)
    for layer in range(start, end):
        shapes.update({f"layers.{layer}.{name}": shape for name, shape in layer_shapes(m, layer).items()})
    if stage == len(ranges) - 1:
        shapes["norm.weight"] = (d,)
        shapes["head.weight"] = (V, d)
    return shapes


def merge_stages(spec: RunSpec, stage_states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The stages' state dicts (one per `export_parts`: per layer group in a mixed-layout run) -> one dict of
    crucible names, float32 on the CPU; every name, shape and value checked (a missing, extra, misshapen or
    non-finite tensor raises ValueError saying which)."""
    parts = export_parts(spec)
    unit = "layer group" if spec.mixed_layout else "stage"
    if len(stage_states) != len(parts):
        raise ValueError(
            f"got {len(stage_states)} stage state dicts, run {spec.run_id} has {spec.stages} stages (0..S-1)"
            if not spec.mixed_layout
            else f"got {len(stage_states)} state dicts, run {spec.run_id} has {len(parts)} layer groups "
            f"{parts} (its replicas' layer splits differ: one state dict per layer group)"
        )
    merged: dict[str, torch.Tensor] = {}
    for s, state in enumerate(stage_states):
        want = expected_shapes(spec, s)
        missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
        if missing or extra:
            raise ValueError(
                f"{unit} {s} state dict does not match layers {parts[s]} of run {spec.run_id}: "
                f"missing {missing[:5]}, unexpected {extra[:5]} (is it another run's or another {unit}'s?)"
            )
        for name, shape in want.items():
            t = state[name]
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{unit} {s} tensor {name} has shape {tuple(t.shape)}, the run spec says {shape}"
                )
            t = t.detach().to("cpu", torch.float32)
            if not torch.isfinite(t).all():
                raise ValueError(f"{unit} {s} tensor {name} holds NaN or inf: the consensus diverged")
            merged[name] = t
    return merged


def residual_spans(spec: RunSpec) -> tuple[int | None, dict[int, int]]:
    """(embed_k, write_k): E's rows lie in span(U[:, :embed_k]), layer l's wo / w_down outputs in
    span(U[:, :write_k[l]]); (None, {}) when every link is dense (protocol.codecs.subspace.subspace_plan).
    The spans are the model's, over every replica's layout (`spec.layouts()`), as the nodes constrain them."""
    plan = subspace_plan(spec.model, spec.pipeline_of(0), spec.layer_ranges(0), layouts=spec.layouts())
    return plan.embed_k, dict(plan.write_k)


def _project(
    name: str, W: torch.Tensor, U_k: torch.Tensor, rows: bool, seed: int, origin: str | None
) -> torch.Tensor:
    """W <- U U^T W (a Linear writing the residual) or E <- E U U^T (embedding rows); checks the drift.
    origin: where the weights come from when the spec is known to be theirs (the run's own signed spec):
    then an off-span weight is a consensus that drifted, not a wrong spec."""
    P = (W @ U_k) @ U_k.T if rows else U_k @ (U_k.T @ W)
    off = float((W - P).norm() / W.norm().clamp_min(1e-30))
    if off <= OFF_SPAN_TOL:
        return P
    where = f"{name} is {off:.1%} outside span(U[:, :{U_k.shape[1]}]) of projection_seed {seed}"
    if origin is None:
        raise ValueError(
            f"{where}: these weights were not trained with this run spec's pipeline.link_k / "
            "projection_seed (a consensus lies in the span to ~1e-7)"
        )
    raise ValueError(
        f"{where} in {origin}, under the run's own spec: its consensus anchor drifted off the span (a "
        "checkpoint written by a build before anchors were kept in span(U)); resume the run with this "
        "build, which projects the anchor on restore identically on every replica, and export a round "
        "checkpointed after that"
    )


def fold_to_llama(
    spec: RunSpec, state: dict[str, torch.Tensor], origin: str | None = None
) -> dict[str, torch.Tensor]:
    """Crucible state (merged, float32) -> LlamaForCausalLM's state dict, or Glm4MoeForCausalLM's for an
    MoE run (see the module docstring). origin: names the checkpoint when `spec` is its run's own (see
    `_project`)."""
    m = spec.model
    d, hd = m.d_model, m.d_model // m.n_heads
    state = dict(state)
    embed_k, write_k = residual_spans(spec)
    if embed_k is not None:
        seed = spec.pipeline.projection_seed
        U = basis(d, max(write_k.values()), seed)  # (d, k_max); nested: U[:, :k] is the basis of width k
        for layer, k in write_k.items():
            for name in m.residual_writers(layer):
                state[name] = _project(name, state[name], U[:, :k], False, seed, origin)
        E = _project("embed.weight", state["embed.weight"], U[:, :embed_k], True, seed, origin)  # (V, d)
        state["embed.weight"] = E + token_table(m.vocab, d, seed, embed_k)  # h_0 = E[x] + T[x]
    # interleaved RoPE pairs -> rotate_half's halves, per head: rows h*hd + [0, 2, .., 1, 3, ..]
    within = torch.cat((torch.arange(0, hd, 2), torch.arange(1, hd, 2)))  # (hd,)
    perm = (torch.arange(m.n_heads)[:, None] * hd + within).reshape(-1)  # (d,)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            if rest in ("attn.wq.weight", "attn.wk.weight"):
                t = t[perm]
            out[f"model.layers.{i}.{hf_layer_name(rest)}"] = t.contiguous()
        else:
            out[TOP_NAMES[name]] = t.contiguous()
    if not m.moe.shared_experts:
        # GLM builds a shared SwiGLU in every MoE block: ours is none, so zero-wide (n_shared_experts = 0:
        # adds exactly 0), written as its save_pretrained writes it, so a load finds no key missing
        for layer in m.moe_layers:
            for name, shape in _swiglu_shapes("", d, 0).items():
                out[f"model.layers.{layer}.mlp.shared_experts.{SWIGLU_NAMES[name]}"] = torch.zeros(shape)
    return out


def hf_layer_name(rest: str) -> str:
    """A block's state name (within layers.{i}.) -> HF's (within model.layers.{i}.): Llama's for the
    attention, the norms and a dense SwiGLU (GLM-4-MoE's are the same); GLM-4-MoE's for an MoE block's
    router and SwiGLUs, one 2-D matrix per expert (`experts.{e}.gate_proj.weight`), as transformers 5's
    `save_pretrained` writes them (it stacks them on load) and the GLM-4.5 checkpoints hold them."""
    if rest in LAYER_NAMES:
        return LAYER_NAMES[rest]
    mlp = rest.removeprefix("mlp.")
    if mlp in ROUTER_NAMES:
        return f"mlp.{ROUTER_NAMES[mlp]}"
    holder, _, tail = mlp.partition(".")
    if holder == "experts":
        e, _, tail = tail.partition(".")
        return f"mlp.experts.{e}.{SWIGLU_NAMES[tail]}"
    return f"mlp.{SWIGLU_HOLDERS[holder]}.{SWIGLU_NAMES[tail]}"


def llama_config(spec: RunSpec) -> dict[str, object]:
    """config.json for LlamaConfig: no GQA, no biases, untied head, byte vocabulary (no special tokens).
    RoPE's base is written both as `rope_theta` (transformers 4.x) and `rope_parameters` (5.x)."""
    m = spec.model
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab,
        "hidden_size": m.d_model,
        "intermediate_size": m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "head_dim": m.d_model // m.n_heads,
        "max_position_embeddings": m.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": m.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def glm4_moe_config(spec: RunSpec) -> dict[str, object]:
    """config.json for Glm4MoeConfig: Llama's (`llama_config`) plus the routing of the module docstring.
    RoPE rotates each head whole: partial_rotary_factor 1 (GLM's default is 0.5), written at the top (4.x)
    and in rope_parameters (5.x). No multi-token-prediction layers (num_nextn_predict_layers, 5.x's
    num_mtp_layers, 0). Raises ValueError for one routed expert: GLM's router (n_group = 1) ranks its
    group by the top two experts' scores, which one expert does not have."""
    m = spec.model
    moe = m.moe
    if moe.experts < 2:
        raise ValueError(
            f"run {spec.run_id}: model.moe.experts={moe.experts}; Glm4MoeForCausalLM's router needs at least "
            "2 routed experts (it ranks expert groups by their top two scores), so this run cannot be exported"
        )
    llama = {k: v for k, v in llama_config(spec).items() if k != "mlp_bias"}
    rope = llama["rope_parameters"]
    assert isinstance(rope, dict)
    return {
        **llama,
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "partial_rotary_factor": 1.0,
        "rope_parameters": {**rope, "partial_rotary_factor": 1.0},
        "moe_intermediate_size": m.expert_d_ff,
        "n_routed_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": moe.first_dense,
        "use_qk_norm": False,
        "num_nextn_predict_layers": 0,
    }


def hf_config(spec: RunSpec) -> dict[str, object]:
    """config.json of the export: GLM-4-MoE's for a run with MoE blocks, Llama's otherwise."""
    return glm4_moe_config(spec) if spec.model.moe.experts else llama_config(spec)


def export_llama(
    spec: RunSpec, stage_states: list[dict[str, torch.Tensor]], out_dir: Path, origin: str | None = None
) -> None:
    """Merge the consensus stages of `spec` into `out_dir`/model.safetensors + config.json (float32), loadable
    offline with `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`: a LlamaForCausalLM, or a
    Glm4MoeForCausalLM for an MoE run. Each file is written to a temporary name first and renamed, so a
    reader never sees half a checkpoint."""
    config = hf_config(spec)
    tensors = fold_to_llama(spec, merge_stages(spec, stage_states), origin)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "crucible_run_id": spec.run_id}
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, out_dir / "model.safetensors")
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out_dir / "config.json")


# --- from the store: the consensus of a round, verified --------------------------------------------
def stage_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stage's consensus state dict from a checkpoint: the module's entries ("model.*"), parameters
    replaced by the consensus anchor ("anchor.*", without the replica's local drift). Buffers (an MoE
    block's expert bias) have no anchor: theirs is the module's, vouched for by `_BiasWitnesses`."""
    state = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    state.update({k[len("anchor.") :]: v for k, v in tensors.items() if k.startswith("anchor.")})
    return state


MAX_EXPORT_TRIES = 8
"""Rounds at and below the newest agreed one whose tensors `consensus_states` reads before it gives up."""
Agreed = list[tuple[str | None, list[tuple[int, SignedManifest]]]]
"""Anchor digest -> the (replica, manifest) pairs signing it, for the digests enough replicas sign."""


def consensus_states(
    store: ObjectStore, run_id: str, operator: set[bytes], rnd: int | None = None
) -> tuple[RunSpec, int, list[dict[str, torch.Tensor]]]:
    """(spec, round, consensus states) of `run_id` at round `rnd`, or by default the newest round whose every
    stage at least two replicas' checkpoints agree on: the same anchor digest in manifests signed by two
    different nodes, and tensors that hold it (a run of one replica: its own checkpoint). The spec must be
    signed by the operator; a checkpoint by a node the operator's coordinators put in its slot (the archived
    assignments, earlier nodes included), never by another slot's node. The round is found by bisection over
    the rounds the run checkpoints (`newest_round`: no LIST, so junk under ckpt/ costs nothing). A named round
    takes any replica's valid checkpoint of each stage. The states are one per `export_parts(spec)`: per stage,
    or per layer group when the replicas' splits differ (`spec.mixed_layout`), agreed group by group
    (`_group_consensus`), as `export_llama` takes them. Raises ValueError naming what is missing."""
    # the operator's own signature or a coordinator it certified, as of when it was signed (the run may
    # have ended after the coordinators' certificates expired)
    trust = OperatorTrust.of(operator)
    record = stored_record(store, run_id, trust)
    if record is None:
        raise ValueError(f"no run {run_id!r} in the store (no {keys.spec_key(run_id)}); check the run id")
    spec = record.spec
    assigned = read_archive(store, spec, trust, as_issued=True) or []
    if spec.sync.topology == "butterfly":
        return (spec, *_pair_consensus(store, spec, assigned, rnd))
    if spec.mixed_layout:
        return (spec, *_group_consensus(store, spec, assigned, rnd))
    signers = [slot_signers(assigned, stage) for stage in range(spec.stages)]
    quorum = 1 if rnd is not None or spec.replicas == 1 else 2
    why: list[str] = []
    seen: dict[tuple[int, int], Agreed] = {}

    def agreed(stage: int, r: int) -> Agreed:
        if (stage, r) not in seen:
            seen[stage, r] = _agreed(store, spec, stage, r, signers[stage], quorum, why)
        return seen[stage, r]

    for r in _rounds_to_try(spec, rnd, lambda r: all(agreed(stage, r) for stage in range(spec.stages))):
        states = []
        for stage in range(spec.stages):
            state = _read_agreed(store, spec, stage, r, signers[stage], agreed(stage, r), why)
            if state is None:
                break
            states.append(state)
        if len(states) == spec.stages:
            return spec, r, states
    raise _none_agreed(run_id, "stage", quorum, why)


def _rounds_to_try(spec: RunSpec, rnd: int | None, counts: Callable[[int], bool]) -> list[int]:
    """`[rnd]` when named; else the newest checkpoint round that `counts` (by bisection) and the ones below
    it, newest first, MAX_EXPORT_TRIES in all (none when no round counts)."""
    if rnd is not None:
        return [rnd]
    rounds = checkpoint_rounds(spec)
    top = newest_round(rounds, counts)
    i = -1 if top is None else rounds.index(top)
    return list(reversed(rounds[max(0, i + 1 - MAX_EXPORT_TRIES) : i + 1]))


def _none_agreed(run_id: str, unit: str, quorum: int, why: list[str]) -> ValueError:
    detail = "; ".join(why[-4:]) or "no checkpoints"
    return ValueError(
        f"run {run_id}: no round with a valid checkpoint of every {unit}"
        + (" that two replicas agree on" if quorum > 1 else "")
        + f" ({detail})"
        + ("; to export one replica's checkpoint anyway, name its round (--round)" if quorum > 1 else "")
    )


def _agreed(
    store: ObjectStore,
    spec: RunSpec,
    stage: int,
    rnd: int,
    signers: dict[int, set[bytes]],
    quorum: int,
    why: list[str],
) -> Agreed:
    """The anchor digests of `stage` at `rnd` that `quorum` replicas' manifests sign (signed by as many
    different nodes, each by a node of its own slot), most signers first: one manifest GET per replica, no
    tensors. With quorum 1 every valid manifest is in one group (digest None). Reasons go to `why`."""
    where = f"round {rnd} stage {stage}"
    found: dict[str | None, list[tuple[int, SignedManifest]]] = {}
    for replica in range(spec.replicas):
        try:
            m = read_manifest(
                store,
                run_id=spec.run_id,
                stage=stage,
                replica=replica,
                round=rnd,
                trusted=signers.get(replica, set()),
            )
        except CheckpointMissing:
            continue
        except CheckpointRefused as e:
            why.append(f"{where} replica {replica}: {e}")
            continue
        if m.manifest.step != checkpoint_step(spec, rnd):
            why.append(f"{where} replica {replica}: manifest is for step {m.manifest.step}")
            continue
        found.setdefault(m.anchor_sha256 if quorum > 1 else None, []).append((replica, m))
    return _with_quorum(found, quorum, where, why)


def _with_quorum(
    found: dict[str | None, list[tuple[int, SignedManifest]]], quorum: int, where: str, why: list[str]
) -> Agreed:
    """The digests of `found` (digest -> the replicas' manifests signing it) that `quorum` different signers
    sign, most signers first; why the others fall short goes to `why`."""
    out: Agreed = []
    for digest, group in sorted(found.items(), key=lambda kv: -len({m.signer for _, m in kv[1]})):
        replicas = [r for r, _ in group]
        if digest is None and quorum > 1:  # written before checkpoints carried the digest
            why.append(f"{where}: replicas {replicas} carry no digest of its anchor (an older build)")
        elif len({m.signer for _, m in group}) < quorum:
            why.append(f"{where}: only replica(s) {replicas} sign anchor {str(digest)[:16]}...")
        else:
            out.append((digest, group))
    if not found:
        why.append(f"{where}: no replica checkpointed it")
    return out


class _BiasWitnesses:
    """The expert biases (node/sync/expert_bias.py) that the checkpoints of one agreed anchor hold, by signer. The digest
    two replicas sign covers the parameters' anchors only, and the bias is a buffer under "model.", so one
    node could change it alone: a state counts once two different nodes' checkpoints hold its biases bit for
    bit, as every honest replica's do (a state without MoE blocks counts at once)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[tuple[str, str], ...], set[bytes]] = {}

    def vouched(self, signer: bytes, state: dict[str, torch.Tensor]) -> bool:
        biases = tuple((n, tensor_sha256(state[n])) for n in sorted(state) if n.endswith(EXPERT_BIAS))
        if not biases:
            return True
        held = self.seen.setdefault(biases, set())
        held.add(signer)
        return len(held) >= 2

    def explain(self, where: str, why: list[str]) -> None:
        if self.seen:
            why.append(
                f"{where}: no two nodes' checkpoints of the agreed anchor hold the same expert bias "
                f"({len(self.seen)} different one(s) among {sum(len(s) for s in self.seen.values())} read)"
            )


def _read_agreed(
    store: ObjectStore,
    spec: RunSpec,
    stage: int,
    rnd: int,
    signers: dict[int, set[bytes]],
    agreed: Agreed,
    why: list[str],
) -> dict[str, torch.Tensor] | None:
    """The consensus state of `stage` at `rnd` from the first agreed checkpoint whose tensors verify and hold
    the digest its group signs and, under a quorum, whose expert biases another node's such checkpoint holds
    alike (`_BiasWitnesses`: a second download for a stage of MoE blocks); None (reasons in `why`)."""
    for digest, group in agreed:
        witnesses = _BiasWitnesses()
        for replica, m in group:
            ck = _read_pinned(store, spec, stage, replica, rnd, signers, m, why)
            if ck is None:
                continue
            if digest is not None and anchor_sha256(ck.tensors) != digest:
                why.append(
                    f"round {rnd} stage {stage} replica {replica}: its tensors do not hold the anchor its "
                    "manifest signs"
                )
                continue
            state = stage_state(ck.tensors)
            if digest is None or witnesses.vouched(m.signer, state):
                return state
        witnesses.explain(f"round {rnd} stage {stage}", why)
    return None


# --- a mixed-layout run: agreed layer group by layer group ------------------------------------------
Loaded = dict[tuple[int, int], tuple[dict[str, torch.Tensor], dict[int, str]] | None]
"""(stage, replica) -> a round's verified checkpoint as (its consensus state, its tensors' group anchor
digests), None where refused: each read once for all the groups it holds."""


def _group_consensus(
    store: ObjectStore, spec: RunSpec, assigned: list[Assignment], rnd: int | None
) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """(round, one consensus state per layer group) of a run whose replicas differ in layer split. The
    replicas' stages of one index hold different layers, so agreement is per layer group g (the trust rule
    of `consensus_states`, per group): g counts at a round when two replicas' checkpoints of the stage
    holding g in each (`spec.stage_of_group`), signed by two different nodes, each a signer of its own slot,
    carry the same digest of g's anchor (`GROUP_ANCHOR_META`), and the tensors of one of them hold it. The
    default round is the newest at which every group counts; a named round takes any valid checkpoint of
    each group. Each (stage, replica) manifest and tensors object of a round is read once."""
    signers = {stage: slot_signers(assigned, stage) for stage in range(spec.max_stages)}
    quorum = 1 if rnd is not None or spec.replicas == 1 else 2
    groups = range(len(spec.layer_groups()))
    why: list[str] = []
    seen: dict[tuple[int, int], Agreed] = {}
    manifests: dict[tuple[int, int, int], SignedManifest | None] = {}

    def manifest(stage: int, replica: int, r: int) -> SignedManifest | None:
        if (stage, replica, r) not in manifests:
            manifests[stage, replica, r] = _manifest(store, spec, stage, replica, r, signers[stage], why)
        return manifests[stage, replica, r]

    def agreed(g: int, r: int) -> Agreed:
        if (g, r) not in seen:
            seen[g, r] = _group_agreed(spec, g, r, quorum, manifest, why)
        return seen[g, r]

    for r in _rounds_to_try(spec, rnd, lambda r: all(agreed(g, r) for g in groups)):
        loaded: Loaded = {}
        states = []
        for g in groups:
            state = _read_group(store, spec, g, r, signers, agreed(g, r), loaded, why)
            if state is None:
                break
            states.append(state)
        if len(states) == len(groups):
            return r, states
    raise _none_agreed(spec.run_id, "layer group", quorum, why)


def _group_name(spec: RunSpec, g: int) -> str:
    a, b = spec.layer_groups()[g]
    return f"layer group {g} (layers {a}-{b - 1})"


def _manifest(
    store: ObjectStore,
    spec: RunSpec,
    stage: int,
    replica: int,
    rnd: int,
    signers: dict[int, set[bytes]],
    why: list[str],
) -> SignedManifest | None:
    """`replica`'s verified manifest of `stage` at `rnd`, signed by a signer of its slot and for the round's
    step; None (a reason in `why` unless there is none)."""
    where = f"round {rnd} stage {stage} replica {replica}"
    try:
        m = read_manifest(
            store,
            run_id=spec.run_id,
            stage=stage,
            replica=replica,
            round=rnd,
            trusted=signers.get(replica, set()),
        )
    except CheckpointMissing:
        return None
    except CheckpointRefused as e:
        why.append(f"{where}: {e}")
        return None
    if m.manifest.step != checkpoint_step(spec, rnd):
        why.append(f"{where}: manifest is for step {m.manifest.step}")
        return None
    return m


def _group_agreed(
    spec: RunSpec,
    g: int,
    rnd: int,
    quorum: int,
    manifest: Callable[[int, int, int], SignedManifest | None],
    why: list[str],
) -> Agreed:
    """The digests of layer group `g`'s anchor at `rnd` that `quorum` replicas' manifests (of the stage
    holding g in each) sign, by as many different nodes, most signers first; with quorum 1 every valid
    manifest is in one entry (digest None). No tensors read. Reasons go to `why`, naming the group."""
    where = f"round {rnd} {_group_name(spec, g)}"
    found: dict[str | None, list[tuple[int, SignedManifest]]] = {}
    for replica in range(spec.replicas):
        m = manifest(spec.stage_of_group(replica, g), replica, rnd)
        if m is not None:
            found.setdefault(m.group_anchor_sha256(g) if quorum > 1 else None, []).append((replica, m))
    return _with_quorum(found, quorum, where, why)


def _read_group(
    store: ObjectStore,
    spec: RunSpec,
    g: int,
    rnd: int,
    signers: dict[int, dict[int, set[bytes]]],
    agreed: Agreed,
    loaded: Loaded,
    why: list[str],
) -> dict[str, torch.Tensor] | None:
    """Layer group `g`'s consensus state at `rnd`: its parameters from the first agreed checkpoint whose
    tensors verify and hold the digest of g its entry signs (one already read for another group first) and,
    under a quorum, whose expert biases of g another node's such checkpoint holds alike (`_BiasWitnesses`);
    None (reasons in `why`)."""
    for digest, group in agreed:
        witnesses = _BiasWitnesses()
        slots = sorted(((spec.stage_of_group(r, g), r), m) for r, m in group)
        for (stage, replica), m in sorted(slots, key=lambda sm: sm[0] not in loaded):
            if (stage, replica) not in loaded:
                loaded[stage, replica] = _read_stage(store, spec, stage, replica, rnd, signers[stage], m, why)
            got = loaded[stage, replica]
            if got is None:
                continue
            state, digests = got
            if digest is not None and digests.get(g) != digest:
                why.append(
                    f"round {rnd} stage {stage} replica {replica}: its tensors do not hold the anchor of "
                    f"{_group_name(spec, g)} its manifest signs"
                )
                continue
            mine = {name: t for name, t in state.items() if param_group(spec, name) == g}
            if digest is None or witnesses.vouched(m.signer, mine):
                return mine
        witnesses.explain(f"round {rnd} {_group_name(spec, g)}", why)
    return None


def _read_stage(
    store: ObjectStore,
    spec: RunSpec,
    stage: int,
    replica: int,
    rnd: int,
    signers: dict[int, set[bytes]],
    m: SignedManifest,
    why: list[str],
) -> tuple[dict[str, torch.Tensor], dict[int, str]] | None:
    """The checkpoint `m` names, verified (pinned to `m`): (its consensus state, its group anchor digests)."""
    ck = _read_pinned(store, spec, stage, replica, rnd, signers, m, why)
    return None if ck is None else (stage_state(ck.tensors), group_anchor_sha256(spec, ck.tensors))


# --- a butterfly run: each parameter from a pair base its two ends' checkpoints hold alike ------------
def _pair_consensus(
    store: ObjectStore, spec: RunSpec, assigned: list[Assignment], rnd: int | None
) -> tuple[int, list[dict[str, torch.Tensor]]]:
    """(round, one state per `export_parts`) of a butterfly run (`sync.topology = "butterfly"`), whose
    replicas' anchors all differ: every parameter is taken from the pair base (a pair result) that the
    checkpoints of both ends of a pair hold alike at the round, signed by two different nodes, each a signer
    of its own slot (protocol/pairing.py `vouched_base`; the newest exchange wins). The default round is the
    newest checkpointed one at which two replicas checkpointed the first stage, and the rounds below it are
    tried until every parameter is vouched for; a named round is tried alone. An expert bias (a buffer: no
    pair base, alike on every replica) is taken as two different nodes' checkpoints hold it (`_held_alike`)."""
    signers = {stage: slot_signers(assigned, stage) for stage in range(spec.max_stages)}
    why: list[str] = []

    def counts(r: int) -> bool:
        return (
            sum(
                _manifest(store, spec, 0, rep, r, signers[0], why) is not None for rep in range(spec.replicas)
            )
            >= 2
        )

    for r in _rounds_to_try(spec, rnd, counts):
        held: dict[str, dict[int, tuple[str, dict[int, tuple[int, str]], Checkpoint]]] = {}
        read: list[tuple[bytes, Checkpoint]] = []
        for rep in range(spec.replicas):
            for stage in range(spec.stages_of(rep)):
                m = _manifest(store, spec, stage, rep, r, signers[stage], why)
                ck = None if m is None else _read_pinned(store, spec, stage, rep, r, signers[stage], m, why)
                if m is None or ck is None:
                    continue
                read.append((m.signer, ck))
                for name, by_partner in _pair_bases(ck.tensors).items():
                    held.setdefault(name, {})[rep] = (m.signer.hex(), by_partner, ck)
        states: list[dict[str, torch.Tensor]] = []
        for part in range(len(export_parts(spec))):
            state: dict[str, torch.Tensor] = {}
            for name in expected_shapes(spec, part):
                if name.endswith(EXPERT_BIAS):
                    bias = _held_alike(f"model.{name}", read)
                    if bias is None:
                        why.append(f"round {r}: no two nodes' checkpoints hold the same {name}")
                        break
                    state[name] = bias
                    continue
                holders = held.get(name, {})
                chosen = vouched_base({rep: (sg, bp) for rep, (sg, bp, _) in holders.items()})
                if chosen is None:
                    why.append(f"round {r}: no two checkpoints hold the same pair base of {name}")
                    break
                rep, partner = chosen
                state[name] = holders[rep][2].tensors[f"pair.base.{partner}.{name}"]
            else:
                states.append(state)
                continue
            break
        if len(states) == len(export_parts(spec)):
            return r, states
    raise ValueError(
        f"run {spec.run_id}: no round at which both ends of a pair checkpointed the same pair base of every "
        f"parameter ({'; '.join(why[-4:]) or 'no checkpoints'})"
    )


def _held_alike(key: str, read: list[tuple[bytes, Checkpoint]]) -> torch.Tensor | None:
    """Tensor `key` as the checkpoints of two different signers in `read` hold it bit for bit; None if none
    do."""
    signers: dict[str, set[bytes]] = {}
    for signer, ck in read:
        t = ck.tensors.get(key)
        if t is None:
            continue
        held = signers.setdefault(tensor_sha256(t), set())
        held.add(signer)
        if len(held) >= 2:
            return t
    return None


def _pair_bases(tensors: dict[str, torch.Tensor]) -> dict[str, dict[int, tuple[int, str]]]:
    """A butterfly checkpoint's bases: parameter -> partner -> (the round that made it, its sha256)."""
    out: dict[str, dict[int, tuple[int, str]]] = {}
    for key, t in tensors.items():
        head, _, rest = key.partition(".base.")
        partner, _, name = rest.partition(".")
        made = tensors.get(f"pair.round.{partner}.{name}")
        if head != "pair" or not (partner.isascii() and partner.isdecimal()) or made is None:
            continue
        if made.numel() != 1 or made.dtype.is_floating_point or made.dtype.is_complex:
            continue  # not what a node writes (one int64): no vouching from it
        out.setdefault(name, {})[int(partner)] = (int(made.reshape(-1)[0]), tensor_sha256(t))
    return out


def _read_pinned(
    store: ObjectStore,
    spec: RunSpec,
    stage: int,
    replica: int,
    rnd: int,
    signers: dict[int, set[bytes]],
    m: SignedManifest,
    why: list[str],
) -> Checkpoint | None:
    """The checkpoint manifest `m` names, signed by a signer of its slot and pinned to `m`; None, the reason
    in `why`, when refused."""
    try:
        return read_round(
            store,
            run_id=spec.run_id,
            stage=stage,
            replica=replica,
            round=rnd,
            trusted=signers.get(replica, set()),
            manifest_sha256=m.sha256,
        )
    except CheckpointRefused as e:
        why.append(f"round {rnd} stage {stage} replica {replica}: {e}")
        return None

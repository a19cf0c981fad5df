"""A Llama-style decoder split into pipeline stages (RMSNorm, RoPE, SwiGLU, untied byte embeddings).

A `Stage` owns a contiguous layer range; the first stage also owns the embedding, the last the final norm
and LM head. Parameter names are global (`layers.3.attn.wq.weight`) and each parameter's initial value
is seeded by its name, so any partition of the model starts from bit-identical weights.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from protocol.runspec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (L, head_dim/2) for rotary position embeddings (arXiv 2104.09864)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (L, hd/2)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (b, h, L, hd); rotate interleaved pairs (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    L = x.shape[-2]
    c, s = cos[:L].to(x.dtype), sin[:L].to(x.dtype)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d = spec.d_model
        self.n_heads = spec.n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)  # writes the residual stream

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, L, d = x.shape
        hd = d // self.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, L, self.n_heads, hd).transpose(1, 2)  # (b, h, L, hd)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, L, hd)
        return self.wo(y.transpose(1, 2).reshape(b, L, d))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)  # writes the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Router(nn.Module):
    """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores s = sigmoid(W x) in fp32; each token goes to
    the top_k experts of s + b, weighted by its s there, normalized to sum to one. The expert bias b
    (a buffer, no gradient) only chooses: node/sync/expert_bias.py moves it to balance the experts' load."""

    def __init__(self, d_model: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(experts, d_model))
        self.expert_bias: torch.Tensor
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, d) -> the chosen experts (T, top_k) and their weights (T, top_k, fp32)."""
        with torch.autocast(x.device.type, enabled=False):  # routing decides on fp32 scores
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, chosen)
        return chosen, w / (w.sum(-1, keepdim=True) + 1e-20)


class MoE(nn.Module):
    """A block's mixture of experts ([model.moe]): the router's top_k of E SwiGLU experts per token, each
    expert's output weighted by its score, plus the shared SwiGLU every token goes through. Each expert is
    its own 2-D matrices (`experts.{e}.w_gate.weight`, ...), so SparseLoCo tiles, Muon orthogonalizes and
    the subspace constraint confines an expert's w_down like any dense block's. `load` counts the tokens
    each expert took in training forwards since node/sync/expert_bias.py last took it."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        m, d, f = spec.moe, spec.d_model, spec.expert_d_ff
        self.router = Router(d, m.experts, m.top_k)
        self.experts = nn.ModuleList(SwiGLU(d, f) for _ in range(m.experts))
        self.shared = SwiGLU(d, m.shared_experts * f) if m.shared_experts else None
        self.load: torch.Tensor
        self.register_buffer("load", torch.zeros(m.experts, dtype=torch.int64), persistent=False)

    @torch.compiler.disable  # token counts per expert are data-dependent shapes
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, w = self.router(flat)
        visits = chosen.reshape(-1)
        per_expert = torch.bincount(visits, minlength=len(self.experts))
        if self.training and torch.is_grad_enabled():  # a training forward (validation runs without grad)
            self.load += per_expert
        order = visits.argsort(stable=True)  # visits grouped by expert, ascending
        token, weight = order // chosen.shape[1], w.reshape(-1)[order]
        out = torch.zeros_like(flat)
        start = 0
        for e, n in enumerate(per_expert.tolist()):
            if n:
                t = token[start : start + n]
                y = self.experts[e](flat[t]) * weight[start : start + n, None]
                out.index_add_(0, t, y.to(out.dtype))
            start += n
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.d_model)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.d_model)
        self.mlp: nn.Module = MoE(spec) if spec.is_moe_layer(layer) else SwiGLU(spec.d_model, spec.d_ff)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Stage(nn.Module):
    """Layers [start, end) of the model; first stage takes token ids, last returns logits."""

    def __init__(self, spec: ModelSpec, start: int, end: int, *, first: bool, last: bool) -> None:
        super().__init__()
        if not 0 <= start < end <= spec.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside the model's {spec.n_layers} layers")
        self.spec, self.start, self.end, self.first, self.last = spec, start, end, first, last
        self.embed = nn.Embedding(spec.vocab, spec.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(start, end)})
        self.norm = RMSNorm(spec.d_model) if last else None
        self.head = nn.Linear(spec.d_model, spec.vocab, bias=False) if last else None
        cos, sin = rope_tables(spec.seq_len, spec.d_model // spec.n_heads, spec.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # (V, d) fixed token table T of a subspace-compressed pipeline (node/subspace_model.py); None = plain
        self.token_table: torch.Tensor | None
        self.register_buffer("token_table", None, persistent=False)
        self.autocast_bf16 = False
        """bf16 autocast around the forward (fp32 master weights stay fp32); see `set_precision`."""
        init_weights_(self, spec)

    def set_precision(self, precision: str) -> None:
        """ "bf16": matmuls in bf16 under autocast, parameters and optimizer state stay fp32; "fp32": plain."""
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {precision!r} must be 'fp32' or 'bf16'")
        self.autocast_bf16 = precision == "bf16"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: x is (b, L) token ids; otherwise (b, L, d) hidden states.
        Returns (b, L, vocab) logits on the last stage, else (b, L, d) hidden states."""
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        if self.embed is not None and self.token_table is not None:
            h = h + self.token_table[x]  # E[x] + T[x] (DESIGN section 4)
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.head is not None and self.norm is not None:
            return self.head(self.norm(h))
        return h


def init_weights_(module: nn.Module, spec: ModelSpec) -> None:
    """Seed each parameter by (init_seed, its global name): the same weights under any stage split."""
    residual_std = 0.02 / math.sqrt(2 * spec.n_layers)  # GPT-2 scaling of residual writes
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator().manual_seed(spec.init_seed * 1_000_003 + zlib.crc32(name.encode()))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w_down.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * residual_std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def moe_blocks(module: nn.Module) -> dict[int, MoE]:
    """Layer -> its MoE of a stage (empty for a dense model), in layer order."""
    layers = getattr(module, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        return {}
    return {int(i): b.mlp for i, b in layers.items() if isinstance(b.mlp, MoE)}


def build_stage(spec: ModelSpec, ranges: list[tuple[int, int]], stage: int) -> Stage:
    start, end = ranges[stage]
    return Stage(spec, start, end, first=stage == 0, last=stage == len(ranges) - 1)


def build_full_model(spec: ModelSpec) -> Stage:
    return Stage(spec, 0, spec.n_layers, first=True, last=True)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats; tokens is (b, L+1), logits (b, L, V)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

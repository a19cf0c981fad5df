"""The reference block: one Llama block of a fixed shape that every node times at start.

A node advertises `ref_block` (which shape it timed) and `ref_block_s` (seconds of one forward + backward
of it over `batch x seq_len` tokens, in the precision it trains in by default). The planner turns that
into the rate the node sustains on real training work, in its FLOPs convention,

    sustained = (6 P_layer + coef d s) x batch s / ref_block_s          # FLOP/s

and scales it to any run's stages by their FLOPs per token (coordinator/plan/inputs.py). Unlike a
matmul's peak it includes what a training step really pays: attention, norms, SwiGLU, autograd.

Two shapes: a GPU's small products are launch-bound, a CPU would take seconds on a GPU's shape.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReferenceBlock:
    name: str
    d_model: int
    n_heads: int
    d_ff: int
    seq_len: int
    batch: int

    @property
    def layer_params(self) -> int:
        """Attention (4 d^2) + SwiGLU (3 d d_ff) + two RMSNorm gains (2 d)."""
        d = self.d_model
        return 4 * d * d + 3 * d * self.d_ff + 2 * d

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


REFERENCE_BLOCKS: dict[str, ReferenceBlock] = {
    b.name: b
    for b in (
        ReferenceBlock("cpu-d256", d_model=256, n_heads=4, d_ff=688, seq_len=128, batch=2),
        ReferenceBlock("gpu-d2048", d_model=2048, n_heads=16, d_ff=5504, seq_len=2048, batch=2),
    )
}


def reference_block_for(device_type: str) -> ReferenceBlock:
    """The shape a node on this kind of device times ("cuda" or "cpu")."""
    return REFERENCE_BLOCKS["gpu-d2048" if device_type == "cuda" else "cpu-d256"]

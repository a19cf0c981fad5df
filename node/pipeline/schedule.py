"""One training step of a pipeline stage: 1F1B over M microbatches, with sends/receives on threaded links.

Stage s of S runs `warmup = min(S - s - 1 + extra_in_flight, M)` forwards (0 on the last stage), then
alternates one forward and one backward, then drains the remaining backwards (PipeDream-Flush / Megatron
1F1B, arXiv 2104.04473): at most `warmup + 1` microbatches' activations are alive, and sends overlap
compute on the link threads.

Why `extra_in_flight`: with plain 1F1B (extra 0) stage s sends F(i) and next needs B(i) after only one
backward and one forward of its own (~ one microbatch of compute, c), while B(i) needs a round trip:
2 (tx + delay) on the wire plus the downstream compute. Every microbatch then stalls ~2 (tx + delay) on a
WAN link. With e extra forwards in flight the slack grows by ~e c, so e >= 2 (tx + delay) / c hides the
link in steady state (scripts/bench_pipeline.py); the price is e more microbatches of activations alive.
Order and results are unchanged: every stage still runs forwards and backwards in microbatch order, and
gradients are summed over the same microbatches. Deadlock-free because a stage never waits for B(j)
before it has sent F(j + warmup), and its downstream neighbour needs only F(j + warmup - 1) for B(j).
Every microbatch crosses a boundary in one message each way, carrying the (possibly subspace-compressed)
tensor and, forward, the token ids, so the last stage has its targets and T[x] can be rebuilt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from node.model import Stage, lm_loss
from node.pipeline.transport import Link
from protocol.schema import ProtocolError


class BoundaryCodec(Protocol):
    """How a stage boundary encodes activations (forward) and activation-gradients (backward)."""

    def pack_fwd(self, kind: str, step: int, mb: int, h: torch.Tensor, tokens: torch.Tensor) -> bytes: ...
    def pack_fwd_async(
        self, kind: str, step: int, mb: int, h: torch.Tensor, tokens: torch.Tensor
    ) -> Callable[[], bytes]: ...
    def unpack_fwd(self, data: bytes) -> tuple[str, int, int, torch.Tensor, torch.Tensor]: ...
    def pack_bwd(self, step: int, mb: int, g: torch.Tensor) -> bytes: ...
    def pack_bwd_async(self, step: int, mb: int, g: torch.Tensor) -> Callable[[], bytes]: ...
    def unpack_bwd(self, data: bytes) -> tuple[int, int, torch.Tensor]: ...


class ScheduleError(ProtocolError):
    """A neighbour sent a message for the wrong step or microbatch."""


@dataclass
class StepStats:
    loss: float | None = None
    """Mean training loss (nats) over the step's microbatches; last stage only."""
    compute_s: float = 0.0
    wait_s: float = 0.0
    """Time blocked on receives (link latency/bandwidth not hidden by compute)."""
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Evaluation:
    """A validation pass on the last stage (every batch holds the same number of tokens)."""

    loss: float
    """Mean loss per token, nats."""
    tokens: int
    """Tokens predicted."""
    text_bytes: int
    """UTF-8 bytes of text those tokens stand for (= tokens at byte level)."""

    @property
    def bits_per_byte(self) -> float:
        """sum nll / (ln 2 x bytes): the byte-level definition under any tokenizer (node/data/tokenizer.py)."""
        if self.tokens == self.text_bytes:
            return self.loss / math.log(2)  # byte level: bits per token are bits per byte
        return self.loss * self.tokens / (math.log(2) * max(self.text_bytes, 1))


@dataclass
class _InFlight:
    mb: int
    inp: torch.Tensor | None  # leaf on non-first stages (its grad goes upstream)
    out: torch.Tensor  # hidden state sent downstream, or the loss on the last stage


class PipelineStage:
    """Runs this node's stage of the pipeline for training steps and evaluations."""

    def __init__(
        self,
        module: Stage,
        *,
        stage: int,
        n_stages: int,
        prev: Link | None,
        next: Link | None,
        codec_in: BoundaryCodec | None,
        codec_out: BoundaryCodec | None,
        recv_timeout_s: float,
        extra_in_flight: int = 0,
        device: torch.device | None = None,
    ) -> None:
        """extra_in_flight: forwards a non-last stage runs ahead beyond plain 1F1B's S - s - 1, to hide
        link round trips (module docstring); 0 = plain 1F1B. device: where the stage computes (default:
        its parameters'); received tensors are moved there, sent ones leave through pinned copies."""
        if extra_in_flight < 0:
            raise ValueError(f"extra_in_flight={extra_in_flight} must be >= 0 (0 = plain 1F1B)")
        self.module, self.stage, self.n_stages = module, stage, n_stages
        self.extra_in_flight = extra_in_flight
        self.prev, self.next = prev, next
        self.codec_in, self.codec_out = codec_in, codec_out
        self.recv_timeout_s = recv_timeout_s
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.device = device or [p.device for p in module.parameters()][0]  # (`next` is a link here)

    # --- receive helpers (timed) ------------------------------------------------------------------
    def _recv_fwd(self, stats: StepStats, kind: str, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.prev is not None and self.codec_in is not None
        t = time.perf_counter()
        data = self.prev.recv(self.recv_timeout_s)
        stats.wait_s += time.perf_counter() - t
        got_kind, got_step, got_mb, h, tokens = self.codec_in.unpack_fwd(data)
        if (got_kind, got_step, got_mb) != (kind, step, mb):
            raise ScheduleError(
                f"stage {self.stage}: expected {kind} step {step} microbatch {mb} from upstream, "
                f"got {got_kind} step {got_step} microbatch {got_mb}"
            )
        return h.to(self.device), tokens.to(self.device)

    def _recv_bwd(self, stats: StepStats, step: int, mb: int) -> torch.Tensor:
        assert self.next is not None and self.codec_out is not None
        t = time.perf_counter()
        data = self.next.recv(self.recv_timeout_s)
        stats.wait_s += time.perf_counter() - t
        got_step, got_mb, g = self.codec_out.unpack_bwd(data)
        if (got_step, got_mb) != (step, mb):
            raise ScheduleError(
                f"stage {self.stage}: expected gradient of step {step} microbatch {mb}, got step {got_step} "
                f"microbatch {got_mb}"
            )
        return g.to(self.device)

    # --- training ---------------------------------------------------------------------------------
    def train_step(self, step: int, tokens: torch.Tensor | None, M: int) -> StepStats:
        """Forward and backward of M microbatches; gradients accumulate in the module's .grad.
        tokens: (B, L+1) on the first stage, None elsewhere."""
        stats = StepStats()
        start = time.perf_counter()
        mbs = list(tokens.to(self.device).chunk(M)) if tokens is not None else [None] * M
        warmup = 0 if self.last else min(self.n_stages - self.stage - 1 + self.extra_in_flight, M)
        pending: list[_InFlight] = []
        losses: list[torch.Tensor] = []  # summed once at the end: no host sync per microbatch
        # one autocast region for the whole step: its cache makes one bf16 copy of each weight per step,
        # shared by the microbatches in flight (the stage's own region, per forward, would keep one each)
        bf16 = bool(getattr(self.module, "autocast_bf16", False))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16):
            for i in range(M):
                pending.append(self._forward(stats, step, i, mbs[i], M, losses))
                if i >= warmup:
                    self._backward(stats, step, pending.pop(0))
            while pending:
                self._backward(stats, step, pending.pop(0))
        if self.last:
            stats.loss = float(torch.stack(losses).sum())
        stats.compute_s = time.perf_counter() - start - stats.wait_s
        return stats

    def _forward(
        self,
        stats: StepStats,
        step: int,
        mb: int,
        tokens: torch.Tensor | None,
        M: int,
        losses: list[torch.Tensor],
    ) -> _InFlight:
        inp: torch.Tensor | None = None
        if self.first:
            assert tokens is not None
            x: torch.Tensor = tokens[:, :-1]  # (b, L) token ids
        else:
            h_in, tokens = self._recv_fwd(stats, "train", step, mb)
            inp = x = h_in.requires_grad_(True)  # (b, L, d) leaf: its grad crosses back upstream
        out = self.module(x)
        if self.last:
            loss = lm_loss(out, tokens) / M  # mean over microbatches
            losses.append(loss.detach())
            return _InFlight(mb, inp, loss)
        assert self.next is not None and self.codec_out is not None
        self.next.send(self.codec_out.pack_fwd_async("train", step, mb, out.detach(), tokens))
        return _InFlight(mb, inp, out)

    def _backward(self, stats: StepStats, step: int, f: _InFlight) -> None:
        if self.last:
            f.out.backward()
        else:
            g = self._recv_bwd(stats, step, f.mb)
            f.out.backward(g)
        if not self.first:
            assert f.inp is not None and f.inp.grad is not None and self.prev is not None
            assert self.codec_in is not None
            self.prev.send(self.codec_in.pack_bwd_async(step, f.mb, f.inp.grad))

    # --- evaluation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(
        self,
        step: int,
        batches: list[torch.Tensor] | None,
        n_batches: int,
        token_bytes: torch.Tensor | None = None,
    ) -> Evaluation | None:
        """The validation loss over the batches; returned on the last stage, None elsewhere (and when there
        are no batches). token_bytes: (vocab,) text bytes per token id (a tokenizer's), None = one byte each."""
        stats = StepStats()
        total, tokens_seen, text_bytes = 0.0, 0, 0
        for i in range(n_batches):
            if self.first:
                assert batches is not None
                tokens = batches[i].to(self.device)
                x: torch.Tensor = tokens[:, :-1]
            else:
                x, tokens = self._recv_fwd(stats, "eval", step, i)
            out = self.module(x)
            if self.last:
                total += float(lm_loss(out, tokens))
                targets = tokens[:, 1:]  # (b, L)
                tokens_seen += targets.numel()
                text_bytes += (
                    targets.numel() if token_bytes is None else int(token_bytes[targets.cpu()].sum())
                )
            else:
                assert self.next is not None and self.codec_out is not None
                self.next.send(self.codec_out.pack_fwd_async("eval", step, i, out, tokens))
        if not self.last or n_batches == 0:
            return None
        return Evaluation(loss=total / n_batches, tokens=tokens_seen, text_bytes=text_bytes)

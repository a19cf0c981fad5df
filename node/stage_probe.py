"""Stage throughput probe: time this run's own stage step on this host (the planner's calibration input).

A matmul overstates what a small model reaches (kernel launches, attention, norms and the optimizer
weigh more), so, like Petals' throughput probe, this times the real thing: one inner step of stage s as
`node/worker.py` runs it, without sockets::

    for each of M microbatches:  unpack_fwd (s > 0) -> forward -> pack_fwd (s < S-1)
                                 unpack_bwd (s < S-1) -> backward -> pack_bwd (s > 0)
    project_grads_ -> clip -> AdamW -> project_weights_

with the run's own boundary codecs (dense or subspace, the run's wire dtype), in the run's precision as
a CPU node resolves it, through the worker's own inner step (`node/inner_step.py`: lr schedule,
projections, `train.grad_clip`, AdamW with `train.weight_decay`); the messages a neighbour would send are
packed once, outside the timing.

`scripts/calibrate_local.py` starts one probe per node process of a swarm (R x S of them, one torch
thread each) to measure how they share the CPU. A probe speaks lines on stdin/stdout:

    <- one JSON line: {"spec": <RunSpec as a dict>, "stage": s, "threads": 1}
    -> READY                               (stage built, one warm-up step done)
    <- run SECONDS                         (time steps until SECONDS have passed; may repeat)
    -> {"stage": s, "steps": n, "step_s": ..., "cpu_s": ..., "overran": false}
    <- quit
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import torch

from node.device import resolve_precision
from node.inner_step import InnerOptimizer, inner_step, make_optimizer, prepare_stage
from node.model import Stage, build_stage, lm_loss
from node.subspace_model import boundary_codecs, constrain_stage
from protocol.codecs.subspace import SubspaceBoundary
from protocol.runspec import RunSpec
from protocol.schema import from_dict


@dataclass
class StageBench:
    """One stage of a run with its codecs, optimizer and pre-packed neighbour messages."""

    spec: RunSpec
    stage: int
    module: Stage
    codec_in: SubspaceBoundary | None
    codec_out: SubspaceBoundary | None
    opt: InnerOptimizer
    tokens: list[torch.Tensor]
    """(b, L+1) token ids per microbatch."""
    fwd_msgs: list[bytes]
    """What stage s-1 would send (s > 0), per microbatch."""
    bwd_msgs: list[bytes]
    """What stage s+1 would send back (s < S-1), per microbatch."""
    steps_done: int = 0
    """Inner steps taken so far: the step index of the lr schedule."""

    @classmethod
    def build(cls, spec: RunSpec, stage: int, seed: int = 0) -> StageBench:
        if not 0 <= stage < spec.stages:
            raise ValueError(f"stage {stage} is outside the run's {spec.stages} stages")
        ms, M = spec.model, spec.train.microbatches
        b = spec.train.batch_size // M
        ranges = spec.layer_ranges()
        module = build_stage(ms, ranges, stage)
        constrain_stage(module, ms, spec.pipeline, ranges, stage)
        cpu = torch.device("cpu")
        prepare_stage(module, cpu, resolve_precision(spec.train.precision, cpu))
        codec_in, codec_out = boundary_codecs(module, ms, spec.pipeline, ranges, stage)
        opt = make_optimizer(module, spec.train)
        g = torch.Generator().manual_seed(seed)
        tokens = [torch.randint(0, ms.vocab, (b, ms.seq_len + 1), generator=g) for _ in range(M)]
        h = [0.02 * torch.randn(b, ms.seq_len, ms.d_model, generator=g) for _ in range(M)]  # (b, L, d)
        fwd = [codec_in.pack_fwd("train", 0, i, h[i], tokens[i]) for i in range(M)] if codec_in else []
        bwd = [codec_out.pack_bwd(0, i, h[i]) for i in range(M)] if codec_out else []
        return cls(spec, stage, module, codec_in, codec_out, opt, tokens, fwd, bwd)

    def step(self) -> None:
        """One inner step of this stage, as the worker computes it (module docstring)."""
        inner_step(self.module, self.opt, self.spec.train, self.steps_done, self._forward_backward)
        self.steps_done += 1

    def _forward_backward(self) -> None:
        """Forward and backward of the M microbatches; gradients accumulate in the module's .grad."""
        M = self.spec.train.microbatches
        for i in range(M):
            tokens = self.tokens[i]
            inp: torch.Tensor | None = None
            if self.codec_in is None:
                x = tokens[:, :-1]  # (b, L) token ids
            else:
                _, _, _, h, tokens = self.codec_in.unpack_fwd(self.fwd_msgs[i])
                inp = x = h.requires_grad_(True)  # (b, L, d)
            out = self.module(x)
            if self.codec_out is None:
                loss = lm_loss(out, tokens) / M
                float(loss.detach())
                loss.backward()
            else:
                self.codec_out.pack_fwd("train", 0, i, out.detach(), tokens)
                _, _, g = self.codec_out.unpack_bwd(self.bwd_msgs[i])
                out.backward(g)
            if inp is not None and self.codec_in is not None:
                assert inp.grad is not None
                self.codec_in.pack_bwd(0, i, inp.grad)

    def time_steps(self, seconds: float) -> tuple[int, float, float, bool]:
        """Run steps until `seconds` have passed -> (steps, wall seconds per step, CPU seconds per
        step, overran).

        Counts only the steps that finished before the deadline: a probe keeps computing until it
        passes the deadline, so when several probes start together every counted step ran while all of
        them were busy. CPU seconds (this process, one torch thread) are what a step costs whoever else
        runs on the machine; wall seconds are what it took. `overran`: no step finished in time; the one
        step is counted anyway.
        """
        start, cpu_start = time.perf_counter(), time.process_time()
        deadline = start + seconds
        n, last, cpu_last = 0, start, cpu_start
        while True:
            self.step()
            now, cpu_now = time.perf_counter(), time.process_time()
            if now > deadline:
                break
            n, last, cpu_last = n + 1, now, cpu_now
        if n == 0:
            return 1, now - start, cpu_now - cpu_start, True
        return n, (last - start) / n, (cpu_last - cpu_start) / n, False


def main() -> int:
    """The line protocol of the module docstring."""
    hello = json.loads(sys.stdin.readline())
    torch.set_num_threads(int(hello.get("threads", 1)))
    spec = from_dict(RunSpec, hello["spec"])
    bench = StageBench.build(spec, int(hello["stage"]))
    bench.step()  # warm-up: allocations, first-call kernel choice
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            n, step_s, cpu_s, overran = bench.time_steps(float(cmd[1]))
            out = {"stage": bench.stage, "steps": n, "step_s": step_s, "cpu_s": cpu_s, "overran": overran}
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""node/pipeline/schedule.py: extra microbatches in flight (stage s runs ahead of plain 1F1B) leave the results of a
training step unchanged and do not deadlock; 3 stages in threads over real loopback links."""

from __future__ import annotations

import threading

import pytest
import torch

from node.model import build_full_model, build_stage, lm_loss
from node.pipeline.schedule import PipelineStage
from node.pipeline.transport import Link
from node.subspace_model import boundary_codecs
from protocol.runspec import ModelSpec, RunSpec
from tests.helpers.tcp_pair import socket_pair

SPEC = RunSpec(run_id="t", stages=3, model=ModelSpec(d_model=32, n_layers=3, n_heads=2, d_ff=64, seq_len=16))
M = 5


def _link_pair() -> tuple[Link, Link]:
    a, b = socket_pair()
    return Link(a, "next"), Link(b, "prev")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra", [0, 1, 2, M + 3])
def test_extra_in_flight_matches_single_process(extra: int) -> None:
    ranges = SPEC.layer_ranges()
    modules = [build_stage(SPEC.model, ranges, s) for s in range(3)]
    l01, l10 = _link_pair()
    l12, l21 = _link_pair()
    prevs, nexts = [None, l10, l21], [l01, l12, None]
    pipes = []
    for s, module in enumerate(modules):
        codec_in, codec_out = boundary_codecs(module, SPEC.model, SPEC.pipeline, ranges, s)
        pipes.append(
            PipelineStage(
                module,
                stage=s,
                n_stages=3,
                prev=prevs[s],
                next=nexts[s],
                codec_in=codec_in,
                codec_out=codec_out,
                recv_timeout_s=20,
                extra_in_flight=extra,
            )
        )
    # Stage 0's first receive (a gradient) must come after warmup + 1 forwards: min(S - 1 + extra + 1, M).
    sent, sent_at_first_recv = [0], []
    send, recv = l01.send, l01.recv

    def counting_send(payload: bytes, timeout_s: float | None = None) -> None:
        sent[0] += 1
        send(payload, timeout_s)

    def noting_recv(timeout_s: float | None = None) -> bytes:
        sent_at_first_recv.append(sent[0])
        return recv(timeout_s)

    l01.send, l01.recv = counting_send, noting_recv  # type: ignore[method-assign]
    tokens = torch.randint(0, 256, (2 * M, 17), generator=torch.Generator().manual_seed(1))
    results: dict[int, object] = {}

    def run(s: int) -> None:
        try:
            results[s] = pipes[s].train_step(0, tokens if s == 0 else None, M)
        except BaseException as e:  # reported below
            results[s] = e

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    for link in (l01, l10, l12, l21):
        link.close()
    assert all(not isinstance(r, BaseException) for r in results.values()), results
    assert len(results) == 3, "a stage did not finish: the schedule deadlocked"

    assert sent_at_first_recv[0] == min(2 + extra + 1, M)

    full = build_full_model(SPEC.model)
    loss = sum(lm_loss(full(mb[:, :-1]), mb) / M for mb in tokens.chunk(M))
    loss.backward()
    assert results[2].loss == pytest.approx(float(loss.detach()), abs=1e-5)  # type: ignore[union-attr]
    ref = dict(full.named_parameters())
    for module in modules:
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_negative_extra_in_flight_is_refused() -> None:
    module = build_stage(SPEC.model, SPEC.layer_ranges(), 0)
    with pytest.raises(ValueError, match="extra_in_flight=-1 must be >= 0"):
        PipelineStage(
            module, stage=0, n_stages=3, prev=None, next=None, codec_in=None, codec_out=None,
            recv_timeout_s=1, extra_in_flight=-1,
        )  # fmt: skip

"""A 2-stage pipeline over real TCP between two OS processes equals the same model in one process."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from node.boundary import DenseBoundary
from node.data import Corpus
from node.model import build_full_model, build_stage, lm_loss
from node.schedule import PipelineStage
from node.transport import Link, connect, listen
from protocol.runspec import ModelSpec, RunSpec

SPEC = RunSpec(run_id="t", model=ModelSpec(d_model=64, n_layers=4, n_heads=4, d_ff=176, seq_len=32))
M = 4


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (8, SPEC.model.seq_len + 1), generator=g)


def _stage1(port: int, out_path: str) -> None:
    torch.manual_seed(0)
    srv = listen("127.0.0.1", port)
    conn, _ = srv.accept()
    link = Link(conn, "stage0")
    module = build_stage(SPEC.model, SPEC.layer_ranges(), 1)
    codec = DenseBoundary(SPEC.model.d_model, SPEC.model.seq_len, 256)
    ps = PipelineStage(
        module, stage=1, n_stages=2, prev=link, next=None, codec_in=codec, codec_out=None, recv_timeout_s=60
    )
    stats = ps.train_step(0, None, M)
    link.flush()
    torch.save({"loss": stats.loss, "grads": {n: p.grad for n, p in module.named_parameters()}}, out_path)
    link.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_two_stage_tcp_matches_single_process(tmp_path) -> None:
    port = _free_port()
    out = str(tmp_path / "stage1.pt")
    child = mp.get_context("spawn").Process(target=_stage1, args=(port, out))
    child.start()
    try:
        link = Link(connect("127.0.0.1", port, timeout_s=60), "stage1")
        module = build_stage(SPEC.model, SPEC.layer_ranges(), 0)
        codec = DenseBoundary(SPEC.model.d_model, SPEC.model.seq_len, 256)
        ps = PipelineStage(
            module,
            stage=0,
            n_stages=2,
            prev=None,
            next=link,
            codec_in=None,
            codec_out=codec,
            recv_timeout_s=60,
        )
        tokens = _tokens()
        ps.train_step(0, tokens, M)
        child.join(60)
        assert child.exitcode == 0
        link.close()
    finally:
        if child.is_alive():
            child.kill()
    remote = torch.load(out)

    full = build_full_model(SPEC.model)
    loss = sum(lm_loss(full(mb[:, :-1]), mb) / M for mb in tokens.chunk(M))
    loss.backward()
    assert remote["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    ref = dict(full.named_parameters())
    grads = {n: p.grad for n, p in module.named_parameters()} | remote["grads"]
    assert set(grads) == set(ref)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_corpus_batches_are_deterministic() -> None:
    c = Corpus.load("stdlib", 0.02)
    a = c.train_batch(1, 0, 5, 4, 32)
    assert torch.equal(a, c.train_batch(1, 0, 5, 4, 32))
    assert not torch.equal(a, c.train_batch(1, 1, 5, 4, 32))
    assert a.shape == (4, 33) and a.max() < 256

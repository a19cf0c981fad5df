"""A 2-stage pipeline over real TCP between two OS processes equals the same model in one process,
with dense links and with a subspace-compressed link (k/d = 1/8, constrained model)."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from node.data.corpus import Corpus
from node.model import Stage, build_full_model, build_stage, lm_loss
from node.pipeline.schedule import PipelineStage
from node.pipeline.transport import Link, connect, listen
from node.subspace_model import boundary_codecs, constrain_stage, project_grads_
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec

M = 4


def _spec(link_k: list[int]) -> RunSpec:
    model = ModelSpec(d_model=64, n_layers=4, n_heads=4, d_ff=176, seq_len=32)
    return RunSpec(run_id="t", model=model, pipeline=PipelineSpec(link_k=link_k))


def _stage(spec: RunSpec, index: int) -> Stage:
    ranges = spec.layer_ranges()
    module = build_stage(spec.model, ranges, index)
    constrain_stage(module, spec.model, spec.pipeline, ranges, index)
    return module


def _pipe(spec: RunSpec, module: Stage, index: int, prev: Link | None, nxt: Link | None) -> PipelineStage:
    codec_in, codec_out = boundary_codecs(module, spec.model, spec.pipeline, spec.layer_ranges(), index)
    return PipelineStage(
        module,
        stage=index,
        n_stages=2,
        prev=prev,
        next=nxt,
        codec_in=codec_in,
        codec_out=codec_out,
        recv_timeout_s=60,
    )


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (8, 33), generator=g)


def _stage1(link_k: list[int], port: int, out_path: str) -> None:
    spec = _spec(link_k)
    srv = listen("127.0.0.1", port)
    conn, _ = srv.accept()
    link = Link(conn, "stage0")
    module = _stage(spec, 1)
    stats = _pipe(spec, module, 1, link, None).train_step(0, None, M)
    project_grads_(module)
    link.flush()
    torch.save(
        {
            "loss": stats.loss,
            "grads": {n: p.grad for n, p in module.named_parameters()},
            "bytes": link.bytes_recv,
        },
        out_path,
    )
    link.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("link_k", [[], [8]], ids=["dense", "subspace-k8-of-64"])
def test_two_stage_tcp_matches_single_process(tmp_path, link_k: list[int]) -> None:
    spec = _spec(link_k)
    port = _free_port()
    out = str(tmp_path / "stage1.pt")
    child = mp.get_context("spawn").Process(target=_stage1, args=(link_k, port, out))
    child.start()
    try:
        link = Link(connect("127.0.0.1", port, timeout_s=60), "stage1")
        module = _stage(spec, 0)
        tokens = _tokens()
        _pipe(spec, module, 0, None, link).train_step(0, tokens, M)
        project_grads_(module)
        child.join(60)
        assert child.exitcode == 0
        link.close()
    finally:
        if child.is_alive():
            child.kill()
    remote = torch.load(out)

    full = build_full_model(spec.model)  # the same constrained model, in one piece, no links
    constrain_stage(full, spec.model, spec.pipeline, spec.layer_ranges(), None)
    loss = sum(lm_loss(full(mb[:, :-1]), mb) / M for mb in tokens.chunk(M))
    loss.backward()
    project_grads_(full)
    assert remote["loss"] == pytest.approx(float(loss.detach()), abs=1e-5)
    ref = dict(full.named_parameters())
    grads = {n: p.grad for n, p in module.named_parameters()} | remote["grads"]
    assert set(grads) == set(ref)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    if link_k:  # k/d = 1/8: forward messages carry 8 of 64 values per token, plus token ids and header
        assert remote["bytes"] < 0.2 * (8 * 32 * 64 * 4 * 4)


def test_corpus_batches_are_deterministic() -> None:
    c = Corpus.load("stdlib", 0.02)
    a = c.train_batch(1, 0, 5, 4, 32)
    assert torch.equal(a, c.train_batch(1, 0, 5, 4, 32))
    assert not torch.equal(a, c.train_batch(1, 1, 5, 4, 32))
    assert a.shape == (4, 33) and a.max() < 256

"""Subspace-compressed links: basis, token table, activation codec, and exactness of a split pipeline.

The key test runs a constrained model split into 2 or 3 stages, every boundary crossing as encoded bytes
through the codec (Z forward, G_Z backward, k/d = 1/8 or narrower), and checks loss and gradients against
the same constrained model in one piece, over two AdamW steps.
"""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.model import Stage, build_full_model, build_stage, lm_loss
from node.subspace_model import (
    boundary_codecs,
    constrain_stage,
    off_subspace,
    project_grads_,
    project_weights_,
    subspace_plan,
)
from protocol.codecs.subspace import (
    HEADER_BYTES,
    MAX_ABS,
    ActivationCodec,
    ActivationCodecError,
    Kind,
    SubspaceBoundary,
    basis,
    compress_activation,
    compress_gradient,
    decompress_activation,
    decompress_gradient,
    dense_bytes,
    payload_bytes,
    token_table,
)
from protocol.runspec import ModelSpec, PipelineSpec

SPEC = ModelSpec(d_model=256, n_layers=4, n_heads=4, d_ff=688, seq_len=32, vocab=256)


def _tokens(b: int = 2, seed: int = 0, spec: ModelSpec = SPEC) -> torch.Tensor:
    return torch.randint(0, spec.vocab, (b, spec.seq_len + 1), generator=torch.Generator().manual_seed(seed))


# --- basis and token table ---------------------------------------------------------------------------


def test_basis_is_orthonormal_deterministic_and_nested() -> None:
    U = basis(256, 32, seed=7)
    assert U.shape == (256, 32) and U.dtype == torch.float32
    torch.testing.assert_close(U.T @ U, torch.eye(32), atol=1e-6, rtol=0)
    assert torch.equal(U, basis(256, 32, seed=7))
    assert not torch.allclose(U, basis(256, 32, seed=8))
    # nested: a narrower link's basis is the prefix of a wider one, whatever k_max the caller used
    torch.testing.assert_close(basis(256, 16, seed=7), U[:, :16], atol=1e-6, rtol=0)
    torch.testing.assert_close(basis(256, 256, seed=7)[:, :32], U, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="k_max"):
        basis(64, 65, seed=0)


def test_basis_golden_values() -> None:
    # Every stage derives U on its own: a change of torch's CPU RNG or of the QR convention would silently
    # desynchronise hosts running different builds. Pin a few values.
    U = basis(64, 8, seed=7)
    torch.testing.assert_close(
        U[:2, :3],
        torch.tensor(
            [[-0.0032327578, 0.0628095716, 0.2426578701], [-0.1306621879, -0.1486849934, -0.1366235167]]
        ),
    )
    assert float(U.abs().sum()) == pytest.approx(50.1135902405, abs=1e-5)
    T = token_table(256, 64, seed=7, k_embed=8)
    assert float(T.abs().sum()) == pytest.approx(242.8859710693, abs=1e-3)


def test_token_table_is_orthogonal_to_the_embedding_span_and_embedding_scaled() -> None:
    U = basis(256, 32, seed=3)
    T = token_table(256, 256, seed=3, k_embed=32)
    assert T.shape == (256, 256)
    assert float((T @ U).abs().max()) < 1e-7  # T_perp: nothing of T crosses the link
    # E U U^T + T has the law of a N(0, 0.02^2) embedding: T holds (d - k)/d of that variance
    assert float(T.pow(2).mean()) == pytest.approx(0.02**2 * (256 - 32) / 256, rel=0.05)
    assert torch.equal(T, token_table(256, 256, seed=3, k_embed=32))
    assert float((token_table(256, 256, seed=3, k_embed=None) @ U).abs().max()) > 1e-3


def test_linear_maps_invert_on_the_subspace() -> None:
    U = basis(64, 8, seed=1)
    T = token_table(256, 64, seed=1, k_embed=8)
    tokens = _tokens(3)[:, :16]
    X = torch.randn(3, 16, 8) @ U.T + T[tokens]  # (b, L, d) in span(U) + T[x]
    Z = compress_activation(X, tokens, U, T)
    assert Z.shape == (3, 16, 8)
    torch.testing.assert_close(decompress_activation(Z, tokens, U, T), X, atol=1e-6, rtol=0)
    G = torch.randn(3, 16, 64)
    G_Z = compress_gradient(G, U)
    assert G_Z.shape == (3, 16, 8)
    torch.testing.assert_close(decompress_gradient(G_Z, U), G @ U @ U.T)
    # dense link: identity
    assert torch.equal(compress_activation(X, tokens, None, None), X)
    assert torch.equal(decompress_gradient(G, None), G)


# --- codec -------------------------------------------------------------------------------------------


def _codec(**kw: object) -> ActivationCodec:
    args: dict = {"d": 64, "k": 8, "vocab": 256, "seq_len": 16, "wire_dtype": "float32"} | kw
    return ActivationCodec(**args)


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("vocab", [256, 1000, 70_000])
@pytest.mark.parametrize("k", [8, 64])
def test_codec_roundtrip(wire_dtype: str, vocab: int, k: int) -> None:
    codec = _codec(k=k, vocab=vocab, wire_dtype=wire_dtype)
    Z = torch.randn(3, 16, k)
    tokens = torch.randint(0, vocab, (3, 17))
    for kind in (Kind.FORWARD, Kind.EVAL):
        data = codec.encode(kind, microbatch=5, step=2**40, Z=Z, tokens=tokens)
        assert len(data) == codec.nbytes(3, kind) == payload_bytes(3, 16, k, wire_dtype, vocab, kind)  # type: ignore[arg-type]
        msg = codec.decode(data, b=3, kinds=(kind,))
        h = msg.header
        assert (h.kind, h.microbatch, h.step, h.b, h.L, h.k, h.dtype) == (
            kind,
            5,
            2**40,
            3,
            16,
            k,
            wire_dtype,
        )
        assert msg.tokens is not None and torch.equal(msg.tokens, tokens)
        wire = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[wire_dtype]
        assert msg.Z.dtype == wire and torch.equal(msg.Z, Z.to(wire))
    back = codec.decode(codec.encode(Kind.BACKWARD, microbatch=1, step=3, Z=Z), b=3)
    assert (
        back.tokens is None
        and back.header.kind == Kind.BACKWARD
        and torch.equal(back.Z.float(), Z.to(wire).float())
    )
    token_bytes = {256: 1, 1000: 2, 70_000: 4}[vocab]
    assert codec.nbytes(3, Kind.FORWARD) - codec.nbytes(3, Kind.BACKWARD) == 3 * 17 * token_bytes


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4),
    L=st.integers(1, 8),
    k=st.integers(1, 16),
    mb=st.integers(0, 2**32 - 1),
    step=st.integers(0, 2**64 - 1),
    kind=st.sampled_from(list(Kind)),
)
def test_codec_roundtrip_property(b: int, L: int, k: int, mb: int, step: int, kind: Kind) -> None:
    codec = ActivationCodec(d=16, k=k, vocab=300, seq_len=L)
    Z = torch.randn(b, L, k)
    tokens = None if kind == Kind.BACKWARD else torch.randint(0, 300, (b, L + 1))
    msg = codec.decode(codec.encode(kind, microbatch=mb, step=step, Z=Z, tokens=tokens))
    assert (msg.header.microbatch, msg.header.step, msg.header.kind) == (mb, step, kind)
    assert torch.equal(msg.Z, Z)
    assert (msg.tokens is None) == (tokens is None)
    if tokens is not None:
        assert msg.tokens is not None and torch.equal(msg.tokens, tokens)


def _fwd_bytes(codec: ActivationCodec | None = None, b: int = 2) -> bytes:
    codec = codec or _codec()
    return codec.encode(
        Kind.FORWARD,
        microbatch=0,
        step=0,
        Z=torch.randn(b, 16, codec.k),
        tokens=torch.randint(0, codec.vocab, (b, 17)),
    )


def _patch(data: bytes, offset: int, fmt: str, value: int | bytes) -> bytes:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d[:20], "shorter than its 32-byte header"),
        (lambda d: _patch(d, 0, "4s", b"XXXX"), "not speaking the subspace link protocol"),
        (lambda d: _patch(d, 4, "B", 9), "version 9, this build speaks 1"),
        (lambda d: _patch(d, 5, "B", 7), "kind 7 is not one of"),
        (lambda d: _patch(d, 6, "B", 9), "value dtype code 9 is unknown"),
        (lambda d: _patch(d, 6, "B", 2), "is bfloat16, the run's wire dtype is float32"),
        (lambda d: _patch(d, 7, "B", 2), "token id dtype code 2, expected 1"),
        (lambda d: _patch(d, 20, "<I", 3), r"\(3, 16, 8\) does not match the link's \(2, 16, 8\)"),
        (lambda d: _patch(d, 20, "<I", 0), r"does not match the link's"),
        (lambda d: _patch(d, 24, "<I", 15), r"\(2, 15, 8\) does not match"),
        (lambda d: _patch(d, 28, "<I", 9), r"\(2, 16, 9\) does not match"),
        (lambda d: d[:-1], "should be 1090 bytes, got 1089"),
        (lambda d: d + b"\0", "should be 1090 bytes, got 1091"),
        (lambda d: _patch(d, HEADER_BYTES, "<f", float("nan")), "non-finite"),
        (lambda d: _patch(d, HEADER_BYTES + 4, "<f", float("inf")), "non-finite"),
        (
            lambda d: _patch(d, HEADER_BYTES + 8, "<f", 3e38),
            r"FORWARD message holds \|value\| = 3e\+38, above the link's bound 1e\+06: the sender's stage "
            r"diverged or is hostile; .* raise pipeline.wire_max_abs in the run spec",
        ),
        (
            lambda d: _patch(d, HEADER_BYTES + 12, "<f", -1.5e6),
            r"\|value\| = 1.5e\+06, above the link's bound",
        ),
    ],
)
def test_decode_rejects(mutate, match: str) -> None:
    data = _fwd_bytes()
    assert len(data) == 1090  # 32 + 2*16*8*4 + 2*17
    with pytest.raises(ActivationCodecError, match=match):
        _codec().decode(mutate(data), b=2)


def test_decode_rejects_kind_and_type_and_token_range() -> None:
    codec = _codec()
    with pytest.raises(ActivationCodecError, match="expected a BACKWARD message, got FORWARD"):
        codec.decode(_fwd_bytes(), kinds=(Kind.BACKWARD,))
    with pytest.raises(ActivationCodecError, match="expected bytes, got str"):
        codec.decode("hello")  # type: ignore[arg-type]
    # a backward message must not claim token ids
    bwd = codec.encode(Kind.BACKWARD, microbatch=0, step=0, Z=torch.randn(2, 16, 8))
    with pytest.raises(ActivationCodecError, match="BACKWARD message has token id dtype code 1, expected 0"):
        codec.decode(_patch(bwd, 7, "B", 1))
    # uint16 ids can exceed a vocabulary of 1000
    wide = _codec(vocab=1000)
    data = bytearray(_fwd_bytes(wide))
    struct.pack_into("<H", data, len(data) - 2, 60_000)
    with pytest.raises(ActivationCodecError, match="token id 60000 is outside the vocabulary of 1000"):
        wide.decode(bytes(data))
    assert isinstance(ActivationCodecError("x"), ValueError)  # a ProtocolError


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(Kind))
def test_decode_bounds_magnitude(wire_dtype: str, kind: Kind) -> None:
    """Z = 3e38 is finite in fp32 and bf16, so it used to pass; now every kind of message is bounded."""
    loose = _codec(wire_dtype=wire_dtype, max_abs=3.4e38)  # a neighbour that sends what it likes
    tokens = None if kind == Kind.BACKWARD else torch.randint(0, 256, (2, 17))
    Z = torch.randn(2, 16, 8)
    Z[1, 3, 5] = -3e38
    data = loose.encode(kind, microbatch=0, step=0, Z=Z, tokens=tokens)
    with pytest.raises(
        ActivationCodecError, match=rf"{kind.name} message holds \|value\| = [23][.0-9]*e\+38, above"
    ):
        _codec(wire_dtype=wire_dtype).decode(data)
    assert torch.equal(loose.decode(data).Z, Z.to(loose.decode(data).Z.dtype))


def test_magnitude_bound_keeps_honest_values_and_can_be_raised() -> None:
    codec = _codec()
    assert codec.max_abs == MAX_ABS == PipelineSpec().wire_max_abs == 1e6
    tiny = torch.randn(2, 16, 8) * 1e-30  # activation gradients can be tiny: no lower bound
    at_bound = torch.randn(2, 16, 8).clamp(-1, 1) * 1e6  # |Z| up to the bound itself is accepted
    for Z in (tiny, at_bound, torch.zeros(2, 16, 8)):
        assert torch.equal(codec.decode(codec.encode(Kind.BACKWARD, microbatch=0, step=0, Z=Z)).Z, Z)
    big = torch.full((2, 16, 8), 5e6)
    with pytest.raises(ValueError, match=r"refusing to send \|value\| = 5e\+06 in a BACKWARD message: above"):
        codec.encode(Kind.BACKWARD, microbatch=0, step=0, Z=big)  # the sender refuses, too
    raised = _codec(max_abs=1e7)
    assert torch.equal(raised.decode(raised.encode(Kind.BACKWARD, microbatch=0, step=0, Z=big)).Z, big)
    for bad in (0.0, -1.0, float("nan"), float("inf"), True, "1e6"):
        with pytest.raises(ValueError, match="max_abs=.* must be a positive finite number"):
            _codec(max_abs=bad)
    with pytest.raises(
        ValueError, match=r"pipeline.wire_max_abs=0.5 must be a finite number in \[1, 3e\+38\]"
    ):
        PipelineSpec(wire_max_abs=0.5)


def test_encode_refuses_bad_input() -> None:
    codec = _codec()
    with pytest.raises(ValueError, match=r"Z has shape \(2, 16, 9\)"):
        codec.encode(
            Kind.FORWARD,
            microbatch=0,
            step=0,
            Z=torch.randn(2, 16, 9),
            tokens=torch.zeros(2, 17, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="needs token ids"):
        codec.encode(Kind.FORWARD, microbatch=0, step=0, Z=torch.randn(2, 16, 8))
    with pytest.raises(ValueError, match="carries no token ids"):
        codec.encode(
            Kind.BACKWARD,
            microbatch=0,
            step=0,
            Z=torch.randn(2, 16, 8),
            tokens=torch.zeros(2, 17, dtype=torch.long),
        )
    with pytest.raises(ValueError, match="use bfloat16"):
        _codec(wire_dtype="float16").encode(
            Kind.BACKWARD, microbatch=0, step=0, Z=torch.full((2, 16, 8), 1e6)
        )
    with pytest.raises(ValueError, match="does not fit the header"):
        codec.encode(Kind.BACKWARD, microbatch=-1, step=0, Z=torch.randn(2, 16, 8))
    with pytest.raises(ValueError, match="k=65"):
        _codec(k=65)


def test_payload_is_under_13_percent_of_dense_at_one_eighth() -> None:
    b, L, d, k = 8, 256, 256, 32
    dense = dense_bytes(b, L, d)
    assert dense == 32 + b * L * d * 4
    fwd = payload_bytes(b, L, k, "float32", 256, Kind.FORWARD)
    bwd = payload_bytes(b, L, k, "float32", 256, Kind.BACKWARD)
    assert fwd == 32 + b * L * k * 4 + b * (L + 1)  # header + Z + uint8 token ids
    assert fwd / dense <= 0.13 and bwd / dense <= 0.13
    codec = ActivationCodec(d=d, k=k, vocab=256, seq_len=L)
    assert codec.ratio(b) == pytest.approx(dense / fwd) and codec.ratio(b) > 7.9
    assert (
        len(
            codec.encode(
                Kind.FORWARD,
                microbatch=0,
                step=0,
                Z=torch.zeros(b, L, k),
                tokens=torch.zeros(b, L + 1, dtype=torch.long),
            )
        )
        == fwd
    )


# --- the constraint and the exactness of a split pipeline --------------------------------------------


def test_plan_nested_widths() -> None:
    ranges = [(0, 1), (1, 3), (3, 4)]
    p = subspace_plan(SPEC, PipelineSpec(link_k=[32, 16]), ranges)
    # link 0 is before link 1: everything it carries is already in span(U_16)
    assert (p.wire_k, p.k_max, p.embed_k, p.write_k) == ((16, 16), 16, 16, {0: 16, 1: 16, 2: 16})
    p = subspace_plan(SPEC, PipelineSpec(link_k=[16, 32]), ranges)
    assert (p.wire_k, p.k_max, p.embed_k, p.write_k) == ((16, 32), 32, 16, {0: 16, 1: 32, 2: 32})
    p = subspace_plan(SPEC, PipelineSpec(link_k=[256, 32]), ranges)  # a dense link before a compressed one
    assert (p.wire_k, p.write_k) == ((32, 32), {0: 32, 1: 32, 2: 32})
    p = subspace_plan(SPEC, PipelineSpec(link_k=[32, 256]), ranges)
    assert (p.wire_k, p.write_k) == ((32, 256), {0: 32})
    p = subspace_plan(SPEC, PipelineSpec(), ranges)
    assert (p.wire_k, p.k_max, p.write_k) == ((256, 256), None, {})
    with pytest.raises(ValueError, match="2 links"):
        subspace_plan(SPEC, PipelineSpec(link_k=[32]), ranges)
    with pytest.raises(ValueError, match="contiguous"):
        subspace_plan(SPEC, PipelineSpec(link_k=[32]), [(0, 2), (3, 4)])


def _pipeline_step(stages: list[Stage], codecs: list, tokens: torch.Tensor, step: int) -> float:
    """One forward+backward through the stages; every boundary crosses as encoded bytes, as over TCP."""
    x: torch.Tensor = tokens[:, :-1]  # (b, L) token ids
    outs, leaves = [], []
    loss = None
    for s, stage in enumerate(stages):
        out = stage(x)
        if s == len(stages) - 1:
            loss = lm_loss(out, tokens)
            break
        _, codec_out = codecs[s]
        codec_in, _ = codecs[s + 1]
        kind, got_step, mb, X_hat, got_tokens = codec_in.unpack_fwd(
            codec_out.pack_fwd("train", step, 0, out, tokens)
        )
        assert (kind, got_step, mb) == ("train", step, 0) and torch.equal(got_tokens, tokens)
        x = X_hat.requires_grad_(True)  # (b, L, d) leaf
        outs.append(out)
        leaves.append(x)
    assert loss is not None
    loss.backward()
    for s in reversed(range(len(stages) - 1)):
        codec_in, _ = codecs[s + 1]
        _, codec_out = codecs[s]
        _, _, G_X = codec_out.unpack_bwd(
            codec_in.pack_bwd(step, 0, leaves[s].grad)
        )  # G_Z = G U, then G_Z U^T
        outs[s].backward(G_X)
    return float(loss.detach())


@pytest.mark.parametrize(
    ("ranges", "link_k"),
    [([(0, 2), (2, 4)], [32]), ([(0, 1), (1, 3), (3, 4)], [32, 16]), ([(0, 1), (1, 3), (3, 4)], [16, 32])],
    ids=["2-stage-k32", "3-stage-k32-k16", "3-stage-k16-k32"],
)
def test_compressed_pipeline_equals_constrained_model_in_one_piece(ranges, link_k) -> None:
    torch.manual_seed(0)
    pspec = PipelineSpec(link_k=link_k)
    ref = build_full_model(SPEC)
    constrain_stage(ref, SPEC, pspec, ranges)
    stages = [build_stage(SPEC, ranges, s) for s in range(len(ranges))]
    for s, stage in enumerate(stages):
        constrain_stage(stage, SPEC, pspec, ranges, s)
    codecs = [boundary_codecs(stage, SPEC, pspec, ranges, s) for s, stage in enumerate(stages)]
    plan = subspace_plan(SPEC, pspec, ranges)
    assert [c[1].codec.k for c in codecs[:-1]] == list(plan.wire_k) and max(plan.wire_k) <= SPEC.d_model // 8
    # Adam's first step is lr * g / (|g| + eps): fp32 rounding of ~1e-8 on a ~1e-7 gradient entry would move
    # the default-eps (1e-8) update by ~lr/10. eps=1e-5 bounds that amplification, so the parameters after
    # the steps can be compared at 1e-5 too.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5)
    opts = [torch.optim.AdamW(s.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-5) for s in stages]
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        tokens = _tokens(2, seed=step)
        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(tokens[:, :-1]), tokens)
        ref_loss.backward()
        raw = {n: p.grad.clone() for n, p in ref.named_parameters()}
        loss = _pipeline_step(stages, codecs, tokens, step)
        assert abs(loss - float(ref_loss.detach())) < 1e-5
        project_grads_(ref)
        worst_raw = 0.0
        for stage in stages:
            project_grads_(stage)
            for name, p in stage.named_parameters():
                assert p.grad is not None
                torch.testing.assert_close(p.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)
                worst_raw = max(worst_raw, float((p.grad - raw[name]).abs().max()))
        assert worst_raw > 1e-4  # without projecting, the constrained writers' gradients do differ
        for opt in [ref_opt, *opts]:
            opt.step()
            opt.zero_grad()
        for m in [ref, *stages]:
            project_weights_(m)
            assert off_subspace(m) < 1e-5
        for stage in stages:
            for name, p in stage.named_parameters():
                torch.testing.assert_close(p, ref_params[name], atol=1e-5, rtol=1e-4, msg=name)


def test_unconstrained_model_is_not_exact_over_a_compressed_link() -> None:
    # Negative control: the same split and link without the constraint loses what is off span(U).
    ranges, pspec = [(0, 2), (2, 4)], PipelineSpec(link_k=[32])
    stages = [build_stage(SPEC, ranges, s) for s in range(2)]
    U = basis(SPEC.d_model, 32, pspec.projection_seed)
    codec = SubspaceBoundary(ActivationCodec(d=256, k=32, vocab=256, seq_len=SPEC.seq_len), U, None)
    tokens = _tokens()
    with torch.no_grad():
        X = stages[0](tokens[:, :-1])  # (b, L, d)
        _, _, _, X_hat, _ = codec.unpack_fwd(codec.pack_fwd("train", 0, 0, X, tokens))
        assert float((X_hat - X).norm() / X.norm()) > 0.5  # most of an unconstrained state is off span(U)
        lossy, exact = lm_loss(stages[1](X_hat), tokens), lm_loss(stages[1](X), tokens)
    assert abs(float(lossy) - float(exact)) > 1e-3


def test_adamw_step_then_projection_keeps_writers_in_span() -> None:
    ranges, pspec = [(0, 2), (2, 4)], PipelineSpec(link_k=[32])
    stage = build_stage(SPEC, ranges, 0)
    constrain_stage(stage, SPEC, pspec, ranges, 0)
    names = [c.name for c in stage.subspace_constraints]  # type: ignore[attr-defined]
    assert names == ["embed.weight"] + [
        f"layers.{i}.{w}" for i in (0, 1) for w in ("attn.wo.weight", "mlp.w_down.weight")
    ]
    assert off_subspace(stage) < 1e-6
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.1)
    stage(_tokens()[:, :-1]).pow(2).mean().backward()
    project_grads_(stage)
    opt.step()
    assert off_subspace(stage) > 1e-2  # Adam's elementwise scaling leaves span(U) ...
    project_weights_(stage)
    assert off_subspace(stage) < 1e-6  # ... and the projection brings it back
    U = stage.subspace_U[:, :32]
    W = stage.layers["1"].mlp.w_down.weight
    torch.testing.assert_close(U @ (U.T @ W), W, atol=1e-6, rtol=0)
    E = stage.embed.weight  # type: ignore[union-attr]
    torch.testing.assert_close(E @ U @ U.T, E, atol=1e-6, rtol=0)


def test_dense_pipeline_is_untouched() -> None:
    ranges, pspec = [(0, 2), (2, 4)], PipelineSpec()
    stage = build_stage(SPEC, ranges, 0)
    before = {n: p.clone() for n, p in stage.named_parameters()}
    constrain_stage(stage, SPEC, pspec, ranges, 0)
    assert stage.token_table is None and off_subspace(stage) == 0.0
    assert all(torch.equal(p, before[n]) for n, p in stage.named_parameters())
    codec_in, codec_out = boundary_codecs(stage, SPEC, pspec, ranges, 0)
    assert codec_in is None and codec_out is not None and codec_out.U is None and codec_out.codec.k == 256
    assert codec_out.codec.max_abs == pspec.wire_max_abs
    bound = boundary_codecs(stage, SPEC, PipelineSpec(wire_max_abs=2e7), ranges, 0)[1]
    assert bound is not None and bound.codec.max_abs == 2e7  # the run spec's bound reaches the codec
    h, tokens = torch.randn(2, SPEC.seq_len, 256), _tokens()
    assert torch.equal(codec_out.unpack_fwd(codec_out.pack_fwd("eval", 1, 0, h, tokens))[3], h)


def test_misuse_is_refused() -> None:
    ranges, pspec = [(0, 2), (2, 4)], PipelineSpec(link_k=[32])
    stage = build_stage(SPEC, ranges, 1)
    with pytest.raises(ValueError, match="call constrain_stage"):
        boundary_codecs(stage, SPEC, pspec, ranges, 1)
    with pytest.raises(ValueError, match=r"ranges\[0\] is \(0, 2\)"):
        constrain_stage(stage, SPEC, pspec, ranges, 0)
    with pytest.raises(ValueError, match="do not align"):
        constrain_stage(Stage(SPEC, 1, 4, first=False, last=True), SPEC, pspec, ranges)

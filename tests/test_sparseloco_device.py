"""SparseLoCo on the device (protocol/codecs/sparseloco_device.py) against the numpy reference (protocol/codecs/sparseloco.py)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codecs.sparseloco import (
    CompressedFragment,
    SparseLoCoConfig,
    compress,
    decompress,
    error_feedback_step,
    rounding_key,
)
from protocol.codecs.sparseloco_device import compress_device, decompress_to, error_feedback_step_device
from protocol.codecs.sparseloco_format import FragmentError, FragmentHeader, decode_fragment, encode_fragment
from protocol.identity import Identity

ALICE = Identity.from_seed(bytes(range(32)))
WHERE = {"run_id": "run-test", "stage": 1, "fragment": 2, "round": 7, "replica": 3, "tokens": 2048}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Edge tiles (100 x 70, 130 x 200), tail chunks (3-D, flat), 1-D and 0-D tensors sent dense.
SHAPES = [(100, 70), (128, 192), (130, 200), (3, 5, 700), (50,), (), (7,)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().float().contiguous().view(torch.int32)


def _tensors(shapes: list[tuple[int, ...]], seed: int, ties: bool = True) -> list[torch.Tensor]:
    """Gaussian tensors of varied scale; with ties: zero runs, few distinct values, sparse chunks."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for j, s in enumerate(shapes):
        x = torch.randn(s, generator=g) * 10.0 ** float(torch.empty(()).uniform_(-2, 2, generator=g))
        if ties and x.dim() >= 2:
            f = x.view(-1)
            f[: f.numel() // 3] = 0.0  # whole chunks of zeros: ties at the threshold, all-zero scale codes
            mid = slice(f.numel() // 3, f.numel() // 2)
            f[mid] = torch.randint(-2, 3, (len(range(*mid.indices(f.numel()))),), generator=g) * 0.5
            if j % 2:  # a chunk with fewer nonzeros than k: zeros are kept after the few nonzeros
                f[-4096:] = 0.0
                f[-3] = 1.0
        out.append(x)
    return out


def _assert_same_selection(a: CompressedFragment, b: CompressedFragment) -> None:
    assert a.shapes == b.shapes and a.cfg == b.cfg
    for name in ("idx", "codes", "chunk_scale", "ref_scale", "table", "dense", "dense_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
    assert np.array_equal(a.idx, b.idx)  # exactly the reference's kept entries, ties included
    assert np.array_equal(a.dense, b.dense) and np.array_equal(a.dense_scale, b.dense_scale)
    assert np.array_equal(a.ref_scale, b.ref_scale)


def _assert_close_values(a: CompressedFragment, b: CompressedFragment) -> None:
    """The quantizer runs its float64 sums in another order: codes and tables agree but for rare bits."""
    n = max(len(a.codes), 1)
    assert (a.codes != b.codes).sum() <= 0.01 * n + 1
    assert (a.chunk_scale != b.chunk_scale).sum() <= 0.01 * len(a.chunk_scale) + 1
    for x, y in zip(decompress(a), decompress(b), strict=True):
        close = torch.isclose(x, y, rtol=1e-5, atol=0.0)
        assert close.float().mean() >= 0.99


# ---- same kept entries and values as the reference ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cfg",
    [
        SparseLoCoConfig(),
        SparseLoCoConfig(chunk=64, k=5, value_bits=3),
        SparseLoCoConfig(chunk=256, k=7, value_bits=1, dense_1d=False),
        SparseLoCoConfig(chunk=16, k=16, value_bits=4),
    ],
)
def test_compress_matches_reference(device: str, cfg: SparseLoCoConfig) -> None:
    for seed, ties in [(0, True), (1, False)]:
        xs = _tensors(SHAPES, seed, ties)
        ref = compress(xs, cfg)
        dev = compress_device([x.to(device) for x in xs], cfg)
        _assert_same_selection(ref, dev)
        _assert_close_values(ref, dev)


def test_all_zero_and_constant_tensors() -> None:
    cfg = SparseLoCoConfig(chunk=64, k=4)
    xs = [torch.zeros(20, 20), torch.full((9, 30), -2.5), torch.zeros(5), torch.ones(3, 3, 3)]
    ref, dev = compress(xs, cfg), compress_device(xs, cfg)
    _assert_same_selection(ref, dev)
    for name in ("codes", "chunk_scale", "table"):
        assert np.array_equal(getattr(ref, name), getattr(dev, name)), name


@FAST
@given(
    shapes=st.lists(
        st.one_of(
            st.tuples(st.integers(1, 300)),
            st.tuples(st.integers(1, 150), st.integers(1, 150)),
            st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 40)),
            st.just(()),
        ),
        min_size=1,
        max_size=3,
    ),
    chunk=st.sampled_from([16, 64, 256, 4096]),
    k=st.integers(1, 64),
    value_bits=st.integers(1, 4),
    dense_1d=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    zeros=st.sampled_from([0.0, 0.3, 0.99]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_compress_matches_reference_random(
    shapes, chunk, k, value_bits, dense_1d, seed, zeros, dtype
) -> None:
    cfg = SparseLoCoConfig(chunk=chunk, k=min(k, chunk), value_bits=value_bits, dense_1d=dense_1d)
    rng = np.random.default_rng(seed)
    xs = []
    for s in shapes:
        x = rng.standard_normal(s) * 10.0 ** rng.uniform(-3, 3)
        x = np.where(rng.random(s) < zeros, 0.0, x)
        xs.append(torch.from_numpy(np.asarray(x, np.float32)).to(dtype))
    ref, dev = compress(xs, cfg), compress_device(xs, cfg)
    _assert_same_selection(ref, dev)
    _assert_close_values(ref, dev)


# ---- error feedback --------------------------------------------------------------------------------------


def _state(device: str, seed: int, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    e = [x.to(device) for x in _tensors(SHAPES, seed)]
    delta = [x.to(device, dtype) for x in _tensors(SHAPES, seed + 100, ties=False)]
    return e, delta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_identity_in_place(device: str, dtype: torch.dtype) -> None:
    cfg = SparseLoCoConfig(chunk=256, k=8, beta=0.9)
    e, delta = _state(device, 3, dtype)
    e_prime = [torch.add(d.float(), x, alpha=cfg.beta) for x, d in zip(e, delta, strict=True)]
    ptrs = [x.data_ptr() for x in e]
    cf, e_new = error_feedback_step_device(e, delta, cfg)
    assert [x.data_ptr() for x in e_new] == ptrs and all(a is b for a, b in zip(e, e_new, strict=True))
    dec = decompress(cf)
    for ep, en, d in zip(e_prime, e_new, dec, strict=True):
        assert en.device.type == device and en.dtype == torch.float32
        assert torch.equal(_bits(en), _bits(ep.cpu() - d))  # e_new == e' - decode(c), bit for bit
        lhs = ep.cpu()  # beta * e + delta == e_new + decompress(c) to float32 rounding
        torch.testing.assert_close(en.cpu() + d, lhs, rtol=2e-6, atol=2e-6 * float(lhs.abs().max()))


def test_error_feedback_matches_reference_step() -> None:
    cfg = SparseLoCoConfig(chunk=64, k=3, beta=0.95)
    e, delta = _state("cpu", 5, torch.bfloat16)
    ref_cf, ref_e = error_feedback_step(e, delta, cfg)
    cf, e_new = error_feedback_step_device([x.clone() for x in e], delta, cfg)
    _assert_same_selection(ref_cf, cf)
    _assert_close_values(ref_cf, cf)
    for a, b in zip(ref_e, e_new, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_signed_fragment_decodes_to_what_was_subtracted(device: str) -> None:
    cfg = SparseLoCoConfig()
    e, delta = _state(device, 7)
    before = [x.clone() for x in e]
    cf, e_new = error_feedback_step_device(e, delta, cfg)
    wire = encode_fragment(ALICE, FragmentHeader.of(cf, **WHERE), cf)
    _, got, signer = decode_fragment(wire, trusted={ALICE.public_key})
    assert signer == ALICE.public_key
    for x0, d, en, out in zip(before, delta, e_new, decompress(got), strict=True):
        e_prime = torch.add(d.float(), x0, alpha=cfg.beta)
        assert torch.equal(_bits(en), _bits(e_prime.cpu() - out))
    for a, b in zip(decompress_to(got, device), decompress_to(cf, device), strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_input_raises_and_leaves_e_untouched(device: str) -> None:
    cfg = SparseLoCoConfig(chunk=64, k=4)
    for bad, what in [(2, float("nan")), (0, float("inf")), (4, float("nan")), (6, -float("inf"))]:
        e, delta = _state(device, 9)
        delta[bad].view(-1)[3] = what
        before = [x.clone() for x in e]
        with pytest.raises(ValueError, match=f"tensor {bad} holds non-finite"):
            error_feedback_step_device(e, delta, cfg)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(before, e, strict=True))
        with pytest.raises(ValueError, match=f"tensor {bad} holds non-finite"):
            compress_device(delta, cfg)


def test_rejects_bad_arguments() -> None:
    cfg = SparseLoCoConfig()
    with pytest.raises(ValueError, match="2 buffers but 1"):
        error_feedback_step_device([torch.zeros(3), torch.zeros(3)], [torch.zeros(3)], cfg)
    with pytest.raises(ValueError, match=r"buffer \(3,\) vs delta \(4,\)"):
        error_feedback_step_device([torch.zeros(3)], [torch.zeros(4)], cfg)
    with pytest.raises(ValueError, match="contiguous float32"):
        error_feedback_step_device([torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(3)], cfg)
    with pytest.raises(ValueError, match="contiguous float32"):
        error_feedback_step_device([torch.zeros(4, 4).t()], [torch.zeros(4, 4)], cfg)
    with pytest.raises(ValueError, match="floating-point"):
        compress_device([torch.zeros(3, dtype=torch.int64)], cfg)
    with pytest.raises(ValueError, match="empty"):
        compress_device([torch.zeros(0, 5)], cfg)


# ---- decoding on the device --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cfg", [SparseLoCoConfig(), SparseLoCoConfig(chunk=64, k=5, value_bits=3, dense_1d=False)]
)
def test_decompress_to_is_bit_identical(device: str, cfg: SparseLoCoConfig) -> None:
    xs = _tensors(SHAPES, 11)
    for cf in (compress(xs, cfg), compress_device([x.to(device) for x in xs], cfg)):
        for a, b in zip(decompress(cf), decompress_to(cf, device), strict=True):
            assert b.device.type == device and b.dtype == torch.float32 and a.shape == b.shape
            assert torch.equal(_bits(a), _bits(b))


def _forged(cf: CompressedFragment) -> list[tuple[CompressedFragment, str]]:
    """Fragments a replica with a valid key could sign (finite on the wire) and what each breaks."""
    f32max = np.float32(np.finfo(np.float32).max)

    def put(name: str, at: tuple[int, ...], v: float) -> CompressedFragment:
        a = getattr(cf, name).copy()
        a[at] = v
        return dataclasses.replace(cf, **{name: a})

    return [
        (put("table", (0, 1), 3e38), r"tensor 0: bin-mean table holds 3e\+38"),
        (put("ref_scale", (0,), f32max), "tensor 0: table x scale = .* overflows float32"),
        (put("table", (1, 0), np.nan), "tensor 1: bin-mean table holds a non-finite value"),
        (put("ref_scale", (2,), -1.0), "tensor 2: tensor scale -1 is not a finite non-negative number"),
        (put("dense", (0,), np.inf), r"tensor 4: dense value inf lies outside \[-1, 1\]"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_decompress_to_rejects_what_decompress_rejects(device: str) -> None:
    """Both decoders run the same check on the host arrays: same inputs rejected, with the same message."""
    cf = compress(_tensors(SHAPES, 13), SparseLoCoConfig())
    for bad, msg in _forged(cf):
        with pytest.raises(FragmentError, match=msg) as on_host:
            decompress(bad)
        with pytest.raises(FragmentError, match=msg) as on_device:
            decompress_to(bad, device)
        assert str(on_host.value) == str(on_device.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [1e-44, 1e-30, 1.0, 1e30, 1e36])
def test_honest_device_encodes_are_never_rejected(device: str, scale: float) -> None:
    """Heavy-tailed, spiky, subnormal and huge tensors: the device encoder's fragments decode, bit-identical
    on both paths, with tables inside the derived bound 1.5 * 2^(1/16) sqrt(k) < 2 sqrt(k)."""
    rng = np.random.default_rng(round(math.log10(scale)) + 50)
    xs = []
    for j, s in enumerate([(130, 70), (3, 700), (40,)]):
        n = math.prod(s)
        x = rng.standard_cauchy(n) if j == 0 else rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 8)
        if j == 1:
            x[rng.random(n) < 0.99] = 0.0  # chunks that keep one nonzero: |y| up to sqrt(k)
        xs.append(torch.from_numpy(np.asarray(x / np.abs(x).max() * scale, np.float32).reshape(s)))
    for cfg in [SparseLoCoConfig(), SparseLoCoConfig(chunk=64, k=3, value_bits=4)]:
        cf = compress_device([x.to(device) for x in xs], cfg)
        assert np.abs(cf.table).max() <= 1.5 * 2 ** (1 / 16) * math.sqrt(cfg.k) * (1 + 1e-6)
        for a, b in zip(decompress(cf), decompress_to(cf, device), strict=True):
            assert torch.isfinite(a).all() and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("device", DEVICES)
def test_values_too_large_to_decode_are_refused_and_leave_e_untouched(device: str) -> None:
    x = torch.zeros(64, 128, device=device)
    x[:, :64] = 1e38  # tile 0: y = 1, ref = 1e38
    x[0, 64] = 1e38  # alone in tile 1: y = 8 in its own bin, and 8 x 1e38 overflows float32
    cfg = SparseLoCoConfig(value_bits=4)
    with pytest.raises(ValueError, match="tensor 0: table x scale = 8e\\+38 overflows float32 .*; refusing"):
        compress_device([x], cfg)
    e = [torch.ones(64, 128, device=device)]
    with pytest.raises(ValueError, match="refusing to compress"):
        error_feedback_step_device(e, [x], cfg)
    assert bool((e[0] == 1).all())


def test_only_dense_tensors_and_empty_list() -> None:
    cfg = SparseLoCoConfig()
    e, delta = [torch.ones(5), torch.zeros(())], [torch.randn(5), torch.tensor(2.0)]
    cf, e_new = error_feedback_step_device(e, delta, cfg)
    assert cf.idx.shape == (0,) and cf.table.shape == (0, 4) and cf.dense.dtype == np.float16
    assert [tuple(x.shape) for x in decompress_to(cf, "cpu")] == [(5,), ()]
    cf, e_new = error_feedback_step_device([], [], cfg)
    assert cf.shapes == () and e_new == [] and decompress_to(cf, "cpu") == []


def test_codec_imports_without_cryptography_or_node_dependencies() -> None:
    """The device codec and the wire format (bar signing) load where only torch, numpy, msgpack exist."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"cryptography", "base58", "hivemind", "boto3", "psutil"}:
                    raise ImportError(f"blocked: {name}")

        sys.meta_path.insert(0, Blocker())
        import torch
        from protocol.codecs.sparseloco import SparseLoCoConfig
        from protocol.codecs.sparseloco_device import compress_device, decompress_to
        from protocol.codecs.sparseloco_format import FragmentHeader, pack_payload, unpack_payload

        cfg = SparseLoCoConfig()
        cf = compress_device([torch.randn(130, 70), torch.randn(9)], cfg)
        cf2 = unpack_payload(pack_payload(cf), cf.shapes, cfg)
        FragmentHeader.of(cf, run_id="r", stage=0, fragment=0, round=0, replica=0, tokens=1)
        assert all(torch.equal(a, b) for a, b in zip(decompress_to(cf, "cpu"), decompress_to(cf2, "cpu")))
        print("ok")
        """
    )
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


# ---- stochastic rounding (sync.stochastic_rounding) ------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_bits", [2, 3])
def test_stochastic_rounding_is_the_references_on_the_device(device: str, value_bits: int) -> None:
    """Same key, same draws, same entries: the device path codes what the reference codes (but for the
    quantizer's rare last bits, as deterministic rounding), and both decode their Lloyd centers."""
    cfg = SparseLoCoConfig(chunk=64, k=5, value_bits=value_bits)
    key = rounding_key("run-test", 1, 2, 7, 3)
    for seed, ties in [(0, True), (1, False)]:
        xs = _tensors(SHAPES, seed, ties)
        ref = compress(xs, cfg, key)
        dev = compress_device([x.to(device) for x in xs], cfg, key)
        _assert_same_selection(ref, dev)
        _assert_close_values(ref, dev)
        L = 1 << (value_bits - 1)
        assert np.array_equal(ref.table[:, :L], -ref.table[:, L:])  # centers, both signs: not bin means
    again = compress(_tensors(SHAPES, 0, True), cfg, key)
    assert np.array_equal(again.codes, compress(_tensors(SHAPES, 0, True), cfg, key).codes)


def test_stochastic_rounding_is_unbiased_between_the_outer_levels() -> None:
    """Over many keys the decoded kept values average to the values themselves (between the lowest and the
    highest level), where nearest rounding keeps its bias; error feedback holds the rest, exactly."""
    cfg = SparseLoCoConfig(chunk=256, k=32)
    x = [torch.randn(64, 64, generator=torch.Generator().manual_seed(3))]
    det = compress(x, cfg)
    rows = torch.from_numpy(decompress(det)[0].view(-1).nonzero()[:, 0].numpy())
    kept = x[0].view(-1)[rows].double()
    got = torch.stack(
        [
            decompress(compress(x, cfg, rounding_key("r", 0, 0, n, 0)))[0].view(-1)[rows].double()
            for n in range(400)
        ]
    )
    inner = got.min(0).values < got.max(0).values  # coded as either level around it: between the outer two
    assert inner.float().mean() > 0.5
    scale = float(kept.abs().mean())
    bias_sr = float((got.mean(0) - kept)[inner].abs().mean()) / scale
    bias_det = float((decompress(det)[0].view(-1)[rows].double() - kept)[inner].abs().mean()) / scale
    assert bias_sr < 0.3 * bias_det, (bias_sr, bias_det)
    e = [torch.zeros(64, 64)]
    cf, e_new = error_feedback_step(e, x, cfg, rounding_key("r", 0, 0, 1, 0))
    assert torch.allclose(e_new[0] + decompress(cf)[0], x[0], atol=1e-6)


def test_the_codec_rounds_stochastically_when_the_run_spec_says_so() -> None:
    from node.sync.outer_sync import FragmentId
    from node.sync.sparseloco_sync import SparseLoCoCodec, make_sync_parts
    from protocol.runspec import RunSpec, SyncSpec

    spec = RunSpec(run_id="sr", sync=SyncSpec(stochastic_rounding=True))
    codec = make_sync_parts(spec, ALICE).codec
    assert isinstance(codec, SparseLoCoCodec) and codec.stochastic
    fid = FragmentId(run_id="sr", stage=0, fragment=0, round=4, replica=1)
    delta = _tensors([(100, 70)], 5, ties=False)
    a, _ = SparseLoCoCodec(ALICE, codec.cfg, stochastic=True).encode(fid, delta, 64)()
    b, _ = SparseLoCoCodec(ALICE, codec.cfg, stochastic=True).encode(fid, delta, 64)()
    c, _ = SparseLoCoCodec(ALICE, codec.cfg).encode(fid, delta, 64)()
    assert a == b and a != c  # the same bytes from the same fragment identity; not nearest rounding's
    with pytest.raises(ValueError, match="sync.stochastic_rounding"):
        SyncSpec(stochastic_rounding="yes")  # type: ignore[arg-type]

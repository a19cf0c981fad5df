"""SparseLoCo codec (protocol/codecs/sparseloco*.py) and aggregation (node/sync/aggregation.py)."""

from __future__ import annotations

import hashlib
import math
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.sync.aggregation import (
    aggregate,
    mean_over_arrivals,
    median_norm_clip,
    norm,
    per_coordinate_mean,
    screen,
)
from protocol.codecs import sparseloco_format
from protocol.codecs.sparseloco import (
    CompressedFragment,
    SparseLoCoConfig,
    _chunk_scales,
    check_values,
    compress,
    decompress,
    error_feedback_step,
    kept_indices,
    layout,
    table_bound,
)
from protocol.codecs.sparseloco_format import (
    MAGIC,
    FragmentError,
    FragmentHeader,
    FragmentMismatch,
    FragmentSignatureError,
    FragmentVersionError,
    UntrustedFragmentSigner,
    decode_fragment,
    encode_fragment,
    golomb_decode,
    golomb_encode,
    pack_payload,
    ratio,
    seal_payload,
)
from protocol.envelope import UntrustedSigner, VersionError
from protocol.identity import Identity
from protocol.schema import ProtocolError, to_dict
from protocol.sync_settings import AggregationSettings

ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))
WHERE = {"run_id": "run-test", "stage": 1, "fragment": 2, "round": 7, "replica": 3, "tokens": 2048}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- helpers -----------------------------------------------------------------------------------------


def _chunk_of(shape: tuple[int, ...], cfg: SparseLoCoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: chunk id of every element (flat order) and each chunk's element count."""
    t = cfg.tile
    if len(shape) == 2:
        m, n = shape
        r, c = torch.meshgrid(torch.arange(m), torch.arange(n), indexing="ij")
        ch = (r // t) * -(-n // t) + c // t
    else:
        ch = torch.arange(math.prod(shape)) // cfg.chunk
    ch = ch.reshape(-1)
    return ch, torch.bincount(ch)


def _split(data: bytes) -> tuple[bytes, bytes]:
    """(header bytes, payload) of a frame."""
    (hlen,) = struct.unpack_from("<I", data, 5)
    (plen,) = struct.unpack_from("<I", data, 9 + hlen)
    return data[9 : 9 + hlen], data[13 + hlen : 13 + hlen + plen]


def _fragment(
    seed: int = 0, cfg: SparseLoCoConfig | None = None
) -> tuple[list[torch.Tensor], CompressedFragment]:
    g = torch.Generator().manual_seed(seed)
    xs = [
        torch.randn(100, 130, generator=g),
        torch.randn(50, generator=g),
        torch.randn(2, 3, 700, generator=g),
    ]
    return xs, compress(xs, cfg or SparseLoCoConfig())


def _sealed(cf: CompressedFragment, payload: bytes | None = None, **over: object) -> bytes:
    header = FragmentHeader.of(cf, **{**WHERE, **over})  # type: ignore[arg-type]
    return seal_payload(ALICE, header, pack_payload(cf) if payload is None else payload)


shape_st = st.one_of(
    st.tuples(st.integers(1, 300)),
    st.tuples(st.integers(1, 150), st.integers(1, 150)),
    st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 40)),
    st.just(()),
)
cfg_st = st.sampled_from([16, 64, 256, 4096]).flatmap(
    lambda chunk: st.builds(
        SparseLoCoConfig,
        chunk=st.just(chunk),
        k=st.one_of(st.integers(1, max(1, chunk // 16)), st.just(chunk)),
        beta=st.floats(0.0, 1.0),
        value_bits=st.integers(1, 4),
        dense_1d=st.booleans(),
    )
)
dtype_st = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def _tensors(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int, zeros: float
) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for s in shapes:
        x = np.asarray(rng.standard_normal(s) * 10.0 ** rng.uniform(-2, 2))
        x[np.asarray(rng.random(s) < zeros)] = 0.0  # zeros make ties at the top-k threshold
        out.append(torch.from_numpy(np.asarray(x, np.float32)).to(dtype))
    return out


# ---- config and layout -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"chunk": 4000}, "perfect square"),
        ({"chunk": 0}, "perfect square"),
        ({"k": 0}, r"k=0 must be in \[1"),
        ({"k": 4097}, "k=4097"),
        ({"beta": 1.5}, "beta"),
        ({"value_bits": 5}, "value_bits=5"),
        ({"dense_1d": 1}, "bool"),
    ],
)
def test_config_rejects_bad_values(kw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        SparseLoCoConfig(**kw)


def test_layout_tiles_2d_and_scales_k_on_edges() -> None:
    lay = layout(((130, 200), (2, 2500, 1), (7,)), SparseLoCoConfig())
    assert lay.sparse == (0, 1) and lay.dense == (2,)
    assert lay.n_chunks == 3 * 4 + 2  # 3 x 4 tiles of 64, then 5000 flattened into 2 chunks
    assert lay.u[:4].tolist() == [4096, 4096, 4096, 64 * 8]  # 200 = 3 * 64 + 8
    assert lay.u[8:12].tolist() == [2 * 64, 2 * 64, 2 * 64, 2 * 8]  # 130 = 2 * 64 + 2
    assert lay.k[:4].tolist() == [64, 64, 64, 8] and lay.k[-4:].tolist() == [2, 1, 64, 15]
    assert int(lay.u.sum()) == 130 * 200 + 5000 and lay.n_dense == 7


# ---- compress / decompress ---------------------------------------------------------------------------


@FAST
@given(
    shapes=st.lists(shape_st, min_size=1, max_size=3),
    cfg=cfg_st,
    dtype=dtype_st,
    seed=st.integers(0, 2**32 - 1),
    zeros=st.sampled_from([0.0, 0.0, 0.3, 0.99]),
)
def test_roundtrip_keeps_topk_positions_and_quantized_values(shapes, cfg, dtype, seed, zeros) -> None:
    xs = _tensors(shapes, dtype, seed, zeros)
    cf = compress(xs, cfg)
    header = FragmentHeader.of(cf, **WHERE)
    h, cf2, signer = decode_fragment(
        encode_fragment(ALICE, header, cf), trusted={ALICE.public_key}, expect=header
    )
    assert h == header and signer == ALICE.public_key
    out, out2 = decompress(cf), decompress(cf2)
    for a, b in zip(out, out2, strict=True):
        assert torch.equal(a, b)  # the wire is lossless
    lay = cf.layout
    kept = kept_indices(cf2)
    for i, (x, o) in enumerate(zip(xs, out, strict=True)):
        x32 = x.float().reshape(-1)
        o = o.reshape(-1)
        assert o.dtype == torch.float32 and o.shape == x32.shape
        if i in lay.dense:  # fp16 relative to the max-abs
            assert (o - x32).abs().max() <= x32.abs().max() * 2**-11 * 1.001
            continue
        ch, u = _chunk_of(x.shape, cfg)
        idx = kept[i]
        assert idx is not None
        mask = torch.zeros_like(x32, dtype=torch.bool)
        mask[idx] = True
        assert len(idx) == len(torch.unique(idx))
        k_c = torch.minimum((cfg.k * u + cfg.chunk - 1) // cfg.chunk, u)
        assert torch.equal(torch.bincount(ch[mask], minlength=len(u)), k_c)
        a = x32.abs()
        lo = torch.full((len(u),), math.inf).scatter_reduce(0, ch[mask], a[mask], "amin")
        hi = torch.zeros(len(u)).scatter_reduce(0, ch[~mask], a[~mask], "amax")
        assert (lo >= hi).all(), "a dropped coordinate is larger than a kept one in its chunk"
        assert (o[~mask] == 0).all()
        nz = mask & (x32 != 0)
        assert (torch.sign(o[nz]) == torch.sign(x32[nz])).all()
    # values up to quantization: each table entry lies within the range of the y = v / s_c it stands for
    rows = np.repeat(np.arange(lay.n_chunks), lay.k)
    s = _chunk_scales(cf.chunk_scale, cf.ref_scale, lay.chunk_tensor())[rows]
    v = np.concatenate([xs[i].float().reshape(-1)[kept[i]].numpy() for i in lay.sparse] or [np.zeros(0)])
    y = np.divide(v, s, out=np.zeros_like(v), where=s > 0)
    tid = lay.chunk_tensor()[rows]
    for key in set(zip(tid.tolist(), cf.codes.tolist(), strict=True)):
        sel = (tid == key[0]) & (cf.codes == key[1])
        q = cf.table[key]
        assert y[sel].min() - 1e-5 * (1 + abs(q)) <= q <= y[sel].max() + 1e-5 * (1 + abs(q))


def test_quantization_error_on_gaussian_values() -> None:
    x = torch.randn(512, 512, generator=torch.Generator().manual_seed(1))
    errs = {}
    for b in (1, 2, 3, 4):
        cf = compress([x], SparseLoCoConfig(value_bits=b))
        o = decompress(cf)[0]
        m = o != 0
        errs[b] = float((o - x)[m].norm() / x[m].norm())
    assert errs[2] < 0.08 and errs[4] < 0.035  # Lloyd-Max bins on the top-k tail
    assert errs[1] > errs[2] > errs[3] > errs[4]


def test_zero_and_nonfinite_inputs() -> None:
    out = decompress(compress([torch.zeros(64, 64), torch.zeros(5)], SparseLoCoConfig()))
    assert all((o == 0).all() for o in out)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(70, 70)
        x[3, 69] = bad
        with pytest.raises(ValueError, match="tensor 1 holds non-finite"):
            compress([torch.randn(9, 9), x], SparseLoCoConfig())
        with pytest.raises(ValueError, match="tensor 0 holds non-finite"):
            compress([torch.tensor([1.0, bad])], SparseLoCoConfig())
    with pytest.raises(ValueError, match="empty"):
        compress([torch.zeros(0, 3)], SparseLoCoConfig())
    with pytest.raises(ValueError, match="floating-point"):
        compress([torch.ones(3, dtype=torch.int64)], SparseLoCoConfig())


@FAST
@given(
    shapes=st.lists(shape_st, min_size=1, max_size=3),
    cfg=cfg_st,
    dtype=dtype_st,
    seed=st.integers(0, 2**32 - 1),
)
def test_error_feedback_identity(shapes, cfg, dtype, seed) -> None:
    e = _tensors(shapes, torch.float32, seed, 0.0)
    delta = _tensors(shapes, dtype, seed + 1, 0.1)
    e0 = [t.clone() for t in e]
    cf, e_new = error_feedback_step(e, delta, cfg)
    assert all(torch.equal(a, b) for a, b in zip(e, e0, strict=True))  # inputs untouched
    for ei, di, en, ci in zip(e, delta, e_new, decompress(cf), strict=True):
        lhs = cfg.beta * ei + di.float()
        assert en.dtype == torch.float32
        torch.testing.assert_close(en + ci, lhs, rtol=2e-6, atol=2e-6 * float(lhs.abs().max()))


def test_error_feedback_sends_everything_eventually() -> None:
    cfg = SparseLoCoConfig(chunk=64, k=8, beta=1.0, value_bits=4)
    delta = [torch.randn(32, 32, generator=torch.Generator().manual_seed(2))]
    e, sent = [torch.zeros(32, 32)], torch.zeros(32, 32)
    cf, e = error_feedback_step(e, delta, cfg)
    sent += decompress(cf)[0]
    for _ in range(40):  # no new delta: the residual drains
        cf, e = error_feedback_step(e, [torch.zeros(32, 32)], cfg)
        sent += decompress(cf)[0]
    assert float(e[0].norm()) < 0.01 * float(delta[0].norm())
    torch.testing.assert_close(sent + e[0], delta[0], rtol=1e-5, atol=1e-5)


# ---- wire format -------------------------------------------------------------------------------------


def test_ratio_beats_200x_and_estimate_matches() -> None:
    cfg = SparseLoCoConfig()
    xs = [torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3))]
    cf = compress(xs, cfg)
    data = encode_fragment(ALICE, FragmentHeader.of(cf, **WHERE), cf)
    assert 4 * 1024 * 1024 / len(data) >= 200
    assert ratio(cf, header=FragmentHeader.of(cf, **WHERE)) == pytest.approx(4 * 1024 * 1024 / len(data))
    assert ratio([(1024, 1024)], cfg) == pytest.approx(ratio(cf), rel=0.02)


@FAST
@given(
    g=st.lists(st.integers(0, 5000), max_size=200).map(lambda v: np.array(v, np.int64)),
    M=st.integers(1, 4096),
)
def test_golomb_roundtrip(g: np.ndarray, M: int) -> None:
    fields, unary, bits, extra = golomb_encode(g, M)
    assert np.array_equal(golomb_decode(fields + unary + extra, len(g), M, bits), g)


@FAST
@given(
    g=st.lists(st.integers(0, 5000), max_size=300).map(lambda v: np.array(v, np.int64)),
    M=st.integers(1, 4096),
    workers=st.integers(2, 5),
)
def test_golomb_in_threads_gives_the_same_bytes(g: np.ndarray, M: int, workers: int) -> None:
    """The threaded coder joins runs of gaps at arbitrary bit offsets: the bytes must not change."""
    from protocol.codecs import sparseloco_format

    old = sparseloco_format._PARALLEL_MIN_GAPS
    sparseloco_format._PARALLEL_MIN_GAPS = 8  # so that small inputs are split too
    try:
        assert golomb_encode(g, M, workers=workers) == golomb_encode(g, M, workers=1)
    finally:
        sparseloco_format._PARALLEL_MIN_GAPS = old


def test_fixed_width_packing_matches_the_bit_matrix() -> None:
    from protocol.codecs.sparseloco_format import _pack_fixed

    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 9, 1001):
        for w in range(1, 17):
            v = rng.integers(0, 1 << w, size=n)
            bits = np.unpackbits(v.astype(">u2").view(np.uint8).reshape(-1, 2), axis=1)[:, 16 - w :]
            assert _pack_fixed(v, w) == np.packbits(bits).tobytes(), (n, w)


def test_golden_wire_bytes() -> None:
    """Pins the format: any change to the coding must bump CODEC_VERSION and this digest."""
    i = np.arange(200 * 70 + 40 + 3 * 4 * 50, dtype=np.int64)
    v = torch.from_numpy((((i * 2654435761) % 1000003 - 500001) / 1000.0).astype(np.float32))
    xs = [v[:14000].reshape(200, 70), v[14000:14040], v[14040:].reshape(3, 4, 50)]
    cf = compress(xs, SparseLoCoConfig())
    data = encode_fragment(ALICE, FragmentHeader.of(cf, **WHERE), cf)
    assert hashlib.sha256(data).hexdigest() == GOLDEN_SHA256, hashlib.sha256(data).hexdigest()


GOLDEN_SHA256 = "8e7c749e2099752ccbbd54541826046ed48834bc36fff45a316a128e41af73d4"


def test_signed_roundtrip_trust_and_expect() -> None:
    _, cf = _fragment()
    header = FragmentHeader.of(cf, **WHERE)
    data = encode_fragment(ALICE, header, cf)
    h, _, signer = decode_fragment(data, expect={"run_id": "run-test", "round": 7})
    assert h == header and signer == ALICE.public_key
    with pytest.raises(UntrustedFragmentSigner, match="not a trusted key") as ei:
        decode_fragment(data, trusted={MALLORY.public_key})
    assert isinstance(ei.value, UntrustedSigner)
    with pytest.raises(FragmentMismatch, match=r"round=7 \(expected 8\)"):
        decode_fragment(data, expect={"round": 8})
    with pytest.raises(FragmentMismatch, match="replica=3 .expected 4."):
        decode_fragment(data, expect=FragmentHeader.of(cf, **{**WHERE, "replica": 4}))
    other = FragmentHeader.of(compress([torch.ones(64, 64)], SparseLoCoConfig()), **WHERE)
    with pytest.raises(FragmentMismatch, match="shapes="):
        decode_fragment(data, expect=other)
    with pytest.raises(ValueError, match="does not describe the fragment"):
        encode_fragment(ALICE, other, cf)


def _tamper(payload: bytes, at: int, raw: bytes) -> bytes:
    return payload[:at] + raw + payload[at + len(raw) :]


def test_rejections_raise_typed_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    _, cf = _fragment()
    lay, b = cf.layout, cf.cfg.value_bits
    data = encode_fragment(ALICE, FragmentHeader.of(cf, **WHERE), cf)
    hbytes, payload = _split(data)
    nan = struct.pack("<f", math.nan)
    at_table = 6 + 4 * len(lay.sparse)
    at_dense_scale = at_table + 4 * (len(lay.sparse) << b)
    at_dense = at_dense_scale + 4 * len(lay.dense) + lay.n_chunks + -(-lay.n_kept * b // 8)
    cases: list[tuple[bytes, type[Exception], str]] = [
        (data[:-1], FragmentError, "truncated"),
        (data + b"\0", FragmentError, "trailing bytes"),
        (data[:20], FragmentError, "truncated"),
        (b"XXXX" + data[4:], FragmentError, "magic"),
        (data[:4] + b"\x02" + data[5:], FragmentVersionError, "frame version 2"),
        (
            data[:-70] + bytes([data[-70] ^ 1]) + data[-69:],
            FragmentSignatureError,
            "signature does not verify",
        ),
        (
            data[:200] + bytes([data[200] ^ 1]) + data[201:],
            FragmentSignatureError,
            "signature does not verify",
        ),
        (_sealed(cf, _tamper(payload, 6, nan)), FragmentError, "tensor scales: non-finite"),
        (_sealed(cf, _tamper(payload, at_table + 4, nan)), FragmentError, "bin-mean tables: non-finite"),
        (
            _sealed(cf, _tamper(payload, at_dense_scale, nan)),
            FragmentError,
            "dense-tensor scales: non-finite",
        ),
        (_sealed(cf, _tamper(payload, 6, struct.pack("<f", -1.0))), FragmentError, "negative"),
        (
            _sealed(cf, _tamper(payload, at_dense, struct.pack("<e", 2.0))),
            FragmentError,
            r"outside \[-1, 1\]",
        ),
        (_sealed(cf, _tamper(payload, 0, b"\0\0")), FragmentError, "Golomb parameter M is 0"),
        (_sealed(cf, payload[:-3]), FragmentError, "payload truncated"),
        (_sealed(cf, payload + b"\0"), FragmentError, "trailing bytes"),
        (_sealed(cf, _tamper(payload, 2, struct.pack("<I", 10**9))), FragmentError, "payload truncated"),
    ]
    for bad, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            decode_fragment(bad)
    with pytest.raises(FragmentError, match="oversized"):
        decode_fragment(data, max_bytes=len(data) - 1)
    with pytest.raises(FragmentError, match="parameters, over the 100 limit"):
        decode_fragment(data, max_params=100)
    huge = FragmentHeader.of(cf, **WHERE).__dict__ | {"shapes": ((10**6, 10**6),)}
    with pytest.raises(FragmentError, match="shapes need at least 244140625 bytes"):
        decode_fragment(seal_payload(ALICE, FragmentHeader(**huge), payload), max_params=10**13)
    # header: wrong codec version, garbage, a schema violation, shapes that do not fit the payload
    for hdr, exc, msg in [
        ({"codec_version": 1}, FragmentVersionError, "codec version 1"),
        ({"k": 0}, FragmentError, "k=0"),
        ({"stage": "one"}, FragmentError, "stage: expected an integer"),
        # the payload no longer parses; which check notices first depends on the bytes
        ({"shapes": [[100, 131], [50], [2, 3, 700]]}, FragmentError, "payload|padding|unary|index"),
    ]:
        h = msgpack.packb({**to_dict(FragmentHeader.of(cf, **WHERE)), **hdr})
        body = MAGIC + struct.pack("<BI", 1, len(h)) + h + struct.pack("<I", len(payload)) + payload
        body += ALICE.public_key
        with pytest.raises(exc, match=msg) as ei:
            decode_fragment(body + ALICE.sign(sparseloco_format._DOMAIN + body))
        assert isinstance(ei.value, ProtocolError)
    assert hbytes  # the split helper found the header
    # indices out of range, or duplicated, cannot come from compress: build them by hand
    bad_idx = cf.idx.copy()
    bad_idx[lay.entry_start[1] - 1] = lay.u[0]  # last index of chunk 0 = its size
    oob = CompressedFragment(**{**cf.__dict__, "idx": bad_idx})
    monkeypatch.setattr(
        "protocol.codecs.sparseloco_format._check_fragment", sparseloco_format._gaps
    )  # unchecked
    with pytest.raises(FragmentError, match=r"index \d+ out of range in chunk 0 \(tensor 0"):
        decode_fragment(_sealed(oob))
    monkeypatch.undo()
    dup = cf.idx.copy()
    dup[1] = dup[0]
    with pytest.raises(FragmentError, match="duplicate or out of order"):
        encode_fragment(
            ALICE, FragmentHeader.of(cf, **WHERE), CompressedFragment(**{**cf.__dict__, "idx": dup})
        )
    assert issubclass(FragmentVersionError, VersionError) and issubclass(FragmentError, ProtocolError)


@settings(max_examples=50, deadline=None)
@given(at=st.integers(0, 10**6), xor=st.integers(1, 255), cut=st.booleans())
def test_corrupted_payload_never_crashes(at: int, xor: int, cut: bool) -> None:
    """Any corruption of a (re-signed) payload either still decodes or raises FragmentError."""
    _, cf = _fragment(cfg=SparseLoCoConfig(chunk=256, k=8))
    payload = pack_payload(cf)
    at %= len(payload)
    bad = payload[:at] if cut else payload[:at] + bytes([payload[at] ^ xor]) + payload[at + 1 :]
    try:
        _, cf2, _ = decode_fragment(_sealed(cf, bad))
        out = decompress(cf2)
    except FragmentError:
        return
    assert all(torch.isfinite(t).all() for t in out)


# ---- magnitude bounds on decoded values (issue 10, finding 5) ----------------------------------------

F32_MAX = float(np.finfo(np.float32).max)
HONEST_TABLE = 1.5 * 2 ** (1 / 16)  # |table| <= this * sqrt(k): the module doc's bound for honest encoders


def _signed_with(
    cf: CompressedFragment, *, ref: dict[int, float], table: dict[tuple[int, int], float]
) -> bytes:
    """cf's wire form with some tensor scales and table entries overwritten, re-signed by ALICE: a replica
    holding a valid key that forges its payload (the signature and every parser check pass)."""
    lay, b = cf.layout, cf.cfg.value_bits
    payload = pack_payload(cf)
    at_table = 6 + 4 * len(lay.sparse)
    for j, v in ref.items():
        payload = _tamper(payload, 6 + 4 * j, struct.pack("<f", v))
    for (j, c), v in table.items():
        payload = _tamper(payload, at_table + 4 * ((j << b) + c), struct.pack("<f", v))
    return _sealed(cf, payload)


def test_forged_table_or_scale_overflow_is_rejected() -> None:
    """Finite on the wire, but table x scale is inf: decompress used to return inf; now FragmentError."""
    _, cf = _fragment()  # k = 64: tables bounded by 2 sqrt(64) = 16
    assert table_bound(cf.cfg) == 16.0
    peak = float(np.abs(cf.table[0]).max())
    cases = [
        ({}, {(0, 1): 3e38}, r"fragment tensor 0: bin-mean table holds 3e\+38, beyond the 16 = 2 sqrt\(k\)"),
        ({}, {(1, 3): -17.0}, "fragment tensor 2: bin-mean table holds 17, beyond the 16"),
        ({0: 1e38}, {(0, 1): 15.0}, r"fragment tensor 0: table x scale = 1.5e\+39.*overflows float32"),
        ({1: F32_MAX}, {}, "fragment tensor 2: table x scale = .* overflows float32"),
    ]
    for ref, table, msg in cases:
        _, forged, _ = decode_fragment(_signed_with(cf, ref=ref, table=table), trusted={ALICE.public_key})
        with pytest.raises(FragmentError, match=msg) as ei:
            decompress(forged)
        assert isinstance(ei.value, ProtocolError)
        with pytest.raises(FragmentError, match=msg):
            check_values(forged)
    # the largest that still decodes finite is accepted (aggregation bounds it relative to the round)
    ok = F32_MAX / peak * (1 - 2**-20)
    _, cf2, _ = decode_fragment(_signed_with(cf, ref={0: ok}, table={}), trusted={ALICE.public_key})
    assert all(torch.isfinite(t).all() for t in decompress(cf2))


def test_in_memory_fragments_with_bad_values_are_rejected() -> None:
    """The same checks hold for a fragment that never went through the parser."""
    _, cf = _fragment()
    nan, inf = np.float32(np.nan), np.float32(np.inf)

    def with_(name: str, at: tuple[int, ...], v: np.floating) -> CompressedFragment:
        a = getattr(cf, name).copy()
        a[at] = v
        return CompressedFragment(**{**cf.__dict__, name: a})

    for bad, msg in [
        (with_("table", (1, 2), nan), "tensor 2: bin-mean table holds a non-finite value"),
        (with_("ref_scale", (0,), inf), "tensor 0: tensor scale inf is not a finite"),
        (with_("ref_scale", (1,), np.float32(-1)), "tensor 2: tensor scale -1 is not a finite non-negative"),
        (with_("dense_scale", (0,), nan), "tensor 1: dense scale nan"),
        (with_("dense", (7,), np.float16(np.inf)), r"tensor 1: dense value inf lies outside \[-1, 1\]"),
        (with_("dense", (7,), np.float16(np.nan)), r"tensor 1: dense value nan lies outside \[-1, 1\]"),
    ]:
        with pytest.raises(FragmentError, match=msg):
            decompress(bad)


def _honest(kind: str, shape: tuple[int, ...], scale: float, rng: np.random.Generator) -> torch.Tensor:
    """A pseudo-gradient-like tensor of max-abs `scale`, drawn in float64 and cast once."""
    n = math.prod(shape)
    if kind == "gauss":
        x = rng.standard_normal(n)
    elif kind == "cauchy":  # heavy tails: a few values dwarf the rest of their chunk
        x = rng.standard_cauchy(n)
    elif kind == "lognormal":  # magnitudes over ~20 decades inside one tensor
        x = rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 8)
    else:  # "spikes": mostly zeros, so a chunk keeps one nonzero and |y| reaches sqrt(k)
        x = np.where(rng.random(n) < 0.002, rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6, n), 0.0)
    x = x / max(np.abs(x).max(), 1e-300) * scale
    return torch.from_numpy(np.asarray(x, np.float32).reshape(shape))


@pytest.mark.parametrize("scale", [1.0, 1e-44, 1e-30, 1e30, 1e36])
@pytest.mark.parametrize("kind", ["gauss", "cauchy", "lognormal", "spikes"])
def test_honest_fragments_are_never_rejected(kind: str, scale: float) -> None:
    """Real encodes, tiny (subnormal) to huge: compress never makes a fragment the decoder rejects, and its
    tables stay within the derived 1.57 sqrt(k), below the accepted 2 sqrt(k)."""
    rng = np.random.default_rng([len(kind), round(math.log10(scale)) + 50])
    cfgs = [
        SparseLoCoConfig(),
        SparseLoCoConfig(chunk=64, k=3, value_bits=4),
        SparseLoCoConfig(chunk=16, k=16, value_bits=1, dense_1d=False),
    ]
    for cfg in cfgs:
        xs = [_honest(kind, s, scale, rng) for s in [(130, 70), (3, 700), (40,)]]
        cf = compress(xs, cfg)
        assert np.abs(cf.table).max(initial=0) <= HONEST_TABLE * math.sqrt(cfg.k) * (1 + 1e-6)
        _, cf2, _ = decode_fragment(encode_fragment(ALICE, FragmentHeader.of(cf, **WHERE), cf))
        assert all(torch.isfinite(t).all() for t in decompress(cf2))


def test_subnormal_worst_case_table_is_accepted() -> None:
    """In float32's subnormal range s_c rounds to a multiple of 2^-149, so |y| reaches 1.5 sqrt(k): here a
    spike of 12 units in a chunk of RMS 1.5 units gets s_c = 1 unit, and the table holds 12 = 1.5 sqrt(64)."""
    u = 2.0**-149
    x = np.zeros((8, 16), np.float32)
    x[:, :8] = 92 * u  # the reference chunk: RMS 92 units
    x[0, 8] = (
        12 * u
    )  # alone in its chunk of k = 64: RMS 1.5 units, scale code 49 -> s_c = 92 * 2^(-49/8) -> 1
    cf = compress([torch.from_numpy(x)], SparseLoCoConfig(chunk=64, k=64, value_bits=4))
    assert float(np.abs(cf.table).max()) == 12.0 and 12.0 < table_bound(cf.cfg)
    assert float(decompress(cf)[0][0, 8]) == 12 * u


def test_values_too_large_to_decode_are_refused_at_the_source() -> None:
    """|x| within ~2 sqrt(k) of float32's max: max |table| x ref could overflow, so compress refuses the
    tensor (the decoder's check is on the tables, not per entry) instead of sending what peers reject."""
    x = torch.zeros(64, 128)
    x[:, :64] = 1e38  # tile 0: y = 1, ref = 1e38
    x[0, 64] = 1e38  # alone in tile 1: y = sqrt(64) = 8, its own bin with 4-bit values
    cfg = SparseLoCoConfig(value_bits=4)
    with pytest.raises(
        ValueError, match="tensor 0: table x scale = 8e\\+38 overflows float32 .*; refusing to"
    ):
        compress([x], cfg)
    with pytest.raises(ValueError, match="refusing to compress"):
        error_feedback_step([torch.zeros(64, 128)], [x], cfg)
    assert all(torch.isfinite(t).all() for t in decompress(compress([x / 8], cfg)))


# ---- aggregation -------------------------------------------------------------------------------------


def _contribs(seed: int, R: int = 4) -> dict[int, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for j in range(R):
        cf = compress(
            [torch.randn(64, 96, generator=g) * 10 ** (j - 2), torch.randn(8, generator=g)],
            SparseLoCoConfig(chunk=256, k=16),
        )
        out[10 + 7 * j % 5] = decompress(cf)
    return out


def test_mean_and_per_coordinate_mean() -> None:
    a = [torch.tensor([2.0, 0.0, 4.0])]
    b = [torch.tensor([4.0, 0.0, 0.0])]
    torch.testing.assert_close(mean_over_arrivals({1: a, 0: b})[0], torch.tensor([3.0, 0.0, 2.0]))
    # a coordinate only one replica chose is not diluted
    torch.testing.assert_close(per_coordinate_mean({1: a, 0: b})[0], torch.tensor([3.0, 0.0, 4.0]))
    with pytest.raises(ValueError, match="no contributions"):
        mean_over_arrivals({})


def test_aggregation_is_independent_of_arrival_order() -> None:
    c = _contribs(5)
    ids = list(c)
    # float addition is not associative: summing these in another order changes some bits...
    fwd = sum((c[j][0] for j in ids), torch.zeros(64, 96))
    rev = sum((c[j][0] for j in reversed(ids)), torch.zeros(64, 96))
    assert not torch.equal(fwd, rev)
    # ...but the aggregate sorts by replica id, so any arrival order gives the same bits
    for cfg in (AggregationSettings(aggregation="mean"), AggregationSettings()):
        ref = aggregate(c, cfg)
        for perm in (ids[::-1], ids[1:] + ids[:1]):
            got = aggregate({j: c[j] for j in perm}, cfg)
            assert got.used == ref.used and got.clip == ref.clip
            assert all(torch.equal(x, y) for x, y in zip(got.tensors, ref.tensors, strict=True))


def test_median_norm_clip() -> None:
    c = {j: [torch.full((3,), float(s))] for j, s in zip(range(5), [1, 2, 3, 40, 500], strict=True)}
    clipped, f = median_norm_clip(c)
    med = norm(c[2])
    assert f[0] == f[1] == f[2] == 1.0 and f[3] < 1 and f[4] < 1
    for j in (3, 4):
        assert norm(clipped[j]) == pytest.approx(med, rel=1e-6)
    agg = aggregate(c, AggregationSettings(aggregation="mean"))
    assert float(agg.tensors[0].max()) <= 3.0 + 1e-5  # a huge contribution cannot drag the mean


def test_screen_rejects_bad_contributions() -> None:
    good = [torch.ones(4, 4), torch.ones(2)]
    c = {
        0: good,
        1: [torch.full((4, 4), float("nan")), torch.ones(2)],
        2: [torch.ones(4, 5), torch.ones(2)],
        3: [torch.ones(4, 4) * 100, torch.ones(2)],
        4: [torch.ones(4, 4) * 3, torch.ones(2)],
    }
    ok, rej = screen(c, max_abs=10.0, max_norm=10.0)
    assert list(ok) == [0]
    reasons = {r.replica: r.reason for r in rej}
    assert "NaN or inf" in reasons[1] and "do not match" in reasons[2]
    assert "max_abs" in reasons[3] and "max_norm" in reasons[4]
    agg = aggregate(c, AggregationSettings(max_abs=10.0, max_norm=10.0))
    assert agg.used == (0,) and [r.replica for r in agg.rejected] == [1, 2, 3, 4]
    none = aggregate({1: c[1]}, shapes=[(4, 4), (2,)])
    assert none.used == () and all((t == 0).all() for t in none.tensors)
    with pytest.raises(ValueError, match="max_abs"):
        AggregationSettings(max_abs=-1.0)


def test_aggregate_decoded_fragments_end_to_end() -> None:
    """Replicas compress, sign and upload; the receiver decodes what arrived and aggregates."""
    cfg = SparseLoCoConfig(chunk=256, k=16)
    g = torch.Generator().manual_seed(9)
    target = torch.randn(48, 80, generator=g)
    arrived = {}
    for r in (2, 0, 1):
        delta = [target + 0.1 * torch.randn(48, 80, generator=g)]
        cf, _ = error_feedback_step([torch.zeros(48, 80)], delta, cfg)
        data = encode_fragment(ALICE, FragmentHeader.of(cf, **{**WHERE, "replica": r}), cf)
        h, cf2, _ = decode_fragment(
            data, trusted={ALICE.public_key}, expect={"run_id": "run-test", "round": 7}
        )
        arrived[h.replica] = decompress(cf2)
    agg = aggregate(arrived)
    assert agg.used == (0, 1, 2)
    m = agg.tensors[0] != 0
    cos = float((agg.tensors[0][m] * target[m]).sum() / (agg.tensors[0][m].norm() * target[m].norm()))
    assert cos > 0.9

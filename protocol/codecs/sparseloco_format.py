"""Signed wire format of a SparseLoCo fragment, with Golomb-coded indices.

Frame (little-endian):

    b"CRSL" | u8 FORMAT_VERSION | u32 len(H) | H | u32 len(P) | P | signer key (32) | Ed25519 sig (64)

H is the msgpack `FragmentHeader`; the signature covers DOMAIN + every byte before it, so a fragment
cannot be replayed under another run, stage, fragment, round or replica. P, the payload:

    u16 M | u32 U | f32 ref[T_s] | f32 table[T_s, 2^b] | f32 dense_scale[T_d] | u8 chunk_scale[NC]
    | codes: N x b bits | f16 dense[D] | fields: N x w bits | unary: U bits | extra: one bit per field >= c

Indices. Inside each chunk the kept indices are sorted, so they are sent as gaps g = i_j - i_{j-1} - 1
(g_0 = i_0), Golomb-coded with one parameter M for the fragment: q = g // M in unary (q zeros then a one),
r = g % M in truncated binary (b_M = ceil(log2 M), c = 2^b_M - M: r < c takes b_M - 1 bits, the rest b_M).
The three parts go to three streams so decoding is vectorised: the ones of the unary stream are the gap
ends, `fields` holds the first b_M - 1 bits of every remainder at a fixed width, and `extra` holds the
last bit of the long ones. For k = 64 of 4096 and uniformly placed indices, M = 43 and a chunk costs
476 index bits (measured; the entropy log2 C(4096, 64) is 471, 12-bit indices cost 768), plus 128 value
bits and 8 scale bits: 612 bits, 214x fewer than dense fp32 (docs/benchmarks.md).

Decoding checks everything and raises `FragmentError` (a `ProtocolError`; protocol/codecs/fragment_errors.py)
saying what was wrong.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from protocol.codecs.fragment_errors import (
    FragmentError,
    FragmentMismatch,
    FragmentSignatureError,
    FragmentVersionError,
    UntrustedFragmentSigner,
)
from protocol.codecs.sparseloco import CompressedFragment, Layout, Shape, SparseLoCoConfig, layout
from protocol.msgpack_limits import unpack_bounded
from protocol.schema import SchemaError, from_dict, to_dict

if TYPE_CHECKING:  # signing needs cryptography; pack/unpack and the Golomb coder do not
    from protocol.identity import Identity

MAGIC = b"CRSL"
FORMAT_VERSION = 1
CODEC_VERSION = 2
"""2: the header carries `tokens`."""
_DOMAIN = b"crucible/sparseloco-fragment/v1\x00"
_FRAME = struct.Struct("<4sBI")  # magic, format version, header length
_U32 = struct.Struct("<I")
_PAYLOAD_HEAD = struct.Struct("<HI")  # Golomb M, unary stream bits
_KEY, _SIG = 32, 64
MAX_FRAGMENT_BYTES = 64 * 1024 * 1024
MAX_PARAMS = 1 << 30
MAX_HEADER_BYTES = 1 << 20
MAX_TENSORS = 1 << 16
MAX_NDIM = 8
MAX_TOKENS = 1 << 48
"""Above any honest count (protocol/runspec.py refuses a spec whose rounds could reach it)."""
_MAX_HEADER_VALUES = 32 + MAX_TENSORS * (1 + MAX_NDIM)
"""msgpack values in the largest valid header: 24 for its 12 fields, 1 + ndim per tensor."""
_MAX_HEADER_CONTAINERS = 8 + MAX_TENSORS
"""Arrays and maps in the largest valid header: the map, `shapes` and one list per tensor (3 levels)."""


@dataclass(kw_only=True, frozen=True)
class FragmentHeader:
    """What a fragment is (store key `{run}/sync/s{stage}/f{fragment}/r{round}/{replica}/{signer}/fragment`, or `.../{sha256}` when that was taken) and how to
    decode it. All of it is covered by the signature."""

    run_id: str
    stage: int
    fragment: int
    round: int
    replica: int
    shapes: tuple[tuple[int, ...], ...]
    chunk: int
    k: int
    value_bits: int
    dense_1d: bool
    tokens: int
    """Tokens the sender's replica trained on since its last capture of this fragment: the weight of its
    contribution (issue 22); a receiver checks it against what the replica's shape allows in a round."""
    codec_version: int = CODEC_VERSION

    def __post_init__(self) -> None:
        if not 1 <= len(self.run_id) <= 256:
            raise ValueError(f"run_id must have 1..256 characters, got {len(self.run_id)}")
        for name in ("stage", "fragment", "round", "replica"):
            v = getattr(self, name)
            if not 0 <= v < 1 << 63:
                raise ValueError(f"{name}={v} must be a non-negative 64-bit integer")
        if not 1 <= self.tokens < MAX_TOKENS:
            raise ValueError(f"tokens={self.tokens} must be in [1, 2^48)")
        if len(self.shapes) > MAX_TENSORS:
            raise ValueError(f"{len(self.shapes)} tensors, at most {MAX_TENSORS} per fragment")
        for i, s in enumerate(self.shapes):
            if len(s) > MAX_NDIM or any(not 1 <= d < 1 << 40 for d in s):
                raise ValueError(f"shapes[{i}]={list(s)}: need at most {MAX_NDIM} dims, each in [1, 2^40)")
        self.cfg  # noqa: B018  (validates chunk, k, value_bits, dense_1d)

    @property
    def cfg(self) -> SparseLoCoConfig:
        return SparseLoCoConfig(
            chunk=self.chunk, k=self.k, value_bits=self.value_bits, dense_1d=self.dense_1d
        )

    @classmethod
    def of(
        cls,
        cf: CompressedFragment,
        *,
        run_id: str,
        stage: int,
        fragment: int,
        round: int,
        replica: int,
        tokens: int,
    ) -> FragmentHeader:
        """The header for `cf` (shapes and decoding settings taken from it)."""
        return cls(
            run_id=run_id,
            stage=stage,
            fragment=fragment,
            round=round,
            replica=replica,
            shapes=cf.shapes,
            chunk=cf.cfg.chunk,
            k=cf.cfg.k,
            value_bits=cf.cfg.value_bits,
            dense_1d=cf.cfg.dense_1d,
            tokens=tokens,
        )


# ---- bit streams -------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.buf) - self.at:
            raise FragmentError(
                f"payload truncated: {what} needs {n} bytes at offset {self.at}, only {len(self.buf) - self.at} left"
            )
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def floats(self, n: int, dtype: str, what: str) -> np.ndarray:
        a = np.frombuffer(self.take(n * np.dtype(dtype).itemsize, what), dtype).astype(dtype[1:])
        if not np.isfinite(a).all():
            raise FragmentError(
                f"{what}: non-finite value at position {int(np.flatnonzero(~np.isfinite(a))[0])}"
            )
        return a


def _pack_fixed(v: np.ndarray, width: int) -> bytes:
    """Each value of v (N,) in `width` bits (<= 16), MSB first, concatenated and zero-padded to a byte."""
    if width == 0 or len(v) == 0:
        return b""
    if 8 % width == 0:  # 1, 2, 4 or 8 bits: whole values per byte, no bit matrix
        per = 8 // width
        flat = np.zeros(-(-len(v) // per) * per, np.uint8)
        flat[: len(v)] = v
        p = flat.reshape(-1, per)  # (bytes, per)
        out = p[:, 0] << (8 - width)
        for j in range(1, per):
            out |= p[:, j] << (8 - width * (j + 1))
        return out.tobytes()
    n_bytes = -(-len(v) * width // 8)
    if width < 8:  # 8 values make `width` whole bytes: one uint64 per 8 values, no bit matrix
        blocks = np.zeros(-(-len(v) // 8) * 8, np.uint64)
        blocks[: len(v)] = v
        b8 = blocks.reshape(-1, 8)  # (blocks, 8)
        word = b8[:, 0] << np.uint64(7 * width)
        for j in range(1, 8):
            word |= b8[:, j] << np.uint64((7 - j) * width)  # value j of a block, MSB first
        be = word.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - width :]  # (blocks, width) bytes
        return be.tobytes()[:n_bytes]
    bits = np.unpackbits(v.astype(">u2").view(np.uint8).reshape(-1, 2), axis=1)[:, 16 - width :]  # (N, width)
    return np.packbits(bits).tobytes()


def _unpack_fixed(buf: bytes | memoryview, n: int, width: int, what: str) -> np.ndarray:
    """Inverse of `_pack_fixed` for n values; the padding bits must be zero."""
    if width == 0:
        return np.zeros(n, np.int64)
    raw = np.frombuffer(buf, np.uint8)
    if 8 % width == 0:
        per, mask = 8 // width, (1 << width) - 1
        vals = np.stack([(raw >> (8 - width * (j + 1))) & mask for j in range(per)], axis=1).reshape(-1)
        if vals[n:].any():
            raise FragmentError(f"{what}: nonzero padding bits after the last value")
        return vals[:n].astype(np.int64)
    bits = np.unpackbits(raw)
    if bits[n * width :].any():
        raise FragmentError(f"{what}: nonzero padding bits after the last value")
    m = bits[: n * width].reshape(n, width).astype(np.int64)  # (n, width)
    return m @ (np.int64(1) << np.arange(width - 1, -1, -1, dtype=np.int64))  # (n,)


def _golomb_parameter(g: np.ndarray) -> int:
    """Golomb M for gaps with this mean under a geometric model: M = ceil(log(1 + theta) / -log(theta)),
    theta = mu / (mu + 1) (Gallager & van Voorhis 1975)."""
    mu = float(g.mean()) if len(g) else 0.0
    if mu < 0.5:
        return 1
    theta = mu / (mu + 1)
    return max(1, min(65535, math.ceil(math.log(1 + theta) / -math.log(theta))))


def _golomb_split(M: int) -> tuple[int, int]:
    """(w, c): remainders r < c take w = b_M - 1 bits; others w bits + 1 extra bit (b_M = ceil(log2 M))."""
    bM = (M - 1).bit_length()
    return max(bM - 1, 0), (1 << bM) - M


def _golomb_segment(g: np.ndarray, M: int) -> tuple[bytes, np.ndarray, int, np.ndarray, int]:
    """One run of gaps: (fields bytes, unary packed, unary bits, extra packed, extra bits)."""
    q, r = np.divmod(g, M)
    unary_bits = int(q.sum()) + len(g)
    u = np.zeros(unary_bits, np.uint8)
    u[np.cumsum(q + 1) - 1] = 1  # a one ends each gap's run of q zeros
    if M == 1:
        return b"", np.packbits(u), unary_bits, np.zeros(0, np.uint8), 0
    w, c = _golomb_split(M)
    long = r >= c
    v = np.where(long, (r + c) >> 1, r)  # first b_M - 1 bits of the truncated-binary code
    extra = ((r + c) & 1)[long].astype(np.uint8)
    return _pack_fixed(v, w), np.packbits(u), unary_bits, np.packbits(extra), len(extra)


def _join_bits(parts: list[tuple[np.ndarray, int]]) -> bytes:
    """Concatenate packed MSB-first bit strings of the given bit lengths into one, zero-padded."""
    total = sum(n for _, n in parts)
    out = np.zeros(-(-total // 8) + 1, np.uint8)  # one spare byte for the last part's spill
    at = 0
    for packed, n in parts:
        b, s = divmod(at, 8)
        m = len(packed)
        if s == 0:
            out[b : b + m] |= packed
        else:  # shift the part right by s bits across byte boundaries
            out[b : b + m] |= packed >> s
            out[b + 1 : b + 1 + m] |= packed << (8 - s)
        at += n
    return out[: -(-total // 8)].tobytes()


_PARALLEL_MIN_GAPS = 1 << 20


def golomb_encode(g: np.ndarray, M: int, workers: int | None = None) -> tuple[bytes, bytes, int, bytes]:
    """Golomb-code the gaps g (N,) >= 0: (fields, unary, unary bit count, extra). See the module doc.

    Large fragments are coded in `workers` threads (default: half the cores, at most 8; numpy releases
    the GIL), each over a run of gaps whose fields start on a byte (a multiple of 8 entries); the runs'
    bit strings are then joined. The bytes are the same as one pass over all gaps."""
    g = g.astype(np.int32) if len(g) and int(g.max()) < 2**31 else g  # 32-bit division is faster
    if workers is None:
        workers = max(1, min(8, (os.cpu_count() or 2) // 2))
    n_seg = min(workers, max(1, len(g) // _PARALLEL_MIN_GAPS))
    if n_seg == 1:
        fields, u, ub, e, _ = _golomb_segment(g, M)
        return fields, u.tobytes(), ub, e.tobytes()
    step = -(-len(g) // n_seg // 8) * 8
    runs = [g[i : i + step] for i in range(0, len(g), step)]
    with ThreadPoolExecutor(len(runs), thread_name_prefix="golomb") as pool:
        parts = list(pool.map(lambda run: _golomb_segment(run, M), runs))
    fields = b"".join(p[0] for p in parts)
    unary = _join_bits([(p[1], p[2]) for p in parts])
    extra = _join_bits([(p[3], p[4]) for p in parts])
    return fields, unary, sum(p[2] for p in parts), extra


def _read_gaps(rd: _Reader, n: int, M: int, unary_bits: int) -> np.ndarray:
    """Read the fields, unary and extra streams of n Golomb-coded gaps; (n,) int64 gaps."""
    w, c = _golomb_split(M)
    v = _unpack_fixed(rd.take(-(-n * w // 8), "index remainders"), n, w, "index remainders")
    if unary_bits < n:
        raise FragmentError(f"unary index stream has {unary_bits} bits, fewer than the {n} kept entries")
    ubits = np.unpackbits(np.frombuffer(rd.take(-(-unary_bits // 8), "unary index stream"), np.uint8))
    ends = np.flatnonzero(ubits)  # (n,) position of each gap's terminating one
    if len(ends) != n or (n and ends[-1] != unary_bits - 1):
        raise FragmentError(
            f"unary index stream holds {len(ends)} gap ends in {unary_bits} bits (expected {n}, the last "
            "on the last bit, then zero padding)"
        )
    q = np.diff(ends, prepend=-1) - 1  # (n,) quotients
    long = v >= c if M > 1 else np.zeros(n, bool)
    n_extra = int(long.sum())
    eb = np.unpackbits(np.frombuffer(rd.take(-(-n_extra // 8), "index extra bits"), np.uint8))
    if eb[n_extra:].any():
        raise FragmentError("index extra bits: nonzero padding bits")
    r = v.copy()
    r[long] = 2 * v[long] + eb[:n_extra] - c  # the long truncated-binary codes
    return q * M + r


def golomb_decode(data: bytes, n: int, M: int, unary_bits: int) -> np.ndarray:
    """Inverse of `golomb_encode` for its three streams concatenated (fields + unary + extra)."""
    rd = _Reader(memoryview(data))
    g = _read_gaps(rd, n, M, unary_bits)
    if rd.at != len(rd.buf):
        raise FragmentError(f"{len(rd.buf) - rd.at} trailing bytes after the Golomb streams")
    return g


# ---- payload -----------------------------------------------------------------------------------------


def _gaps(cf: CompressedFragment) -> np.ndarray:
    idx = cf.idx.astype(np.int64)
    g = np.empty_like(idx)
    g[1:] = idx[1:] - idx[:-1] - 1
    starts = cf.layout.entry_start[:-1]  # every chunk keeps at least one entry
    g[starts] = idx[starts]  # first gap of a chunk counts from 0
    return g  # (N,)


def _check_fragment(cf: CompressedFragment) -> np.ndarray:
    """Reject an in-memory fragment that does not match its layout (before it is signed and sent);
    returns its index gaps (N,)."""
    lay = cf.layout
    b = cf.cfg.value_bits
    want = {
        "idx": (lay.n_kept,),
        "codes": (lay.n_kept,),
        "chunk_scale": (lay.n_chunks,),
        "ref_scale": (len(lay.sparse),),
        "table": (len(lay.sparse), 1 << b),
        "dense": (lay.n_dense,),
        "dense_scale": (len(lay.dense),),
    }
    for name, shape in want.items():
        if getattr(cf, name).shape != shape:
            raise FragmentError(
                f"CompressedFragment.{name} has shape {getattr(cf, name).shape}, layout needs {shape}"
            )
    g = _gaps(cf)
    if (g < 0).any():
        e = int(np.flatnonzero(g < 0)[0])
        raise FragmentError(
            f"kept entry {e}: index {int(cf.idx[e])} is a duplicate or out of order in its chunk"
        )
    last = cf.idx[lay.entry_start[1:] - 1] if lay.n_kept else np.zeros(0, np.int32)
    if (last >= lay.u).any() or (cf.idx < 0).any():
        raise FragmentError("a kept index is outside its chunk")
    if int(cf.codes.max(initial=0)) >= 1 << b:
        raise FragmentError(f"a value code does not fit in {b} bits")
    return g


def pack_payload(cf: CompressedFragment) -> bytes:
    """The payload P of the frame (see the module doc)."""
    g = _check_fragment(cf)
    M = _golomb_parameter(g)
    fields_, unary, unary_bits, extra = golomb_encode(g, M)
    return b"".join(
        [
            _PAYLOAD_HEAD.pack(M, unary_bits),
            cf.ref_scale.astype("<f4").tobytes(),
            cf.table.astype("<f4").tobytes(),
            cf.dense_scale.astype("<f4").tobytes(),
            cf.chunk_scale.astype(np.uint8).tobytes(),
            _pack_fixed(cf.codes, cf.cfg.value_bits),
            cf.dense.astype("<f2").tobytes(),
            fields_,
            unary,
            extra,
        ]
    )


def unpack_payload(
    payload: bytes | memoryview, shapes: tuple[Shape, ...], cfg: SparseLoCoConfig
) -> CompressedFragment:
    """Parse and validate a payload P into a `CompressedFragment`."""
    # Every chunk costs at least its scale byte and every dense value 2 bytes: check that before
    # building the layout, whose arrays take ~50 bytes per chunk, for shapes the sender chose.
    t, C = cfg.tile, cfg.chunk
    NC = D = 0
    for s in shapes:
        if len(s) <= 1 and cfg.dense_1d:
            D += math.prod(s)
        else:
            NC += -(-s[0] // t) * -(-s[1] // t) if len(s) == 2 else -(-math.prod(s) // C)
    if NC + 2 * D > len(payload):
        raise FragmentError(
            f"payload truncated: the header's shapes need at least {NC + 2 * D} bytes ({NC} chunks, "
            f"{D} dense values), the payload has {len(payload)}"
        )
    lay = layout(shapes, cfg)
    N, NC, b = lay.n_kept, lay.n_chunks, cfg.value_bits
    rd = _Reader(memoryview(payload))
    M, unary_bits = _PAYLOAD_HEAD.unpack(rd.take(_PAYLOAD_HEAD.size, "Golomb parameter"))
    if M < 1:
        raise FragmentError("Golomb parameter M is 0; it must be at least 1")
    ref = rd.floats(len(lay.sparse), "<f4", "tensor scales")
    table = rd.floats(len(lay.sparse) << b, "<f4", "bin-mean tables").reshape(len(lay.sparse), 1 << b)
    dense_scale = rd.floats(len(lay.dense), "<f4", "dense-tensor scales")
    if (ref < 0).any() or (dense_scale < 0).any():
        raise FragmentError("a tensor scale is negative")
    chunk_scale = np.frombuffer(rd.take(NC, "chunk scales"), np.uint8)
    codes = _unpack_fixed(rd.take(-(-N * b // 8), "value codes"), N, b, "value codes").astype(np.uint8)
    dense = rd.floats(lay.n_dense, "<f2", "dense values")
    if (np.abs(dense) > 1).any():
        raise FragmentError("a dense value lies outside [-1, 1] (values are sent divided by their max-abs)")
    g = _read_gaps(rd, N, M, unary_bits)  # (N,)
    if rd.at != len(rd.buf):
        raise FragmentError(f"payload has {len(rd.buf) - rd.at} trailing bytes after the last section")
    cs = np.cumsum(g + 1)
    prev = np.concatenate([[0], cs])[lay.entry_start[:-1]]  # (NC,) running total before each chunk
    idx = cs - np.repeat(prev, lay.k) - 1  # (N,) within-chunk index, increasing inside a chunk
    if N:
        last = idx[lay.entry_start[1:] - 1]  # (NC,) largest index of each chunk
        bad = np.flatnonzero(last >= lay.u)
        if len(bad):
            ch = int(bad[0])
            t = lay.sparse[int(np.searchsorted(lay.chunk_start, ch, side="right")) - 1]
            raise FragmentError(
                f"index {int(last[ch])} out of range in chunk {ch} (tensor {t}, {int(lay.u[ch])} elements)"
            )
    return CompressedFragment(
        shapes=shapes,
        cfg=cfg,
        idx=idx.astype(np.int32),
        codes=codes,
        chunk_scale=chunk_scale,
        ref_scale=ref,
        table=table,
        dense=dense,
        dense_scale=dense_scale,
    )


# ---- frame -------------------------------------------------------------------------------------------


def seal_payload(identity: Identity, header: FragmentHeader, payload: bytes) -> bytes:
    """Frame and sign a header and payload (`encode_fragment` without the payload checks)."""
    h = msgpack.packb(to_dict(header), use_bin_type=True)
    body = b"".join(
        [_FRAME.pack(MAGIC, FORMAT_VERSION, len(h)), h, _U32.pack(len(payload)), payload, identity.public_key]
    )
    return body + identity.sign(_DOMAIN + body)


def encode_fragment(identity: Identity, header: FragmentHeader, cf: CompressedFragment) -> bytes:
    """The signed wire bytes of `cf` described by `header` (whose shapes and settings must match cf)."""
    if header.shapes != cf.shapes or header.cfg != SparseLoCoConfig(**_decode_fields(cf.cfg)):
        raise ValueError(
            f"header (shapes {header.shapes}, {header.cfg}) does not describe the fragment "
            f"(shapes {cf.shapes}, {cf.cfg}); build it with FragmentHeader.of(cf, ...)"
        )
    return seal_payload(identity, header, pack_payload(cf))


def _decode_fields(cfg: SparseLoCoConfig) -> dict[str, Any]:
    return {"chunk": cfg.chunk, "k": cfg.k, "value_bits": cfg.value_bits, "dense_1d": cfg.dense_1d}


def _check_expect(header: FragmentHeader, expect: FragmentHeader | Mapping[str, Any]) -> None:
    want = to_dict(expect) if isinstance(expect, FragmentHeader) else dict(expect)
    got = to_dict(header)
    unknown = set(want) - set(got)
    if unknown:
        raise ValueError(f"expect names unknown header field(s) {sorted(unknown)}")
    diff = [f"{f}={got[f]!r} (expected {want[f]!r})" for f in sorted(want) if got[f] != to_dict(want[f])]
    if diff:
        raise FragmentMismatch(f"fragment header does not match what was expected: {', '.join(diff)}")


def decode_fragment(
    data: bytes | bytearray | memoryview,
    *,
    trusted: set[bytes] | None = None,
    max_bytes: int = MAX_FRAGMENT_BYTES,
    max_params: int = MAX_PARAMS,
    expect: FragmentHeader | Mapping[str, Any] | None = None,
) -> tuple[FragmentHeader, CompressedFragment, bytes]:
    """Verify and decode a fragment: (header, fragment, signer's public key).

    trusted: if given, the signer must be one of these Ed25519 public keys.
    expect: a FragmentHeader, or a mapping of some header fields, the header must equal.
    max_params: the largest total tensor size accepted (bounds what decompress would allocate).
    Parsing memory grows linearly with the payload (worst case a few hundred bytes per payload byte), so
    `max_bytes` bounds it; pass the run's settings in `expect` to pin chunk and k as well.
    Raises `FragmentError` or a subclass (all `ProtocolError`) saying what was wrong.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FragmentError(f"fragment: expected bytes, got {type(data).__name__}")
    buf = memoryview(data).cast("B")
    n = len(buf)
    if n > max_bytes:
        raise FragmentError(f"fragment is {n} bytes, over the {max_bytes}-byte limit (oversized)")
    if n < _FRAME.size + _U32.size + _KEY + _SIG:
        raise FragmentError(f"fragment truncated: {n} bytes is shorter than an empty frame")
    magic, version, hlen = _FRAME.unpack_from(buf)
    if magic != MAGIC:
        raise FragmentError(f"not a SparseLoCo fragment: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise FragmentVersionError(
            f"fragment frame version {version}, this build speaks {FORMAT_VERSION}; upgrade the older side"
        )
    if hlen > MAX_HEADER_BYTES:
        raise FragmentError(f"fragment header is {hlen} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    if hlen > n - _FRAME.size - _U32.size - _KEY - _SIG:
        raise FragmentError(f"fragment truncated: a {hlen}-byte header does not fit in {n} bytes")
    p_at = _FRAME.size + hlen
    (plen,) = _U32.unpack_from(buf, p_at)
    end = p_at + _U32.size + plen
    if end + _KEY + _SIG != n:
        kind = "truncated" if end + _KEY + _SIG > n else "has trailing bytes"
        raise FragmentError(f"fragment {kind}: frame declares {end + _KEY + _SIG} bytes, got {n}")
    signer = bytes(buf[end : end + _KEY])
    from protocol.identity import SignatureError, peer_id_of, verify  # lazy: cryptography only to verify

    try:
        verify(signer, _DOMAIN + bytes(buf[: end + _KEY]), bytes(buf[end + _KEY :]))
    except SignatureError as e:
        raise FragmentSignatureError(f"fragment signature does not verify: {e}") from e
    if trusted is not None and signer not in trusted:
        raise UntrustedFragmentSigner(f"fragment signed by {peer_id_of(signer)}, which is not a trusted key")
    try:
        hd = unpack_bounded(
            buf[_FRAME.size : p_at],
            "fragment header",
            max_bytes=MAX_HEADER_BYTES,
            max_values=_MAX_HEADER_VALUES,
            max_containers=_MAX_HEADER_CONTAINERS,
            max_depth=3,
        )
    except SchemaError as e:
        raise FragmentError(str(e)) from e
    if isinstance(hd, dict) and hd.get("codec_version") != CODEC_VERSION:
        raise FragmentVersionError(
            f"fragment codec version {hd.get('codec_version')!r}, this build speaks {CODEC_VERSION}; "
            "upgrade the older side"
        )
    try:
        header = from_dict(FragmentHeader, hd)
    except SchemaError as e:
        raise FragmentError(f"fragment header: {e}") from e
    if expect is not None:
        _check_expect(header, expect)
    numel = sum(math.prod(s) for s in header.shapes)
    if numel > max_params:
        raise FragmentError(f"fragment holds {numel} parameters, over the {max_params} limit")
    cf = unpack_payload(buf[p_at + _U32.size : end], header.shapes, header.cfg)
    return header, cf, signer


# ---- size accounting ---------------------------------------------------------------------------------


def _header_size(header: FragmentHeader) -> int:
    return len(msgpack.packb(to_dict(header), use_bin_type=True))


def _expected_index_bits(lay: Layout) -> float:
    """Expected Golomb bits for uniformly placed indices, geometric model of the gaps."""
    if lay.n_kept == 0:
        return 0.0
    mu_c = (lay.u - lay.k) / (lay.k + 1)  # (NC,) mean gap in each chunk
    mu = float((mu_c * lay.k).sum() / lay.n_kept)
    M = 1 if mu < 0.5 else math.ceil(math.log(1 + mu / (mu + 1)) / -math.log(mu / (mu + 1)))
    w, c = _golomb_split(M)
    theta = mu_c / (mu_c + 1)
    tM = theta**M
    per_gap = tM / (1 - tM) + 1 + (w + (theta**c - tM) / (1 - tM) if M > 1 else 0)
    return float((per_gap * lay.k).sum())


def wire_bytes(
    x: CompressedFragment | Sequence[Shape],
    cfg: SparseLoCoConfig | None = None,
    *,
    header: FragmentHeader | None = None,
) -> int:
    """Bytes on the wire: exact for a fragment, expected (uniform index positions) for a list of shapes."""
    if isinstance(x, CompressedFragment):
        lay, cfg = x.layout, x.cfg
        payload = len(pack_payload(x))
    else:
        if cfg is None:
            raise ValueError("wire_bytes(shapes, cfg): cfg is required with shapes")
        lay = layout(tuple(tuple(s) for s in x), cfg)
        b = cfg.value_bits
        bits = _expected_index_bits(lay) + lay.n_kept * b
        payload = (
            _PAYLOAD_HEAD.size
            + 4 * (len(lay.sparse) * (1 + (1 << b)) + len(lay.dense))
            + lay.n_chunks
            + 2 * lay.n_dense
            + math.ceil(bits / 8)
            + 3
        )
    if header is None:
        header = FragmentHeader(
            run_id="run-00000000",
            stage=0,
            fragment=0,
            round=0,
            replica=0,
            shapes=lay.shapes,
            tokens=1 << 20,  # a typical round's count: a 5-byte msgpack integer
            **_decode_fields(cfg),
        )
    return _FRAME.size + _header_size(header) + _U32.size + payload + _KEY + _SIG


def ratio(
    x: CompressedFragment | Sequence[Shape],
    cfg: SparseLoCoConfig | None = None,
    *,
    header: FragmentHeader | None = None,
) -> float:
    """Compression ratio: dense fp32 bytes / wire bytes (header and signature included)."""
    shapes = x.shapes if isinstance(x, CompressedFragment) else x
    return 4 * sum(math.prod(s) for s in shapes) / wire_bytes(x, cfg, header=header)


__all__ = [
    "CODEC_VERSION",
    "FORMAT_VERSION",
    "FragmentError",
    "FragmentHeader",
    "FragmentMismatch",
    "FragmentSignatureError",
    "FragmentVersionError",
    "UntrustedFragmentSigner",
    "decode_fragment",
    "encode_fragment",
    "golomb_decode",
    "golomb_encode",
    "pack_payload",
    "ratio",
    "seal_payload",
    "unpack_payload",
    "wire_bytes",
]

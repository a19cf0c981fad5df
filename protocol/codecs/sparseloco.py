"""SparseLoCo pseudo-gradient compression: per-chunk top-k, b-bit quantization, error feedback.

SparseLoCo (arXiv 2508.15706), per stage worker r and outer round:

    e_r = beta * e_r + Delta_r             # error feedback, beta = 0.95
    c_r = Q_b(TopK_per_chunk(e_r))         # k of every chunk of `chunk` coordinates (64 of 4096)
    e_r = e_r - decode(c_r)                # what was not sent stays for a later round

Chunks. A 2-D tensor (m, n) is cut into t x t tiles (t = sqrt(chunk) = 64), row-major over the tile grid
and row-major inside a tile; an edge tile holds only its real h x w elements. Any other tensor is
flattened and cut into runs of `chunk`; the tail chunk holds the remainder. A chunk with u real elements
keeps k_c = ceil(k * u / chunk) of them: the density of a full chunk, never less than one element and
never more than u. Unless `dense_1d` is off, 1-D and 0-D tensors (norms, biases) skip all this and are
sent dense (see `SparseLoCoConfig.dense_1d`).

Quantizer Q_b. Each chunk gets a scale s_c: the RMS of its kept values on a 1/8-octave grid below the
tensor's largest (s_c = ref * 2^(-code/8), one byte; code 255 marks an all-zero chunk). A kept value v is
normalized to y = v / s_c and coded in b bits: a sign bit and b-1 bits of magnitude level, with Lloyd-Max
thresholds on |y| fitted per tensor. It decodes to the mean of its bin (a per-tensor table of 2^b fp32
means, as Templar dequantizes to bin means) times s_c. The per-chunk scale costs 8 bits per 4096
coordinates (1.3% of the bytes); where tiles differ in scale it cuts the quantization error by 10-20%
(see docs/benchmarks.md), and elsewhere it costs nothing in error.

Stochastic rounding (`rounding_key`, `sync.stochastic_rounding`). Deterministic rounding codes |y| to the
nearest Lloyd level and decodes the bin's mean. Stochastic rounding decodes the Lloyd centers themselves and
codes |y| between the two centers around it, c_j <= |y| < c_j+1, as level j + 1 with probability
(|y| - c_j) / (c_j+1 - c_j): unbiased between the outer centers (|y| below the lowest or above the highest
takes that center). The uniforms are numpy's Philox, a counter-based generator keyed by a hash of (run,
stage, fragment, round, replica) (`rounding_key`), drawn in entry order, so every encoder (host or device)
codes the same entries with the same draws. Error feedback keeps what the rounding moved, as always.

Bounds a decoder checks (`check_values`, on the tables and scales, not per entry). A chunk keeping k_c
values of RMS s has |v| <= sqrt(k_c) s, and s_c >= s 2^(-1/16) (nearest grid step; clipping at code 254
only raises s_c), so |y| <= 2^(1/16) sqrt(k_c); in float32's subnormal range rounding s_c to a multiple
of 2^-149 costs up to another 1.5x. A bin mean lies within its bin, so every table entry of an honest
encoder has |table| <= 1.5 * 2^(1/16) sqrt(k) < 2 sqrt(k) (16 for k = 64). And max |table| * ref <= float32's
max makes every decoded value table * s_c finite, since s_c <= ref. `compress` refuses what fails them.

This module is the math (pure functions on tensors); `protocol.codecs.sparseloco_format` is the signed wire
format with entropy-coded indices.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from protocol.codecs.fragment_errors import FragmentError

Shape = tuple[int, ...]

_SIGN_CLEAR = np.int32(0x7FFFFFFF)  # |x| of an IEEE float32, as int32: same order as the floats, NaN on top
_SCALE_STEPS_PER_OCTAVE = 8
_ZERO_CHUNK = 255  # chunk scale code of an all-zero chunk
# 2^(-code/8) as float32, from correctly rounded Python floats: every host decodes s_c to the same bits.
_SCALE_LUT = np.array([2.0 ** (-c / _SCALE_STEPS_PER_OCTAVE) for c in range(_ZERO_CHUNK)] + [0.0], np.float32)
_LLOYD_ITERS = 12

_F32_MAX = float(np.finfo(np.float32).max)
_TABLE_BOUND_PER_SQRT_K = 2.0  # honest |table| <= 1.5 * 2^(1/16) sqrt(k) = 1.57 sqrt(k): see the module doc


def rounding_key(run_id: str, stage: int, fragment: int, round: int, replica: int) -> int:
    """The 128-bit Philox key of a fragment's stochastic rounding: sha256 of its identity (hashlib, not a
    hand-made hash), so a replica never reuses draws across rounds or fragments."""
    raw = f"{run_id}|{stage}|{fragment}|{round}|{replica}".encode()
    return int.from_bytes(hashlib.sha256(raw).digest()[:16], "little")


def rounding_uniforms(key: int, n: int) -> np.ndarray:
    """(n,) float64 uniforms in [0, 1), the entries' draws in entry order (the same on every host)."""
    return np.random.Generator(np.random.Philox(key=key)).random(n)


def stochastic_levels(m: np.ndarray, c: np.ndarray, u: np.ndarray) -> np.ndarray:
    """(N,) levels of |y| = m (N,) between the centers c (N, L) around it: level j + 1 with probability
    (m - c_j) / (c_j+1 - c_j) (u (N,) the draws); the outer centers below and above. float64 throughout,
    so the device path's torch arithmetic gives the same levels."""
    L = c.shape[1]
    j = np.clip((m[:, None] >= c).sum(axis=1) - 1, 0, L - 2)
    lo = np.take_along_axis(c, j[:, None], 1)[:, 0]
    hi = np.take_along_axis(c, j[:, None] + 1, 1)[:, 0]
    gap = hi - lo
    p = np.clip(np.divide(m - lo, gap, out=np.zeros_like(gap), where=gap > 0), 0.0, 1.0)
    return j + (u < p)


@dataclass(kw_only=True, frozen=True)
class SparseLoCoConfig:
    """SparseLoCo codec settings (arXiv 2508.15706 defaults: 64 of 4096, 2 bits, beta 0.95)."""

    chunk: int = 4096
    """Coordinates per chunk; a perfect square, since 2-D weights are tiled sqrt(chunk) x sqrt(chunk)."""
    k: int = 64
    """Coordinates kept (top-k by magnitude) per full chunk; 64/4096 = 1.56% density."""
    beta: float = 0.95
    """Error-feedback decay: e = beta * e + Delta before each compression."""
    value_bits: int = 2
    """Bits per kept value: one sign bit and value_bits-1 magnitude-level bits (1..4)."""
    dense_1d: bool = True
    """Send 1-D and 0-D tensors (norms, biases) dense as fp16 after dividing by the tensor's fp32
    max-abs scale (so fp16 can neither overflow nor flush small values); False chunks them like any
    flattened tensor."""

    def __post_init__(self) -> None:
        for name in ("chunk", "k", "value_bits"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"SparseLoCoConfig.{name} must be an integer, got {v!r}")
        if not isinstance(self.dense_1d, bool):
            raise ValueError(f"SparseLoCoConfig.dense_1d must be a bool, got {self.dense_1d!r}")
        t = math.isqrt(max(self.chunk, 0))
        if not 1 <= self.chunk <= 65536 or t * t != self.chunk:
            raise ValueError(
                f"SparseLoCoConfig.chunk={self.chunk} must be a perfect square in [1, 65536] "
                "(2-D weights are tiled sqrt(chunk) x sqrt(chunk); the design uses 4096 = 64 x 64)"
            )
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"SparseLoCoConfig.k={self.k} must be in [1, chunk={self.chunk}]")
        if not (isinstance(self.beta, (int, float)) and 0.0 <= self.beta <= 1.0):
            raise ValueError(f"SparseLoCoConfig.beta={self.beta!r} must be a number in [0, 1]")
        if not 1 <= self.value_bits <= 4:
            raise ValueError(f"SparseLoCoConfig.value_bits={self.value_bits} must be in 1..4")

    @property
    def tile(self) -> int:
        """Side of the square tile a 2-D weight is cut into (64 for chunk 4096)."""
        return math.isqrt(self.chunk)


@dataclass(frozen=True, eq=False)
class Layout:
    """Where every chunk of a fragment lies: a pure function of (shapes, cfg), shared by both ends.

    Chunk c is a (h, w) block of its tensor with row stride `stride[c]`, starting at flat offset `base[c]`;
    its within-chunk index i in [0, u[c]) is element (i // w, i % w) of the block. Flat chunks use
    w = stride = tile, so i is simply the offset from `base[c]`. Kept entries are stored chunk after chunk;
    chunk c owns entries `entry_start[c]:entry_start[c + 1]` (k[c] of them).
    """

    shapes: tuple[Shape, ...]
    dense: tuple[int, ...]  # tensors sent dense, in fragment order
    sparse: tuple[int, ...]  # tensors sent as top-k chunks, in fragment order
    chunk_start: np.ndarray  # (T_s + 1,) first chunk of each sparse tensor
    k: np.ndarray  # (NC,) kept entries per chunk
    u: np.ndarray  # (NC,) real elements per chunk
    w: np.ndarray  # (NC,) block width
    stride: np.ndarray  # (NC,) block row stride in the tensor
    base: np.ndarray  # (NC,) flat offset of the block's first element in its tensor
    entry_start: np.ndarray  # (NC + 1,) cumsum of k
    dense_start: np.ndarray  # (T_d + 1,) offsets of the dense tensors in the dense value vector

    @property
    def n_chunks(self) -> int:
        return len(self.k)

    @property
    def n_kept(self) -> int:
        return int(self.entry_start[-1])

    @property
    def n_dense(self) -> int:
        return int(self.dense_start[-1])

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def chunk_tensor(self) -> np.ndarray:
        """(NC,) index into `sparse` of each chunk's tensor."""
        return np.repeat(np.arange(len(self.sparse)), np.diff(self.chunk_start))


def _readonly(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.flags.writeable = False


@lru_cache(maxsize=16)
def layout(shapes: tuple[Shape, ...], cfg: SparseLoCoConfig) -> Layout:
    """The chunk layout of a fragment of tensors with these shapes (cached; arrays are read-only)."""
    t, C, k = cfg.tile, cfg.chunk, cfg.k
    dense: list[int] = []
    sparse: list[int] = []
    parts: list[tuple[np.ndarray, ...]] = []
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        if n < 1:
            raise ValueError(f"tensor {i} has shape {shape}: empty tensors cannot be compressed")
        if len(shape) <= 1 and cfg.dense_1d:
            dense.append(i)
            continue
        sparse.append(i)
        if len(shape) == 2:
            m, cols = shape
            tr, tc = -(-m // t), -(-cols // t)
            hs = np.full(tr, t, np.int64)
            hs[-1] = m - (tr - 1) * t
            ws = np.full(tc, t, np.int64)
            ws[-1] = cols - (tc - 1) * t
            h_c, w_c = np.repeat(hs, tc), np.tile(ws, tr)  # (tr*tc,) row-major over the tile grid
            ti, tj = np.divmod(np.arange(tr * tc, dtype=np.int64), tc)
            base = ti * t * cols + tj * t
            stride = np.full(tr * tc, cols, np.int64)
            u = h_c * w_c
        else:
            nc = -(-n // C)
            u = np.full(nc, C, np.int64)
            u[-1] = n - (nc - 1) * C
            w_c = stride = np.full(nc, t, np.int64)
            base = np.arange(nc, dtype=np.int64) * C
        parts.append((u, w_c, stride, base))
    cat = lambda j: np.concatenate([p[j] for p in parts]) if parts else np.zeros(0, np.int64)  # noqa: E731
    u, w, stride, base = cat(0), cat(1), cat(2), cat(3)
    k_c = np.minimum((k * u + C - 1) // C, u)  # ceil(k u / chunk): full-chunk density, >= 1
    chunk_start = np.concatenate([[0], np.cumsum([len(p[0]) for p in parts], dtype=np.int64)])
    entry_start = np.concatenate([[0], np.cumsum(k_c)])
    dense_start = np.concatenate([[0], np.cumsum([math.prod(shapes[i]) for i in dense], dtype=np.int64)])
    arrays = (chunk_start, k_c, u, w, stride, base, entry_start, dense_start)
    _readonly(*arrays)
    return Layout(
        shapes=shapes,
        dense=tuple(dense),
        sparse=tuple(sparse),
        chunk_start=chunk_start,
        k=k_c,
        u=u,
        w=w,
        stride=stride,
        base=base,
        entry_start=entry_start,
        dense_start=dense_start,
    )


@dataclass(frozen=True, eq=False)
class CompressedFragment:
    """A compressed list of tensors, in memory (the wire form is `protocol.codecs.sparseloco_format`).

    N = kept entries, NC = chunks, T_s / T_d = sparse / dense tensors, D = dense elements.
    """

    shapes: tuple[Shape, ...]
    cfg: SparseLoCoConfig
    idx: np.ndarray  # (N,) int32 within-chunk index, strictly increasing inside each chunk
    codes: np.ndarray  # (N,) uint8 value code: sign << (b - 1) | magnitude level
    chunk_scale: np.ndarray  # (NC,) uint8 s_c = ref * 2^(-code / 8); 255 = all-zero chunk
    ref_scale: np.ndarray  # (T_s,) float32 largest chunk RMS of each sparse tensor
    table: np.ndarray  # (T_s, 2^b) float32 bin means of y = v / s_c
    dense: np.ndarray  # (D,) float16 dense-tensor values divided by their scale
    dense_scale: np.ndarray  # (T_d,) float32 max-abs of each dense tensor

    @property
    def layout(self) -> Layout:
        return layout(self.shapes, self.cfg)

    @property
    def numel(self) -> int:
        return self.layout.numel


def _as_f32(x: torch.Tensor, i: int) -> np.ndarray:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"tensor {i}: expected a floating-point torch.Tensor, got {type(x).__name__}")
    return x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def _magnitudes(xs: list[np.ndarray], lay: Layout, cfg: SparseLoCoConfig) -> np.ndarray:
    """(NC, chunk) int32 |x| of every sparse chunk in tile order; padding past u is -1 (never chosen)."""
    t, C = cfg.tile, cfg.chunk
    A = np.empty((lay.n_chunks, C), np.int32)
    for j, i in enumerate(lay.sparse):
        xi = xs[i].view(np.int32)
        rows = A[lay.chunk_start[j] : lay.chunk_start[j + 1]]
        shape = lay.shapes[i]
        if len(shape) == 2:
            m, n = shape
            tr, tc = -(-m // t), -(-n // t)
            if m % t == 0 and n % t == 0:  # common case: one pass, |x| written straight into tile order
                np.bitwise_and(
                    xi.reshape(tr, t, tc, t).transpose(0, 2, 1, 3),
                    _SIGN_CLEAR,
                    out=rows.reshape(tr, tc, t, t),
                )
            else:
                P = np.full((tr * t, tc * t), -1, np.int32)
                np.bitwise_and(xi, _SIGN_CLEAR, out=P[:m, :n])
                rows.reshape(tr, tc, t, t)[...] = P.reshape(tr, t, tc, t).transpose(0, 2, 1, 3)
        else:
            flat = rows.reshape(-1)
            np.bitwise_and(xi.reshape(-1), _SIGN_CLEAR, out=flat[: xi.size])
            flat[xi.size :] = -1
    return A


def _select(A: np.ndarray, k_c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-k_c of every row of A: (rows, positions) of the kept entries, sorted by (row, position).

    np.partition (introselect, SIMD) finds each row's k_c-th largest magnitude; a threshold pass and
    flatnonzero then find the positions already in order — 3x faster here than torch.topk on CPU.
    Ties at the threshold keep the lowest positions, so the choice is deterministic.
    """
    NC, C = A.shape
    if NC == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    k = int(k_c.max())
    B = A.copy()
    B.partition(C - k, axis=1)
    thr = B[:, C - k].copy()  # (NC,) k-th largest per row
    del B
    for kk in np.unique(k_c[k_c != k]):  # edge/tail chunks keep fewer entries
        r = np.flatnonzero(k_c == kk)
        thr[r] = np.partition(A[r], C - kk, axis=1)[:, C - kk]
    flat = np.flatnonzero(A >= thr[:, None])  # (>= N,) row-major: sorted by (row, position)
    rows = flat // C
    counts = np.bincount(rows, minlength=NC)
    if not np.array_equal(counts, k_c):  # ties at the threshold: keep the lowest positions among equals
        bad = np.flatnonzero(counts != k_c)
        Ab, tb = A[bad], thr[bad, None]
        gt, eq = Ab > tb, Ab == tb
        need = k_c[bad] - gt.sum(axis=1)
        keep = gt | (eq & (np.cumsum(eq, axis=1) <= need[:, None]))
        rb = np.flatnonzero(keep)
        fixed = bad[rb // C] * C + rb % C
        flat = np.sort(np.concatenate([flat[~np.isin(rows, bad)], fixed]))
        rows = flat // C
    return rows, flat - rows * C


def _flat_index(lay: Layout, rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Flat offset in its tensor of each entry (chunk `rows`, within-chunk index `idx`)."""
    w = lay.w[rows]
    return lay.base[rows] + (idx // w) * lay.stride[rows] + idx % w


def _quantize(
    v: np.ndarray, rows: np.ndarray, lay: Layout, b: int, u: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q_b of the kept values v (N,) in chunks `rows` (N,): (codes, chunk scale codes, ref, tables).
    u: (N,) uniforms for stochastic rounding (None: deterministic)."""
    T = len(lay.sparse)
    L = 1 << (b - 1)  # magnitude levels per sign
    a = np.abs(v).astype(np.float64)
    if len(a):  # (NC,) RMS of each chunk's kept values
        s = np.sqrt(np.add.reduceat(a * a, lay.entry_start[:-1]) / lay.k)
    else:
        s = np.zeros(0)
    ref = np.maximum.reduceat(s, lay.chunk_start[:-1]) if T else np.zeros(0)  # (T_s,) largest chunk RMS
    if not np.isfinite(ref).all() or not np.isfinite(s).all():
        j = lay.chunk_tensor()[int(np.flatnonzero(~np.isfinite(s))[0])] if len(s) else 0
        raise ValueError(
            f"tensor {lay.sparse[j]} holds non-finite or too large values; refusing to compress it"
        )
    ct = lay.chunk_tensor()
    ref32 = ref.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        octaves = -np.log2(s / ref32[ct])  # (NC,) >= 0; inf for a zero chunk
    code = np.clip(np.rint(octaves * _SCALE_STEPS_PER_OCTAVE), 0, _ZERO_CHUNK - 1)
    code[s == 0] = _ZERO_CHUNK
    chunk_scale = code.astype(np.uint8)
    sq = _chunk_scales(chunk_scale, ref32, ct)[rows]  # (N,) s_c exactly as the decoder computes it
    y = np.divide(v, sq, out=np.zeros_like(v), where=sq > 0)  # (N,) about unit RMS per chunk
    m = np.abs(y)
    ent = np.diff(lay.entry_start[lay.chunk_start])  # (T,) kept entries per tensor
    tid = np.repeat(np.arange(T), ent)  # (N,) tensor of each entry (entries are grouped by tensor)
    centers = np.zeros((T, L))
    level = np.zeros(len(v), np.int64)
    if L > 1 and len(m):
        # Lloyd-Max on |y| per tensor (thresholds shared by both signs). Sorting |y| inside each tensor
        # once makes an iteration O(T L log N): bin edges by searchsorted, bin sums from prefix sums.
        seg = np.concatenate([[0], np.cumsum(ent)])  # (T+1,)
        big = 2.0 * float(m.max()) + 1.0
        srt = np.sort(tid * big + m)  # (N,) key: tensor, then |y|
        ms = srt - tid * big  # (N,) |y| sorted inside each tensor
        cs = np.concatenate([[0.0], np.cumsum(ms)])  # (N+1,)
        q = seg[:-1, None] + ((np.arange(L) + 0.5) / L * ent[:, None]).astype(np.int64)  # (T, L)
        centers = ms[q]  # start from each tensor's quantiles
        for _ in range(_LLOYD_ITERS):
            th = (centers[:, 1:] + centers[:, :-1]) / 2  # (T, L-1)
            cut = np.searchsorted(srt, np.arange(T)[:, None] * big + th)  # (T, L-1)
            edges = np.concatenate([seg[:-1, None], cut, seg[1:, None]], axis=1)  # (T, L+1)
            cnt = np.diff(edges, axis=1)
            centers = np.where(cnt > 0, (cs[edges[:, 1:]] - cs[edges[:, :-1]]) / np.maximum(cnt, 1), centers)
        th = (centers[:, 1:] + centers[:, :-1]) / 2
        if u is not None:  # between the centers around |y| (module doc)
            level = stochastic_levels(m.astype(np.float64), centers[tid], u)
        elif L == 2:
            level = (m >= th[tid, 0]).astype(np.int64)
        else:
            level = (m[:, None] >= th[tid]).sum(axis=1)
    codes = ((y < 0).astype(np.int64) << (b - 1)) | level  # (N,)
    if u is not None and L > 1:  # stochastic rounding decodes the centers themselves
        table = np.concatenate([centers, -centers], axis=1).astype(np.float32)
        return codes.astype(np.uint8), chunk_scale, ref32, table
    key = tid * 2 * L + codes
    cnt = np.bincount(key, minlength=T * 2 * L).reshape(T, 2 * L)
    tot = np.bincount(key, weights=y, minlength=T * 2 * L).reshape(T, 2 * L)
    fallback = np.concatenate([centers, -centers], axis=1)  # an empty bin decodes to its Lloyd center
    table = np.where(cnt > 0, tot / np.maximum(cnt, 1), fallback).astype(np.float32)
    return codes.astype(np.uint8), chunk_scale, ref32, table


def _chunk_scales(code: np.ndarray, ref: np.ndarray, ct: np.ndarray) -> np.ndarray:
    """(NC,) float32 s_c = ref * 2^(-code / 8), 0 for code 255 (the same arithmetic at both ends)."""
    return ref[ct].astype(np.float32) * _SCALE_LUT[code]


def table_bound(cfg: SparseLoCoConfig) -> float:
    """Largest |bin mean| a decoder accepts: 2 sqrt(k); an honest encoder stays below 1.57 sqrt(k)."""
    return _TABLE_BOUND_PER_SQRT_K * math.sqrt(cfg.k)


def _value_problem(cf: CompressedFragment) -> tuple[int, str] | None:
    """(tensor, what is wrong) for the first tensor whose scales or table no honest encoder writes, or
    whose decoded values would overflow float32; None if every value decodes finite and plausible.
    Looks at the tables and scales (T_s 2^b + T_s + T_d numbers) and the dense values (D), not the entries."""
    lay = cf.layout
    ref = cf.ref_scale.astype(np.float64)  # (T_s,)
    table = cf.table.astype(np.float64)  # (T_s, 2^b)
    peak = np.abs(table).max(axis=1, initial=0.0)  # (T_s,) largest |bin mean|; NaN propagates
    bound = table_bound(cf.cfg)
    with np.errstate(invalid="ignore", over="ignore"):
        bad_ref = ~(np.isfinite(ref) & (ref >= 0))  # (T_s,) each
        bad_table = ~np.isfinite(table.sum(axis=1))  # a NaN or inf entry survives the float64 sum
        big = ~(peak <= bound)
        over = ~(peak * ref <= _F32_MAX)  # decoded |v| = |table| * s_c <= peak * ref, as s_c <= ref
    bad = np.flatnonzero(bad_ref | bad_table | big | over)
    if len(bad):
        j = int(bad[0])
        i = lay.sparse[j]
        if bad_ref[j]:
            return i, f"tensor scale {ref[j]:.4g} is not a finite non-negative number"
        if bad_table[j]:
            return i, "bin-mean table holds a non-finite value"
        if big[j]:
            return i, (
                f"bin-mean table holds {peak[j]:.4g}, beyond the {bound:g} = 2 sqrt(k) an encoder can write "
                "(bin means of y = v / s_c, s_c the chunk RMS)"
            )
        return i, f"table x scale = {peak[j] * ref[j]:.4g} overflows float32 (largest {_F32_MAX:.4g})"
    ds = cf.dense_scale.astype(np.float64)  # (T_d,)
    bad = np.flatnonzero(~(np.isfinite(ds) & (ds >= 0)))
    if len(bad):
        return lay.dense[bad[0]], f"dense scale {ds[bad[0]]:.4g} is not a finite non-negative number"
    bad = np.flatnonzero(~(np.abs(cf.dense) <= 1))  # NaN fails too
    if len(bad):
        j = int(np.searchsorted(lay.dense_start, bad[0], side="right")) - 1
        return lay.dense[j], f"dense value {float(cf.dense[bad[0]]):.4g} lies outside [-1, 1]"
    return None


def check_values(cf: CompressedFragment) -> None:
    """Raise `FragmentError` unless every value of cf decodes finite and its tables are ones an honest
    encoder writes (|table| <= `table_bound`, max |table| x ref within float32). `decompress`,
    `decoded_entries` and `protocol.codecs.sparseloco_device.decompress_to` call it before decoding."""
    problem = _value_problem(cf)
    if problem is not None:
        raise FragmentError(f"fragment tensor {problem[0]}: {problem[1]}")


def refuse_undecodable(cf: CompressedFragment) -> CompressedFragment:
    """cf, or ValueError if a decoder would reject it (values too large to code): encoders call it last."""
    problem = _value_problem(cf)
    if problem is not None:
        raise ValueError(f"tensor {problem[0]}: {problem[1]}; refusing to compress it")
    return cf


def compress(
    tensors: list[torch.Tensor], cfg: SparseLoCoConfig, key: int | None = None
) -> CompressedFragment:
    """Q_b(TopK_per_chunk(x)) of each tensor (any float dtype; computed in float32); key: round
    stochastically with that `rounding_key`'s draws (None: deterministically).

    Raises ValueError for an empty or non-floating tensor, one holding NaN/inf, or one whose values are
    so large (|x| within a factor 2 sqrt(k) of float32's max: 2e37 for k = 64) that a decoder's
    `check_values` would reject the fragment.
    """
    xs = [_as_f32(x, i) for i, x in enumerate(tensors)]
    lay = layout(tuple(tuple(int(d) for d in x.shape) for x in xs), cfg)
    rows, pos = _select(_magnitudes(xs, lay, cfg), lay.k)  # (N,), (N,) sorted by (chunk, position)
    t = cfg.tile
    idx = (pos // t) * lay.w[rows] + pos % t  # (N,) padded tile position -> within-chunk index
    flat = _flat_index(lay, rows, idx)
    v = np.empty(len(idx), np.float32)  # (N,) kept values, gathered tensor by tensor
    for j, i in enumerate(lay.sparse):
        a, e = lay.entry_start[lay.chunk_start[j]], lay.entry_start[lay.chunk_start[j + 1]]
        v[a:e] = xs[i].reshape(-1)[flat[a:e]]
    u = None if key is None else rounding_uniforms(key, len(v))
    codes, chunk_scale, ref, table = _quantize(v, rows, lay, cfg.value_bits, u)
    dense_x = [xs[i].reshape(-1) for i in lay.dense]
    dense_scale = np.array([np.abs(x).max() for x in dense_x], np.float32)
    if not np.isfinite(dense_scale).all():
        bad = lay.dense[int(np.flatnonzero(~np.isfinite(dense_scale))[0])]
        raise ValueError(f"tensor {bad} holds non-finite values; refusing to compress it")
    dense = np.empty(lay.n_dense, np.float16)
    for j, x in enumerate(dense_x):
        s = dense_scale[j]
        dense[lay.dense_start[j] : lay.dense_start[j + 1]] = x / s if s > 0 else 0
    cf = CompressedFragment(
        shapes=lay.shapes,
        cfg=cfg,
        idx=idx.astype(np.int32),
        codes=codes,
        chunk_scale=chunk_scale,
        ref_scale=ref,
        table=table,
        dense=dense,
        dense_scale=dense_scale,
    )
    return refuse_undecodable(cf)


def _entries(cf: CompressedFragment) -> tuple[list[np.ndarray], list[np.ndarray]]:
    lay = cf.layout
    rows = np.repeat(np.arange(lay.n_chunks), lay.k)  # (N,) chunk of each entry
    ct = lay.chunk_tensor()
    tid = ct[rows]
    sq = _chunk_scales(cf.chunk_scale, cf.ref_scale, ct)[rows]  # (N,)
    v = cf.table[tid, cf.codes.astype(np.int64)] * sq  # (N,) float32
    flat = _flat_index(lay, rows, cf.idx.astype(np.int64))
    offs, vals = [], []
    for j in range(len(lay.sparse)):
        a, e = lay.entry_start[lay.chunk_start[j]], lay.entry_start[lay.chunk_start[j + 1]]
        offs.append(flat[a:e])
        vals.append(v[a:e])
    return offs, vals


def decoded_entries(cf: CompressedFragment) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per sparse tensor (in `layout.sparse` order): flat offsets of the kept entries and their values.
    Raises `FragmentError` (`check_values`) for values no honest encoder sends or that overflow float32."""
    check_values(cf)
    return _entries(cf)


def _dense_values(cf: CompressedFragment, j: int) -> np.ndarray:
    lay = cf.layout
    return cf.dense[lay.dense_start[j] : lay.dense_start[j + 1]].astype(np.float32) * cf.dense_scale[j]


def decompress(cf: CompressedFragment) -> list[torch.Tensor]:
    """Dense float32 tensors, zero wherever nothing was sent; all finite.

    Raises `FragmentError` (`check_values`) for values no honest encoder sends or that overflow float32.
    """
    check_values(cf)
    lay = cf.layout
    out: list[torch.Tensor] = [torch.empty(0)] * len(lay.shapes)
    offs, vals = _entries(cf)
    for j, i in enumerate(lay.sparse):
        x = np.zeros(math.prod(lay.shapes[i]), np.float32)  # calloc: no separate memset pass
        x[offs[j]] = vals[j]
        out[i] = torch.from_numpy(x).view(lay.shapes[i])
    for j, i in enumerate(lay.dense):
        out[i] = torch.from_numpy(_dense_values(cf, j)).view(lay.shapes[i])
    return out


def kept_indices(cf: CompressedFragment) -> list[torch.Tensor | None]:
    """Flat offsets of the coordinates sent for each tensor; None for a tensor sent dense."""
    lay = cf.layout
    offs, _ = _entries(cf)
    out: list[torch.Tensor | None] = [None] * len(lay.shapes)
    for j, i in enumerate(lay.sparse):
        out[i] = torch.from_numpy(offs[j])
    return out


def error_feedback_step(
    e: list[torch.Tensor], delta: list[torch.Tensor], cfg: SparseLoCoConfig, key: int | None = None
) -> tuple[CompressedFragment, list[torch.Tensor]]:
    """One SparseLoCo error-feedback round (arXiv 2508.15706, Alg. 1):

        e' = beta * e + delta;  c = Q_b(TopK(e'));  e_new = e' - decode(c)

    so that beta * e + delta == e_new + decompress(c) up to float32 rounding. Inputs are not modified;
    e_new is float32 on the CPU. key: as `compress`. Returns (c, e_new).
    """
    if len(e) != len(delta):
        raise ValueError(f"error feedback: {len(e)} buffers but {len(delta)} pseudo-gradients")
    acc: list[torch.Tensor] = []
    for i, (ei, di) in enumerate(zip(e, delta, strict=True)):
        if ei.shape != di.shape:
            raise ValueError(
                f"error feedback: tensor {i} buffer {tuple(ei.shape)} vs delta {tuple(di.shape)}"
            )
        acc.append(
            torch.add(di.detach().float(), ei.detach().float(), alpha=cfg.beta).cpu()
        )  # beta*e + delta
    cf = compress(acc, cfg, key)  # refuses what a decoder would reject
    lay = cf.layout
    offs, vals = _entries(cf)
    for j, i in enumerate(lay.sparse):  # e_new = e' - decode(c), only where c is nonzero
        acc[i].view(-1)[torch.from_numpy(offs[j])] -= torch.from_numpy(vals[j])
    for j, i in enumerate(lay.dense):
        acc[i] -= torch.from_numpy(_dense_values(cf, j)).view(acc[i].shape)
    return cf, acc


__all__ = [
    "CompressedFragment",
    "Layout",
    "SparseLoCoConfig",
    "check_values",
    "compress",
    "decoded_entries",
    "decompress",
    "error_feedback_step",
    "kept_indices",
    "layout",
    "refuse_undecodable",
    "rounding_key",
    "rounding_uniforms",
    "stochastic_levels",
    "table_bound",
]

"""SparseLoCo error feedback where the tensors live (torch on cuda or cpu), with the numpy path's wire form.

SparseLoCo (arXiv 2508.15706), per stage worker and outer round:

    e' = beta * e + Delta                  # error feedback, beta = 0.95
    c  = Q_b(TopK_per_chunk(e'))           # k of every chunk of `chunk` coordinates (64 of 4096)
    e  = e' - decode(c)                    # what was not sent stays for a later round

`protocol.codecs.sparseloco` is the reference: numpy on the host, 0.4 GB/s. Here tiling, top-k, the quantizer
and the residual update run on the device of e and Delta; only the compact arrays of the
`CompressedFragment` (kept indices, value codes, chunk scale codes, tensor scales, bin-mean tables, the
dense 1-D tensors: ~1/200 of the stage) cross to the host, through pinned buffers with one
synchronisation per round. The fragment is the reference's in-memory form (numpy arrays, same dtypes and
meaning), so `protocol.codecs.sparseloco_format` signs and Golomb-codes it unchanged, on the host.

Exactness, against the reference:
- Top-k keeps exactly the reference's entries. A chunk position p of value x gets the int64 sort key
  bits(|x|) * 2^16 + (chunk - 1 - p), where bits(|x|) is the IEEE pattern as an int32 (ordered like the
  floats, NaN on top). The keys of a chunk are distinct, so its top k_c keys are one set whatever top-k
  algorithm runs, and among equal magnitudes the lowest positions win, as in the reference. Padding of an
  edge tile or tail chunk has a negative key and is never chosen (k_c <= real elements).
- The quantizer is the same algorithm: scale codes on the 1/8-octave grid below the tensor's largest
  chunk RMS, `_LLOYD_ITERS` Lloyd-Max iterations per tensor on |y| started from the quantiles, bin-mean
  tables with the Lloyd center for an empty bin, codes sign << (b - 1) | level. Its float64 sums run in
  another order, so a rare scale code, threshold or table entry may differ from the reference's.
- Decoding is the reference decoder's float32 arithmetic (s_c = ref * 2^(-code/8), then
  value = table[tensor, code] * s_c, each one IEEE multiply), so e_new == e' - decompress(c) bit for bit,
  and `decompress_to` equals `decompress` bit for bit on any device. Both reject the same fragments
  (`protocol.codecs.sparseloco.check_values`, run on the host arrays before anything is uploaded).

Memory: the stage's e is updated in place (no second copy of the stage). Tensors are compressed one at a
time, so the full-size temporaries are one tensor's e' and its int64 sort keys (16 bytes per element of
the largest tensor); over the kept entries (1.56% of the stage) the Lloyd-Max step peaks near 100 bytes
per entry. e' is computed twice (to select, then into e once the fragment is accepted), which keeps e
untouched when a tensor is rejected.

Speed (H200, a 1.95e9-parameter stage of 4096 x 4096 and 4096 x 14336 weights, fp32): 107 ms from (e,
Delta) on the GPU to the fragment's arrays on the host, 72 GB/s; top-k over the int64 keys is 55% of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from protocol.codecs.sparseloco import (
    _LLOYD_ITERS,
    _SCALE_LUT,
    _SCALE_STEPS_PER_OCTAVE,
    _ZERO_CHUNK,
    CompressedFragment,
    Layout,
    Shape,
    SparseLoCoConfig,
    check_values,
    layout,
    refuse_undecodable,
    rounding_uniforms,
)

_SIGN_CLEAR = 0x7FFFFFFF  # |x| of an IEEE float32, as int32 bits
_POS_BITS = 16  # chunk <= 65536: a within-chunk position fits in the low 16 bits of a sort key
_POS_MASK = (1 << _POS_BITS) - 1
_TID_SHIFT = 32  # Lloyd-Max sort key: tensor << 32 | bits(|y|)


def _h2d(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device`, without a synchronisation (staged through pinned memory on cuda)."""
    t = torch.from_numpy(np.array(a, order="C"))  # a copy: layout arrays are read-only
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=device)


# ---- top-k per chunk -----------------------------------------------------------------------------------


def _sort_keys(x: torch.Tensor, shape: Shape, cfg: SparseLoCoConfig, rev: torch.Tensor) -> torch.Tensor:
    """(NC, chunk) int64 key bits(|x|) * 2^16 + (chunk - 1 - p) of every position p of every chunk, in
    tile order; padding past a chunk's real elements gets a negative key."""
    t, C = cfg.tile, cfg.chunk
    bits = x.view(torch.int32)
    if len(shape) == 2:
        m, n = shape
        tr, tc = -(-m // t), -(-n // t)
        if m % t == 0 and n % t == 0:
            a = torch.bitwise_and(bits, _SIGN_CLEAR)  # (m, n)
        else:
            a = torch.full((tr * t, tc * t), -1, dtype=torch.int32, device=x.device)
            a[:m, :n] = torch.bitwise_and(bits, _SIGN_CLEAR)
        tiles = a.view(tr, t, tc, t).permute(0, 2, 1, 3)  # (tr, tc, t, t) view
        key = torch.empty((tr, tc, t, t), dtype=torch.int64, device=x.device)
        torch.add(rev.view(t, t), tiles, alpha=1 << _POS_BITS, out=key)
        return key.view(tr * tc, C)
    n = bits.numel()
    nc = -(-n // C)
    a = torch.bitwise_and(bits.reshape(-1), _SIGN_CLEAR)  # (n,)
    if n % C:
        a = torch.cat([a, a.new_full((nc * C - n,), -1)])
    return torch.add(rev, a.view(nc, C), alpha=1 << _POS_BITS)  # (NC, C)


@dataclass(frozen=True)
class _Kept:
    """The kept entries of one sparse tensor, in entry order (by chunk, then position)."""

    idx: torch.Tensor  # (N_j,) int32 within-chunk index
    flat: torch.Tensor  # (N_j,) int64 offset in the tensor
    v: torch.Tensor  # (N_j,) float32 kept value
    s: torch.Tensor  # (NC_j,) float64 RMS of each chunk's kept values


def _select(
    x: torch.Tensor, shape: Shape, cfg: SparseLoCoConfig, rev: torch.Tensor, k_c: np.ndarray, kc: torch.Tensor
) -> _Kept:
    """Top-k_c of every chunk of x (float32, contiguous); k_c (NC_j,) on the host, kc the same on x's device."""
    t, C = cfg.tile, cfg.chunk
    NC, kmax = len(k_c), int(k_c.max())
    uniform = bool((k_c == kmax).all())
    key = _sort_keys(x, shape, cfg, rev)  # (NC, C)
    top = torch.topk(key, kmax, dim=1, sorted=not uniform).values  # (NC, kmax), descending if sorted
    del key
    pos = (C - 1) - torch.bitwise_and(top, _POS_MASK)  # (NC, kmax) position in the padded chunk
    valid: torch.Tensor | None = None
    if not uniform:  # edge tile / tail chunk keeps its first k_c (largest) keys; the rest sort last
        valid = torch.arange(kmax, device=x.device) < kc[:, None]  # (NC, kmax)
        pos = torch.where(valid, pos, C)
    pos = torch.sort(pos, dim=1).values  # (NC, kmax) ascending inside each chunk
    if valid is not None:
        pos = torch.where(valid, pos, 0)  # a real position, for the gather below
    row = torch.arange(NC, device=x.device)[:, None]  # (NC, 1)
    if len(shape) == 2:
        n = shape[1]
        tc = -(-n // t)
        ti, tj = row // tc, row % tc  # (NC, 1) tile coordinates
        pr, pc = pos // t, pos % t  # (NC, kmax) row and column inside the tile
        flat = (ti * t + pr) * n + tj * t + pc
        w = torch.where(tj == tc - 1, n - (tc - 1) * t, t) if n % t else t  # block width
        idx = pr * w + pc if n % t else pos
    else:
        flat = row * C + pos
        idx = pos
    v = x.view(-1)[flat]  # (NC, kmax)
    if valid is not None:
        v = torch.where(valid, v, 0.0)
    s = torch.sqrt(v.double().square().sum(dim=1) / (kc if valid is not None else kmax))  # (NC,)
    if valid is None:
        return _Kept(idx=idx.reshape(-1).int(), flat=flat.reshape(-1), v=v.reshape(-1), s=s)
    sel = _h2d(np.flatnonzero(np.arange(kmax) < k_c[:, None]), x.device)  # compaction, no host sync
    return _Kept(idx=idx.reshape(-1)[sel].int(), flat=flat.reshape(-1)[sel], v=v.reshape(-1)[sel], s=s)


# ---- quantizer -----------------------------------------------------------------------------------------


def _scale_codes(s: torch.Tensor, ref32: torch.Tensor, ct: torch.Tensor) -> torch.Tensor:
    """(NC,) uint8 chunk scale code round(8 * log2(ref / s)) in [0, 254]; 255 for an all-zero chunk."""
    octaves = -torch.log2(s / ref32.double()[ct])  # (NC,) >= 0
    code = torch.clamp(torch.round(octaves * _SCALE_STEPS_PER_OCTAVE), 0, _ZERO_CHUNK - 1)
    code = torch.where(s > 0, code, float(_ZERO_CHUNK))
    return torch.nan_to_num(code, nan=float(_ZERO_CHUNK)).to(torch.uint8)  # NaN input: rejected later


def _bin_edges(
    key: torch.Tensor, centers: torch.Tensor, seg: torch.Tensor, tensor_id: torch.Tensor
) -> torch.Tensor:
    """(T, L+1) bin boundaries, as positions in the sorted keys, of the Lloyd thresholds between centers.

    Position = number of entries in earlier tensors or with |y| < threshold. A float64 threshold th becomes
    the least float32 f >= th, so |y| < th exactly when bits(|y|) < bits(f)."""
    T = centers.shape[0]
    th = (centers[:, 1:] + centers[:, :-1]) / 2  # (T, L-1)
    f = th.float()
    f = torch.where(f.double() < th, torch.nextafter(f, torch.full_like(f, math.inf)), f)
    target = (tensor_id[:, None] << _TID_SHIFT) | torch.bitwise_and(f.view(torch.int32).long(), _SIGN_CLEAR)
    cut = torch.searchsorted(key, target.reshape(-1)).view(T, -1)  # (T, L-1)
    return torch.cat([seg[:-1, None], cut, seg[1:, None]], dim=1)


def _stochastic_levels(m: torch.Tensor, c: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`protocol.codecs.sparseloco.stochastic_levels` in torch float64 (the same arithmetic, so the same
    levels): m (N,), c (N, L) the centers, u (N,) the draws."""
    L = c.shape[1]
    j = ((m[:, None] >= c).sum(dim=1) - 1).clamp(0, L - 2)
    lo = c.gather(1, j[:, None])[:, 0]
    hi = c.gather(1, j[:, None] + 1)[:, 0]
    gap = hi - lo
    p = torch.where(gap > 0, (m - lo) / torch.where(gap > 0, gap, 1.0), 0.0).clamp(0.0, 1.0)
    return j + (u < p).long()


def _lloyd_table(
    y: torch.Tensor, tid: torch.Tensor, seg_np: np.ndarray, b: int, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max on |y| per tensor (thresholds shared by both signs) and the bin-mean table, all tensors
    at once: (codes (N,) uint8, table (T, 2^b) float32). Entries are grouped by tensor, seg (T+1,) bounds.

    |y| is sorted once inside each tensor (key tensor << 32 | bits(|y|)), so an iteration is O(T L log N):
    bin edges by searchsorted, bin sums from prefix sums; so are the table's sums, per sign."""
    device = y.device
    T, L = len(seg_np) - 1, 1 << (b - 1)
    m = y.abs()  # (N,) float32
    neg = y < 0  # (N,)
    seg = _h2d(seg_np, device)  # (T+1,)
    tensor_id = torch.arange(T, device=device)
    if L > 1:
        key, order = torch.sort((tid << _TID_SHIFT) | m.view(torch.int32).long())  # (N,) tensor, then |y|
        ms = torch.bitwise_and(key, 0xFFFFFFFF).int().view(torch.float32)  # (N,) |y| sorted in each tensor
        neg_s = neg[order]
        del order
    else:
        key, ms, neg_s = tid, m, neg  # one bin per sign: no thresholds, no sorting
    ms64 = ms.double()
    zero = torch.zeros(1, dtype=torch.float64, device=device)
    cs = torch.cat([zero, ms64.cumsum(0)])  # (N+1,) prefix sums of |y|
    if L > 1:
        ent = np.diff(seg_np)
        q = seg_np[:-1, None] + ((np.arange(L) + 0.5) / L * ent[:, None]).astype(np.int64)  # (T, L)
        centers = ms64[_h2d(q, device)]  # start from each tensor's quantiles
        for _ in range(_LLOYD_ITERS):
            edges = _bin_edges(key, centers, seg, tensor_id)  # (T, L+1)
            cnt = edges.diff(dim=1)
            mean = (cs[edges[:, 1:]] - cs[edges[:, :-1]]) / cnt.clamp(min=1)
            centers = torch.where(cnt > 0, mean, centers)
        th = (centers[:, 1:] + centers[:, :-1]) / 2  # (T, L-1)
        if u is not None:  # stochastic rounding: between the centers around |y|, decoded as the centers
            codes = (neg.long() << (b - 1)) | _stochastic_levels(m.double(), centers[tid], u)
            return codes.to(torch.uint8), torch.cat([centers, -centers], dim=1).float()
        level = (m.double()[:, None] >= th[tid]).sum(dim=1)  # (N,)
    else:
        centers = torch.zeros((T, 1), dtype=torch.float64, device=device)
        level = torch.zeros_like(tid)
    edges = _bin_edges(key, centers, seg, tensor_id) if L > 1 else torch.stack([seg[:-1], seg[1:]], 1)
    lo, hi = edges[:, :-1], edges[:, 1:]  # (T, L) bin ranges in sorted order
    cn = torch.cat([zero.long(), neg_s.long().cumsum(0)])  # (N+1,) negatives so far
    csn = torch.cat([zero, torch.where(neg_s, ms64, 0.0).cumsum(0)])  # (N+1,) their |y| so far
    n_neg = cn[hi] - cn[lo]
    n_pos = (hi - lo) - n_neg
    sum_neg = csn[hi] - csn[lo]
    sum_pos = (cs[hi] - cs[lo]) - sum_neg
    pos_mean = torch.where(n_pos > 0, sum_pos / n_pos.clamp(min=1), centers)  # an empty bin decodes to
    neg_mean = torch.where(n_neg > 0, -sum_neg / n_neg.clamp(min=1), -centers)  # its Lloyd center
    table = torch.cat([pos_mean, neg_mean], dim=1).float()  # (T, 2L), column = code
    codes = (neg.long() << (b - 1)) | level  # (N,)
    return codes.to(torch.uint8), table


# ---- encode on the device, fetch to the host ---------------------------------------------------------------


@dataclass
class _Encoded:
    """A fragment still on the device, and what the residual update needs."""

    idx: torch.Tensor  # (N,) int32
    codes: torch.Tensor  # (N,) uint8
    chunk_scale: torch.Tensor  # (NC,) uint8
    ref: torch.Tensor  # (T_s,) float32
    table: torch.Tensor  # (T_s, 2^b) float32
    dense: torch.Tensor  # (D,) float16
    dense_scale: torch.Tensor  # (T_d,) float32
    ok: torch.Tensor  # (1 + T_d,) bool: sparse part finite, each dense tensor finite
    s: torch.Tensor  # (NC,) float64 chunk RMS (to name a bad tensor)
    dec: torch.Tensor  # (N,) float32 decoded kept values
    flat: list[torch.Tensor]  # per sparse tensor: (N_j,) offsets of the kept entries
    v: list[torch.Tensor]  # per sparse tensor: (N_j,) kept values of e'
    dense_dec: list[torch.Tensor]  # per dense tensor: decoded values, flat


def _encode(
    value: Callable[[int], torch.Tensor],
    lay: Layout,
    cfg: SparseLoCoConfig,
    device: torch.device,
    key: int | None = None,
) -> _Encoded:
    """Q_b(TopK_per_chunk(x)) of x_i = value(i) (float32, contiguous, on `device`), left on the device;
    key: stochastic rounding with the reference's draws (`rounding_uniforms`, made on the host)."""
    C, b = cfg.chunk, cfg.value_bits
    rev = (C - 1) - torch.arange(C, dtype=torch.int64, device=device)  # (C,) lower position, larger key
    k_dev = _h2d(lay.k, device)  # (NC,)
    idx, flat, v, s, ref = [], [], [], [], []
    for j, i in enumerate(lay.sparse):  # one tensor at a time: temporaries ~ 16 bytes per element
        c0, c1 = int(lay.chunk_start[j]), int(lay.chunk_start[j + 1])
        kept = _select(value(i), lay.shapes[i], cfg, rev, lay.k[c0:c1], k_dev[c0:c1])
        idx.append(kept.idx)
        flat.append(kept.flat)
        v.append(kept.v)
        s.append(kept.s)
        ref.append(kept.s.max())
    f32, f64 = torch.float32, torch.float64
    T = len(lay.sparse)
    s_all = _cat(s, f64, device)  # (NC,)
    ref32 = torch.stack(ref).float() if T else torch.zeros(0, dtype=f32, device=device)  # (T_s,)
    chunks_per_tensor = np.diff(lay.chunk_start)
    ct = torch.repeat_interleave(
        torch.arange(T, device=device), _h2d(chunks_per_tensor, device), output_size=lay.n_chunks
    )  # (NC,) tensor of each chunk
    rows = torch.repeat_interleave(
        torch.arange(lay.n_chunks, device=device), k_dev, output_size=lay.n_kept
    )  # (N,) chunk of each entry
    chunk_scale = _scale_codes(s_all, ref32, ct)  # (NC,)
    lut = _h2d(_SCALE_LUT, device)
    sq = (ref32[ct] * lut[chunk_scale.long()])[rows]  # (N,) s_c exactly as the decoder computes it
    v_all = _cat(v, f32, device)  # (N,)
    y = torch.where(sq > 0, v_all / sq, 0.0)  # (N,) about unit RMS per chunk
    tid = ct[rows]  # (N,) tensor of each entry
    del rows, v_all
    if T:
        u = None if key is None else _h2d(rounding_uniforms(key, lay.n_kept), device)
        codes, table = _lloyd_table(y, tid, lay.entry_start[lay.chunk_start], b, u)
    else:
        codes = torch.zeros(0, dtype=torch.uint8, device=device)
        table = torch.zeros((0, 1 << b), dtype=f32, device=device)
    dec = table.view(-1)[tid * (1 << b) + codes.long()] * sq  # (N,) float32, as the reference decodes
    dense, dense_scale, dense_dec = [], [], []
    for i in lay.dense:
        x = value(i).reshape(-1)
        scale = x.abs().max()  # float32; NaN propagates
        q = torch.where(scale > 0, x / scale, 0.0).half()
        dense.append(q)
        dense_scale.append(scale)
        dense_dec.append(q.float() * scale)
    ok_sparse = torch.isfinite(s_all).all() & torch.isfinite(ref32).all() & torch.isfinite(dec).all()
    ds = torch.stack(dense_scale) if dense_scale else torch.zeros(0, dtype=f32, device=device)
    return _Encoded(
        idx=_cat(idx, torch.int32, device),
        codes=codes,
        chunk_scale=chunk_scale,
        ref=ref32,
        table=table,
        dense=_cat(dense, torch.float16, device),
        dense_scale=ds,
        ok=torch.cat([ok_sparse[None], torch.isfinite(ds)]),
        s=s_all,
        dec=dec,
        flat=flat,
        v=v,
        dense_dec=dense_dec,
    )


def _to_host(arrays: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Device -> host: non-blocking copies into pinned buffers, then one synchronisation."""
    first = next(iter(arrays.values()))
    if first.device.type == "cpu":
        return {k: a.numpy() for k, a in arrays.items()}
    if first.device.type != "cuda":
        return {k: a.cpu().numpy() for k, a in arrays.items()}
    host = {k: torch.empty(a.shape, dtype=a.dtype, pin_memory=True) for k, a in arrays.items()}
    for k, a in arrays.items():
        host[k].copy_(a, non_blocking=True)
    torch.cuda.current_stream(first.device).synchronize()
    return {k: h.numpy() for k, h in host.items()}


def _check_finite(enc: _Encoded, ok: np.ndarray, lay: Layout) -> None:
    """Raise ValueError naming the first tensor with NaN/inf or values too large to code (error path)."""
    if not ok[0]:
        s = enc.s.cpu().numpy()
        bad_chunk = np.flatnonzero(~np.isfinite(s))
        if len(bad_chunk):
            j = int(lay.chunk_tensor()[bad_chunk[0]])
        else:  # a decoded value overflowed
            bad_entry = int(torch.nonzero(~torch.isfinite(enc.dec))[0, 0])
            j = int(np.searchsorted(lay.entry_start[lay.chunk_start], bad_entry, side="right")) - 1
        raise ValueError(
            f"tensor {lay.sparse[j]} holds non-finite or too large values; refusing to compress it"
        )
    if not ok[1:].all():
        bad = lay.dense[int(np.flatnonzero(~ok[1:])[0])]
        raise ValueError(f"tensor {bad} holds non-finite values; refusing to compress it")


def _fetch(enc: _Encoded, lay: Layout, cfg: SparseLoCoConfig) -> CompressedFragment:
    h = _to_host(
        {
            "idx": enc.idx,
            "codes": enc.codes,
            "chunk_scale": enc.chunk_scale,
            "ref": enc.ref,
            "table": enc.table,
            "dense": enc.dense,
            "dense_scale": enc.dense_scale,
            "ok": enc.ok,
        }
    )
    _check_finite(enc, h["ok"], lay)
    cf = CompressedFragment(
        shapes=lay.shapes,
        cfg=cfg,
        idx=h["idx"],
        codes=h["codes"],
        chunk_scale=h["chunk_scale"],
        ref_scale=h["ref"],
        table=h["table"],
        dense=h["dense"],
        dense_scale=h["dense_scale"],
    )
    return refuse_undecodable(cf)  # what a decoder would reject (values near float32's max)


# ---- public API --------------------------------------------------------------------------------------------


def _device_of(tensors: list[torch.Tensor], what: str) -> torch.device:
    device = tensors[0].device if tensors else torch.device("cpu")
    for i, x in enumerate(tensors):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{what} {i}: expected a floating-point torch.Tensor, got {type(x).__name__}")
        if x.device != device:
            raise ValueError(f"{what} {i} is on {x.device}, tensor 0 on {device}: put them on one device")
        if x.numel() == 0:
            raise ValueError(f"{what} {i} has shape {tuple(x.shape)}: empty tensors cannot be compressed")
    return device


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float32).contiguous()


def _shapes(xs: list[torch.Tensor]) -> tuple[Shape, ...]:
    return tuple(tuple(int(d) for d in x.shape) for x in xs)


@torch.no_grad()
def compress_device(
    tensors: list[torch.Tensor], cfg: SparseLoCoConfig, key: int | None = None
) -> CompressedFragment:
    """`protocol.codecs.sparseloco.compress` computed on the tensors' device (any float dtype, one device).

    Same kept indices as the reference; the quantizer's codes and tables may differ in rare last bits.
    Raises ValueError for an empty or non-floating tensor, one holding NaN/inf, or one whose values are so
    large (|x| within a factor 2 sqrt(k) of float32's max) that `protocol.codecs.sparseloco.check_values` would
    reject the fragment.
    """
    device = _device_of(tensors, "tensor")
    lay = layout(_shapes(tensors), cfg)
    return _fetch(_encode(lambda i: _f32(tensors[i]), lay, cfg, device, key), lay, cfg)


@torch.no_grad()
def error_feedback_step_device(
    e: list[torch.Tensor], delta: list[torch.Tensor], cfg: SparseLoCoConfig, key: int | None = None
) -> tuple[CompressedFragment, list[torch.Tensor]]:
    """One SparseLoCo error-feedback round (arXiv 2508.15706, Alg. 1) on the device of e and delta:

        e' = beta * e + delta;  c = Q_b(TopK(e'));  e_new = e' - decode(c)

    e (float32, contiguous) is updated IN PLACE to e_new and returned: no second copy of the stage.
    delta may be any float dtype. c is on the host, as `protocol.codecs.sparseloco.compress` makes it, and
    e_new == e' - decompress(c) bit for bit (e' computed as `torch.add(delta.float(), e, alpha=beta)`).
    On cuda the call returns after one synchronisation (the fragment's arrays are on the host, views of
    pinned buffers that go back to torch's pinned-memory cache with the fragment); the residual update
    is queued on the current stream after it. Raises ValueError, leaving e untouched,
    if a tensor holds NaN/inf or values too large to code. Returns (c, e).
    """
    if len(e) != len(delta):
        raise ValueError(f"error feedback: {len(e)} buffers but {len(delta)} pseudo-gradients")
    device = _device_of(e, "error-feedback buffer")
    _device_of(list(delta), "pseudo-gradient")
    for i, (ei, di) in enumerate(zip(e, delta, strict=True)):
        if ei.shape != di.shape:
            raise ValueError(
                f"error feedback: tensor {i} buffer {tuple(ei.shape)} vs delta {tuple(di.shape)}"
            )
        if ei.dtype != torch.float32 or not ei.is_contiguous() or di.device != device:
            raise ValueError(
                f"error feedback: buffer {i} must be a contiguous float32 tensor on the device of delta "
                f"{i} (got {ei.dtype}, contiguous={ei.is_contiguous()}, {ei.device} vs {di.device})"
            )
    beta = cfg.beta
    lay = layout(_shapes(e), cfg)
    enc = _encode(lambda i: torch.add(_f32(delta[i]), e[i], alpha=beta), lay, cfg, device, key)
    cf = _fetch(enc, lay, cfg)  # raises before e is written
    for j, i in enumerate(lay.sparse):  # e_new = e' - decode(c): e' again (same kernel, same bits), then
        torch.add(_f32(delta[i]), e[i], alpha=beta, out=e[i])  # the kept entries from the values sent
        a, z = int(lay.entry_start[lay.chunk_start[j]]), int(lay.entry_start[lay.chunk_start[j + 1]])
        e[i].view(-1).index_put_((enc.flat[j],), enc.v[j] - enc.dec[a:z])
    for j, i in enumerate(lay.dense):
        torch.add(_f32(delta[i]), e[i], alpha=beta, out=e[i])
        e[i].sub_(enc.dense_dec[j].view(e[i].shape))
    return cf, list(e)


@torch.no_grad()
def decompress_to(cf: CompressedFragment, device: torch.device | str) -> list[torch.Tensor]:
    """Dense float32 tensors on `device`, bit-identical to `protocol.codecs.sparseloco.decompress(cf)`.

    Raises `FragmentError` for the fragments `decompress` rejects (`check_values`, on the host arrays).
    """
    check_values(cf)
    device = torch.device(device)
    lay = cf.layout
    T, N, b = len(lay.sparse), lay.n_kept, cf.cfg.value_bits
    out: list[torch.Tensor] = [torch.empty(0)] * len(lay.shapes)
    if T:
        k = _h2d(lay.k, device)
        rows = torch.repeat_interleave(torch.arange(lay.n_chunks, device=device), k, output_size=N)  # (N,)
        ct = torch.repeat_interleave(
            torch.arange(T, device=device), _h2d(np.diff(lay.chunk_start), device), output_size=lay.n_chunks
        )  # (NC,)
        ref = _h2d(cf.ref_scale.astype(np.float32), device)
        code = _h2d(cf.chunk_scale.astype(np.int64), device)
        sq = (ref[ct] * _h2d(_SCALE_LUT, device)[code])[rows]  # (N,) float32 s_c
        table = _h2d(cf.table.astype(np.float32), device)  # (T, 2^b)
        codes = _h2d(cf.codes.astype(np.int64), device)
        v = table.view(-1)[ct[rows] * (1 << b) + codes] * sq  # (N,) float32
        idx = _h2d(cf.idx.astype(np.int64), device)
        w = _h2d(lay.w, device)[rows]
        flat = _h2d(lay.base, device)[rows] + (idx // w) * _h2d(lay.stride, device)[rows] + idx % w  # (N,)
        for j, i in enumerate(lay.sparse):
            a, z = int(lay.entry_start[lay.chunk_start[j]]), int(lay.entry_start[lay.chunk_start[j + 1]])
            x = torch.zeros(math.prod(lay.shapes[i]), dtype=torch.float32, device=device)
            x[flat[a:z]] = v[a:z]
            out[i] = x.view(lay.shapes[i])
    for j, i in enumerate(lay.dense):
        d0, d1 = int(lay.dense_start[j]), int(lay.dense_start[j + 1])
        q = _h2d(cf.dense[d0:d1].astype(np.float16), device)
        scale = _h2d(cf.dense_scale[j : j + 1].astype(np.float32), device)
        out[i] = (q.float() * scale).view(lay.shapes[i])
    return out


__all__ = ["compress_device", "decompress_to", "error_feedback_step_device"]

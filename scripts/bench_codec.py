"""SparseLoCo codec: compression ratio and encode/decode throughput, beside a naive baseline.

  python -m scripts.bench_codec [--sizes 1M,16M,64M] [--repeats 3] [--device cpu|cuda] [--check]

Each size is one Llama-style block of width d with a 4x MLP (q, k, v, o: d x d; gate, up: 4d x d;
down: d x 4d; two RMSNorm vectors): d = 256, 1024, 2048 give 1M, 16M and 64M parameters in 2-D weights.
Values are Gaussian with log-normal row and column scales (tiles of different magnitude, as real
pseudo-gradients have). Encode = compress + sign + frame; decode = verify + parse + decompress to dense
tensors. Throughput is GB/s of fp32 parameters on one core (torch and numpy limited to one thread), the
median of `--repeats` warm runs. The baseline keeps the same top-k but sends 12-bit indices and one int8
byte per value (per-tensor scale). The device row times the same compression on `--device`
(protocol/codecs/sparseloco_device.py: compress_device, and the in-place error-feedback step) against the numpy
reference `compress`, both ending with the fragment's arrays on the host. A table goes to stderr and one
JSON line, last, to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy/torch load their thread pools

import numpy as np  # noqa: E402
import torch  # noqa: E402

from protocol.codecs.sparseloco import SparseLoCoConfig, compress, decompress  # noqa: E402
from protocol.codecs.sparseloco_device import compress_device, error_feedback_step_device  # noqa: E402
from protocol.codecs.sparseloco_format import FragmentHeader, decode_fragment, encode_fragment  # noqa: E402
from protocol.identity import Identity  # noqa: E402

WIDTHS = {"1M": 256, "16M": 1024, "64M": 2048}


def block_shapes(d: int) -> list[tuple[int, ...]]:
    f = 4 * d
    return [(d, d)] * 4 + [(f, d), (f, d), (d, f), (d,), (d,)]


def make_tensors(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        x = torch.randn(s, generator=g)
        if len(s) == 2:
            x *= torch.exp(0.5 * torch.randn(s[0], 1, generator=g)) * torch.exp(
                0.5 * torch.randn(1, s[1], generator=g)
            )
        out.append(x)
    return out


# ---- naive baseline: same top-k, 12-bit indices + 1 byte per value ------------------------------------


def baseline_encode(xs: list[torch.Tensor], cfg: SparseLoCoConfig) -> bytes:
    t, k = cfg.tile, cfg.k
    parts = []
    for x in xs:
        if x.dim() == 1:
            parts.append(x.half().numpy().tobytes())
            continue
        m, n = x.shape  # the benchmark's weights are multiples of 64
        tiles = x.view(m // t, t, n // t, t).permute(0, 2, 1, 3).reshape(-1, t * t)  # (NC, chunk)
        _, idx = tiles.abs().topk(k, dim=1)  # (NC, k)
        v = tiles.gather(1, idx)
        scale = float(v.abs().max()) / 127 or 1.0
        q = torch.round(v / scale).to(torch.int8)
        i = idx.reshape(-1).numpy().astype(np.uint16)  # two 12-bit indices per 3 bytes
        a, b = i[0::2], i[1::2]
        packed = np.stack([a >> 4, ((a & 15) << 4) | (b >> 8), b & 255], axis=1).astype(np.uint8)
        parts += [np.float32(scale).tobytes(), packed.tobytes(), q.numpy().tobytes()]
    return b"".join(parts)


def baseline_decode(data: bytes, shapes: list[tuple[int, ...]], cfg: SparseLoCoConfig) -> list[torch.Tensor]:
    t, k, at = cfg.tile, cfg.k, 0
    out = []
    for s in shapes:
        if len(s) == 1:
            out.append(torch.from_numpy(np.frombuffer(data, np.float16, s[0], at).astype(np.float32)))
            at += 2 * s[0]
            continue
        m, n = s
        N = m * n // (t * t) * k
        scale = np.frombuffer(data, np.float32, 1, at)[0]
        p = np.frombuffer(data, np.uint8, N // 2 * 3, at + 4).reshape(-1, 3).astype(np.uint16)
        q = np.frombuffer(data, np.int8, N, at + 4 + N // 2 * 3)
        at += 4 + N // 2 * 3 + N
        idx = np.empty(N, np.int64)
        idx[0::2] = (p[:, 0] << 4) | (p[:, 1] >> 4)
        idx[1::2] = ((p[:, 1] & 15) << 8) | p[:, 2]
        tiles = np.zeros((m * n // (t * t), t * t), np.float32)
        np.put_along_axis(tiles, idx.reshape(-1, k), q.reshape(-1, k).astype(np.float32) * scale, axis=1)
        x = tiles.reshape(m // t, n // t, t, t).transpose(0, 2, 1, 3).reshape(m, n)
        out.append(torch.from_numpy(np.ascontiguousarray(x)))
    return out


# ---- measurement ---------------------------------------------------------------------------------------


def timed(fn, repeats: int):  # type: ignore[no-untyped-def]
    """(first result, first-call seconds, median warm seconds)."""
    t0 = time.perf_counter()
    first = fn()
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - t0)
    return first, cold, statistics.median(warm)


def bench_device(xs: list[torch.Tensor], cfg: SparseLoCoConfig, device: str, repeats: int) -> dict:
    """Reference compress (host numpy) vs the torch path on `device`; GB/s of fp32 parameters."""
    gb = 4 * sum(x.numel() for x in xs) / 1e9
    dev = [x.to(device) for x in xs]
    e = [torch.zeros_like(x) for x in dev]
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None

    def ef() -> None:
        error_feedback_step_device(e, dev, cfg)
        sync()  # the residual update queued after the fragment's arrays reached the host

    _, _, ref_s = timed(lambda: compress(xs, cfg), repeats)
    _, _, comp_s = timed(lambda: compress_device(dev, cfg), repeats)
    _, _, ef_s = timed(ef, repeats)
    return {"ref_compress_gbps": gb / ref_s, "device_compress_gbps": gb / comp_s, "device_ef_gbps": gb / ef_s}


def bench_size(name: str, repeats: int, ident: Identity, cfg: SparseLoCoConfig, device: str) -> dict:
    shapes = block_shapes(WIDTHS[name])
    xs = make_tensors(shapes)
    params = sum(math.prod(s) for s in shapes)
    gb = 4 * params / 1e9
    where: dict = {
        "run_id": "bench-run-0001",
        "stage": 0,
        "fragment": 0,
        "round": 1,
        "replica": 0,
        "tokens": 61440,
    }

    def enc() -> bytes:
        cf = compress(xs, cfg)
        return encode_fragment(ident, FragmentHeader.of(cf, **where), cf)

    data, enc_cold, enc_s = timed(enc, repeats)
    _, dec_cold, dec_s = timed(
        lambda: decompress(decode_fragment(data, trusted={ident.public_key})[1]), repeats
    )
    out = decompress(decode_fragment(data)[1])
    num = den = 0.0
    for o, x in zip(out, xs, strict=True):
        if x.dim() == 2:  # relative error of the kept values (the norms are sent dense)
            m = o != 0
            num += float(((o - x)[m] ** 2).sum())
            den += float((x[m] ** 2).sum())
    err = math.sqrt(num / den)
    base, _, base_enc_s = timed(lambda: baseline_encode(xs, cfg), repeats)
    _, _, base_dec_s = timed(lambda: baseline_decode(base, shapes, cfg), repeats)
    (hlen,) = struct.unpack_from("<I", data, 5)
    base_wire = len(base) + 4 + 1 + 4 + hlen + 4 + 32 + 64  # same header, framing and signature
    return {
        "params": params,
        "wire_bytes": len(data),
        "ratio": 4 * params / len(data),
        "bits_per_chunk": 8 * len(data) / (params / cfg.chunk),
        "encode_gbps": gb / enc_s,
        "decode_gbps": gb / dec_s,
        "codec_gbps": gb / (enc_s + dec_s),
        "encode_cold_s": enc_cold,
        "decode_cold_s": dec_cold,
        "encode_s": enc_s,
        "decode_s": dec_s,
        "kept_rel_err": err,
        "baseline_ratio": 4 * params / base_wire,
        "baseline_encode_gbps": gb / base_enc_s,
        "baseline_decode_gbps": gb / base_dec_s,
        **bench_device(xs, cfg, device, repeats),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma-separated, from " + ",".join(WIDTHS))
    ap.add_argument("--repeats", type=int, default=3, help="warm runs per measurement (median is reported)")
    ap.add_argument("--device", default="cpu", help="where the torch path runs (example: cuda:0)")
    ap.add_argument(
        "--check", action="store_true", help="validate the flags, print one JSON line, time nothing"
    )
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in WIDTHS]
    if unknown or not sizes:
        ap.error(f"--sizes: unknown size(s) {unknown}; choose from {','.join(WIDTHS)} (example: 1M,16M)")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be at least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e} (example: cpu, cuda:0)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device!r}: torch sees no CUDA device on this host")
    cfg = SparseLoCoConfig()
    if args.check:  # the blocks each size builds, without allocating them
        params = {s: sum(math.prod(sh) for sh in block_shapes(WIDTHS[s])) for s in sizes}
        print(json.dumps({"check": "ok", "bench": "codec", "params": params, "device": str(device)}))
        return
    torch.set_num_threads(1)
    ident = Identity.from_seed(bytes(32))
    res = {s: bench_size(s, args.repeats, ident, cfg, args.device) for s in sizes}
    print(
        f"SparseLoCo codec, chunk {cfg.chunk}, k {cfg.k}, {cfg.value_bits}-bit values, one core "
        f"(torch {torch.__version__}, numpy {np.__version__})",
        file=sys.stderr,
    )
    hdr = f"{'size':>5} {'params':>11} {'wire KB':>9} {'ratio':>7} {'bits/chunk':>10} {'enc GB/s':>9} {'dec GB/s':>9} {'enc+dec':>8} {'cold enc s':>10} {'kept err':>8} | {'naive ratio':>11} {'enc GB/s':>9} {'dec GB/s':>9}"
    print(hdr, file=sys.stderr)
    for s, r in res.items():
        print(
            f"{s:>5} {r['params']:>11,} {r['wire_bytes'] / 1024:>9.1f} {r['ratio']:>7.1f} {r['bits_per_chunk']:>10.1f} "
            f"{r['encode_gbps']:>9.2f} {r['decode_gbps']:>9.2f} {r['codec_gbps']:>8.2f} {r['encode_cold_s']:>10.3f} "
            f"{r['kept_rel_err']:>8.3f} | {r['baseline_ratio']:>11.1f} {r['baseline_encode_gbps']:>9.2f} {r['baseline_decode_gbps']:>9.2f}",
            file=sys.stderr,
        )
    for s, r in res.items():
        print(
            f"{s:>5} device {args.device}: compress reference {r['ref_compress_gbps']:.2f} GB/s, "
            f"torch {r['device_compress_gbps']:.2f} GB/s, error-feedback step {r['device_ef_gbps']:.2f} GB/s",
            file=sys.stderr,
        )
    head = res.get("16M") or next(iter(res.values()))
    summary = {
        "headline_size": "16M" if "16M" in res else sizes[0],
        "ratio": round(head["ratio"], 2),
        "encode_gbps": round(head["encode_gbps"], 3),
        "decode_gbps": round(head["decode_gbps"], 3),
        "codec_gbps": round(head["codec_gbps"], 3),
        "baseline_ratio": round(head["baseline_ratio"], 2),
        "device": args.device,
        "device_compress_gbps": round(head["device_compress_gbps"], 3),
        "ref_compress_gbps": round(head["ref_compress_gbps"], 3),
        "sizes": {
            s: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for s, r in res.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

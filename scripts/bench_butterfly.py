"""Butterfly mixing against the store all-to-all (issue 23): what one replica downloads per outer round, and
how many exchanges a fragment takes until every replica's update has reached all N.

  python -m scripts.bench_butterfly [--replicas 4,8,16] [--d 256] [--check]

The fragment is one Llama-style block of width d (q, k, v, o: d x d; gate, up: 4d x d; down: d x 4d; two
RMSNorm vectors), its values Gaussian with log-normal row scales. Bytes are the real signed SparseLoCo wire
format (64 of 4096, 2-bit values): the all-to-all reads N - 1 fragments of the pseudo-gradient per round;
a butterfly pair reads its partner's one message, the pseudo-gradient and the anchor difference in one
fragment of twice the tensors (node/sync/pair_mix.py). Exchanges to mix come from the pairing rule
(protocol/pairing.py); the all-to-all mixes in one. A table goes to stderr, one JSON line to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from node.sync.pair_mix import base_tag
from protocol.codecs.sparseloco import SparseLoCoConfig, compress
from protocol.codecs.sparseloco_format import FragmentHeader, encode_fragment
from protocol.identity import Identity
from protocol.pairing import butterfly_stages, exchanges_to_mix, pairs


def block(d: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(d, d)] * 4 + [(4 * d, d)] * 2 + [(d, 4 * d), (d,), (d,)]
    out = []
    for s in shapes:
        t = torch.randn(*s, generator=g)
        if len(s) == 2:
            t = t * torch.exp(torch.randn(s[0], 1, generator=g))
        out.append(t * 1e-3)
    return out


def wire_bytes(tensors: list[torch.Tensor]) -> int:
    cf = compress(tensors, SparseLoCoConfig())
    header = FragmentHeader.of(cf, run_id="bench", stage=0, fragment=0, round=0, replica=0, tokens=1)
    return len(encode_fragment(Identity.from_seed(b"\x01" * 32), header, cf))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", default="4,8,16", help="comma-separated replica counts N (each >= 2)")
    ap.add_argument("--d", type=int, default=256, help="block width d of the fragment (256: 1.0M parameters)")
    ap.add_argument(
        "--check", action="store_true", help="validate the flags, print one JSON line, measure nothing"
    )
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.replicas.split(",")]
    for n in ns:
        butterfly_stages(n)  # refuses N < 2
    if args.check:
        print(json.dumps({"check": "ok", "bench": "butterfly", "replicas": ns}))
        return 0
    delta, anchor_diff = block(args.d, 1), block(args.d, 2)
    one = wire_bytes(delta)
    pair = wire_bytes([*delta, *anchor_diff, base_tag(anchor_diff)])  # the message as pair_sync sends it
    rows = []
    for n in ns:
        L = butterfly_stages(n)  # the share of replica-exchanges the rule sits out, over one butterfly cycle
        sit_out = sum(1 - 2 * len(pairs(0, f, n)) / n for f in range(L)) / L
        rows.append(
            {
                "replicas": n,
                "all_down_bytes": (n - 1) * one,
                "butterfly_down_bytes": pair,
                "ratio": pair / ((n - 1) * one),
                "ratio_x_n_minus_1": pair / one,
                "all_exchanges_to_mix": 1,
                "butterfly_exchanges_to_mix": max(exchanges_to_mix(n, f) for f in range(butterfly_stages(n))),
                "butterfly_sit_out_share": sit_out,
            }
        )
        r = rows[-1]
        print(
            f"N={n:3d}  all-to-all {r['all_down_bytes'] / 1e3:9.1f} kB/round  butterfly "
            f"{r['butterfly_down_bytes'] / 1e3:8.1f} kB/round ({r['ratio']:.3f}x)  exchanges to mix: 1 vs "
            f"{r['butterfly_exchanges_to_mix']}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "bench": "butterfly",
                "params": sum(t.numel() for t in delta),
                "fragment_bytes": one,
                "pair_message_bytes": pair,
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

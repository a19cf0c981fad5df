"""Pipeline links: bytes of one boundary message, its serialization time, and the subspace rank k.

DESIGN section 4: a boundary sends Z = (X - T[x]) U, (b, L, k), plus the token ids, instead of X,
(b, L, d); with nested bases any k <= d is valid, so k is chosen per link from its bandwidth.
"""

from __future__ import annotations

import math


def activation_bytes(
    *,
    k: int,
    d_model: int,
    tokens: int,
    bytes_per_value: int = 2,
    token_id_bytes: int = 4,
    header_bytes: int = 256,
) -> int:
    """Bytes of one boundary message (one microbatch, one direction).

    k < d sends Z = (X - T[x]) U, (b, L, k), plus the token ids that rebuild T[x] on the far side;
    k = d sends X itself, no ids needed. The backward message (G_Z = G_X U) has the same size.
    """
    if k >= d_model:
        return tokens * d_model * bytes_per_value + header_bytes
    return tokens * (k * bytes_per_value + token_id_bytes) + header_bytes


def id_bytes(vocab: int) -> int:
    """Bytes of the smallest unsigned integer that holds a token id (uint8, uint16 or uint32)."""
    return 1 if vocab <= 1 << 8 else 2 if vocab <= 1 << 16 else 4


def transfer_s(n_bytes: float, mbps: float) -> float:
    """Serialization time of `n_bytes` on a `mbps` Mbit/s link (latency excluded)."""
    return n_bytes * 8.0 / (mbps * 1e6)


def shaped_link(
    mbps: float, rtt_ms: float, shaper_mbps: float = 0.0, delay_ms: float = 0.0
) -> tuple[float, float]:
    """(Mbit/s, rtt ms) of a link through the run spec's in-process shaper (`pipeline.bandwidth_mbps` per
    direction, 0 = none; `pipeline.delay_ms` one way): the shaper paces frames onto the measured path, so
    the two rates are in series, 1/bw = 1/shaper + 1/measured, and the delay adds to the round trip twice."""
    if shaper_mbps > 0:
        mbps = 1.0 / (1.0 / shaper_mbps + 1.0 / mbps)
    return mbps, rtt_ms + 2.0 * delay_ms


def choose_k(
    *,
    d_model: int,
    tokens: int,
    bandwidth_mbps: float,
    compute_s: float,
    bytes_per_value: int = 2,
    token_id_bytes: int = 4,
    header_bytes: int = 256,
    multiple_of: int = 8,
) -> int | None:
    """Largest k (least compression) whose message serializes within `compute_s`; None if none fits.

    With nested bases (the first k columns of one seeded U) any k <= d is valid, so this is the
    closed form of bytes(k) * 8 / bandwidth <= compute_s, rounded down to a multiple of `multiple_of`
    (tensor-core friendly shapes). Returns d when the dense tensor already fits. Placement calls it per
    link with the replica's pipeline slot (its slowest stage's compute time per microbatch).
    """
    wire = dict(bytes_per_value=bytes_per_value, token_id_bytes=token_id_bytes, header_bytes=header_bytes)
    budget = compute_s * bandwidth_mbps * 1e6 / 8.0  # bytes that fit in the compute time
    if activation_bytes(k=d_model, d_model=d_model, tokens=tokens, **wire) <= budget:
        return d_model
    k = math.floor(((budget - header_bytes) / tokens - token_id_bytes) / bytes_per_value)
    k -= k % multiple_of  # k < d here: a dense tensor costs no more than k = d - 1 plus token ids
    return k if k >= 1 else None

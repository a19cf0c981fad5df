"""Corrupted SparseLoCo fragments, as a faulty or malicious writer to the shared store would leave them."""

from __future__ import annotations

import struct

import torch

from node.sync.outer_sync import FragmentId
from protocol.codecs.sparseloco import SparseLoCoConfig, compress
from protocol.codecs.sparseloco_format import FragmentHeader, encode_fragment, pack_payload, seal_payload
from protocol.identity import Identity

KINDS = ["bad-signature", "untrusted-signer", "nan-scale", "truncated"]
MALLORY = Identity.from_seed(b"\x66" * 32)


def _header(cf, fid: FragmentId) -> FragmentHeader:  # type: ignore[no-untyped-def]
    return FragmentHeader.of(
        cf,
        run_id=fid.run_id,
        stage=fid.stage,
        fragment=fid.fragment,
        round=fid.round,
        replica=fid.replica,
        tokens=1,
    )


def valid_blob(
    identity: Identity, fid: FragmentId, shapes: list[tuple[int, ...]], cfg: SparseLoCoConfig, seed: int = 7
) -> tuple[bytes, bytes]:
    """(signed fragment bytes, its payload) of a random pseudo-gradient (drawn from `seed`)."""
    g = torch.Generator().manual_seed(seed)
    cf = compress([torch.randn(s, generator=g) for s in shapes], cfg)
    return encode_fragment(identity, _header(cf, fid), cf), pack_payload(cf)


def corrupt(
    kind: str,
    signer: Identity,
    fid: FragmentId,
    shapes: list[tuple[int, ...]],
    cfg: SparseLoCoConfig = SparseLoCoConfig(),  # noqa: B008
) -> bytes:
    """A fragment for `fid` that validation must reject; `signer` is the replica expected at that key."""
    data, payload = valid_blob(signer, fid, shapes, cfg)
    if kind == "bad-signature":  # one payload bit flipped after signing
        b = bytearray(data)
        b[len(b) // 2] ^= 0x01
        return bytes(b)
    if kind == "untrusted-signer":  # well formed, but signed by a key that is not this replica's
        return valid_blob(MALLORY, fid, shapes, cfg)[0]
    if kind == "nan-scale":  # the first tensor's scale set to NaN, then properly signed by the replica
        cf = compress([torch.ones(s) for s in shapes], cfg)
        p = bytearray(payload)
        p[6:10] = struct.pack("<f", float("nan"))  # u16 M | u32 U | f32 ref[0] ...
        return seal_payload(signer, _header(cf, fid), bytes(p))
    if kind == "truncated":
        return data[: len(data) * 2 // 3]
    raise AssertionError(f"unknown fault kind {kind!r}")

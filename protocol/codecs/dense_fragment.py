"""Dense pseudo-gradient fragments (the DiLoCo baseline): fp32 tensors in a signed envelope."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity, public_key_of_peer_id
from protocol.schema import ProtocolError

MAX_DENSE_FRAGMENT_BYTES = 1 << 30


class DenseFragmentError(ProtocolError):
    """A dense fragment did not match what the round expected."""


@dataclass(kw_only=True, frozen=True)
class DenseFragment:
    run_id: str
    stage: int
    fragment: int
    round: int
    replica: int
    tokens: int
    """Tokens the sender's replica trained on for this contribution (its weight in the aggregate)."""
    shapes: list[list[int]]
    data: bytes
    """The tensors' fp32 values, concatenated in order (little-endian)."""


def encode_dense(identity: Identity, header: dict, tensors: list[torch.Tensor], tokens: int) -> bytes:
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    body = DenseFragment(
        shapes=[list(t.shape) for t in tensors],
        data=flat.numpy().astype("<f4").tobytes(),
        tokens=tokens,
        **header,
    )
    return seal(identity, body)


def decode_dense(
    data: bytes, header: dict, shapes: list[torch.Size], signer_peer_id: str
) -> tuple[list[torch.Tensor], int]:
    """Verify signer, header and shapes; reject non-finite values. Returns (tensors, claimed tokens): the
    caller bounds the claim."""
    signed = open_envelope(
        data, DenseFragment, {public_key_of_peer_id(signer_peer_id)}, max_bytes=MAX_DENSE_FRAGMENT_BYTES
    )
    frag = signed.body
    for k, v in header.items():
        if getattr(frag, k) != v:
            raise DenseFragmentError(f"dense fragment: {k}={getattr(frag, k)!r}, expected {v!r}")
    if frag.shapes != [list(s) for s in shapes]:
        raise DenseFragmentError(
            f"dense fragment: shapes {frag.shapes} do not match the stage's {list(map(list, shapes))}"
        )
    n = sum(int(np.prod(s)) for s in shapes)
    if len(frag.data) != 4 * n:
        raise DenseFragmentError(f"dense fragment: {len(frag.data)} bytes of values, expected {4 * n}")
    flat = torch.from_numpy(np.frombuffer(frag.data, dtype="<f4").copy())
    if not torch.isfinite(flat).all():
        raise DenseFragmentError("dense fragment holds non-finite values (NaN/inf)")
    parts = flat.split([int(np.prod(s)) for s in shapes])
    return [t.reshape(s) for t, s in zip(parts, shapes, strict=True)], frag.tokens

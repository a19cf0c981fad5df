"""DiLoCo's dense pseudo-gradient codec (arXiv 2311.08105): fp32 tensors in a signed envelope.

The baseline `FragmentCodec` of `node.sync.outer_sync.OuterSync`; SparseLoCo's is `node.sync.sparseloco_sync`.
"""

from __future__ import annotations

import torch

from node.sync.exchange import Contribution, TokensBound, check_tokens
from node.sync.outer_sync import Encoding, FragmentCodec, FragmentId
from protocol.codecs.dense_fragment import MAX_DENSE_FRAGMENT_BYTES, decode_dense, encode_dense
from protocol.identity import Identity


def fragment_header(fid: FragmentId) -> dict:
    """The header fields a fragment is signed under (store key `{run}/sync/s{stage}/f{f}/r{round}/{replica}/{signer}/`
    then `fragment`, or the sha256 of the bytes when that key was taken)."""
    return {
        "run_id": fid.run_id,
        "stage": fid.stage,
        "fragment": fid.fragment,
        "round": fid.round,
        "replica": fid.replica,
    }


class DenseCodec(FragmentCodec):
    """DiLoCo's dense fp32 pseudo-gradient, signed by the uploading node."""

    def __init__(self, identity: Identity, *, tokens_bound: TokensBound | None = None) -> None:
        """tokens_bound: the most tokens a fragment may claim (`RunSpec.fragment_tokens`; None: any
        positive count)."""
        self.identity, self.tokens_bound = identity, tokens_bound

    def encode(self, fid: FragmentId, delta: list[torch.Tensor], tokens: int) -> Encoding:
        host = [d.detach().float().cpu() for d in delta]  # the whole pseudo-gradient crosses to the host
        return lambda: (
            encode_dense(self.identity, fragment_header(fid), host, tokens),
            Contribution(host, tokens),
        )

    def decode(self, fid: FragmentId, data: bytes, shapes: list[torch.Size], signer: str) -> Contribution:
        tensors, tokens = decode_dense(data, fragment_header(fid), shapes, signer)
        return Contribution(tensors, check_tokens(fid, tokens, self.tokens_bound))

    @property
    def signer(self) -> str:
        return self.identity.peer_id

    @property
    def max_fragment_bytes(self) -> int:
        return MAX_DENSE_FRAGMENT_BYTES

    def state(self) -> dict[str, torch.Tensor]:
        return {}  # DiLoCo carries nothing between rounds

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        pass

    def restore(self, fid: FragmentId, unsent: list[torch.Tensor], *, whole: bool = False) -> None:
        """DiLoCo keeps no error feedback: a pseudo-gradient that did not land is dropped."""

    def residual(self, group: int, fragment: int) -> list[torch.Tensor]:
        return []  # nothing carried between rounds


__all__ = ["DenseCodec", "fragment_header"]

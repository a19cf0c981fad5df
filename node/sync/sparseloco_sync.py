"""SparseLoCo's fragment codec for the outer loop, and the factory that picks a run's sync method.

SparseLoCo (arXiv 2508.15706), per stage worker r and fragment f of a layer group (DESIGN section 3):

    e_r,f = beta * e_r,f + Delta_r,f         # error feedback, one buffer per fragment
    c_r,f = Q2(TopK_per_chunk(e_r,f))        # k of every 4096 coordinates, 2-bit values
    e_r,f = e_r,f - decode(c_r,f)            # what was not sent stays for a later round

`SparseLoCoCodec.encode` runs that step and signs the result (`protocol.codecs.sparseloco_format`); it returns
the contribution exactly as every receiver decodes it, so all replicas aggregate the same tensors.
`SparseLoCoCodec.decode` accepts a fragment only if it is signed by the replica expected at that store
key and its header names this run, stage, fragment, round, replica, shapes and codec settings.

`make_sync_parts(spec, identity)` turns a `RunSpec`'s [sync] section into what `OuterSync` takes besides
the schedule (`SyncSpec.schedule()`): the codec (DiLoCo's dense one, or SparseLoCo's built from
`SyncSpec.sparseloco()`), the aggregation (`SyncSpec.aggregation_settings()`) and the outer momentum.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch

from node.sync.aggregation import Weights, aggregate
from node.sync.dense_sync import DenseCodec
from node.sync.exchange import Contribution, TokensBound, check_tokens
from node.sync.outer_sync import Aggregator, Encoding, FragmentCodec, FragmentId
from protocol.codecs.sparseloco import SparseLoCoConfig, decompress, error_feedback_step, rounding_key
from protocol.codecs.sparseloco_format import (
    MAX_FRAGMENT_BYTES,
    FragmentError,
    FragmentHeader,
    decode_fragment,
    encode_fragment,
)
from protocol.identity import Identity, SignatureError, public_key_of_peer_id
from protocol.runspec import RunSpec
from protocol.schema import to_dict
from protocol.sync_settings import AggregationSettings

log = logging.getLogger(__name__)


class SparseLoCoCodec(FragmentCodec):
    """Error feedback + chunked top-k + 2-bit values, signed by this node; one buffer e per fragment.

    Two paths compute the same fragment format (DESIGN section 9): on a GPU, error feedback, top-k and
    quantization run where the tensors are (`protocol.codecs.sparseloco_device`) and only kept indices and codes
    cross to the host; on the CPU the numpy reference (`protocol.codecs.sparseloco`) does. Either way the
    Golomb coding of the indices, the signature and the decoded contribution are made by the returned
    `Encoding` on OuterSync's I/O thread, while training goes on.

    encode runs on the training thread (it owns the buffers); decode only reads settings, so the I/O
    thread may call it concurrently.
    """

    def __init__(
        self,
        identity: Identity,
        cfg: SparseLoCoConfig = SparseLoCoConfig(),  # noqa: B008
        *,
        device_path: bool | None = None,
        tokens_bound: TokensBound | None = None,
        stochastic: bool = False,
    ) -> None:
        """device_path: True = the torch path wherever the tensors are, False = the numpy reference on the
        host, None = the torch path for CUDA tensors and the reference for CPU ones. tokens_bound: the most
        tokens a fragment may claim (`RunSpec.fragment_tokens`; None: any the format holds). stochastic:
        stochastic rounding of the 2-bit values (`sync.stochastic_rounding`), keyed per fragment."""
        self.identity, self.cfg, self.device_path = identity, cfg, device_path
        self.stochastic = stochastic
        self.tokens_bound = tokens_bound
        self.e: dict[tuple[int, int], list[torch.Tensor]] = {}
        """Error-feedback buffer of each (layer group, fragment) (float32, on the device the path runs on),
        created at its first capture."""

    def encode(self, fid: FragmentId, delta: list[torch.Tensor], tokens: int) -> Encoding:
        """Update the fragment's buffer e and compress (on delta's device or the host); the returned
        `Encoding` gives (signed wire bytes, decode(c) with `tokens`) of this round's Delta."""
        return self._encode(fid, delta, [], tokens)

    def encode_pair(
        self, fid: FragmentId, delta: list[torch.Tensor], anchor_diff: list[torch.Tensor], tokens: int
    ) -> Encoding:
        """A butterfly pair's message (node/sync/pair_mix.py): one fragment of [Delta..., A - B...], error
        feedback on the Delta part only (what the anchor difference does not carry stays in the anchor,
        so a second buffer would count it twice). Its decode holds both parts, Delta's first."""
        return self._encode(fid, delta, anchor_diff, tokens)

    def _encode(
        self, fid: FragmentId, delta: list[torch.Tensor], fresh: list[torch.Tensor], tokens: int
    ) -> Encoding:
        """The error-feedback step on delta, with `fresh` tensors compressed alongside from a zero buffer."""
        on_device = self.device_path if self.device_path is not None else bool(delta and delta[0].is_cuda)
        where = delta[0].device if on_device and delta else torch.device("cpu")
        e = self.e.get((fid.stage, fid.fragment))
        if e is None or [t.shape for t in e] != [d.shape for d in delta]:
            e = [torch.zeros(d.shape, dtype=torch.float32, device=where) for d in delta]
        elif e and e[0].device != where:  # restored from a checkpoint on the CPU: move it, keep it
            e = [t.to(where) for t in e]
        zeros = [torch.zeros(t.shape, dtype=torch.float32, device=where) for t in fresh]
        key = (
            rounding_key(fid.run_id, fid.stage, fid.fragment, fid.round, fid.replica)
            if self.stochastic
            else None
        )
        if on_device:
            from protocol.codecs.sparseloco_device import error_feedback_step_device

            cf, e_new = error_feedback_step_device(e + zeros, delta + fresh, self.cfg, key)  # e in place
        else:
            cf, e_new = error_feedback_step(e + zeros, delta + fresh, self.cfg, key)
        self.e[fid.stage, fid.fragment] = e_new[: len(delta)]
        header = FragmentHeader.of(
            cf,
            run_id=fid.run_id,
            stage=fid.stage,
            fragment=fid.fragment,
            round=fid.round,
            replica=fid.replica,
            tokens=tokens,
        )
        return lambda: (encode_fragment(self.identity, header, cf), Contribution(decompress(cf), tokens))

    def state(self) -> dict[str, torch.Tensor]:
        return {f"ef.{g}.{f}.{j}": t for (g, f), e in sorted(self.e.items()) for j, t in enumerate(e)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Error feedback from a checkpoint; kept on the CPU until the first encode moves it (encode
        rebuilds a buffer whose device differs from delta's, so the buffers go where the stage is)."""
        e: dict[tuple[int, int], list[torch.Tensor]] = {}
        for key in sorted(state, key=lambda k: tuple(int(x) for x in k.split(".")[1:])):
            index = tuple(int(x) for x in key.split(".")[1:])
            if len(index) != 3:  # "ef.{f}.{j}": before fragments were keyed by layer group
                raise KeyError(f"error feedback {key} by layer group (ef.group.fragment.tensor)")
            g, f, j = index
            if j != len(e.setdefault((g, f), [])):
                raise KeyError(f"error feedback tensor {key} out of order in the checkpoint")
            e[g, f].append(state[key].float().clone())
        self.e = e

    def restore(self, fid: FragmentId, unsent: list[torch.Tensor], *, whole: bool = False) -> None:
        """e_f += decode(c): a contribution nobody received is sent again in a later round (of a pair's
        message, its Delta part: the anchor difference's residual is in the anchor). The next encode
        scales e_f by beta, so a restored c goes out as beta c; `whole` restores c / beta instead, so the
        next encode starts from c itself (a butterfly exchange both ends skipped loses nothing of it)."""
        e_f = self.e[fid.stage, fid.fragment]
        if len(unsent) not in (len(e_f), 2 * len(e_f), 2 * len(e_f) + 1):  # a pair message: + its base tag
            raise ValueError(f"{len(unsent)} tensors to restore into {len(e_f)} error-feedback buffers")
        scale = 1.0 / self.cfg.beta if whole and self.cfg.beta > 0 else 1.0
        for e, u in zip(e_f, unsent[: len(e_f)], strict=True):
            e.add_(u.to(e.device), alpha=scale)

    def residual(self, group: int, fragment: int) -> list[torch.Tensor]:
        """e_f: the error feedback the next encode of the group's `fragment` starts from (in place)."""
        return self.e.get((group, fragment), [])

    @property
    def signer(self) -> str:
        return self.identity.peer_id

    @property
    def max_fragment_bytes(self) -> int:
        return MAX_FRAGMENT_BYTES

    def expected_header(self, fid: FragmentId, shapes: list[torch.Size], tokens: int) -> FragmentHeader:
        """The exact header a valid fragment for `fid` with these tensor shapes and `tokens` carries."""
        return FragmentHeader(
            run_id=fid.run_id,
            stage=fid.stage,
            fragment=fid.fragment,
            round=fid.round,
            replica=fid.replica,
            shapes=tuple(tuple(int(d) for d in s) for s in shapes),
            chunk=self.cfg.chunk,
            k=self.cfg.k,
            value_bits=self.cfg.value_bits,
            dense_1d=self.cfg.dense_1d,
            tokens=tokens,
        )

    def decode(self, fid: FragmentId, data: bytes, shapes: list[torch.Size], signer: str) -> Contribution:
        """Verify (signed by `signer`'s key, header == expected but for the token claim, the claim within
        the replica's bound) and decompress; raise FragmentError or TokenClaimError."""
        try:
            trusted = {public_key_of_peer_id(signer)}
        except SignatureError as e:
            raise FragmentError(f"replica {fid.replica}'s peer id cannot sign fragments: {e}") from e
        expect = to_dict(self.expected_header(fid, shapes, tokens=1))
        del expect["tokens"]  # checked against the bound below
        numel = sum(math.prod(s) for s in shapes)
        header, cf, _ = decode_fragment(data, trusted=trusted, expect=expect, max_params=max(numel, 1))
        return Contribution(decompress(cf), check_tokens(fid, header.tokens, self.tokens_bound))


def make_aggregator(cfg: AggregationSettings) -> Aggregator:
    """`node.sync.aggregation.aggregate` as OuterSync's aggregator: Delta_bar tensors, the contributions
    weighed by their tokens (`sync.weighting = "tokens"`) or alike ("equal"); rejections, and
    contributions scaled below half or with values clamped, are logged."""

    def aggregate_fn(contribs: dict[int, list[torch.Tensor]], weights: Weights) -> list[torch.Tensor]:
        agg = aggregate(contribs, cfg, weights=weights if cfg.weighting == "tokens" else None)
        for rej in agg.rejected:
            log.warning("aggregation left out replica %d: %s", rej.replica, rej.reason)
        for j in agg.used:
            f, n = agg.clip.get(j, 1.0), agg.clamped.get(j, 0)
            if f < 0.5 or n:
                log.warning(
                    "aggregation bounded replica %d: %d values clamped to the round's bound, "
                    "norm scaled by %.3g",
                    j,
                    n,
                    f,
                )
        return agg.tensors

    return aggregate_fn


class SyncParts(NamedTuple):
    """What `OuterSync` needs besides the schedule: codec, aggregate and outer momentum."""

    codec: FragmentCodec
    aggregate: Aggregator
    momentum: float


def make_sync_parts(spec: RunSpec, identity: Identity) -> SyncParts:
    """The codec, aggregation and outer momentum a run's [sync] section selects.

    method "sparseloco": `SparseLoCoCodec` with the spec's chunk, k and beta; method "diloco": the dense
    fp32 `DenseCodec`; either refuses a fragment claiming more tokens than
    its replica's shape trained on for it (`spec.fragment_tokens`). Both aggregate with `spec.sync.aggregation` (for dense contributions the
    per-coordinate mean equals the plain mean except where a contribution is exactly zero) under the
    robust rule `spec.sync.robust` and its bounds (by default clamp + median-norm clip + trimmed mean), and
    use `spec.sync.outer_momentum` (Nesterov; DiLoCo's 0.9, SparseLoCo's 0).
    """
    s = spec.sync

    def bound(fid: FragmentId) -> int:
        return spec.fragment_tokens(fid.replica, fid.fragment, fid.round)

    codec: FragmentCodec
    if s.method == "sparseloco":
        codec = SparseLoCoCodec(
            identity, s.sparseloco(), tokens_bound=bound, stochastic=s.stochastic_rounding
        )
    elif s.method == "diloco":
        codec = DenseCodec(identity, tokens_bound=bound)
    else:  # SyncSpec validates the method; this guards a spec built around that check
        raise ValueError(f"sync.method={s.method!r} must be 'diloco' or 'sparseloco'")
    return SyncParts(
        codec=codec, aggregate=make_aggregator(s.aggregation_settings()), momentum=s.outer_momentum
    )


__all__ = ["SparseLoCoCodec", "SyncParts", "make_aggregator", "make_sync_parts"]

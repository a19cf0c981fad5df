"""What the outer loop and a round exchange share: the round's key, the codec, what a round applies, and
the interface the outer loop (node/sync/outer_sync.py) holds an exchange by.

The outer loop keeps the schedule, the anchor and the apply; an exchange moves one (stage, fragment,
round)'s contributions between the replicas and says which set every replica applies. The store's
all-to-all, its set decided by the store's own timestamps (node/sync/round_rule.py), is
node/sync/round_exchange.py `RoundExchange`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from protocol.identity import Identity
from protocol.schema import ProtocolError

TokensBound = Callable[["FragmentId"], int]
"""A fragment's (slot, fragment, round) -> the most tokens its replica's shape trained on for it
(`RunSpec.fragment_tokens`: a round's, less in round 0)."""


class TokenClaimError(ProtocolError):
    """A fragment claims more tokens than its replica's shape can train on in a round (or none)."""


def check_tokens(fid: FragmentId, tokens: int, bound: TokensBound | None) -> int:
    """`tokens` if 1 <= tokens <= bound(fid) (no bound: any positive count); else TokenClaimError naming
    the claim and the bound, so an oversized claim cannot buy weight."""
    most = bound(fid) if bound is not None else tokens
    if not 1 <= tokens <= most:
        raise TokenClaimError(
            f"replica {fid.replica}'s fragment {fid.fragment} of round {fid.round} claims {tokens} tokens; its "
            f"shape trains at most {most} for it (steps since its previous capture x its batch x seq_len): a "
            "forged count, or a node running another run spec"
        )
    return tokens


class RoundAgreementError(RuntimeError):
    """The round's agreed set cannot be applied here (the store would not list it or give a fragment it lists)."""


class RoundSuperseded(RuntimeError):
    """This node's slot went to a newer epoch of the run's assignments that leaves it out (its replica dropped
    out while it trained on): the rounds it reaches are no longer its to apply or checkpoint, and a replica
    that went on would hold a consensus of its own. The worker stops, applying nothing more."""


@dataclass(frozen=True)
class FragmentId:
    run_id: str
    stage: int
    """The layer group (`RunSpec.layer_groups`; a run whose replicas share one split: the stage), as the
    store keys and the signed headers name it."""
    fragment: int
    round: int
    replica: int


@dataclass(eq=False)
class Contribution:
    """One slot's decoded fragment: the tensors every receiver decodes (float32, on the CPU) and the tokens
    its replica trained on for it (signed with it). `parts`: a late fragment summed with later ones
    (node/sync/round_exchange.py): each part's tokens, `tokens` their sum. Compared by identity: the
    exchange tells our own contribution from a copy of its bytes that way."""

    tensors: list[torch.Tensor]
    tokens: int
    parts: tuple[int, ...] = ()

    @property
    def weight(self) -> float:
        """Its weight in a token-weighted aggregate: its tokens, or for a sum of fragments of several rounds
        its largest part's (the sum holds those rounds' updates already: weighing it by their total too
        would count the late one twice). Each part is bounded, so the weight is."""
        return float(max(self.parts) if self.parts else self.tokens)


Encoding = Callable[[], tuple[bytes, Contribution]]
"""The host half of an encode: () -> (signed wire bytes, the contribution exactly as receivers decode it).
OuterSync runs it on its I/O thread, so entropy coding and signing overlap training."""


class FragmentCodec(Protocol):
    """Turns a fragment's pseudo-gradient into signed wire bytes and back."""

    def encode(self, fid: FragmentId, delta: list[torch.Tensor], tokens: int) -> Encoding:
        """Run what must happen before training moves on (e.g. error feedback, on delta's device) and
        return the rest as an `Encoding` for the I/O thread; `tokens`: what our replica trained on for it."""
        ...

    def decode(self, fid: FragmentId, data: bytes, shapes: list[torch.Size], signer: str) -> Contribution:
        """Validate (signature by `signer`, header, shapes, finiteness, a token claim the replica's shape
        allows) and decode; raise ProtocolError."""
        ...

    def restore(self, fid: FragmentId, unsent: list[torch.Tensor], *, whole: bool = False) -> None:
        """Our upload of `fid` did not land: keep `unsent` (what encode returned) for a later round
        (`whole`: all of it in the next encode, not decayed as error feedback decays)."""
        ...

    def residual(self, group: int, fragment: int) -> list[torch.Tensor]:
        """What the codec carries into the group's `fragment`'s next encode, one tensor per parameter of the fragment
        (SparseLoCo: its error feedback), for the round owner to confine; [] if nothing (yet)."""
        ...

    identity: Identity
    """Signs our fragments."""

    def state(self) -> dict[str, torch.Tensor]:
        """What the codec carries between rounds (SparseLoCo: error feedback), for checkpoints."""
        ...

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state()` (tensors on the CPU; the codec moves them where it works)."""
        ...

    @property
    def signer(self) -> str:
        """Peer id of the identity that signs our fragments."""
        ...

    @property
    def max_fragment_bytes(self) -> int:
        """The largest object a valid fragment can be: anything bigger at a fragment key is not fetched."""
        ...


@dataclass
class SyncStats:
    rounds_applied: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    wait_s: float = 0.0
    """Training time blocked waiting for transfers still in flight at apply time."""
    rejected: int = 0
    """Fragments that failed validation and were dropped."""
    missing: int = 0
    """Expected fragments that had not arrived by the deadline."""
    not_uploaded: int = 0
    """Our fragments that did not land (store error, or the key already held other bytes)."""
    late_committed: int = 0
    """Fragments committed in a later round's set than their own (any slot's, ours included)."""
    late_expired: int = 0
    """Our fragments that no round's set took within `sync.max_late_rounds`: back to error feedback."""
    last_contributors: list[int] = field(default_factory=list)
    applied_tokens: dict[int, list[int]] = field(default_factory=dict)
    """Round -> [tokens the agreed contributions of its fragments claimed, summed, fragments applied] of
    the last APPLIED_ROUNDS rounds: what the consensus took in (`applied_history`)."""
    last_tokens: dict[int, int] = field(default_factory=dict)
    """Replica -> the tokens of its contribution to the last round applied."""
    last_weights: dict[int, float] = field(default_factory=dict)
    """Replica -> its `Contribution.weight` in the last round applied (what the aggregate weighs it by
    under `sync.weighting = "tokens"`; ignored under "equal")."""


APPLIED_ROUNDS = 64


def record_applied(stats: SyncStats, rnd: int, tokens: int) -> None:
    """One fragment of round `rnd` applied, its agreed contributions claiming `tokens` in all."""
    got = stats.applied_tokens.setdefault(rnd, [0, 0])
    got[0], got[1] = got[0] + tokens, got[1] + 1
    for old in sorted(stats.applied_tokens)[:-APPLIED_ROUNDS]:
        del stats.applied_tokens[old]


def applied_history(stats: SyncStats) -> list[tuple[int, int]]:
    """(round, tokens applied): per round the mean over its fragments of what their agreed contributions
    claimed (a replica missing from one fragment counts for the others); equal on every replica."""
    return [(r, round(t / n)) for r, (t, n) in sorted(stats.applied_tokens.items())]


@dataclass
class Exchanged:
    """What one round applies, the same on every replica."""

    contribs: dict[int, list[torch.Tensor]]
    """Replica -> decoded contribution; for our slot, whatever every replica reads at our key. A replica's
    late fragments of earlier rounds committed in this one are summed into its contribution."""
    unsent: list[list[torch.Tensor]] = field(default_factory=list)
    """Our contributions that no round will use (this one's, or an earlier round's whose late window
    closed with this round): handed back to the codec at apply time."""
    late: dict[int, list[int]] = field(default_factory=dict)
    """Replica -> the earlier rounds whose fragments of it this round commits (in `contribs`)."""
    tokens: dict[int, int] = field(default_factory=dict)
    """Replica -> the tokens its contribution in `contribs` trained on (late parts included)."""
    weights: dict[int, float] = field(default_factory=dict)
    """Replica -> its `Contribution.weight`: what a token-weighted aggregate weighs it by."""


class Exchange(Protocol):
    """One replica's side of one stage's round exchange, as the outer loop holds it. The outer loop calls
    `run` on its I/O thread once per captured (fragment, round) and applies what it returns:

        puts       `encoding`: our contribution to `fid`'s round, signed bytes and their decode
        waits for  the other slots' contributions to the same (stage, fragment, round), of `shapes`
        returns    `Exchanged`: the set every replica applies, and ours back if it is not in it

    Seams for the exchanges that come next, each written beside `RoundExchange` (the store all-to-all)
    with the outer loop's schedule, anchor and apply left as they are:
    - the rule that decides the agreed set: `RoundExchange`'s is node/sync/round_rule.py's (the fragments
      in the store by the quorum's arrival + W, on the store's clock); another rule decides
      `Exchanged.contribs` its own way, and replicas apply whatever it says;
    - per-contribution token counts travel in the signed fragment (`Contribution.tokens`) and come back in
      `Exchanged.tokens` and `.weights`, keyed by replica as `contribs` is, for the aggregator to weigh;
    - fragments keyed by layer groups rather than stages: `FragmentId` is the only key an exchange names
      its objects by (store keys, signed headers); the outer loop builds it and reads back only `fragment`;
    - a pairwise exchange: another implementation of this interface, with the signers of the stage's
      slots as `set_stage_peers` gives them.
    """

    def run(self, fid: FragmentId, encoding: Encoding, shapes: list[torch.Size]) -> Exchanged:
        """Put ours, wait for the others' until every slot is in or the deadline, return the agreed set;
        raise RoundAgreementError if this replica cannot apply it."""
        ...

    def state(self) -> dict[str, torch.Tensor]:
        """What the exchange carries between rounds that every replica holds alike (the store's: the recent
        rounds' cutoffs its late window decides with), for checkpoints."""
        ...

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore `state()` (missing keys: a checkpoint of an older build)."""
        ...

    def set_stage_peers(
        self, stage_peers: dict[int, str], former: dict[int, set[str]] | None = None
    ) -> set[str]:
        """The signers of the stage's slots changed (`former`: the nodes a slot had earlier in the run,
        still signers of the rounds they took part in). Returns every signer now known for the stage."""
        ...


__all__ = [
    "Contribution",
    "Encoding",
    "Exchange",
    "Exchanged",
    "FragmentCodec",
    "FragmentId",
    "RoundAgreementError",
    "RoundSuperseded",
    "SyncStats",
    "TokenClaimError",
    "TokensBound",
    "check_tokens",
]

"""Butterfly mixing in the outer loop (issue 23, `sync.topology = "butterfly"`): the round owner's pair half.

At a fragment's capture (round r, fragment f of layer group g) replica i pairs with
p = protocol/pairing.py `partner(i, r, f, N)`; with a partner whose slot is filled it sends one SparseLoCo
pair message (`SparseLoCoCodec.encode_pair`: Delta and A_i - B, B the pair's base) through the store,
exactly as a round of two slots (node/sync/round_exchange.py with quorum 1 and no late window: both ends
read the same final LIST, so both apply the pair or both skip it). At apply (tau steps later), when both
messages are in and pass the pair screen, both ends compute the same pair result P
(node/sync/pair_mix.py), P becomes the pair's next base, and each end blends into its own weights:

    A_i      <- P + ((A_i - B) - z'_i)                        (node/sync/pair_mix.py `anchor_after`)
    "outer":  theta <- A_i + (theta(a_f) - theta(c_f))         (the outer step on the pair's mean, + drift)
    "half":   theta <- (theta(a_f) + A_i) / 2                  (the seed's 0.5 live + 0.5 pair result)

Skipped exchanges are counted and lose nothing: with no partner (the butterfly's sit-out for N not a power
of two, or a slot the coordinator left empty) nothing is captured, so the drift stays in the weights and the
next capture's Delta carries it; a partner whose message missed the deadline, or a pair refused by the
screen, sends our Delta part back to the codec's error feedback and leaves the anchor as it was.

The bases are state: one per (group, fragment, partner), the run's initial weights until the pair first
meets, kept in checkpoints ("pair.base.{p}.{param name}", with the round of the exchange that made each,
"pair.round.{p}.{param name}") so a restored end still holds what its partner holds. Memory: L = ceil(log2 N)
partners per fragment, so up to L host copies of the stage's parameters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from node.sync.exchange import Exchange, Exchanged, FragmentCodec, FragmentId, SyncStats
from node.sync.pair_mix import TAG_LEN, Disagreement, anchor_after, base_tag, pair_result, tag_bytes
from protocol.pairing import butterfly_stages, partner
from protocol.runspec import RunSpec

log = logging.getLogger(__name__)

PAIR_OUTCOMES = ("exchanged", "unpaired", "missing", "refused", "disagreed", "clipped", "resynced")
"""`PairStats`' counters, as /status (`pair_exchanges`), /metrics and the benchmarks name them."""
MAX_REPORTED = 64
"""`PairStats.last` keeps the newest pair result digest of at most this many (group, fragment)s."""

Signers = Callable[[int], dict[int, str]]
"""Layer group -> its signers by replica now (the stage's, or the group's in a mixed layout)."""
ExchangeFactory = Callable[[int, dict[int, str]], Exchange]
"""(layer group, {our replica: our signer, partner: its signer}) -> a two-slot round exchange."""


@dataclass(frozen=True)
class PairSettings:
    """What the pair half needs from the run spec (`pair_settings`)."""

    replicas: int
    """N: the run's replica count, which the pairing is computed from."""
    alpha: float
    ratio: float
    """rho of the pair rule (`sync.pair_clip`)."""
    blend: str
    """`sync.pair_blend`: "outer" or "half"."""
    max_abs: float
    max_norm: float
    weighted: bool
    """Token weights (`sync.weighting = "tokens"`) in the pair's mean of pseudo-gradients."""
    per_coordinate: bool = True
    """The pair's mean of pseudo-gradients per coordinate (`sync.aggregation = "per_coordinate"`)."""
    agreement: float = -1.0
    """gamma of the agreement rule (`sync.pair_agreement`; -1: off)."""


def pair_settings(spec: RunSpec) -> PairSettings | None:
    """The run's butterfly settings, None under `sync.topology = "all"`."""
    s = spec.sync
    if s.topology != "butterfly":
        return None
    return PairSettings(
        replicas=spec.replicas,
        alpha=s.alpha,
        ratio=s.pair_clip,
        blend=s.pair_blend,
        max_abs=s.max_abs,
        max_norm=s.max_norm,
        weighted=s.weighting == "tokens",
        per_coordinate=s.aggregation == "per_coordinate",
        agreement=s.pair_agreement,
    )


@dataclass
class PairStats:
    exchanged: int = 0
    """Exchanges that gave a pair result (blended)."""
    unpaired: int = 0
    """Captures this replica sat out: no partner in the butterfly, or the partner's slot empty."""
    missing: int = 0
    """Exchanges skipped because the partner's message was not in the store by the deadline."""
    refused: int = 0
    """Exchanges skipped because a message failed the pair screen (both ends skip it)."""
    disagreed: int = 0
    """Exchanges skipped because the two messages point apart (the agreement rule; both ends skip it)."""
    clipped: int = 0
    """Exchanges in which the pair rule scaled a part of either end."""
    resynced: int = 0
    """Exchanges skipped because the ends held different bases (both restart the pair from zero)."""
    last: dict[str, str] = field(default_factory=dict)
    """"g.f" -> "round:partner:sha256" of the newest pair result of that fragment (both ends publish it)."""


class PairMixer:
    """The butterfly's pairing, bases and pair results for one round owner (node/sync/outer_sync.py holds
    it and calls `capture` / `apply` where all-to-all would encode and aggregate)."""

    def __init__(
        self,
        settings: PairSettings,
        *,
        codec: FragmentCodec,
        replica: int,
        fragments: dict[tuple[int, int], list[int]],
        initial: list[torch.Tensor],
        signers: Signers,
        exchange: ExchangeFactory,
        stats: SyncStats,
        lock: threading.Lock,
        project: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """fragments: (group, fragment) -> indices into the params (OuterSync's). initial: the anchor the
        run starts from (every pair's base until it first meets). project: (param index, host tensor) ->
        its projection onto the parameter's subspace, bit-identical on every host (None: no subspace)."""
        self.cfg, self.codec, self.replica, self.project = settings, codec, replica, project
        self.fragments, self.signers, self.make_exchange = fragments, signers, exchange
        self.sync_stats, self.lock = stats, lock
        self.stats = PairStats()
        self._exchanges: dict[tuple[int, int, str], Exchange] = {}
        partners = sorted(
            {replica ^ (1 << s) for s in range(butterfly_stages(settings.replicas))} - {replica}
        )
        partners = [p for p in partners if p < settings.replicas]
        self.bases: dict[tuple[int, int, int], list[torch.Tensor]] = {}
        self.base_round: dict[tuple[int, int, int], int] = {}
        for (g, f), idx in fragments.items():
            b = [initial[i].detach().cpu().float().clone() for i in idx]
            for p in partners:  # shared until a pair meets (results replace, never write into, a base)
                self.bases[g, f, p], self.base_round[g, f, p] = b, -1

    # --- capture ------------------------------------------------------------------------------------
    def partner_of(self, g: int, f: int, rnd: int) -> tuple[int, dict[int, str]] | None:
        """Our partner for (g, f) in round rnd and the exchange's two signers, None if we sit it out."""
        p = partner(self.replica, rnd, f, self.cfg.replicas)
        peers = self.signers(g)
        if p is None or p not in peers or self.replica not in peers:
            return None
        return p, {self.replica: peers[self.replica], p: peers[p]}

    def capture(
        self,
        fid: FragmentId,
        anchor: list[torch.Tensor],
        delta: list[torch.Tensor],
        tokens: int,
        shapes: list[torch.Size],
    ) -> tuple[int, Callable[[], Exchanged]] | None:
        """(our partner, the I/O thread's job: put our pair message for fid and settle the two-slot round),
        or None when we sit the exchange out (counted; nothing captured: the drift stays in the weights).
        delta: the fragment's pseudo-gradient, anchor - theta."""
        g, f = fid.stage, fid.fragment
        paired = self.partner_of(g, f, fid.round)
        if paired is None:
            with self.lock:
                self.stats.unpaired += 1
            return None
        p, peers = paired
        base = self.bases[g, f, p]
        with torch.no_grad():
            diff = [a - b.to(a.device) for a, b in zip(anchor, base, strict=True)]
        tag = base_tag(base).to(diff[0].device if diff else "cpu")
        encoding = self.codec.encode_pair(fid, delta, [*diff, tag], tokens)  # type: ignore[attr-defined]
        key = (g, p, peers[p])
        if key not in self._exchanges:
            self._exchanges[key] = self.make_exchange(g, peers)
        ex = self._exchanges[key]
        return p, lambda: ex.run(fid, encoding, [*shapes, *shapes, torch.Size([TAG_LEN])])

    # --- apply --------------------------------------------------------------------------------------
    def apply(
        self, fid: FragmentId, p: int, ex: Exchanged, anchor: list[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        """The fragment's new anchor (host float32) from the settled exchange with partner p, None when
        it is skipped (our Delta part then goes back to error feedback)."""
        me = self.replica
        for unsent in ex.unsent:
            self.codec.restore(fid, unsent, whole=True)
        # ours in the set and nothing unsent: that is our fresh message (after a restart the set holds the
        # bytes our key already had, and the fresh one comes back in `unsent`, restored above)
        ours_fresh = me in ex.contribs and not ex.unsent
        if set(ex.contribs) != {me, p}:
            if ours_fresh:
                self.codec.restore(fid, ex.contribs[me], whole=True)
            with self.lock:
                self.stats.missing += 1
            log.info(
                "round %d fragment %d (group %d): partner replica %d's pair message did not arrive; skipped",
                fid.round,
                fid.fragment,
                fid.stage,
                p,
            )
            return None
        key = (fid.stage, fid.fragment, p)
        base = self.bases[key]
        tags = {j: tag_bytes(ts[-1]) for j, ts in ex.contribs.items()}
        if len(set(tags.values())) != 1 or b"" in tags.values():
            self._resync(fid, p, ex, ours_fresh)
            return None
        result, rejected = pair_result(
            {j: ts[:-1] for j, ts in ex.contribs.items()},
            base,
            alpha=self.cfg.alpha,
            ratio=self.cfg.ratio,
            max_abs=self.cfg.max_abs,
            max_norm=self.cfg.max_norm,
            weights=ex.weights if self.cfg.weighted else None,
            per_coordinate=self.cfg.per_coordinate,
            reach=butterfly_stages(self.cfg.replicas),
            agreement=self.cfg.agreement,
        )
        if result is None:
            if ours_fresh:
                self.codec.restore(fid, ex.contribs[me], whole=True)
            if rejected and all(isinstance(r, Disagreement) for r in rejected):
                with self.lock:
                    self.stats.disagreed += 1
                log.warning("pair exchange %s skipped: %s", fid, rejected[0].reason)
                return None
            with self.lock:
                self.stats.refused += 1
                self.sync_stats.rejected += len(rejected)
            for rej in rejected:
                log.warning("pair exchange %s refused replica %d's message: %s", fid, rej.replica, rej.reason)
            return None
        new_anchor = anchor_after(anchor, base, result, me)
        self.bases[key], self.base_round[key] = result.tensors, fid.round
        if self.project is not None:  # the anchor and the base stay in span, alike at both ends
            idx = self.fragments[fid.stage, fid.fragment]
            new_anchor = [self.project(i, t) for i, t in zip(idx, new_anchor, strict=True)]
            self.bases[key] = [self.project(i, t) for i, t in zip(idx, result.tensors, strict=True)]
        with self.lock:
            self.stats.exchanged += 1
            self.stats.clipped += any(f != 1.0 for f in result.factors.values())
            name = f"{fid.stage}.{fid.fragment}"
            self.stats.last.pop(name, None)
            self.stats.last[name] = f"{fid.round}:{p}:{result.sha256}"
            while len(self.stats.last) > MAX_REPORTED:
                self.stats.last.pop(next(iter(self.stats.last)))
        return new_anchor

    def _resync(self, fid: FragmentId, p: int, ex: Exchanged, ours_fresh: bool) -> None:
        """The two ends hold different bases (the tags differ): both see it from the same bytes, both skip
        the exchange, and both restart the pair from the same base, zero (the next anchor differences are
        then whole anchors; what their compression leaves stays in each anchor, as always)."""
        if ours_fresh:
            self.codec.restore(fid, ex.contribs[self.replica], whole=True)
        key = (fid.stage, fid.fragment, p)
        self.bases[key] = [torch.zeros_like(b) for b in self.bases[key]]
        self.base_round[key] = fid.round
        with self.lock:
            self.stats.resynced += 1
        log.warning(
            "round %d fragment %d (group %d): replica %d and we hold different pair bases (a restore from an "
            "older checkpoint, or an exchange one of us skipped); both skip it and restart the pair from zero",
            fid.round,
            fid.fragment,
            fid.stage,
            p,
        )

    def blend(self, live: torch.Tensor, anchor: torch.Tensor, at_capture: torch.Tensor) -> torch.Tensor:
        """The live weights after a pair result (`sync.pair_blend`)."""
        if self.cfg.blend == "half":
            return (live + anchor) / 2
        return anchor + (live - at_capture)

    # --- state --------------------------------------------------------------------------------------
    def state(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The bases by partner and parameter name ("base.{p}.{name}"), with the round of the exchange
        that made each ("round.{p}.{name}", -1: the run's start), for checkpoints: a checkpoint of r
        and one of p at the same round vouch for each other where they hold the same base (export)."""
        out: dict[str, torch.Tensor] = {}
        for (g, f, p), ts in sorted(self.bases.items()):
            for i, t in zip(self.fragments[g, f], ts, strict=True):
                out[f"base.{p}.{names[i]}"] = t
                out[f"round.{p}.{names[i]}"] = torch.tensor([self.base_round[g, f, p]], dtype=torch.int64)
        return out

    def load_state(self, names: list[str], state: dict[str, torch.Tensor]) -> None:
        """Restore `state(names)`; KeyError naming a base the checkpoint lacks."""
        for g, f, p in sorted(self.bases):
            idx = self.fragments[g, f]
            self.bases[g, f, p] = [state[f"base.{p}.{names[i]}"].float().cpu().clone() for i in idx]
            self.base_round[g, f, p] = int(state[f"round.{p}.{names[idx[0]]}"].item()) if idx else -1


__all__ = ["PAIR_OUTCOMES", "PairMixer", "PairSettings", "PairStats", "pair_settings"]

"""Cross-replica outer loop through the object store: capture -> upload/fetch -> apply, per fragment.

DiLoCo (arXiv 2311.08105) / SparseLoCo (arXiv 2508.15706) with Streaming DiLoCo's fragments and overlap
(arXiv 2501.18512). The stage's parameters are split by layer group (`RunSpec.layer_groups`: replicas of
different layer splits exchange the same groups; a uniform run has one group per stage), each group into P
strided fragments; with q = floor(H/P), fragment f of every group is captured at inner step c_f = (f+1) q of each H-step cycle and applied at a_f = c_f + tau:

    Delta_r   = theta_anchor - theta_local(c_f)          # pseudo-gradient (codec may compress it)
    Delta_bar = aggregate({decode(c_j) : j arrived})     # over replicas whose fragment arrived in time
    theta_anchor <- theta_anchor - alpha * Delta_bar     # (DiLoCo: Nesterov momentum on Delta_bar)
    theta(a_f)  <- theta_anchor + (theta(a_f) - theta(c_f))   # keep the tau steps of local drift

Upload and fetch run on a background I/O thread while training goes on for tau steps; applying blocks
only for what is still in flight, and that wait is recorded. The schedule and a step's round are
protocol/sync_settings.py `Schedule`'s. Which fragments a round applies is agreed by the round exchange this
owner holds behind node/sync/exchange.py's `Exchange` (the store's: node/sync/round_exchange.py
`RoundExchange`): it puts ours, waits for the others' and returns the set every replica applies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from node.sync.aggregation import mean_over_arrivals
from node.sync.exchange import (
    Contribution,
    Encoding,
    Exchange,
    Exchanged,
    FragmentCodec,
    FragmentId,
    RoundAgreementError,
    RoundSuperseded,
    SyncStats,
    record_applied,
)
from node.sync.pair_mix import digest
from node.sync.pair_sync import PairMixer, PairSettings
from node.sync.round_exchange import RoundExchange
from node.sync.stage_checkpoints import StageCheckpoints
from protocol.checkpoint import Checkpoint
from protocol.net.store import ObjectStore
from protocol.sync_settings import Schedule

log = logging.getLogger(__name__)

Aggregator = Callable[[dict[int, list[torch.Tensor]], dict[int, float]], list[torch.Tensor]]
"""(replica -> contribution, replica -> its weight, node/sync/exchange.py `Contribution.weight`) -> Delta_bar."""


class Confinement(Protocol):
    """Parameters confined to a subspace (the subspace links', node/subspace_model.py), by index into
    OuterSync's params. A sparse, quantized Delta_bar leaves the subspace; projecting it before the outer
    step keeps the anchor in it, and must give the same bits on every replica."""

    def consensus(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """proj(t) of parameter i's host tensor, bit-identical on every host (t if unconstrained)."""
        ...

    def local_(self, i: int, t: torch.Tensor) -> None:
        """t <- proj(t) in place on t's device (local state, e.g. error feedback)."""
        ...


ANCHOR_IN_SPAN = "sync.anchor_in_span"
"""Checkpoint tensor marking an anchor kept in its subspace (builds before that let it drift off: such a
checkpoint's anchor is projected on restore, identically on every replica)."""


def _in_group(key: str, group: int) -> str:
    """A codec state name of a build before fragments were keyed by layer group ("ef.{f}.{j}") as this
    build names it ("ef.{group}.{f}.{j}"); any other name as it is."""
    parts = key.split(".")
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return f"{parts[0]}.{group}.{parts[1]}.{parts[2]}"
    return key


@dataclass
class _Pending:
    fid: FragmentId
    theta_at_capture: list[torch.Tensor]
    future: Future[Exchanged]
    apply_step: int
    partner: int | None = None
    """Butterfly: the replica this exchange pairs us with (None: an all-to-all round)."""


@dataclass
class LocalState:
    """What the round owner checkpoints but does not own: the worker's weights and optimizer."""

    names: list[str]
    """Parameter names, in the order of OuterSync's params."""
    tensors: Callable[[], dict[str, torch.Tensor]]
    """The local weights ("model.*") and optimizer state ("optim.*") now."""
    load: Callable[[dict[str, torch.Tensor]], None]
    """Load the optimizer state from a checkpoint's tensors (the weights are loaded before training)."""
    after_apply: Callable[[], None] = lambda: None
    """Called after an outer update changed the weights (the subspace links re-project them)."""


@dataclass
class StepOutcome:
    """What the round owner did after one inner step."""

    applied: list[int]
    """Fragments whose aggregate was applied."""
    round_ended: int | None
    """The round this step ended (every H steps), else None."""
    checkpointed: int | None
    """The round whose state was checkpointed at this step, else None."""


class OuterSync:
    """Streaming outer optimiser for one stage worker: the owner of its rounds. It holds the anchor,
    outer momentum, the codec's error feedback, the fragment schedule and the round counter; it decides
    when a round ends and when a checkpoint is due, and writes and restores checkpoints. The worker's
    loop is "inner step, then `step_done`"."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        store: ObjectStore,
        codec: FragmentCodec,
        run_id: str,
        stage: int,
        replica: int,
        stage_peers: dict[int, str],
        former_stage_peers: dict[int, set[str]] | None = None,
        groups: dict[int, list[int]] | None = None,
        group_peers: dict[int, dict[int, str]] | None = None,
        former_group_peers: dict[int, dict[int, set[str]]] | None = None,
        schedule: Schedule,
        alpha: float,
        momentum: float = 0.0,
        timeout_s: float = 60.0,
        aggregate: Aggregator = mean_over_arrivals,
        poll_s: float = 0.1,
        poll_max_s: float = 1.0,
        local: LocalState | None = None,
        checkpoints: StageCheckpoints | None = None,
        checkpoint_every: int = 1,
        confine: Confinement | None = None,
        quorum: int = 0,
        cancelled: Callable[[], bool] = lambda: False,
        max_late_rounds: int = 1,
        tokens_per_step: int = 1,
        butterfly: PairSettings | None = None,
        superseded: Callable[[], str | None] = lambda: None,
    ) -> None:
        """schedule: when each fragment is captured and applied (`SyncSpec.schedule()`). poll_s,
        poll_max_s: the first and the longest wait between two polls of the store for the
        other replicas' fragments (exponential backoff). local and checkpoints: what step_done()
        checkpoints, every `checkpoint_every` rounds, and where (neither: no checkpoints, as in the
        benchmarks). confine: the parameters confined to a subspace, whose Delta_bar and codec residual
        are projected onto it (None: none are). quorum: how many replicas' fragments a round needs
        (node/sync/round_rule.py; 0: a majority of the stage's live replicas). cancelled: the worker is
        stopping (a round still waiting for its quorum gives up). max_late_rounds: how many rounds late a
        fragment may still be committed (node/sync/late_window.py; 0: never). tokens_per_step: what this
        replica trains on per inner step (`RunSpec.tokens_per_step`): a fragment's contribution claims it
        times the steps since that fragment's previous capture. groups: layer group -> indices into
        params of its parameters (None: one group numbered `stage` of them all, as in a run whose replicas
        share one split). group_peers, former_group_peers: each group's signers by replica (None: the
        stage's, stage_peers and former_stage_peers, for every group). butterfly: pair exchanges instead of
        the all-to-all round (node/sync/pair_sync.py; None: all-to-all). superseded: why this node no longer
        holds its slot (None: it does), asked before each round is applied (RoundSuperseded)."""
        if not 0 < poll_s <= poll_max_s:
            raise ValueError(f"need 0 < poll_s <= poll_max_s, got poll_s={poll_s} poll_max_s={poll_max_s}")
        self.params = params
        self.store, self.codec = store, codec
        self.run_id, self.stage, self.replica = run_id, stage, replica
        self.schedule, self.alpha, self.momentum = schedule, alpha, momentum
        self.aggregate, self.tokens_per_step = aggregate, tokens_per_step
        self.local, self.checkpoints, self.checkpoint_every = local, checkpoints, checkpoint_every
        self.confine = confine
        self.groups = groups if groups is not None else {stage: list(range(len(params)))}
        # strided fragments spread big and small tensors evenly: a group's j-th parameter is in fragment j % P
        self.fragments = {
            (g, f): idx[f :: schedule.P] for g, idx in sorted(self.groups.items()) for f in range(schedule.P)
        }
        self.anchor = [p.detach().clone() for p in params]
        self.outer_m = [torch.zeros_like(p) for p in params] if momentum > 0 else []
        self.stats = SyncStats()
        self._pending: list[_Pending] = []
        # each group's exchange holds a thread from its put until its round settles: two per group, so
        # every group's fragment goes up at its capture and two of its fragments can overlap
        self._io = ThreadPoolExecutor(max_workers=2 * len(self.groups), thread_name_prefix="outer-io")
        self._lock = threading.Lock()
        self.exchanges: dict[int, Exchange] = {
            g: RoundExchange(
                store,
                codec,
                replica=replica,
                stage_peers=(group_peers or {}).get(g, stage_peers),
                former_stage_peers=(former_group_peers or {}).get(g, former_stage_peers),
                timeout_s=timeout_s,
                poll_s=poll_s,
                poll_max_s=poll_max_s,
                stats=self.stats,
                lock=self._lock,
                quorum=quorum,
                cancelled=cancelled,
                max_late_rounds=max_late_rounds,
                superseded=superseded,
            )
            for g in sorted(self.groups)
        }
        self._cancelled, self._superseded = cancelled, superseded
        self._signers = {g: dict((group_peers or {}).get(g, stage_peers)) for g in self.groups}
        self._former = {
            g: dict((former_group_peers or {}).get(g, former_stage_peers) or {}) for g in self.groups
        }
        self.pairs = None if butterfly is None else self._pair_mixer(butterfly, timeout_s, poll_s, poll_max_s)

    @property
    def exchange(self) -> Exchange:
        """The exchange of a stage holding one layer group (each group has its own: `exchanges`)."""
        if len(self.exchanges) != 1:
            raise AttributeError(f"this stage holds layer groups {sorted(self.exchanges)}: use exchanges[g]")
        return next(iter(self.exchanges.values()))

    # --- schedule ---------------------------------------------------------------------------------
    def step_done(self, step: int) -> StepOutcome:
        """The worker's one call after inner step `step` (1-based): capture and apply the fragments due,
        end the round every H steps, checkpoint when one is due."""
        applied = self.after_inner_step(step)
        if applied and self.local is not None:
            self.local.after_apply()
        checkpointed = self.checkpoint_due(step, self.checkpoint_every) if self.checkpoints else None
        if checkpointed is not None:
            self.save_checkpoint(step, checkpointed)
        return StepOutcome(applied, self.round_end(step), checkpointed)

    def after_inner_step(self, step: int) -> list[int]:
        """Call after inner step `step` (1-based count of completed steps). Returns fragments applied."""
        self.capture_due(step)
        return self.apply_due(step)

    def capture_due(self, step: int) -> None:
        """Capture phase: fragments whose c_f falls on `step` are compressed and handed to the I/O thread."""
        for f, rnd in self.schedule.captures(step):
            for g in sorted(self.groups):
                self._capture(g, f, rnd, step)

    def apply_due(self, step: int) -> list[int]:
        """Apply phase: fragments whose a_f = c_f + tau falls on `step` (blocks for transfers in flight)."""
        applied = []
        for p in [p for p in self._pending if p.apply_step == step]:
            self._apply(p)
            self._pending.remove(p)
            if p.fid.fragment not in applied:
                applied.append(p.fid.fragment)
        return applied

    def round_end(self, step: int) -> int | None:
        """The round that inner step `step` (1-based) ends, or None: rounds end every H steps."""
        return self.schedule.round_ended(step)

    def checkpoint_due(self, step: int, every: int) -> int | None:
        """The round to checkpoint after inner step `step`, or None. A checkpoint is taken when round r's
        fragments are all applied (tau steps after it ends) and nothing of round r+1 is in flight, so the
        anchor, momentum and error feedback are exactly round r's; every `every` rounds."""
        rnd = self.schedule.settled_at(step)
        if every <= 0 or rnd is None or self._pending:
            return None
        return rnd if rnd % every == 0 else None

    # --- state: checkpoints and digests -----------------------------------------------------------
    def state_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The round owner's state by parameter name: consensus anchor, outer momentum, codec state."""
        if len(names) != len(self.params):
            raise ValueError(f"{len(names)} names for {len(self.params)} parameters")
        out = {f"anchor.{n}": a for n, a in zip(names, self.anchor, strict=True)}
        out.update({f"outer_m.{n}": m for n, m in zip(names, self.outer_m, strict=False)})
        out.update({f"codec.{k}": v for k, v in self.codec.state().items()})
        for g, ex in self.exchanges.items():
            out.update({f"exchange.g{g}.{k}": v for k, v in ex.state().items()})
        if self.confine is not None:
            out[ANCHOR_IN_SPAN] = torch.ones(1)
        if self.pairs is not None:
            out.update({f"pair.{k}": v for k, v in self.pairs.state(names).items()})
        return out

    def load_state_tensors(self, names: list[str], state: dict[str, torch.Tensor]) -> None:
        """Restore `state_tensors()`; raises KeyError naming what a checkpoint lacks."""
        with torch.no_grad():
            for n, a in zip(names, self.anchor, strict=True):
                a.copy_(state[f"anchor.{n}"].to(a.device, a.dtype))
            for n, m in zip(names, self.outer_m, strict=False):
                m.copy_(state[f"outer_m.{n}"].to(m.device, m.dtype))
            if self.confine is not None and ANCHOR_IN_SPAN not in state:
                # written before anchors were kept in span: every replica that restores it projects the
                # same bits the same way, so the consensus stays one (and in span from here on)
                for ts in (self.anchor, self.outer_m):
                    for i, t in enumerate(ts):
                        t.copy_(self.confine.consensus(i, t.cpu()).to(t.device))
        codec = {k[len("codec.") :]: v for k, v in state.items() if k.startswith("codec.")}
        if len(self.groups) == 1:  # an older build's "ef.{f}.{j}": its stage was its one group
            codec = {_in_group(k, next(iter(self.groups))): v for k, v in codec.items()}
        self.codec.load_state(codec)
        by_group = any(k.startswith("exchange.g") for k in state)
        for g, ex in self.exchanges.items():
            head = f"exchange.g{g}." if by_group else "exchange."  # an older build's: its stage, one group
            ex.load_state({k[len(head) :]: v for k, v in state.items() if k.startswith(head)})
        if self.pairs is not None:
            self.pairs.load_state(
                names, {k[len("pair.") :]: v for k, v in state.items() if k.startswith("pair.")}
            )

    def save_checkpoint(self, step: int, rnd: int) -> None:
        """Everything needed to continue from round `rnd`: the worker's weights and optimizer, our anchor,
        outer momentum and error feedback; snapshotted now, uploaded in the background."""
        if self.checkpoints is None or self.local is None:
            raise RuntimeError("this round owner was built without checkpoints")
        tensors = self.local.tensors()
        tensors.update(self.state_tensors(self.local.names))
        self.checkpoints.write(tensors, step=step, rnd=rnd)

    def restore(self, ck: Checkpoint) -> None:
        """Anchor, outer momentum, error feedback and the optimizer from `ck`."""
        if self.local is None:
            raise RuntimeError("this round owner was built without local state to restore")
        try:
            self.load_state_tensors(self.local.names, ck.tensors)
            self.local.load(ck.tensors)
        except KeyError as e:
            raise RuntimeError(f"checkpoint of round {ck.round} lacks {e}: written by an older build?") from e

    def anchor_digest(self) -> str:
        """sha256 of the consensus anchor's bytes (equal on every replica after the same rounds)."""
        return digest(self.anchor)

    def finish(self) -> None:
        """Apply whatever is still pending (end of run) and stop the I/O thread."""
        for p in list(self._pending):
            self._apply(p)
        self._pending.clear()
        self._io.shutdown(wait=True)

    def close(self) -> None:
        """Wait for a checkpoint upload in flight (the run ended or was stopped)."""
        if self.checkpoints is not None:
            self.checkpoints.join()

    # --- phases -----------------------------------------------------------------------------------
    def _pair_mixer(self, cfg: PairSettings, timeout_s: float, poll_s: float, poll_max_s: float) -> PairMixer:
        """Butterfly: the pair half, each exchange a round of two slots (both ends in, or skipped)."""

        def exchange(g: int, peers: dict[int, str]) -> Exchange:
            return RoundExchange(
                self.store,
                self.codec,
                replica=self.replica,
                stage_peers=peers,
                former_stage_peers={r: set(self._former[g].get(r, ())) for r in peers},
                timeout_s=timeout_s,
                poll_s=poll_s,
                poll_max_s=poll_max_s,
                stats=self.stats,
                lock=self._lock,
                quorum=1,
                cancelled=lambda: self._cancelled(),
                max_late_rounds=0,
                superseded=self._superseded,  # a left-out node applies no pair exchange either
            )

        confine = self.confine
        return PairMixer(
            cfg,
            codec=self.codec,
            replica=self.replica,
            fragments=self.fragments,
            initial=self.anchor,
            signers=lambda g: self._signers[g],
            exchange=exchange,
            stats=self.stats,
            lock=self._lock,
            project=None if confine is None else confine.consensus,
        )

    def _capture(self, g: int, f: int, rnd: int, step: int) -> None:
        idx = self.fragments[g, f]
        if self.confine is not None:  # what error feedback carries off the span would be re-sent forever
            for j, e in enumerate(self.codec.residual(g, f)):
                self.confine.local_(idx[j], e)
        with torch.no_grad():
            theta = [self.params[i].detach().clone() for i in idx]
            delta = [self.anchor[i] - t for i, t in zip(idx, theta, strict=True)]  # Delta = anchor - local
        fid = FragmentId(self.run_id, g, f, rnd, self.replica)  # keyed by layer group, not stage
        tokens = self.tokens_per_step * self.schedule.steps_since_capture(step)
        shapes = [self.params[i].shape for i in idx]
        if self.pairs is not None:
            job = self.pairs.capture(fid, [self.anchor[i] for i in idx], delta, tokens, shapes)
            if job is not None:
                fut = self._io.submit(job[1])
                self._pending.append(_Pending(fid, theta, fut, step + self.schedule.tau, job[0]))
            return
        encoding = self.codec.encode(fid, delta, tokens)
        fut = self._io.submit(self.exchanges[g].run, fid, encoding, shapes)
        self._pending.append(_Pending(fid, theta, fut, step + self.schedule.tau))

    def set_stage_peers(
        self,
        stage_peers: dict[int, str],
        former: dict[int, set[str]] | None = None,
        group_peers: dict[int, dict[int, str]] | None = None,
        former_group_peers: dict[int, dict[int, set[str]]] | None = None,
    ) -> None:
        """The signers of this stage's slots changed (a replica rebuilt with a new node, or dropped out):
        each group's exchange trusts them from now on (the worker binds them to their checkpoint slots);
        group_peers as in the constructor."""
        self._signers = {g: dict((group_peers or {}).get(g, stage_peers)) for g in self.groups}
        self._former = {g: dict((former_group_peers or {}).get(g, former) or {}) for g in self.groups}
        for g, ex in self.exchanges.items():
            ex.set_stage_peers(
                (group_peers or {}).get(g, stage_peers), (former_group_peers or {}).get(g, former)
            )

    def _apply(self, p: _Pending) -> None:
        t = time.perf_counter()
        ex = p.future.result()
        with self._lock:
            self.stats.wait_s += time.perf_counter() - t
            self.stats.rounds_applied += 1
            self.stats.last_contributors = sorted(ex.contribs)
            self.stats.last_tokens, self.stats.last_weights = dict(ex.tokens), dict(ex.weights)
            record_applied(self.stats, p.fid.round, sum(ex.tokens.values()))
        if p.partner is not None:
            self._apply_pair(p, ex)
            return
        for unsent in ex.unsent:  # ours that no round uses: back to the codec (error feedback)
            self.codec.restore(p.fid, unsent)
        # nothing arrived, not even ours: the anchor stays and the replica restarts from it (+ drift)
        delta_bar = self.aggregate(ex.contribs, ex.weights) if ex.contribs else None
        idx = self.fragments[p.fid.stage, p.fid.fragment]
        if delta_bar is not None and self.confine is not None:  # on the host, before it meets the anchor
            delta_bar = [self.confine.consensus(i, t) for i, t in zip(idx, delta_bar, strict=True)]
        with torch.no_grad():
            for j, i in enumerate(idx):
                if delta_bar is not None:
                    update = delta_bar[j].to(self.anchor[i].device)  # host consensus -> the stage's device
                    if self.momentum > 0:  # Nesterov: m <- mu m + g; step along g + mu m
                        self.outer_m[i].mul_(self.momentum).add_(update)
                        update = update + self.momentum * self.outer_m[i]
                    self.anchor[i].sub_(self.alpha * update)
                drift = self.params[i].detach() - p.theta_at_capture[j]  # theta(a_f) - theta(c_f)
                self.params[i].copy_(self.anchor[i] + drift)

    def _apply_pair(self, p: _Pending, ex: Exchanged) -> None:
        """Butterfly: the pair result blended into our anchor and weights, or (skipped) the standard reset."""
        assert self.pairs is not None and p.partner is not None
        idx = self.fragments[p.fid.stage, p.fid.fragment]
        new = self.pairs.apply(p.fid, p.partner, ex, [self.anchor[i] for i in idx])
        with torch.no_grad():
            for j, i in enumerate(idx):
                live = self.params[i].detach()
                if new is None:  # ours went back to error feedback: restart from the anchor (+ drift)
                    self.params[i].copy_(self.anchor[i] + (live - p.theta_at_capture[j]))
                    continue
                self.anchor[i].copy_(new[j].to(self.anchor[i].device))
                self.params[i].copy_(self.pairs.blend(live, self.anchor[i], p.theta_at_capture[j]))


__all__ = [
    "ANCHOR_IN_SPAN",
    "Aggregator",
    "Confinement",
    "Contribution",
    "Encoding",
    "Exchange",
    "FragmentCodec",
    "FragmentId",
    "LocalState",
    "OuterSync",
    "RoundAgreementError",
    "RoundSuperseded",
    "StepOutcome",
    "SyncStats",
]

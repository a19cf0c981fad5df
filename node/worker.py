"""Runs one assignment: this node's stage of one replica, from start_step to the run's last step.

Per inner step: 1F1B over M microbatches through the pipeline links, AdamW, then the outer loop's
capture/apply schedule; validation on consensus weights at round boundaries; progress in `metrics`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypedDict

import torch

from node.data.corpus import Corpus, DataSource
from node.device import describe, resolve_precision
from node.inner_step import (
    InnerOptimizer,
    inner_step,
    load_optimizer_tensors,
    make_optimizer,
    optimizer_tensors,
    prepare_stage,
)
from node.model import Stage, build_stage
from node.pipeline.acceptor import Acceptor
from node.pipeline.dial import LinkRoute, open_downstream, route_of
from node.pipeline.fallback import Fallback
from node.pipeline.hello_proof import find_sealed
from node.pipeline.relay_bridge import BridgeSession
from node.pipeline.schedule import PipelineStage, StepStats
from node.pipeline.transport import Link, Shaper
from node.subspace_model import boundary_codecs, confinement, constrain_stage, project_weights_
from node.sync.exchange import applied_history
from node.sync.expert_bias import Balancer, Signers, stage_balancer
from node.sync.outer_sync import LocalState, OuterSync, RoundSuperseded
from node.sync.pair_sync import PAIR_OUTCOMES, pair_settings
from node.sync.sparseloco_sync import make_sync_parts
from node.sync.stage_checkpoints import StageCheckpoints
from protocol import keys
from protocol.checkpoint import Checkpoint
from protocol.identity import Identity
from protocol.messages import Assignment
from protocol.net.store import ObjectStore, StoreError
from protocol.runspec import RunSpec
from protocol.trust.delegation import OperatorTrust

log = logging.getLogger(__name__)
LN2 = math.log(2)
ANCHOR_HISTORY = 32


@dataclass
class WorkerMetrics:
    """Live progress of the current assignment (read by the advert loop and the health server)."""

    state: str = "idle"
    run_id: str = ""
    replica: int = -1
    stage: int = -1
    step: int = 0
    total_steps: int = 0
    train_loss_bits_per_token: float | None = None
    """The last inner step's training loss, bits per token: the mean cross-entropy in nats over ln 2 (a
    token is a byte without a tokenizer). Only a replica's last stage computes it; None elsewhere."""
    validation_loss_bits_per_byte: float | None = None
    """The last validation loss, bits per byte of text whatever the tokenizer (node/data/tokenizer.py)."""
    val_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation loss in bits per byte) of every validation."""
    tokens_per_s: float = 0.0
    tokens: int = 0
    """Tokens this stage has trained on in the assignment (batch x seq_len per inner step)."""
    bytes_pipe_sent: int = 0
    bytes_pipe_recv: int = 0
    link_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Pipeline bytes [sent, received] by neighbour peer id."""
    link_transport: dict[str, str] = field(default_factory=dict)
    """By neighbour peer id: "direct" (TCP) or "relayed" (a libp2p stream through the relay)."""
    link_address: dict[str, str] = field(default_factory=dict)
    """By neighbour peer id: host:port, or the relayed stream's /p2p-circuit multiaddr."""
    link_resumes: int = 0
    """Times a relayed link's stream was reset (a relay's limit) and resumed on a new one."""
    bytes_store_up: int = 0
    bytes_store_down: int = 0
    pipe_wait_s: float = 0.0
    sync_wait_s: float = 0.0
    compute_s: float = 0.0
    rounds: int = 0
    fragments_rejected: int = 0
    fragments_missing: int = 0
    fragments_not_uploaded: int = 0
    fragments_late_committed: int = 0
    fragments_late_expired: int = 0
    round_tokens: dict[str, int] = field(default_factory=dict)
    """Replica -> the tokens its contribution to the last round this stage applied claimed (signed, bounded
    by its shape; late parts summed in): what sync.weighting = "tokens" weighs it by."""
    pair_exchanges: dict[str, int] = field(default_factory=dict)
    """Butterfly (sync.topology = "butterfly"): exchanges "exchanged", "unpaired" (sat out), "missing"
    (the partner's message missed the deadline), "refused" (the pair screen), "clipped" (the pair rule)."""
    pair_sha256: dict[str, str] = field(default_factory=dict)
    """Butterfly: "group.fragment" -> "round:partner:sha256" of its newest pair result; both ends of a
    pair show the same digest for the same round."""
    expert_load: dict[str, float] = field(default_factory=dict)
    """MoE ([model.moe]): layer -> max / mean tokens per expert in the last agreed step's load, over the
    run's replicas (1.0 = balanced); what the expert bias balances."""
    expert_load_local: dict[str, float] = field(default_factory=dict)
    """MoE: layer -> max / mean tokens per expert in this replica's own last step."""
    expert_bias_history: list[tuple[int, str]] = field(default_factory=list)
    """MoE: (step, sha256 of the stage's expert biases used at that step) of the last steps: every
    replica's stage holding those layers shows the same digest at the same step (node/sync/expert_bias.py)."""
    routing: dict[str, float] = field(default_factory=dict)
    """MoE: the routing statistics' per-step barrier (node/sync/route_exchange.py): steps, wait_s (the
    training time it stalled), settle_s (from a step's end until its set was final, in the background),
    bytes_up, bytes_down, rejected, missing, not_published."""
    weights_sha256: str = ""
    group_sha256: dict[str, str] = field(default_factory=dict)
    """Layer group -> sha256 of this stage's final weights of that group (`group_digests`): equal in every
    replica, whatever its split, when the consensus is."""
    anchor_round: int = -1
    """The last round whose consensus anchor this stage checkpointed, and its sha256 (every replica's
    stage shows the same digest for the same round)."""
    anchor_sha256: str = ""
    anchor_history: list[tuple[int, str]] = field(default_factory=list)
    """(round, anchor sha256) of the last ANCHOR_HISTORY checkpointed rounds, to compare replicas at equal
    rounds (a rebuilt replica replays rounds the others passed)."""
    applied_history: list[tuple[int, int]] = field(default_factory=list)
    """(round, tokens the consensus applied in it: its agreed contributions' claims, summed) of the last
    rounds this stage applied; equal on every replica (a rebuilt one replays the same sets)."""
    device: str = ""
    """Where this assignment trains (e.g. "cuda:0 (NVIDIA H200, 139.8 GiB)" or "cpu")."""
    precision: str = ""
    """The run's train.precision as resolved on this node: "bf16" (autocast, fp32 master) or "fp32"."""
    error: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


class GroupSigners(TypedDict):
    group_peers: dict[int, dict[int, str]] | None
    former_group_peers: dict[int, dict[int, set[str]]] | None


def group_signers(a: Assignment) -> GroupSigners:
    """The signers of each of the stage's layer groups by replica, from `a` (None where the run's
    replicas share one split: the stage's signers are each group's)."""
    if not a.group_peers:
        return GroupSigners(group_peers=None, former_group_peers=None)
    return GroupSigners(
        group_peers={int(g): {int(r): p for r, p in by.items()} for g, by in a.group_peers.items()},
        former_group_peers={
            int(g): {int(r): set(ps) for r, ps in a.former_group_peers.get(g, {}).items()}
            for g in a.group_peers
        },
    )


def route_signers(spec: RunSpec, a: Assignment) -> Signers:
    """Each of the stage's layer groups' signers by replica, and the former ones, from assignment `a`."""
    gs = group_signers(a)
    stage = {int(r): p for r, p in a.stage_peers.items()}
    former = {int(r): set(p) for r, p in a.former_stage_peers.items()}
    return {
        g: ((gs["group_peers"] or {}).get(g, stage), (gs["former_group_peers"] or {}).get(g, former))
        for g in spec.groups_of(a.replica, a.stage)
    }


def group_params(spec: RunSpec, names: list[str]) -> dict[int, list[int]]:
    """Layer group -> indices into `names` (the stage's parameters, in order) of its parameters."""
    out: dict[int, list[int]] = {}
    for i, name in enumerate(names):
        out.setdefault(spec.group_of_param(name), []).append(i)
    return out


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 over the state dict's fp32 bytes in name order, wherever the tensors live."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def group_digests(spec: RunSpec, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Layer group -> `weights_digest` of its tensors alone (by global name): comparable across replicas
    of different splits, unlike a stage's digest."""
    hs: dict[int, hashlib._Hash] = {}
    for name, p in sorted(tensors.items()):
        h = hs.setdefault(spec.group_of_param(name), hashlib.sha256())
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return {str(g): h.hexdigest() for g, h in sorted(hs.items())}


@dataclass
class _Setup:
    """What `StageWorker._build` sets up for the loop."""

    module: Stage
    opt: InnerOptimizer
    sync: OuterSync
    pipe: PipelineStage
    corpus: Corpus | None
    """The first stage's corpus (None elsewhere)."""
    val: list[torch.Tensor] | None
    """The first stage's validation batches (None elsewhere)."""
    start: int
    """The inner step this replica starts from."""
    balancer: Balancer | None = None
    """MoE: the expert bias and its per-step barrier (None for a dense model, or a stage of dense blocks)."""


@dataclass
class _Clock:
    """The window of the tokens-per-second figure (about 2 s) and the time of the last progress line."""

    window_t: float
    last_log: float
    window_steps: int = 0


class StageWorker:
    """One assignment's training loop."""

    def __init__(
        self,
        assignment: Assignment,
        *,
        identity: Identity,
        store: ObjectStore,
        acceptor: Acceptor,
        data: DataSource,
        metrics: WorkerMetrics,
        should_stop: Callable[[], str | None],
        connect_timeout_s: float = 120.0,
        device: torch.device | None = None,
        compile: bool = True,
        node_shaper: Shaper | None = None,
        operator: OperatorTrust | None = None,
        left_out: Callable[[], str | None] = lambda: None,
        fallback: Fallback | None = None,
    ) -> None:
        """device: where the stage trains (default CPU); compile: torch.compile the stage on CUDA;
        node_shaper: the node's emulated link (--emulate-mbps), applied to its links' sends; operator: who
        signs the run's assignments (a resuming first stage reads the later stages' signers from them);
        left_out: why this node no longer holds its slot (None: it does; asked before a round is applied);
        fallback: this node's relayed links (node/pipeline/fallback.py), None: direct only."""
        self.node_shaper, self.left_out, self.fallback = node_shaper or Shaper(), left_out, fallback
        self._sessions: list[BridgeSession] = []  # relayed links' sessions: their resumes are counted
        self.device, self.compile = device or torch.device("cpu"), compile
        self.a, self.spec = assignment, assignment.spec
        self.identity, self.store, self.acceptor = identity, store, acceptor
        self.data = data
        self._token_bytes: torch.Tensor | None = None  # last stage under a tokenizer: bits per byte
        self.m = metrics
        self.should_stop = should_stop
        self.connect_timeout_s = connect_timeout_s
        self.prev: Link | None = None
        self.sync: OuterSync | None = None
        self.balancer: Balancer | None = None
        self._aborted = threading.Event()
        self.next: Link | None = None
        self._resume: Checkpoint | None = None
        self.checkpoints = StageCheckpoints(store, identity, assignment, should_stop, operator)

    # --- set-up -----------------------------------------------------------------------------------
    def _shaper(self) -> Shaper:
        """The run's [pipeline] shaper combined with this node's emulated link: the slower rate and the
        longer delay win."""
        p, own = self.spec.pipeline, self.node_shaper
        rates = [r for r in (p.bandwidth_mbps, own.bandwidth_mbps) if r > 0]
        return Shaper(bandwidth_mbps=min(rates, default=0.0), delay_ms=max(p.delay_ms, own.delay_ms))

    def _open_links(self) -> int:
        """Accept upstream, then connect downstream; returns the step this replica starts from.

        The first stage decides the start step (resuming after churn: the latest consensus checkpoint)
        and each stage passes it on in its Hello, so a rebuilt replica's stages agree on it."""
        a = self.a
        start = a.start_step
        if a.prev is not None:
            hello, sock = self.acceptor.take(
                a.run_id,
                a.prev.peer_id,
                a.replica,
                a.stage - 1,
                self.connect_timeout_s,
                self._cancelled,
                term=a.term,
                epoch=a.epoch,
            )
            self.prev = self._link(sock, a.prev.peer_id, a.stage - 1, route_of(sock, self.fallback))
            start = hello.start_step
        elif start < 0:  # the first stage picks the round its replica resumes from
            self._resume = self.checkpoints.latest()
            start = self._resume.step if self._resume is not None else 0
        if a.next is not None:
            proof = find_sealed(self.store, a)  # our signed assignment: the next node holds only neighbours
            args = (a, self.identity, proof, start, self.fallback)
            sock, route = open_downstream(*args, timeout_s=self.connect_timeout_s, cancelled=self._cancelled)
            self.next = self._link(sock, a.next.peer_id, a.stage + 1, route)
        return start

    def _link(self, sock: socket.socket, peer: str, stage: int, route: LinkRoute) -> Link:
        self.m.link_transport[peer], self.m.link_address[peer] = route.transport, route.address
        if route.session is not None:
            self._sessions.append(route.session)
        return Link(sock, f"{peer[-8:]} (stage {stage})", shaper=self._shaper())

    def _close_links(self) -> None:
        for link in (self.prev, self.next):
            if link is not None:
                link.flush(5.0)
                link.close()

    def _cancelled(self) -> bool:
        return self._aborted.is_set() or self.should_stop() is not None

    def abort(self) -> None:
        """Unblock a worker waiting on its links (the node is reassigned or shutting down)."""
        self._aborted.set()
        for link in (self.prev, self.next):
            if link is not None:
                link.close()

    def update_stage_peers(self, a: Assignment) -> None:
        """A replica elsewhere was rebuilt with a new node (`a`: our newer assignment): trust its signer from
        now on (no restart); the node it replaced stays a signer of the rounds it took part in. Checkpoints
        bind each to its slot."""
        self.checkpoints.set_stage_peers(
            a.stage_peers, a.former_stage_peers, a.group_peers, a.former_group_peers
        )
        if self.balancer is not None:
            self.balancer.set_signers(route_signers(self.spec, a))
        if self.sync is not None:
            self.sync.set_stage_peers(
                {int(r): p for r, p in a.stage_peers.items()},
                {int(r): set(p) for r, p in a.former_stage_peers.items()},
                **group_signers(a),
            )

    # --- the loop ---------------------------------------------------------------------------------
    def run(self) -> str:
        """Train to the end (returns "done") or until should_stop() says why (returns that reason)."""
        a, m = self.a, self.m
        st = self._build()
        result = "done"
        try:
            result = self._train(st)
            st.sync.finish()
            self._update_io(st.sync)
            if result == "done":
                self._evaluate(st.pipe, m.step, st.val)
                m.weights_sha256 = weights_digest(st.module)
                m.group_sha256 = group_digests(self.spec, st.module.state_dict())
                self._report()
        except RoundSuperseded as e:  # a newer epoch left us out: stop, and so do the rounds in flight
            self._aborted.set()
            result = str(e)
        finally:
            self._close_links()
            st.sync.close()  # a checkpoint upload in flight finishes
            if st.balancer is not None:
                st.balancer.close()
        m.state = "done" if result == "done" else "idle"
        log.info("run %s r%d/s%d ended at step %d: %s", a.run_id, a.replica, a.stage, m.step, result)
        return result

    def _build(self) -> _Setup:
        """The stage, its data, optimizer, round owner and pipeline, resumed from a checkpoint where the
        replica resumes. If any of it fails the links are closed: the neighbours then fail at once with a
        closed link, not at a timeout."""
        a, spec, m = self.a, self.spec, self.m
        torch.manual_seed(spec.model.init_seed)
        ranges = spec.layer_ranges(a.replica)
        # built, constrained and resumed on the CPU: every replica starts bit-identical whatever its device
        module = build_stage(spec.model, ranges, a.stage)
        # subspace links (DESIGN section 4): keep the residual stream in span(U) + T[x] so k-wide is exact;
        # the spans are the model's, the same in every replica's split
        pipeline = spec.pipeline_of(a.replica)
        constrain_stage(module, spec.model, pipeline, ranges, a.stage, layouts=spec.layouts())
        precision = resolve_precision(spec.train.precision, self.device)
        m.state, m.total_steps = "training", spec.train.total_steps
        m.device, m.precision = describe(self.device), precision
        try:
            start = self._open_links()
            ck = None
            if a.start_step < 0 and start > 0:  # a rebuilt or relaunched replica resumes
                ck = self._resume if self._resume is not None else self.checkpoints.at_step(start)
                module.load_state_dict(
                    {k[len("model.") :]: v for k, v in ck.tensors.items() if k.startswith("model.")}
                )
                project_weights_(module)
            prepare_stage(module, self.device, precision, compile=self.compile)
            log.info("run %s r%d/s%d trains on %s in %s", a.run_id, a.replica, a.stage, m.device, precision)
            codec_in, codec_out = boundary_codecs(module, spec.model, pipeline, ranges, a.stage)
            first = a.stage == 0
            # the first stage reads the corpus (its hash checked), the last counts text bytes per token
            corpus = self.data.corpus(spec.train, spec.model.vocab) if first else None
            if a.stage == len(ranges) - 1:
                self._token_bytes = self.data.token_bytes(spec.train, spec.model.vocab)
            val = (
                corpus.val_batches(spec.train.eval_batches, spec.train.batch_size, spec.model.seq_len)
                if corpus
                else None
            )
            opt = make_optimizer(module, spec.train)
            sync = self._outer_sync(module, opt)
            self.sync = sync
            if ck is not None:
                sync.restore(ck)
            m.step = start
            pipe = PipelineStage(
                module,
                stage=a.stage,
                n_stages=len(ranges),
                prev=self.prev,
                next=self.next,
                codec_in=codec_in,
                codec_out=codec_out,
                recv_timeout_s=spec.pipeline.recv_timeout_s,
                extra_in_flight=spec.pipeline.extra_in_flight,
                device=self.device,
            )
        except BaseException:
            self._close_links()
            raise
        balancer = stage_balancer(  # MoE: the expert bias and its per-step barriers (None without MoE)
            module, spec, self.store, self.identity, replica=a.replica, signers=route_signers(spec, a),
            cancelled=self._cancelled,
        )  # fmt: skip
        self.balancer = balancer
        return _Setup(
            module=module,
            opt=opt,
            sync=sync,
            pipe=pipe,
            corpus=corpus,
            val=val,
            start=start,
            balancer=balancer,
        )

    def _outer_sync(self, module: Stage, opt: InnerOptimizer) -> OuterSync:
        """The stage's round owner, with the codec, aggregation and schedule the run's [sync] selects."""
        a, spec = self.a, self.spec
        parts = make_sync_parts(spec, self.identity)
        names = [n for n, _ in module.named_parameters()]
        local = LocalState(
            names=names,
            tensors=lambda: {
                **{f"model.{k}": v for k, v in module.state_dict().items()},
                **optimizer_tensors(module, opt),
            },
            load=lambda tensors: load_optimizer_tensors(module, opt, tensors),
            after_apply=lambda: project_weights_(module),  # a sparse, quantized update leaves span(U)
        )
        return OuterSync(
            list(module.parameters()),
            store=self.store,
            codec=parts.codec,
            aggregate=parts.aggregate,
            run_id=a.run_id,
            stage=a.stage,
            replica=a.replica,
            stage_peers={int(r): p for r, p in a.stage_peers.items()},
            former_stage_peers={int(r): set(p) for r, p in a.former_stage_peers.items()},
            groups=group_params(spec, names),
            **group_signers(a),
            schedule=spec.sync.schedule(),
            alpha=spec.sync.alpha,
            momentum=parts.momentum,
            timeout_s=spec.sync.timeout_s,
            quorum=spec.sync.quorum,
            max_late_rounds=spec.sync.max_late_rounds,
            tokens_per_step=spec.tokens_per_step(a.replica),  # the weight its fragments claim
            cancelled=self._cancelled,  # a stop or reassignment ends a wait for a quorum
            local=local,
            checkpoints=self.checkpoints,
            checkpoint_every=spec.sync.checkpoint_every,
            confine=confinement(module),  # the anchor stays in span(U), identically on every replica
            butterfly=pair_settings(spec),  # sync.topology = "butterfly": pair exchanges, no consensus
            superseded=self.left_out,  # a replica dropped out while alive must not hold a second consensus
        )

    def _train(self, st: _Setup) -> str:
        """Inner steps from st.start to the run's last, each followed by the round owner's step_done;
        returns "done", or should_stop()'s reason."""
        a, spec = self.a, self.spec
        self._evaluate(st.pipe, st.start, st.val)
        now = time.perf_counter()
        clock = _Clock(window_t=now, last_log=now)
        for step in range(st.start, spec.train.total_steps):
            reason = self.should_stop()
            if reason:
                return reason
            batch = (
                st.corpus.train_batch(
                    spec.train.data_seed, a.replica, step, spec.batch_of(a.replica), spec.model.seq_len
                )
                if st.corpus
                else None
            )
            stats = inner_step(
                st.module,
                st.opt,
                spec.train,
                step,
                lambda: st.pipe.train_step(step, batch, spec.microbatches_of(a.replica)),  # noqa: B023
            )
            # MoE: publish the step's routing counts, move the expert bias by the agreed ones (before a
            # checkpoint, so it holds the bias the next step uses)
            if st.balancer is not None and not st.balancer.step_done(step):
                return self.should_stop() or "stopped waiting for routing statistics"
            outcome = st.sync.step_done(step + 1)  # the round owner: outer sync, round end, checkpoint
            self._count_step(step + 1, stats, clock)
            self._update_io(st.sync)
            rnd = outcome.round_ended
            if rnd is not None:
                self.m.rounds = rnd
                if spec.eval_every and rnd % spec.eval_every == 0 and step + 1 < spec.train.total_steps:
                    self._evaluate(st.pipe, step + 1, st.val)
            if outcome.checkpointed is not None:
                self._record_anchor(outcome.checkpointed, st.sync)
        return "done"

    # --- metrics ------------------------------------------------------------------------------------
    def _count_step(self, done: int, stats: StepStats, clock: _Clock) -> None:
        """Progress after `done` inner steps: time, tokens, loss, tokens per second; a log line every 10 s."""
        m = self.m
        tokens_per_step = self.spec.tokens_per_step(self.a.replica)
        m.step, m.compute_s, m.pipe_wait_s = done, m.compute_s + stats.compute_s, m.pipe_wait_s + stats.wait_s
        m.tokens += tokens_per_step
        if stats.loss is not None:  # nats per token
            m.train_loss_bits_per_token = stats.loss / LN2
        clock.window_steps += 1
        now = time.perf_counter()
        if now - clock.window_t > 2.0:
            m.tokens_per_s = clock.window_steps * tokens_per_step / (now - clock.window_t)
            clock.window_t, clock.window_steps = now, 0
        if now - clock.last_log > 10.0:
            clock.last_log = now
            self._log_progress()

    def _record_anchor(self, rnd: int, sync: OuterSync) -> None:
        """Round `rnd` was checkpointed: its anchor's digest, and the last ANCHOR_HISTORY of them."""
        m = self.m
        m.anchor_round, m.anchor_sha256 = rnd, sync.anchor_digest()
        m.anchor_history = [*m.anchor_history, (m.anchor_round, m.anchor_sha256)][-ANCHOR_HISTORY:]

    def _log_progress(self) -> None:
        m = self.m
        bits = m.train_loss_bits_per_token
        loss = f"{bits:.3f} bits/token" if bits is not None else "-"
        log.info(
            "run %s r%d/s%d step %d/%d  train %s  %.0f tok/s  pipeline %.1f MB  store %.1f MB  waits: pipe %.1f s, sync %.1f s",
            self.a.run_id,
            self.a.replica,
            self.a.stage,
            m.step,
            m.total_steps,
            loss,
            m.tokens_per_s,
            (m.bytes_pipe_sent + m.bytes_pipe_recv) / 1e6,
            (m.bytes_store_up + m.bytes_store_down) / 1e6,
            m.pipe_wait_s,
            m.sync_wait_s,
        )

    def _evaluate(self, pipe: PipelineStage, step: int, val: list[torch.Tensor] | None) -> None:
        ev = pipe.evaluate(step, val, self.spec.train.eval_batches, self._token_bytes)
        if ev is not None:
            bpb = ev.bits_per_byte  # nats / (ln 2 x text bytes): per byte whatever the tokenizer
            self.m.validation_loss_bits_per_byte = bpb
            self.m.val_history.append((step, bpb))
            log.info("replica %d step %d: validation %.4f bits/byte", self.a.replica, step, bpb)

    def _update_io(self, sync: OuterSync) -> None:
        m = self.m
        m.bytes_pipe_sent = sum(link.bytes_sent for link in (self.prev, self.next) if link)
        m.bytes_pipe_recv = sum(link.bytes_recv for link in (self.prev, self.next) if link)
        m.link_resumes = sum(s.resumes for s in self._sessions)
        m.link_bytes = {
            ep.peer_id: [link.bytes_sent, link.bytes_recv]
            for ep, link in ((self.a.prev, self.prev), (self.a.next, self.next))
            if ep is not None and link is not None
        }
        m.bytes_store_up, m.bytes_store_down = sync.stats.bytes_up, sync.stats.bytes_down
        m.sync_wait_s = sync.stats.wait_s
        m.fragments_rejected, m.fragments_missing = sync.stats.rejected, sync.stats.missing
        m.fragments_not_uploaded = sync.stats.not_uploaded
        m.fragments_late_committed, m.fragments_late_expired = (
            sync.stats.late_committed,
            sync.stats.late_expired,
        )
        m.round_tokens = {str(r): t for r, t in sorted(sync.stats.last_tokens.items())}
        m.applied_history = applied_history(sync.stats)
        if self.balancer is not None:
            for name, value in self.balancer.figures().items():
                setattr(m, name, value)
        if sync.pairs is not None:
            ps = sync.pairs.stats
            m.pair_exchanges = {k: getattr(ps, k) for k in PAIR_OUTCOMES}
            m.pair_sha256 = dict(ps.last)

    def _report(self) -> None:
        import json

        key = keys.report_key(self.a.run_id, self.a.replica, self.a.stage)
        try:
            self.store.put(key, json.dumps(self.m.as_dict()).encode())
        except StoreError as e:
            if not self.store.write_once:
                raise
            # through grants the report is written once, by its grant: the run's work is done all the same
            log.warning("final report %s not written: %s", key, e)

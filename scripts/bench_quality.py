"""Quality of the cross-replica sync methods on the same tokens: AdamW data-parallel vs DiLoCo vs SparseLoCo.

  python -m scripts.bench_quality            # the recorded run (about 10 minutes on 2 cores)
  python -m scripts.bench_quality --quick    # CI-sized (under 2 minutes)
  python -m scripts.bench_quality --check    # build every selected arm's run spec, train nothing
  python -m scripts.bench_quality --arms adamw,sparseloco --steps 300 --alpha 1.0 --H 15
  python -m scripts.bench_quality --arms sparseloco --attack flip --attack-rounds 3-8 --robust none

In one process, R simulated replicas of a small Llama-style model train on the standard-library corpus;
replica r draws batch (data_seed, r, step) in every arm, so every method sees the same tokens:

- adamw:        data-parallel AdamW, gradients averaged over the R replicas every step (the centralized
                baseline; one model on the concatenation of the R batches, which is the same gradient).
- diloco:       H AdamW steps per replica, then dense fp32 pseudo-gradients averaged, Nesterov outer step
                (arXiv 2311.08105). The paper's alpha 0.7 / momentum 0.9 is tuned for H ~ 500; at H = 15
                plain averaging (alpha 1, momentum 0) was the best of those tried (docs/benchmarks.md).
- sparseloco:   error feedback + top-k per 4096-chunk + 2-bit values (arXiv 2508.15706); k = 64,
                per-coordinate mean, alpha 1, beta 0.7, H = 5 (the best of the settings tried here:
                with 200 rounds a short error-feedback memory beats the paper's 0.95; docs/benchmarks.md).
- late_commit / late_drop: SparseLoCo, where the last replica's fragment of every odd round (0-based)
                reaches the store --late-window-s + 2.5 s after the round began, past its deadline
                (W = --late-window-s); committed in the next round's set (sync.max_late_rounds = 1) or
                left to its sender's error feedback (max_late_rounds = 0, the behaviour before issue 22);
                --late-method diloco runs them as the diloco arm (no error feedback: a dropped one is lost).
- mixed_tokens / mixed_equal: SparseLoCo, where the last half of the replicas run twice the batch
                (their [[shapes]] table has twice the microbatches, so they train on twice the tokens per
                step); the aggregate weighs each contribution by the tokens it trained on
                (sync.weighting = "tokens", the default) or alike ("equal"). `sparseloco` is the uniform
                baseline (every replica at --batch).
- butterfly:    SparseLoCo with sync.topology = "butterfly" (issue 23): each round every replica exchanges
                with one partner (i XOR 2^(round mod log2 R)) through the store, sending its pseudo-gradient
                and its anchor's difference from the pair's base in one fragment; no consensus, so the
                figure is replica 0's anchor (`val_bpb`), with every replica's own (`butterfly_val_bpb`)
                and the spread of the anchors beside it. Compare with `sparseloco` at the same tokens.
- muon:         SparseLoCo with train.optimizer = "muon" (issue 24): torch.optim.Muon at --muon-lr for the
                blocks' 2-D matrices, AdamW at --lr for the embedding, head and norms, in every replica's
                inner step; `sparseloco` is the AdamW-inner baseline at the same tokens.
- stochastic:   SparseLoCo with sync.stochastic_rounding = true (issue 24): each kept value coded between
                the two Lloyd levels around it, unbiased, instead of to the nearest; `sparseloco` is the
                nearest-rounding baseline at the same tokens.
- moe / moe_adamw: the model with MoE blocks of the same active parameters (issue 24): --moe-experts
                experts of width d_ff / 2, top-2, every block; its expert bias moved after every step by
                the agreed routing counts of every replica, through the store's per-step barrier
                (node/sync/expert_bias.py, node/sync/route_exchange.py), under SparseLoCo (moe) or data-parallel
                AdamW (moe_adamw: one model, the bias moved by the global batch's counts). `sparseloco`
                and `adamw` are the dense models at the same active parameters and tokens.
- stream_tau1/2: SparseLoCo with P strided fragments captured at c_f = (f+1) floor(H/P) and applied
                tau = 1 or 2 inner steps later, keeping the local drift (arXiv 2501.18512). The run spec
                needs tau < floor(H/P) (a cycle's fragments all applied before the next cycle's first
                capture), so without --P each arm takes the most fragments, up to 5, its tau allows:
                P = floor(H / (tau + 1)); at H = 5 that is P = 2 for tau = 1 and P = 1 for tau = 2.

Every inner step is the worker's (node/inner_step.py: lr schedule, clipping, AdamW) under a `TrainSpec`
built from the flags. The outer loops are the real `node.sync.outer_sync.OuterSync` with the codecs and
aggregation that `node.sync.sparseloco_sync.make_sync_parts` builds for the swarm, talking to an in-process S3
server (moto) on loopback; replicas are stepped in lockstep (capture phase for all, then apply phase for
all). The figure is validation bits-per-byte (mean cross-entropy / ln 2; byte vocabulary) of the
consensus weights on the held-out tail of the corpus, as a table on stderr and one JSON line last on stdout.

--attack KIND makes one replica (--attack-replica, default the last) hostile during --attack-rounds
(1-based outer rounds, inclusive): it trains and runs error feedback honestly, then replaces its SparseLoCo
fragment with a forged one it signs with its own valid key: "x100" (scales x100), "flip" (every value
negated: a sign flip of normal size), "floatmax" (values up to 1e38, near float32's 3.4e38), "reversed"
(minus the round's honest mean) or "orthogonal" (its own update negated, on coordinates no honest replica
sent: orthogonal to the honest mean); the last two at the honest replicas' median norm. --robust
picks the aggregation's bound on one replica's influence (`sync.robust`; default "trimmed"). A run whose
weights stop being finite is reported as diverged (bits per byte null in the JSON).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from node.data.corpus import Corpus
from node.device import resolve_precision
from node.inner_step import InnerOptimizer, inner_step, make_optimizer, prepare_stage
from node.model import Stage, build_full_model, lm_loss, moe_blocks
from node.sync.aggregation import norm
from node.sync.expert_bias import Balancer, bias_digest, load_ratio, move_bias, take_load
from node.sync.outer_sync import Contribution, Encoding, FragmentCodec, FragmentId, OuterSync
from node.sync.pair_mix import TAG_LEN
from node.sync.pair_sync import PAIR_OUTCOMES, pair_settings
from node.sync.route_exchange import RouteExchange
from node.sync.sparseloco_sync import SparseLoCoCodec, make_sync_parts
from protocol.codecs.sparseloco import CompressedFragment, SparseLoCoConfig, compress, decompress
from protocol.codecs.sparseloco_format import decode_fragment, encode_fragment
from protocol.identity import Identity
from protocol.net.store import ObjectStore
from protocol.runspec import ModelSpec, MoESpec, ReplicaShape, RunSpec, SyncSpec, TrainSpec
from scripts.bench_subspace_quality import bench_model
from scripts.embedded_store import embedded_store

ARMS = (
    "adamw",
    "diloco",
    "sparseloco",
    "stream_tau1",
    "stream_tau2",
    "late_commit",
    "late_drop",
    "mixed_tokens",
    "mixed_equal",
    "butterfly",
    "muon",
    "stochastic",
    "moe",
    "moe_adamw",
)
NEWER_ARMS = ("butterfly", "muon", "stochastic", "moe", "moe_adamw")
DATA_PARALLEL_ARMS = ("adamw", "moe_adamw")
"""The arms that train one model on the R replicas' batches (no outer loop)."""
"""Arms a plain run leaves out (as it does the late and mixed ones): ask for them with --arms."""
LATE_ARMS = {"late_commit": 1, "late_drop": 0}
"""The late arms and their sync.max_late_rounds: the last replica's fragment of every other round reaches
the store after that round's deadline; committed in the next round's set, or dropped (error feedback)."""
MIXED_ARMS = {"mixed_tokens": "tokens", "mixed_equal": "equal"}
"""The mixed-batch arms and their sync.weighting: the last half of the replicas run twice the batch (a
[[shapes]] table of twice the microbatches); the aggregate weighs them by their tokens, or alike."""
ATTACKS = ("x100", "flip", "floatmax", "reversed", "orthogonal")
COLLUDING = ("reversed", "orthogonal")
"""Attacks built from the round's honest contributions (`HonestBoard`), not from the attacker's own alone."""
FLOATMAX_TARGET = 1e38
"""Largest |value| of a "floatmax" forgery: float32's max is 3.4e38, so two of them summed overflow."""
SPREAD_EVERY = 10
"""The butterfly arm records its anchors' spread every this many rounds."""
BOARD_WAIT_S = 60.0
"""How long a colluding forgery waits for the round's honest contributions (all are encoded in the same
capture phase, before any replica applies, so only a bug makes it wait at all)."""


@dataclass(kw_only=True, frozen=True)
class Setup:
    """Everything an arm needs besides its sync settings."""

    model: ModelSpec
    replicas: int
    train: TrainSpec
    """Inner steps, per-replica batch, peak lr, warm-up, clipping, data seed (weight decay 0)."""
    moe_experts: int = 8
    """The MoE arms' experts per block."""

    def model_of(self, name: str) -> ModelSpec:
        """The model arm `name` trains: the MoE arms' has MoE blocks of the dense one's active parameters
        (top-2 experts of half the dense width), the others the dense model."""
        if name not in ("moe", "moe_adamw"):
            return self.model
        moe = MoESpec(experts=self.moe_experts, top_k=2, d_ff=self.model.d_ff // 2)
        return replace(self.model, moe=moe)


@dataclass
class Result:
    name: str
    val_bpb: float
    train_s: float
    sync: SyncSpec | None = None
    bytes_up_per_round: float = 0.0
    """Bytes one replica uploads per outer round (all fragments), headers and signatures included."""
    bytes_down_per_round: float = 0.0
    """Bytes one replica downloads per outer round (the other replicas' fragments it reads)."""
    replica_bpb: list[float] = field(default_factory=list)
    mean_bpb: float | None = None
    """Butterfly: the bits per byte of the replicas' mean anchor (a final full mix)."""
    """Butterfly: each replica's own anchor's bits per byte (no consensus)."""
    spread: float | None = None
    """Butterfly: max over replicas of ||A_r - mean A|| / ||mean A - A_0|| at the end (A_0: the start)."""
    spread_history: list[tuple[int, float]] = field(default_factory=list)
    """Butterfly: (round, spread) every SPREAD_EVERY rounds."""
    pair_counts: dict[str, int] = field(default_factory=dict)
    """Butterfly: exchanges blended, sat out, missing, refused, clipped (summed over replicas)."""
    wait_s: float = 0.0
    """Training time blocked on transfers still in flight, summed over replicas."""
    rounds: int = 0
    rejected: int = 0
    missing: int = 0
    late_committed: int = 0
    """Late fragments committed, counted by one replica."""
    round_tokens: dict[int, int] = field(default_factory=dict)
    """Replica -> the tokens its contribution to the last round claimed (the weights of "tokens")."""
    diverged_at: int | None = None
    """Inner step after which the weights or the loss stopped being finite (None: they never did)."""
    load_ratio: dict[int, float] = field(default_factory=dict)
    """MoE arms: layer -> max / mean tokens per expert over the last step's batch (all replicas')."""


@dataclass(kw_only=True, frozen=True)
class Attack:
    """One hostile replica: forged fragments in outer rounds first..last (1-based, inclusive)."""

    kind: str
    replica: int
    first: int
    last: int
    colluders: tuple[int, ...] = ()
    """Further replicas forging the same way in the same rounds (scripts.bench_attack --hostile)."""

    def active(self, rnd: int) -> bool:
        """rnd: OuterSync's 0-based round number."""
        return self.first <= rnd + 1 <= self.last


def forge(cf: CompressedFragment, kind: str) -> CompressedFragment:
    """The honest fragment cf turned into a hostile one of the same shape (it still decodes: scales stay
    non-negative and dense values within [-1, 1])."""
    if kind == "x100":
        return replace(
            cf, ref_scale=cf.ref_scale * np.float32(100), dense_scale=cf.dense_scale * np.float32(100)
        )
    if kind == "flip":
        return replace(cf, table=-cf.table, dense=-cf.dense)
    if kind == "floatmax":  # decoded |value| = |table| * s_c <= |table|max * ref: make that 1e38
        peak = np.abs(cf.table).max(axis=1) if cf.table.size else np.zeros(0, np.float32)
        ref = np.where(peak > 0, FLOATMAX_TARGET / np.maximum(peak, 1e-30), 0).astype(np.float32)
        dense_scale = np.full_like(cf.dense_scale, FLOATMAX_TARGET)
        return replace(cf, ref_scale=ref, dense_scale=dense_scale)
    raise ValueError(f"unknown attack {kind!r}; choose from {', '.join(ATTACKS)}")


def forge_against(
    kind: str, honest: list[list[torch.Tensor]], delta: list[torch.Tensor], cfg: SparseLoCoConfig
) -> CompressedFragment:
    """A hostile fragment aimed at the round's honest decoded contributions (replica order), at their
    (lower) median norm:

        m = (1/n) sum_h Delta_h                        (the honest mean)
        "reversed":    v = -m                          (every colluder sends the same one)
        "orthogonal":  v = -delta on {i : m_i = 0}     (the attacker's own pseudo-gradient, negated, where
                                                        no honest replica sent anything; 1-D tensors 0)

    compressed as an honest encoder would (top-k per chunk, 2-bit values), then scaled so its decoded norm
    is the median honest norm. An "orthogonal" fragment only holds coordinates where m is 0, so its decoded
    values are orthogonal to m exactly (and to every honest contribution): it passes an agreement screen
    at cosine 0 and, per coordinate, meets no honest value to be trimmed against."""
    n = len(honest)
    m = [
        sum((h[i].double() for h in honest), torch.zeros_like(honest[0][i], dtype=torch.float64)) / n
        for i in range(len(honest[0]))
    ]
    if kind == "reversed":
        v = [(-t).float() for t in m]
    elif kind == "orthogonal":
        v = [
            torch.where(t == 0, -d.detach().float().cpu(), 0.0) if t.dim() >= 2 else torch.zeros_like(d)
            for t, d in zip(m, delta, strict=True)
        ]
    else:
        raise ValueError(
            f"attack {kind!r} is not aimed at the honest mean; choose from {', '.join(COLLUDING)}"
        )
    cf = compress(v, cfg)
    got, target = norm(decompress(cf)), sorted(norm(h) for h in honest)[(n - 1) // 2]
    s = np.float32(target / got if got > 0 else 0.0)
    return replace(cf, ref_scale=cf.ref_scale * s, dense_scale=cf.dense_scale * s)


class HonestBoard:
    """What colluding replicas know of a round: the honest replicas' decoded contributions. The bench
    hands them over in-process (the colluders could read the same from the store once the honest fragments
    are uploaded, and upload theirs within the round's window; in-process is the same for them and keeps
    the round's timing). Keyed by (fragment, round); honest replicas post at encode (only in the attack's
    rounds, so a long run keeps no more than those), forgers wait."""

    def __init__(self, honest: set[int], attack: Attack) -> None:
        self.honest, self.attack = honest, attack
        self._posted: dict[tuple[int, int], dict[int, list[torch.Tensor]]] = {}
        self._cv = threading.Condition()

    def post(self, fid: FragmentId, tensors: list[torch.Tensor]) -> None:
        if not self.attack.active(fid.round):
            return
        with self._cv:
            self._posted.setdefault((fid.fragment, fid.round), {})[fid.replica] = tensors
            self._cv.notify_all()

    def wait(self, fid: FragmentId) -> list[list[torch.Tensor]]:
        """The honest contributions of fid's fragment and round, in replica order."""
        key = (fid.fragment, fid.round)
        with self._cv:
            if not self._cv.wait_for(lambda: set(self._posted.get(key, {})) >= self.honest, BOARD_WAIT_S):
                raise RuntimeError(f"round {fid.round}: the honest contributions never all arrived")
            got = self._posted[key]
            return [got[r] for r in sorted(self.honest)]


class PostingCodec(SparseLoCoCodec):
    """An honest replica whose decoded contribution the colluders see (`HonestBoard`); its fragments are
    the honest codec's, bit for bit (encoded at once instead of on the I/O thread)."""

    def __init__(self, identity: Identity, cfg: SparseLoCoConfig, board: HonestBoard) -> None:
        super().__init__(identity, cfg, device_path=False)
        self.board = board

    def encode(self, fid: FragmentId, delta: list[torch.Tensor], tokens: int) -> Encoding:
        data, own = super().encode(fid, delta, tokens)()
        self.board.post(fid, own.tensors)
        return lambda: (data, own)


class ForgingCodec(SparseLoCoCodec):
    """A replica holding a valid key that trains and keeps its error feedback honestly, but in the attack
    window uploads a forged fragment signed with that key (every receiver verifies and decodes it).
    board: the round's honest contributions, for the attacks in COLLUDING."""

    def __init__(
        self, identity: Identity, cfg: SparseLoCoConfig, attack: Attack, board: HonestBoard | None = None
    ) -> None:
        super().__init__(identity, cfg, device_path=False)
        self.attack, self.board = attack, board
        if attack.kind in COLLUDING and board is None:
            raise ValueError(f"attack {attack.kind!r} needs the round's honest contributions (a HonestBoard)")

    def encode(self, fid: FragmentId, delta: list[torch.Tensor], tokens: int) -> Encoding:
        mine = [d.detach().clone() for d in delta] if self.attack.kind == "orthogonal" else delta
        return self._forged(fid, super().encode(fid, delta, tokens), mine)

    def encode_pair(
        self, fid: FragmentId, delta: list[torch.Tensor], anchor_diff: list[torch.Tensor], tokens: int
    ) -> Encoding:
        """A butterfly pair message, both parts forged alike (x100, flip, floatmax) for the pair rule to
        clip. Its last tensor, the base tag, stays honest (forged, the partner would only skip the
        exchange), and the forger keeps its own honest message for itself (its own anchor stays sane, as
        a forger's would; the two ends' bases then differ and their next exchange restarts the pair)."""
        honest = super().encode_pair(fid, delta, anchor_diff, tokens)
        if not self.attack.active(fid.round) or self.attack.kind in COLLUDING:
            return honest

        def forged() -> tuple[bytes, Contribution]:
            data, own = honest()
            header, cf, _ = decode_fragment(data)
            bad = forge(cf, self.attack.kind)
            cut = len(cf.dense) - TAG_LEN  # the base tag: the last tensor, sent dense, so the last values
            bad = replace(
                bad,
                dense_scale=np.concatenate([bad.dense_scale[:-1], cf.dense_scale[-1:]]),
                dense=np.concatenate([bad.dense[:cut], cf.dense[cut:]]),
            )
            return encode_fragment(self.identity, header, bad), own

        return forged

    def _forged(self, fid: FragmentId, honest: Encoding, mine: list[torch.Tensor]) -> Encoding:
        if not self.attack.active(fid.round):
            return honest

        def forged() -> tuple[bytes, Contribution]:
            data, _ = honest()
            header, cf, _ = decode_fragment(data)
            if self.board is not None and self.attack.kind in COLLUDING:
                bad = forge_against(self.attack.kind, self.board.wait(fid), mine, self.cfg)
            else:
                bad = forge(cf, self.attack.kind)
            return encode_fragment(self.identity, header, bad), Contribution(decompress(bad), header.tokens)

        return forged


class LateCodec:
    """An honest replica on a slow link, any codec: its fragment of every odd round reaches the store
    `delay_s` late (the I/O thread waits before the upload; training goes on). Everything else is the
    wrapped codec's."""

    def __init__(self, codec: FragmentCodec, delay_s: float) -> None:
        self.codec, self.delay_s = codec, delay_s
        self.identity = codec.identity
        self.decode, self.restore, self.residual = codec.decode, codec.restore, codec.residual
        self.state, self.load_state = codec.state, codec.load_state

    @property
    def signer(self) -> str:
        return self.codec.signer

    @property
    def max_fragment_bytes(self) -> int:
        return self.codec.max_fragment_bytes

    def encode(self, fid: FragmentId, delta: list[torch.Tensor], tokens: int) -> Encoding:
        encoding = self.codec.encode(fid, delta, tokens)
        if fid.round % 2 == 0:
            return encoding

        def late() -> tuple[bytes, Contribution]:
            time.sleep(self.delay_s)
            return encoding()

        return late


CPU = torch.device("cpu")


def new_model(
    s: Setup, train: TrainSpec | None = None, spec: ModelSpec | None = None
) -> tuple[Stage, InnerOptimizer]:
    """A replica's model and inner optimizer (`train`, `spec`: an arm's own, default s.train, s.model)."""
    model = build_full_model(
        spec or s.model
    )  # deterministic init from model.init_seed: every replica the same
    prepare_stage(model, CPU, resolve_precision(s.train.precision, CPU))
    return model, make_optimizer(model, train or s.train)


def train_on(model: Stage, opt: InnerOptimizer, s: Setup, step: int, tokens: torch.Tensor) -> float:
    """The worker's inner step (node/inner_step.py) on tokens (b, L+1); returns the training loss."""

    def forward_backward() -> float:
        loss = lm_loss(model(tokens[:, :-1]), tokens)
        loss.backward()
        return float(loss.detach())

    return inner_step(model, opt, s.train, step, forward_backward)


@torch.no_grad()
def evaluate(model: Stage, val: list[torch.Tensor]) -> float:
    """Validation bits per byte: mean cross-entropy over the fixed held-out batches / ln 2."""
    model.eval()
    nats = sum(float(lm_loss(model(b[:, :-1]), b)) for b in val) / len(val)
    model.train()
    return nats / math.log(2)


def run_adamw(
    s: Setup, corpus: Corpus, val: list[torch.Tensor], log: logging.Logger, name: str = "adamw"
) -> Result:
    spec = s.model_of(name)
    model, opt = new_model(s, spec=spec)
    blocks = moe_blocks(model)
    ratios: dict[int, float] = {}
    t = s.train
    t0 = time.perf_counter()
    for step in range(t.total_steps):
        tokens = torch.cat(  # (R b, L+1): the R replicas' batches; mean loss = gradient averaged over R
            [
                corpus.train_batch(t.data_seed, r, step, t.batch_size, s.model.seq_len)
                for r in range(s.replicas)
            ]
        )
        loss = train_on(model, opt, s, step, tokens)
        for layer, load in take_load(model).items():  # one model: the global batch's counts move its bias
            move_bias(blocks[layer], load, spec.moe.bias_rate)
            ratios[layer] = load_ratio(load)
        if step % 100 == 0 or step == t.total_steps - 1:
            log.info("%s step %4d train bpb %.4f", name, step, loss / math.log(2))
    train_s = time.perf_counter() - t0
    return Result(name, evaluate(model, val), train_s, load_ratio=ratios)


def arm_spec(name: str, sync: SyncSpec, s: Setup) -> RunSpec:
    """The run spec an outer arm trains under: R replicas of one stage holding the whole model (in the
    mixed arms the last half at twice the batch)."""
    doubled = list(range(s.replicas // 2, s.replicas))
    return RunSpec(
        run_id=f"bench-{name.replace('_', '-')}-{int(time.time() * 1000) % 10**9}",
        replicas=s.replicas,
        stages=1,
        model=s.model_of(name),
        train=replace(s.train, optimizer="muon") if name == "muon" else s.train,
        sync=sync,
        shapes=[ReplicaShape(replicas=doubled, microbatches=2 * s.train.microbatches)]
        if name in MIXED_ARMS and doubled
        else [],
    )


def run_outer(
    name: str,
    sync: SyncSpec,
    s: Setup,
    corpus: Corpus,
    val: list[torch.Tensor],
    store: ObjectStore,
    log: logging.Logger,
    attack: Attack | None = None,
    kill: tuple[int, int] | None = None,
) -> Result:
    """kill: (replica, rounds) — that replica stops for good after that many rounds (its slot stays)."""
    spec = arm_spec(name, sync, s)
    ids = [Identity.from_seed(bytes([r + 1]) * 32) for r in range(s.replicas)]
    peers = {r: ids[r].peer_id for r in range(s.replicas)}
    replicas, syncs = [], []
    hostile = set() if attack is None else {attack.replica, *attack.colluders}
    board = None
    if attack is not None and attack.kind in COLLUDING:
        board = HonestBoard(set(range(s.replicas)) - hostile, attack)
    for r in range(s.replicas):
        model, opt = new_model(s, spec.train, spec.model)
        parts = make_sync_parts(spec, ids[r])  # the swarm's codec, aggregation and outer momentum
        codec = parts.codec
        if attack is not None:
            if not isinstance(codec, SparseLoCoCodec):
                raise ValueError(f"--attack needs a SparseLoCo arm; {name} is {sync.method}")
            if r in hostile:
                codec = ForgingCodec(ids[r], codec.cfg, attack, board)
            elif board is not None:
                codec = PostingCodec(ids[r], codec.cfg, board)
        if name in LATE_ARMS and r == s.replicas - 1:
            codec = LateCodec(codec, sync.timeout_s + 2.5)
        syncs.append(
            OuterSync(
                list(model.parameters()),
                store=store,
                codec=codec,
                aggregate=parts.aggregate,
                run_id=spec.run_id,
                stage=0,
                replica=r,
                stage_peers=peers,
                schedule=sync.schedule(),
                alpha=sync.alpha,
                momentum=parts.momentum,
                timeout_s=sync.timeout_s,
                poll_s=0.002,
                max_late_rounds=sync.max_late_rounds,
                tokens_per_step=spec.tokens_per_step(r),
                butterfly=pair_settings(spec),
            )
        )
        replicas.append((model, opt))
    balancers = moe_balancers(spec, [m for m, _ in replicas], store, ids)
    start = [a.clone() for a in syncs[0].anchor]
    spread_history: list[tuple[int, float]] = []
    t = s.train
    t0 = time.perf_counter()
    diverged_at = None
    for step in range(t.total_steps):
        alive = [r for r in range(s.replicas) if kill is None or r != kill[0] or step < kill[1] * sync.H]
        losses = [
            train_on(
                m, o, s, step, corpus.train_batch(t.data_seed, r, step, spec.batch_of(r), s.model.seq_len)
            )
            for r, (m, o) in enumerate(replicas)
            if r in alive
        ]
        if not all(math.isfinite(x) for x in losses):
            diverged_at = step
            break
        for b in [balancers[r] for r in alive if balancers]:  # MoE: every replica's counts, then the bias
            b.publish(step)
        for b in [balancers[r] for r in alive if balancers]:
            b.apply(step)
        for r in alive:  # capture phase for every replica, then apply phase: no replica waits on itself
            syncs[r].capture_due(step + 1)
        for r in alive:
            syncs[r].apply_due(step + 1)
        if sync.topology == "butterfly" and (step + 1) % (SPREAD_EVERY * sync.H) == 0:
            spread_history.append(
                ((step + 1) // sync.H, anchor_spread([syncs[r].anchor for r in alive], start))
            )
        if not all(bool(torch.isfinite(a).all()) for a in syncs[alive[0]].anchor):
            diverged_at = step + 1
            break
        if step % 100 == 0 or step == t.total_steps - 1:
            log.info(
                "%s step %4d train bpb %.4f (mean over replicas)",
                name,
                step,
                sum(losses) / len(losses) / math.log(2),
            )
    if diverged_at is not None:
        log.warning("%s: weights or loss no longer finite after step %d; stopped", name, diverged_at)
    for sy in syncs:
        sy.finish()  # streaming: apply the fragments captured in the last tau steps
    for b in balancers:
        b.close()
    train_s = time.perf_counter() - t0
    live = [r for r in range(s.replicas) if kill is None or r != kill[0]]
    anchors = [syncs[r].anchor for r in live]
    butterfly = sync.topology == "butterfly"
    for a in [] if butterfly else anchors[1:]:  # butterfly: no consensus, each replica its own anchor
        if not all(torch.equal(x, y) for x, y in zip(anchors[0], a, strict=True)):
            raise AssertionError(f"{name}: replicas ended with different consensus weights")

    def bpb_of(weights: list[torch.Tensor]) -> float:
        model, _ = new_model(s, spec=spec.model)
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights, strict=True):
                p.copy_(w)
            for (_, b), (_, ours) in zip(model.named_buffers(), replicas[0][0].named_buffers(), strict=True):
                b.copy_(ours)  # MoE: the expert bias, one on every replica (checked below)
        return evaluate(model, val) if diverged_at is None else math.nan

    biases = {bias_digest(m) for r, (m, _) in enumerate(replicas) if r in live}
    if len(biases) != 1:
        raise AssertionError(f"{name}: replicas ended with different expert biases")

    st = [syncs[r].stats for r in live]
    # butterfly: a sit-out applies nothing, so count the rounds the schedule ran
    rounds = t.total_steps // sync.H if butterfly else st[0].rounds_applied / sync.P
    extra: dict[str, Any] = {}
    if butterfly:
        extra["replica_bpb"] = [bpb_of(a) for a in anchors]
        extra["mean_bpb"] = bpb_of([sum(ws) / len(ws) for ws in zip(*anchors, strict=True)])
        extra["spread"] = anchor_spread(anchors, start)
        extra["spread_history"] = [(r, round(x, 4)) for r, x in spread_history]
        counts = [syncs[r].pairs.stats for r in live if syncs[r].pairs is not None]  # type: ignore[union-attr]
        extra["pair_counts"] = {k: sum(getattr(c, k) for c in counts) for k in PAIR_OUTCOMES}
    return Result(
        name,
        bpb_of(anchors[0]),
        train_s,
        sync=sync,
        bytes_up_per_round=sum(x.bytes_up for x in st) / len(st) / max(rounds, 1),
        bytes_down_per_round=sum(x.bytes_down for x in st) / len(st) / max(rounds, 1),
        **extra,
        wait_s=sum(x.wait_s for x in st),
        rounds=int(rounds),
        rejected=sum(x.rejected for x in st),
        missing=sum(x.missing for x in st),
        late_committed=st[0].late_committed,
        round_tokens=dict(st[0].last_tokens),
        diverged_at=diverged_at,
        load_ratio=dict(balancers[0].load_ratio) if balancers else {},
    )


def moe_balancers(
    spec: RunSpec, models: list[Stage], store: ObjectStore, ids: list[Identity]
) -> list[Balancer]:
    """An MoE arm's expert bias per replica, each moved by the agreed counts of the step's barrier through
    the store, as a stage worker's (node/sync/expert_bias.py); [] for a dense model."""
    moe = spec.model.moe
    if not moe.experts:
        return []
    peers = {r: ids[r].peer_id for r in range(len(models))}
    return [
        Balancer(
            m,
            {0: RouteExchange(store, ids[r], spec, group=0, replica=r, signers=peers, poll_s=0.002)},
            rate=moe.bias_rate,
            delay=moe.stats_delay,
        )
        for r, m in enumerate(models)
    ]


def anchor_spread(anchors: list[list[torch.Tensor]], start: list[torch.Tensor]) -> float:
    """max_r ||A_r - mean A|| / ||mean A - A_0||: how far apart the replicas' anchors are, against how far
    their mean has moved from the start (0 for a consensus)."""
    flat = [torch.cat([t.detach().double().flatten() for t in a]) for a in anchors]
    mean = sum(flat) / len(flat)
    moved = float((mean - torch.cat([t.double().flatten() for t in start])).norm())
    return max(float((f - mean).norm()) for f in flat) / max(moved, 1e-30)


def parse_rounds(text: str) -> tuple[int, int]:
    """ "3-8" -> (3, 8); "5" -> (5, 5); 1-based, inclusive."""
    a, _, b = text.partition("-")
    try:
        first, last = int(a), int(b or a)
    except ValueError:
        raise ValueError(f"rounds {text!r} must be FIRST-LAST or N (example: 3-8)") from None
    if not 1 <= first <= last:
        raise ValueError(f"rounds {text!r} need 1 <= FIRST <= LAST (example: 3-8)")
    return first, last


STREAM_TAU = {"stream_tau1": 1, "stream_tau2": 2}
"""The streaming arms and their overlap tau (inner steps between a fragment's capture and its application)."""
AUTO_P_MAX = 5
"""Without --P a streaming arm takes the most fragments, up to this many, that its tau allows."""


def stream_P(H: int, tau: int) -> int:
    """The most fragments (at most AUTO_P_MAX) the spec accepts with this tau: tau < floor(H / P) holds
    exactly when P <= H / (tau + 1). At least 1, so an H too short for tau is refused by the spec itself."""
    return max(1, min(AUTO_P_MAX, H // (tau + 1)))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="CI-sized: 2 replicas, 120 steps, H=10")
    ap.add_argument(
        "--check",
        action="store_true",
        help="build every selected arm's settings and run spec, print one JSON line, train nothing",
    )
    ap.add_argument(
        "--arms",
        default=",".join(
            a for a in ARMS if a not in LATE_ARMS and a not in MIXED_ARMS and a not in NEWER_ARMS
        ),
        help=f"comma-separated subset of {','.join(ARMS)} (default: all but the late, mixed, butterfly, muon and stochastic arms)",
    )
    ap.add_argument("--replicas", type=int, default=4, help="R simulated replicas (default 4)")
    ap.add_argument("--steps", type=int, default=1000, help="inner steps per replica (default 1000)")
    ap.add_argument("--H", type=int, default=5, help="inner steps per outer round (default 5)")
    ap.add_argument(
        "--P",
        type=int,
        default=None,
        help=f"fragments of the streaming arms (default: the most, up to {AUTO_P_MAX}, that the arm's tau "
        "allows: floor(H / (tau + 1)))",
    )
    ap.add_argument("--alpha", type=float, default=1.0, help="SparseLoCo outer lr (default 1.0)")
    ap.add_argument("--k", type=int, default=64, help="SparseLoCo top-k per 4096-chunk (default 64)")
    ap.add_argument(
        "--beta", type=float, default=0.7, help="SparseLoCo error-feedback decay (default 0.7, tuned here)"
    )
    ap.add_argument("--aggregation", choices=["mean", "per_coordinate"], default="per_coordinate")
    ap.add_argument(
        "--pair-blend",
        choices=["outer", "half"],
        default=SyncSpec.pair_blend,
        help=f"the butterfly arm's sync.pair_blend (default {SyncSpec.pair_blend})",
    )
    ap.add_argument(
        "--muon-lr", type=float, default=TrainSpec.muon_lr, help="the muon arm's train.muon_lr (its peak)"
    )
    ap.add_argument(
        "--moe-experts", type=int, default=8, help="the MoE arms' experts per block (top-2, default 8)"
    )
    ap.add_argument("--butterfly-alpha", type=float, help="the butterfly arm's outer lr (default: --alpha)")
    ap.add_argument("--butterfly-k", type=int, help="the butterfly arm's top-k per chunk (default: --k)")
    ap.add_argument(
        "--pair-clip", type=float, default=SyncSpec.pair_clip, help="the butterfly arm's sync.pair_clip (rho)"
    )
    ap.add_argument(
        "--pair-agreement",
        type=float,
        default=SyncSpec.pair_agreement,
        help="the butterfly arm's sync.pair_agreement (gamma; -1: off)",
    )
    ap.add_argument(
        "--robust",
        choices=["trimmed", "clip_median", "none"],
        default=SyncSpec.robust,
        help=f"bound on one replica's influence, sync.robust (default {SyncSpec.robust})",
    )
    ap.add_argument("--clip-median-norm", action="store_true", help="the same as --robust clip_median")
    ap.add_argument(
        "--max-norm-ratio", type=float, default=SyncSpec.max_norm_ratio, help="sync.max_norm_ratio"
    )
    ap.add_argument("--max-abs-ratio", type=float, default=SyncSpec.max_abs_ratio, help="sync.max_abs_ratio")
    ap.add_argument("--trim", type=float, default=SyncSpec.trim, help="sync.trim")
    ap.add_argument("--min-agreement", type=float, default=SyncSpec.min_agreement, help="sync.min_agreement")
    ap.add_argument(
        "--late-method",
        choices=("sparseloco", "diloco"),
        default="sparseloco",
        help="the outer method of the late arms (diloco: dense, no error feedback, so a dropped fragment "
        "is lost)",
    )
    ap.add_argument(
        "--late-window-s",
        type=float,
        default=1.0,
        help="W (sync.timeout_s) of the late arms; their late fragments arrive W + 2.5 s into the round",
    )
    ap.add_argument(
        "--kill-replica",
        type=int,
        help="this replica stops for good after --kill-round rounds (a node killed mid-run; its slot stays "
        "assigned, so its partners' exchanges with it are skipped and counted)",
    )
    ap.add_argument(
        "--kill-round", type=int, default=10, help="rounds before --kill-replica stops (default 10)"
    )
    ap.add_argument(
        "--timeout-s", type=float, help="W (sync.timeout_s) of the non-late arms (default: the spec's, 60 s)"
    )
    ap.add_argument("--attack", choices=ATTACKS, help="one replica uploads forged fragments (see above)")
    ap.add_argument("--attack-replica", type=int, help="the hostile replica (default the last)")
    ap.add_argument("--attack-rounds", default="3-8", help="1-based outer rounds of the attack (default 3-8)")
    ap.add_argument("--diloco-alpha", type=float, default=1.0, help="DiLoCo outer lr (default 1.0, tuned)")
    ap.add_argument(
        "--diloco-momentum", type=float, default=0.0, help="DiLoCo Nesterov momentum (default 0, tuned)"
    )
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per replica per step (default 8)")
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak lr (default 3e-3)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-batches", type=int, default=64, help="validation batches of --batch sequences")
    ap.add_argument("--data-seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def robust_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The aggregation bound of every outer arm (`SyncSpec.robust` and its ratios)."""
    return {
        "robust": "clip_median" if args.clip_median_norm else args.robust,
        "max_norm_ratio": args.max_norm_ratio,
        "max_abs_ratio": args.max_abs_ratio,
        "min_agreement": args.min_agreement,
        "trim": args.trim,
    }


def arm_sync(name: str, args: argparse.Namespace) -> SyncSpec:
    """The sync settings of outer arm `name`; the spec's ValueError when it refuses them."""
    late: dict[str, Any] = (
        {"timeout_s": args.late_window_s, "max_late_rounds": LATE_ARMS[name]} if name in LATE_ARMS else {}
    )
    if name in MIXED_ARMS:
        late["weighting"] = MIXED_ARMS[name]
    alpha, k = args.alpha, args.k
    if args.timeout_s is not None and name not in LATE_ARMS:
        late["timeout_s"] = args.timeout_s
    if name == "stochastic":
        late["stochastic_rounding"] = True
    if name == "butterfly":
        late.update(
            topology="butterfly",
            max_late_rounds=0,
            pair_blend=args.pair_blend,
            pair_clip=args.pair_clip,
            pair_agreement=args.pair_agreement,
        )
        alpha = args.alpha if args.butterfly_alpha is None else args.butterfly_alpha
        k = args.k if args.butterfly_k is None else args.butterfly_k
    if name == "diloco" or (name in LATE_ARMS and args.late_method == "diloco"):
        return SyncSpec(
            method="diloco",
            H=args.H,
            alpha=args.diloco_alpha,
            outer_momentum=args.diloco_momentum,
            aggregation="mean",
            **late,
            **robust_settings(args),
        )
    tau = STREAM_TAU.get(name, 0)
    P = (
        1
        if name in ("sparseloco", "butterfly", "muon", "stochastic", "moe")
        or name in LATE_ARMS
        or name in MIXED_ARMS
        else stream_P(args.H, tau)
        if args.P is None
        else args.P
    )
    return SyncSpec(
        method="sparseloco",
        H=args.H,
        P=P,
        tau=tau,
        alpha=alpha,
        k=k,
        beta=args.beta,
        aggregation=args.aggregation,
        **late,
        **robust_settings(args),
    )


def refusal_hint(name: str, args: argparse.Namespace) -> str:
    """What to change when the spec refuses a streaming arm's H, P and tau."""
    if name not in STREAM_TAU:
        return ""
    tau = STREAM_TAU[name]
    if args.H <= tau:
        return f" (tau={tau} needs --H {tau + 1} or more)"
    if args.P is not None:
        return f" (use --P {stream_P(args.H, tau)} or fewer with --H {args.H}, or leave --P out)"
    return ""


@dataclass(kw_only=True, frozen=True)
class Plan:
    """A run as its flags describe it, validated before anything trains: the selected arms only."""

    args: argparse.Namespace
    arms: list[str]
    setup: Setup
    syncs: dict[str, SyncSpec]
    """Sync settings of every selected outer arm (adamw has none)."""
    attack: Attack | None
    kill: tuple[int, int] | None = None
    """(replica, rounds): --kill-replica stops after --kill-round rounds."""


def plan(argv: list[str] | None = None) -> Plan:
    """Parse the flags and build every selected arm's settings and run spec (what a real run builds
    before it trains); a refused setting exits with the reason, as argparse errors do."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.replicas, args.steps, args.H, args.P, args.eval_batches, args.warmup = 2, 120, 10, 2, 16, 10
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown or not arms:
        ap.error(f"--arms: unknown arm(s) {sorted(unknown)}; choose from {','.join(ARMS)}")
    attack = None
    if args.attack:
        try:
            first, last = parse_rounds(args.attack_rounds)
        except ValueError as e:
            ap.error(f"--attack-rounds: {e}")
        who = args.replicas - 1 if args.attack_replica is None else args.attack_replica
        if not 0 <= who < args.replicas:
            ap.error(f"--attack-replica {who} must be in 0..{args.replicas - 1}")
        attack = Attack(kind=args.attack, replica=who, first=first, last=last)
        if attack.kind in COLLUDING and "butterfly" in arms:
            ap.error(f"--attack {attack.kind} is aimed at a round's honest mean; a butterfly pair has none")
        if set(DATA_PARALLEL_ARMS) & set(arms) or "diloco" in arms:
            ap.error("--attack forges SparseLoCo fragments: use SparseLoCo arms only (--arms sparseloco)")
    try:
        model = bench_model(args)
    except ValueError as e:
        ap.error(f"--d-model/--n-layers/--seq-len: {e}")
    try:
        train = TrainSpec(
            total_steps=args.steps,
            batch_size=args.batch,
            microbatches=1,
            lr=args.lr,
            warmup_steps=args.warmup,
            weight_decay=0.0,
            grad_clip=args.grad_clip,
            data_seed=args.data_seed,
            muon_lr=args.muon_lr,
        )
    except ValueError as e:
        ap.error(f"--steps/--batch: {e}")
    s = Setup(model=model, replicas=args.replicas, train=train, moe_experts=args.moe_experts)
    syncs: dict[str, SyncSpec] = {}
    for name in arms:
        if name in DATA_PARALLEL_ARMS:
            continue
        try:
            syncs[name] = arm_sync(name, args)
            arm_spec(name, syncs[name], s)  # the run spec's own checks, as run_outer builds it
        except ValueError as e:
            ap.error(f"--arms {name}: {e}{refusal_hint(name, args)}")
    kill = None
    if args.kill_replica is not None:
        if not 0 < args.kill_replica < args.replicas:  # replica 0's anchor is the arm's figure
            ap.error(f"--kill-replica {args.kill_replica} must be in 1..{args.replicas - 1}")
        if not 0 < args.kill_round < args.steps // args.H:
            ap.error(
                f"--kill-round {args.kill_round} must be in 1..{args.steps // args.H - 1} (the run's rounds)"
            )
        kill = (args.kill_replica, args.kill_round)
    return Plan(args=args, arms=arms, setup=s, syncs=syncs, attack=attack, kill=kill)


def check(p: Plan) -> dict[str, Any]:
    """--check: every selected arm built as run_outer builds it (run spec, codec, aggregation), no data,
    no store, no training; what was built, as one JSON-ready dict."""
    if importlib.util.find_spec("moto") is None:
        raise SystemExit("bench_quality needs moto for its in-process S3 server: pip install -e '.[swarm]'")
    ident = Identity.from_seed(bytes([1]) * 32)
    arms: dict[str, dict[str, Any]] = {}
    for name in p.arms:
        if name in DATA_PARALLEL_ARMS:
            arms[name] = {"method": "adamw"}
            continue
        spec = arm_spec(name, p.syncs[name], p.setup)
        parts = make_sync_parts(spec, ident)
        sy = spec.sync
        arms[name] = {
            "method": sy.method,
            "H": sy.H,
            "P": sy.P,
            "tau": sy.tau,
            "codec": type(parts.codec).__name__,
        }
    return {
        "check": "ok",
        "bench": "sparseloco_quality",
        "arms": arms,
        "replicas": p.setup.replicas,
        "steps": p.setup.train.total_steps,
        "params": p.setup.model.n_params,
        "attack": None if p.attack is None else p.attack.kind,
    }


def main(argv: list[str] | None = None) -> int:
    p = plan(argv)
    if p.args.check:
        print(json.dumps(check(p)))
        return 0
    args, arms, s, syncs, attack = p.args, p.arms, p.setup, p.syncs, p.attack
    model, train = s.model, s.train
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    log = logging.getLogger("bench_quality")
    log.setLevel(logging.INFO)

    corpus = Corpus.load("stdlib", 0.02)
    val = corpus.val_batches(args.eval_batches, args.batch, model.seq_len)
    streams = {n: sy for n, sy in syncs.items() if sy.P > 1 or sy.tau > 0}
    print(
        f"# R={s.replicas} steps={train.total_steps} H={args.H} d={model.d_model} "
        f"layers={model.n_layers} seq={model.seq_len} batch={train.batch_size}/replica "
        f"params={model.n_params:,} lr={train.lr} "
        f"eval tokens={args.eval_batches * args.batch * model.seq_len:,}"
        + "".join(f" {n}: P={sy.P} tau={sy.tau}" for n, sy in streams.items()),
        file=sys.stderr,
        flush=True,
    )

    with embedded_store("bench-quality") as store:
        t_all = time.perf_counter()
        results: list[Result] = []
        for name in arms:
            r = (
                run_adamw(s, corpus, val, log, name)
                if name in DATA_PARALLEL_ARMS
                else run_outer(name, syncs[name], s, corpus, val, store, log, attack, p.kill)
            )
            log.info("%s: val bpb %.4f (%.0f s)", name, r.val_bpb, r.train_s)
            results.append(r)
    total_s = time.perf_counter() - t_all

    by = {r.name: r for r in results}
    base = by.get("adamw")
    ref = by.get("sparseloco")
    dense_bytes = 4 * model.n_params
    print(
        f"\n{'arm':<13}{'H':>4}{'P':>3}{'tau':>4}{'alpha':>6}{'val bpb':>9}{'vs adamw':>10}{'vs sparse':>10}"
        f"{'B up/round':>12}{'ratio':>8}{'wait s':>8}{'train s':>9}",
        file=sys.stderr,
    )
    for r in results:
        sy = r.sync
        cols = f"{sy.H:>4}{sy.P:>3}{sy.tau:>4}{sy.alpha:>6.2f}" if sy else f"{'-':>4}{'-':>3}{'-':>4}{'-':>6}"
        vs_a = f"{(r.val_bpb / base.val_bpb - 1) * 100:+.2f}%" if base else "-"
        vs_s = (
            f"{(r.val_bpb / ref.val_bpb - 1) * 100:+.2f}%"
            if ref and sy and sy.method == "sparseloco"
            else "-"
        )
        up = f"{r.bytes_up_per_round:,.0f}" if sy else "-"
        rat = f"{dense_bytes / r.bytes_up_per_round:.1f}x" if sy and r.bytes_up_per_round else "-"
        print(
            f"{r.name:<13}{cols}{r.val_bpb:>9.4f}{vs_a:>10}{vs_s:>10}{up:>12}{rat:>8}{r.wait_s:>8.1f}{r.train_s:>9.1f}",
            file=sys.stderr,
        )
    print(f"total {total_s:.0f} s", file=sys.stderr)

    def gap(a: str, b: str) -> float | None:
        return round(by[a].val_bpb / by[b].val_bpb - 1, 5) if a in by and b in by else None

    robust = robust_settings(args)["robust"]
    out = {
        "bench": "sparseloco_quality",
        "replicas": s.replicas,
        "steps": train.total_steps,
        "H": args.H,
        "P": args.P,
        "streaming": {n: {"P": sy.P, "tau": sy.tau} for n, sy in streams.items()},
        "alpha": args.alpha,
        "k": args.k,
        "beta": args.beta,
        "aggregation": args.aggregation,
        "robust": robust,
        "attack": None
        if attack is None
        else {"kind": attack.kind, "replica": attack.replica, "rounds": [attack.first, attack.last]},
        "butterfly_k": args.butterfly_k,
        "butterfly_alpha": args.butterfly_alpha,
        "pair_blend": args.pair_blend,
        "pair_clip": args.pair_clip,
        "pair_agreement": args.pair_agreement,
        "muon_lr": args.muon_lr,
        "kill": None if p.kill is None else {"replica": p.kill[0], "after_rounds": p.kill[1]},
        "timeout_s": args.timeout_s,
        "diloco_alpha": args.diloco_alpha,
        "diloco_momentum": args.diloco_momentum,
        "lr": train.lr,
        "d_model": model.d_model,
        "n_layers": model.n_layers,
        "seq_len": model.seq_len,
        "batch": train.batch_size,
        "params": model.n_params,
        "val_bpb": {r.name: round(r.val_bpb, 5) if math.isfinite(r.val_bpb) else None for r in results},
        "diverged_at": {r.name: r.diverged_at for r in results if r.diverged_at is not None},
        "gap_sparseloco_vs_adamw": gap("sparseloco", "adamw"),
        "gap_diloco_vs_adamw": gap("diloco", "adamw"),
        "gap_tau1_vs_sparseloco": gap("stream_tau1", "sparseloco"),
        "gap_tau2_vs_sparseloco": gap("stream_tau2", "sparseloco"),
        "gap_late_commit_vs_sparseloco": gap("late_commit", "sparseloco"),
        "gap_late_drop_vs_sparseloco": gap("late_drop", "sparseloco"),
        "gap_mixed_tokens_vs_sparseloco": gap("mixed_tokens", "sparseloco"),
        "gap_mixed_equal_vs_sparseloco": gap("mixed_equal", "sparseloco"),
        "late_committed": {r.name: r.late_committed for r in results if r.name in LATE_ARMS},
        "round_tokens": {r.name: r.round_tokens for r in results if r.name in MIXED_ARMS},
        "sparseloco_beats_diloco": (by["sparseloco"].val_bpb < by["diloco"].val_bpb)
        if "sparseloco" in by and "diloco" in by
        else None,
        "bytes_up_per_round": {r.name: round(r.bytes_up_per_round) for r in results if r.sync},
        "bytes_down_per_round": {r.name: round(r.bytes_down_per_round) for r in results if r.sync},
        "gap_butterfly_vs_sparseloco": gap("butterfly", "sparseloco"),
        "gap_muon_vs_sparseloco": gap("muon", "sparseloco"),
        "gap_stochastic_vs_sparseloco": gap("stochastic", "sparseloco"),
        "gap_moe_vs_moe_adamw": gap("moe", "moe_adamw"),
        "gap_moe_vs_sparseloco": gap("moe", "sparseloco"),
        "gap_moe_adamw_vs_adamw": gap("moe_adamw", "adamw"),
        "moe": None
        if not {"moe", "moe_adamw"} & set(by)
        else {
            "experts": s.moe_experts,
            "top_k": 2,
            "params": s.model_of("moe").n_params,
            "active_params": s.model_of("moe").n_active_params,
            "dense_params": model.n_params,
            "load_ratio": {r.name: r.load_ratio for r in results if r.load_ratio},
        },
        "butterfly_val_bpb": [round(x, 5) for x in by["butterfly"].replica_bpb]
        if "butterfly" in by
        else None,
        "butterfly_mean_val_bpb": None if "butterfly" not in by else by["butterfly"].mean_bpb,
        "butterfly_spread": None if "butterfly" not in by else by["butterfly"].spread,
        "butterfly_spread_history": None if "butterfly" not in by else by["butterfly"].spread_history,
        "butterfly_pairs": by["butterfly"].pair_counts if "butterfly" in by else None,
        "rejected": sum(r.rejected for r in results),
        "missing": sum(r.missing for r in results),
        "total_s": round(total_s, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

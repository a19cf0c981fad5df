"""The run spec: everything every participant of a run must agree on before the first microbatch.

Loaded from the operator's `run.toml` (sections [run], [model], [train], [sync], [pipeline]); signed by
the coordinator and published at `{run}/spec` in the store and in the DHT.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from protocol.corpus import ManifestError, check_sha256, is_store_url, parse_store_url
from protocol.schema import SchemaError, check_finite, check_range, describe, from_dict
from protocol.sync_settings import AggregationSettings, CodecSettings, Schedule, check_schedule

RUN_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
"""What a run id may be (matched whole with `fullmatch`: no trailing newline): a store prefix and DHT name."""
MAX_SEED = 2**63 - 1
"""Seeds are fed to torch and numpy generators, which take 64-bit values."""
MAX_STEPS = 2**40
"""More inner steps than any run will take (a trillion), far below where counters overflow."""
MAX_LATE_ROUNDS = 8
MAX_ROUND_TOKENS = 1 << 48
"""Tokens one fragment may claim (protocol/codecs/sparseloco_format.py MAX_TOKENS): a round must fit."""
"""The most rounds late a fragment may be committed: each round keeps that many earlier rounds' cutoffs."""


def check_run_id(where: str, run_id: str) -> None:
    """Raise ValueError unless `run_id` is 1-63 lowercase letters, digits or dashes (whole string)."""
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ValueError(
            f"{where}={describe(run_id)} must be 1-63 lowercase letters, digits or dashes, starting with a "
            "letter or digit (example: tiny-llama-1)"
        )


_MODEL_BOUNDS = {
    "vocab": 1 << 24,
    "d_model": 1 << 17,
    "n_layers": 1 << 12,
    "n_heads": 1 << 12,
    "d_ff": 1 << 20,
    "seq_len": 1 << 20,
}
"""Upper bounds of the model's sizes: well beyond any model one swarm trains, small enough that the sizes
cannot overflow an allocation computed from them."""


MAX_EXPERTS = 1 << 12
"""Routed experts per MoE block: 256 in DeepSeek-V3's and the seed's models, far above that here."""
MAX_STATS_DELAY = 64
"""The most inner steps the routing statistics of a step may wait before the bias update that uses them."""


@dataclass(kw_only=True, frozen=True)
class MoESpec:
    """Mixture-of-experts blocks ([model.moe]; issue 24): a router picks `top_k` of `experts` SwiGLU experts
    per token in every block from `first_dense` on, as DeepSeek-V3 and GLM-4.5 lay them out (sigmoid
    scores; an expert bias, used only to choose, balances the load without an auxiliary loss). The bias
    moves after each inner step by `bias_rate` x sign(mean load - expert load), from the token counts of
    every replica (node/sync/expert_bias.py), so it is one state across the run. experts = 0: dense blocks only."""

    experts: int = 0
    """Routed experts per MoE block (0: no MoE; every block is the dense SwiGLU of model.d_ff)."""
    top_k: int = 2
    """Experts each token is routed to."""
    d_ff: int = 0
    """Each expert's SwiGLU width (0: model.d_ff)."""
    first_dense: int = 0
    """Blocks before this one keep the dense SwiGLU (HF's first_k_dense_replace); 0: every block is MoE."""
    shared_experts: int = 0
    """Experts every token goes through as well, as one SwiGLU of shared_experts x d_ff (0: none)."""
    bias_rate: float = 1e-3
    """gamma: how far one step moves an expert's bias (DeepSeek-V3's aux-loss-free balancing)."""
    stats_delay: int = 1
    """D: the bias used at step t + 1 moves by the agreed routing counts of step t + 1 - D (node/sync/expert_bias.py):
    with D = 1 each step waits for every replica's counts of the step before (a per-step barrier); a
    larger D lets replicas run up to D - 1 steps apart without waiting."""
    stats_timeout_s: float = 2.0
    """W of the per-step agreed set (node/sync/route_exchange.py): a step's counts count if stamped by the
    store within W seconds of the quorum's; a replica missing for a step costs the others W + 2 s."""

    def __post_init__(self) -> None:
        check_finite(self)
        check_range("model.moe.experts", self.experts, 0, MAX_EXPERTS)
        check_range("model.moe.d_ff", self.d_ff, 0, _MODEL_BOUNDS["d_ff"])
        check_range("model.moe.shared_experts", self.shared_experts, 0, 64)
        check_range("model.moe.first_dense", self.first_dense, 0, _MODEL_BOUNDS["n_layers"])
        check_range("model.moe.bias_rate", self.bias_rate, 0.0, 1.0)
        check_range("model.moe.stats_delay", self.stats_delay, 1, MAX_STATS_DELAY)
        check_range("model.moe.stats_timeout_s", self.stats_timeout_s, 0.0, 1e4)
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"model.moe.top_k={self.top_k} must be in 1..experts={self.experts} (example: top_k = 2)"
            )


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU); byte-level vocabulary by default; MoE blocks with
    [model.moe]."""

    vocab: int = 256
    """Vocabulary size: 256 = raw bytes (loss in bits per token is bits per byte); with train.tokenizer,
    the tokenizer's vocabulary size (validation still reports bits per byte: nats / (ln 2 x bytes))."""
    d_model: int = 256
    """Residual width d."""
    n_layers: int = 4
    """Transformer blocks, split into contiguous stage ranges."""
    n_heads: int = 4
    """Attention heads; d_model must be divisible by it."""
    d_ff: int = 688
    """SwiGLU hidden width (about 8/3 d, rounded)."""
    seq_len: int = 256
    """Tokens per sequence L."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    init_seed: int = 0
    """Seed of the initial weights; every replica starts from the same ones."""
    moe: MoESpec = field(default_factory=MoESpec)
    """Mixture-of-experts blocks ([model.moe]); none by default."""

    def __post_init__(self) -> None:
        check_finite(self)
        for name, hi in _MODEL_BOUNDS.items():
            check_range(f"model.{name}", getattr(self, name), 1, hi)
        check_range("model.rope_theta", self.rope_theta, 1e-6, 1e12)
        check_range("model.init_seed", self.init_seed, 0, MAX_SEED)
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"model.d_model={self.d_model} must split into n_heads={self.n_heads} heads of even width (RoPE)"
            )
        if self.moe.experts and self.moe.first_dense >= self.n_layers:
            raise ValueError(
                f"model.moe.first_dense={self.moe.first_dense} leaves none of the {self.n_layers} blocks MoE "
                f"(blocks first_dense..n_layers-1 are; example: first_dense = 0)"
            )

    @property
    def expert_d_ff(self) -> int:
        """Each routed expert's SwiGLU width."""
        return self.moe.d_ff or self.d_ff

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes its tokens to experts."""
        return self.moe.experts > 0 and layer >= self.moe.first_dense

    def residual_writers(self, layer: int) -> list[str]:
        """Names of block `layer`'s weights that write the residual stream (attention's wo, the MLP's
        w_down: every expert's and the shared one's in an MoE block), which a subspace link confines; the
        node builds them under these names (node/model.py) and export reads them by them."""
        head = f"layers.{layer}"
        if not self.is_moe_layer(layer):
            return [f"{head}.attn.wo.weight", f"{head}.mlp.w_down.weight"]
        experts = [f"{head}.mlp.experts.{e}.w_down.weight" for e in range(self.moe.experts)]
        shared = [f"{head}.mlp.shared.w_down.weight"] if self.moe.shared_experts else []
        return [f"{head}.attn.wo.weight", *experts, *shared]

    @property
    def moe_layers(self) -> list[int]:
        """The MoE blocks, in order."""
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def mlp_matrix_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of block `layer`'s feed-forward matrices: the dense SwiGLU (3 d d_ff), or the router
        (E d), the routed experts (E x 3 d f_e; active: only the top_k a token goes through) and the shared
        SwiGLU (3 d x shared x f_e)."""
        d = self.d_model
        if not self.is_moe_layer(layer):
            return 3 * d * self.d_ff
        m, f = self.moe, self.expert_d_ff
        routed = (m.top_k if active else m.experts) * 3 * d * f
        return m.experts * d + routed + 3 * d * m.shared_experts * f

    def layer_params(self, layer: int, *, active: bool = False) -> int:
        """Parameters of block `layer`: attention (4 d^2), its feed-forward matrices, two RMSNorm gains;
        active: those one token's forward pass multiplies by (an MoE block's top_k experts of E)."""
        d = self.d_model
        return 4 * d * d + self.mlp_matrix_params(layer, active=active) + 2 * d

    @property
    def n_params(self) -> int:
        """Every parameter: blocks, the embedding and head (V d each) and the final norm (d)."""
        d = self.d_model
        return sum(self.layer_params(i) for i in range(self.n_layers)) + 2 * self.vocab * d + d

    @property
    def n_active_params(self) -> int:
        """The parameters one token's forward pass goes through (n_params for a dense model): what its
        FLOPs per token count (6 N_active + attention) and MFU is measured on."""
        d = self.d_model
        return sum(self.layer_params(i, active=True) for i in range(self.n_layers)) + 2 * self.vocab * d + d


@dataclass(kw_only=True, frozen=True)
class TrainSpec:
    """Inner optimisation and data, identical on every stage worker."""

    total_steps: int = 300
    """Inner optimizer steps per replica for the whole run."""
    batch_size: int = 8
    """Sequences per replica per inner step (split into microbatches)."""
    microbatches: int = 4
    """Microbatches per step M; batch_size must be divisible by it."""
    lr: float = 3e-3
    """Inner AdamW peak learning rate."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """Inner optimizer: "adamw"; "muon" = torch.optim.Muon (Newton-Schulz orthogonalized momentum) for
    the blocks' 2-D matrices (attention and MLP weights), AdamW at `lr` for the embedding, head and norms."""
    muon_lr: float = 0.02
    """Muon's peak learning rate (the same warm-up and cosine decay as `lr`); torch's Muon scales it by
    sqrt(max(1, rows / cols)) per matrix."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    warmup_steps: int = 30
    """Linear warm-up steps of the inner learning rate."""
    weight_decay: float = 0.0
    """Inner AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip each stage's gradient norm to this (0 disables)."""
    data: str = "stdlib"
    """Corpus: "stdlib" (the Python standard library's source); a text file, a folder (every readable text
    file under it) or a glob, a relative one under each node's `--data-root`; or `s3://bucket/prefix`,
    shards in the object store listed by the manifest at `prefix/crucible-manifest.jsonl`
    (protocol/corpus.py), streamed to the node's disk and checked shard by shard."""
    data_sha256: str = ""
    """The corpus's content hash (protocol/corpus.py: sha256 of its manifest of names, sizes and sha256s);
    a first stage whose corpus hashes otherwise refuses the assignment, naming both hashes. Empty = not
    checked (each node trains on what it finds). `crucible-swarm` fills it in."""
    tokenizer: str = ""
    """A `tokenizers` tokenizer.json (a path, a relative one under each node's `--data-root`, or
    `s3://bucket/key`); model.vocab must equal its vocabulary size. Empty = bytes (vocabulary 256)."""
    tokenizer_sha256: str = ""
    """sha256 of the tokenizer.json's bytes; a node whose file differs refuses. Empty = not checked."""
    data_seed: int = 1234
    """Seed of batch sampling; each replica draws its own stream from it."""
    val_fraction: float = 0.02
    """Held-out tail of the corpus for validation bits-per-byte."""
    eval_batches: int = 4
    """Validation batches of batch_size sequences per evaluation."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Inner-step arithmetic, resolved by each node: "bf16" = bf16 autocast over fp32 master weights and
    fp32 AdamW state; "fp32" = plain float32; "auto" = bf16 on a CUDA device, fp32 on a CPU. The outer
    sync (anchor, error feedback, aggregation) is fp32/float64 whatever this says."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.total_steps <= 0 or self.batch_size <= 0 or self.microbatches <= 0:
            raise ValueError("train.total_steps, batch_size and microbatches must be positive")
        check_range("train.total_steps", self.total_steps, 1, MAX_STEPS)
        check_range("train.batch_size", self.batch_size, 1, 1 << 20)
        check_range("train.lr", self.lr, 1e-12, 1e3)
        check_range("train.warmup_steps", self.warmup_steps, 0, MAX_STEPS)
        check_range("train.weight_decay", self.weight_decay, 0, 1e3)
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"train.optimizer={describe(self.optimizer)} must be 'adamw' or 'muon'")
        check_range("train.muon_lr", self.muon_lr, 1e-12, 1e3)
        check_range("train.muon_momentum", self.muon_momentum, 0.0, 0.9999)
        check_range("train.grad_clip", self.grad_clip, 0, None)
        check_range("train.data_seed", self.data_seed, 0, MAX_SEED)
        check_range("train.eval_batches", self.eval_batches, 0, 1 << 20)
        if not 1 <= len(self.data) <= 4096:
            raise ValueError(
                f'train.data={describe(self.data)} must be 1-4096 characters ("stdlib" or a path)'
            )
        if len(self.tokenizer) > 4096:
            raise ValueError(f"train.tokenizer={describe(self.tokenizer)} must be at most 4096 characters")
        for where, url in (("train.data", self.data), ("train.tokenizer", self.tokenizer)):
            if is_store_url(url):
                try:
                    parse_store_url(url)
                except ManifestError as e:
                    raise ValueError(f"{where}: {e}") from None
        check_sha256("train.data_sha256", self.data_sha256, empty_ok=True)
        check_sha256("train.tokenizer_sha256", self.tokenizer_sha256, empty_ok=True)
        if self.tokenizer_sha256 and not self.tokenizer:
            raise ValueError(
                "train.tokenizer_sha256 is set but train.tokenizer is empty: name the tokenizer.json"
            )
        if self.batch_size % self.microbatches:
            raise ValueError(
                f"train.batch_size={self.batch_size} must be divisible by microbatches={self.microbatches}"
            )
        if not 0 < self.val_fraction < 0.5:
            raise ValueError(f"train.val_fraction must be in (0, 0.5), got {describe(self.val_fraction)}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"train.precision={describe(self.precision)} must be 'auto', 'fp32' or 'bf16'")


@dataclass(kw_only=True, frozen=True)
class OuterLoopSettings:
    """The outer loop's own part of [sync]: the method, its schedule, its step, checkpoints and deadline."""

    method: Literal["diloco", "sparseloco"] = "sparseloco"
    """Outer method: dense DiLoCo or SparseLoCo (compressed, error feedback)."""
    H: int = 30
    """Inner steps per outer round."""
    alpha: float = 1.0
    """Outer learning rate."""
    outer_momentum: float = 0.0
    """Nesterov momentum of the outer step (the DiLoCo paper uses 0.9 with alpha 0.7; at H=15 on the small
    model it measured 31% worse than plain averaging, see docs/benchmarks.md; 0 = plain averaging)."""
    P: int = 1
    """Streaming fragments per stage (1 = no streaming)."""
    tau: int = 0
    """Overlap: inner steps between a fragment's capture and its application (0 <= tau < H/P: a cycle's
    fragments are all applied before the next cycle's first capture, which is when checkpoints are taken)."""
    checkpoint_every: int = 1
    """Rounds between checkpoints (each replica's stage writes its own: consensus anchor, local weights,
    optimizer, outer momentum, error feedback, data position); 0 = never."""
    timeout_s: float = 60.0
    """W: a round applies the fragments in the store by the quorum's arrival + W seconds (on the store's
    clock, node/sync/round_rule.py); the same for every replica."""
    quorum: int = 0
    """q: how many replicas' fragments a round needs before its deadline runs (0: a majority of the
    stage's live replicas). Below it a round waits, then applies nothing: fewer replicas cannot outvote
    one hostile node."""
    max_late_rounds: int = 1
    """k: a fragment that misses its round's set is committed in one of the next k rounds' sets if it is
    in the store by that round's cutoff (node/sync/round_rule.py `late_entries`), by every replica alike;
    later than that, or with k = 0, it goes back to its sender's error feedback. Its sender restores it
    only once the window has closed, so it is never applied twice nor lost."""
    topology: Literal["all", "butterfly"] = "all"
    """Who a replica exchanges a fragment with: "all" = every replica reads every other replica's fragment
    through the store and all apply one agreed set (one consensus); "butterfly" = each exchange of a
    fragment pairs each replica with one partner (protocol/pairing.py: i XOR 2^((round + fragment) mod
    ceil(log2 R)), sitting out where that is R or more) and the two ends compute one pair result
    (node/sync/pair_mix.py). Butterfly needs method "sparseloco", outer_momentum 0, quorum 0 and
    max_late_rounds 0."""
    pair_blend: Literal["outer", "half"] = "outer"
    """Butterfly: how an end blends the pair result tau steps after it sent: "outer" = the outer step on
    the pair's mean (theta <- A' + local drift, as all-to-all does); "half" = the seed's 0.5 live weights
    + 0.5 pair result."""
    pair_clip: float = 1.0
    """Butterfly's pair rule, rho: each end's parts are clipped to rho x the smaller of the two ends' norms,
    so one hostile partner moves an honest end by at most rho x its own update per exchange."""
    pair_agreement: float = 0.0
    """Butterfly's agreement rule, gamma: a pair whose pseudo-gradients, or whose anchor differences,
    have a cosine below gamma gives no result (both ends skip; counted as `disagreed`), so a partner
    cannot push against where our own message points, exchange after exchange. -1 turns it off."""

    def __post_init__(self) -> None:
        check_finite(self)
        check_range("sync.H", self.H, 1, MAX_STEPS)
        check_range("sync.max_late_rounds", self.max_late_rounds, 0, MAX_LATE_ROUNDS)
        check_range("sync.timeout_s", self.timeout_s, 0, 1e6)
        check_range("sync.quorum", self.quorum, 0, MAX_STEPS)
        if self.method not in ("diloco", "sparseloco"):
            raise ValueError(f"sync.method={describe(self.method)} must be 'diloco' or 'sparseloco'")
        check_schedule(self.H, self.P, self.tau, checkpointed=True)
        check_range("sync.checkpoint_every", self.checkpoint_every, 0, MAX_STEPS)
        if not 0 < self.alpha <= 1e3:
            raise ValueError(f"sync.alpha={describe(self.alpha)} must be positive and at most 1000")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"sync.outer_momentum={describe(self.outer_momentum)} must be in [0, 1)")
        self._check_topology()

    def _check_topology(self) -> None:
        if self.topology not in ("all", "butterfly"):
            raise ValueError(f"sync.topology={describe(self.topology)} must be 'all' or 'butterfly'")
        if self.pair_blend not in ("outer", "half"):
            raise ValueError(f"sync.pair_blend={describe(self.pair_blend)} must be 'outer' or 'half'")
        check_range("sync.pair_clip", self.pair_clip, 1.0, 1e3)
        check_range("sync.pair_agreement", self.pair_agreement, -1.0, 1.0)
        if self.topology != "butterfly":
            return
        refused = {
            "method = 'sparseloco' (a pair message is SparseLoCo's pseudo-gradient plus anchor difference)": (
                self.method != "sparseloco"
            ),
            "outer_momentum = 0 (the two ends of a pair hold different momentum)": self.outer_momentum != 0,
            "quorum = 0 (a pair exchange needs both ends; there is no quorum to set)": self.quorum != 0,
            "max_late_rounds = 0 (a late pair message cannot be committed: the other end has moved on)": (
                self.max_late_rounds != 0
            ),
        }
        needed = [fix for fix, bad in refused.items() if bad]
        if needed:
            raise ValueError("sync.topology = 'butterfly' needs sync." + "; sync.".join(needed))

    def schedule(self) -> Schedule:
        """The fragment schedule the outer loop runs (and the round arithmetic of a step)."""
        return Schedule(H=self.H, P=self.P, tau=self.tau)


@dataclass(kw_only=True, frozen=True)
class SyncSpec(AggregationSettings, CodecSettings, OuterLoopSettings):
    """Cross-replica synchronisation through the object store (DESIGN section 3): one flat [sync] section
    of the outer loop's, the codec's and the aggregation's settings, each declared by its own type.

    A dataclass takes its bases' fields from the last base to the first, so the fields (the [sync] keys
    and the signed encoding, in this order) are the outer loop's, then the codec's, then the
    aggregation's."""

    def __post_init__(self) -> None:
        OuterLoopSettings.__post_init__(self)
        CodecSettings.__post_init__(self)
        AggregationSettings.__post_init__(self)

    def aggregation_settings(self) -> AggregationSettings:
        """The aggregation's settings alone (node/sync/aggregation.py takes them)."""
        return AggregationSettings(**{f.name: getattr(self, f.name) for f in fields(AggregationSettings)})


@dataclass(kw_only=True, frozen=True)
class PipelineSpec:
    """Inside-replica pipeline links (DESIGN section 4)."""

    link_k: list[int] = field(default_factory=list)
    """Subspace width k of each stage boundary (S-1 values); empty = dense links."""
    link_k_auto: bool = False
    """Let the coordinator choose link_k at the run's first placement from the nodes' measured links:
    the slowest link a boundary crosses, in any replica, sets its k (then fixed for the whole run)."""
    projection_seed: int = 7
    """Seed of the shared orthonormal basis U and token table T."""
    wire_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of activations and activation-gradients on the wire."""
    wire_max_abs: float = 1e6
    """Largest |value| of an activation or activation-gradient on a link: a sender refuses to send more, a
    receiver rejects it (a diverged or hostile neighbour). Honest values stay far below 1e6; see
    `protocol.codecs.subspace.MAX_ABS`."""
    bandwidth_mbps: float = 0.0
    """In-process link shaper: bandwidth per direction in Mbit/s (0 = unshaped)."""
    delay_ms: float = 0.0
    """In-process link shaper: one-way delay in milliseconds."""
    recv_timeout_s: float = 120.0
    """A stage gives up on a silent neighbour after this long."""
    extra_in_flight: int = 2
    """Microbatches a non-last stage runs ahead beyond 1F1B's S-s-1, so link round trips hide behind
    compute (costs that many more microbatches of activations; 0 = plain 1F1B)."""

    def __post_init__(self) -> None:
        check_finite(self)
        check_range("pipeline.projection_seed", self.projection_seed, 0, MAX_SEED)
        check_range("pipeline.wire_max_abs", self.wire_max_abs, 1.0, 3e38)
        check_range("pipeline.bandwidth_mbps", self.bandwidth_mbps, 0, 1e7)
        check_range("pipeline.delay_ms", self.delay_ms, 0, 1e6)
        check_range("pipeline.recv_timeout_s", self.recv_timeout_s, 0, 1e6)
        check_range("pipeline.extra_in_flight", self.extra_in_flight, 0, 1 << 16)


@dataclass(kw_only=True, frozen=True)
class ReplicaShape:
    """How some replicas differ from the run's default shape (a `[[shapes]]` table of run.toml)."""

    replicas: list[int]
    """The replicas (0..R-1) of this shape; each in at most one table."""
    microbatches: int = 0
    """Microbatches per inner step of these replicas, of the run's microbatch size
    (train.batch_size / train.microbatches sequences): their batch is microbatches x that (0: the run's
    train.microbatches)."""
    stages: int = 0
    """Pipeline stages of these replicas (0: the run's): a site of larger GPUs holds its replica in fewer."""
    layer_split: list[int] = field(default_factory=list)
    """Layers per stage of these replicas (empty: the run's layer_split when their stage count is the
    run's, else as even as possible)."""
    link_k: list[int] = field(default_factory=list)
    """Subspace width of each of their stage boundaries (empty: the run's pipeline.link_k when their stage
    count is the run's, else dense)."""

    def __post_init__(self) -> None:
        check_range("shapes.microbatches", self.microbatches, 0, 1 << 16)
        check_range("shapes.stages", self.stages, 0, 1 << 12)
        if not self.replicas:
            raise ValueError("a [[shapes]] table needs replicas = [...] (example: replicas = [2, 3])")


@dataclass(kw_only=True, frozen=True)
class RunSpec:
    """One training run: R replicas x S stages of one model."""

    run_id: str
    """Store prefix and DHT namespace of the run: lowercase letters, digits and dashes."""
    replicas: int = 2
    """R: data-parallel pipeline replicas."""
    stages: int = 2
    """S: pipeline stages per replica (one node each)."""
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    sync: SyncSpec = field(default_factory=SyncSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    eval_every: int = 1
    """Validate on the consensus weights every this many outer rounds (0 = only at start and end)."""
    layer_split: list[int] = field(default_factory=list)
    """Layers per stage (S values summing to model.n_layers); empty = as even as possible."""
    layer_split_auto: bool = False
    """Let the coordinator choose layer_split at the run's first placement from the placed nodes'
    measured speed and memory (the slowest node of each stage over the replicas; then fixed)."""
    shapes: list[ReplicaShape] = field(default_factory=list)
    """Replicas whose shape differs from the run's ([[shapes]] tables): their microbatch count (a replica
    of faster GPUs runs a larger batch; the aggregate weighs each by its tokens), their stage count, layer
    split and link widths (a replica of larger GPUs holds the model in fewer stages). Replicas of any
    shape exchange the same layer groups (`layer_groups`)."""

    def __post_init__(self) -> None:
        check_run_id("run_id", self.run_id)
        listed = [r for sh in self.shapes for r in sh.replicas]
        if len(set(listed)) != len(listed) or any(not 0 <= r < self.replicas for r in listed):
            raise ValueError(
                f"shapes name replicas {listed}: each must be in 0..replicas-1={self.replicas - 1} and in at "
                "most one [[shapes]] table"
            )
        if self.layer_split and (
            len(self.layer_split) != self.stages
            or min(self.layer_split) < 1
            or sum(self.layer_split) != self.model.n_layers
        ):
            raise ValueError(
                f"layer_split={self.layer_split} must hold stages={self.stages} values >= 1 summing to "
                f"model.n_layers={self.model.n_layers} (example: layer_split = [3, 5] for 8 layers)"
            )
        if self.replicas <= 0 or self.stages <= 0:
            raise ValueError(f"replicas={self.replicas} and stages={self.stages} must be positive")
        if self.sync.topology == "butterfly" and self.replicas < 2:
            raise ValueError(
                f"sync.topology = 'butterfly' pairs replicas: replicas={self.replicas}, need at least 2 "
                "(or sync.topology = 'all')"
            )
        for sh in self.shapes:
            self._check_shape(sh)
        if (self.layer_split_auto or self.pipeline.link_k_auto) and any(
            sh.stages or sh.layer_split or sh.link_k for sh in self.shapes
        ):
            raise ValueError(
                "layer_split_auto and pipeline.link_k_auto choose one split for every replica: with "
                "[[shapes]] of their own stages, layer_split or link_k, state those instead"
            )
        check_range("replicas", self.replicas, 1, 1 << 16)  # messages.MAX_REPLICAS
        check_range("eval_every", self.eval_every, 0, MAX_STEPS)
        most = max(self.round_tokens_bound(r) for r in range(self.replicas))
        if most >= MAX_ROUND_TOKENS:
            raise ValueError(
                f"a round of sync.H={self.sync.H} steps trains up to {most} tokens, over {MAX_ROUND_TOKENS}, "
                "more than a fragment can claim: lower sync.H or the batch"
            )
        if not self.train.tokenizer and self.model.vocab < 256:
            raise ValueError(
                f"model.vocab={self.model.vocab}: a byte-level run (no train.tokenizer) needs at least 256 "
                "(one id per byte value)"
            )
        if self.stages > self.model.n_layers:
            raise ValueError(f"stages={self.stages} exceeds model.n_layers={self.model.n_layers}")
        if self.pipeline.link_k and len(self.pipeline.link_k) != self.stages - 1:
            raise ValueError(
                f"pipeline.link_k has {len(self.pipeline.link_k)} values; a {self.stages}-stage pipeline "
                f"has {self.stages - 1} links"
            )
        for k in self.pipeline.link_k:
            if not 0 < k <= self.model.d_model:
                raise ValueError(f"pipeline.link_k value {k} must be in 1..d_model={self.model.d_model}")

    def _check_shape(self, sh: ReplicaShape) -> None:
        stages, n, d = sh.stages or self.stages, self.model.n_layers, self.model.d_model
        where = f"[[shapes]] of replicas {sh.replicas}"
        if stages > n:
            raise ValueError(f"{where}: stages={stages} exceeds model.n_layers={n}")
        if sh.layer_split and (
            len(sh.layer_split) != stages or min(sh.layer_split) < 1 or sum(sh.layer_split) != n
        ):
            raise ValueError(
                f"{where}: layer_split={sh.layer_split} must hold stages={stages} values >= 1 summing to "
                f"model.n_layers={n}"
            )
        if sh.link_k and len(sh.link_k) != stages - 1:
            raise ValueError(
                f"{where}: link_k has {len(sh.link_k)} values; {stages} stages have {stages - 1} links"
            )
        if any(not 0 < k <= d for k in sh.link_k):
            raise ValueError(f"{where}: link_k values {sh.link_k} must be in 1..d_model={d}")

    @property
    def rounds(self) -> int:
        return self.train.total_steps // self.sync.H

    def shape_of(self, replica: int) -> ReplicaShape | None:
        """`replica`'s [[shapes]] table, None for a replica of the run's own shape."""
        for sh in self.shapes:
            if replica in sh.replicas:
                return sh
        return None

    def microbatches_of(self, replica: int) -> int:
        """M of `replica`: its [[shapes]] table's, else train.microbatches."""
        sh = self.shape_of(replica)
        return sh.microbatches if sh is not None and sh.microbatches else self.train.microbatches

    def stages_of(self, replica: int) -> int:
        """S of `replica`: its [[shapes]] table's, else the run's `stages`."""
        sh = self.shape_of(replica)
        return sh.stages if sh is not None and sh.stages else self.stages

    def link_k_of(self, replica: int) -> list[int]:
        """`replica`'s boundary widths (S_r - 1 values, or empty: dense)."""
        sh = self.shape_of(replica)
        if sh is not None and (sh.link_k or self.stages_of(replica) != self.stages):
            return list(sh.link_k)
        return list(self.pipeline.link_k)

    def pipeline_of(self, replica: int) -> PipelineSpec:
        """The [pipeline] section as `replica`'s links see it (its own link_k)."""
        return replace(self.pipeline, link_k=self.link_k_of(replica))

    @property
    def max_stages(self) -> int:
        """The most stages any replica has."""
        return max(self.stages_of(r) for r in range(self.replicas))

    @property
    def mixed_layout(self) -> bool:
        """Whether some replica's layer split differs from another's (the stages differ in layers)."""
        return len({tuple(self.layer_ranges(r)) for r in range(self.replicas)}) > 1

    def layouts(self) -> list[tuple[list[tuple[int, int]], list[int]]]:
        """Each distinct (layer ranges, link_k) of the run's replicas: what one model-wide subspace plan
        must satisfy (protocol/codecs/subspace.py `subspace_plan`)."""
        out: list[tuple[list[tuple[int, int]], list[int]]] = []
        for r in range(self.replicas):
            lay = (self.layer_ranges(r), self.link_k_of(r))
            if lay not in out:
                out.append(lay)
        return out

    def layer_groups(self) -> list[tuple[int, int]]:
        """The model's layer groups: [start, end) between consecutive boundaries of any replica's split.
        Fragments are keyed by group, so replicas of different splits exchange the same layers; the
        embedding goes with the first group, the final norm and head with the last. A run whose replicas
        share one split has one group per stage."""
        cuts = sorted(
            {0, self.model.n_layers} | {b for r in range(self.replicas) for b, _ in self.layer_ranges(r)}
        )
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def groups_of(self, replica: int, stage: int) -> list[int]:
        """The layer groups `replica`'s stage `stage` holds, in model order."""
        start, end = self.layer_ranges(replica)[stage]
        return [g for g, (a, b) in enumerate(self.layer_groups()) if start <= a and b <= end]

    def group_of_param(self, name: str) -> int:
        """The layer group of a parameter by its global name (node/model.py's: `layers.{l}.*` goes with layer
        l, `embed.*` with the first layer, the final norm and head with the last)."""
        head, _, rest = name.partition(".")
        n = self.model.n_layers
        layer = int(rest.partition(".")[0]) if head == "layers" else 0 if head == "embed" else n - 1
        return next(g for g, (a, b) in enumerate(self.layer_groups()) if a <= layer < b)

    def stage_of_group(self, replica: int, group: int) -> int:
        """The stage of `replica` that holds layer group `group`."""
        a, _ = self.layer_groups()[group]
        return next(s for s, (start, end) in enumerate(self.layer_ranges(replica)) if start <= a < end)

    def batch_of(self, replica: int) -> int:
        """Sequences per inner step of `replica`: its M x the run's microbatch size."""
        return self.microbatches_of(replica) * (self.train.batch_size // self.train.microbatches)

    def tokens_per_step(self, replica: int) -> int:
        """Tokens `replica` trains on per inner step: its batch x model.seq_len."""
        return self.batch_of(replica) * self.model.seq_len

    def round_tokens_bound(self, replica: int) -> int:
        """The most tokens any fragment of `replica` trains on: one round's, H x its tokens per step."""
        return self.sync.H * self.tokens_per_step(replica)

    def fragment_tokens(self, replica: int, fragment: int, rnd: int) -> int:
        """The tokens `replica`'s fragment `fragment` of round `rnd` trained on since its previous capture
        (a round's worth, less in round 0: captured c_f steps in): what an honest fragment claims, and the
        most a receiver accepts (node/sync/exchange.py `check_tokens`)."""
        sch = self.sync.schedule()
        return self.tokens_per_step(replica) * sch.steps_since_capture(sch.capture_step(fragment, rnd))

    def layer_ranges(self, replica: int | None = None) -> list[tuple[int, int]]:
        """Contiguous [start, end) layer ranges per stage of `replica` (None: of the run's own shape): its
        layer_split, else as even as possible."""
        sh = self.shape_of(replica) if replica is not None else None
        n, s = self.model.n_layers, self.stages_of(replica) if replica is not None else self.stages
        split = sh.layer_split if sh is not None and sh.layer_split else []
        if not split and s == self.stages:
            split = self.layer_split
        if split:
            ends = [sum(split[: i + 1]) for i in range(s)]
            return [(ends[i] - split[i], ends[i]) for i in range(s)]
        bounds = [round(i * n / s) for i in range(s + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(s)]


_SECTIONS: dict[str, type] = {
    "model": ModelSpec,
    "train": TrainSpec,
    "sync": SyncSpec,
    "pipeline": PipelineSpec,
}
"""The run.toml sections that hold a nested spec; [run] holds RunSpec's own fields."""


def _run_keys() -> list[str]:
    return [f.name for f in fields(RunSpec) if f.name not in _SECTIONS]


def _check_layout(path: str | Path, data: dict[str, Any]) -> None:
    """Reject unknown sections and keys, naming the valid ones: from_dict would reject them too, but
    without saying what the section may hold."""
    sections = ", ".join(f"[{s}]" for s in ("run", *_SECTIONS))
    run_keys = _run_keys()
    for name, value in data.items():
        cls = _SECTIONS.get(name)
        if cls is None and name != "run":
            if name in run_keys and not isinstance(value, dict):
                continue  # a [run] key written before the first section: accepted as such
            what = "section" if isinstance(value, dict) else "top-level key"
            raise ValueError(
                f"{path}: unknown {what} {describe(name)}; valid sections: {sections} "
                "(see docs/examples/run.toml)"
            )
        if not isinstance(value, dict):
            raise ValueError(f"{path}: {describe(name)} must be a section ([{name}]), got {describe(value)}")
        allowed = run_keys if cls is None else [f.name for f in fields(cls)]
        unknown = [k for k in value if k not in allowed]
        if unknown:
            raise ValueError(
                f"{path}: [{name}] has no key {', '.join(describe(k) for k in unknown[:5])}; "
                f"valid: {', '.join(allowed)}"
            )


def _where(message: str) -> str:
    """A SchemaError's message with the key as the file spells it: "RunSpec.sync: sync.tau=50 must ..."
    becomes "sync.tau=50 must ...", "RunSpec.train.lr: expected a number" becomes "train.lr: ..."."""
    if not message.startswith("RunSpec"):
        return message
    head, sep, rest = message[len("RunSpec") :].partition(": ")
    key = head.lstrip(".")
    if not sep or not key or rest.startswith(f"{key}.") or rest.startswith(f"{key}="):
        return rest if sep else message
    return f"{key}: {rest}"


def load_run_spec(path: str | Path, **overrides: Any) -> RunSpec:
    """Load a run.toml into a RunSpec; every error is a one-line ValueError that names the file and the
    section and key (unknown ones with the list of valid ones)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        raise ValueError(
            f"run spec file {str(path)!r} does not exist (example: docs/examples/run.toml)"
        ) from e
    except IsADirectoryError as e:
        raise ValueError(f"run spec file {str(path)!r} is a folder, not a TOML file") from e
    except OSError as e:
        raise ValueError(f"run spec file {str(path)!r} cannot be read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"run spec file {str(path)!r} is not UTF-8 text: {e.reason}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"run spec file {str(path)!r} is not valid TOML: {e}") from e
    _check_layout(path, data)
    flat = dict(data.pop("run", {}))
    flat.update(data)
    flat.update(overrides)
    if "run_id" not in flat:
        raise ValueError(f'{path}: [run] has no run_id (example: run_id = "tiny-llama-1")')
    try:
        return from_dict(RunSpec, flat)
    except SchemaError as e:
        raise ValueError(f"{path}: {_where(str(e))}") from e


__all__ = [
    "RUN_ID_PATTERN",
    "ModelSpec",
    "MoESpec",
    "OuterLoopSettings",
    "PipelineSpec",
    "ReplicaShape",
    "RunSpec",
    "SyncSpec",
    "TrainSpec",
    "check_run_id",
    "load_run_spec",
]

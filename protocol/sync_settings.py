"""The settings of what the [sync] section configures, one type per component (torchtitan's job config:
each component reads its own section): the fragment schedule the outer loop runs, the SparseLoCo codec's
and the aggregation's.

Each field is declared once (type, default, doc, check), by the type that owns it: the codec's and the
aggregation's here, the outer loop's (method, H, P, tau, alpha, ...) in `protocol.runspec.OuterLoopSettings`.
`protocol.runspec.SyncSpec` inherits all three, so the [sync] keys and the signed spec's encoding stay one
flat section, and builds each component's settings with a method (`schedule()`, `sparseloco()`,
`aggregation_settings()`); node/sync/ takes those objects.

`Schedule` is Streaming DiLoCo's (arXiv 2501.18512): P strided fragments, q = floor(H/P), fragment f
captured at inner step c_f = (f+1) q of each H-step cycle and applied at a_f = c_f + tau; rounds end every
H steps. Its methods are the one place that turns an inner step into a round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from protocol.schema import check_finite, check_range, describe

if TYPE_CHECKING:
    from protocol.codecs.sparseloco import SparseLoCoConfig

Average = Literal["mean", "per_coordinate"]
Weighting = Literal["tokens", "equal"]
Robust = Literal["none", "clip_median", "trimmed"]
ROBUST_RULES: tuple[Robust, ...] = ("none", "clip_median", "trimmed")
MAX_RATIO = 1e6
"""Upper bound of `max_norm_ratio` and `max_abs_ratio`: beyond it a bound no longer bounds anything."""
MAX_BOUND = 3e38
"""Upper bound of the absolute `max_abs` and `max_norm` (float32's largest is 3.4e38)."""


def check_schedule(H: int, P: int, tau: int, *, checkpointed: bool = False) -> None:
    """Raise ValueError unless 0 < P <= H and 0 <= tau < H (a fragment's aggregate is applied before that
    fragment is captured again). `checkpointed` (every run spec): 0 <= tau < H/P, so a cycle's fragments
    are all applied before the next cycle's first capture, which is when a checkpoint is taken."""
    if H <= 0 or P <= 0 or P > H:
        raise ValueError(f"sync.H={H} and sync.P={P} must satisfy 0 < P <= H")
    if checkpointed and not 0 <= tau < H // P:
        raise ValueError(
            f"sync.tau={tau} must satisfy 0 <= tau < H/P={H // P} (H={H}, P={P}): a cycle's fragments "
            "must all be applied before the next cycle's first capture"
        )
    if not 0 <= tau < H:
        raise ValueError(
            f"sync.tau={tau} must satisfy 0 <= tau < H={H}: a fragment must be applied before its next capture"
        )


@dataclass(kw_only=True, frozen=True)
class Schedule:
    """When one stage's outer loop captures and applies each fragment, and which round a step is in.
    H, P and tau are declared (default, doc) by the run spec (`protocol.runspec.OuterLoopSettings`), which
    builds this with `schedule()`; the outer loop (node/sync/outer_sync.py) and the checkpoints run it."""

    H: int
    P: int
    tau: int

    def __post_init__(self) -> None:
        check_schedule(self.H, self.P, self.tau)

    @property
    def q(self) -> int:
        """Inner steps between two captures: floor(H / P)."""
        return self.H // self.P

    def capture_offset(self, f: int) -> int:
        """c_f = (f + 1) * floor(H / P), in inner steps from the start of the cycle."""
        return (f + 1) * self.q

    def captures(self, step: int) -> list[tuple[int, int]]:
        """(fragment, round) of each fragment captured after inner step `step` (1-based count of steps
        done), in fragment order; the fragment is applied tau steps later."""
        rnd, pos = divmod(step, self.H)
        out = []
        for f in range(self.P):
            c_f = self.capture_offset(f)
            # c_f == H is the cycle's last step, i.e. position 0 of the next cycle
            if step > 0 and pos == c_f % self.H:
                out.append((f, rnd - 1 if c_f == self.H else rnd))
        return out

    def capture_step(self, f: int, rnd: int) -> int:
        """The inner step after which fragment f of round `rnd` is captured: rnd H + c_f."""
        return rnd * self.H + self.capture_offset(f)

    def steps_since_capture(self, step: int) -> int:
        """Inner steps a fragment captured after `step` trained on since its previous capture (H steps
        earlier; the first one, from step 0): min(step, H). A replica resumed from a checkpoint holds the
        weights of those steps, so it claims the same as one that never stopped."""
        return min(step, self.H)

    def round_ended(self, step: int) -> int | None:
        """The round that inner step `step` (1-based) ends, or None: rounds end every H steps."""
        return step // self.H if step > 0 and step % self.H == 0 else None

    def round_at(self, step: int) -> int:
        """The last round whose every fragment is applied after inner step `step`: floor((step - tau) / H)
        (a round's last fragment is applied tau steps after the round ends)."""
        return (step - self.tau) // self.H

    def settled_at(self, step: int) -> int | None:
        """The round r >= 1 whose last fragment is applied at exactly inner step `step` = r H + tau, else
        None: the step after which the anchor, outer momentum and error feedback are exactly round r's."""
        rnd = self.round_at(step)
        return rnd if rnd >= 1 and step == rnd * self.H + self.tau else None


@dataclass(kw_only=True, frozen=True)
class CodecSettings:
    """SparseLoCo's codec (arXiv 2508.15706) as the run spec sets it; sync.method = "diloco" ignores it."""

    k: int = 64
    """SparseLoCo: coordinates kept (top-k by magnitude) per chunk; 64 of 4096 = 1.56% density."""
    chunk: int = 4096
    """SparseLoCo: coordinates per chunk, a perfect square (2-D weights are cut into 64 x 64 tiles)."""
    beta: float = 0.95
    """SparseLoCo: error-feedback decay, e = beta * e + Delta before each compression. 0.95 is the paper's
    (thousands of rounds); runs of tens to hundreds of rounds train better with 0.6-0.8 (the local swarm
    and docs/examples/run.toml use 0.7; docs/benchmarks.md)."""
    stochastic_rounding: bool = False
    """SparseLoCo: code each kept value between the two Lloyd levels around it, with the probability that
    makes it unbiased, instead of to the nearest (draws from a counter-based generator keyed by run,
    stage, fragment, round and replica: every encoder, host or device, writes the same bytes)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if not isinstance(self.stochastic_rounding, bool):
            raise ValueError(
                f"sync.stochastic_rounding={describe(self.stochastic_rounding)} must be true or false"
            )
        t = math.isqrt(max(self.chunk, 0))
        if not 1 <= self.chunk <= 65536 or t * t != self.chunk:
            raise ValueError(
                f"sync.chunk={self.chunk} must be a perfect square in [1, 65536] (example: 4096 = 64 x 64)"
            )
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"sync.k={self.k} must be in [1, chunk={self.chunk}]")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"sync.beta={describe(self.beta)} must be in [0, 1]")

    def sparseloco(self) -> SparseLoCoConfig:
        """The codec's own settings (its value bits and 1-D handling at their defaults)."""
        from protocol.codecs.sparseloco import SparseLoCoConfig  # torch: only where a codec is built

        return SparseLoCoConfig(chunk=self.chunk, k=self.k, beta=self.beta)


def _number(where: str, value: object) -> None:
    """Refuse a bool or a non-number before its range is checked (True is an int to Python, never a bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}={describe(value)} must be a number")


@dataclass(kw_only=True, frozen=True)
class AggregationSettings:
    """How decoded contributions become Delta_bar (node/sync/aggregation.py; DESIGN sections 3 and 10)."""

    aggregation: Average = "per_coordinate"
    """How arrived contributions are averaged: "mean" over arrivals (the paper) or "per_coordinate",
    each coordinate divided by the number of replicas that sent it (Templar; see docs/benchmarks.md)."""
    robust: Robust = "trimmed"
    """Bound on one replica's influence on Delta_bar (DESIGN section 10; node/sync/aggregation.py):
    "trimmed" = clamp each value to max_abs_ratio x the round's median peak, clip each contribution's
    norm to max_norm_ratio x the round's median norm, leave out contributions that point away from the
    others (min_agreement), then a coordinate-wise trimmed mean (the median of 3 senders, the middle two
    of 4): resists values x100 or near float max and sign flips; "clip_median" = the clamp and clip,
    then `aggregation`'s mean (magnitude attacks only); "none" = no bound (only NaN/inf and the absolute
    max_abs/max_norm are rejected). See docs/benchmarks.md, "Robust aggregation under attack"."""
    max_norm_ratio: float = 1.0
    """robust != "none": scale a contribution whose L2 norm exceeds this multiple of the round's (lower)
    median norm down to it; in [1, 1e6] (1 = the median itself)."""
    max_abs_ratio: float = 4.0
    """robust != "none": clamp each decoded value of a tensor to +-(this multiple of the round's lower
    median, over contributions, of that tensor's largest |value|); in [1, 1e6]."""
    min_agreement: float = 0.0
    """robust = "trimmed": leave out a contribution that fewer than half of the round agree with above
    max(this, 1/4 of the round's own agreement) (pairwise cosine; where the round has no agreement above
    this, only one also pointing away from the others' geometric median), then recomputed over the rest,
    never half or more of the round; in [-1, 1] (-1 = never)."""
    trim: float = 0.25
    """robust = "trimmed": fraction of the values sent at a coordinate dropped at each end (at least one
    where >= 3 replicas sent it, never so many that none is left); in [0, 0.5)."""
    max_abs: float = 1e3
    """Reject outright a contribution holding a decoded |value| above this (0 = no absolute bound). An
    honest value is a weight change over H Adam steps plus error feedback, at most about
    H lr 3 / (1 - beta) = 5.4 at the defaults; the largest measured is 0.068 (bench_quality --quick)."""
    max_norm: float = 1e5
    """Reject outright a contribution whose L2 norm exceeds this (0 = no absolute bound). The largest
    measured honest norm is 5.2 (bench_quality --quick, 0.5M parameters, dense DiLoCo included); a
    1e9-parameter fragment at 1.56% density with every value 1 would still be 4e3."""
    weighting: Weighting = "tokens"
    """How contributions are weighed in the average: "tokens" = by the tokens each replica trained on in
    the round (signed in its fragment, bounded by its shape: node/sync/aggregation.py), so a replica of
    twice the batch counts twice; "equal" = one weight per replica. Replicas of one shape weigh the same
    either way (bit for bit)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.aggregation not in ("mean", "per_coordinate"):
            raise ValueError(
                f"sync.aggregation={describe(self.aggregation)} must be 'mean' or 'per_coordinate'"
            )
        if self.weighting not in ("tokens", "equal"):
            raise ValueError(f"sync.weighting={describe(self.weighting)} must be 'tokens' or 'equal'")
        if self.robust not in ROBUST_RULES:
            raise ValueError(
                f"sync.robust={describe(self.robust)} must be 'trimmed' (the default), 'clip_median' "
                "or 'none'"
            )
        for name in ("max_norm_ratio", "max_abs_ratio", "min_agreement", "trim", "max_abs", "max_norm"):
            _number(f"sync.{name}", getattr(self, name))
        check_range("sync.max_norm_ratio", self.max_norm_ratio, 1, MAX_RATIO)
        check_range("sync.max_abs_ratio", self.max_abs_ratio, 1, MAX_RATIO)
        check_range("sync.min_agreement", self.min_agreement, -1, 1)
        if not 0 <= self.trim < 0.5:
            raise ValueError(f"sync.trim={describe(self.trim)} must be in [0, 0.5) (example: 0.25)")
        check_range("sync.max_abs", self.max_abs, 0, MAX_BOUND)
        check_range("sync.max_norm", self.max_norm, 0, MAX_BOUND)


__all__ = [
    "MAX_BOUND",
    "MAX_RATIO",
    "ROBUST_RULES",
    "AggregationSettings",
    "Average",
    "CodecSettings",
    "Robust",
    "Schedule",
    "Weighting",
    "check_schedule",
]

"""Message bodies every participant shares. Each travels inside a signed envelope (protocol.envelope).

Every body checks its fields in `__post_init__` (so a decoded message and one built in code obey the same
rules): floats are finite (a diverged run's `loss` and `val_bpb` excepted), ports are ports, counts are not
negative, and measured figures stay below what one node can physically have (`MAX_*`): a peer claiming
1e308 TFLOP/s is rejected, not ranked first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.runspec import RunSpec, check_run_id
from protocol.schema import NONFINITE_OK, check_finite, check_range, describe

MAX_PORT = 65535
MAX_COUNT = 2**63 - 1
"""Terms, epochs, steps and byte counters: non-negative 64-bit integers."""
MAX_TIME_S = 1e10
"""Unix times (DHT time, seconds) lie in [0, 1e10], i.e. before the year 2286."""
MAX_TFLOPS = 1e5
"""Per node, any dtype: about a hundred of today's fastest accelerators' dense bf16 peak."""
MAX_MEMORY_GB = 1e5
"""GB of accelerator memory or RAM on one node."""
MAX_PRICE_PER_HOUR = 1e5
"""USD per hour for one node."""
MAX_MBPS = 1e7
"""10 Tbit/s: more than any network link a node has."""
MAX_RTT_MS = 1e6
"""Round trips longer than 1000 s are not measurements."""
MAX_TEXT = 256
"""Peer ids, hosts, device and version strings."""


def _check_text(where: str, value: str, *, empty_ok: bool = True) -> None:
    if len(value) > MAX_TEXT or (not value and not empty_ok):
        raise ValueError(f"{where}={describe(value)} must be {0 if empty_ok else 1}-{MAX_TEXT} characters")


def _check_port(where: str, port: int) -> None:
    check_range(where, port, 0, MAX_PORT)


NodeState = Literal["idle", "assigned", "training", "done", "failed"]
RunState = Literal["pending", "running", "stopping", "stopped", "done", "failed"]


@dataclass(kw_only=True, frozen=True)
class Endpoint:
    """A node's direct TCP endpoint for pipeline traffic."""

    peer_id: str
    host: str
    port: int

    def __post_init__(self) -> None:
        _check_text("Endpoint.peer_id", self.peer_id, empty_ok=False)
        _check_text("Endpoint.host", self.host, empty_ok=False)
        _check_port("Endpoint.port", self.port)


@dataclass(kw_only=True, frozen=True)
class NodeAdvert:
    """What a node publishes in the DHT (subkey = its peer id), refreshed before its TTL runs out."""

    peer_id: str
    version: str
    device: str
    """Accelerator name, e.g. "cuda:NVIDIA A100-SXM4-80GB" or "cpu"."""
    memory_gb: float
    free_memory_gb: float = 0.0
    """Free accelerator memory in GB (1e9 bytes) when the advert was made (CUDA: torch.cuda.mem_get_info;
    CPU: available RAM); 0 = unknown. Placement keeps a node off a stage whose estimated memory
    (protocol/memory.py) does not fit it."""
    tflops: float
    """Measured dense matmul TFLOP/s at the dtype this node trains in by default (bf16 on CUDA, fp32 on
    a CPU): what placement ranks by."""
    tflops_fp32: float = 0.0
    """Measured dense fp32 matmul TFLOP/s (0 = not measured)."""
    tflops_bf16: float = 0.0
    """Measured dense bf16 matmul TFLOP/s (0 = not measured)."""
    price_per_hour: float
    """What the provider charges, USD per hour."""
    host: str
    port: int
    """Pipeline TCP port."""
    health_port: int
    store_mbps: float = 0.0
    """Measured upload bandwidth to the object store, Mbit/s (0 = not measured yet)."""
    peer_mbps: dict[str, float] = field(default_factory=dict)
    """Measured bandwidth to pipeline neighbours, Mbit/s, by peer id."""
    peer_rtt_ms: dict[str, float] = field(default_factory=dict)
    coordinator_eligible: bool = False
    state: NodeState = "idle"
    error: str = ""
    """Why the current assignment failed (state "failed"), for the coordinator and the operator; else empty."""
    run_id: str = ""
    replica: int = -1
    stage: int = -1
    epoch: int = 0
    """Epoch of the assignment the state refers to (the coordinator ignores reports on older ones)."""
    step: int = 0
    loss: float | None = field(default=None, metadata=NONFINITE_OK)
    """Last training loss (NaN or inf when the run diverged: reported as it is)."""
    val_bpb: float | None = field(default=None, metadata=NONFINITE_OK)
    tokens_per_s: float = 0.0
    bytes_pipe: int = 0
    """Pipeline bytes sent + received so far in the current run."""
    bytes_store: int = 0
    """Object-store bytes uploaded + downloaded so far in the current run."""
    timestamp: float = 0.0

    def __post_init__(self) -> None:
        check_finite(self)
        for name in ("peer_id", "version", "device", "host"):
            _check_text(f"NodeAdvert.{name}", getattr(self, name), empty_ok=name in ("version", "device"))
        for name in ("memory_gb", "free_memory_gb"):
            check_range(f"NodeAdvert.{name}", getattr(self, name), 0, MAX_MEMORY_GB)
        for name in ("tflops", "tflops_fp32", "tflops_bf16"):
            check_range(f"NodeAdvert.{name}", getattr(self, name), 0, MAX_TFLOPS)
        check_range("NodeAdvert.price_per_hour", self.price_per_hour, 0, MAX_PRICE_PER_HOUR)
        _check_port("NodeAdvert.port", self.port)
        _check_port("NodeAdvert.health_port", self.health_port)
        check_range("NodeAdvert.store_mbps", self.store_mbps, 0, MAX_MBPS)
        for peer, mbps in self.peer_mbps.items():
            _check_text("NodeAdvert.peer_mbps key", peer)
            check_range(f"NodeAdvert.peer_mbps[{describe(peer)}]", mbps, 0, MAX_MBPS)
        for peer, ms in self.peer_rtt_ms.items():
            _check_text("NodeAdvert.peer_rtt_ms key", peer)
            check_range(f"NodeAdvert.peer_rtt_ms[{describe(peer)}]", ms, 0, MAX_RTT_MS)
        if self.run_id:
            check_run_id("NodeAdvert.run_id", self.run_id)
        for name in ("replica", "stage"):
            check_range(f"NodeAdvert.{name}", getattr(self, name), -1, MAX_COUNT)
        for name in ("epoch", "step", "bytes_pipe", "bytes_store"):
            check_range(f"NodeAdvert.{name}", getattr(self, name), 0, MAX_COUNT)
        check_range("NodeAdvert.tokens_per_s", self.tokens_per_s, 0, None)
        check_range("NodeAdvert.timestamp", self.timestamp, 0, MAX_TIME_S)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(peer_id=self.peer_id, host=self.host, port=self.port)


@dataclass(kw_only=True, frozen=True)
class RunRecord:
    """A launched run as published in the DHT (subkey = run id), signed by the operator/coordinator."""

    spec: RunSpec
    state: RunState = "pending"
    term: int = 0
    coordinator: str = ""
    """Peer id of the coordinator holding the run's lease."""
    updated: float = 0.0

    def __post_init__(self) -> None:
        check_range("RunRecord.term", self.term, 0, MAX_COUNT)
        _check_text("RunRecord.coordinator", self.coordinator)
        check_range("RunRecord.updated", self.updated, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class Assignment:
    """Signed by the run's coordinator: which replica/stage a node serves, and its neighbours.

    Nodes order assignments by (term, epoch) and ignore anything older than what they hold, so a deposed
    coordinator (lower term) cannot split the run.
    """

    run_id: str
    term: int
    epoch: int
    peer_id: str
    replica: int
    stage: int
    layers: list[int]
    """[start, end) of the stage's layers."""
    prev: Endpoint | None = None
    next: Endpoint | None = None
    spec: RunSpec
    stage_peers: dict[str, str] = field(default_factory=dict)
    """Replica index (as a string) -> peer id of the node serving this stage in that replica; the signer
    every cross-replica fragment of this stage must carry."""
    start_step: int = 0
    """Inner step to start from; -1 = resume from the latest consensus checkpoint (a replica rebuilt after
    churn): the first stage picks that step and passes it downstream in its Hello."""
    issued_at: float = 0.0

    def __post_init__(self) -> None:
        check_run_id("Assignment.run_id", self.run_id)
        if self.run_id != self.spec.run_id:
            raise ValueError(
                f"Assignment.run_id={describe(self.run_id)} must equal its spec's run_id "
                f"{describe(self.spec.run_id)}"
            )
        check_range("Assignment.term", self.term, 0, MAX_COUNT)
        check_range("Assignment.epoch", self.epoch, 0, MAX_COUNT)
        _check_text("Assignment.peer_id", self.peer_id, empty_ok=False)
        check_range("Assignment.replica", self.replica, -1, self.spec.replicas - 1)
        check_range("Assignment.stage", self.stage, -1, self.spec.stages - 1)  # -1: released
        if self.stage >= 0 and not (
            len(self.layers) == 2 and 0 <= self.layers[0] < self.layers[1] <= self.spec.model.n_layers
        ):
            raise ValueError(
                f"Assignment.layers must be [start, end) with 0 <= start < end <= model.n_layers="
                f"{self.spec.model.n_layers}, got {describe(self.layers)}"
            )
        for r, peer in self.stage_peers.items():
            if not (r.isdecimal() and len(r) <= 6 and int(r) < self.spec.replicas):
                raise ValueError(
                    f"Assignment.stage_peers key {describe(r)} must be a replica index below "
                    f"replicas={self.spec.replicas}"
                )
            _check_text(f"Assignment.stage_peers[{r}]", peer, empty_ok=False)
        check_range("Assignment.start_step", self.start_step, -1, MAX_COUNT)
        check_range("Assignment.issued_at", self.issued_at, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class Lease:
    """A run's coordinator lease in the store; written with conditional PUTs (If-None-Match / If-Match)."""

    run_id: str
    term: int
    holder: str
    expires_at: float

    def __post_init__(self) -> None:
        check_run_id("Lease.run_id", self.run_id)
        check_range("Lease.term", self.term, 0, MAX_COUNT)
        _check_text("Lease.holder", self.holder)
        check_range("Lease.expires_at", self.expires_at, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class RunControl:
    """Operator request for a run (stop)."""

    run_id: str
    action: Literal["stop"]
    issued_at: float

    def __post_init__(self) -> None:
        check_run_id("RunControl.run_id", self.run_id)
        check_range("RunControl.issued_at", self.issued_at, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class Hello:
    """First frame on a pipeline connection, signed by the connecting (upstream) node."""

    run_id: str
    term: int
    epoch: int
    replica: int
    stage: int
    peer_id: str
    start_step: int = 0
    """The inner step the upstream stage starts from; downstream stages adopt it (resume after churn)."""
    to_peer_id: str = ""
    """The recipient's (downstream node's) peer id: a captured hello is refused by any other node."""
    sent_at: float = 0.0
    """Unix time the hello was signed: the recipient refuses one outside its skew window, or seen before."""

    def __post_init__(self) -> None:
        check_run_id("Hello.run_id", self.run_id)
        for name in ("term", "epoch", "replica", "stage", "start_step"):
            check_range(f"Hello.{name}", getattr(self, name), 0, MAX_COUNT)
        _check_text("Hello.peer_id", self.peer_id, empty_ok=False)
        _check_text("Hello.to_peer_id", self.to_peer_id)
        check_range("Hello.sent_at", self.sent_at, 0, MAX_TIME_S)

"""Message bodies every participant shares. Each travels inside a signed envelope (protocol.envelope)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from protocol.runspec import RunSpec

NodeState = Literal["idle", "assigned", "training", "done", "failed"]
RunState = Literal["pending", "running", "stopping", "stopped", "done", "failed"]


@dataclass(kw_only=True, frozen=True)
class Endpoint:
    """A node's direct TCP endpoint for pipeline traffic."""

    peer_id: str
    host: str
    port: int


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
    loss: float | None = None
    val_bpb: float | None = None
    tokens_per_s: float = 0.0
    bytes_pipe: int = 0
    """Pipeline bytes sent + received so far in the current run."""
    bytes_store: int = 0
    """Object-store bytes uploaded + downloaded so far in the current run."""
    timestamp: float = 0.0

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


@dataclass(kw_only=True, frozen=True)
class Lease:
    """A run's coordinator lease in the store; written with conditional PUTs (If-None-Match / If-Match)."""

    run_id: str
    term: int
    holder: str
    expires_at: float


@dataclass(kw_only=True, frozen=True)
class RunControl:
    """Operator request for a run (stop)."""

    run_id: str
    action: Literal["stop"]
    issued_at: float


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

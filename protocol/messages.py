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
MAX_PROBE_BYTES = 16 << 20
"""A bandwidth probe sends at most this much (node/pipeline/link_probe.py)."""
MAX_FORMER_PEERS = 64
MAX_ADVERT_LAYERS = 256
"""Layers a stage's advert reports figures of (expert load): far more than one stage holds."""
MAX_REPLICAS = 1 << 16
"""RunSpec's bound on R."""
MAX_CERTIFICATE_BYTES = 1024
"""A sealed Delegation (protocol/trust/delegation.py) is about 300 bytes."""
MAX_DELEGATION_S = 366 * 86400.0
"""Longest a certificate may be valid: expiry is its only revocation, so none outlives a year."""
ANY_RUN = "*"
"""Delegation.run for a certificate valid for every run of the operator."""
"""Replacements remembered per slot (a run that churns more than that forgets the oldest)."""
"""Peer ids, hosts, device and version strings."""


def _check_text(where: str, value: str, *, empty_ok: bool = True) -> None:
    if len(value) > MAX_TEXT or (not value and not empty_ok):
        raise ValueError(f"{where}={describe(value)} must be {0 if empty_ok else 1}-{MAX_TEXT} characters")


def _check_relay_addr(where: str, addr: str) -> None:
    """Empty, or RELAY_MULTIADDR/p2p-circuit/p2p/PEER_ID (node/pipeline/fallback.py dials only its own relay)."""
    _check_text(where, addr)
    relay, sep, peer = addr.partition("/p2p-circuit/p2p/")
    if addr and (not sep or not relay.startswith("/") or "/p2p/" not in relay or not peer or "/" in peer):
        raise ValueError(f"{where}={describe(addr)} is not RELAY_MULTIADDR/p2p-circuit/p2p/PEER_ID")


def _check_port(where: str, port: int) -> None:
    check_range(where, port, 0, MAX_PORT)


def _check_certificate(where: str, certificate: bytes) -> None:
    if len(certificate) > MAX_CERTIFICATE_BYTES:
        raise ValueError(
            f"{where} holds {len(certificate)} bytes, more than a certificate's {MAX_CERTIFICATE_BYTES}"
        )


NodeState = Literal["idle", "assigned", "training", "done", "failed", "leaving"]
""""leaving": the node was given notice (SIGTERM) and is shutting down; its slot is free at once."""
RunState = Literal["pending", "running", "stopping", "stopped", "done", "failed"]


@dataclass(kw_only=True, frozen=True)
class Endpoint:
    """A node's direct TCP endpoint for pipeline traffic."""

    peer_id: str
    host: str
    port: int
    relay_addr: str = ""
    """Set when nobody can dial host:port: where the node is reached through a relay instead
    (RELAY/p2p-circuit/p2p/PEER, node/pipeline/fallback.py)."""

    def __post_init__(self) -> None:
        _check_text("Endpoint.peer_id", self.peer_id, empty_ok=False)
        _check_text("Endpoint.host", self.host, empty_ok=False)
        _check_port("Endpoint.port", self.port)
        _check_relay_addr("Endpoint.relay_addr", self.relay_addr)


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
    ref_block: str = ""
    """Which reference block (protocol/reference_block.py) `ref_block_s` timed ("" = none)."""
    ref_block_s: float = 0.0
    """Seconds of one forward + backward of that block in this node's default precision (0 = not
    measured): the planner scales it to a run's stages (what the node sustains on training work)."""
    price_per_hour: float
    """What the provider charges, USD per hour."""
    host: str
    port: int
    """Pipeline TCP port."""
    health_port: int
    reachable: bool = True
    """Whether peers could dial host:port back at join (node/reachability.py); False: reach it at
    `relay_addr`, or not at all."""
    relay_addr: str = ""
    """Where the node serves relayed pipeline links (RELAY/p2p-circuit/p2p/PEER); empty: it has no relay."""
    link_transport: dict[str, str] = field(default_factory=dict)
    """Its current pipeline links' transports by neighbour peer id: "direct" or "relayed"."""
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
    mail_key: str = ""
    """The node's X25519 grant-mail public key, 64 hex characters (protocol/trust/grant_mail.py): set when
    it writes through grants, so the coordinator seals them to it; empty otherwise."""
    expert_load: dict[str, float] = field(default_factory=dict)
    """MoE runs: max / mean tokens per expert of each of the stage's MoE layers (by layer) in the last
    agreed step's load, every replica's tokens (node/sync/expert_bias.py); empty otherwise."""

    def __post_init__(self) -> None:
        check_finite(self)
        if len(self.expert_load) > MAX_ADVERT_LAYERS:
            raise ValueError(
                f"NodeAdvert.expert_load names {len(self.expert_load)} layers, over {MAX_ADVERT_LAYERS}"
            )
        for layer, ratio in self.expert_load.items():
            _check_text("NodeAdvert.expert_load key", layer, empty_ok=False)
            check_range(f"NodeAdvert.expert_load[{describe(layer)}]", ratio, 0, 1 << 12)  # at most E
        if self.mail_key and not (
            len(self.mail_key) == 64 and all(c in "0123456789abcdef" for c in self.mail_key)
        ):
            raise ValueError(
                f"NodeAdvert.mail_key={describe(self.mail_key)} must be 64 lowercase hex characters or empty"
            )
        for name in ("peer_id", "version", "device", "host"):
            _check_text(f"NodeAdvert.{name}", getattr(self, name), empty_ok=name in ("version", "device"))
        _check_relay_addr("NodeAdvert.relay_addr", self.relay_addr)
        if len(self.link_transport) > 2 or not set(self.link_transport.values()) <= {"direct", "relayed"}:
            raise ValueError(
                f"NodeAdvert.link_transport={describe(self.link_transport)} must name at most 2 links, each "
                '"direct" or "relayed"'
            )
        for peer in self.link_transport:
            _check_text("NodeAdvert.link_transport key", peer)
        for name in ("memory_gb", "free_memory_gb"):
            check_range(f"NodeAdvert.{name}", getattr(self, name), 0, MAX_MEMORY_GB)
        for name in ("tflops", "tflops_fp32", "tflops_bf16"):
            check_range(f"NodeAdvert.{name}", getattr(self, name), 0, MAX_TFLOPS)
        _check_text("NodeAdvert.ref_block", self.ref_block, empty_ok=True)  # unknown names are ignored
        check_range("NodeAdvert.ref_block_s", self.ref_block_s, 0, 3600)
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
        """Where neighbours reach it: its relayed address too when it cannot be dialed."""
        relay = self.relay_addr if not self.reachable else ""
        return Endpoint(peer_id=self.peer_id, host=self.host, port=self.port, relay_addr=relay)


@dataclass(kw_only=True, frozen=True)
class RunRecord:
    """A launched run as published in the DHT (subkey = run id), signed by the operator/coordinator."""

    spec: RunSpec
    state: RunState = "pending"
    term: int = 0
    coordinator: str = ""
    """Peer id of the coordinator holding the run's lease."""
    updated: float = 0.0
    reason: str = ""
    """Why the run failed (the nodes' reported errors), for `status` and `--watch`."""
    certificate: bytes = b""
    """The signer's certificate (a Delegation sealed by the operator's key, protocol/trust/delegation.py) when a
    coordinator key signed this; empty when the operator's key signed it itself."""
    dashboard: str = ""
    """URL of the leading coordinator's dashboard (`status` prints it); empty when it serves none."""

    def __post_init__(self) -> None:
        check_range("RunRecord.term", self.term, 0, MAX_COUNT)
        _check_text("RunRecord.dashboard", self.dashboard)
        _check_text("RunRecord.coordinator", self.coordinator)
        _check_text("RunRecord.reason", self.reason)
        check_range("RunRecord.updated", self.updated, 0, MAX_TIME_S)
        _check_certificate("RunRecord.certificate", self.certificate)

    @property
    def run_id(self) -> str:
        return self.spec.run_id


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
    former_stage_peers: dict[str, list[str]] = field(default_factory=dict)
    """Replica index -> peer ids that served this stage in that replica earlier in the run (replaced after
    churn). Their fragments of past rounds, listed in an agreed round record, are still that slot's: a
    rebuilt replica replaying those rounds applies exactly what the others applied."""
    certificate: bytes = b""
    """The signer's certificate (a Delegation sealed by the operator's key, protocol/trust/delegation.py) when a
    coordinator key signed this; empty when the operator's key signed it itself."""
    group_peers: dict[str, dict[str, str]] = field(default_factory=dict)
    """Layer group (`RunSpec.layer_groups`, as a string) -> replica -> the peer whose stage holds that
    group in that replica: the signer of the group's fragments. Set for each group of this stage when the
    run's replicas differ in layer split (`RunSpec.mixed_layout`); empty otherwise, where each group's
    signers are `stage_peers` (which then name only replicas of this one's split)."""
    former_group_peers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """As `former_stage_peers`, per layer group (with `group_peers`)."""

    def __post_init__(self) -> None:
        check_run_id("Assignment.run_id", self.run_id)
        _check_certificate("Assignment.certificate", self.certificate)
        if self.run_id != self.spec.run_id:
            raise ValueError(
                f"Assignment.run_id={describe(self.run_id)} must equal its spec's run_id "
                f"{describe(self.spec.run_id)}"
            )
        check_range("Assignment.term", self.term, 0, MAX_COUNT)
        check_range("Assignment.epoch", self.epoch, 0, MAX_COUNT)
        _check_text("Assignment.peer_id", self.peer_id, empty_ok=False)
        check_range("Assignment.replica", self.replica, -1, self.spec.replicas - 1)
        check_range("Assignment.stage", self.stage, -1, self.spec.stages_of(self.replica) - 1)  # -1: released
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
        for r, peers in self.former_stage_peers.items():
            if not (r.isdecimal() and len(r) <= 6 and int(r) < self.spec.replicas):
                raise ValueError(
                    f"Assignment.former_stage_peers key {describe(r)} must be a replica index below "
                    f"replicas={self.spec.replicas}"
                )
            check_range(f"Assignment.former_stage_peers[{r}] length", len(peers), 0, MAX_FORMER_PEERS)
            for peer in peers:
                _check_text(f"Assignment.former_stage_peers[{r}]", peer, empty_ok=False)
        self._check_groups()

    def _check_groups(self) -> None:
        mine = set(self.spec.groups_of(self.replica, self.stage)) if self.stage >= 0 else set()
        for where, table in (
            ("group_peers", self.group_peers),
            ("former_group_peers", self.former_group_peers),
        ):
            for g, by_replica in table.items():
                if not (g.isdecimal() and len(g) <= 6 and int(g) in mine):
                    raise ValueError(
                        f"Assignment.{where} key {describe(g)} must be a layer group of this stage "
                        f"({sorted(mine)})"
                    )
                for r, peers in by_replica.items():
                    if not (r.isdecimal() and len(r) <= 6 and int(r) < self.spec.replicas):
                        raise ValueError(
                            f"Assignment.{where}[{g}] key {describe(r)} must be a replica index below "
                            f"replicas={self.spec.replicas}"
                        )
                    names = [peers] if isinstance(peers, str) else peers
                    check_range(f"Assignment.{where}[{g}][{r}] length", len(names), 0, MAX_FORMER_PEERS)
                    for peer in names:
                        _check_text(f"Assignment.{where}[{g}][{r}]", peer, empty_ok=False)
        if self.spec.mixed_layout and mine and {int(g) for g in self.group_peers} != mine:
            raise ValueError(
                f"Assignment.group_peers names layer groups {sorted(self.group_peers)}: a run whose replicas "
                f"differ in split needs the signers of each of the stage's groups {sorted(mine)}"
            )


@dataclass(kw_only=True, frozen=True)
class Lease:
    """A run's coordinator lease in the store; written with conditional PUTs (If-None-Match / If-Match)."""

    run_id: str
    term: int
    holder: str
    expires_at: float
    certificate: bytes = b""
    """The signer's certificate (a Delegation sealed by the operator's key, protocol/trust/delegation.py) when a
    coordinator key signed this; empty when the operator's key signed it itself."""

    def __post_init__(self) -> None:
        check_run_id("Lease.run_id", self.run_id)
        _check_certificate("Lease.certificate", self.certificate)
        check_range("Lease.term", self.term, 0, MAX_COUNT)
        _check_text("Lease.holder", self.holder)
        check_range("Lease.expires_at", self.expires_at, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class TermClaim:
    """The write-once claim of a lease term (`{run}/terms/{term:06d}`), signed by the claimant: a term
    counts for the fencing floor only when a trusted coordinator claimed it (coordinator/lease.py)."""

    run_id: str
    term: int
    holder: str
    claimed_at: float
    """Unix time of the claim: its certificate is checked as of then (it may have expired since)."""
    certificate: bytes = b""
    """As in Lease: the signer's certificate, empty when the operator's key signed."""

    def __post_init__(self) -> None:
        check_run_id("TermClaim.run_id", self.run_id)
        _check_certificate("TermClaim.certificate", self.certificate)
        check_range("TermClaim.term", self.term, 1, MAX_COUNT)
        _check_text("TermClaim.holder", self.holder)
        check_range("TermClaim.claimed_at", self.claimed_at, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class RunControl:
    """Operator request for a run (stop)."""

    run_id: str
    action: Literal["stop"]
    issued_at: float
    certificate: bytes = b""
    """The signer's certificate (a Delegation sealed by the operator's key, protocol/trust/delegation.py) when a
    coordinator key signed this; empty when the operator's key signed it itself."""

    def __post_init__(self) -> None:
        check_run_id("RunControl.run_id", self.run_id)
        _check_certificate("RunControl.certificate", self.certificate)
        check_range("RunControl.issued_at", self.issued_at, 0, MAX_TIME_S)


@dataclass(kw_only=True, frozen=True)
class Delegation:
    """A certificate: the operator's key (the signer of the envelope around it) lets the key `subject` sign
    as `role` for the run `run` (or every run: "*") from `issued_at` until `expires_at`. Carried in the
    `certificate` field of what the subject signs; checked by protocol/trust/delegation.py."""

    subject: str
    """Peer id (12D3KooW...) of the certified key."""
    role: str = "coordinator"
    """What the key may sign as; "coordinator" (leases, run records, assignments, control objects)."""
    run: str
    """The run id the certificate is valid for, or "*" (ANY_RUN) for every run."""
    issued_at: float
    """Unix time of issue (readers allow a few minutes of clock skew before it)."""
    expires_at: float
    """Unix time from which the certificate is void; at most MAX_DELEGATION_S after issued_at."""

    def __post_init__(self) -> None:
        _check_text("Delegation.subject", self.subject, empty_ok=False)
        if not 1 <= len(self.role) <= 64:
            raise ValueError(f"Delegation.role={describe(self.role)} must be 1-64 characters")
        if self.run != ANY_RUN:
            check_run_id("Delegation.run", self.run)
        check_range("Delegation.issued_at", self.issued_at, 0, MAX_TIME_S)
        check_range("Delegation.expires_at", self.expires_at, 0, MAX_TIME_S)
        if not 0 < self.expires_at - self.issued_at <= MAX_DELEGATION_S:
            raise ValueError(
                f"Delegation.expires_at={describe(self.expires_at)} must lie after issued_at="
                f"{describe(self.issued_at)} and at most {MAX_DELEGATION_S:g} s (366 days) after it"
            )


MAX_HELLO_ASSIGNMENT_BYTES = 4 << 20
"""The sealed Assignment a Hello carries: as large as an envelope may be (protocol/envelope.py)."""


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
    probe_bytes: int = 0
    """> 0: not a pipeline link but a bandwidth probe of this many bytes (node/pipeline/link_probe.py)."""
    assignment: bytes = b""
    """The sender's own Assignment as its coordinator sealed it, naming the recipient as its `next`: the
    recipient holds only connections from nodes a trusted coordinator placed upstream of it
    (node/pipeline/hello_proof.py). Empty in a probe, and from builds before it."""

    def __post_init__(self) -> None:
        check_run_id("Hello.run_id", self.run_id)
        for name in ("term", "epoch", "replica", "stage", "start_step"):
            check_range(f"Hello.{name}", getattr(self, name), 0, MAX_COUNT)
        _check_text("Hello.peer_id", self.peer_id, empty_ok=False)
        _check_text("Hello.to_peer_id", self.to_peer_id)
        check_range("Hello.sent_at", self.sent_at, 0, MAX_TIME_S)
        check_range("Hello.probe_bytes", self.probe_bytes, 0, MAX_PROBE_BYTES)
        check_range("Hello.assignment length", len(self.assignment), 0, MAX_HELLO_ASSIGNMENT_BYTES)
        if self.probe_bytes and self.assignment:
            raise ValueError(
                "Hello.assignment must be empty in a probe (probe_bytes > 0): a probe is never held"
            )


@dataclass(kw_only=True, frozen=True)
class RecordEntry:
    """One fragment an agreed round uses: whose slot, who signed it, and the sha256 of its bytes (which,
    with the slot and signer, is its store key)."""

    replica: int
    signer: str
    digest: str

    def __post_init__(self) -> None:
        check_range("RecordEntry.replica", self.replica, 0, MAX_REPLICAS - 1)
        _check_text("RecordEntry.signer", self.signer, empty_ok=False)
        if len(self.digest) != 64 or any(c not in "0123456789abcdef" for c in self.digest):
            raise ValueError(f"RecordEntry.digest={describe(self.digest)} must be 64 lowercase hex digits")


@dataclass(kw_only=True, frozen=True)
class RoundRecord:
    """The agreed set of one round as builds before issue 21 wrote it (first writer wins) at
    `keys.round_record_key`. Nothing writes or reads it now (the set is the store's, node/sync/round_rule.py);
    it stays in the protocol because stores of older runs hold such records, and the attack tests and
    scripts/fuzz.py plant and parse them as a hostile member would."""

    run_id: str
    stage: int
    fragment: int
    round: int
    entries: list[RecordEntry]

    def __post_init__(self) -> None:
        check_run_id("RoundRecord.run_id", self.run_id)
        for name in ("stage", "fragment", "round"):
            check_range(f"RoundRecord.{name}", getattr(self, name), 0, MAX_COUNT)
        check_range("RoundRecord.entries length", len(self.entries), 0, MAX_REPLICAS)
        replicas = [e.replica for e in self.entries]
        if replicas != sorted(set(replicas)):
            raise ValueError("RoundRecord.entries must name each replica at most once, in replica order")


MAX_ROUTE_BYTES = 1 << 20
"""A RouteCounts' counts: 4 bytes per (MoE layer, expert), e.g. 16 layers x 256 experts = 16 KiB; 1 MiB
bounds what a reader decodes."""
MAX_ROUTE_RECORD_BYTES = MAX_ROUTE_BYTES + 4096
"""A RouteCounts envelope as stored: its counts plus a signed header of a few hundred bytes."""


@dataclass(kw_only=True, frozen=True)
class RouteCounts:
    """One replica's routing statistics of one inner step of one layer group (issue 24): for each MoE layer
    of the group, the tokens its router sent to each expert (node/sync/expert_bias.py). Signed by a node of the slot and
    written once at `keys.route_key`; the step's agreed set of them moves every replica's expert bias
    alike (node/sync/route_exchange.py)."""

    run_id: str
    group: int
    step: int
    """The inner step (0-based) whose forward passes routed these tokens."""
    replica: int
    tokens: int
    """Tokens the step trained on (each is routed to top_k experts in each layer)."""
    experts: int
    layers: list[int]
    """The group's MoE layers, ascending."""
    counts: bytes
    """len(layers) x experts little-endian uint32, layer-major."""

    def __post_init__(self) -> None:
        check_run_id("RouteCounts.run_id", self.run_id)
        for name in ("group", "step", "tokens"):
            check_range(f"RouteCounts.{name}", getattr(self, name), 0, MAX_COUNT)
        check_range("RouteCounts.replica", self.replica, 0, MAX_REPLICAS - 1)
        check_range("RouteCounts.experts", self.experts, 1, 1 << 12)
        if self.layers != sorted(set(self.layers)) or any(not 0 <= x < 1 << 12 for x in self.layers):
            raise ValueError(f"RouteCounts.layers={describe(self.layers)} must be distinct layers, ascending")
        want = 4 * len(self.layers) * self.experts
        if len(self.counts) != want or want > MAX_ROUTE_BYTES:
            raise ValueError(
                f"RouteCounts.counts holds {len(self.counts)} bytes; {len(self.layers)} layers x "
                f"{self.experts} experts need {want} (at most {MAX_ROUTE_BYTES})"
            )


MAX_META_ENTRIES = 64
"""Entries in a checkpoint's `meta` (data position, seeds, counters): a few are needed, 64 bound the manifest."""
MAX_STORE_KEY = 1024
"""S3's longest object key, in bytes (ASCII here)."""
_SHA256_HEX = frozenset("0123456789abcdef")


def _check_sha256(where: str, value: str) -> None:
    if len(value) != 64 or not _SHA256_HEX.issuperset(value):
        raise ValueError(f"{where}={describe(value)} must be a sha256 digest: 64 lowercase hex digits")


def _check_ckpt_slot(cls: str, run_id: str, stage: int, replica: int, rnd: int) -> None:
    check_run_id(f"{cls}.run_id", run_id)
    check_range(f"{cls}.stage", stage, 0, MAX_COUNT)
    check_range(f"{cls}.replica", replica, 0, MAX_REPLICAS - 1)
    check_range(f"{cls}.round", rnd, 0, MAX_COUNT)


@dataclass(kw_only=True, frozen=True)
class CheckpointManifest:
    """What one (run, stage, replica) checkpoint at a round boundary holds: its tensors object (one
    safetensors file, named by key, size and sha256) and the little that is not a tensor (`meta`).
    Signed by the node that wrote it; readers check every field against what they asked for and the
    object against size and hash before loading a byte of it (protocol/checkpoint.py)."""

    run_id: str
    stage: int
    replica: int
    round: int
    """Outer round the checkpoint closes: training resumes at the start of round `round`."""
    step: int
    """Inner step at that boundary."""
    created_at: float
    """Unix time the writer sealed the manifest."""
    tensors_key: str
    """Store key of the safetensors object."""
    tensors_bytes: int
    tensors_sha256: str
    """Lowercase hex sha256 of the whole safetensors object."""
    meta: dict[str, int | float | str] = field(default_factory=dict)
    """Small non-tensor state (e.g. the data position): at most MAX_META_ENTRIES entries, keys 1-256
    characters, string values at most 256, numbers finite."""

    def __post_init__(self) -> None:
        check_finite(self)
        _check_ckpt_slot("CheckpointManifest", self.run_id, self.stage, self.replica, self.round)
        check_range("CheckpointManifest.step", self.step, 0, MAX_COUNT)
        check_range("CheckpointManifest.created_at", self.created_at, 0, MAX_TIME_S)
        if not 0 < len(self.tensors_key) <= MAX_STORE_KEY:
            raise ValueError(
                f"CheckpointManifest.tensors_key={describe(self.tensors_key)} must be 1-{MAX_STORE_KEY} characters"
            )
        check_range("CheckpointManifest.tensors_bytes", self.tensors_bytes, 0, MAX_COUNT)
        _check_sha256("CheckpointManifest.tensors_sha256", self.tensors_sha256)
        if len(self.meta) > MAX_META_ENTRIES:
            raise ValueError(
                f"CheckpointManifest.meta holds {len(self.meta)} entries, more than {MAX_META_ENTRIES}; "
                "keep tensors in the tensors object and only a few scalars here"
            )
        for k, v in self.meta.items():
            if not isinstance(k, str):
                raise ValueError(f"CheckpointManifest.meta key {describe(k)} must be a string")
            _check_text("CheckpointManifest.meta key", k, empty_ok=False)
            if isinstance(v, str):
                _check_text(f"CheckpointManifest.meta[{describe(k)}]", v)
            elif isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(
                    f"CheckpointManifest.meta[{describe(k)}]={describe(v)} must be an int, a float or a string"
                )
            elif isinstance(v, int):
                check_range(f"CheckpointManifest.meta[{describe(k)}]", v, -(2**63), 2**63 - 1)


@dataclass(kw_only=True, frozen=True)
class CheckpointPointer:
    """The LATEST pointer of one (run, stage, replica): the round of its newest complete checkpoint and
    the sha256 of that round's manifest envelope. Written only after the tensors and the manifest are in,
    so a reader that finds it finds a whole checkpoint."""

    run_id: str
    stage: int
    replica: int
    round: int
    manifest_key: str
    manifest_sha256: str
    """Lowercase hex sha256 of the manifest envelope's bytes as stored."""

    def __post_init__(self) -> None:
        _check_ckpt_slot("CheckpointPointer", self.run_id, self.stage, self.replica, self.round)
        if not 0 < len(self.manifest_key) <= MAX_STORE_KEY:
            raise ValueError(
                f"CheckpointPointer.manifest_key={describe(self.manifest_key)} must be 1-{MAX_STORE_KEY} "
                "characters"
            )
        _check_sha256("CheckpointPointer.manifest_sha256", self.manifest_sha256)

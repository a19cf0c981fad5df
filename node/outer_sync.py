"""Cross-replica outer loop through the object store: capture -> upload/fetch -> apply, per fragment.

DiLoCo (arXiv 2311.08105) / SparseLoCo (arXiv 2508.15706) with Streaming DiLoCo's fragments and overlap
(arXiv 2501.18512). The stage's parameters are split into P strided fragments; with q = floor(H/P),
fragment f is captured at inner step c_f = (f+1) q of each H-step cycle and applied at a_f = c_f + tau:

    Delta_r   = theta_anchor - theta_local(c_f)          # pseudo-gradient (codec may compress it)
    Delta_bar = aggregate({decode(c_j) : j arrived})     # over replicas whose fragment arrived in time
    theta_anchor <- theta_anchor - alpha * Delta_bar     # (DiLoCo: Nesterov momentum on Delta_bar)
    theta(a_f)  <- theta_anchor + (theta(a_f) - theta(c_f))   # keep the tau steps of local drift

Upload and fetch run on a background I/O thread while training goes on for tau steps; applying blocks
only for what is still in flight, and that wait is recorded.

Fragment keys are write-once (conditional PUT, If-None-Match): every reader of a key sees the same bytes,
so an object cannot be swapped between two replicas' reads. If our key already holds other bytes
(a faulty writer got there first, or our own upload from before a restart), we treat our slot exactly
as every other replica does: use those bytes if they validate against this slot's signer, leave the
slot out if not. The consensus stays identical, and our unused contribution goes back to the codec
(SparseLoCo's error feedback sends it in a later round). A store that does not answer is retried
until the round's deadline.

Waiting for the other replicas GETs keys every reader can compute (the round record, each signer's
primary fragment key) with exponential backoff, and LISTs the round rarely (`OuterSync._listing`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from node.aggregation import mean_over_arrivals
from node.stage_checkpoints import StageCheckpoints
from protocol import keys
from protocol.checkpoint import Checkpoint
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import RecordEntry, RoundRecord
from protocol.schema import ProtocolError
from protocol.store import ObjectStore, ObjectTooLarge, StoreError

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1 << 20
"""A round record lists at most one entry (~130 bytes) per replica."""


class RoundAgreementError(RuntimeError):
    """The round's agreed set cannot be applied here (a listed fragment stayed out of reach)."""


@dataclass(frozen=True)
class FragmentId:
    run_id: str
    stage: int
    fragment: int
    round: int
    replica: int


Encoding = Callable[[], tuple[bytes, list[torch.Tensor]]]
"""The host half of an encode: () -> (signed wire bytes, the contribution exactly as receivers decode it,
as float32 CPU tensors). OuterSync runs it on its I/O thread, so entropy coding and signing overlap training."""


class FragmentCodec(Protocol):
    """Turns a fragment's pseudo-gradient into signed wire bytes and back."""

    def encode(self, fid: FragmentId, delta: list[torch.Tensor]) -> Encoding:
        """Run what must happen before training moves on (e.g. error feedback, on delta's device) and
        return the rest as an `Encoding` for the I/O thread."""
        ...

    def decode(
        self, fid: FragmentId, data: bytes, shapes: list[torch.Size], signer: str
    ) -> list[torch.Tensor]:
        """Validate (signature by `signer`, header, shapes, finiteness) and decode; raise ProtocolError."""
        ...

    def restore(self, fid: FragmentId, unsent: list[torch.Tensor]) -> None:
        """Our upload of `fid` did not land: keep `unsent` (what encode returned) for a later round."""
        ...

    def residual(self, fragment: int) -> list[torch.Tensor]:
        """What the codec carries into `fragment`'s next encode, one tensor per parameter of the fragment
        (SparseLoCo: its error feedback), for the round owner to confine; [] if nothing (yet)."""
        ...

    identity: Identity
    """Signs our fragments and the round records we write."""

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


Aggregator = Callable[[dict[int, list[torch.Tensor]]], list[torch.Tensor]]


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


@dataclass
class _Exchanged:
    contribs: dict[int, list[torch.Tensor]]
    """Replica -> decoded contribution; for our slot, whatever every replica reads at our key."""
    unsent: list[torch.Tensor] | None
    """Our contribution when the round did not use it (handed back to the codec at apply time)."""


TOO_LARGE = "too large"
"""What `_Gathered.seen` notes for a key whose object was refused by its size (no digest was taken)."""


@dataclass
class _Gathered:
    """One replica's view of one round's fragments while it gathers them."""

    contribs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Replica -> decoded contribution."""
    used: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Replica -> (signer, sha256) of what contribs holds."""
    bad: set[str] = field(default_factory=set)
    """Keys that held no valid fragment of their slot: never read again."""
    seen: dict[str, str] = field(default_factory=dict)
    """Key -> sha256 of the bytes it held when read (or TOO_LARGE); keys are written once, so it stays so."""


class _Backoff:
    """The wait between two polls of the store: first_s, doubled after each poll up to cap_s, never past
    the deadline; back to first_s when something arrived (the replicas' uploads come close together)."""

    def __init__(self, first_s: float, cap_s: float) -> None:
        self.first_s, self.cap_s, self.delay_s = first_s, cap_s, first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    def wait(self, deadline: float) -> None:
        time.sleep(max(0.0, min(self.delay_s, deadline - time.monotonic())))
        self.delay_s = min(2 * self.delay_s, self.cap_s)


@dataclass
class _Pending:
    fid: FragmentId
    theta_at_capture: list[torch.Tensor]
    future: Future[_Exchanged]
    apply_step: int


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
    last_contributors: list[int] = field(default_factory=list)
    bytes_records: int = 0
    """Round records we wrote (a few hundred bytes per round and fragment; not in bytes_up)."""


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
        H: int,
        P: int,
        tau: int,
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
    ) -> None:
        """poll_s, poll_max_s: the first and the longest wait between two polls of the store for the
        other replicas' fragments (exponential backoff). local and checkpoints: what step_done()
        checkpoints, every `checkpoint_every` rounds, and where (neither: no checkpoints, as in the
        benchmarks). confine: the parameters confined to a subspace, whose Delta_bar and codec residual
        are projected onto it (None: none are)."""
        if not 0 <= tau < H or not 0 < P <= H:
            raise ValueError(f"need 0 <= tau < H and 0 < P <= H, got H={H} P={P} tau={tau}")
        if not 0 < poll_s <= poll_max_s:
            raise ValueError(f"need 0 < poll_s <= poll_max_s, got poll_s={poll_s} poll_max_s={poll_max_s}")
        self.params = params
        self.store, self.codec = store, codec
        self.run_id, self.stage, self.replica = run_id, stage, replica
        self.stage_peers = dict(stage_peers)
        self.former: dict[int, set[str]] = {r: set(v) for r, v in (former_stage_peers or {}).items()}
        self.H, self.P, self.tau, self.alpha, self.momentum = H, P, tau, alpha, momentum
        self.timeout_s, self.poll_s, self.poll_max_s = timeout_s, poll_s, poll_max_s
        self.aggregate = aggregate
        self.local, self.checkpoints, self.checkpoint_every = local, checkpoints, checkpoint_every
        self.confine = confine
        # strided fragments spread big and small tensors evenly: param i belongs to fragment i % P
        self.fragments = [list(range(f, len(params), P)) for f in range(P)]
        self.q = H // P
        self.anchor = [p.detach().clone() for p in params]
        self.outer_m = [torch.zeros_like(p) for p in params] if momentum > 0 else []
        self.stats = SyncStats()
        self._pending: list[_Pending] = []
        self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="outer-io")
        self._lock = threading.Lock()

    # --- schedule ---------------------------------------------------------------------------------
    def capture_offset(self, f: int) -> int:
        """c_f = (f + 1) * floor(H / P), in inner steps from the start of the cycle."""
        return (f + 1) * self.q

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
        rnd, pos = divmod(step, self.H)
        for f in range(self.P):
            c_f = self.capture_offset(f)
            # c_f == H is the cycle's last step, i.e. position 0 of the next cycle
            if step > 0 and pos == c_f % self.H:
                self._capture(f, rnd - 1 if c_f == self.H else rnd, step)

    def apply_due(self, step: int) -> list[int]:
        """Apply phase: fragments whose a_f = c_f + tau falls on `step` (blocks for transfers in flight)."""
        applied = []
        for p in [p for p in self._pending if p.apply_step == step]:
            self._apply(p)
            self._pending.remove(p)
            applied.append(p.fid.fragment)
        return applied

    def round_end(self, step: int) -> int | None:
        """The round that inner step `step` (1-based) ends, or None: rounds end every H steps."""
        return step // self.H if step > 0 and step % self.H == 0 else None

    def checkpoint_due(self, step: int, every: int) -> int | None:
        """The round to checkpoint after inner step `step`, or None. A checkpoint is taken when round r's
        fragments are all applied (tau steps after it ends) and nothing of round r+1 is in flight, so the
        anchor, momentum and error feedback are exactly round r's; every `every` rounds."""
        if every <= 0 or step < self.H or (step - self.tau) % self.H or self._pending:
            return None
        rnd = (step - self.tau) // self.H
        return rnd if rnd % every == 0 else None

    # --- state: checkpoints and digests -----------------------------------------------------------
    def state_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The round owner's state by parameter name: consensus anchor, outer momentum, codec state."""
        if len(names) != len(self.params):
            raise ValueError(f"{len(names)} names for {len(self.params)} parameters")
        out = {f"anchor.{n}": a for n, a in zip(names, self.anchor, strict=True)}
        out.update({f"outer_m.{n}": m for n, m in zip(names, self.outer_m, strict=False)})
        out.update({f"codec.{k}": v for k, v in self.codec.state().items()})
        if self.confine is not None:
            out[ANCHOR_IN_SPAN] = torch.ones(1)
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
        self.codec.load_state({k[len("codec.") :]: v for k, v in state.items() if k.startswith("codec.")})

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
        h = hashlib.sha256()
        for a in self.anchor:
            h.update(a.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

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
    def _capture(self, f: int, rnd: int, step: int) -> None:
        idx = self.fragments[f]
        if self.confine is not None:  # what error feedback carries off the span would be re-sent forever
            for j, e in enumerate(self.codec.residual(f)):
                self.confine.local_(idx[j], e)
        with torch.no_grad():
            theta = [self.params[i].detach().clone() for i in idx]
            delta = [self.anchor[i] - t for i, t in zip(idx, theta, strict=True)]  # Delta = anchor - local
        fid = FragmentId(self.run_id, self.stage, f, rnd, self.replica)
        encoding = self.codec.encode(fid, delta)
        shapes = [self.params[i].shape for i in idx]
        fut = self._io.submit(self._exchange, fid, encoding, shapes)
        self._pending.append(_Pending(fid, theta, fut, step + self.tau))

    def _put_once(self, key: str, data: bytes) -> tuple[bool | None, bytes | None]:
        """Write-once PUT of our fragment: (True, None) if the key holds our bytes, (False, what it holds)
        if it holds other bytes, (None, None) if the store did not answer (try again later)."""
        try:
            if self.store.put_if_absent(key, data) is not None:
                self._count(up=len(data))
                return True, None
        except StoreError as e:
            log.debug("upload of %s failed (retrying until the round's deadline): %s", key, e)
        try:  # refused, or a PUT whose reply was lost: what does the key hold now?
            stored = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except ObjectTooLarge as e:  # somebody else's oversized object: no valid fragment of ours
            log.warning("our fragment key %s: %s", key, e)
            return False, b""
        except StoreError:
            return None, None
        if stored is None:
            return None, None
        return (True, None) if stored == data else (False, stored)

    # --- who may sign a slot -----------------------------------------------------------------------
    def set_stage_peers(self, stage_peers: dict[int, str], former: dict[int, set[str]] | None = None) -> None:
        """The signers of this stage's slots changed (a replica was rebuilt with a new node, or dropped out
        and is no longer waited for): the old signer of a slot stays known for the rounds it signed
        (round records may list its fragments)."""
        known = {r: set(v) for r, v in self.former.items()}
        for r, old in self.stage_peers.items():
            if stage_peers.get(r) != old:
                known.setdefault(r, set()).add(old)
        for r, peers in (former or {}).items():
            known.setdefault(r, set()).update(peers)
        self.former = known
        self.stage_peers = dict(stage_peers)
        if self.checkpoints is not None:
            self.checkpoints.trust([*stage_peers.values(), *(p for ps in known.values() for p in ps)])

    def _signers(self, r: int) -> set[str]:
        """Every signer whose fragments count for replica r's slot: its node now and the ones it replaced."""
        now = self.codec.signer if r == self.replica else self.stage_peers.get(r)
        return ({now} if now else set()) | self.former.get(r, set())

    def _slots(self) -> set[int]:
        return set(self.stage_peers) | {self.replica}

    # --- the exchange -----------------------------------------------------------------------------
    def _listing(self, fid: FragmentId) -> dict[int, list[str]] | None:
        """Fragment keys of this round per replica, keeping only those named by a signer of the replica's
        slot (anything else under the round is not looked at), each signer's primary key first; None if
        the LIST was not answered.

        R2 bills a LIST as a class A operation (12.5x a GET), so the exchange polls the primary keys with
        GETs and lists the round only where no GET can name what is there: once when it starts (what our
        slot holds before we upload; a fragment at a hash-named key from before we got here, written by a
        signer whose primary key was taken or, in a round a resumed run replays, by a build before
        primary keys), and while a missing slot's primary key holds something that is not its signer's
        fragment (the real one is then at a hash-named key)."""
        prefix = keys.sync_prefix(fid.run_id, fid.stage, fid.fragment, fid.round)
        try:
            listed = self.store.list(prefix)
        except StoreError as e:
            log.warning("listing %s failed (polling the primary keys meanwhile): %s", prefix, e)
            return None
        found: dict[int, list[tuple[str, bool, str]]] = {}
        for key in listed:
            parsed = keys.parse_sync_key(prefix, key)
            if parsed is not None and parsed[1] in self._signers(parsed[0]):
                found.setdefault(parsed[0], []).append((parsed[1], parsed[2] is not None, key))
        return {r: [key for *_, key in sorted(ks)] for r, ks in found.items()}

    def _primary(self, fid: FragmentId, r: int, signer: str) -> str:
        return keys.primary_fragment_key(fid.run_id, fid.stage, fid.fragment, fid.round, r, signer)

    def _get_fragment(self, key: str, g: _Gathered) -> bytes | None:
        """The bytes at `key`, refused (ObjectTooLarge) when larger than any valid fragment; None if absent
        or the store did not answer (asked again at the next poll). Notes in g.seen what the key holds."""
        try:
            blob = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except ObjectTooLarge:
            g.seen[key] = TOO_LARGE
            raise
        except StoreError as e:  # transient (503, reset, timeout)
            log.debug("fetch of %s failed (retrying until the round's deadline): %s", key, e)
            return None
        if blob is not None:
            self._count(down=len(blob))
            g.seen[key] = keys.content_digest(blob)
        return blob

    def _reject(self, fid: FragmentId, r: int, key: str, why: Exception, g: _Gathered) -> None:
        g.bad.add(key)
        with self._lock:
            self.stats.rejected += 1
        log.warning("rejected an object under replica %d's slot of %s (%s): %s", r, fid, key, why)

    def _read_record(self, fid: FragmentId, seen_bad: set[bytes]) -> tuple[RoundRecord | None, bool]:
        """(the round's agreed record if one is there and valid, whether any object is at its key).
        A record counts when a signer of this stage's slots signed it for exactly this round and every
        entry names a signer of its slot; an invalid one is logged once and read as absent."""
        key = keys.round_record_key(fid.run_id, fid.stage, fid.fragment, fid.round)
        try:
            blob = self.store.get(key, max_bytes=MAX_RECORD_BYTES)
        except ObjectTooLarge as e:
            self._reject_record(fid, str(e), seen_bad, b"too large")
            return None, True
        except StoreError as e:
            log.debug("reading %s failed (retrying): %s", key, e)
            return None, False
        if blob is None:
            return None, False
        try:
            signed = open_envelope(blob, RoundRecord)
            rec = signed.body
            if not any(signed.signer_id in self._signers(r) for r in self._slots()):
                raise ProtocolError(f"signed by {signed.signer_id}, not a node of this stage")
            if (rec.run_id, rec.stage, rec.fragment, rec.round) != (
                fid.run_id,
                fid.stage,
                fid.fragment,
                fid.round,
            ):
                raise ProtocolError("it is the record of another round")
            for entry in rec.entries:
                if entry.signer not in self._signers(entry.replica):
                    raise ProtocolError(
                        f"it lists a fragment of replica {entry.replica} signed by {entry.signer}"
                    )
        except (ProtocolError, ValueError) as e:  # ValueError: a bad signature
            self._reject_record(fid, str(e), seen_bad, blob)
            return None, True
        return rec, True

    def _reject_record(self, fid: FragmentId, why: str, seen_bad: set[bytes], blob: bytes) -> None:
        if blob not in seen_bad:
            seen_bad.add(blob)
            with self._lock:
                self.stats.rejected += 1
            log.warning(
                "round %d fragment %d: the object at the round record's key is not valid: %s",
                fid.round,
                fid.fragment,
                why,
            )

    def _settle(
        self, fid: FragmentId, used: dict[int, tuple[str, str]], seen_bad: set[bytes]
    ) -> RoundRecord | None:
        """Write our view as the round's record (first writer wins) or adopt the one written first.
        None: no valid record could be had before a second deadline (the key squatted, or the store
        silent); the caller applies its own view."""
        ours = RoundRecord(
            run_id=fid.run_id,
            stage=fid.stage,
            fragment=fid.fragment,
            round=fid.round,
            entries=[RecordEntry(replica=r, signer=sg, digest=d) for r, (sg, d) in sorted(used.items())],
        )
        key = keys.round_record_key(fid.run_id, fid.stage, fid.fragment, fid.round)
        blob = seal(self.codec.identity, ours)
        deadline = time.monotonic() + self.timeout_s
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        while True:
            try:
                if self.store.put_if_absent(key, blob) is not None:
                    with self._lock:
                        self.stats.bytes_records += len(blob)
                    return ours
            except StoreError as e:
                log.debug("writing the round record %s failed (retrying): %s", key, e)
            rec, present = self._read_record(fid, seen_bad)
            if rec is not None:
                return rec
            if time.monotonic() > deadline or present:
                if present:  # squatted: nobody can write a valid record there
                    log.warning(
                        "round %d fragment %d: no valid round record can be written; applying this "
                        "replica's own view (replicas may differ for this round)",
                        fid.round,
                        fid.fragment,
                    )
                return None
            backoff.wait(deadline)

    def _follow(
        self, fid: FragmentId, rec: RoundRecord, g: _Gathered, shapes: list[torch.Size]
    ) -> dict[int, list[torch.Tensor]]:
        """Exactly the record's set: what we hold already, the rest fetched where its signer put it (the
        signer's primary key if it holds the listed bytes, else the key naming their hash). An entry
        whose bytes are not a valid fragment is left out by every replica alike (all read the same
        bytes); one the store will not give us before a second deadline fails the round."""
        final: dict[int, list[torch.Tensor]] = {}
        deadline = time.monotonic() + self.timeout_s
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        for e in rec.entries:
            if g.used.get(e.replica) == (e.signer, e.digest):
                final[e.replica] = g.contribs[e.replica]
                continue
            other = FragmentId(fid.run_id, fid.stage, fid.fragment, fid.round, e.replica)
            where = [
                self._primary(fid, e.replica, e.signer),
                keys.fragment_key(
                    fid.run_id, fid.stage, fid.fragment, fid.round, e.replica, e.signer, e.digest
                ),
            ]
            try:
                while (blob := self._read_listed(where, e.digest, g)) is None:
                    if time.monotonic() > deadline:
                        raise RoundAgreementError(
                            f"round {fid.round} fragment {fid.fragment}: the agreed record lists replica "
                            f"{e.replica}'s fragment {e.digest}, which the store did not give us (at {where[0]} "
                            f"or {where[1]}) within {self.timeout_s:.0f} s; this replica cannot apply the agreed set"
                        )
                    backoff.wait(deadline)
                final[e.replica] = self.codec.decode(other, blob, shapes, e.signer)
            except ProtocolError as err:
                log.warning(
                    "round %d: the record lists an invalid fragment of replica %d: %s",
                    fid.round,
                    e.replica,
                    err,
                )
        return final

    def _read_listed(self, where: list[str], digest: str, g: _Gathered) -> bytes | None:
        """The bytes of sha256 `digest` from the first key of `where` that holds them; None if none does yet.
        Raises ProtocolError where none can: each key held other bytes when read (keys are written once, so
        they are not asked again), or those very bytes were rejected here."""
        todo = [k for k in where if g.seen.get(k, digest) == digest]
        if not todo or any(k in g.bad for k in todo):
            raise ProtocolError("no key of its signer holds those bytes as a valid fragment")
        for key in todo:
            try:
                blob = self._get_fragment(key, g)
            except ObjectTooLarge:
                continue
            if blob is not None and g.seen[key] == digest:
                return blob
        return None

    def _exchange(self, fid: FragmentId, encoding: Encoding, shapes: list[torch.Size]) -> _Exchanged:
        """I/O thread: finish encoding ours, upload it, gather the other replicas' fragments until all
        arrived or the deadline, then agree on the round's set through its write-once round record.

        A slot is settled only by a valid fragment signed by a signer of the replica's slot, found at
        that signer's primary key or at a key that names the signer and the fragment's hash. Anything
        else under the round (a squatter's object, a truncated or forged one, one signed by a stranger) is
        counted as rejected and never read again, and the slot stays open until the deadline: planting
        garbage cannot empty a round. Our own slot is resolved like a peer's: if it already holds a valid
        fragment of ours (uploaded before a restart), every replica may have used that one, so we use it
        too and do not upload a second.

        Whoever settles first (every slot in, or its deadline) writes the set it holds as the round's
        record; every replica that finds a record applies exactly that set, fetching what it lacks, so
        replicas with different deadlines or a late, rebuilt one apply the same set."""
        data, own = encoding()
        me = fid.replica
        own_digest = keys.content_digest(data)
        g = _Gathered()
        bad_records: set[bytes] = set()
        started = time.monotonic()
        deadline = started + self.timeout_s
        expected = self._slots()  # a replica that drops out while we wait still missed this round
        backoff = _Backoff(self.poll_s, self.poll_max_s)
        listed = False
        rec: RoundRecord | None = None
        while True:
            rec, _ = self._read_record(fid, bad_records)
            if rec is not None:
                break
            waiting = sorted(self._slots() - set(g.contribs))
            squatted = any(
                self._primary(fid, r, sg) in g.bad for r in waiting if r != me for sg in self._signers(r)
            )
            found = self._listing(fid) if not listed or squatted else None
            listed = listed or found is not None
            arrived = False
            for r in waiting:
                if found is not None:
                    candidates = found.get(r, [])
                else:  # our slot is not polled: we put ours there
                    candidates = (
                        [] if r == me else [self._primary(fid, r, s) for s in sorted(self._signers(r))]
                    )
                arrived |= self._take(fid, r, candidates, shapes, g, (own, own_digest))
                if r == me and me not in g.contribs:
                    self._put_ours(fid, data, (own, own_digest), shapes, g)
            if not self._slots() - set(g.contribs) or time.monotonic() > deadline:
                rec = self._settle(fid, g.used, bad_records)
                break
            if arrived:
                backoff.reset()
            backoff.wait(deadline)
        contribs = g.contribs if rec is None else self._follow(fid, rec, g, shapes)
        ours_used = contribs.get(me) is own
        if not ours_used:
            with self._lock:
                self.stats.not_uploaded += 1
            own_key = keys.fragment_key(
                fid.run_id, fid.stage, fid.fragment, fid.round, me, self.codec.signer, own_digest
            )
            why_not_ours = (
                "the round's agreed record, written by the replica that settled it first, does not list it"
                if rec is not None and me not in contribs
                else "a valid fragment of this slot was already in the store (from before a restart)"
                if me in contribs
                else "our fragment's key already held other bytes"  # only someone who knew our bytes
                if own_key in g.bad
                else "the object store did not answer before the deadline"
            )
            log.warning(
                "our fragment %s was not used: %s; it stays in error feedback for a later round",
                fid,
                why_not_ours,
            )
        missing = (expected | self._slots()) - set(contribs) - {me}
        if missing:
            with self._lock:
                self.stats.missing += len(missing)
            gone = missing - self._slots()
            log.warning(
                "run %s stage %d round %d fragment %d: replicas %s did not arrive %s; aggregating %s",
                fid.run_id,
                fid.stage,
                fid.round,
                fid.fragment,
                sorted(missing),
                f"(dropped out after {time.monotonic() - started:.1f} s)"
                if gone == missing
                else f"within {self.timeout_s:.0f} s",
                sorted(contribs),
            )
        return _Exchanged(contribs, None if ours_used else own)

    def _take(
        self,
        fid: FragmentId,
        r: int,
        candidates: list[str],
        shapes: list[torch.Size],
        g: _Gathered,
        ours: tuple[list[torch.Tensor], str],
    ) -> bool:
        """Settle slot r in g with the first of `candidates` that holds a valid fragment of it: its bytes
        verify against the signer the key names (a signer of the slot) and, at a key naming a hash, match
        that hash. Each invalid object met before is rejected, once. True if it settled the slot. In our
        slot, our own bytes (a PUT whose reply was lost, a replay) are `ours`, (contribution, sha256)."""
        other = FragmentId(fid.run_id, fid.stage, fid.fragment, fid.round, r)
        for key in (k for k in candidates if k not in g.bad):
            signer, name = key.rsplit("/", 2)[1:]
            try:
                if (blob := self._get_fragment(key, g)) is None:
                    continue
                if name != keys.PRIMARY_NAME and g.seen[key] != name:
                    raise ProtocolError(
                        "its bytes do not match the hash its key names (truncated or planted)"
                    )
                got = self.codec.decode(other, blob, shapes, signer)
            except (ProtocolError, ObjectTooLarge) as e:
                self._reject(fid, r, key, e, g)
                continue
            if r == fid.replica and (signer, g.seen[key]) == (self.codec.signer, ours[1]):
                got = ours[0]
            g.contribs[r], g.used[r] = got, (signer, g.seen[key])
            return True
        return False

    def _put_ours(
        self,
        fid: FragmentId,
        data: bytes,
        ours: tuple[list[torch.Tensor], str],
        shapes: list[torch.Size],
        g: _Gathered,
    ) -> None:
        """Upload our fragment to our primary key, or, if that holds anything but a valid fragment of ours,
        to the key naming its hash, and settle our slot in g with what the round can use: `ours`, or a
        valid fragment of ours already at the primary key (from before a restart). Nothing settled: the
        store did not answer (again at the next poll), or both keys held other bytes."""
        me, signer = fid.replica, self.codec.signer
        primary = self._primary(fid, me, signer)
        by_hash = keys.fragment_key(fid.run_id, fid.stage, fid.fragment, fid.round, me, signer, ours[1])
        for key in (k for k in (primary, by_hash) if k not in g.bad):
            state, stored = self._put_once(key, data)
            if state is None:
                return
            if state:
                g.contribs[me], g.used[me] = ours[0], (signer, ours[1])
                return
            g.seen[key] = keys.content_digest(stored) if stored else TOO_LARGE
            if key == by_hash:
                g.bad.add(key)
                return
            try:
                if not stored:
                    raise ObjectTooLarge("larger than any valid fragment")
                g.contribs[me] = self.codec.decode(fid, stored, shapes, signer)
            except (ProtocolError, ObjectTooLarge) as e:
                self._reject(fid, me, key, e, g)
                continue
            g.used[me] = (signer, g.seen[key])
            return

    def _apply(self, p: _Pending) -> None:
        t = time.perf_counter()
        ex = p.future.result()
        with self._lock:
            self.stats.wait_s += time.perf_counter() - t
            self.stats.rounds_applied += 1
            self.stats.last_contributors = sorted(ex.contribs)
        if ex.unsent is not None:
            self.codec.restore(p.fid, ex.unsent)
        # nothing arrived, not even ours: the anchor stays and the replica restarts from it (+ drift)
        delta_bar = self.aggregate(ex.contribs) if ex.contribs else None
        idx = self.fragments[p.fid.fragment]
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

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.stats.bytes_up += up
            self.stats.bytes_down += down

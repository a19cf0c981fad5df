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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from node.aggregation import mean_over_arrivals
from protocol import keys
from protocol.schema import ProtocolError
from protocol.store import ObjectStore, ObjectTooLarge, StoreError

log = logging.getLogger(__name__)


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

    @property
    def signer(self) -> str:
        """Peer id of the identity that signs our fragments."""
        ...

    @property
    def max_fragment_bytes(self) -> int:
        """The largest object a valid fragment can be: anything bigger at a fragment key is not fetched."""
        ...


Aggregator = Callable[[dict[int, list[torch.Tensor]]], list[torch.Tensor]]


@dataclass
class _Exchanged:
    contribs: dict[int, list[torch.Tensor]]
    """Replica -> decoded contribution; for our slot, whatever every replica reads at our key."""
    unsent: list[torch.Tensor] | None
    """Our contribution when the round did not use it (handed back to the codec at apply time)."""


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


class OuterSync:
    """Streaming outer optimiser for one stage worker."""

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
        H: int,
        P: int,
        tau: int,
        alpha: float,
        momentum: float = 0.0,
        timeout_s: float = 60.0,
        aggregate: Aggregator = mean_over_arrivals,
        poll_s: float = 0.1,
    ) -> None:
        if not 0 <= tau < H or not 0 < P <= H:
            raise ValueError(f"need 0 <= tau < H and 0 < P <= H, got H={H} P={P} tau={tau}")
        self.params = params
        self.store, self.codec = store, codec
        self.run_id, self.stage, self.replica = run_id, stage, replica
        self.stage_peers = dict(stage_peers)
        self.H, self.P, self.tau, self.alpha, self.momentum = H, P, tau, alpha, momentum
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.aggregate = aggregate
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

    def finish(self) -> None:
        """Apply whatever is still pending (end of run) and stop the I/O thread."""
        for p in list(self._pending):
            self._apply(p)
        self._pending.clear()
        self._io.shutdown(wait=True)

    # --- phases -----------------------------------------------------------------------------------
    def _capture(self, f: int, rnd: int, step: int) -> None:
        idx = self.fragments[f]
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

    def _listing(self, fid: FragmentId, signers: dict[int, str]) -> dict[int, list[str]]:
        """Fragment keys of this round per replica, keeping only those named by the replica's signer in
        effect (anything else under the round is not looked at). An unanswered LIST reads as empty."""
        prefix = keys.sync_prefix(fid.run_id, fid.stage, fid.fragment, fid.round)
        try:
            listed = self.store.list(prefix)
        except StoreError as e:
            log.warning("listing %s failed (retrying until the round's deadline): %s", prefix, e)
            return {}
        found: dict[int, list[str]] = {}
        for key in sorted(listed):
            parsed = keys.parse_sync_key(prefix, key)
            if parsed is not None and signers.get(parsed[0]) == parsed[1]:
                found.setdefault(parsed[0], []).append(key)
        return found

    def _fetch_valid(
        self, fid: FragmentId, key: str, shapes: list[torch.Size], signer: str
    ) -> list[torch.Tensor] | None:
        """The decoded fragment at `key` if its bytes match the key's hash and verify against `signer`;
        None if the store did not answer (asked again at the next poll). Raises ProtocolError (or
        ObjectTooLarge) for an object that is not a valid fragment of this slot."""
        try:
            blob = self.store.get(key, max_bytes=self.codec.max_fragment_bytes)
        except ObjectTooLarge:
            raise
        except StoreError as e:  # transient (503, reset, timeout)
            log.debug("fetch of %s failed (retrying until the round's deadline): %s", key, e)
            return None
        if blob is None:
            return None
        self._count(down=len(blob))
        if keys.content_digest(blob) != key.rsplit("/", 1)[1]:
            raise ProtocolError("its bytes do not match the hash its key names (truncated or planted)")
        return self.codec.decode(fid, blob, shapes, signer)

    def _exchange(self, fid: FragmentId, encoding: Encoding, shapes: list[torch.Size]) -> _Exchanged:
        """I/O thread: finish encoding ours, upload it, then fetch every other replica's until all arrived
        or the deadline.

        A slot is settled only by a valid fragment signed by the replica's signer in effect, found at a key
        that names that signer and the fragment's hash. Anything else under the round (a squatter's object,
        a truncated or forged one, one signed by a stranger) is counted as rejected and never read again,
        and the slot stays open until the deadline: planting garbage cannot empty a round. Our own slot is
        resolved like a peer's: if it already holds a valid fragment of ours (uploaded before a restart),
        every replica may have used that one, so we use it too and do not upload a second."""
        data, own = encoding()
        me = fid.replica
        signers = {**self.stage_peers, me: self.codec.signer}
        own_key = keys.sync_key(fid.run_id, fid.stage, fid.fragment, fid.round, me, signers[me], data)
        contribs: dict[int, list[torch.Tensor]] = {}
        bad: set[str] = set()  # keys that held no valid fragment of their slot
        uploaded = False
        why_not_ours = "the object store did not answer before the deadline"
        deadline = time.monotonic() + self.timeout_s
        while True:
            found = self._listing(fid, signers)
            for r in sorted(set(signers) - set(contribs)):
                other = FragmentId(fid.run_id, fid.stage, fid.fragment, fid.round, r)
                for key in found.get(r, []):
                    if key in bad or (r == me and key == own_key):
                        continue
                    try:
                        got = self._fetch_valid(other, key, shapes, signers[r])
                    except (ProtocolError, ObjectTooLarge) as e:
                        bad.add(key)
                        with self._lock:
                            self.stats.rejected += 1
                        log.warning("rejected an object under replica %d's slot of %s: %s", r, fid, e)
                        continue
                    if got is not None:
                        contribs[r] = got
                        if r == me:
                            why_not_ours = (
                                "a valid fragment of ours was already in the store (from before a restart)"
                            )
                        break
                if r == me and me not in contribs and not uploaded:
                    state, _ = self._put_once(own_key, data)
                    if state is True:
                        uploaded = True
                        contribs[me] = own
                    elif state is False:  # our exact key held other bytes: only someone who knew our bytes
                        bad.add(own_key)
                        why_not_ours = "our fragment's key already held other bytes"
            if not set(signers) - set(contribs) or time.monotonic() > deadline:
                break
            time.sleep(self.poll_s)
        ours_used = contribs.get(me) is own
        if not ours_used:
            with self._lock:
                self.stats.not_uploaded += 1
            log.warning(
                "our fragment %s was not used: %s; it stays in error feedback for a later round",
                fid,
                why_not_ours,
            )
        missing = set(signers) - set(contribs) - {me}
        if missing:
            with self._lock:
                self.stats.missing += len(missing)
            log.warning(
                "round %d fragment %d: replicas %s did not arrive within %.0f s; aggregating %s",
                fid.round,
                fid.fragment,
                sorted(missing),
                self.timeout_s,
                sorted(contribs),
            )
        return _Exchanged(contribs, None if ours_used else own)

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

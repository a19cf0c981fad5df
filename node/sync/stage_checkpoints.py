"""Where one stage worker's checkpoints come from and go to (protocol/checkpoint.py holds the format).

The round owner (node/sync/outer_sync.py) decides when a checkpoint is due and what its state is; this class
knows which checkpoints of this stage a node may resume from, in which order replicas are tried (this
replica's own first: a rebuilt replica resumes from its predecessor's), and uploads in the background so
training does not wait.

A round R of replica r's slot counts (docs/reliability.md, "Checkpoint slots bound to their replica") when
  1. the run checkpoints R at all (`checkpoint_rounds`), and the manifest is for R's step;
  2. the manifest is signed by a signer of slot r: a node the signed assignment puts there, now or earlier
     in the run (this node, for its own slot); a node of another slot never counts for this one;
  3. when the stage has other replicas, one of them checkpointed R too, signed by a signer of its slot other
     than the node that signed r's, and the tensors' anchor is the one that checkpoint signed
     (`ANCHOR_META`): a round no other replica reached never counts; with one replica, the slot's own
     signers decide;
  4. (the first stage picking the round) every later stage has a manifest of R of replica r that rules 1-3
     hold for there, its signers those the archived assignments put in each slot: the round the first stage
     passes on is one every later stage's `at_step` takes.
In a run whose replicas differ in layer split (`RunSpec.mixed_layout`), the stages of one index hold different
layers, so rule 3 holds per layer group of the stage: for each group, another replica's checkpoint of the
stage holding it there (`stage_of_group`), signed by a signer of that slot (the assignment's `group_peers`; for
rule 4 the archive) other than the node that signed r's, signs the same digest of the group's anchor
(`GROUP_ANCHOR_META`), and the tensors hold it.
In a butterfly run (`sync.topology = "butterfly"`) no two replicas' anchors are equal, so rule 3 asks only that
another replica checkpointed R, signed by another node (the round was reached), and a replica resumes from its
own slot's checkpoints only: its anchor and its pair bases (what its partners hold with it) are its own.
The newest such round is found by bisection over the run's checkpoint rounds (`newest_round`: a manifest
GET per slot and probe, about log2(rounds) probes), not by listing: junk under ckpt/ costs nothing, and a
LATEST pointer, which anyone with the store's credentials can replay or squat, decides nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol import keys
from protocol.checkpoint import (
    ANCHOR_META,
    Checkpoint,
    CheckpointMissing,
    CheckpointRefused,
    Refusal,
    SignedManifest,
    add_slot_signers,
    anchor_sha256,
    checkpoint_rounds,
    checkpoint_step,
    group_anchor_meta,
    group_anchor_sha256,
    newest_round,
    read_manifest,
    read_round,
    slot_signers,
    write_checkpoint,
)
from protocol.identity import Identity
from protocol.messages import Assignment
from protocol.net.store import ObjectStore, StoreError
from protocol.runspec import RunSpec
from protocol.trust.assignment_archive import read_archive
from protocol.trust.delegation import OperatorTrust

log = logging.getLogger(__name__)

MAX_TRIES = 8
"""Rounds at and below the newest that counts whose tensors a reader tries (a download each) before it gives up."""
LaterSigners = dict[int, dict[int, set[bytes]]] | None
"""Later stage -> replica -> the keys that may sign its checkpoints; None: not known (any valid signature).
In a mixed-layout run: every stage index's (the witnesses of a group sit at any stage of another replica)."""
ReadManifest = Callable[[int, int, set[bytes] | None], SignedManifest | None]
"""(stage, replica, trusted keys or None: any valid signature) -> that slot's verified manifest of the round
at its step, or None (absent or refused): one GET per slot and round, cached."""


@dataclass(frozen=True)
class _Candidate:
    """A slot's manifest of a round that counts (rules 1-4), its tensors not yet read."""

    replica: int
    manifest: SignedManifest
    agreed: set[str | None] | None
    """The anchor digests the vouching replicas' manifests sign (None for a build before digests); None
    when the stage has no other replica."""
    groups: dict[int, set[str | None]] | None = None
    """Mixed-layout run: layer group -> the digests of its anchor the vouching replicas sign (rule 3 per
    group); a group no other replica is known to hold is left out."""


class StageCheckpoints:
    """Checkpoints of (run, stage) for the replica of `assignment`."""

    def __init__(
        self,
        store: ObjectStore,
        identity: Identity,
        assignment: Assignment,
        should_stop: Callable[[], str | None] = lambda: None,
        operator: OperatorTrust | None = None,
    ) -> None:
        """operator: who may sign the run's assignments; with it the first stage reads the assignment archive
        to know the later stages' signers (without it, any valid signature passes rule 4)."""
        self.store, self.identity, self.a = store, identity, assignment
        self.should_stop, self.operator = should_stop, operator
        self.slots = slot_signers([assignment], assignment.stage)
        self.slots.setdefault(assignment.replica, set()).add(identity.public_key)
        self.group_slots: dict[int, dict[int, set[bytes]]] = {}
        """Mixed-layout run: stage -> replica -> the signers of the other replicas' stages holding this
        stage's layer groups (the assignment's `group_peers`, `former_group_peers`)."""
        self._add_group_slots(assignment.group_peers, assignment.former_group_peers)
        self.refused: list[Refusal] = []
        """What the last `latest` or `at_step` refused, and why."""
        self._upload: threading.Thread | None = None
        self.butterfly = assignment.spec.sync.topology == "butterfly"

    def set_stage_peers(
        self,
        stage_peers: dict[str, str],
        former: dict[str, list[str]] | None = None,
        group_peers: Mapping[str, Mapping[str, str]] | None = None,
        former_group_peers: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
    ) -> None:
        """The stage's slots got new nodes (a replica rebuilt): each counts for its own slot from now on, and
        the nodes a slot had before still do. group_peers, former_group_peers: as the assignment's (a
        mixed-layout run's witnesses of each layer group)."""
        add_slot_signers(self.slots, {r: [p] for r, p in stage_peers.items()}, former or {})
        self._add_group_slots(group_peers or {}, former_group_peers or {})

    def _add_group_slots(
        self,
        group_peers: Mapping[str, Mapping[str, str]],
        former: Mapping[str, Mapping[str, Sequence[str]]],
    ) -> None:
        spec = self.a.spec
        n = len(spec.layer_groups())
        for table in ({g: {r: [p] for r, p in by.items()} for g, by in group_peers.items()}, former):
            for g, by in table.items():
                for r, peers in by.items():  # the Assignment checked the keys: decimal, in range
                    if int(g) < n and int(r) < spec.replicas:
                        stage = spec.stage_of_group(int(r), int(g))
                        add_slot_signers(self.group_slots.setdefault(stage, {}), {r: peers})

    def signers(self, replica: int) -> set[bytes]:
        """The keys whose checkpoints of this stage count for `replica`'s slot."""
        return set(self.slots.get(replica, ()))

    def replicas(self) -> list[int]:
        """Replicas tried for a checkpoint: this one first, then the others (a new replica has none)."""
        a = self.a
        if self.butterfly:  # its anchor and pair bases are its slot's alone
            return [a.replica]
        return [a.replica, *sorted(int(r) for r in a.stage_peers if int(r) != a.replica)]

    def _log_resume(self, rnd: int, step: int, replica: int) -> None:
        a = self.a
        log.info(
            "run %s r%d/s%d resumes from round %d (step %d) of replica %d",
            a.run_id,
            a.replica,
            a.stage,
            rnd,
            step,
            replica,
        )

    # --- read ---------------------------------------------------------------------------------------
    def latest(self) -> Checkpoint | None:
        """The newest checkpoint of this stage that counts (module docstring) and that every later stage of
        the same replica also wrote (a replica resumes all its stages at one round); None if none does."""
        a = self.a
        self.refused = []
        later = self._later_signers()
        rounds = checkpoint_rounds(a.spec)
        found: dict[int, list[_Candidate]] = {}

        def counts(rnd: int) -> bool:
            found[rnd] = self._candidates(rnd, later, first_only=True)
            return bool(found[rnd])

        top = newest_round(rounds, counts)
        if top is None:
            return None
        i = rounds.index(top)
        for rnd in reversed(rounds[max(0, i + 1 - MAX_TRIES) : i + 1]):
            for c in self._in_order(rnd, later, found.get(rnd, [])):
                ck = self._load(c, rnd)
                if ck is not None:
                    self._log_resume(ck.round, ck.step, c.replica)
                    return ck
        return None

    def at_step(self, step: int, wait_s: float = 120.0) -> Checkpoint:
        """The checkpoint of the round that ends at `step` (the first stage chose it), from the first
        replica whose one counts; waits for one still being written."""
        a = self.a
        rnd = a.spec.sync.schedule().round_at(step)
        if checkpoint_step(a.spec, rnd) != step:
            raise RuntimeError(
                f"step {step} is not a checkpoint boundary of run {a.run_id} (round {rnd}); cannot resume there"
            )
        deadline = time.monotonic() + wait_s
        self.refused = []
        while True:
            for c in self._candidates(rnd, later={}):
                ck = self._load(c, rnd)
                if ck is not None:
                    self._log_resume(rnd, step, c.replica)
                    return ck
            if time.monotonic() > deadline or self.should_stop():
                why = "; ".join(str(r) for r in self.refused[-3:]) or "none was written"
                raise RuntimeError(
                    f"no valid checkpoint of round {rnd} (step {step}) for stage {a.stage} after "
                    f"{wait_s:.0f} s ({why}); cannot resume"
                )
            time.sleep(0.5)

    def _candidates(self, rnd: int, later: LaterSigners, first_only: bool = False) -> list[_Candidate]:
        """The slots whose manifest of `rnd` counts (rules 1-4), in `replicas()` order: one manifest GET per
        slot of this stage, and of each later stage once a candidate needs it (stopping at the first
        candidate with first_only). later {}: no later stage checked (the last stage; or `at_step`, where
        each later stage reads its own)."""
        a = self.a
        if a.spec.mixed_layout:
            return self._group_candidates(rnd, later, first_only)
        found = self._manifests(a.stage, rnd, self.slots)
        stages: dict[int, dict[int, SignedManifest]] = {}  # later stage -> its slots' manifests of rnd
        out: list[_Candidate] = []
        for r in self.replicas():
            if r not in found:
                continue
            try:
                agreed = _vouched(a.stage, r, rnd, found, sorted(self.slots), a.replica, self.butterfly)
                for s in range(a.stage + 1, a.spec.stages_of(a.replica)) if later != {} else ():
                    signers = None if later is None else later.get(s, {})
                    if s not in stages:
                        stages[s] = self._manifests(s, rnd, signers)
                    if r not in stages[s]:
                        raise CheckpointRefused(
                            keys.ckpt_manifest_key(a.run_id, rnd=rnd, stage=s, replica=r),
                            f"stage {s} of replica {r} has no valid checkpoint of round {rnd}: a replica "
                            "resumes all its stages at one round; trying an earlier one",
                        )
                    _vouched(
                        s,
                        r,
                        rnd,
                        stages[s],
                        sorted(signers if signers is not None else self.slots),
                        a.replica,
                        self.butterfly,
                    )
            except CheckpointRefused as e:
                self._refuse(rnd, e)
                continue
            out.append(_Candidate(replica=r, manifest=found[r], agreed=agreed))
            if first_only:
                break
        return out

    def _group_candidates(self, rnd: int, later: LaterSigners, first_only: bool = False) -> list[_Candidate]:
        """`_candidates` of a mixed-layout run: rule 3 per layer group (module docstring), the witnesses of
        this stage's groups signed by the slots the assignment names (`group_slots`), those of a later
        stage's by the archive's (`later`)."""
        a = self.a
        spec = a.spec
        read = self._reader(rnd)
        own: dict[int, dict[int, set[bytes]]] = {s: dict(by) for s, by in self.group_slots.items()}
        own.setdefault(a.stage, {}).update(self.slots)  # the replicas of this one's split
        out: list[_Candidate] = []
        for r in self.replicas():
            m = read(a.stage, r, self.signers(r))
            if m is None:
                continue
            try:
                groups = _group_vouched(spec, a.stage, r, rnd, m, read, own, a.replica, self.butterfly)
                for s in range(a.stage + 1, spec.stages_of(r)) if later != {} else ():
                    signers = None if later is None else later.get(s, {}).get(r)
                    later_m = read(s, r, signers) if later is None or signers is not None else None
                    if later_m is None:
                        raise CheckpointRefused(
                            keys.ckpt_manifest_key(a.run_id, rnd=rnd, stage=s, replica=r),
                            f"stage {s} of replica {r} has no valid checkpoint of round {rnd}: a replica "
                            "resumes all its stages at one round; trying an earlier one",
                        )
                    _group_vouched(spec, s, r, rnd, later_m, read, later, a.replica, self.butterfly)
            except CheckpointRefused as e:
                self._refuse(rnd, e)
                continue
            out.append(_Candidate(replica=r, manifest=m, agreed=None, groups=groups))
            if first_only:
                break
        return out

    def _reader(self, rnd: int) -> ReadManifest:
        """A `ReadManifest` of round `rnd`, each (stage, replica, signers) asked once; refusals logged."""
        step = checkpoint_step(self.a.spec, rnd)
        seen: dict[tuple[int, int, frozenset[bytes] | None], SignedManifest | None] = {}

        def read(stage: int, replica: int, trusted: set[bytes] | None) -> SignedManifest | None:
            key = (stage, replica, None if trusted is None else frozenset(trusted))
            if key not in seen:
                seen[key] = None
                try:
                    m = read_manifest(
                        self.store,
                        run_id=self.a.run_id,
                        stage=stage,
                        replica=replica,
                        round=rnd,
                        trusted=trusted,
                    )
                    _check_step(m, step)
                    seen[key] = m
                except CheckpointMissing:
                    pass  # none there: a round beyond this slot's newest, or one still being written
                except CheckpointRefused as e:
                    self._refuse(rnd, e)
            return seen[key]

        return read

    def _manifests(
        self, stage: int, rnd: int, signers: dict[int, set[bytes]] | None
    ) -> dict[int, SignedManifest]:
        """Replica -> its verified manifest of (`stage`, `rnd`) at the round's step, signed by a signer of its
        slot (`signers`; None: any valid signature, for the replicas this stage has): a GET per slot.
        Refusals are logged; a slot without one is left out."""
        a = self.a
        step = checkpoint_step(a.spec, rnd)
        found: dict[int, SignedManifest] = {}
        for r in sorted(signers if signers is not None else self.slots):
            try:
                m = read_manifest(
                    self.store,
                    run_id=a.run_id,
                    stage=stage,
                    replica=r,
                    round=rnd,
                    trusted=None if signers is None else signers[r],
                )
                _check_step(m, step)
            except CheckpointMissing:
                continue  # none there: a round beyond this slot's newest, or one still being written
            except CheckpointRefused as e:
                self._refuse(rnd, e)
                continue
            found[r] = m
        return found

    def _in_order(self, rnd: int, later: LaterSigners, first: list[_Candidate]) -> Iterator[_Candidate]:
        """`first` (found while bisecting), then the round's other candidates, asked for only if needed."""
        yield from first
        done = {c.replica for c in first}
        yield from (c for c in self._candidates(rnd, later) if c.replica not in done)

    def _load(self, c: _Candidate, rnd: int) -> Checkpoint | None:
        """The candidate's tensors, verified (checks 3-5) and holding the anchor the vouchers sign; None
        if refused (logged, in `refused`)."""
        a = self.a
        try:
            ck = read_round(
                self.store,
                run_id=a.run_id,
                stage=a.stage,
                replica=c.replica,
                round=rnd,
                trusted=self.signers(c.replica),
                manifest_sha256=c.manifest.sha256,
            )
            if (
                c.agreed is not None
                and None not in c.agreed
                and (got := anchor_sha256(ck.tensors)) not in c.agreed
            ):
                raise CheckpointRefused(
                    c.manifest.manifest.tensors_key,
                    f"its anchor {got[:16]}... is not the one the other replicas' checkpoints of round {rnd} "
                    "sign: the consensus of that round is another",
                )
            held = group_anchor_sha256(a.spec, ck.tensors) if c.groups else {}
            for g, agreed in (c.groups or {}).items():
                if None not in agreed and held.get(g) not in agreed:
                    raise CheckpointRefused(
                        c.manifest.manifest.tensors_key,
                        f"its anchor of {_group_name(a.spec, g)} is not the one the other replicas' "
                        f"checkpoints of round {rnd} sign: the consensus of that round is another",
                    )
        except CheckpointRefused as e:
            self._refuse(rnd, e)
            return None
        return ck

    def _later_signers(self) -> LaterSigners:
        """Later stage -> replica -> its signers, from the assignment archive (rule 4); {} for the last
        stage; None without an operator or a readable archive."""
        a = self.a
        if a.stage == a.spec.stages_of(a.replica) - 1:
            return {}
        if self.operator is None:
            return None
        archived = read_archive(self.store, a.spec, self.operator, as_issued=True)
        if not archived:
            log.warning(
                "run %s: no readable assignment archive; the later stages' checkpoints are checked for a "
                "valid signature, not for their slot's signer",
                a.run_id,
            )
            return None
        # a mixed-layout run's later stages have witnesses at any stage index of the other replicas
        stages = (
            range(a.spec.max_stages)
            if a.spec.mixed_layout
            else range(a.stage + 1, a.spec.stages_of(a.replica))
        )
        return {s: slot_signers(archived, s) for s in stages}

    def _refuse(self, rnd: int | None, e: CheckpointRefused) -> None:
        refusal = Refusal(round=rnd, key=e.key, reason=e.reason)
        if refusal not in self.refused:  # at_step asks again every 0.5 s: each reason logged once
            self.refused.append(refusal)
            log.warning("checkpoint refused: %s", refusal)

    # --- write --------------------------------------------------------------------------------------
    def write(self, tensors: dict[str, torch.Tensor], *, step: int, rnd: int) -> None:
        """Snapshot `tensors` to the CPU now (training goes on) and upload them on a background thread;
        the previous upload is waited for first. A failed upload is logged: the next round's tries again."""
        self.join()
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        a = self.a

        def upload() -> None:
            meta: dict[str, int | float | str] = {"data_seed": a.spec.train.data_seed, "data_step": step}
            meta[ANCHOR_META] = anchor_sha256(snapshot)  # what the other replicas' checkpoints compare
            if a.spec.mixed_layout:  # replicas of another split compare layer group by layer group
                meta.update(group_anchor_meta(a.spec, snapshot))
            try:
                write_checkpoint(
                    self.store,
                    self.identity,
                    run_id=a.run_id,
                    stage=a.stage,
                    replica=a.replica,
                    round=rnd,
                    step=step,
                    tensors=snapshot,
                    meta=meta,
                )
            except (StoreError, ValueError, OSError) as e:
                log.warning("checkpoint of round %d not written: %s", rnd, e)

        self._upload = threading.Thread(target=upload, name="checkpoint", daemon=True)
        self._upload.start()

    def join(self) -> None:
        """Wait for the upload in flight, if any."""
        if self._upload is not None:
            self._upload.join()
            self._upload = None


def _vouched(
    stage: int,
    replica: int,
    rnd: int,
    found: dict[int, SignedManifest],
    slots: list[int],
    me: int,
    butterfly: bool = False,
) -> set[str | None] | None:
    """Rule 3 on a stage's manifests of `rnd` (`found`, by replica): the anchor digests that the other
    replicas' manifests sign (None for one written before digests were), counting only those signed by
    another node than `replica`'s (a node serving two slots is no second witness of its own checkpoint);
    None when the stage has no other replica (`slots`), or when its one other replica is the reader's (`me`)
    and that has no checkpoint of `rnd`: the reader's replica was away (dropped, now rebuilt) while the one
    survivor went on, and the rounds it settled alone are the consensus the reader must join (resuming
    before them, it would replay them with both replicas in view). Raises CheckpointRefused when none
    vouches, or none for the anchor `replica`'s claims. butterfly: no anchor is another's, so a vouching
    checkpoint says only that the round was reached ({None}: no digest check)."""
    own = found[replica]
    others = [r for r in slots if r != replica]
    if not others:
        return None
    agreed = {m.anchor_sha256 for r, m in found.items() if r != replica and m.signer != own.signer}
    agreed = {None} if butterfly and agreed else agreed
    if not agreed and others == [me] and me not in found:
        return None
    if not agreed:
        raise CheckpointRefused(
            own.key,
            f"no other replica's checkpoint of stage {stage} round {rnd} vouches for it (replicas {others} "
            "asked): a round counts only when two nodes of two replicas checkpointed it",
        )
    claimed = own.anchor_sha256
    if claimed is not None and None not in agreed and claimed not in agreed:
        raise CheckpointRefused(
            own.key,
            f"its anchor digest {claimed[:16]}... is not the one the other replicas' checkpoints of stage "
            f"{stage} round {rnd} sign: the consensus of that round is another",
        )
    return agreed


def _group_vouched(
    spec: RunSpec,
    stage: int,
    replica: int,
    rnd: int,
    own: SignedManifest,
    read: ReadManifest,
    table: LaterSigners,
    me: int,
    butterfly: bool = False,
) -> dict[int, set[str | None]]:
    """Rule 3 per layer group (a mixed-layout run): for each group g of `replica`'s `stage`, the digests of
    g's anchor that the other replicas' manifests of the stage holding g there sign (`read`, signed by the
    slot's keys in `table`, stage -> replica -> keys; None: any valid signature), counting only those signed
    by another node than `own`'s; `_vouched`'s exceptions per group (no other replica known to hold g: left
    out; its one other replica the reader's own, `me`, without a checkpoint of `rnd`: left out). Raises
    CheckpointRefused when none vouches for a group, or none for the digest `own` claims."""
    out: dict[int, set[str | None]] = {}
    for g in spec.groups_of(replica, stage):
        slots = [(r, spec.stage_of_group(r, g)) for r in range(spec.replicas) if r != replica]
        slots = [(r, s) for r, s in slots if table is None or r in table.get(s, {})]
        if not slots:
            continue
        found = {r: read(s, r, None if table is None else table[s][r]) for r, s in slots}
        agreed = {
            m.group_anchor_sha256(g) for m in found.values() if m is not None and m.signer != own.signer
        }
        agreed = {None} if butterfly and agreed else agreed  # `_vouched`'s butterfly rule
        if not agreed and list(found) == [me] and found[me] is None:
            continue
        name = _group_name(spec, g)
        if not agreed:
            raise CheckpointRefused(
                own.key,
                f"no other replica's checkpoint of {name} at round {rnd} vouches for it (replicas "
                f"{list(found)} asked): a round counts only when two nodes of two replicas checkpointed it",
            )
        claimed = own.group_anchor_sha256(g)
        if claimed is not None and None not in agreed and claimed not in agreed:
            raise CheckpointRefused(
                own.key,
                f"its digest {claimed[:16]}... of {name}'s anchor is not the one the other replicas' "
                f"checkpoints of round {rnd} sign: the consensus of that round is another",
            )
        out[g] = agreed
    return out


def _group_name(spec: RunSpec, g: int) -> str:
    a, b = spec.layer_groups()[g]
    return f"layer group {g} (layers {a}-{b - 1})"


def _check_step(m: SignedManifest, step: int | None) -> None:
    if m.manifest.step != step:
        raise CheckpointRefused(
            m.key,
            f"manifest is for step {m.manifest.step}, but round {m.manifest.round} of this run is checkpointed "
            f"at step {step}",
        )

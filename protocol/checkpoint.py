"""Checkpoints that lose nothing: one (run, stage, replica) at a round boundary, signed and verified.

A checkpoint is three objects (protocol/keys.py), written in this order:

    {run}/ckpt/{round:08d}/s{stage}/r{replica}/tensors.safetensors   every tensor the caller names, one
                                                                    safetensors file (multipart when large)
    {run}/ckpt/{round:08d}/s{stage}/r{replica}/manifest              signed CheckpointManifest: the tensors'
                                                                    key, size and sha256, step, meta
    {run}/ckpt/LATEST-s{stage}-r{replica}                            signed CheckpointPointer: the round and
                                                                    the sha256 of its manifest

so a pointer never names a checkpoint that is not whole. The caller names the tensors ("model.<param>",
"anchor.<i>", "ef.<f>.<i>", "optim.<...>"); this module knows nothing of training.

Reading trusts nothing it has not checked. From the LATEST pointer (or a round the caller gives), each
candidate is checked in this order, and the first failure refuses it with a reason that names the check:
  1. the pointer: its signature, a trusted signer, its run/stage/replica, the manifest key it names;
  2. the manifest: present, at most MAX_MANIFEST_BYTES, its signature, a trusted signer, its run/stage/
     replica/round and tensors key, and (for the pointer's round) the sha256 the pointer holds;
  3. the tensors object's size by HEAD, against the manifest, before a byte of it is fetched;
  4. its sha256, computed in chunks over a temporary file it was downloaded to (pinned to the HEADed
     version by If-Match, so an object swapped mid-way is refused instead of mixing two);
  5. that safetensors can load it.
A refused checkpoint is logged and collected (`Refusal`), and the next lower round under `{run}/ckpt/`
is tried, down to none (None). Rounds listed above the pointer's are tried before it: the pointer only
saves a LIST, and an older, validly signed pointer put back by someone with store access must not turn
the run back to its round. A store that cannot be reached raises StoreError instead: an outage
must not silently roll a node back to an older checkpoint.

Which slot a signer may write, and which rounds a resume or an export takes (docs/reliability.md, issue 21),
is decided by the readers (node/sync/stage_checkpoints.py, coordinator/export.py) from the pieces here:
`slot_signers` (the nodes the signed assignments put in a slot), `checkpoint_rounds` (the rounds a run
checkpoints at all), `newest_round` (a bisection over them: no LIST, junk folders cost nothing),
`read_manifest` (check 2 without the tensors) and the anchor digest every writer puts in `meta`
(`ANCHOR_META`), which two replicas' checkpoints of one round share. Replicas of different layer splits
(`RunSpec.mixed_layout`) hold different layers in a stage of one index, so their whole-stage digests never
match; their checkpoints also carry one digest per layer group the stage holds (`group_anchor_meta`), which
every replica holding that group shares, whatever its split.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from protocol import keys
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity, SignatureError, peer_id_of, public_key_of_peer_id
from protocol.messages import Assignment, CheckpointManifest, CheckpointPointer
from protocol.net.store import (
    DEFAULT_PART_BYTES,
    ObjectChanged,
    ObjectStore,
    ObjectTooLarge,
    StoreError,
    check_part_bytes,
)
from protocol.runspec import RunSpec
from protocol.schema import ProtocolError, describe

log = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 64 << 10
"""Largest manifest envelope read: MAX_META_ENTRIES entries of 256-character keys and strings fit in 40 KB."""
MAX_POINTER_BYTES = 4 << 10
"""Largest LATEST pointer envelope read (one is about 400 bytes)."""
ANCHOR_META = "anchor_sha256"
"""The `meta` entry holding `anchor_sha256` of the checkpoint's tensors: replicas compare it across slots
before a byte of the tensors moves."""
GROUP_ANCHOR_META = "group_anchor_sha256"
"""Prefix of the `meta` entries `{GROUP_ANCHOR_META}.{g}` holding `group_anchor_sha256(...)[g]` for each layer
group g of the stage (mixed-layout runs). One entry per group, not one string of them all: a meta string
holds at most 256 characters, three digests."""


class CheckpointRefused(ProtocolError):
    """A checkpoint failed a check; `reason` says which, `key` is the object that failed it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(reason)
        self.key = key
        self.reason = reason


class CheckpointMissing(CheckpointRefused):
    """No manifest at that round for this (stage, replica): no checkpoint there, or one never finished."""


@dataclass(frozen=True)
class Refusal:
    """One checkpoint (or pointer) `read_checkpoint` refused, and why."""

    round: int | None
    """The refused checkpoint's round; None for the LATEST pointer itself."""
    key: str
    """The object that failed the check."""
    reason: str

    def __str__(self) -> str:
        where = "" if self.round is None else f"round {self.round}: "  # a pointer's reason names it
        return f"{where}{self.reason} ({self.key})"


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint: its manifest, who signed it, and its tensors (on the requested device)."""

    manifest: CheckpointManifest
    signer: bytes
    tensors: dict[str, torch.Tensor]

    @property
    def round(self) -> int:
        return self.manifest.round

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def meta(self) -> dict[str, int | float | str]:
        return self.manifest.meta


@dataclass(frozen=True)
class SignedManifest:
    """A manifest that passed check 2 (module docstring), its tensors not yet fetched."""

    manifest: CheckpointManifest
    signer: bytes
    sha256: str
    """sha256 of the manifest envelope as stored: what a LATEST pointer names, and what pins `read_round`."""
    key: str
    """Where it was read."""

    @property
    def anchor_sha256(self) -> str | None:
        """The anchor digest its writer signed (`ANCHOR_META`); None from a build before it was written."""
        value = self.manifest.meta.get(ANCHOR_META)
        return value if isinstance(value, str) else None

    def group_anchor_sha256(self, group: int) -> str | None:
        """The digest of layer group `group`'s anchor its writer signed (`GROUP_ANCHOR_META`); None when
        it signed none (a uniform run's checkpoint, a build before them, a group the stage does not hold)."""
        value = self.manifest.meta.get(f"{GROUP_ANCHOR_META}.{group}")
        return value if isinstance(value, str) else None


# --- which slots and rounds count ------------------------------------------------------------------


def slot_signers(assignments: Iterable[Assignment], stage: int) -> dict[int, set[bytes]]:
    """Replica -> the public keys that may sign stage `stage`'s checkpoints of that replica: the nodes the
    signed `assignments` put in that slot, now or earlier in the run (each one's own node, `stage_peers`,
    `former_stage_peers`). A node of another slot is never a signer of this one; a peer id naming no key is
    skipped."""
    out: dict[int, set[bytes]] = {}
    for a in assignments:
        if a.stage == stage:
            add_slot_signers(out, {str(a.replica): [a.peer_id]}, a.former_stage_peers)
            add_slot_signers(out, {r: [p] for r, p in a.stage_peers.items()})
    return out


def add_slot_signers(
    out: dict[int, set[bytes]], *slots: Mapping[str, Iterable[str]]
) -> dict[int, set[bytes]]:
    """Add to `out` (replica -> keys) the peers of each {replica index: peer ids} mapping, as assignments
    spell them (`stage_peers` values wrapped in lists, `former_stage_peers`); returns `out`."""
    for mapping in slots:
        for r, peers in mapping.items():
            for peer in peers:
                with suppress(ProtocolError):
                    out.setdefault(int(r), set()).add(public_key_of_peer_id(peer))
    return out


def checkpoint_rounds(spec: RunSpec) -> range:
    """Every round `spec` checkpoints, ascending: the multiples of sync.checkpoint_every whose checkpoint
    step (`checkpoint_step`) is within train.total_steps. No honest writer puts one anywhere else, so a
    reader asks the store about no other round."""
    every = spec.sync.checkpoint_every
    if every <= 0:
        return range(0)
    return range(every, spec.sync.schedule().round_at(spec.train.total_steps) + 1, every)


def checkpoint_step(spec: RunSpec, rnd: int) -> int | None:
    """The inner step at which round `rnd`'s checkpoint is taken, rnd H + tau (its last fragment applied);
    None if `spec` does not checkpoint that round (`checkpoint_rounds`)."""
    schedule = spec.sync.schedule()
    return rnd * schedule.H + schedule.tau if rnd in checkpoint_rounds(spec) else None


def newest_round(rounds: Sequence[int], counts: Callable[[int], bool]) -> int | None:
    """The highest of `rounds` (ascending) that `counts`, by bisection: about log2(len(rounds)) + 1 calls,
    however many rounds there are and whatever else lies under `{run}/ckpt/`. The rounds that count are taken
    to be a prefix, as honest writers make them (each round's checkpoint follows the previous one's); a gap
    (an upload that failed, a checkpoint deleted) can make it answer a round below the gap, never one that
    does not count. None when none does."""
    lo, hi = -1, len(rounds) - 1  # rounds[lo] counts (lo = -1: none known to); the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if counts(rounds[mid]):
            lo = mid
        else:
            hi = mid - 1
    return rounds[lo] if lo >= 0 else None


def anchor_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the "anchor.*" entries (the consensus, bit-identical on every replica at a round) in name
    order: each name, dtype, shape and bytes, wherever the tensors live."""
    return _sha256_of(tensors, sorted(n for n in tensors if n.startswith("anchor.")))


def param_group(spec: RunSpec, param: str) -> int | None:
    """The layer group (`RunSpec.layer_groups`) of parameter `param` by its global name ("layers.3.attn.wq.
    weight", "embed.weight"); None for a name no parameter of `spec`'s model has ("layers.x.w", "layers.99.w",
    from a hostile or foreign checkpoint), rather than an exception."""
    try:
        return spec.group_of_param(param)
    except (ValueError, StopIteration):
        return None


def group_anchor_sha256(spec: RunSpec, tensors: Mapping[str, torch.Tensor]) -> dict[int, str]:
    """Layer group -> sha256 over that group's "anchor.*" entries, hashed as `anchor_sha256` hashes them (in
    name order): the consensus of a group, bit-identical on every replica holding it whatever its layer split.
    For a stage that holds one group and only parameters' anchors, that group's digest is `anchor_sha256`."""
    names: dict[int, list[str]] = {}
    for name in sorted(n for n in tensors if n.startswith("anchor.")):
        g = param_group(spec, name[len("anchor.") :])
        if g is not None:
            names.setdefault(g, []).append(name)
    return {g: _sha256_of(tensors, group) for g, group in sorted(names.items())}


def group_anchor_meta(spec: RunSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The `meta` entries carrying `group_anchor_sha256` (`GROUP_ANCHOR_META`), for a writer to add."""
    return {f"{GROUP_ANCHOR_META}.{g}": h for g, h in group_anchor_sha256(spec, tensors).items()}


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of one tensor's dtype, shape and bytes (a butterfly pair base, held alike by both ends)."""
    return _sha256_of({"": t}, [""])


def _sha256_of(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> str:
    h = hashlib.sha256()
    for name in names:
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- write ------------------------------------------------------------------------------------------


def write_checkpoint(
    store: ObjectStore,
    identity: Identity,
    *,
    run_id: str,
    stage: int,
    replica: int,
    round: int,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, int | float | str] | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    tmp_dir: str | None = None,
) -> CheckpointManifest:
    """Write the checkpoint of (run_id, stage, replica) at the boundary closing `round`, then point LATEST
    at it. Tensors may live on any device and in any dtype safetensors holds (bf16 included); they are
    copied to the CPU, made contiguous and written to a temporary file (in `tmp_dir`, default the system's:
    it needs room for the whole checkpoint), hashed in chunks, and uploaded by boto3's managed transfer in
    `part_bytes` parts when larger than that. The manifest follows, the pointer last (none through write
    grants, a GrantedStore: it writes each key once, and readers list the rounds). Returns the manifest.

    Raises ValueError for a bad argument (before anything is written) and StoreError when the store
    refuses; LATEST then still names the previous checkpoint."""
    check_part_bytes(part_bytes)
    tensors_key = keys.ckpt_tensors_key(run_id, rnd=round, stage=stage, replica=replica)
    draft = CheckpointManifest(  # checks every field now, before gigabytes move
        run_id=run_id,
        stage=stage,
        replica=replica,
        round=round,
        step=step,
        created_at=0.0,
        tensors_key=tensors_key,
        tensors_bytes=0,
        tensors_sha256="0" * 64,
        meta=dict(meta or {}),
    )
    host = _host_tensors(tensors)
    with tempfile.TemporaryDirectory(prefix="crucible-ckpt-", dir=tmp_dir) as tmp:
        path = os.path.join(tmp, "tensors.safetensors")
        save_file(host, path, metadata=_file_metadata(draft))
        del host
        size = os.path.getsize(path)
        digest = _file_sha256(path)
        stored = store.upload_file(path, tensors_key, part_bytes=part_bytes)
    if stored.size != size:
        raise StoreError(
            f"{tensors_key} holds {stored.size} bytes right after an upload of {size}; not committed"
        )
    manifest = replace(draft, created_at=time.time(), tensors_bytes=size, tensors_sha256=digest)
    sealed = seal(identity, manifest)
    manifest_key = keys.ckpt_manifest_key(run_id, rnd=round, stage=stage, replica=replica)
    store.put(manifest_key, sealed)
    if not store.write_once:  # one that writes each key once moves no pointer: readers list
        pointer = CheckpointPointer(
            run_id=run_id,
            stage=stage,
            replica=replica,
            round=round,
            manifest_key=manifest_key,
            manifest_sha256=hashlib.sha256(sealed).hexdigest(),
        )
        store.put(keys.ckpt_pointer_key(run_id, stage=stage, replica=replica), seal(identity, pointer))
    log.info(
        "checkpoint %s stage %d replica %d round %d (step %d): %d tensors, %d bytes%s",
        run_id,
        stage,
        replica,
        round,
        step,
        len(tensors),
        size,
        f", multipart ETag {stored.etag}" if "-" in stored.etag else "",
    )
    return manifest


def _host_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor detached, on the CPU and contiguous; one that shares memory with an earlier one (tied
    weights, views of one buffer) is copied, since safetensors stores each tensor's bytes once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"checkpoint tensor name {describe(name)} must be a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"checkpoint entry {describe(name)} is {describe(t)}, not a torch.Tensor")
        h = t.detach().to("cpu").contiguous()
        if h.numel():
            ptr = h.untyped_storage().data_ptr()
            if ptr in seen:
                h = h.clone()
                ptr = h.untyped_storage().data_ptr()
            seen.add(ptr)
        out[name] = h
    return out


def _file_metadata(m: CheckpointManifest) -> dict[str, str]:
    """safetensors header metadata: which checkpoint the file is, for a human or a converter holding only the
    file (readers trust the signed manifest, not this)."""
    return {
        "format": "pt",
        "crucible.run_id": m.run_id,
        "crucible.stage": str(m.stage),
        "crucible.replica": str(m.replica),
        "crucible.round": str(m.round),
        "crucible.step": str(m.step),
    }


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # reads in chunks, never the whole file


# --- read -------------------------------------------------------------------------------------------


def list_rounds(store: ObjectStore, run_id: str) -> list[int]:
    """Rounds holding any checkpoint of the run (of any stage or replica), ascending."""
    found = (keys.parse_ckpt_round(run_id, p) for p in store.list_prefixes(keys.ckpt_prefix(run_id)))
    return sorted({r for r in found if r is not None})


def read_manifest(
    store: ObjectStore,
    *,
    run_id: str,
    stage: int,
    replica: int,
    round: int,
    trusted: set[bytes] | None,
) -> SignedManifest:
    """The manifest of (run_id, stage, replica) at `round`, verified (module docstring, check 2) but its
    tensors not fetched: one GET of at most MAX_MANIFEST_BYTES. trusted: the keys that may sign this slot;
    None takes any valid signature (for a reader that cannot know the slot's signers: the fields are still
    checked).

    Raises CheckpointMissing (no manifest), CheckpointRefused (a check failed) or StoreError."""
    mkey = keys.ckpt_manifest_key(run_id, rnd=round, stage=stage, replica=replica)
    try:
        blob = store.get(mkey, max_bytes=MAX_MANIFEST_BYTES)
    except ObjectTooLarge as e:
        raise CheckpointRefused(mkey, f"manifest is not a manifest: {e}") from e
    if blob is None:
        raise CheckpointMissing(mkey, "no manifest: no checkpoint at this round, or its write never finished")
    try:
        signed = open_envelope(blob, CheckpointManifest, max_bytes=MAX_MANIFEST_BYTES)
    except (ProtocolError, SignatureError) as e:
        raise CheckpointRefused(mkey, f"manifest does not verify: {e}") from e
    if trusted is not None:
        _check_signer(mkey, "manifest", signed.signer, trusted, stage, replica)
    m = signed.body
    want: dict[str, Any] = {
        "run_id": run_id,
        "stage": stage,
        "replica": replica,
        "round": round,
        "tensors_key": keys.ckpt_tensors_key(run_id, rnd=round, stage=stage, replica=replica),
    }
    for name, value in want.items():
        if getattr(m, name) != value:
            raise CheckpointRefused(
                mkey,
                f"manifest is for {name}={describe(getattr(m, name))}, not {describe(value)}: a validly signed "
                "manifest of another checkpoint copied here",
            )
    return SignedManifest(manifest=m, signer=signed.signer, sha256=hashlib.sha256(blob).hexdigest(), key=mkey)


def read_round(
    store: ObjectStore,
    *,
    run_id: str,
    stage: int,
    replica: int,
    round: int,
    trusted: set[bytes],
    device: str | torch.device = "cpu",
    manifest_sha256: str | None = None,
    max_bytes: int | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    tmp_dir: str | None = None,
) -> Checkpoint:
    """The checkpoint of (run_id, stage, replica) at exactly `round`, verified (module docstring, checks
    2-5), with no fallback: what an exporter wants. manifest_sha256: the manifest must be this one (the
    pointer's). max_bytes: refuse a larger tensors object before downloading it.

    Raises CheckpointMissing (no manifest), CheckpointRefused (a check failed; the reason names it), or
    StoreError (the store could not be asked)."""
    mkey = keys.ckpt_manifest_key(run_id, rnd=round, stage=stage, replica=replica)
    tkey = keys.ckpt_tensors_key(run_id, rnd=round, stage=stage, replica=replica)
    signed = read_manifest(store, run_id=run_id, stage=stage, replica=replica, round=round, trusted=trusted)
    m = signed.manifest
    if manifest_sha256 is not None and (got := signed.sha256) != manifest_sha256:
        raise CheckpointRefused(
            mkey,
            f"manifest sha256 {got[:16]}... is not the {manifest_sha256[:16]}... the LATEST pointer vouches "
            "for: the manifest was replaced after the pointer was written",
        )
    if max_bytes is not None and m.tensors_bytes > max_bytes:
        raise CheckpointRefused(
            mkey, f"manifest declares {m.tensors_bytes} tensor bytes, over this reader's bound of {max_bytes}"
        )
    info = store.head(tkey)
    if info is None:
        raise CheckpointRefused(tkey, "tensors object is missing, though its manifest is signed")
    if info.size != m.tensors_bytes:
        raise CheckpointRefused(
            tkey,
            f"tensors object holds {info.size} bytes, its manifest says {m.tensors_bytes}: truncated or "
            "replaced (not downloaded)",
        )
    with tempfile.TemporaryDirectory(prefix="crucible-ckpt-", dir=tmp_dir) as tmp:
        path = os.path.join(tmp, "tensors.safetensors")
        try:
            store.download_file(tkey, path, version=info, part_bytes=part_bytes)
        except ObjectChanged as e:
            raise CheckpointRefused(tkey, f"tensors object changed while downloading: {e}") from e
        digest = _file_sha256(path)
        if digest != m.tensors_sha256:
            raise CheckpointRefused(
                tkey,
                f"tensors sha256 {digest[:16]}... does not match its manifest's {m.tensors_sha256[:16]}...: "
                "the object was replaced or corrupted",
            )
        try:
            tensors = load_file(path, device=str(device))
        except Exception as e:  # safetensors raises its own SafetensorError on a bad header
            raise CheckpointRefused(
                tkey, f"tensors object matches its manifest but is not a loadable safetensors file: {e}"
            ) from e
    return Checkpoint(manifest=m, signer=signed.signer, tensors=tensors)


def read_checkpoint(
    store: ObjectStore,
    *,
    run_id: str,
    stage: int,
    replica: int,
    trusted: set[bytes],
    round: int | None = None,
    device: str | torch.device = "cpu",
    refused: list[Refusal] | None = None,
    max_bytes: int | None = None,
    part_bytes: int = DEFAULT_PART_BYTES,
    tmp_dir: str | None = None,
) -> Checkpoint | None:
    """The newest valid checkpoint of (run_id, stage, replica): the one LATEST names (or the one of
    `round`), else the next lower round that verifies (module docstring). None if none does.

    trusted: the public keys allowed to sign this slot's manifests and pointer. refused: every refusal
    on the way is appended here (and logged), so a caller can report why it resumed where it did. A
    refused or absent pointer is not the end: rounds are then tried from the newest listed one down.
    Raises StoreError when the store cannot be asked (no fallback on an outage)."""
    refusals = refused if refused is not None else []

    def refuse(rnd: int | None, key: str, reason: str) -> None:
        refusal = Refusal(round=rnd, key=key, reason=reason)
        refusals.append(refusal)
        log.warning("checkpoint refused: %s", refusal)

    start, pinned = round, None
    if start is None:
        pointer = _read_pointer(store, run_id, stage, replica, trusted, refuse)
        if pointer is not None:
            start, pinned = pointer.round, pointer.manifest_sha256
    listed = list_rounds(store, run_id)
    # a pointer only saves a LIST: a newer round whose manifest verifies wins over it (an older, validly
    # signed pointer put back by someone with store access must not turn the run back)
    above = sorted((r for r in listed if round is None and start is not None and r > start), reverse=True)
    below = sorted((r for r in listed if start is None or r < start), reverse=True)
    candidates = above + ([] if start is None else [start]) + below
    for rnd in candidates:
        try:
            ckpt = read_round(
                store,
                run_id=run_id,
                stage=stage,
                replica=replica,
                round=rnd,
                trusted=trusted,
                device=device,
                manifest_sha256=pinned if rnd == start else None,
                max_bytes=max_bytes,
                part_bytes=part_bytes,
                tmp_dir=tmp_dir,
            )
        except CheckpointMissing as e:
            if rnd == start:  # named by the pointer or the caller: its absence is a finding
                refuse(rnd, e.key, e.reason)
            continue  # a round only other stages or replicas wrote
        except CheckpointRefused as e:
            refuse(rnd, e.key, e.reason)
            continue
        if start is not None and rnd > start:
            log.warning(
                "LATEST of %s stage %d replica %d names round %d but round %d verifies: using the newer",
                run_id,
                stage,
                replica,
                start,
                rnd,
            )
        if refusals:
            log.warning(
                "resuming %s stage %d replica %d from round %d after %d refusal(s)",
                run_id,
                stage,
                replica,
                rnd,
                len(refusals),
            )
        return ckpt
    return None


def _read_pointer(
    store: ObjectStore,
    run_id: str,
    stage: int,
    replica: int,
    trusted: set[bytes],
    refuse: Callable[[int | None, str, str], None],
) -> CheckpointPointer | None:
    """The verified LATEST pointer, or None (absent, or refused through `refuse`)."""
    key = keys.ckpt_pointer_key(run_id, stage=stage, replica=replica)
    try:
        blob = store.get(key, max_bytes=MAX_POINTER_BYTES)
    except ObjectTooLarge as e:
        refuse(None, key, f"LATEST pointer is not a pointer: {e}")
        return None
    if blob is None:
        return None
    try:
        signed = open_envelope(blob, CheckpointPointer, max_bytes=MAX_POINTER_BYTES)
        _check_signer(key, "LATEST pointer", signed.signer, trusted, stage, replica)
    except (ProtocolError, SignatureError) as e:
        reason = e.reason if isinstance(e, CheckpointRefused) else f"LATEST pointer does not verify: {e}"
        refuse(None, key, reason)
        return None
    p = signed.body
    for name, value in (("run_id", run_id), ("stage", stage), ("replica", replica)):
        if getattr(p, name) != value:
            refuse(
                None, key, f"LATEST pointer is for {name}={describe(getattr(p, name))}, not {describe(value)}"
            )
            return None
    expected_key = keys.ckpt_manifest_key(run_id, rnd=p.round, stage=stage, replica=replica)
    if p.manifest_key != expected_key:
        refuse(None, key, f"LATEST pointer names manifest {describe(p.manifest_key)}, not {expected_key}")
        return None
    return p


def _check_signer(key: str, what: str, signer: bytes, trusted: set[bytes], stage: int, replica: int) -> None:
    if signer not in trusted:
        raise CheckpointRefused(
            key,
            f"{what} is signed by {peer_id_of(signer)}, which is not among the {len(trusted)} key(s) trusted "
            f"for stage {stage} replica {replica}'s checkpoints",
        )

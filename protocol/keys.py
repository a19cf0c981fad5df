"""Where things live: DHT keys and the object store's key layout (DESIGN section 6).

Each run is isolated under its own store prefix `{run}/` and its own DHT keys.
"""

from __future__ import annotations

import hashlib

SWARM = "crucible"

# --- DHT -----------------------------------------------------------------------------------------
NODES_KEY = f"{SWARM}/nodes"
"""Subkey per peer id -> signed NodeAdvert (TTL, refreshed)."""
RUNS_KEY = f"{SWARM}/runs"
"""Subkey per run id -> signed RunRecord (launched runs, their state and coordinator)."""


def assignment_key(peer_id: str) -> str:
    """Signed Assignment for one node (polled by that node)."""
    return f"{SWARM}/assign/{peer_id}"


# --- object store --------------------------------------------------------------------------------
PROBE_PREFIX = "_probe/"
"""The throwaway objects nodes write to test the store, outside every run's prefix."""


def preflight_key(peer_id: str) -> str:
    """The small object a node puts and deletes at start to prove the store takes its writes."""
    return f"{PROBE_PREFIX}preflight/{peer_id}"


def bandwidth_probe_key(token: str) -> str:
    """The object a node uploads and deletes to measure its store bandwidth (`token`: random, per probe)."""
    return f"{PROBE_PREFIX}{token}"


def spec_key(run: str) -> str:
    return f"{run}/spec"


def launch_key(run: str) -> str:
    """The run's launch as `launch` signed it (RunRecord): nodes take the run only when it is the operator's
    (protocol/trust/run_authority.py); {run}/spec is rewritten by the coordinators."""
    return f"{run}/launch"


def lease_key(run: str) -> str:
    return f"{run}/lease"


def terms_prefix(run: str) -> str:
    return f"{run}/terms/"


def term_key(run: str, term: int) -> str:
    """Write-once claim of a lease term: a term is taken once, even if the lease object is lost."""
    return f"{terms_prefix(run)}{term:06d}"


def assign_prefix(run: str) -> str:
    """Where the run's assignment archives are (protocol/trust/assignment_archive.py)."""
    return f"{run}/assign/"


def assign_key(run: str, term: int, epoch: int) -> str:
    return f"{assign_prefix(run)}{term:06d}-{epoch:06d}"


def _canonical_number(text: str) -> int | None:
    """The number `text` spells as these keys write numbers (ASCII digits, zero-padded to 6 and no further:
    "000007", "1234567"), else None ("007", "+5", "-3", "0000007", "7e3", 40 digits)."""
    if not (text.isascii() and text.isdigit() and len(text) <= 19):
        return None
    n = int(text)
    return n if text == f"{n:06d}" else None


def parse_term_key(run: str, key: str) -> int | None:
    """The term of a canonical `term_key` of `run`, else None (any other name under the prefix)."""
    if not key.startswith(terms_prefix(run)):
        return None
    return _canonical_number(key[len(terms_prefix(run)) :])


def parse_assign_key(run: str, key: str) -> tuple[int, int] | None:
    """(term, epoch) of a canonical `assign_key` of `run`, else None."""
    if not key.startswith(assign_prefix(run)):
        return None
    term, sep, epoch = key[len(assign_prefix(run)) :].partition("-")
    t, e = _canonical_number(term), _canonical_number(epoch)
    return (t, e) if sep and t is not None and e is not None else None


def control_key(run: str) -> str:
    """Signed RunControl (stop requests)."""
    return f"{run}/control"


def route_prefix(run: str, group: int, step: int) -> str:
    """Where every replica's routing counts of one inner step of one layer group live (issue 24)."""
    return f"{run}/route/g{group}/t{step:09d}/"


def route_key(run: str, group: int, step: int, replica: int) -> str:
    """Replica `replica`'s signed RouteCounts of one step (node/sync/route_exchange.py): one key per slot,
    written once by whichever of the slot's nodes trains that step first, so its bytes and its store
    timestamp are fixed the moment a reader sees them (a replayed step finds its predecessor's)."""
    return f"{route_prefix(run, group, step)}r{replica}"


def sync_prefix(run: str, stage: int, frag: int, rnd: int) -> str:
    return f"{run}/sync/s{stage}/f{frag}/r{rnd}/"


def slot_prefix(run: str, stage: int, frag: int, rnd: int, replica: int) -> str:
    """Where replica `replica`'s fragments of one round live, whoever signed them."""
    return f"{sync_prefix(run, stage, frag, rnd)}{replica}/"


def round_record_key(run: str, stage: int, frag: int, rnd: int) -> str:
    """Where builds before issue 21 wrote a round's agreed set (a signed RoundRecord); read by nobody now."""
    return f"{sync_prefix(run, stage, frag, rnd)}record"


def content_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


PRIMARY_NAME = "fragment"
"""The last part of a primary fragment key (a content digest is 64 hex digits, so the two never meet)."""


def primary_fragment_key(run: str, stage: int, frag: int, rnd: int, replica: int, signer: str) -> str:
    """Where a signer puts its fragment of a round first: `{slot}{signer}/fragment`, a name every reader can
    compute, so readers poll it with GETs instead of listing the round (R2 bills a LIST as a class A
    operation). Written once (If-None-Match). Being predictable, anyone with store credentials can take it
    first; a signer that finds it holding anything but its own valid fragment writes at `sync_key`
    instead, and readers that find garbage there list the slot to find that key."""
    return f"{slot_prefix(run, stage, frag, rnd, replica)}{signer}/{PRIMARY_NAME}"


def sync_key(run: str, stage: int, frag: int, rnd: int, replica: int, signer: str, data: bytes) -> str:
    """One replica's signed pseudo-gradient fragment for one round, named by its signer and content:
    `{slot}{signer peer id}/{sha256 of the bytes}` (the fallback when `primary_fragment_key` was taken).
    Any holder of store credentials can write any key, so a key nobody can predict before the signer
    writes it is what makes the slot the signer's in effect: garbage under the slot (a squatter's, a
    truncated upload) sits beside the real fragment instead of taking its place, and readers use only
    what verifies against the signer in effect for the replica (and, here, the key's hash). Written once
    (If-None-Match)."""
    return fragment_key(run, stage, frag, rnd, replica, signer, content_digest(data))


def fragment_key(run: str, stage: int, frag: int, rnd: int, replica: int, signer: str, digest: str) -> str:
    """`sync_key` from the digest (what a round record names)."""
    return f"{slot_prefix(run, stage, frag, rnd, replica)}{signer}/{digest}"


def parse_sync_key(prefix: str, key: str) -> tuple[int, str, str | None] | None:
    """(replica, signer, digest) of a fragment key under a round's `prefix`, digest None for a primary key
    (`primary_fragment_key`); None for any other name."""
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix) :].split("/")
    slot = parts[0] if len(parts) == 3 else ""
    if not (slot.isascii() and slot.isdigit() and len(slot) <= 6 and slot == str(int(slot))) or not parts[1]:
        return None  # one name per slot: ASCII digits, no leading zero (`01/` is not slot 1's, `²` no digit)
    replica, signer, name = parts
    if name == PRIMARY_NAME:
        return int(replica), signer, None
    if len(name) != 64 or any(c not in "0123456789abcdef" for c in name):
        return None
    return int(replica), signer, name


def ckpt_prefix(run: str) -> str:
    """Every checkpoint of a run: one folder per round, `{run}/ckpt/{round:08d}/`, and the LATEST pointers."""
    return f"{run}/ckpt/"


def ckpt_dir(run: str, *, rnd: int, stage: int, replica: int) -> str:
    """One (stage, replica)'s checkpoint at the boundary that closes outer round `rnd`."""
    return f"{ckpt_prefix(run)}{rnd:08d}/s{stage}/r{replica}/"


def ckpt_tensors_key(run: str, *, rnd: int, stage: int, replica: int) -> str:
    """The checkpoint's tensors: one safetensors object (multipart upload when large)."""
    return f"{ckpt_dir(run, rnd=rnd, stage=stage, replica=replica)}tensors.safetensors"


def ckpt_manifest_key(run: str, *, rnd: int, stage: int, replica: int) -> str:
    """The checkpoint's signed CheckpointManifest (written after the tensors)."""
    return f"{ckpt_dir(run, rnd=rnd, stage=stage, replica=replica)}manifest"


def ckpt_pointer_key(run: str, *, stage: int, replica: int) -> str:
    """The signed CheckpointPointer to a (stage, replica)'s newest checkpoint (written last)."""
    return f"{ckpt_prefix(run)}LATEST-s{stage}-r{replica}"


def parse_ckpt_round(run: str, prefix: str) -> int | None:
    """The round of a round folder `{run}/ckpt/{round:08d}/` (as listed with delimiter "/"), else None."""
    head = ckpt_prefix(run)
    if not (prefix.startswith(head) and prefix.endswith("/")):
        return None
    digits = prefix[len(head) : -1]
    if not (8 <= len(digits) <= 19 and digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


def grants_prefix(run: str, peer_id: str) -> str:
    """The grant mails (protocol/trust/grant_mail.py) the coordinators sealed to one node."""
    return f"{run}/grants/{peer_id}/"


def grant_mail_key(run: str, peer_id: str, first_round: int, term: int, seq: int = 0) -> str:
    """One mail: the grants of rounds from `first_round` on, issued in lease term `term` (written once);
    `seq` > 0 names a renewal from the same round in the same term (the grants were near their expiry).
    Names sort in issue order within a term."""
    tail = f"-{seq:04d}" if seq else ""
    return f"{grants_prefix(run, peer_id)}{first_round:08d}-{term:06d}{tail}"


def report_key(run: str, replica: int, stage: int) -> str:
    """A stage worker's final report (metrics JSON)."""
    return f"{run}/report/r{replica}-s{stage}"


def metrics_key(run: str, replica: int, stage: int) -> str:
    """Per-round metrics log of a stage worker (JSON lines, rewritten each round)."""
    return f"{run}/metrics/r{replica}-s{stage}.jsonl"

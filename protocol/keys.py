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
def spec_key(run: str) -> str:
    return f"{run}/spec"


def lease_key(run: str) -> str:
    return f"{run}/lease"


def term_key(run: str, term: int) -> str:
    """Write-once claim of a lease term: a term is taken once, even if the lease object is lost."""
    return f"{run}/terms/{term:06d}"


def assign_key(run: str, term: int, epoch: int) -> str:
    return f"{run}/assign/{term:06d}-{epoch:06d}"


def control_key(run: str) -> str:
    """Signed RunControl (stop requests)."""
    return f"{run}/control"


def sync_prefix(run: str, stage: int, frag: int, rnd: int) -> str:
    return f"{run}/sync/s{stage}/f{frag}/r{rnd}/"


def slot_prefix(run: str, stage: int, frag: int, rnd: int, replica: int) -> str:
    """Where replica `replica`'s fragments of one round live, whoever signed them."""
    return f"{sync_prefix(run, stage, frag, rnd)}{replica}/"


def content_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sync_key(run: str, stage: int, frag: int, rnd: int, replica: int, signer: str, data: bytes) -> str:
    """One replica's signed pseudo-gradient fragment for one round, named by its signer and content:
    `{slot}{signer peer id}/{sha256 of the bytes}`. Any holder of store credentials can write any key,
    so a key nobody can predict before the signer writes it is what makes the slot the signer's in
    effect: garbage under the slot (a squatter's, a truncated upload) sits beside the real fragment
    instead of taking its place, and readers use only what verifies against the key's hash and the
    signer in effect for the replica. Written once (If-None-Match)."""
    return f"{slot_prefix(run, stage, frag, rnd, replica)}{signer}/{content_digest(data)}"


def parse_sync_key(prefix: str, key: str) -> tuple[int, str, str] | None:
    """(replica, signer, digest) of a fragment key under a round's `prefix`, or None for any other name."""
    if not key.startswith(prefix):
        return None
    parts = key[len(prefix) :].split("/")
    if len(parts) != 3 or not parts[0].isdigit() or len(parts[0]) > 6 or len(parts[2]) != 64:
        return None
    replica, signer, digest = parts
    if not signer or any(c not in "0123456789abcdef" for c in digest):
        return None
    return int(replica), signer, digest


def ckpt_key(run: str, step: int, stage: int) -> str:
    return f"{run}/ckpt/{step:08d}/s{stage}"


def ckpt_latest_key(run: str, stage: int) -> str:
    return f"{run}/ckpt/LATEST-s{stage}"


def report_key(run: str, replica: int, stage: int) -> str:
    """A stage worker's final report (metrics JSON)."""
    return f"{run}/report/r{replica}-s{stage}"


def metrics_key(run: str, replica: int, stage: int) -> str:
    """Per-round metrics log of a stage worker (JSON lines, rewritten each round)."""
    return f"{run}/metrics/r{replica}-s{stage}.jsonl"

"""Where things live: DHT keys and the object store's key layout (DESIGN section 6).

Each run is isolated under its own store prefix `{run}/` and its own DHT keys.
"""

from __future__ import annotations

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


def sync_key(run: str, stage: int, frag: int, rnd: int, replica: int) -> str:
    """One replica's signed pseudo-gradient fragment for one round. Write-once (If-None-Match PUT), so
    every reader sees the same bytes; readers verify the signer expected for `replica`."""
    return f"{sync_prefix(run, stage, frag, rnd)}{replica}"


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

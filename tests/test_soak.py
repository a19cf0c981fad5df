"""Issue 26 acceptance 2: a short chaos soak (scripts/soak.py) in the suite, with the long one's invariants.

The soak's own swarm (elected coordinators, scoped grants, a signature-checking store behind the fault
proxy, link relays) trains for 90 s while a node is stopped, the store answers 503 and the leading
coordinator is killed; it must end with every fault recovered, the consensus identical across replicas
at every round they both checkpointed, no round lost beyond the one a fault hit, and tokens applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from scripts.chaos import KINDS, MAX_JOINS, schedule


def test_the_schedule_has_every_kind_twice_and_is_the_seed_s() -> None:
    faults = schedule(1, 1800.0, 24, KINDS, warmup_s=60.0, cooldown_s=60.0)
    kinds = Counter(f.kind for f in faults)
    assert len(faults) == 24 and set(kinds) == set(KINDS) and min(kinds.values()) >= 2, kinds
    assert kinds["join"] <= MAX_JOINS
    times = [f.at_s for f in faults]
    assert times == sorted(times) and times[0] >= 60.0 and times[-1] <= 1740.0, times
    again = schedule(1, 1800.0, 24, KINDS, warmup_s=60.0, cooldown_s=60.0)
    assert [(f.kind, f.at_s, f.duration_s) for f in again] == [(f.kind, f.at_s, f.duration_s) for f in faults]
    other = schedule(2, 1800.0, 24, KINDS, warmup_s=60.0, cooldown_s=60.0)
    assert [f.kind for f in other] != [f.kind for f in faults]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_keeps_the_consensus_and_recovers_from_every_fault(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "scripts.soak", "--minutes", "1.5", "--baseline-minutes", "0", "--faults", "3",
        "--kinds", "node_stop,store_503,coordinator_kill", "--warmup-s", "15", "--out", str(tmp_path),
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert p.stdout.strip(), p.stderr[-3000:]
    line = json.loads(p.stdout.strip().splitlines()[-1])
    report = json.loads((tmp_path / "soak.json").read_text())["soak_arm"]
    assert p.returncode == 0, (line, p.stderr[-3000:])
    assert line["faults_by_kind"] == {"coordinator_kill": 1, "node_stop": 1, "store_503": 1}, line
    assert line["not_recovered"] == 0 and all(f["recovery_s"] is not None for f in report["faults"]), report
    assert line["consensus_identical"] and report["consensus"]["rounds_compared"] >= 3, report["consensus"]
    assert line["rounds_lost_beyond_fault"] == [], line
    assert line["goodput_tokens_per_s"] > 0 and report["rounds_applied"] >= 3, report
    # a stopped node is a fault of its host, not a process that stays wrong: no traceback anywhere
    assert not [e for e in report["errors"] if e["line"].startswith("Traceback")], report["errors"]

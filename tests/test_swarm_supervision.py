"""Issue 12 acceptance 2: `crucible-swarm` keeps a run going through a node crash and a coordinator crash.

One crucible-swarm process (store, bootstrap peer, coordinator, 4 nodes: real processes) trains a small
model. The test SIGKILLs the coordinator mid-run: crucible-swarm says so and starts another, which takes
the run over when the lease lapses, with the placement from the store. Then it SIGKILLs a node:
crucible-swarm starts a new one, and the new coordinator rebuilds the replica from its checkpoint. The run
must finish with both replicas and identical consensus, and the report must name both faults.

The pipeline links are paced (8 ms each way: at most ~20 steps/s on any host), so the run outlasts the
takeover (lease 8 s) and the rebuild (churn grace 6 s) on a fast host too; a slow host trains slower.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RUN = """\
[run]
run_id = "swarm-sup"
replicas = 2
stages = 2
eval_every = 2
[model]
d_model = 64
n_layers = 2
n_heads = 2
d_ff = 176
seq_len = 64
[train]
total_steps = 500
batch_size = 4
microbatches = 2
lr = 3e-3
warmup_steps = 2
eval_batches = 2
[sync]
method = "sparseloco"
H = 10
timeout_s = 30
[pipeline]
delay_ms = 8
"""


def _wait(pred, timeout_s: float, what: str, proc: subprocess.Popen, log: Path):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        if proc.poll() is not None:
            raise AssertionError(
                f"crucible-swarm exited ({proc.returncode}) waiting for {what}:\n{log.read_text()}"
            )
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}:\n{log.read_text()[-3000:]}")


def _step(out: Path) -> int:
    """The furthest step of the run's nodes, from their /status (the progress lines come every 10 s)."""
    best = 0
    for log in out.glob("node*.log"):
        if m := re.search(r"health=(\S+)/health", log.read_text()):
            try:
                with urllib.request.urlopen(f"{m.group(1)}/status", timeout=5) as r:
                    best = max(best, json.load(r)["metrics"]["step"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
    return best


def _kill(out: Path, name: str) -> None:
    pid = json.loads((out / "processes.json").read_text())[name]
    os.killpg(pid, signal.SIGKILL)  # the node or coordinator and everything it started (its DHT daemon)


def test_crucible_swarm_survives_a_node_and_a_coordinator_crash(tmp_path: Path) -> None:
    out, toml, log = tmp_path / "swarm", tmp_path / "run.toml", tmp_path / "swarm.out"
    toml.write_text(RUN)
    with log.open("w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scripts.local_swarm",
                "--run-toml",
                str(toml),
                "--out",
                str(out),
                "--no-calibrate",
                "--timeout-s",
                "420",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait(lambda: _step(out) >= 25, 150, "the run to pass two rounds", proc, log)
        _kill(out, "coordinator")
        _wait(lambda: "FAULT coordinator exited" in log.read_text(), 30, "the coordinator crash", proc, log)
        took = out / "coordinator-1.log"
        _wait(
            lambda: "took the lease (term 2)" in took.read_text(),
            60,
            "the new coordinator's takeover",
            proc,
            log,
        )
        _kill(out, "node3")
        _wait(
            lambda: "FAULT node3 exited with -9" in log.read_text(), 30, "the node crash reported", proc, log
        )
        _wait(
            lambda: "rebuilding replica" in took.read_text(), 90, "the new coordinator to rebuild", proc, log
        )
        assert proc.wait(360) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    text = log.read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] and report["replicas_done"] == [0, 1], text
    assert report["consensus_identical"], text
    faults = {f["process"]: f for f in report["faults"] if "exited" in f["event"]}
    assert set(faults) == {"node3", "coordinator"}, report["faults"]
    # the crashed node's neighbour saw its link break: listed too, with the reason its node gave
    others = [f for f in report["faults"] if "exited" not in f["event"]]
    assert all(f["event"].startswith("reported failed (replica") for f in others), others
    assert "started node4" in faults["node3"]["action"]
    assert "started coordinator-1" in faults["coordinator"]["action"]
    assert "fault at" in text and "node3 exited with -9" in text  # the printed report names them
    # the new coordinator took the run over with the placement from the store's assignment archive, and
    # rebuilt the replica that lost its node
    text = took.read_text()
    assert "adopted the placement of term 1" in text and "rebuilding replica(s) [" in text, text[-2000:]

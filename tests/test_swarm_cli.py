"""Issue 19: `crucible-swarm` as a new user types it. A flag the run cannot use ends with exit 2 and one line
naming the flag, the value and an example before any process starts (no runs/ folder is left behind), and
the swarm starts its nodes only once crucible-swarm's calibration is done (the nodes time their matmul and
reference block as they start: probes running meanwhile made them advertise a quarter of their speed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts.local_swarm import Swarm

ROOT = Path(__file__).resolve().parent.parent
REFUSED_WITHIN_S = 30.0
"""Generous on a loaded host: the slowest check (--device) imports torch to ask for a GPU."""


def swarm_cli(args: list[str], cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "scripts.local_swarm", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    return p, time.monotonic() - t


MISSING_GPU = "cuda" if torch.cuda.device_count() == 0 else f"cuda:{torch.cuda.device_count()}"
"""A GPU this host lacks: any on a CPU host (the issue's case), one past the last on a GPU host."""
GPU_FIX = "--device cpu" if torch.cuda.device_count() == 0 else "cuda:0.."


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--device", MISSING_GPU], [f"--device '{MISSING_GPU}'", "CUDA device", GPU_FIX]),
        (["--link-k", "300"], ["--link-k '300'", "must be in 1..d_model=256", "(example: --link-k 32)"]),
        (["--link-k", "32,32"], ["--link-k '32,32'", "2-stage pipeline has 1 links", "--link-k 32"]),
        (["--stages", "5"], ["--stages 5", "exceeds model.n_layers=4", "(example: --stages 2)"]),
        (["--beta", "1.5"], ["--beta 1.5", "must be in [0, 1]", "(example: --beta 0.7)"]),
        (["--run-id", "My_Run"], ["--run-id 'My_Run'", "lowercase letters", "example"]),
    ],
)
def test_a_flag_the_run_cannot_use_exits_2_before_anything_starts(
    tmp_path: Path, args: list[str], said: list[str]
) -> None:
    p, took = swarm_cli(args, tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("crucible-swarm: error: "), p.stderr
    assert all(s in lines[0] for s in said), lines[0]
    assert "Traceback" not in p.stderr and "store" not in p.stdout  # nothing was started
    assert not (tmp_path / "runs").exists()
    assert took < REFUSED_WITHIN_S, f"refused after {took:.1f} s"


@pytest.mark.slow
def test_the_nodes_start_after_what_runs_before_them(tmp_path: Path) -> None:
    """`Swarm.start(before_nodes=...)` (crucible-swarm calibrates there) runs once the store, the
    bootstrap peer and the coordinator are up, and before any node process exists."""

    class Stop(Exception):
        pass

    swarm = Swarm(tmp_path / "swarm", 2)
    seen: dict[str, object] = {}

    def before_nodes() -> None:
        seen["children"] = [c.name for c in swarm.children]
        seen["dashboard"] = swarm.dashboard
        seen["node_logs"] = sorted(p.name for p in (tmp_path / "swarm").glob("node*.log"))
        raise Stop  # end the start here: were a node started before the hook, it would be running now

    try:
        with pytest.raises(Stop):
            swarm.start(ready_timeout_s=90, before_nodes=before_nodes)
        assert seen["children"] == ["store", "bootstrap", "coordinator"]
        assert str(seen["dashboard"]).startswith("http://127.0.0.1:")
        assert seen["node_logs"] == [] and swarm.nodes == []
    finally:
        swarm.stop()

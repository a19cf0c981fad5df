"""A whole-swarm restart resumes from the checkpoints (issue 11, acceptance 3).

One replica of two stages trains on real node processes; after round 3 every process but the store is
stopped, the swarm is started again with the same key files and the run is launched again. Every stage
must resume from its LATEST checkpoint, lose at most one round, and evaluate on resuming exactly where
it stood before the stop.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.local_swarm import Swarm, set_pipeline
from tests.test_swarm import RUN_TOML, run_metrics, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_whole_swarm_restart_resumes_from_latest(tmp_path: Path) -> None:
    run_id, H, steps = "restarted", 5, 100
    toml = tmp_path / "run.toml"
    spec = (
        RUN_TOML.format(run_id=run_id, steps=steps, H=H, timeout=10)
        .replace("replicas = 2", "replicas = 1")
        .replace('method = "diloco"', 'method = "sparseloco"')
    )
    toml.write_text(set_pipeline(spec, delay_ms=5))  # paced (<= ~40 steps/s): the stop lands mid-run anywhere
    swarm = Swarm(tmp_path / "swarm", 2)
    try:
        swarm.start()
        swarm.launch(toml)
        wait_until(
            lambda: (m := run_metrics(swarm, run_id)) and len(m) == 2 and min(x["step"] for x in m) > 3 * H,
            240,
            f"{run_id} to pass round 3",
        )
        first = list(swarm.nodes)
        codes = swarm.restart()
        assert all(c == 0 for c in codes.values()), codes  # a graceful stop of every process
        ended = [
            int(s)
            for n in first
            for s in re.findall(rf"run {run_id} r0/s\d ended at step (\d+)", n.log_text())
        ]
        # the stage stopped first logs where it ended; its neighbour, whose link then closes, cannot train on
        assert ended and max(ended) < steps, ended
        stopped_at = max(ended)
        last_stage = next(n for n in first if "r0/s1" in n.log_text())
        evals = {  # the validations made before the stop (logged to 4 decimals)
            int(s): float(v)
            for s, v in re.findall(
                r"replica 0 step (\d+): validation ([\d.]+) bits/byte", last_stage.log_text()
            )
        }

        swarm.launch(toml)  # the same run again: the coordinator finds its checkpoints

        def finished() -> list[dict] | None:
            ms = run_metrics(swarm, run_id)
            return ms if len(ms) == 2 and all(m["state"] == "done" for m in ms) else None

        ms = wait_until(finished, 300, f"{run_id} to finish after the restart")
        assert all(m["step"] == steps for m in ms)
        resumed = set()
        for node in swarm.nodes:
            found = re.findall(r"resumes from round (\d+) \(step (\d+)\)", node.log_text())
            assert found, f"{node.name} did not resume:\n{node.tail()}"
            resumed.add(int(found[-1][1]))
        (step,) = resumed  # both stages resumed from the same step
        assert stopped_at - H <= step <= stopped_at, (step, stopped_at)  # at most one round lost
        after = next(m for m in ms if m["stage"] == 1)["val_history"]
        first_step, first_bpb = int(after[0][0]), after[0][1]
        assert first_step == step
        # the same weights as before the stop: the evaluation at that step is the one made then
        assert abs(first_bpb - evals[step]) <= 1e-4, (first_bpb, evals)
        # so within one round's progress of the loss measured last before the stop
        before = [evals[s] for s in sorted(evals)]
        progress = max(abs(a - b) for a, b in zip(before[-4:], before[-3:], strict=False))
        assert abs(first_bpb - before[-1]) <= progress + 1e-4, (first_bpb, before)
    finally:
        swarm.stop()

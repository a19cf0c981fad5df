"""Issue 19: crucible-swarm's progress lines and report through a rebuild. A node dies, a new one rebuilds
its replica from the checkpoint: the report's starting validation is still the run's step 0, the progress
step never goes back, and the bytes count what the dead node moved. The inputs are what the nodes' /status
serves (node.worker.WorkerMetrics.as_dict), in the order a run produces them."""

from __future__ import annotations

import re

from node.worker import WorkerMetrics
from scripts.local_swarm import Progress, build_report

RUN = "rebuilt"
MB = 1_000_000


def status(
    peer: str,
    replica: int,
    stage: int,
    step: int,
    *,
    state: str = "training",
    val: list[tuple[int, float]] | None = None,
    pipe: int = 0,
    up: int = 0,
    down: int = 0,
) -> dict:
    m = WorkerMetrics(
        state=state,
        run_id=RUN,
        replica=replica,
        stage=stage,
        step=step,
        total_steps=240,
        validation_loss_bits_per_byte=val[-1][1] if val else None,
        val_history=list(val or []),
        tokens_per_s=1500.0,
        bytes_pipe_sent=pipe,
        bytes_store_up=up,
        bytes_store_down=down,
        weights_sha256=f"w{stage}" if state == "done" else "",
    )
    return {"peer_id": peer, "state": m.state, "metrics": m.as_dict()}


def shown_step(line: str) -> int:
    m = re.search(r"step +(\d+)/240", line)
    assert m, line
    return int(m.group(1))


def test_a_rebuild_keeps_the_start_figure_the_step_and_the_bytes() -> None:
    p = Progress(RUN)
    r0 = [(0, 8.162), (20, 5.9)]
    # both replicas at step 39; replica 1's stage 1 (node3) dies there
    p.observe(
        [
            status("n0", 0, 0, 39, pipe=40 * MB, up=MB, down=MB),
            status("n1", 0, 1, 39, val=r0, pipe=40 * MB, up=MB, down=MB),
            status("n2", 1, 0, 39, pipe=40 * MB, up=MB, down=MB),
            status("n3", 1, 1, 39, val=r0, pipe=40 * MB, up=MB, down=MB),
        ]
    )
    before = p.line(60.0, 2816.0)
    assert shown_step(before) == 39 and "(predicted  2816)" in before
    # the store's two directions apart, as in the report; the pipeline counts sent bytes
    assert re.search(r"pipeline +160\.0 MB +store up +4\.0 MB down +4\.0 MB", before), before
    # node4 rebuilds replica 1 from the step-20 checkpoint: its history starts there, its counters at 0;
    # node2 is given the new epoch's assignment and counts from 0 again
    rebuilt = [(20, 5.686)]
    p.observe(
        [
            status("n0", 0, 0, 45, pipe=46 * MB, up=MB, down=MB),
            status("n1", 0, 1, 45, val=r0, pipe=46 * MB, up=MB, down=MB),
            status("n2", 1, 0, 31, pipe=11 * MB),
            status("n4", 1, 1, 31, val=rebuilt, pipe=11 * MB),
        ]
    )
    after = p.line(70.0)
    assert shown_step(after) == 45  # the furthest replica, not the rebuilt one's 31 (it read 39 -> 31)
    # dead node3's 40 MB and node2's first 40 MB are still counted: no dip
    assert re.search(r"pipeline +194\.0 MB +store up +4\.0 MB down +4\.0 MB", after), after
    # a poll that misses replica 0's nodes (their /status timed out) is still no step back
    p.observe([status("n2", 1, 0, 33, pipe=12 * MB), status("n4", 1, 1, 33, val=rebuilt, pipe=12 * MB)])
    assert shown_step(p.line(75.0)) == 45

    final = [
        status("n0", 0, 0, 240, state="done", pipe=240 * MB, up=2 * MB, down=2 * MB),
        status("n1", 0, 1, 240, state="done", val=[*r0, (240, 3.3)], pipe=240 * MB, up=2 * MB, down=2 * MB),
        status("n2", 1, 0, 240, state="done", pipe=220 * MB, up=MB, down=MB),
        status("n4", 1, 1, 240, state="done", val=[*rebuilt, (240, 3.4)], pipe=220 * MB, up=MB, down=MB),
    ]
    p.observe(final)
    ms = [s["metrics"] for s in final]
    report = build_report(RUN, ms, 200.0, "http://127.0.0.1:1", p)
    # the run started at step 0's 8.162 (it read 6.924: replica 0's step 0 averaged with the rebuilt
    # replica's step 20), and ended at the replicas' mean
    assert report["val_bpb_start"] == 8.162 and report["val_bpb_end"] == 3.35
    assert report["bytes_pipeline"] == (240 + 240 + 40 + 220 + 40 + 220) * MB
    assert (report["bytes_store_up"], report["bytes_store_down"]) == (
        2 * MB + 2 * MB + MB + MB + MB + MB,
    ) * 2
    assert report["completed"] and report["consensus_identical"] and report["steps"] == 240
    # without what was seen during the run, the live nodes' step-0 figures still give the start
    alone = build_report(RUN, ms, 200.0, "http://127.0.0.1:1")
    assert alone["val_bpb_start"] == 8.162

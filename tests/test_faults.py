"""Store faults met by real node processes (issue 10, acceptance 4).

A swarm of two one-stage replicas; node 1 reaches the embedded S3 server only through a fault-injecting HTTP
proxy (scripts/fault_proxy.py, real sockets). For a while every fragment request of node 1 is answered
503 SlowDown, held unanswered, or cut off half way, in turn. The rounds must complete (or skip cleanly), the
two replicas must end with identical weights (nothing half-applied), and node 1 must end healthy.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from scripts.fault_proxy import FaultProxy
from scripts.local_swarm import Swarm
from tests.test_swarm import RUN_TOML, run_metrics, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_node_behind_a_failing_store_completes_its_rounds(tmp_path: Path) -> None:
    run_id, H, rounds, window_s = "faulty-store", 4, 8, 8.0
    swarm = Swarm(tmp_path / "swarm", 1)
    proxy: FaultProxy | None = None
    try:
        swarm.start()
        proxy = FaultProxy(swarm.store_url)
        proxy.stall_s = 3.0
        node1 = swarm.add_node(1, store_url=proxy.url)
        swarm.health.append(node1.wait_for(r"health=(\S+)/health", 120).group(1))
        toml = tmp_path / "run.toml"
        toml.write_text(
            RUN_TOML.format(run_id=run_id, steps=H * rounds, H=H, timeout=60)
            .replace("stages = 2", "stages = 1")
            .replace('method = "diloco"', 'method = "sparseloco"')
        )
        swarm.launch(toml)
        wait_until(
            lambda: (m := run_metrics(swarm, run_id)) and len(m) == 2 and min(x["step"] for x in m) >= H,
            180,
            f"{run_id} to pass its first round",
        )
        kinds = itertools.cycle(["503", "stall", "truncate"])
        lock = threading.Lock()
        t0 = time.monotonic()

        def rule(method: str, path: str) -> str:
            if time.monotonic() - t0 > window_s or ("/sync/" not in path and "sync%2F" not in path):
                return "pass"
            with lock:
                return next(kinds)

        proxy.rule = rule

        def finished() -> list[dict] | None:
            ms = run_metrics(swarm, run_id)
            return ms if len(ms) == 2 and all(m["state"] == "done" for m in ms) else None

        ms = wait_until(finished, 300, f"{run_id} to finish through the faulty store")
        assert set(proxy.actions) == {"503", "stall", "truncate"}, proxy.actions
        assert all(m["step"] == H * rounds for m in ms)
        assert ms[0]["weights_sha256"] == ms[1]["weights_sha256"] != "", "replicas disagree"
        # every round was applied on both; a round that lost a contribution lost it on both
        assert {m["rounds"] for m in ms} == {rounds}
        assert len({m["fragments_missing"] + m["fragments_not_uploaded"] for m in ms}) == 1
        with urllib.request.urlopen(f"{swarm.health[1]}/health", timeout=5) as r:
            assert json.load(r)["status"] == "ok"
        assert swarm.nodes[1].alive
    finally:
        if proxy is not None:
            proxy.close()
        codes = swarm.stop()
        assert all(c == 0 for c in codes.values()), codes

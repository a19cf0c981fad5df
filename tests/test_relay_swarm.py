"""Nodes nobody can dial train through the relay (issue 25, acceptance 1 and 3).

Two node processes announce a pipeline port where nothing listens (as behind a NAT with no port mapped):
their dial-back check finds them unreachable, they log the verdict, the advice and the fallback, and the
replica's link runs over a libp2p stream through the bootstrap peer's relay. The relay resets each
relayed connection after 1 MiB, so the link is cut again and again mid-run; it resumes on new streams.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from scripts.local_swarm import Swarm
from tests.helpers.observability import chromium
from tests.test_swarm import RUN_TOML, run_metrics, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_nodes_train_over_the_relay_through_its_resets(tmp_path: Path) -> None:
    run_id, H, steps = "relayed", 5, 40
    toml = tmp_path / "run.toml"
    toml.write_text(
        RUN_TOML.format(run_id=run_id, steps=steps, H=H, timeout=10)
        .replace("replicas = 2", "replicas = 1")
        .replace('method = "diloco"', 'method = "sparseloco"')
    )
    hidden = {i: ["--announce-port", str(_closed_port())] for i in range(2)}
    swarm = Swarm(
        tmp_path / "swarm", 2, node_args=hidden, relay_args=["--relay-port", "0", "--relay-limit-mb", "1"]
    )
    try:
        swarm.start()
        peers = [s["peer_id"] for s in swarm.statuses()]  # type: ignore[index]

        def verdicts() -> list[dict] | None:
            st = swarm.statuses()
            ok = all(s and s["reachability"]["reachable"] is False and s["links"] for s in st)
            return st if ok else None  # type: ignore[return-value]

        # both found unreachable, and each measured the other through the relay (advertised for placement)
        statuses = wait_until(verdicts, 90, "both nodes' reachability verdicts and relayed link measures")
        for i, s in enumerate(statuses):
            other = peers[1 - i]
            assert s["links"][other]["mbps"] > 0, s["links"]
            assert s["reachability"]["relay"].startswith(swarm.relay + "/p2p-circuit/p2p/")
        for node in swarm.nodes:
            log = node.log_text()
            assert "reachability: 0 of 1 peers reached pipeline port" in log and "NOT reachable" in log, (
                node.tail()
            )
            assert "Open TCP port" in log and "--announce-port" in log  # the advice
            assert "falling back to relayed pipeline links" in log

        swarm.launch(toml)

        def shown() -> list[dict] | None:  # the dashboard shows the relayed link, from the adverts
            try:
                with urllib.request.urlopen(f"{swarm.dashboard}api/runs/{run_id}", timeout=10) as resp:
                    cells = [c for row in json.load(resp)["grid"] for c in row if c]
            except urllib.error.HTTPError:  # 404 until the coordinator took the run on
                return None
            return cells if len(cells) == 2 and all(c["relayed"] for c in cells) else None

        cells = wait_until(shown, 120, "the dashboard to show both nodes' relayed link")
        assert {c["relayed"][0] for c in cells} == set(peers) and not any(c["reachable"] for c in cells)
        dom = chromium(f"{swarm.dashboard}?run={run_id}", "--virtual-time-budget=3000", "--dump-dom")
        assert "relayed link to" in dom and "unreachable (NAT)" in dom, dom[-3000:]

        def finished() -> list[dict] | None:
            ms = run_metrics(swarm, run_id)
            return ms if len(ms) == 2 and all(m["state"] == "done" for m in ms) else None

        ms = wait_until(finished, 240, f"{run_id} to finish over the relay")
        assert all(m["step"] == steps for m in ms)
        first = next(m for m in ms if m["stage"] == 0)
        (peer,) = first["link_transport"]
        assert first["link_transport"][peer] == "relayed"
        assert "/p2p-circuit" in first["link_address"][peer]  # the stream's connection is relayed
        last = next(m for m in ms if m["stage"] == 1)
        assert "/p2p-circuit" in next(iter(last["link_address"].values()))
        # the relay cut the link at its 1 MiB limit, and the replica went on over new streams
        assert first["link_resumes"] + last["link_resumes"] > 0, (first["link_resumes"], last["link_resumes"])
        assert first["bytes_pipe_sent"] > 2 << 20
        history = last["val_history"]
        assert history[-1][1] < history[0][1], history  # it trained
    finally:
        swarm.stop()

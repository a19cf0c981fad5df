"""Issue 13 acceptance 1: the coordinator is elected from the nodes, and a dead leader is replaced.

Four real node processes, no standalone coordinator: nodes 0 and 1 are coordinator-eligible (each runs
`crucible-coordinator serve` as a supervised child, signing with its own key under a certificate the
operator issued; the operator key is only used to certify and to launch). The leader is whoever holds the
run's lease (5 s here). SIGKILL the leading node: its coordinator dies with it, the other candidate takes
the lease within the lease time + 5 s and re-issues the assignments under its term, the run goes on, and
an assignment the deposed leader signs afterwards at its old term is refused by the nodes as stale.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from protocol import keys
from protocol.identity import Identity
from protocol.net.dht_client import DHTClient
from protocol.trust.delegation import issue
from scripts.local_swarm import Swarm
from tests.test_swarm import RUN_TOML, run_metrics, wait_until

pytestmark = pytest.mark.slow
LEASE_S = 5.0


def _leader(out: Path, ids: list[Identity]) -> tuple[int, int] | None:
    """(candidate index, term) of the newest lease taken in the candidates' coordinator logs."""
    newest = None
    for i, ident in enumerate(ids):
        log = out / f"coordinator-{ident.peer_id[-8:]}.log"
        text = log.read_text() if log.exists() else ""
        for term in re.findall(r"run swarm-e: took the lease \(term (\d+)\)", text):
            if newest is None or int(term) > newest[1]:
                newest = (i, int(term))
    return newest


def test_an_elected_coordinator_fails_over_and_the_deposed_one_is_stale(tmp_path: Path) -> None:
    out = tmp_path / "swarm"
    out.mkdir()
    operator = Identity.load_or_create(out / "operator.key")
    ids = [Identity.load_or_create(out / f"node{i}.key") for i in range(4)]
    args = {}
    for i in (0, 1):
        cert = out / f"node{i}.cert"
        cert.write_bytes(issue(operator, ids[i].peer_id, expires_at=time.time() + 3600))
        args[i] = ["--coordinator-eligible", "--coordinator-certificate", str(cert)]
        args[i] += ["--coordinator-lease-s", str(LEASE_S), "--coordinator-churn-grace-s", "6"]
    swarm = Swarm(out, 4, node_args=args, coordinator=False)
    dht = None
    try:
        swarm.start()
        toml = tmp_path / "run.toml"
        spec = RUN_TOML.format(run_id="swarm-e", steps=5000, H=5, timeout=30)  # still training at the end
        toml.write_text(spec.replace("replicas = 2", "replicas = 1"))  # two spare nodes for a rebuild
        swarm.launch(toml)
        first = wait_until(lambda: _leader(out, ids), 60, "a candidate to take the run's lease")
        wait_until(
            lambda: (m := run_metrics(swarm, "swarm-e")) and len(m) == 2 and min(x["step"] for x in m) >= 5,
            120,
            "the run to train under the elected coordinator",
        )
        old, old_term = first
        swarm.nodes[old].kill()  # the leading node, and its coordinator child with it
        killed_at = time.monotonic()
        new = wait_until(
            lambda: (got := _leader(out, ids)) and got[1] > old_term and got,
            30,
            "the other candidate to take the lease over",
            poll_s=0.1,
        )
        took_s = time.monotonic() - killed_at
        assert new[0] == 1 - old and took_s <= LEASE_S + 5, (new, took_s)
        print(f"takeover {took_s:.1f} s after the kill (lease {LEASE_S:.0f} s)")

        alive = [i for i in range(4) if i != old]
        at_takeover = max(m["step"] for m in run_metrics(swarm, "swarm-e"))
        wait_until(
            lambda: max(m["step"] for m in run_metrics(swarm, "swarm-e")) >= at_takeover + 10,
            180,
            "the run to go on under the new leader",
        )

        # the deposed leader's key signs one more assignment at its old term (a clock-skewed or partitioned
        # leader would): a node holding the new term refuses it as stale
        def holder_of_new_term() -> list[int]:  # a node of the run, training under the new leader's term
            sts = swarm.statuses()
            return [
                i
                for i in alive
                if (st := sts[i])
                and st["metrics"]["run_id"] == "swarm-e"
                and st["metrics"]["state"] == "training"
                and st["assignment"]["term"] == new[1]
            ]

        target = wait_until(holder_of_new_term, 60, "a node of the run to train under the new term")[0]
        dht = DHTClient(Identity.generate(), bootstrap=[swarm.bootstrap])
        cert = (out / f"node{old}.cert").read_bytes()
        from dataclasses import replace

        from protocol.messages import Assignment

        got = dht.get_all(keys.assignment_key(ids[target].peer_id), Assignment)
        current = next(s.body for s in got.values() if s.body.term == new[1])
        forged = replace(
            current, term=old_term, epoch=current.epoch + 50, issued_at=time.time(), certificate=cert
        )
        assert dht.publish(keys.assignment_key(ids[target].peer_id), forged, 60, signer=ids[old])
        line = f"ignoring stale assignment of run swarm-e term {old_term} epoch {current.epoch + 50}"
        wait_until(
            lambda: line in swarm.nodes[target].log_text(), 30, "the node to refuse the stale assignment"
        )
        after = swarm.statuses()[target]
        assert after is not None and after["assignment"]["term"] == new[1]
        assert after["metrics"]["state"] == "training"
    finally:
        if dht is not None:
            dht.shutdown()
        swarm.stop()

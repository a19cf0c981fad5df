"""Issue 19: a node restarted with the same key after its replica dropped out (epoch 2) took the stale
assignment of term 1 epoch 1, still republished in the DHT, and showed `training ... step 0` until after
the run was done. A node now acts only on a current assignment (node/daemon.py `AssignmentSource`): none
of its run is newer in the coordinators' archives in the store, and the run is not over. Against a real
hivemind DHT and a real S3 server (moto), with records laid out as coordinator/service.py writes them."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack
import pytest

from coordinator.lease import launch, try_acquire
from protocol import keys
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Assignment, RunRecord, RunState
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.store import ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, RunSpec
from protocol.trust.delegation import OperatorTrust, RefusalLog

if TYPE_CHECKING:
    from node.daemon import AssignmentSource

pytestmark = pytest.mark.timeout(120)
OPERATOR = Identity.from_seed(bytes([19]) * 32)
TTL_S = 60.0


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="stale-assignments"))
    s.ensure_bucket()
    return s


@pytest.fixture(scope="module")
def dht() -> Iterator[DHTClient]:
    """The coordinator's side of the DHT (it publishes what the operator's key signs)."""
    d = DHTClient(OPERATOR)
    try:
        yield d
    finally:
        d.shutdown()


@dataclass
class Run:
    """A 2 x 2 run as a coordinator lays it out: assignments in the DHT, archives in the store."""

    dht: DHTClient
    store: ObjectStore
    node: Identity
    """The node of replica 1, stage 1: the one that restarts."""

    def __post_init__(self) -> None:
        self.rid = f"stale-{uuid.uuid4().hex[:8]}"
        self.spec = RunSpec(
            run_id=self.rid, replicas=2, stages=2, model=ModelSpec(d_model=32, n_layers=2, n_heads=2)
        )
        self.peers = {(r, s): Identity.generate().peer_id for r in range(2) for s in range(2)}
        self.peers[(1, 1)] = self.node.peer_id
        # launched by the operator, led under its key at term 1 (protocol/trust/run_authority.py)
        launch(self.dht, self.store, OPERATOR, RunRecord(spec=self.spec, updated=dht_time()))
        assert try_acquire(self.store, OPERATOR, self.rid, 600) is not None

    def assignment(self, r: int, s: int, *, term: int, epoch: int, listed: tuple[int, ...]) -> Assignment:
        return Assignment(
            run_id=self.rid, term=term, epoch=epoch, peer_id=self.peers[(r, s)], replica=r, stage=s,
            layers=list(self.spec.layer_ranges()[s]), spec=self.spec,
            stage_peers={str(rr): self.peers[(rr, s)] for rr in listed}, issued_at=dht_time(),
        )  # fmt: skip

    def archive(self, term: int, epoch: int, assignments: list[Assignment]) -> None:
        """What RunPublisher.archive_and_publish (coordinator/run_publisher.py) writes (then it publishes each in the DHT)."""
        blob = msgpack.packb([seal(OPERATOR, a) for a in assignments])
        self.store.put(keys.assign_key(self.rid, term, epoch), blob)
        for a in assignments:
            assert self.dht.publish(keys.assignment_key(a.peer_id), a, TTL_S, signer=OPERATOR)

    def state(self, state: RunState) -> None:
        record = RunRecord(
            spec=self.spec, state=state, term=1, coordinator=OPERATOR.peer_id, updated=dht_time()
        )
        assert self.dht.publish(keys.RUNS_KEY, record, TTL_S, signer=OPERATOR, name=self.rid)

    def replica_1_drops_out(self) -> Assignment:
        """Placed at epoch 1; replica 1 loses a node with none free: the survivors get epoch 2 without it,
        replica 1's nodes keep their epoch-1 assignments (still in the archive and the DHT). Returns the
        restarting node's stale one."""
        self.state("running")
        first = [self.assignment(r, s, term=1, epoch=1, listed=(0, 1)) for r, s in self.peers]
        self.archive(1, 1, first)
        survivors = [self.assignment(0, s, term=1, epoch=2, listed=(0,)) for s in range(2)]
        self.archive(1, 2, survivors + [a for a in first if a.replica == 1])
        return next(a for a in first if a.peer_id == self.node.peer_id)


def source(run: Run) -> AssignmentSource:
    """The node's assignment rule, reading what `run` laid out (torch is imported with node.daemon)."""
    from node.daemon import AssignmentSource

    trust = OperatorTrust.of({OPERATOR.public_key})
    return AssignmentSource(
        run.node.peer_id, run.dht, run.store, trust, RefusalLog(logging.getLogger(__name__))
    )


def test_an_assignment_superseded_by_a_newer_epoch_or_of_an_ended_run_is_not_current(
    dht: DHTClient, store: ObjectStore
) -> None:
    run = Run(dht, store, Identity.generate())
    stale = run.replica_1_drops_out()
    src = source(run)
    (found,) = src.newest(src.found())
    assert (found.term, found.epoch) == (1, 1)  # what the DHT still holds for the restarted node
    why = src.why_not_current(found)
    assert why is not None and "superseded by term 1 epoch 2" in why and "dropped out" in why
    assert src.last_ignored is not None and src.last_ignored["epoch"] == stale.epoch == 1

    # junk under newer archive names (anyone with store credentials can write there) supersedes nothing
    store.put(keys.assign_key(run.rid, 999999, 999999), b"\x93 not an archive")
    stranger = Identity.generate()
    forged = run.assignment(0, 0, term=7, epoch=7, listed=(0,))
    store.put(keys.assign_key(run.rid, 7, 7), msgpack.packb([seal(stranger, forged)]))
    # the replica is rebuilt with the restarted node: epoch 3 is current for it
    rebuilt = [run.assignment(r, s, term=1, epoch=3, listed=(0, 1)) for r, s in run.peers]
    run.archive(1, 3, rebuilt)
    (found,) = src.newest(src.found())
    assert found.epoch == 3 and src.why_not_current(found) is None

    # a run that is over: not even its newest assignment is taken
    again = Run(dht, store, Identity.generate())
    again.state("done")
    newest = [again.assignment(r, s, term=1, epoch=1, listed=(0, 1)) for r, s in again.peers]
    again.archive(1, 1, newest)
    src = source(again)
    (found,) = src.newest(src.found())
    assert src.why_not_current(found) == f"run {again.rid} is done"


def test_a_node_training_on_is_told_when_a_newer_epoch_leaves_it_out(
    dht: DHTClient, store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`AssignmentSource.left_out`, which the round owner asks before it applies a round: replica 1's node,
    training on under epoch 1 after its replica dropped out at epoch 2, is left out; a survivor whose epoch 2
    keeps its slot (only the signers changed) is not, nor is the node once epoch 3 rebuilds its replica with
    it; a forged newer archive, or an older one copied under a newer name, leaves nobody out."""
    monkeypatch.setattr("node.daemon.LEFT_OUT_TTL_S", 0.0)  # each call reads the archives afresh
    run = Run(dht, store, Identity.generate())
    held = run.replica_1_drops_out()
    src = source(run)
    why = src.left_out(held)
    assert why is not None and "term 1 epoch 2 gives this node no slot" in why and "dropped out" in why
    kept = run.assignment(0, 1, term=1, epoch=1, listed=(0, 1))
    assert source_of(run, kept.peer_id).left_out(kept) is None  # epoch 2 holds replica 0's slot for it
    # another node takes the slot at epoch 3: still left out (no slot); then epoch 4 gives it stage 0
    run.peers[(1, 1)] = Identity.generate().peer_id
    run.archive(1, 3, [run.assignment(r, s, term=1, epoch=3, listed=(0, 1)) for r, s in run.peers])
    assert "gives this node no slot" in (src.left_out(held) or "")
    run.peers[(1, 0)] = run.node.peer_id
    run.archive(1, 4, [run.assignment(r, s, term=1, epoch=4, listed=(0, 1)) for r, s in run.peers])
    assert "gives this node another slot" in (src.left_out(held) or "")
    # epoch 5 gives it its slot back; epoch 2's archive copied under epoch 6's name says nothing
    run.peers[(1, 0)], run.peers[(1, 1)] = run.peers[(1, 1)], run.node.peer_id
    run.archive(1, 5, [run.assignment(r, s, term=1, epoch=5, listed=(0, 1)) for r, s in run.peers])
    assert src.left_out(held) is None
    store.put(keys.assign_key(run.rid, 1, 6), store.get(keys.assign_key(run.rid, 1, 2)) or b"")
    assert src.left_out(held) is None
    # a forged archive at a newer epoch (a stranger's signature) says nothing
    again = Run(dht, store, Identity.generate())
    again.state("running")
    first = [again.assignment(r, s, term=1, epoch=1, listed=(0, 1)) for r, s in again.peers]
    again.archive(1, 1, first)
    forged = again.assignment(0, 0, term=1, epoch=2, listed=(0,))
    store.put(keys.assign_key(again.rid, 1, 2), msgpack.packb([seal(Identity.generate(), forged)]))
    mine = next(a for a in first if a.peer_id == again.node.peer_id)
    assert source(again).left_out(mine) is None


def source_of(run: Run, peer_id: str) -> AssignmentSource:
    """`source` for another node of `run`."""
    from node.daemon import AssignmentSource

    trust = OperatorTrust.of({OPERATOR.public_key})
    return AssignmentSource(peer_id, run.dht, run.store, trust, RefusalLog(logging.getLogger(__name__)))


def test_a_restarted_node_does_not_take_its_dropped_replica_s_old_slot(
    dht: DHTClient, store: ObjectStore, moto_store: str
) -> None:
    """The whole node, in-process: it joins the DHT, finds the epoch-1 assignment of its replica, which
    dropped out at epoch 2, and stays idle, saying why in /status."""
    from node.daemon import NodeConfig, NodeDaemon

    node = Identity.generate()
    run = Run(dht, store, node)
    run.replica_1_drops_out()
    cfg = NodeConfig(
        bootstrap=dht.visible_maddrs(),
        operator_key=OPERATOR.peer_id,
        store=StoreConfig(endpoint_url=moto_store, bucket="stale-assignments"),
        device="cpu",
        poll_s=0.2,
        probe_peers=0,
    )
    daemon = NodeDaemon(cfg, node)
    serving = threading.Thread(target=daemon.serve, daemon=True)
    serving.start()
    try:
        url = f"http://127.0.0.1:{daemon.health.port}/status"

        def status() -> dict:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.load(r)

        deadline = time.monotonic() + 30
        while (st := status())["ignored_assignment"] is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ignored = st["ignored_assignment"]
        assert ignored and ignored["run_id"] == run.rid and (ignored["term"], ignored["epoch"]) == (1, 1)
        assert "superseded by term 1 epoch 2" in ignored["reason"]
        time.sleep(1.0)  # a few more polls: still not taken
        st = status()
        assert st["state"] == "idle" and st["assignment"] is None, st
        assert daemon._worker_thread is None
    finally:
        daemon.stop_event.set()
        serving.join(30)
        daemon.shutdown()

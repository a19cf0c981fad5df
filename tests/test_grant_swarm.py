"""Issue 21, acceptance 6: nodes holding only their grants train a whole run.

A real swarm (scripts/local_swarm.py): the embedded store behind the SigV4-checking front
(scripts/store_front.py), two nodes that read with the read-only key pair and write only through the grants
the coordinator seals to them (--store-grants), and a coordinator that holds the full key pair and issues
grants that live 36 s (--store-grant-hours 0.01: renewed during the run) sized for 5 MiB parts. The 2x1 run
trains to the end with checkpoints of several parts; then, with a node's real grants, a write to another
replica's key, an expired grant, a forged one, an unsigned PUT and an overwrite of its own key are each
refused by the store.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import urllib3

from protocol import keys
from protocol.identity import Identity
from protocol.net.grants import WRITE_ONCE
from protocol.net.store import ObjectStore, StoreConfig, StoreError
from protocol.trust.delegation import OperatorTrust
from protocol.trust.grant_mail import read_mails
from scripts.local_swarm import Swarm
from scripts.store_front import FULL_KEY, READ_ONLY_KEY
from tests.test_swarm import run_metrics, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "grant-run"
RUN_TOML = f"""\
[run]
run_id = "{RUN}"
replicas = 2
stages = 1
[model]
d_model = 128
n_layers = 4
n_heads = 2
d_ff = 512
seq_len = 64
[train]
total_steps = 8
batch_size = 4
microbatches = 2
lr = 3e-3
warmup_steps = 2
eval_batches = 1
[sync]
method = "diloco"
H = 4
timeout_s = 30
"""
NODE_FLAGS = [
    "--store-access-key",
    READ_ONLY_KEY[0],
    "--store-secret-key",
    READ_ONLY_KEY[1],
    "--store-grants",
]
http = urllib3.PoolManager(retries=False)


class GrantSwarm(Swarm):
    """A local swarm whose store checks signatures as R2 does, and whose coordinator grants 5 MiB parts."""

    def start(self, ready_timeout_s: float = 120, before_nodes: Callable[[], None] | None = None) -> None:
        store = self._spawn("store", ["-m", "scripts.embedded_store", "--front"])
        self.store_url = store.wait_for(r"STORE (\S+)", ready_timeout_s).group(1)
        self._start_swarm(ready_timeout_s, before_nodes)

    @staticmethod
    def coordinator_flags() -> list[str]:
        return [*Swarm.coordinator_flags(), "--store-part-mib", "5", "--store-grant-hours", "0.01"]


def _refused(r: urllib3.BaseHTTPResponse, code: str) -> None:
    assert r.status in (400, 403, 412), (r.status, r.data)
    assert f"<Code>{code}</Code>".encode() in r.data, r.data


def test_nodes_holding_only_their_grants_train_a_whole_run(tmp_path: Path) -> None:
    swarm = GrantSwarm(tmp_path / "swarm", 2, node_args={0: NODE_FLAGS, 1: NODE_FLAGS})
    try:
        swarm.start()
        toml = tmp_path / "run.toml"
        toml.write_text(RUN_TOML)
        swarm.launch(toml)
        ms = wait_until(
            lambda: (
                (m := run_metrics(swarm, RUN)) and len(m) == 2 and all(x["state"] == "done" for x in m) and m
            ),
            240,
            f"2 nodes to finish run {RUN} through their grants",
        )
        assert all(m["rounds"] == 2 for m in ms)
        assert len({m["weights_sha256"] for m in ms}) == 1  # the replicas agree: every fragment got through
        assert re.search(rf"run {RUN}: granted replica 1 stage 0", swarm.coordinator.log_text())

        full = ObjectStore(
            StoreConfig(endpoint_url=swarm.store_url, access_key=FULL_KEY[0], secret_key=FULL_KEY[1])
        )
        reader = ObjectStore(
            StoreConfig(
                endpoint_url=swarm.store_url, access_key=READ_ONLY_KEY[0], secret_key=READ_ONLY_KEY[1]
            )
        )
        listed = full.list(f"{RUN}/")
        fragments = [k for k in listed if k.startswith(f"{RUN}/sync/")]
        assert fragments and all(k.endswith(f"/{keys.PRIMARY_NAME}") for k in fragments)  # primary keys only
        assert not [k for k in listed if "LATEST" in k]  # no pointer: a grant cannot move one
        for replica in (0, 1):
            for rnd in (1, 2):
                info = full.head(keys.ckpt_tensors_key(RUN, rnd=rnd, stage=0, replica=replica))
                assert info is not None and info.size > 10 << 20
                parts = re.search(r'-(\d+)"$', info.etag)
                assert parts and int(parts.group(1)) >= 3, info.etag  # several 5 MiB parts
            assert reader.get(keys.report_key(RUN, replica, 0)) is not None
        with pytest.raises(StoreError, match="AccessDenied"):
            reader.put(f"{RUN}/spec", b"x")  # the nodes' own key pair writes nothing

        # a node's real grants, opened with its key file as the node does
        node0 = Identity.load_or_create(swarm.out / "node0.key")
        node1 = Identity.load_or_create(swarm.out / "node1.key")
        trust = OperatorTrust.of({swarm.operator.public_key})
        mails = read_mails(reader, node0, trust, RUN)  # more than one if the run outlasted half of 36 s
        mail, grants = mails[0]
        assert mail.recipient == node0.peer_id and mail.stage == 0
        me, them = mail.replica, 1 - mail.replica
        own = keys.primary_fragment_key(RUN, 0, 0, 0, me, node0.peer_id)
        g = next(x for x in grants.puts if x.key == own)
        other = keys.primary_fragment_key(RUN, 0, 0, 1, them, node1.peer_id)
        _refused(  # another replica's key
            http.request("PUT", g.url.replace(own, other), body=b"x", headers=WRITE_ONCE),
            "SignatureDoesNotMatch",
        )
        forged = g.url[:-1] + ("0" if g.url[-1] != "0" else "1")
        _refused(http.request("PUT", forged, body=b"x", headers=WRITE_ONCE), "SignatureDoesNotMatch")
        _refused(
            http.request("PUT", f"{swarm.store_url}/{full.cfg.bucket}/{other}", body=b"x"), "AccessDenied"
        )  # unsigned
        # an overwrite of its own key, with its newest grant of it (still valid: renewed at half its life)
        newest = max((x for _, gs in mails for x in gs.puts if x.key == own), key=lambda x: x.expires_at)
        assert newest.expires_at > time.time()
        assert http.request("PUT", newest.url, body=b"x", headers=WRITE_ONCE).status == 412
        # an expired grant (the first mail's, once its 36 s are past)
        expired = next(x for x in grants.puts if x.key == keys.report_key(RUN, me, 0))
        time.sleep(max(0.0, expired.expires_at + 1.5 - time.time()))
        _refused(http.request("PUT", expired.url, body=b"x", headers=WRITE_ONCE), "AccessDenied")
        assert full.get(other) is not None and full.get(own) != b"x"
    finally:
        codes = swarm.stop()
        assert all(v == 0 for v in codes.values()), codes

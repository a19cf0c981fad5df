"""Grant mail and its wiring (issue 21): grants sealed to their node, issued for its slot, written with.

A real moto server behind the real SigV4 front (scripts/store_front.py) on loopback: the coordinator writes
with the full key pair, the node reads with the read-only pair and writes only through what it was mailed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from coordinator.grant_issuer import WINDOW, GrantIssuer, checkpoint_parts
from coordinator.lease import HeldLease
from coordinator.managed_run import ManagedRun
from coordinator.placement import Placement
from protocol import keys
from protocol.checkpoint import write_checkpoint
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages import Lease, NodeAdvert, RunRecord
from protocol.net.grants import Grantor, Grants, NoGrant
from protocol.net.store import MIN_PART_BYTES, ObjectStore, StoreConfig
from protocol.runspec import ModelSpec, ReplicaShape, RunSpec, SyncSpec, TrainSpec
from protocol.trust.delegation import OperatorTrust, Untrusted, issue
from protocol.trust.grant_mail import (
    GrantInbox,
    GrantMailError,
    mail_key_hex,
    open_mail,
    read_mails,
    write_mail,
)
from scripts.embedded_store import s3_server
from scripts.store_front import FULL_KEY, READ_ONLY_KEY, StoreFront, store_front

BUCKET = "mail"
RUN = "run-m"
OPERATOR = Identity.generate()
TRUST = OperatorTrust.of({OPERATOR.public_key})


@pytest.fixture(scope="module")
def front() -> Iterator[StoreFront]:
    with s3_server() as upstream, store_front(upstream) as f:
        ObjectStore(_cfg(f, FULL_KEY)).ensure_bucket()
        yield f


def _cfg(front: StoreFront, key: tuple[str, str], *, grants: bool = False, part_mib: int = 64) -> StoreConfig:
    return StoreConfig(
        endpoint_url=front.url,
        bucket=BUCKET,
        access_key=key[0],
        secret_key=key[1],
        grants=grants,
        part_mib=part_mib,
    )


def _mail(store: ObjectStore, issuer: Identity, node: Identity, grants: Grants, **kw: object) -> bool:
    args: dict = dict(
        recipient=node.peer_id,
        recipient_mail_key=mail_key_hex(node),
        run_id=RUN,
        term=1,
        replica=0,
        stage=0,
        first_round=0,
        rounds=WINDOW,
        part_bytes=MIN_PART_BYTES,
        expires_at=max([g.expires_at for g in grants.puts], default=time.time() + 600),
    )
    args.update(kw)
    return write_mail(store, issuer, grants, **args)


def test_the_mail_key_is_the_node_s_own_and_the_advert_carries_it() -> None:
    node = Identity.generate()
    key = mail_key_hex(node)
    assert key == mail_key_hex(Identity.from_seed(node.seed)) != mail_key_hex(Identity.generate())
    advert = NodeAdvert(
        peer_id=node.peer_id,
        version="0",
        device="cpu",
        memory_gb=1,
        tflops=1,
        price_per_hour=0,
        host="127.0.0.1",
        port=1,
        health_port=2,
        mail_key=key,
    )
    assert advert.mail_key == key and replace(advert, mail_key="").mail_key == ""
    for bad in ("ab", key.upper(), "g" * 64):
        with pytest.raises(ValueError, match="mail_key"):
            replace(advert, mail_key=bad)


def test_a_mail_opens_only_for_its_node_and_only_from_a_trusted_issuer(front: StoreFront) -> None:
    full = ObjectStore(_cfg(front, FULL_KEY))
    grantor = Grantor(_cfg(front, FULL_KEY))
    node, other = Identity.generate(), Identity.generate()
    grants = Grants(puts=(grantor.grant(f"{RUN}/report/r0-s0", 600),))
    coord = Identity.generate()
    cert = issue(OPERATOR, coord.peer_id, expires_at=time.time() + 86400, run=RUN)
    assert _mail(full, coord, node, grants, certificate=cert)
    assert not _mail(full, coord, node, grants, certificate=cert)  # write-once: the same first round and term
    key = keys.grant_mail_key(RUN, node.peer_id, 0, 1)
    data = full.get(key)
    assert data is not None
    mail, opened = open_mail(data, node, TRUST, RUN)
    assert opened == grants and mail.certificate == cert and mail.term == 1
    assert b"X-Amz-Signature" not in data  # the URLs travel encrypted
    with pytest.raises(GrantMailError, match="not for this node"):
        open_mail(data, other, TRUST, RUN)
    with pytest.raises(GrantMailError, match="not for this node"):
        open_mail(data, node, TRUST, "run-other")
    # an uncertified signer (a node, anyone with store access) cannot issue grants
    _mail(full, Identity.generate(), node, grants, first_round=5)
    stranger = full.get(keys.grant_mail_key(RUN, node.peer_id, 5, 1))
    assert stranger is not None
    with pytest.raises(Untrusted, match="uncertified"):
        open_mail(stranger, node, TRUST, RUN)
    # a box moved into a mail with another header (here: another node's) does not decrypt
    _mail(full, OPERATOR, other, grants, first_round=7)
    moved = full.get(keys.grant_mail_key(RUN, other.peer_id, 7, 1))
    assert moved is not None
    theirs, _ = open_mail(moved, other, TRUST, RUN)
    planted = seal(OPERATOR, replace(mail, box=theirs.box, certificate=b""))
    with pytest.raises(GrantMailError, match="does not decrypt"):
        open_mail(planted, node, TRUST, RUN)
    # the node's look takes the good mail and skips (and logs) the stranger's
    got = read_mails(ObjectStore(_cfg(front, READ_ONLY_KEY)), node, TRUST, RUN)
    assert [m.first_round for m, _ in got] == [0]


def test_a_node_writes_through_its_mails_and_asks_again_when_a_grant_is_missing(
    front: StoreFront,
) -> None:
    full = ObjectStore(_cfg(front, FULL_KEY))
    grantor = Grantor(_cfg(front, FULL_KEY))
    node = Identity.generate()
    inbox = GrantInbox(_cfg(front, READ_ONLY_KEY, grants=True), node, TRUST, RUN)
    store = inbox.store
    assert not inbox.wait(0.2, lambda: False, poll_s=0.05)  # no mail yet
    first = f"{RUN}/sync/s0/f0/r00000001/{node.peer_id}/fragment"
    with pytest.raises(NoGrant):
        store.put_if_absent(first, b"x")
    _mail(full, OPERATOR, node, Grants(puts=(grantor.grant(first, 600),)))
    store.refill_every_s = 0.0
    assert store.put_if_absent(first, b"x")  # the miss read the new mail
    assert inbox.mails == 1 and store.part_bytes == MIN_PART_BYTES

    # a checkpoint through grants: multipart at the mailed part size, and no LATEST pointer
    rnd, tensors = 3, {"w": torch.arange(3 * MIN_PART_BYTES // 4 + 10, dtype=torch.float32)}
    tkey = keys.ckpt_tensors_key(RUN, rnd=rnd, stage=0, replica=0)
    mkey = keys.ckpt_manifest_key(RUN, rnd=rnd, stage=0, replica=0)
    up = grantor.open_multipart(tkey, 5, 600)
    _mail(full, OPERATOR, node, Grants(puts=grantor.grants([mkey], 600).puts, uploads=(up,)), first_round=2)
    write_checkpoint(store, node, run_id=RUN, stage=0, replica=0, round=rnd, step=6, tensors=tensors)
    info = full.head(tkey)
    assert info is not None and info.etag.endswith('-4"')  # four 5 MiB parts
    assert full.get(mkey) is not None
    assert full.get(keys.ckpt_pointer_key(RUN, stage=0, replica=0)) is None


def _spec() -> RunSpec:
    return RunSpec(
        run_id=RUN,
        replicas=2,
        stages=1,
        model=ModelSpec(d_model=128, n_layers=4, n_heads=2, d_ff=512, seq_len=64),
        train=TrainSpec(total_steps=100, batch_size=4, microbatches=2, warmup_steps=2),
        sync=SyncSpec(method="diloco", H=2, P=2, checkpoint_every=2),
    )


def test_the_issuer_grants_each_node_its_slot_s_keys_for_a_window_and_renews(front: StoreFront) -> None:
    spec = _spec()
    coordinator = ObjectStore(_cfg(front, FULL_KEY, part_mib=5))
    issuer = GrantIssuer(OPERATOR, coordinator)
    nodes = [Identity.generate(), Identity.generate()]
    pl = Placement(slots={(r, 0): n.peer_id for r, n in enumerate(nodes)})
    lease = HeldLease(Lease(run_id=RUN, term=3, holder=OPERATOR.peer_id, expires_at=2e9), etag="")
    run = ManagedRun(record=RunRecord(spec=spec, state="running"), lease=lease, placement=pl)

    def advert(n: Identity, step: int, mail: bool = True) -> NodeAdvert:
        replica = [x.peer_id for x in nodes].index(n.peer_id)
        return NodeAdvert(
            peer_id=n.peer_id,
            version="0",
            device="cpu",
            memory_gb=1,
            tflops=1,
            price_per_hour=0,
            host="127.0.0.1",
            port=1,
            health_port=2,
            run_id=RUN,
            replica=replica,
            stage=0,
            step=step,
            mail_key=mail_key_hex(n) if mail else "",
        )

    ads = {n.peer_id: advert(n, 0, mail=i == 0) for i, n in enumerate(nodes)}
    assert issuer.issue(run, ads) == 1  # the other node holds full credentials: no mail for it
    assert issuer.issue(run, ads) == 0  # nothing due
    (mail, grants), *_ = read_mails(coordinator, nodes[0], TRUST, RUN)
    assert (mail.term, mail.first_round, mail.rounds, mail.replica) == (3, 0, WINDOW, 0)
    granted = {g.key for g in grants.puts}
    assert keys.primary_fragment_key(RUN, 0, 1, WINDOW - 1, 0, nodes[0].peer_id) in granted
    assert keys.primary_fragment_key(RUN, 0, 0, WINDOW, 0, nodes[0].peer_id) not in granted
    assert not any(nodes[1].peer_id in k for k in granted)  # another replica's keys: none
    assert keys.ckpt_manifest_key(RUN, rnd=2, stage=0, replica=1) not in granted
    assert keys.ckpt_manifest_key(RUN, rnd=2, stage=0, replica=0) in granted
    assert keys.ckpt_manifest_key(RUN, rnd=3, stage=0, replica=0) not in granted  # not a checkpoint round
    assert keys.report_key(RUN, 0, 0) in granted and len(grants.uploads) == WINDOW // 2 - 1  # 2, 4, .. 30
    assert len(grants.uploads[0].part_urls) == checkpoint_parts(spec, 0, 5 << 20) > 2
    # the node nears the end of its window: a mail from its round on
    ads[nodes[0].peer_id] = advert(nodes[0], 2 * (WINDOW // 2 + 1))
    assert issuer.issue(run, ads) == 1
    newest = read_mails(coordinator, nodes[0], TRUST, RUN, {keys.grant_mail_key(RUN, nodes[0].peer_id, 0, 3)})
    assert [m.first_round for m, _ in newest] == [WINDOW // 2 + 1]
    for _, g in newest + [(mail, grants)]:
        for u in g.uploads:
            issuer.grantor.abort(u)


def test_a_node_of_a_mixed_layout_run_is_granted_its_own_layer_groups_keys(front: StoreFront) -> None:
    """Issue 22: fragments are keyed by layer group. Replica 0 in one stage, replica 1 in two ([1, 3] of 4
    layers): groups [0,1) [1,4). Replica 1's stage 1 holds group 1 alone: it is granted group 1's fragment
    keys (its slot's), never group 0's, which its replica's stage 0 signs."""
    spec = replace(
        _spec(),
        shapes=[ReplicaShape(replicas=[1], stages=2, layer_split=[1, 3])],
    )
    assert spec.layer_groups() == [(0, 1), (1, 4)] and spec.groups_of(1, 1) == [1]
    coordinator = ObjectStore(_cfg(front, FULL_KEY, part_mib=5))
    issuer = GrantIssuer(OPERATOR, coordinator)
    nodes = {(0, 0): Identity.generate(), (1, 0): Identity.generate(), (1, 1): Identity.generate()}
    pl = Placement(slots={slot: n.peer_id for slot, n in nodes.items()})
    lease = HeldLease(Lease(run_id=RUN, term=4, holder=OPERATOR.peer_id, expires_at=2e9), etag="")
    run = ManagedRun(record=RunRecord(spec=spec, state="running"), lease=lease, placement=pl)
    me = nodes[1, 1]
    ads = {
        n.peer_id: NodeAdvert(
            peer_id=n.peer_id,
            version="0",
            device="cpu",
            memory_gb=1,
            tflops=1,
            price_per_hour=0,
            host="127.0.0.1",
            port=1,
            health_port=2,
            run_id=RUN,
            replica=r,
            stage=s,
            mail_key=mail_key_hex(n) if n is me else "",
        )
        for (r, s), n in nodes.items()
    }
    assert issuer.issue(run, ads) == 1
    (_, grants), *_ = read_mails(coordinator, me, TRUST, RUN)
    granted = {g.key for g in grants.puts}
    for rnd in range(WINDOW):
        for f in range(spec.sync.P):
            assert keys.primary_fragment_key(RUN, 1, f, rnd, 1, me.peer_id) in granted
            assert keys.primary_fragment_key(RUN, 0, f, rnd, 1, me.peer_id) not in granted
    assert keys.ckpt_manifest_key(RUN, rnd=2, stage=1, replica=1) in granted
    for u in grants.uploads:
        issuer.grantor.abort(u)

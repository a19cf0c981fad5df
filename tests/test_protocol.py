"""The shared contract: identities, signed envelopes, schema checks, framing, DHT subkey ownership."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import fields

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord

from protocol.codecs.sparseloco import SparseLoCoConfig
from protocol.envelope import UntrustedSigner, VersionError, open_envelope, seal
from protocol.framing import ConnectionClosed, FrameError, encode_frame, recv_frame, send_frame
from protocol.identity import Identity, SignatureError, peer_id_of, public_key_of_peer_id
from protocol.messages import Endpoint, Hello, NodeAdvert
from protocol.net.dht_validator import SignedSubkeyValidator
from protocol.runspec import RunSpec, SyncSpec, load_run_spec
from protocol.schema import SchemaError, from_dict, to_dict
from protocol.sync_settings import AggregationSettings, Schedule


def _hello(ident: Identity) -> Hello:
    return Hello(run_id="r", term=1, epoch=1, replica=0, stage=0, peer_id=ident.peer_id)


def test_peer_id_roundtrip_and_key_file(tmp_path) -> None:
    ident = Identity.load_or_create(tmp_path / "k")
    assert ident.peer_id.startswith("12D3KooW")
    assert public_key_of_peer_id(ident.peer_id) == ident.public_key
    assert Identity.load_or_create(tmp_path / "k").peer_id == ident.peer_id
    (tmp_path / "bad").write_bytes(b"short")
    with pytest.raises(SignatureError, match="32-byte"):
        Identity.load_or_create(tmp_path / "bad")
    with pytest.raises(SignatureError):
        public_key_of_peer_id("QmNotEd25519")


def test_envelope_roundtrip_and_rejections() -> None:
    a, b = Identity.generate(), Identity.generate()
    data = seal(a, _hello(a))
    got = open_envelope(data, Hello)
    assert got.body == _hello(a) and got.signer_id == a.peer_id
    with pytest.raises(UntrustedSigner):
        open_envelope(data, Hello, trusted={b.public_key})
    env = msgpack.unpackb(data)
    tampered = dict(env, payload=msgpack.packb({**msgpack.unpackb(env["payload"]), "stage": 3}))
    with pytest.raises(SignatureError):
        open_envelope(msgpack.packb(tampered), Hello)
    with pytest.raises(VersionError, match="version"):
        open_envelope(msgpack.packb(dict(env, v=2)), Hello)
    with pytest.raises(SchemaError, match="kind"):
        open_envelope(data, NodeAdvert)
    with pytest.raises(SchemaError, match="msgpack"):
        open_envelope(b"\xc1garbage", Hello)
    with pytest.raises(SchemaError, match="limit"):
        open_envelope(b"x" * 100, Hello, max_bytes=10)


def test_schema_errors_name_the_field() -> None:
    a = Identity.generate()
    bad_body = {"run_id": "r", "term": "one", "epoch": 1, "replica": 0, "stage": 0, "peer_id": a.peer_id}
    payload = msgpack.packb(bad_body)
    from protocol.envelope import _DOMAIN

    env = {
        "v": 1,
        "kind": "Hello",
        "signer": a.public_key,
        "payload": payload,
        "sig": a.sign(_DOMAIN + b"Hello" + payload),
    }
    with pytest.raises(SchemaError, match=r"Hello\.term: expected an integer"):
        open_envelope(msgpack.packb(env), Hello)
    from protocol.schema import from_dict

    with pytest.raises(SchemaError, match="unknown field"):
        from_dict(Endpoint, {"peer_id": "x", "host": "h", "port": 1, "extra": 2})
    with pytest.raises(SchemaError, match=r"RunSpec\.sync\.H"):
        from_dict(RunSpec, {"run_id": "ok", "sync": {"H": "30"}})


def test_run_toml_errors_name_file_and_field(tmp_path) -> None:
    p = tmp_path / "run.toml"
    p.write_text('[run]\nrun_id = "a"\n[train]\nbatch_size = 7\nmicrobatches = 2\n')
    with pytest.raises(ValueError, match="divisible"):
        load_run_spec(p)
    p.write_text('[run]\nrun_id = "a"\n[model]\nd_modl = 3\n')
    with pytest.raises(ValueError, match="d_modl"):
        load_run_spec(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_run_spec(tmp_path / "missing.toml")


SYNC_KEYS = (
    "method H alpha outer_momentum P tau checkpoint_every timeout_s quorum max_late_rounds topology pair_blend pair_clip pair_agreement "
    "k chunk beta stochastic_rounding aggregation robust "
    "max_norm_ratio max_abs_ratio min_agreement trim max_abs max_norm weighting"
).split()


def test_the_sync_section_is_flat_and_builds_its_components() -> None:
    """[sync] keeps its keys, in the order of the signed encoding, while the codec's and the aggregation's
    types declare theirs; each component's settings come from the section by one method."""
    assert [f.name for f in fields(SyncSpec)] == SYNC_KEYS
    encoded = msgpack.packb(to_dict(SyncSpec()), use_bin_type=True)
    # def89355c4f9a399 before issue 21 turned the absolute bounds on (max_abs 1e3, max_norm 1e5 by default);
    # fc61b811035a20e8 before it added sync.quorum (the round rule's q, node/sync/round_rule.py);
    # 5475778bf32e4af7 before issue 22 added sync.max_late_rounds (late fragments committed, default 1);
    # 52e6137c9ce0015d before it added sync.weighting (contributions weighed by their tokens, default)
    # d2879fb4cf2a15ce before issue 23 added sync.topology, pair_blend and pair_clip (butterfly mixing);
    # 338aa6dcbd1ad7e7 before it added sync.pair_agreement (the pair's agreement rule);
    # c429f309c1ed2a24 before issue 24 added sync.stochastic_rounding
    assert hashlib.sha256(encoded).hexdigest()[:16] == "5dce2a66bb535c27"
    s = SyncSpec(
        H=12, P=3, tau=2, k=16, chunk=256, beta=0.7, aggregation="mean", robust="clip_median", max_abs=5.0
    )
    assert from_dict(SyncSpec, to_dict(s)) == s
    assert s.schedule() == Schedule(H=12, P=3, tau=2)
    assert s.sparseloco() == SparseLoCoConfig(chunk=256, k=16, beta=0.7)
    agg = s.aggregation_settings()
    assert type(agg) is AggregationSettings
    assert agg == AggregationSettings(aggregation="mean", robust="clip_median", max_abs=5.0)


def test_the_schedule_names_each_steps_captures_and_rounds() -> None:
    sc = Schedule(H=4, P=2, tau=1)  # q = 2: fragment 0 captured at step 2 of each cycle, fragment 1 at 4
    assert [sc.captures(t) for t in range(9)] == [[], [], [(0, 0)], [], [(1, 0)], [], [(0, 1)], [], [(1, 1)]]
    assert [sc.round_ended(t) for t in range(9)] == [None, None, None, None, 1, None, None, None, 2]
    assert [sc.round_at(t) for t in (4, 5, 8, 9)] == [0, 1, 1, 2]  # round r's last fragment lands at rH + tau
    assert [sc.settled_at(t) for t in range(10)] == [None] * 5 + [1, None, None, None, 2]
    assert Schedule(H=4, P=2, tau=2).settled_at(6) == 1  # the outer loop allows tau < H ...
    with pytest.raises(ValueError, match=r"sync.tau=2 must satisfy 0 <= tau < H/P=2 \(H=4, P=2\)"):
        SyncSpec(H=4, P=2, tau=2)  # ... a run spec tau < H/P, so checkpoints see whole rounds
    for bad, what in [({"P": 5}, "0 < P <= H"), ({"tau": 4}, "0 <= tau < H=4"), ({"tau": -1}, "0 <= tau")]:
        with pytest.raises(ValueError, match=what):
            Schedule(**{"H": 4, "P": 2, "tau": 1, **bad})


def test_framing_limits_and_eof() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, b"hello")
        assert recv_frame(b) == b"hello"
        a.sendall((1 << 30).to_bytes(4, "big"))
        with pytest.raises(FrameError, match="over the"):
            recv_frame(b, max_bytes=1024)
    with pytest.raises(FrameError, match="exceeds"):
        encode_frame(b"x" * 11, max_bytes=10)
    a, b = socket.socketpair()
    with b:
        a.sendall(encode_frame(b"abcdef")[:6])
        a.close()
        with pytest.raises(FrameError, match="mid-frame"):
            recv_frame(b)
    a, b = socket.socketpair()
    with b:
        a.close()
        with pytest.raises(ConnectionClosed):
            recv_frame(b)


def test_validator_only_lets_the_owner_write_its_subkey() -> None:
    owner, forger = Identity.generate(), Identity.generate()
    v = SignedSubkeyValidator(clock=lambda: 0.0)

    def rec(subkey: str, signer: Identity) -> DHTRecord:
        value = msgpack.packb(seal(signer, _hello(signer), expires_at=60.0))
        return DHTRecord(b"key", msgpack.packb(subkey), value, 60.0)

    assert v.validate(rec(owner.peer_id, owner))
    assert v.validate(rec(f"run-1@{owner.peer_id}", owner))
    assert not v.validate(rec(owner.peer_id, forger))
    assert not v.validate(rec(f"run-1@{owner.peer_id}", forger))
    junk = DHTRecord(b"key", msgpack.packb(owner.peer_id), msgpack.packb(b"junk"), 0.0)
    assert not v.validate(junk)
    assert not v.validate(rec("not-a-peer", forger))  # a record no subkey ties to its signer is refused
    assert peer_id_of(owner.public_key) == owner.peer_id


def test_acceptor_rejects_bad_hello_and_hands_over_good_one() -> None:
    from node.pipeline.acceptor import Acceptor
    from node.pipeline.transport import listen

    acc = Acceptor(listen("127.0.0.1", 0), hello_timeout_s=2)
    try:
        with socket.create_connection(("127.0.0.1", acc.port)) as s:
            s.sendall(encode_frame(b"not an envelope"))
        ident = Identity.generate()
        c = socket.create_connection(("127.0.0.1", acc.port))
        c.sendall(encode_frame(seal(ident, _hello(ident))))
        hello, conn = acc.take("r", ident.peer_id, 0, 0, timeout_s=10)
        assert hello.peer_id == ident.peer_id
        conn.close()
        c.close()
        assert acc.rejected == 1
        with pytest.raises(TimeoutError, match="did not connect"):
            acc.take("r", "someone-else", 0, 0, timeout_s=0.5)
    finally:
        acc.close()

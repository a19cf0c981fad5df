"""Hostile DHT records and messages (issue 10, findings 1, 2 and 9), against a real hivemind DHT.

Finding 1: the DHT validator admits only records tied to their signer and no longer than signed.
Finding 2: one bad record never halts a reader, and error messages stay bounded.
Finding 9: the schema rejects non-finite, out-of-range and malformed values.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import ValueWithExpiration

from coordinator.cli import main as coordinator_main
from coordinator.service import Coordinator
from protocol import envelope, keys
from protocol.envelope import open_envelope, seal, verified_header
from protocol.identity import Identity, SignatureError
from protocol.messages import Assignment, Endpoint, Hello, Lease, NodeAdvert, RunRecord
from protocol.net.dht_client import DHTClient, dht_time
from protocol.net.dht_validator import SignedSubkeyValidator, dht_key_id
from protocol.runspec import RunSpec, load_run_spec
from protocol.schema import SchemaError, from_dict, to_dict

DEEP = 1000  # a list nested this deep made repr() raise RecursionError in the coordinator


def _advert(ident: Identity, **kw: Any) -> NodeAdvert:
    fields: dict[str, Any] = dict(
        peer_id=ident.peer_id,
        version="test",
        device="cpu",
        memory_gb=16.0,
        tflops=1.0,
        price_per_hour=0.5,
        host="127.0.0.1",
        port=4000,
        health_port=4001,
        timestamp=dht_time(),
    )
    fields.update(kw)
    return NodeAdvert(**fields)


def _deep_list(depth: int = DEEP) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def _forged(kind: str, **body: Any) -> Any:
    """A dataclass named `kind` (what the envelope's kind is taken from) holding arbitrary fields: how a
    hostile peer signs a body its own schema would refuse."""
    cls = dataclasses.make_dataclass(kind, [(k, object) for k in body])
    return cls(**body)


def _deep_advert(ident: Identity) -> Any:
    body = to_dict(_advert(ident))
    body["state"] = _deep_list()
    return _forged("NodeAdvert", **body)


@pytest.fixture(scope="module")
def dhts() -> Iterator[tuple[DHTClient, DHTClient]]:
    """(reader, attacker): two DHT peers on loopback; the reader is the bootstrap peer."""
    reader = DHTClient(Identity.generate())
    attacker = DHTClient(Identity.generate(), bootstrap=reader.visible_maddrs())
    try:
        yield reader, attacker
    finally:
        attacker.shutdown()
        reader.shutdown()


def _capture(client: DHTClient, key: str, subkey: str) -> ValueWithExpiration:
    """A stored record's value (envelope bytes) and DHT expiration, as any peer can read it."""
    found = client.dht.get(key, latest=True)
    assert found is not None and subkey in found.value, f"{key}/{subkey} not found"
    return found.value[subkey]


def _publish_deep(client: DHTClient, key: str, body: Any, ttl_s: float, **kw: Any) -> bool:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10 * DEEP)  # to_dict recurses through the attacker's own list
    try:
        return client.publish(key, body, ttl_s, **kw)
    finally:
        sys.setrecursionlimit(old)


# --- finding 1: the validator -------------------------------------------------------------------


def test_a_value_without_subkey_cannot_replace_the_nodes_dictionary(dhts) -> None:
    reader, attacker = dhts
    honest = Identity.generate()
    assert reader.publish(keys.NODES_KEY, _advert(honest), 60, signer=honest)
    plain = attacker.dht.store(
        keys.NODES_KEY, seal(attacker.identity, _advert(attacker.identity)), expiration_time=dht_time() + 3600
    )
    assert not plain, "a plain value (no subkey) was stored over the crucible/nodes dictionary"
    assert honest.peer_id in reader.get_all(keys.NODES_KEY, NodeAdvert)


def test_a_record_under_a_subkey_naming_no_peer_is_refused(dhts) -> None:
    _, attacker = dhts
    assert attacker.publish(keys.NODES_KEY, _advert(attacker.identity), 60)
    own = _capture(attacker, keys.NODES_KEY, attacker.peer_id)  # validly signed, with its expiry
    for subkey in ("run-1", "x@not-a-peer", ""):
        stored = attacker.dht.store(
            keys.NODES_KEY, own.value, expiration_time=own.expiration_time, subkey=subkey
        )
        assert not stored, f"a record under the subkey {subkey!r} (no signer) was stored"


def test_a_replayed_record_cannot_outlive_its_signed_expiry(dhts) -> None:
    reader, attacker = dhts
    honest = Identity.generate()
    assert reader.publish(keys.NODES_KEY, _advert(honest, step=1), 30, signer=honest)
    captured = _capture(attacker, keys.NODES_KEY, honest.peer_id).value
    replay = attacker.dht.store(
        keys.NODES_KEY, captured, expiration_time=dht_time() + 1e6, subkey=honest.peer_id
    )
    assert not replay, "a captured record was re-stored with an expiration far beyond its signed one"
    assert reader.publish(keys.NODES_KEY, _advert(honest, step=2), 30, signer=honest)
    assert reader.get_all(keys.NODES_KEY, NodeAdvert)[honest.peer_id].body.step == 2


def test_the_envelope_version_is_covered_by_the_signature(monkeypatch) -> None:
    a = Identity.generate()
    env = msgpack.unpackb(seal(a, Hello(run_id="r", term=1, epoch=1, replica=0, stage=0, peer_id=a.peer_id)))
    monkeypatch.setattr(envelope, "PROTOCOL_VERSION", 2)  # a build that speaks version 2...
    with pytest.raises(SignatureError):  # ...must not take a version-1 signature for a version-2 message
        open_envelope(msgpack.packb(dict(env, v=2)), Hello)


def test_the_validator_rejects_what_it_cannot_tie_to_a_signer() -> None:
    owner, other = Identity.generate(), Identity.generate()
    now = 1_700_000_000.0
    v = SignedSubkeyValidator(clock=lambda: now)
    nodes, runs, assign = (
        dht_key_id(keys.NODES_KEY),
        dht_key_id(keys.RUNS_KEY),
        dht_key_id(keys.assignment_key(owner.peer_id)),
    )
    spec = RunSpec(run_id="r1")

    def rec(key: bytes, subkey: Any, data: bytes, expiration: float = now + 30) -> DHTRecord:
        return DHTRecord(key, msgpack.packb(subkey), msgpack.packb(data), expiration)

    advert = seal(owner, _advert(owner), expires_at=now + 30)
    run = seal(owner, RunRecord(spec=spec), expires_at=now + 30)
    assert v.validate(rec(nodes, owner.peer_id, advert))
    assert v.validate(rec(runs, f"r1@{owner.peer_id}", run))
    assert v.validate(rec(assign, owner.peer_id, run))  # other keys: only the owner rule
    refused = {
        "no subkey": DHTRecord(nodes, msgpack.packb(None), msgpack.packb(advert), now + 30),
        "dictionary tag": DHTRecord(nodes, b"", msgpack.packb(advert), now + 30),
        "integer subkey": rec(nodes, 7, advert),
        "subkey naming no peer": rec(assign, "not-a-peer", advert),
        "huge subkey": rec(assign, "x" * 10**6, advert),
        "someone else's subkey": rec(nodes, other.peer_id, advert),
        "no signed expiry": rec(nodes, owner.peer_id, seal(owner, _advert(owner))),
        "expiration beyond the signed one": rec(nodes, owner.peer_id, advert, now + 31),
        "non-finite expiration": rec(nodes, owner.peer_id, advert, math.nan),
        "signed expiry too far ahead": rec(
            nodes, owner.peer_id, seal(owner, _advert(owner), expires_at=now + 1e6), now + 30
        ),
        "named subkey under nodes": rec(nodes, f"x@{owner.peer_id}", advert),
        "bare subkey under runs": rec(runs, owner.peer_id, run),
        "wrong kind under nodes": rec(nodes, owner.peer_id, run),
        "garbage value": DHTRecord(nodes, msgpack.packb(owner.peer_id), b"\xc1junk", now + 30),
    }
    for what, r in refused.items():
        assert not v.validate(r), what
        assert v.rejection(r), what
    # mutated records: never raise, never admit a changed signed field, stay fast
    rng = random.Random(0)
    good = rec(nodes, owner.peer_id, advert)
    signed = verified_header(advert)
    t0 = time.perf_counter()
    for _ in range(2000):
        value = bytearray(good.value)
        for _ in range(rng.randint(1, 4)):
            value[rng.randrange(len(value))] = rng.randrange(256)
        r = dataclasses.replace(good, value=bytes(value))
        if v.validate(r):
            assert verified_header(msgpack.unpackb(r.value)) == signed
    assert time.perf_counter() - t0 < 20


# --- finding 2: readers survive bad records -----------------------------------------------------


def test_a_hostile_advert_does_not_halt_the_coordinator(dhts) -> None:
    reader, attacker = dhts
    honest = Identity.generate()
    assert reader.publish(keys.NODES_KEY, _advert(honest), 60, signer=honest)
    assert _publish_deep(attacker, keys.NODES_KEY, _deep_advert(attacker.identity), 60)
    coord = Coordinator(Identity.generate(), reader, None)  # type: ignore[arg-type]  # no run: no store use
    coord.tick()  # RecursionError escaped here before
    adverts = coord.adverts()
    assert honest.peer_id in adverts and attacker.peer_id not in adverts
    assert reader.rejected["SchemaError"] > 0


def test_get_all_drops_and_counts_every_bad_record(dhts, monkeypatch) -> None:
    """Records the validator would refuse, as a peer that skips validation might still return them."""
    reader, attacker = dhts
    honest, stranger = Identity.generate(), attacker.identity
    assert reader.publish(keys.NODES_KEY, _advert(honest), 60, signer=honest)
    assert _publish_deep(attacker, keys.NODES_KEY, _deep_advert(stranger), 60)
    good, deep = (
        _capture(reader, keys.NODES_KEY, honest.peer_id),
        _capture(reader, keys.NODES_KEY, stranger.peer_id),
    )
    env = msgpack.unpackb(good.value)
    bad_sig = msgpack.packb(dict(env, payload=msgpack.packb({**msgpack.unpackb(env["payload"]), "step": 9})))
    exp = good.expiration_time
    records = {
        "not-a-peer": ValueWithExpiration(bad_sig, exp),  # SignatureError (a ValueError) escaped
        stranger.peer_id: deep,  # RecursionError escaped
        "x@" + stranger.peer_id: ValueWithExpiration(42, exp),
        "y@" + stranger.peer_id: ValueWithExpiration(b"\xc1junk", exp),
        "z@" + stranger.peer_id: good,  # signed by someone else than the subkey names
        "w@" + honest.peer_id: ValueWithExpiration(good.value, exp + 3600),  # outlives its signed expiry
        honest.peer_id: good,
    }

    def answer(key: str, latest: bool = True, return_future: bool = False) -> object:
        found: Future = Future()  # what hivemind's get returns with return_future=True
        found.set_result(ValueWithExpiration(records, exp))
        return found if return_future else found.result()

    monkeypatch.setattr(reader.dht, "get", answer)
    monkeypatch.setattr(reader, "rejected", Counter(), raising=False)
    got = reader.get_all(keys.NODES_KEY, NodeAdvert)
    assert list(got) == [honest.peer_id]
    assert reader.rejected == {"SignatureError": 1, "SchemaError": 3, "RecordError": 2}
    # the run records: the coordinator's tick reads them with its trust set and goes on
    Coordinator(Identity.generate(), reader, None).tick()  # type: ignore[arg-type]


def test_schema_errors_are_short_and_never_recurse() -> None:
    a = Identity.generate()
    body = to_dict(_advert(a))
    for bad in (_deep_list(), "x" * 10**6, {"k" * 10**6: 1}, 10**30):
        with pytest.raises(SchemaError) as e:
            from_dict(NodeAdvert, dict(body, state=bad))
        assert "NodeAdvert.state" in str(e.value) and len(str(e.value)) < 200
    with pytest.raises(SchemaError) as e:
        from_dict(NodeAdvert, dict(body, **{"z" * 10**6: 1}))
    assert "unknown field" in str(e.value) and len(str(e.value)) < 200

    @dataclasses.dataclass
    class Loose:
        x: Any

    with pytest.raises(SchemaError, match="nested deeper"):
        from_dict(Loose, {"x": _deep_list(100)})


def test_status_shows_only_run_records_the_operator_signed(dhts, capsys) -> None:
    reader, attacker = dhts
    operator = Identity.generate()
    spec = RunSpec(run_id="hostile-a")
    mine = RunRecord(spec=spec, state="running", updated=dht_time())
    assert reader.publish(keys.RUNS_KEY, mine, 60, signer=operator, name="hostile-a")
    theirs = RunRecord(spec=spec, state="failed", updated=dht_time() + 1000)
    assert attacker.publish(keys.RUNS_KEY, theirs, 60, name="hostile-a")
    boot = reader.visible_maddrs()[0]
    args = ["status", "hostile-a", "--bootstrap", boot, "--log-level", "ERROR"]
    assert coordinator_main([*args, "--operator-key", operator.peer_id]) == 0
    out = capsys.readouterr().out
    assert "run hostile-a: running" in out and "failed" not in out
    assert coordinator_main(args) == 0
    out = capsys.readouterr().out
    assert "unverified" in out and "--operator-key" in out


# --- finding 9: ranges and finiteness -----------------------------------------------------------


def test_non_finite_floats_are_rejected_everywhere(tmp_path) -> None:
    lease = {"run_id": "r", "term": 1, "holder": "h", "expires_at": math.nan}
    with pytest.raises(SchemaError, match=r"Lease\.expires_at.*nan.*finite"):
        from_dict(Lease, lease)
    with pytest.raises(ValueError, match=r"Lease\.expires_at"):
        Lease(run_id="r", term=1, holder="h", expires_at=math.inf)
    with pytest.raises(SchemaError, match=r"RunSpec\.sync\.alpha.*inf"):
        from_dict(RunSpec, {"run_id": "a", "sync": {"alpha": math.inf}})
    a = Identity.generate()
    body = to_dict(_advert(a))
    for name in ("tflops", "memory_gb", "timestamp", "tokens_per_s"):
        with pytest.raises(SchemaError, match=rf"NodeAdvert\.{name}"):
            from_dict(NodeAdvert, dict(body, **{name: -math.inf}))
    with pytest.raises(SchemaError, match=r"peer_mbps"):
        from_dict(NodeAdvert, dict(body, peer_mbps={"p": math.nan}))
    # a diverged run reports its loss as it is
    assert math.isnan(from_dict(NodeAdvert, dict(body, loss=math.nan)).loss or 0.0)
    p = tmp_path / "run.toml"
    p.write_text('[run]\nrun_id = "a"\n[sync]\nalpha = inf\n')
    with pytest.raises(ValueError, match="alpha"):
        load_run_spec(p)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("port", 70000, "65535"),
        ("port", -1, "0"),
        ("health_port", 65536, "65535"),
        ("tflops", 1e308, "100000"),
        ("tflops_bf16", 2e5, "100000"),
        ("price_per_hour", -1.0, "0"),
        ("memory_gb", -0.5, "0"),
        ("step", -5, "0"),
        ("bytes_store", -1, "0"),
        ("epoch", 2**64 - 1, "9.22337e+18"),
        ("timestamp", 1e300, "1e+10"),
    ],
)
def test_out_of_range_advert_fields_are_rejected_naming_field_value_and_rule(field, value, rule) -> None:
    body = to_dict(_advert(Identity.generate()))
    with pytest.raises(SchemaError) as e:
        from_dict(NodeAdvert, dict(body, **{field: value}))
    msg = str(e.value)
    assert f"NodeAdvert.{field}" in msg and rule in msg and "must" in msg, msg


def test_out_of_range_message_fields_are_rejected() -> None:
    a = Identity.generate()
    spec = RunSpec(run_id="r1", replicas=2, stages=2)
    ok = dict(run_id="r1", term=1, epoch=1, peer_id=a.peer_id, replica=0, stage=1, layers=[2, 4], spec=spec)
    Assignment(**ok)
    for bad in (
        {"epoch": -1},
        {"replica": 2},
        {"stage": 5},
        {"layers": [3, 9]},
        {"run_id": "other"},
        {"stage_peers": {"7": a.peer_id}},
    ):
        with pytest.raises(ValueError, match="Assignment"):
            Assignment(**{**ok, **bad})
    with pytest.raises(ValueError, match=r"Endpoint\.port"):
        Endpoint(peer_id=a.peer_id, host="h", port=70000)
    with pytest.raises(ValueError, match=r"Lease\.term"):
        Lease(run_id="r", term=-1, holder="h", expires_at=1.0)
    with pytest.raises(ValueError, match=r"Hello\.stage"):
        Hello(run_id="r", term=1, epoch=1, replica=0, stage=-3, peer_id=a.peer_id)
    with pytest.raises(SchemaError, match=r"64 bits"):
        from_dict(RunSpec, {"run_id": "a", "train": {"data_seed": 2**70}})
    with pytest.raises(SchemaError, match=r"model\.d_model"):
        from_dict(RunSpec, {"run_id": "a", "model": {"d_model": 2**40}})


def test_the_run_id_pattern_takes_no_trailing_newline() -> None:
    with pytest.raises(ValueError, match=r"run_id='tiny\\n'"):
        RunSpec(run_id="tiny\n")
    with pytest.raises(SchemaError, match="run_id"):
        from_dict(RunSpec, {"run_id": "tiny\n"})
    with pytest.raises(ValueError, match=r"Lease\.run_id"):
        Lease(run_id="r\n", term=1, holder="h", expires_at=1.0)
    with pytest.raises(ValueError) as e:
        RunSpec(run_id="a" * 10**6)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--price-per-hour", "-1"], "--price-per-hour '-1': must be a finite number"),
        (["--price-per-hour", "nan"], "--price-per-hour 'nan': must be a finite number"),
        (["--port", "70000"], "--port '70000': not a TCP port"),
        (["--health-port", "-5"], "--health-port '-5': not a TCP port"),
    ],
)
def test_a_node_s_own_out_of_range_figures_stop_its_start(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 10 finding 9, node side: a negative price used to pass the start and then fail every advert
    refresh with a warning (the node never showed up for placement). It now stops `join` up front with
    exit 2 and one line naming the flag, the value and the rule; nothing is started."""
    from node.cli import main

    operator = Identity.from_seed(b"\x07" * 32).peer_id
    bootstrap = f"/ip4/127.0.0.1/tcp/9/p2p/{operator}"  # never dialled: the figures are checked first
    argv = ["join", "--operator-key", operator, "--bootstrap", bootstrap, *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("crucible-node: error: ") and named in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1

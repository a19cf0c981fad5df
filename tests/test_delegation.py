"""Trust by delegation (issue 13, acceptance 2): the operator's key certifies coordinator keys, and every
reader (nodes, coordinators, leases, `status`) applies one rule, protocol/trust/delegation.py.

The rule in isolation (valid, expired, wrong scope, wrong role, forged, not by the operator, for another
key, uncertified); the lease handed between two certified keys; a real node process that refuses
assignments signed by an uncertified key, under an expired certificate or one for another run, with the
reason in its log once, and takes a certified coordinator's; `certify` and `serve --certificate` as a user
types them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Assignment, Delegation, Lease, RunControl, RunRecord, TermClaim
from protocol.runspec import ModelSpec, RunSpec
from protocol.trust import delegation as d
from protocol.trust.delegation import OperatorTrust, RefusalLog, Untrusted, issue

ROOT = Path(__file__).resolve().parent.parent
OPERATOR = Identity.from_seed(bytes([11]) * 32)
TRUST = OperatorTrust.of({OPERATOR.public_key})
NOW = 1.8e9
DAY = 86400.0
TIMEOUT_S = 20.0


def _cert(subject: Identity, *, run: str = "*", by: Identity = OPERATOR, issued: float = NOW - 60,
          expires: float = NOW + DAY, role: str = "coordinator") -> bytes:  # fmt: skip
    return seal(
        by, Delegation(subject=subject.peer_id, role=role, run=run, issued_at=issued, expires_at=expires)
    )


def _assignment(signer_cert: bytes, run_id: str, peer: str, *, stage: int = 0) -> Assignment:
    spec = RunSpec(run_id=run_id, replicas=1, stages=1, model=ModelSpec(d_model=32, n_layers=1, n_heads=2))
    return Assignment(
        run_id=run_id, term=1, epoch=1, peer_id=peer, replica=stage, stage=stage,
        layers=[0, 1] if stage >= 0 else [], spec=spec, issued_at=time.time(), certificate=signer_cert,
    )  # fmt: skip


def _refusal(signer: Identity, certificate: bytes, run_id: str = "run-a", now: float = NOW) -> str | None:
    try:
        TRUST.delegation(signer.public_key, certificate, run_id, now)
    except Untrusted as e:
        assert "not a trusted key" in str(e) and e.why in str(e)
        return e.reason
    return None


# --- the rule -------------------------------------------------------------------------------------
def test_an_object_dated_beyond_the_clock_skew_is_refused_whoever_signed_it() -> None:
    """The newest run record, the latest assignment and a stop request are chosen by their date: one
    dated next year (the operator's own key, or a certified coordinator, a deposed one included) would win
    over everything honest coordinators sign until then. Each kind that carries a date is refused beyond
    SKEW_S ahead of the reader's clock, with the reason; within the skew it is admitted."""
    coord = Identity.generate()
    spec = RunSpec(run_id="run-a", replicas=1, stages=1, model=ModelSpec(d_model=32, n_layers=1, n_heads=2))
    ahead = NOW + d.SKEW_S + 60

    def dated(t: float, cert: bytes) -> list[object]:
        return [
            RunRecord(spec=spec, state="running", term=1, coordinator=coord.peer_id, updated=t, certificate=cert),
            Assignment(run_id="run-a", term=1, epoch=1, peer_id=coord.peer_id, replica=0, stage=0, layers=[0, 1],
                       spec=spec, issued_at=t, certificate=cert),
            RunControl(run_id="run-a", action="stop", issued_at=t, certificate=cert),
            TermClaim(run_id="run-a", term=1, holder=coord.peer_id, claimed_at=t, certificate=cert),
        ]  # fmt: skip

    for signer, cert in ((OPERATOR, b""), (coord, _cert(coord, expires=NOW + 300 * DAY))):
        for body in dated(ahead, cert):
            signed = open_envelope(seal(signer, body), type(body))
            with pytest.raises(Untrusted, match="dated .* ahead of this host's clock") as e:
                TRUST.admit(signed, NOW)
            assert e.value.reason == d.FUTURE_DATED, type(body).__name__
            refusals = RefusalLog(logging.getLogger("test"))
            assert TRUST.filter([signed], refusals, NOW) == [] and refusals.by_reason[d.FUTURE_DATED] == 1
        for body in dated(NOW + d.SKEW_S - 60, cert):  # a clock a few minutes ahead is still believed
            assert TRUST.admit(open_envelope(seal(signer, body), type(body)), NOW).body == body
    lease = Lease(run_id="run-a", term=1, holder=OPERATOR.peer_id, expires_at=NOW + DAY)
    assert TRUST.admit(open_envelope(seal(OPERATOR, lease), Lease), NOW).body == lease  # no date of its own


def test_the_operator_and_the_keys_it_certified_are_trusted() -> None:
    coord = Identity.generate()
    assert _refusal(OPERATOR, b"") is None  # the operator signs directly: no certificate needed
    assert _refusal(coord, _cert(coord)) is None  # any run
    assert _refusal(coord, _cert(coord, run="run-a")) is None  # this run
    assert _refusal(coord, _cert(coord), now=NOW - 60 - d.SKEW_S + 1) is None  # a clock a little behind


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda c: b"", d.UNCERTIFIED),
        (lambda c: _cert(c, expires=NOW - 1, issued=NOW - DAY), d.EXPIRED),
        (lambda c: _cert(c, expires=NOW), d.EXPIRED),  # void from its expiry on
        (lambda c: _cert(c, issued=NOW + 3600, expires=NOW + DAY), d.NOT_YET_VALID),
        (lambda c: _cert(c, run="run-b"), d.WRONG_SCOPE),
        (lambda c: _cert(c, role="auditor"), d.WRONG_ROLE),
        (lambda c: _cert(c, by=Identity.generate()), d.NOT_OPERATOR),
        (lambda c: _cert(c, by=c), d.NOT_OPERATOR),  # certified by itself
        (lambda c: _cert(Identity.generate()), d.OTHER_KEY),  # someone else's certificate
        (lambda c: _cert(c)[:-1] + bytes([_cert(c)[-1] ^ 1]), d.FORGED),  # signature bit flipped
        (lambda c: b"\x93garbage", d.FORGED),
        (lambda c: seal(OPERATOR, RunControl(run_id="run-a", action="stop", issued_at=NOW)), d.FORGED),
    ],
    ids=["uncertified", "expired", "at-expiry", "not-yet-valid", "wrong-scope", "wrong-role",
         "by-a-stranger", "by-itself", "another-key", "forged", "garbage", "other-kind"],
)  # fmt: skip
def test_each_reason_a_signer_is_not_trusted(make, reason: str) -> None:
    coord = Identity.generate()
    assert _refusal(coord, make(coord)) == reason


def test_every_certified_message_kind_goes_through_the_rule() -> None:
    coord, peer = Identity.generate(), Identity.generate().peer_id
    good, other = _cert(coord, run="run-a"), _cert(coord, run="run-b")
    spec = RunSpec(run_id="run-a")
    for cert, ok in ((good, True), (other, False), (b"", False)):
        bodies = [
            _assignment(cert, "run-a", peer),
            RunRecord(spec=spec, state="running", certificate=cert),
            Lease(run_id="run-a", term=1, holder=coord.peer_id, expires_at=NOW, certificate=cert),
            RunControl(run_id="run-a", action="stop", issued_at=NOW, certificate=cert),
        ]
        for body in bodies:
            data = seal(coord, body)
            if ok:
                assert TRUST.open(data, type(body), NOW).body == body
            else:
                with pytest.raises(Untrusted, match=type(body).__name__):
                    TRUST.open(data, type(body), NOW)
    # the certificate is signed over with the body: moving it onto another key's message does not help
    thief = Identity.generate()
    with pytest.raises(Untrusted) as e:
        TRUST.open(seal(thief, _assignment(good, "run-a", peer)), Assignment, NOW)
    assert e.value.reason == d.OTHER_KEY


def test_delegation_fields_are_range_checked() -> None:
    peer = Identity.generate().peer_id
    with pytest.raises(ValueError, match="expires_at"):
        Delegation(subject=peer, run="*", issued_at=NOW, expires_at=NOW)
    with pytest.raises(ValueError, match="366 days"):
        Delegation(subject=peer, run="*", issued_at=NOW, expires_at=NOW + 400 * DAY)
    with pytest.raises(ValueError, match="Delegation.run"):
        Delegation(subject=peer, run="Bad Run", issued_at=NOW, expires_at=NOW + DAY)
    with pytest.raises(ValueError, match="Delegation.subject"):
        Delegation(subject="", run="*", issued_at=NOW, expires_at=NOW + DAY)
    with pytest.raises(ValueError, match="peer id"):
        issue(OPERATOR, "12D3KooWnotapeer", expires_at=NOW + DAY, now=NOW)
    with pytest.raises(ValueError, match="certificate"):
        RunControl(run_id="a", action="stop", issued_at=NOW, certificate=b"x" * 2000)
    cert = issue(OPERATOR, peer, expires_at=NOW + DAY, run="run-a", now=NOW)
    body = open_envelope(cert, Delegation).body
    assert (body.subject, body.role, body.run, body.expires_at) == (peer, "coordinator", "run-a", NOW + DAY)


def test_refusals_are_logged_once_per_signer_and_reason(caplog) -> None:
    coord, stranger = Identity.generate(), Identity.generate()
    cert = _cert(coord, run="run-b")
    found = [
        TRUST.admit(open_envelope(seal(OPERATOR, RunRecord(spec=RunSpec(run_id="run-a"))), RunRecord), NOW),
    ]
    records = [
        open_envelope(seal(s, RunRecord(spec=RunSpec(run_id="run-a"), certificate=c)), RunRecord)
        for s, c in ((coord, cert), (stranger, b""))
    ]
    refusals = RefusalLog(logging.getLogger("test.delegation"))
    with caplog.at_level(logging.WARNING, logger="test.delegation"):
        for _ in range(5):  # five polls
            assert TRUST.filter(found + records, refusals, NOW) == found
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and refusals.count == 10, lines
    assert any("wrong scope" in x and coord.peer_id in x for x in lines)
    assert any("uncertified" in x and stranger.peer_id in x for x in lines)


# --- the lease ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(moto_store: str):
    from protocol.net.store import ObjectStore, StoreConfig

    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="delegation"))
    s.ensure_bucket()
    return s


def test_two_certified_coordinators_take_the_lease_over_from_each_other(store) -> None:
    from coordinator.lease import renew, try_acquire

    rid = f"run-{uuid.uuid4().hex[:8]}"
    now = time.time()
    a, b = Identity.generate(), Identity.generate()
    cert_a, cert_b = (
        issue(OPERATOR, a.peer_id, expires_at=now + DAY),
        issue(OPERATOR, b.peer_id, expires_at=now + DAY),
    )
    held = try_acquire(store, a, rid, 30, trusted=TRUST, certificate=cert_a)
    assert held is not None and held.lease.term == 1 and held.lease.certificate == cert_a
    assert try_acquire(store, b, rid, 30, trusted=TRUST, certificate=cert_b) is None  # a's lease is live
    held = renew(store, a, held, 30)
    assert held is not None and held.lease.certificate == cert_a
    later = now + 60
    taken = try_acquire(store, b, rid, 30, now=later, trusted=TRUST, certificate=cert_b)
    assert taken is not None and taken.lease.term == 2  # a different certified key: a takeover, term + 1
    assert renew(store, a, held, 30) is None  # a is deposed
    back = try_acquire(store, a, rid, 30, now=later + 60, trusted=TRUST, certificate=cert_a)
    assert back is not None and back.lease.term == 3


def test_a_lease_signed_without_a_valid_certificate_blocks_nothing(store) -> None:
    from coordinator.lease import try_acquire

    now = time.time()
    mine = Identity.generate()
    cert = issue(OPERATOR, mine.peer_id, expires_at=now + DAY)
    for signer, c in (
        (Identity.generate(), b""),  # uncertified
        (lapsed := Identity.generate(), issue(OPERATOR, lapsed.peer_id, expires_at=now - 1, now=now - DAY)),
        (
            scoped := Identity.generate(),
            issue(OPERATOR, scoped.peer_id, expires_at=now + DAY, run="other-run"),
        ),
    ):
        rid = f"run-{uuid.uuid4().hex[:8]}"
        claim = TermClaim(run_id=rid, term=4, holder=OPERATOR.peer_id, claimed_at=now)
        store.put(f"{rid}/terms/000004", seal(OPERATOR, claim))  # the run was at term 4
        forged = Lease(run_id=rid, term=9, holder=signer.peer_id, expires_at=now + 300, certificate=c)
        store.put(f"{rid}/lease", seal(signer, forged))
        held = try_acquire(store, mine, rid, 30, trusted=TRUST, certificate=cert)
        assert held is not None and held.lease.term == 5  # above the claimed terms, not the refused lease's


def test_a_certified_coordinator_serves_only_the_runs_its_certificate_covers(store) -> None:
    """In-process: a coordinator signing with a certified key takes a launched run's lease and publishes a
    run record that `status --operator-key` accepts; one certified for another run leaves it alone."""
    from coordinator.cli import _read_views
    from coordinator.service import Coordinator, launch
    from protocol import keys
    from protocol.net.dht_client import DHTClient, dht_time

    rid = f"run-{uuid.uuid4().hex[:8]}"
    now = time.time()
    elsewhere, mine = Identity.generate(), Identity.generate()
    dht = DHTClient(Identity.generate())
    try:
        launch(dht, store, OPERATOR, RunRecord(spec=RunSpec(run_id=rid), updated=dht_time()))
        other = Coordinator(elsewhere, dht, store, certificate=issue(OPERATOR, elsewhere.peer_id,
                            expires_at=now + DAY, run="other-run"), trust=TRUST)  # fmt: skip
        other.tick()
        assert rid not in other.runs
        coord = Coordinator(
            mine, dht, store, certificate=issue(OPERATOR, mine.peer_id, expires_at=now + DAY), trust=TRUST
        )
        coord.tick()
        assert coord.runs[rid].lease.lease.term == 1
        coord._publish(force=True)
        published = TRUST.filter(
            dht.get_all(keys.RUNS_KEY, RunRecord).values(), RefusalLog(logging.getLogger())
        )
        ours = [s.body for s in published if s.signer_id == mine.peer_id]
        assert len(ours) == 1 and ours[0].coordinator == mine.peer_id and ours[0].term == 1
        runs, _, _ = _read_views(dht, TRUST)  # what `status --operator-key` shows
        assert runs[rid].state == "pending"
        stranger = Coordinator(Identity.generate(), dht, store, trust=TRUST)  # signs with no certificate
        assert not stranger.may_sign_for(rid)
    finally:
        dht.shutdown()


# --- a real node ----------------------------------------------------------------------------------
@pytest.fixture
def node(tmp_path: Path, moto_store: str) -> Iterator[tuple[object, object, Identity]]:
    """(test's DHT peer, the node process, the node's identity): one `crucible-node join` trusting OPERATOR,
    bootstrapped through the test's DHT peer, with the session's store."""
    from protocol.net.dht_client import DHTClient
    from protocol.net.store import ObjectStore, StoreConfig
    from scripts.procs import Child

    ObjectStore(StoreConfig(endpoint_url=moto_store)).ensure_bucket()
    dht = DHTClient(Identity.generate())
    key = tmp_path / "node.key"
    ident = Identity.load_or_create(key)
    child = Child(
        "node",
        ["-m", "node.cli", "join", "--bootstrap", dht.visible_maddrs()[0], "--operator-key", OPERATOR.peer_id,
         "--key-file", str(key), "--device", "cpu", "--torch-threads", "1", "--store-endpoint", moto_store],
        tmp_path,
    )  # fmt: skip
    try:
        yield dht, child, ident
    finally:
        child.stop(timeout_s=15)
        dht.shutdown()


def test_a_node_refuses_uncertified_expired_and_foreign_coordinators_with_the_reason(
    node, moto_store
) -> None:
    from coordinator.lease import try_acquire
    from protocol import keys
    from protocol.net.store import ObjectStore, StoreConfig

    dht, child, ident = node
    health = child.wait_for(r"health=(\S+)/health", 90).group(1)
    now = time.time()
    a, b, c, ok = (Identity.generate() for _ in range(4))
    signed = {
        "cert-a": (a, b""),  # (a) uncertified
        "cert-b": (b, issue(OPERATOR, b.peer_id, expires_at=now - 60, now=now - DAY)),  # (b) expired
        "cert-c": (c, issue(OPERATOR, c.peer_id, expires_at=now + DAY, run="other-run")),  # (c) another run
        "cert-ok": (ok, issue(OPERATOR, ok.peer_id, expires_at=now + DAY)),  # (d) certified
    }
    # the certified coordinator's run: launched by the operator, its lease (term 1) held by that coordinator
    store = ObjectStore(StoreConfig(endpoint_url=moto_store))
    launch = RunRecord(spec=_assignment(b"", "cert-ok", ident.peer_id).spec, updated=now)
    store.put(keys.launch_key("cert-ok"), seal(OPERATOR, launch))
    assert try_acquire(store, ok, "cert-ok", 600, trusted=TRUST, certificate=signed["cert-ok"][1])
    for rid, (signer, cert) in signed.items():
        body = _assignment(cert, rid, ident.peer_id, stage=-1)  # a release: accepting it starts no worker
        assert dht.publish(keys.assignment_key(ident.peer_id), body, 120, signer=signer)

    def assigned() -> str | None:
        try:
            with urllib.request.urlopen(f"{health}/status", timeout=5) as r:
                return (json.load(r)["assignment"] or {}).get("run_id")
        except OSError:
            return None

    deadline = time.monotonic() + TIMEOUT_S
    while assigned() != "cert-ok" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert assigned() == "cert-ok", child.tail()
    time.sleep(3)  # three more polls: each refusal is still logged once
    log = child.log_text()
    for rid, signer, why in (
        ("cert-a", a, "no certificate from the operator (uncertified)"),
        ("cert-b", b, "its certificate expired at"),
        ("cert-c", c, "its certificate is for run 'other-run' only (wrong scope)"),
    ):
        line = (
            f"ignoring Assignment signed by {signer.peer_id}, which is not a trusted key for run {rid}: {why}"
        )
        assert log.count(line) == 1, (line, child.tail(30))
    assert ok.peer_id not in log


# --- the CLI --------------------------------------------------------------------------------------
def _cli(*argv: str | Path, home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HOME=str(home))
    with subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *map(str, argv)], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    ) as p:  # fmt: skip
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"crucible-coordinator {argv} ran past {TIMEOUT_S} s; stderr: {err}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _one_line(r: subprocess.CompletedProcess[str], *names: str) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def test_certify_then_serve_with_the_certificate(tmp_path: Path, moto_store: str) -> None:
    from protocol.net.dht_client import DHTClient
    from scripts.procs import Child

    op_key = tmp_path / "operator.key"
    op_key.write_bytes(OPERATOR.seed)
    node_key = tmp_path / "node.key"
    coord = Identity.load_or_create(node_key)
    cert = tmp_path / "coordinator.cert"
    r = _cli("certify", coord.peer_id, "--expires", "7d", "--any-run", "--operator-key-file", op_key,
             "--out", cert, home=tmp_path)  # fmt: skip
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert "any run" in r.stdout and f"--operator-key {OPERATOR.peer_id}" in r.stdout
    body = open_envelope(cert.read_bytes(), Delegation)
    assert body.signer == OPERATOR.public_key and body.body.subject == coord.peer_id
    assert 7 * DAY - 60 < body.body.expires_at - time.time() <= 7 * DAY

    dht = DHTClient(Identity.generate())
    serve = ["serve", "--bootstrap", dht.visible_maddrs()[0], "--store-endpoint", moto_store]
    child = Child("serve", ["-m", "coordinator.cli", *serve, "--key-file", str(node_key), "--certificate",
                            str(cert), "--operator-key", OPERATOR.peer_id], tmp_path, {"HOME": str(tmp_path)})  # fmt: skip
    try:
        line = child.wait_for(r"crucible-coordinator ready: .*", 60).group(0)
        assert f"coordinator={coord.peer_id}" in line and f"operator={OPERATOR.peer_id}" in line
        assert child.stop(timeout_s=15) == 0
    finally:
        child.stop(timeout_s=5)
        dht.shutdown()

    # refused before any connection: one line naming --certificate and why, exit 2
    flags = [*serve, "--key-file", node_key, "--operator-key", OPERATOR.peer_id, "--certificate"]
    now = time.time()
    expired = tmp_path / "expired.cert"
    expired.write_bytes(issue(OPERATOR, coord.peer_id, expires_at=now - 60, now=now - DAY))
    _one_line(_cli(*flags, expired, home=tmp_path), "--certificate", "expired at", coord.peer_id)
    foreign = tmp_path / "foreign.cert"
    foreign.write_bytes(issue(OPERATOR, Identity.generate().peer_id, expires_at=now + DAY))
    _one_line(_cli(*flags, foreign, home=tmp_path), "--certificate", "another key")
    stranger = tmp_path / "stranger.cert"
    stranger.write_bytes(issue(Identity.generate(), coord.peer_id, expires_at=now + DAY))
    _one_line(_cli(*flags, stranger, home=tmp_path), "--certificate", "not by the operator")
    garbage = tmp_path / "garbage.cert"
    garbage.write_bytes(b"not a certificate")
    _one_line(_cli(*flags, garbage, home=tmp_path), "--certificate", "is not a certificate")
    _one_line(_cli(*flags, tmp_path / "missing.cert", home=tmp_path), "--certificate", "certify")
    _one_line(_cli(*serve, "--key-file", node_key, "--certificate", cert, home=tmp_path), "--operator-key")
    _one_line(_cli("certify", coord.peer_id, "--expires", "2020-01-01T00:00Z", "--any-run",
                   "--operator-key-file", op_key, "--out", cert, home=tmp_path), "--expires", "future")  # fmt: skip

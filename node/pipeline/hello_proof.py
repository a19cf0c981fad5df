"""What makes a pipeline hello a neighbour's: the sender's own signed assignment, naming the recipient.

The pipeline port faces the internet and identities cost nothing, so a hello's signature proves who
connects, not that the coordinator put them there: 70 fresh keys once filled the acceptor's `max_held`
and evicted the real neighbour's connection before the worker took it (issue 21). A hello therefore
carries `Hello.assignment`, the sender's Assignment as its coordinator sealed it, and with A that
assignment, h the hello and N the receiving node, N holds the connection only if (`check`)

    trust.admit(A)                          the node's one rule for assignments (protocol/trust/delegation.py)
    A.peer_id = h.peer_id                   the sender's own (h is signed by h.peer_id: the acceptor checks)
    A.next.peer_id = N                      the coordinator put N right downstream of the sender
    (A.run_id, A.term, A.epoch, A.replica, A.stage) = h's
    (A.term, A.epoch) >= what N holds for A.run_id (when it holds one)

A fresh key has no such A; an assignment copied from the DHT names its own node, whose key the copier
lacks (one whose bytes hold no mention of the sender is refused before its body is decoded: 6 ms instead
of 140 ms for a churned run's 3.5 MB assignment). A.next = N is what "same replica, stage = ours - 1" means, said by the coordinator: it holds even
while N has not yet read its own assignment (the sender read its newer one first), which is why the proof
travels in the hello and is not looked up by N.

The sender finds A in the store's assignment archives (protocol/trust/assignment_archive.py), where its
coordinator puts every assignment before publishing it to the DHT (`find_sealed`): one LIST of the run's
archives and a GET of the first holding A (archives of A's term from A's epoch on: a coordinator that took
the run over re-issues unchanged epochs under its newest one), a signature check per envelope in it.
"""

from __future__ import annotations

import logging

import msgpack

from protocol import keys
from protocol.envelope import kind_of, open_envelope, verified_header
from protocol.messages import MAX_HELLO_ASSIGNMENT_BYTES, Assignment, Hello
from protocol.msgpack_limits import unpack_bounded
from protocol.net.store import ObjectStore, StoreError
from protocol.schema import ProtocolError, to_dict
from protocol.trust.assignment_archive import MAX_ARCHIVE_BYTES, MAX_ARCHIVE_TRIES
from protocol.trust.delegation import OperatorTrust

log = logging.getLogger(__name__)


HELLO_MAX_BYTES = MAX_HELLO_ASSIGNMENT_BYTES + 64 * 1024
"""The assignment a hello carries, and the hello's own fields and envelope around it (a few hundred bytes)."""


def find_sealed(store: ObjectStore, a: Assignment) -> bytes:
    """The envelope `a`'s coordinator sealed it in, from the run's archives; b"" (and a warning saying why)
    when none of the first MAX_ARCHIVE_TRIES that may hold it does, or the store does not answer."""
    payload = msgpack.packb(to_dict(a), use_bin_type=True)  # the bytes `seal` signed (protocol/envelope.py)
    kind = kind_of(Assignment)
    try:
        slots = sorted(
            (slot, key)
            for key in store.list(keys.assign_prefix(a.run_id))
            if (slot := keys.parse_assign_key(a.run_id, key)) is not None
            and slot[0] == a.term
            and slot[1] >= a.epoch
        )
        for _, key in slots[:MAX_ARCHIVE_TRIES]:
            blob = store.get(key, max_bytes=MAX_ARCHIVE_BYTES)
            if blob is None:
                continue
            try:
                envelopes = unpack_bounded(
                    blob, "assignment archive", max_bytes=MAX_ARCHIVE_BYTES, max_values=1 << 16, max_depth=1
                )
            except ProtocolError as e:
                log.info("run %s: skipping the assignment archive %s (%s)", a.run_id, key, e)
                continue
            for env in envelopes if isinstance(envelopes, list) else ():
                try:
                    header = verified_header(env)
                except ValueError:  # ProtocolError, SignatureError: someone else's junk
                    continue
                if header.kind == kind and header.payload == payload:
                    return bytes(env)
    except StoreError as e:
        log.warning(
            "run %s: cannot read the assignment archives (%s); the hello to stage %d carries no assignment, "
            "so that node holds the connection only while it waits for it",
            a.run_id,
            e,
            a.stage + 1,
        )
        return b""
    log.warning(
        "run %s: this node's assignment (term %d, epoch %d) is in none of the store's archives %s; the hello "
        "to stage %d carries no assignment, so that node holds the connection only while it waits for it",
        a.run_id,
        a.term,
        a.epoch,
        keys.assign_prefix(a.run_id),
        a.stage + 1,
    )
    return b""


def open_hello(frame: bytes, me: str | None, *, now: float, max_skew_s: float) -> Hello:
    """The hello a connection's first frame holds, signed by the peer it names, addressed to `me` (None:
    any node) and signed within `max_skew_s` of `now`; raises ProtocolError saying which is not so."""
    signed = open_envelope(frame, Hello, max_bytes=HELLO_MAX_BYTES)
    h = signed.body
    if signed.signer_id != h.peer_id:
        raise ProtocolError(f"hello names peer {h.peer_id} but is signed by {signed.signer_id}")
    if me is None:
        return h
    if h.to_peer_id != me:
        raise ProtocolError(
            f"hello from {h.peer_id} is addressed to {h.to_peer_id or 'no node'}, not to this node "
            f"{me}: replayed from another connection, or the peer runs an older build"
        )
    age_s = now - h.sent_at
    if not abs(age_s) <= max_skew_s:
        raise ProtocolError(
            f"hello from {h.peer_id} was signed {age_s:.0f} s ago by this node's clock, outside the "
            f"±{max_skew_s:.0f} s window: replayed, or the two clocks disagree (run NTP on both)"
        )
    return h


def check(
    hello: Hello, trust: OperatorTrust, me: str, *, now: float, held: tuple[int, int] | None = None
) -> Assignment:
    """The sender's assignment if `hello` (whose signer the caller checked is hello.peer_id) proves that a
    trusted coordinator put the sender right upstream of node `me` (module docstring); raises ProtocolError
    saying what is wrong otherwise. held: the (term, epoch) `me` holds in hello's run, if any."""
    who = hello.peer_id
    if not hello.assignment:
        raise ProtocolError(
            f"hello from {who} carries no assignment naming this node: only nodes a trusted coordinator "
            "placed upstream of this node are held (a stranger, or the sender runs an older build)"
        )
    try:
        # a fresh key's id is nowhere in an assignment it copied: refused before the body is decoded (a
        # churned run's is up to 4 MiB, a third of a second of this node's accept loop)
        if who.encode() not in verified_header(hello.assignment, MAX_HELLO_ASSIGNMENT_BYTES).payload:
            raise ProtocolError(f"it does not name {who} (copied from another node)")
        a = trust.open(hello.assignment, Assignment, now, max_bytes=MAX_HELLO_ASSIGNMENT_BYTES).body
    except ValueError as e:  # ProtocolError (schema, Untrusted), SignatureError
        raise ProtocolError(f"hello from {who} carries an assignment that is refused: {e}") from e
    if a.peer_id != who:
        raise ProtocolError(f"hello from {who} carries the assignment of {a.peer_id}, not its own (copied)")
    if a.next is None or a.next.peer_id != me:
        raise ProtocolError(
            f"hello from {who}: its assignment (run {a.run_id}, replica {a.replica}, stage {a.stage}) puts "
            f"{a.next.peer_id if a.next else 'no node'} downstream of it, not this node {me}"
        )
    said = (hello.run_id, hello.term, hello.epoch, hello.replica, hello.stage)
    if said != (a.run_id, a.term, a.epoch, a.replica, a.stage):
        raise ProtocolError(
            f"hello from {who} is for run {said[0]} term {said[1]} epoch {said[2]} replica {said[3]} stage "
            f"{said[4]}, but its assignment is for run {a.run_id} term {a.term} epoch {a.epoch} replica "
            f"{a.replica} stage {a.stage}"
        )
    if held is not None and (a.term, a.epoch) < held:
        raise ProtocolError(
            f"hello from {who} is for term {a.term} epoch {a.epoch} of run {a.run_id}, older than the "
            f"assignment this node holds (term {held[0]}, epoch {held[1]}): superseded"
        )
    return a


__all__ = ["check", "find_sealed"]

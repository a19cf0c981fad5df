"""The store's archive of a run's signed assignments: `{run}/assign/{term:06d}-{epoch:06d}` (protocol/keys.py).

A coordinator writes every (term, epoch) it issues as one msgpack list of signed `Assignment` envelopes.
Three readers share this one reading: a coordinator taking a run over (it adopts the placement), export
(who may sign the run's checkpoints) and a node judging whether its assignment is current (a newer epoch
supersedes it). Only what a trusted key signed counts: junk under an archive name supersedes nothing.
"""

from __future__ import annotations

import logging

import msgpack

from protocol import keys
from protocol.envelope import Signed, open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Assignment
from protocol.msgpack_limits import unpack_bounded
from protocol.net.store import ObjectStore, StoreError
from protocol.runspec import RunSpec
from protocol.schema import ProtocolError
from protocol.trust.delegation import OperatorTrust

log = logging.getLogger(__name__)

MAX_ARCHIVE_BYTES = 64 * 1024 * 1024
"""A run's signed assignments: a few KB per node."""


def encode_archive(identity: Identity, assignments: list[Assignment]) -> bytes:
    """The archive object of one (term, epoch): every assignment sealed by `identity`."""
    return msgpack.packb([seal(identity, a) for a in assignments])


def decode_archive(blob: bytes, trust: OperatorTrust, *, as_issued: bool = False) -> list[Assignment]:
    """The assignments of an archive object, each admitted by `trust`; raises ProtocolError (malformed)
    or ValueError (a bad signature, an untrusted signer). as_issued: check each certificate at the
    assignment's issued_at instead of now (a finished run's coordinators' certificates may have expired)."""
    return [s.body for s in open_archive(blob, trust, as_issued=as_issued)]


def open_archive(blob: bytes, trust: OperatorTrust, *, as_issued: bool = False) -> list[Signed[Assignment]]:
    """`decode_archive`, keeping who signed each assignment (a node counts only its term's leader's)."""
    try:
        # a list of envelopes, at least 1 KB each: 65,536 fill MAX_ARCHIVE_BYTES
        envelopes = unpack_bounded(
            blob, "assignment archive", max_bytes=MAX_ARCHIVE_BYTES, max_values=1 << 16, max_depth=1
        )
    except msgpack.UnpackException as e:
        raise ProtocolError(f"the assignment archive is not msgpack: {e}") from e
    if not isinstance(envelopes, list):
        raise ProtocolError("the assignment archive is not a list of envelopes")
    out = []
    for env in envelopes:
        signed = open_envelope(env, Assignment)
        out.append(trust.admit(signed, signed.body.issued_at if as_issued else None))
    return out


MAX_ARCHIVE_TRIES = 4
"""Archives a reader opens, newest first, before it gives up: junk or an unreadable object under a canonical
name (anyone with the store's credentials can write one) costs one GET each, not a missed adoption."""


def read_archive(
    store: ObjectStore, spec: RunSpec, trusted: OperatorTrust | set[bytes], *, as_issued: bool = False
) -> list[Assignment] | None:
    """The run's assignments in the newest archive its coordinators wrote that holds any: canonical keys
    only (`keys.parse_assign_key`), by (term, epoch), newest first, at most MAX_ARCHIVE_TRIES opened; an
    object that is junk, unsigned or another run's is logged and the next older one read. None if none."""
    rid = spec.run_id
    try:
        listed = store.list(keys.assign_prefix(rid))
    except StoreError as e:
        log.warning("run %s: cannot list the assignment archives (%s)", rid, e)
        return None
    slots = sorted(((s, k) for k in listed if (s := keys.parse_assign_key(rid, k)) is not None), reverse=True)
    for _, key in slots[:MAX_ARCHIVE_TRIES]:
        try:
            blob = store.get(key, max_bytes=MAX_ARCHIVE_BYTES)
            found = decode_archive(blob, OperatorTrust.of(trusted), as_issued=as_issued) if blob else []
        except (StoreError, ProtocolError, ValueError) as e:
            log.warning("run %s: skipping the assignment archive %s (%s)", rid, key, e)
            continue
        mine = [a for a in found if a.run_id == rid and a.spec == spec]
        if mine:
            return mine
        log.warning("run %s: the assignment archive %s holds no assignment of this run", rid, key)
    return None


__all__ = [
    "MAX_ARCHIVE_BYTES",
    "MAX_ARCHIVE_TRIES",
    "decode_archive",
    "encode_archive",
    "open_archive",
    "read_archive",
]

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
from protocol.delegation import OperatorTrust
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import Assignment
from protocol.msgpack_limits import unpack_bounded
from protocol.net.store import ObjectStore, StoreError
from protocol.runspec import RunSpec
from protocol.schema import ProtocolError

log = logging.getLogger(__name__)

MAX_ARCHIVE_BYTES = 64 * 1024 * 1024
"""A run's signed assignments: a few KB per node."""


def encode_archive(identity: Identity, assignments: list[Assignment]) -> bytes:
    """The archive object of one (term, epoch): every assignment sealed by `identity`."""
    return msgpack.packb([seal(identity, a) for a in assignments])


def archive_slot(run_id: str, key: str) -> tuple[int, int] | None:
    """(term, epoch) of an archive's store key, or None for any other name under the run."""
    prefix = keys.assign_prefix(run_id)
    term, sep, epoch = key.removeprefix(prefix).partition("-")
    if not (key.startswith(prefix) and sep and term.isdecimal() and epoch.isdecimal()):
        return None
    if len(term) > 19 or len(epoch) > 19:  # beyond MAX_COUNT: nobody's term
        return None
    return int(term), int(epoch)


def decode_archive(blob: bytes, trust: OperatorTrust, *, as_issued: bool = False) -> list[Assignment]:
    """The assignments of an archive object, each admitted by `trust`; raises ProtocolError (malformed)
    or ValueError (a bad signature, an untrusted signer). as_issued: check each certificate at the
    assignment's issued_at instead of now (a finished run's coordinators' certificates may have expired)."""
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
        out.append(trust.admit(signed, signed.body.issued_at if as_issued else None).body)
    return out


def read_archive(
    store: ObjectStore, spec: RunSpec, trusted: OperatorTrust | set[bytes], *, as_issued: bool = False
) -> list[Assignment] | None:
    """The run's assignments in the newest archive its coordinators wrote (keys sort by term, then epoch);
    None if there is none or it cannot be read (logged)."""
    rid = spec.run_id
    try:
        archived = sorted(store.list(keys.assign_prefix(rid)))
        blob = store.get(archived[-1], max_bytes=MAX_ARCHIVE_BYTES) if archived else None
        if blob is None:
            return None
        found = decode_archive(blob, OperatorTrust.of(trusted), as_issued=as_issued)
    except (StoreError, ProtocolError, ValueError) as e:
        log.warning("run %s: cannot read the assignment archive (%s)", rid, e)
        return None
    mine = [a for a in found if a.run_id == rid and a.spec == spec]
    if not mine:
        log.warning("run %s: the assignment archive holds no assignment of this run", rid)
    return mine or None


__all__ = ["MAX_ARCHIVE_BYTES", "archive_slot", "decode_archive", "encode_archive", "read_archive"]

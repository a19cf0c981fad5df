"""A hivemind record validator that admits only records tied to their signer, for no longer than signed.

Every Crucible DHT record is stored under a subkey ending in the signer's peer id (`PEER` or
`name@PEER`), and its value is an envelope signed by that peer with an expiry inside the signed bytes.
Each DHT node checks this when asked to store a record and when one is returned, and refuses:
- a record without a subkey (a plain value would replace a whole dictionary such as `crucible/nodes`);
- a subkey that names no peer, or a value signed by someone else than the peer it names (nobody can
  overwrite or shadow another peer's advert, a coordinator's assignment or an operator's run record);
- a value without a signed expiry, or a DHT expiration later than the signed one (a captured record
  re-stored with a far expiration would otherwise block every later update of its subkey), or a signed
  expiry more than MAX_RECORD_TTL_S ahead;
- under the swarm-wide keys, a subkey of the wrong form or a message of the wrong kind (`LAYOUT`).
A rejected record is simply never stored, so readers never see it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from protocol import keys
from protocol.envelope import MAX_ENVELOPE_BYTES, kind_of, verified_header
from protocol.identity import SignatureError, peer_id_of, public_key_of_peer_id
from protocol.messages import NodeAdvert, RunRecord
from protocol.msgpack_limits import unpack_bounded
from protocol.schema import describe

MAX_RECORD_TTL_S = 24 * 3600.0
"""Longest a record may be signed to live; the swarm's records live for seconds to minutes."""
MAX_SUBKEY_CHARS = 256
_PEER_ID_CHARS = 64  # an Ed25519 libp2p peer id is 52 base58 characters
_MAX_SUBKEY_BYTES = 4 * MAX_SUBKEY_CHARS + 5  # msgpack str header + UTF-8


def subkey_owner(subkey: object) -> str | None:
    """The peer id a subkey names (`PEER` or `name@PEER`), or None if it names none."""
    if not isinstance(subkey, str) or len(subkey) > MAX_SUBKEY_CHARS:
        return None
    owner = subkey.rsplit("@", 1)[-1]
    if len(owner) > _PEER_ID_CHARS:
        return None
    try:
        public_key_of_peer_id(owner)
    except SignatureError:
        return None
    return owner


@dataclass(frozen=True)
class KeyRule:
    """What may be stored under one swarm-wide DHT key."""

    kind: str
    """The message kind of every value."""
    named: bool
    """Subkeys are `name@PEER` (True; the name is not empty) or the bare `PEER` (False)."""


def dht_key_id(key: str) -> bytes:
    """The bytes a validator sees as `DHTRecord.key` for the DHT key `key`."""
    return bytes(DHTID.generate(source=key).to_bytes())


LAYOUT = {
    dht_key_id(keys.NODES_KEY): KeyRule(kind=kind_of(NodeAdvert), named=False),
    dht_key_id(keys.RUNS_KEY): KeyRule(kind=kind_of(RunRecord), named=True),
}
"""protocol/keys.py's fixed keys; per-peer keys (assignments) follow the general rule only."""
_NO_SUBKEY = (msgpack.packb(None), b"")  # hivemind's tags of a plain value and of a whole dictionary


class SignedSubkeyValidator(RecordValidatorBase):
    def __init__(
        self, *, max_ttl_s: float = MAX_RECORD_TTL_S, clock: Callable[[], float] = get_dht_time
    ) -> None:
        self.max_ttl_s = max_ttl_s
        self.clock = clock

    def validate(self, record: DHTRecord) -> bool:
        return self.rejection(record) is None

    def rejection(self, record: DHTRecord) -> str | None:
        """Why `record` is refused, or None if it is admitted. Never raises."""
        try:
            return self._rejection(record)
        except Exception as e:  # anything unparsable is refused: it cannot be tied to a signer
            return f"unparsable record ({type(e).__name__}: {str(e)[:80]})"

    def _rejection(self, record: DHTRecord) -> str | None:
        if record.subkey in _NO_SUBKEY:
            return "no subkey: every record is stored under its signer's subkey (PEER or name@PEER)"
        # both are one msgpack scalar (a str, a bin); the envelope inside the value is bounded again
        subkey = unpack_bounded(record.subkey, "subkey", max_bytes=_MAX_SUBKEY_BYTES, max_values=1)
        owner = subkey_owner(subkey)
        if owner is None:
            return f"subkey {describe(subkey)} names no peer (expected PEER or name@PEER)"
        assert isinstance(subkey, str)
        rule = LAYOUT.get(bytes(record.key))
        if rule is not None:
            name = subkey[: -len(owner)]
            if rule.named and len(name) < 2:
                return f"subkey {describe(subkey)} must be name@PEER under this key"
            if not rule.named and name:
                return f"subkey {describe(subkey)} must be the bare peer id under this key"
        value = unpack_bounded(record.value, "value", max_bytes=MAX_ENVELOPE_BYTES + 5, max_values=1)
        header = verified_header(value)
        if rule is not None and header.kind != rule.kind:
            return f"a {describe(header.kind)} message under a key that holds {rule.kind} messages"
        if peer_id_of(header.signer) != owner:
            return f"signed by {peer_id_of(header.signer)}, not by the subkey's owner {owner}"
        signed_exp = header.expires_at
        if signed_exp is None:
            return "the envelope carries no signed expiry"
        if not math.isfinite(record.expiration_time) or record.expiration_time > signed_exp:
            return (
                f"DHT expiration {describe(record.expiration_time)} lies beyond the signed expiry "
                f"{describe(signed_exp)}"
            )
        if signed_exp > self.clock() + self.max_ttl_s:
            return f"signed expiry {describe(signed_exp)} is more than {self.max_ttl_s:g} s ahead"
        return None

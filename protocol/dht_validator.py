"""A hivemind record validator that makes subkeys named after a peer writable only by that peer.

Every Crucible DHT record is stored under a subkey ending in the signer's peer id (`PEER` or
`name@PEER`), and its value is an envelope signed by that peer. Each DHT node checks this when asked to
store a record and when one is returned, so nobody can overwrite or shadow another peer's advert, a
coordinator's assignment or an operator's run record — a forged value is simply never stored.
"""

from __future__ import annotations

import msgpack
from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from protocol.envelope import verified_signer
from protocol.identity import SignatureError, peer_id_of, public_key_of_peer_id


def subkey_owner(subkey: object) -> str | None:
    """The peer id a subkey names (`PEER` or `name@PEER`), or None if it names none."""
    if not isinstance(subkey, str):
        return None
    owner = subkey.rsplit("@", 1)[-1]
    try:
        public_key_of_peer_id(owner)
    except SignatureError:
        return None
    return owner


class SignedSubkeyValidator(RecordValidatorBase):
    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False) if record.subkey else None
        except Exception:
            return True  # not one of ours (hivemind's own records use other encodings)
        owner = subkey_owner(subkey)
        if owner is None:
            return True
        try:
            return peer_id_of(verified_signer(msgpack.unpackb(record.value, raw=False))) == owner
        except Exception:  # anything unparsable under a peer-owned subkey is a forgery
            return False

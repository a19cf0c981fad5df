"""The operator's key: the one Ed25519 identity every node of the operator's swarm trusts.

Nodes accept run records and assignments only when this key signed them (`crucible-node join
--operator-key PEER_ID`). A key made up on the spot is trusted by no node, so only `crucible-coordinator
init` creates one (`create_operator_key`); every other command loads it (`load_operator_key`) and refuses
to start without it, naming the file and the command that creates it.

The operator key need not sit on a coordinator host: `crucible-coordinator certify` signs a certificate for
a coordinator's own key (protocol/trust/delegation.py), and `serve --key-file --certificate` loads that key and
checks the certificate here before it starts (`load_signing_key`, `load_certificate`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from protocol.identity import Identity, peer_id_of
from protocol.messages import MAX_CERTIFICATE_BYTES
from protocol.process.cli_errors import bad_input
from protocol.trust.delegation import OperatorTrust, Untrusted, read_certificate

DEFAULT_OPERATOR_KEY_FILE = "~/.crucible/operator.key"
"""Where `init` writes the key and the other commands read it when --operator-key-file is not given."""
FLAG = "--operator-key-file"
SEED_BYTES = 32
"""The file holds the raw Ed25519 seed, as `Identity.load_or_create` writes it (mode 0600)."""


def _init_hint(path: str | Path) -> str:
    flag = "" if str(path) == DEFAULT_OPERATOR_KEY_FILE else f" {FLAG} {path}"
    return f"crucible-coordinator init{flag}"


def load_operator_key(path: str | Path = DEFAULT_OPERATOR_KEY_FILE) -> Identity:
    """The operator key at `path` (`~` expanded); a UsageError naming --operator-key-file, and saying how
    to create the key, when the file is missing or is not a key. Never creates one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise bad_input(
            FLAG,
            str(path),
            f"no operator key there, and only `{_init_hint(path)}` creates one (a new key is trusted by "
            "no node: providers give their nodes its peer id); run it once, or point "
            f"{FLAG} at the existing key",
        )
    if not p.is_file():
        raise bad_input(
            FLAG, str(path), "is a folder, not a key file", f"{FLAG} {Path(path) / 'operator.key'}"
        )
    return _read_seed(p, FLAG, str(path), "`crucible-coordinator init`")


def _read_seed(p: Path, flag: str, shown: str, writer: str) -> Identity:
    try:
        seed = p.read_bytes()
    except OSError as e:
        raise bad_input(flag, shown, f"cannot be read: {e.strerror}") from e
    if len(seed) != SEED_BYTES:
        raise bad_input(
            flag,
            shown,
            f"holds {len(seed)} bytes, not a {SEED_BYTES}-byte Ed25519 seed (the file {writer} writes)",
        )
    return Identity.from_seed(seed)


def load_signing_key(path: str | Path, flag: str = "--key-file") -> Identity:
    """A coordinator's own key (a node's key file) at `path`; never created (a new key holds no
    certificate), a UsageError naming `flag` when missing or not a key."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise bad_input(
            flag,
            str(path),
            "no key file there: give the key file of the node the certificate was issued for (the "
            "--key-file of its `crucible-node join`)",
        )
    return _read_seed(p, flag, str(path), "`crucible-node join`")


def load_certificate(
    path: str | Path,
    signer: Identity,
    trust: OperatorTrust,
    now: float | None = None,
    flag: str = "--certificate",
) -> bytes:
    """The certificate at `path` if it lets `signer` sign as a coordinator under `trust` now (for its run,
    or any run); else a UsageError naming `flag`, the file and why (missing, not a certificate, expired,
    not for this key, not signed by the operator, wrong role)."""
    p = Path(path).expanduser()
    renew = f"crucible-coordinator certify {signer.peer_id} --expires 7d --any-run --out {path}"
    operators = ", ".join(peer_id_of(k) for k in sorted(trust.operators))
    if not p.is_file():
        raise bad_input(flag, str(path), f"no certificate there; the operator issues one with `{renew}`")
    try:
        with p.open("rb") as f:
            data = f.read(MAX_CERTIFICATE_BYTES + 1)
    except OSError as e:
        raise bad_input(flag, str(path), f"cannot be read: {e.strerror}") from e
    try:
        if len(data) > MAX_CERTIFICATE_BYTES:
            raise ValueError(f"over {MAX_CERTIFICATE_BYTES} bytes")
        cert = read_certificate(data).body
    except ValueError as e:
        raise bad_input(flag, str(path), f"is not a certificate ({e}); `{renew}` writes one", None) from e
    try:
        trust.delegation(signer.public_key, data, cert.run, time.time() if now is None else now)
    except Untrusted as e:
        raise bad_input(
            flag,
            str(path),
            f"does not let key {signer.peer_id} coordinate for operator {operators}: {e.why} ({e.reason}); "
            f"the operator issues a new one with `{renew}`",
        ) from e
    return data


def create_operator_key(path: str | Path = DEFAULT_OPERATOR_KEY_FILE) -> tuple[Identity, bool]:
    """A new operator key written to `path` (mode 0600, folders created), or the key already there:
    (identity, created). An existing file is never overwritten."""
    p = Path(path).expanduser()
    if p.exists():
        return load_operator_key(path), False
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise bad_input(FLAG, str(path), f"cannot create its folder: {e.strerror}") from e
    ident = Identity.generate()
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another init won the race: its key stands
        return load_operator_key(path), False
    except OSError as e:
        raise bad_input(FLAG, str(path), f"cannot be created: {e.strerror}") from e
    with os.fdopen(fd, "wb") as f:
        f.write(ident.seed)
    return ident, True


__all__ = [
    "DEFAULT_OPERATOR_KEY_FILE",
    "create_operator_key",
    "load_certificate",
    "load_operator_key",
    "load_signing_key",
]

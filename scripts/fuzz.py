"""Seeded mutation fuzzing of every decoder that reads untrusted bytes (issue 10, acceptance 2; issue 21,
acceptance 8: what is read from the store).

    python -m scripts.fuzz [--n 100000] [--decoders frame,sparseloco,...] [--seed 0] [--jobs 2]
    python -m scripts.fuzz --list                          # the decoders and what each may raise
    python -m scripts.fuzz --repro sparseloco 1234         # rebuild input 1234, print it and its traceback
    python -m scripts.fuzz --flood 16                      # 16 MB of the worst msgpack per decoder (FLOODS)
    python -m scripts.fuzz --check                         # the flags and decoder names only, fuzz nothing

Every input starts from a VALID encoding (a seed) and is mutated the way a hostile peer would: bit flips,
byte insert/delete/duplicate, truncation, edits of length fields (the format's own and msgpack's), splices
of two valid inputs, and msgpack-level edits of the decoded structure (a field replaced by an extreme or
ill-typed value, deleted, added, renamed or nested deeply). Structural edits are re-signed with the seed's
key, so they get past the signature check and reach the schema and payload parsers behind it: a signer
is never proof of honest bytes. Input i of a decoder is a pure function of (--seed, decoder, i), so
`--repro` rebuilds it in a fresh process.

What a node, a coordinator or `export` reads from the store (anyone with the store's credentials writes it):
`envelope:RoundRecord`, `envelope:RouteCounts`, `checkpoint:manifest` and `checkpoint:pointer` (`open_envelope` within the reader's
size bound), `certificate` (`read_certificate`, then `OperatorTrust.delegation`, the rule every reader of a
coordinator's object applies) and `corpus_manifest` (`parse_manifest`: the bytes mutated, JSON pieces
spliced in, lines dropped, repeated, swapped, taken from another manifest or nested up to 5,000 deep, each
line's list edited as a structure and written out again, sizes beyond a float's or a file's range; an
accepted manifest's sizes are summed as the node's disk check does). 3% of their inputs are random bytes. 100,000
each (about a minute on 2 cores; docs/reliability.md has the figures):

    python -m scripts.fuzz --n 100000 --decoders envelope:RoundRecord,checkpoint:manifest,checkpoint:pointer,certificate,corpus_manifest

Each decoder runs in its own child process. The child builds its seeds, warms up, reads its address space
(VmSize in /proc/self/status), then caps it at that baseline + --mem-mb with RLIMIT_AS: an input that
makes the decoder allocate beyond that shows as a MemoryError (or a failed torch allocation). Per decoder:
- bad_exceptions: inputs that raised something outside the decoder's documented error types (`--list`),
  with the first example of each kind: input index, input (hex), message and traceback;
- slowest_s / slowest_input: the slowest single decode;
- memory_error: whether any input hit the cap (also when a documented error wraps the MemoryError);
- crashed: set if the child died (a signal, an abort, the timeout), with the input it was on;
- inputs_per_s: inputs generated and decoded per second;
- outcomes: inputs accepted or rejected, by error type (how deep they got).
Progress goes to stderr; one JSON line, last, to stdout. Exit status 1 if any decoder has a finding.

`--flood MB` decodes, instead, a few inputs per decoder of about MB megabytes (at most the decoder's own size
limit) that a peer fills with the msgpack a decoder handles worst (`FLOODS`: empty arrays, short strings,
integers then arrays, arrays declaring 65,535 elements nested 1,023 deep), signed where the decoder checks a
signature first, under the same cap, and reports each one's time, peak memory and outcome.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import hashlib
import json
import math
import mmap
import os
import random
import re
import resource
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from protocol.envelope import MAX_ENVELOPE_BYTES, kind_of, seal, signed_bytes
from protocol.identity import Identity, SignatureError
from protocol.messages import MAX_ROUTE_RECORD_BYTES
from protocol.schema import ProtocolError, to_dict

NOW = 1_700_000_000.0
"""The DHT time every seed is made at (and the validator's clock): inputs do not depend on the date."""
SLOW_S = 3.0
"""An input slower than this to decode is a finding (a pathological case takes minutes; the slowest honest
megabyte takes ~0.25 s alone and passed 1 s on a 2-core CI host under load)."""
MAX_EXAMPLES = 5
"""Distinct findings kept per decoder (distinct = exception type and the line that raised it)."""
MAX_HEX = 4096
"""Bytes of an input shown in a finding; `--repro` rebuilds the whole input."""


def _identity(name: str) -> Identity:
    return Identity.from_seed(hashlib.sha256(b"crucible-fuzz/" + name.encode()).digest())


# ---- byte-level mutations ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Field:
    """An integer field of a binary format (a length, a count, a version) that mutations aim at."""

    offset: int
    size: int
    order: str = "little"


_MSGPACK_LEN = re.compile(rb"[\xc4-\xc6\xd9-\xdf]")  # bin/str 8-32, array/map 16-32: a length follows
_MSGPACK_LEN_SIZE = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
_EDGE_INTS = (0, 1, 2, 3, 4, 7, 8, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000)
_EDGE_INTS += (0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 26, (1 << 26) + 1, 2**63 - 1, 2**64 - 1)


def _edge_int(rng: random.Random, size: int, current: int, length: int) -> int:
    pick = rng.random()
    if pick < 0.5:
        v = rng.choice(_EDGE_INTS)
    elif pick < 0.8:
        v = current + rng.choice((-2, -1, 1, 2, 8, -8, current, 1 << rng.randrange(8 * size)))
    elif pick < 0.9:
        v = length + rng.randrange(-4, 5)
    else:
        v = rng.getrandbits(8 * size)
    return v % (1 << (8 * size))


def _edit_field(b: bytearray, rng: random.Random, fields: Sequence[Field]) -> bytearray:
    """Overwrite a length or count field: the format's own, a msgpack length, or any 1-8 bytes."""
    fit = [f for f in fields if f.offset + f.size <= len(b)]
    pick = rng.random()
    if fit and pick < 0.6:
        f = rng.choice(fit)
    elif pick < 0.85 and (heads := [m.start() for m in _MSGPACK_LEN.finditer(b)]):
        at = rng.choice(heads)
        f = Field(at + 1, _MSGPACK_LEN_SIZE[b[at]], "big")
        if f.offset + f.size > len(b):
            return b
    elif b:
        size = rng.choice((1, 2, 4, 8))
        f = Field(rng.randrange(len(b)), size, rng.choice(("little", "big")))
        if f.offset + f.size > len(b):
            return b
    else:
        return b
    current = int.from_bytes(b[f.offset : f.offset + f.size], f.order)  # type: ignore[arg-type]
    v = _edge_int(rng, f.size, current, len(b))
    b[f.offset : f.offset + f.size] = v.to_bytes(f.size, f.order)  # type: ignore[arg-type]
    return b


def _piece(rng: random.Random) -> bytes:
    return rng.choice(
        (
            bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 16))),
            b"\x00" * rng.randint(1, 64),
            b"\xff" * rng.randint(1, 64),
            b"\xc1",  # never used in msgpack
            b"\x91" * rng.choice((33, 600, 5000)) + b"\xc0",  # nested arrays
            b"\xdd\xff\xff\xff\xff",  # array of 2^32 - 1 items
            b"\xdf\x7f\xff\xff\xff",  # map of 2^31 - 1 entries
            b"\xc6\x7f\xff\xff\xff",  # bin of 2 GiB
            b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # float64 NaN
            b"\x00\x00\xc0\x7f",  # float32 NaN, little-endian
        )
    )


def mutate_bytes(
    data: bytes, rng: random.Random, *, fields: Sequence[Field] = (), others: Sequence[bytes] = ()
) -> bytes:
    """1-8 stacked byte-level mutations of `data` (splices take a second input from `others`)."""
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 8))):
        op = rng.randrange(10)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:  # bit flips
            for _ in range(rng.choice((1, 1, 2, 8))):
                j = rng.randrange(len(b))
                b[j] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # byte set
            b[rng.randrange(len(b))] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.getrandbits(8)))
        elif op == 2:  # insert
            b[i:i] = _piece(rng)
        elif op == 3:  # delete
            del b[i : i + rng.choice((1, 1, 2, 4, 16, 256))]
        elif op == 4 and b:  # duplicate a range, once or many times
            j = rng.randrange(len(b))
            part = b[j : j + rng.choice((1, 4, 16, 256, len(b)))]
            b[i:i] = part * rng.choice((1, 1, 2, 16))
        elif op == 5:  # truncate
            del b[rng.randrange(len(b) + 1) :]
        elif op in (6, 7):
            b = _edit_field(b, rng, fields)
        elif op == 8 and others:  # splice: a prefix of this input, a suffix of another
            other = rng.choice(others)
            b = b[:i] + other[rng.randrange(len(other) + 1) :]
        elif op == 9:  # append
            b += _piece(rng)
    return bytes(b)


# ---- msgpack-level mutations ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deep:
    """A value nested `depth` arrays deep (packed as raw bytes: msgpack's packer stops at 512)."""

    depth: int


_DEEP = re.compile(rb"[\xa0-\xbf]\x00DEEP(\d+)\x00")


def _deep_default(obj: object) -> object:
    if isinstance(obj, Deep):
        return f"\x00DEEP{obj.depth}\x00"
    if isinstance(obj, int):  # beyond 64 bits: msgpack has no such integer, a peer can only send a float
        return float(obj) if abs(obj) < 2**1023 else (math.inf if obj > 0 else -math.inf)
    raise TypeError(f"cannot pack {type(obj).__name__}")


def pack(obj: object) -> bytes:
    """msgpack bytes of obj, with every `Deep` expanded to its nested arrays."""
    raw = msgpack.packb(obj, use_bin_type=True, default=_deep_default)
    if b"DEEP" in raw:
        raw = _DEEP.sub(lambda m: b"\x91" * int(m.group(1)) + b"\xc0", raw)
    return raw


def _copy(obj: object) -> Any:
    return msgpack.unpackb(pack(obj), raw=False, strict_map_key=False)


_INTERESTING: tuple[object, ...] = (
    None, True, False, 0, 1, -1, 255, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
    0.0, -0.0, 0.5, 1e10 + 1, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf,
    "", "\n", "x" * 257, "x" * 70_000, "é\u202e\u0000", "12D3KooW", "r1\n", b"", b"\x00" * 32, b"\xff" * 64,
    [], [[]], [0] * 2000, [None], [1, 2], [0, 0], [-1, 2**40], {}, {"": None}, {"a": {"b": {}}},
    Deep(33), Deep(600), Deep(5000),
)  # fmt: skip
_NEW_KEYS: tuple[object, ...] = ("x", "", "exp", "sig", "spec", "peer_id", "__class__", "a" * 300, 7, 1.5)


def _values(obj: object, out: list[object], limit: int = 200) -> list[object]:
    """Every value inside obj (breadth-first, at most `limit`): material for cross-seed swaps."""
    queue = [obj]
    while queue and len(out) < limit:
        v = queue.pop(0)
        out.append(v)
        if isinstance(v, dict):
            queue.extend(v.values())
        elif isinstance(v, list):
            queue.extend(v)
    return out


def _repeat(v: Any, times: int) -> Any:
    """v * times, or v twice where that would pack to more than 1 MiB (the inputs stay small)."""
    return v * times if len(pack(v)) * times <= 1 << 20 else v + v


def _derived(v: object, rng: random.Random) -> object:
    """A neighbour of v: off by one, negated, scaled, retyped, truncated, repeated."""
    if isinstance(v, bool):
        return rng.choice((not v, int(v), str(v).lower(), None))
    if isinstance(v, int):
        return rng.choice(
            (v + 1, v - 1, -v, -v - 1, v * 2**32, v + 2**63, float(v), str(v), v ^ (1 << rng.randrange(64)))
        )
    if isinstance(v, float):
        finite = math.isfinite(v)
        return rng.choice(
            (math.nan, math.inf, -v, v * 1e300 if finite else 0.0, v / 1e300, int(v) if finite else 0, str(v))
        )
    if isinstance(v, str):
        at = rng.randrange(len(v) + 1)
        many = _repeat(v, rng.choice((2, 100, 10_000)))
        return rng.choice(
            (
                "",
                many,
                v + "\n",
                v[:-1],
                v[1:],
                f"{v}@{v}",
                v.encode(),
                v + "\x00",
                v[:at] + "\u00e9" + v[at:],
            )
        )
    if isinstance(v, bytes):
        flipped = bytearray(v)
        if flipped:
            flipped[rng.randrange(len(v))] ^= 1 << rng.randrange(8)
        return rng.choice((b"", v[:-1], v + b"\x00", v * 2, bytes(flipped), v.hex()))
    if isinstance(v, list):
        many = _repeat(v, rng.choice((10, 1000)))
        return rng.choice(([], v + v, v[:1], [v], many, v[::-1], {str(i): x for i, x in enumerate(v)}))
    if isinstance(v, dict):
        return rng.choice(({}, list(v.values()), list(v), {**v, "x": 1}, [v]))
    return rng.choice((0, "", [], {}, False))


def _variant(v: object, rng: random.Random, pool: Sequence[object]) -> object:
    pick = rng.random()
    if pick < 0.35:  # a copy: the edits that follow must never reach the shared table
        return copy.deepcopy(rng.choice(_INTERESTING))
    if pick < 0.5 and pool:
        return _copy(rng.choice(pool))
    return _derived(v, rng)


def mutate_obj(obj: object, rng: random.Random, pool: Sequence[object] = ()) -> Any:
    """1-3 structural edits of a msgpack-able value (a copy): replace, delete, add, rename or nest."""
    root: list[Any] = [_copy(obj)]
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        slots: list[tuple[Any, Any]] = [(root, 0)]
        for c in _values(root[0], []):
            if isinstance(c, dict):
                slots.extend((c, k) for k in c)
            elif isinstance(c, list):
                slots.extend((c, i) for i in range(len(c)))
        c, k = rng.choice(slots)
        op = rng.random()
        if op < 0.6 or c is root:
            c[k] = _variant(c[k], rng, pool)
        elif op < 0.72:
            del c[k]
        elif op < 0.84:
            if isinstance(c, dict):
                c[rng.choice(_NEW_KEYS)] = _variant(c[k], rng, pool)
            else:
                c.insert(k, _variant(c[k], rng, pool))
        elif op < 0.92 and isinstance(c, dict):
            c[rng.choice(_NEW_KEYS)] = c.pop(k)
        else:
            c[k] = [c[k]] if rng.random() < 0.5 else Deep(rng.choice((31, 33, 600)))
    return root[0]


# ---- decoders ------------------------------------------------------------------------------------------


class Target:
    """One decoder of untrusted input: how to make inputs from valid seeds, and how to decode one."""

    name: str
    documented: tuple[type[BaseException], ...] = (ProtocolError,)
    """What the decoder's docstring says it raises on bad input; anything else is a finding."""

    def generate(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def decode(self, x: Any) -> str:
        """Decode input x; return an outcome label ("ok" or what was refused), raise what the decoder does."""
        raise NotImplementedError

    def seeds(self) -> list[Any]:
        """The valid inputs (each must decode without an error)."""
        raise NotImplementedError

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> Any:
        """An input of about nbytes (at most the decoder's own size limit) whose msgpack part is `fill(size)`
        (one of FLOODS), signed where the decoder checks a signature; None if it takes an exact size."""
        return None

    def show(self, x: Any) -> dict[str, Any]:
        """The input, for a report: hex of its bytes, plus whatever else the decoder is given."""
        data = x[0] if isinstance(x, tuple) else x
        return {"hex": data[:MAX_HEX].hex(), "bytes": len(data)}


@dataclasses.dataclass
class EnvelopeSeed:
    identity: Identity
    kind: str
    body: dict[str, Any]
    exp: float | None
    wire: bytes


def envelope_seed(identity: Identity, body: Any, exp: float | None = None) -> EnvelopeSeed:
    return EnvelopeSeed(
        identity, kind_of(type(body)), to_dict(body), exp, seal(identity, body, expires_at=exp)
    )


def mutated_envelope(
    seed: EnvelopeSeed, rng: random.Random, wires: Sequence[bytes], pool: Sequence[object]
) -> bytes:
    """A hostile envelope: the seed's bytes mutated (signature broken), or its body, payload or envelope
    fields edited and re-signed with the seed's key (a valid signature over hostile content)."""
    mode = rng.random()
    if mode < 0.3:
        return mutate_bytes(seed.wire, rng, others=wires)
    body: object = seed.body if mode > 0.8 else mutate_obj(seed.body, rng, pool)
    payload = pack(body)
    if rng.random() < 0.15:
        payload = mutate_bytes(payload, rng)
    env: dict[Any, Any] = {"v": 1, "kind": seed.kind, "signer": seed.identity.public_key, "payload": payload}
    if seed.exp is not None:
        env["exp"] = seed.exp
    if rng.random() < 0.15:
        env = mutate_obj(env, rng, [seed.exp or NOW, NOW + 1e6, 1, 2, "Hello", "Lease"])
    if isinstance(env, dict):
        try:
            exp = env.get("exp")
            env["sig"] = seed.identity.sign(signed_bytes(env["v"], env["kind"], exp, env["payload"]))
        except Exception:  # an edited field no longer fits the signed form: leave the signature off
            env["sig"] = bytes(64)
    data = pack(env)
    return mutate_bytes(data, rng) if rng.random() < 0.1 else data


def containers(nbytes: int) -> bytes:
    """nbytes of msgpack: an array of nbytes - 5 empty arrays (one Python list per byte when unpacked)."""
    n = max(nbytes - 5, 0)
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def strings(nbytes: int) -> bytes:
    """nbytes of msgpack: an array of 2-character strings (one 51-byte str per 3 input bytes)."""
    n = max(nbytes - 5, 0) // 3
    return b"\xdd" + n.to_bytes(4, "big") + b"\xa2ab" * n


def declared(nbytes: int) -> bytes:
    """Arrays nested 1,023 deep (msgpack's stack), each declaring 65,535 elements and the last holding a bin
    that pads the input to nbytes, then the end: msgpack's C unpacker allocates room for declared elements up
    front (msgpack 1.2.4: 67 MB resident for these 3 KB of headers, in an input of at least 64 KB)."""
    head = b"\xdc\xff\xff" * 1023
    pad = max(nbytes - len(head) - 5, 0)
    return head + b"\xc6" + pad.to_bytes(4, "big") + bytes(pad)


def mixed(nbytes: int) -> bytes:
    """nbytes of msgpack: an array of 2-byte integers (uint 8, decoded by msgpack) then 65,540 empty arrays,
    so a decoder that bounds containers apart from values (a fragment header) meets both bounds."""
    lists = 65_540
    ints = max(nbytes - 5 - lists, 0) // 2
    return b"\xdd" + (ints + lists).to_bytes(4, "big") + b"\xcc\x80" * ints + b"\x90" * lists


FLOODS: dict[str, Callable[[int], bytes]] = {
    "arrays": containers,
    "strings": strings,
    "mixed": mixed,
    "declared": declared,
}
"""The msgpack fills `--flood` sends each decoder (module docstring)."""


def _peer_ids() -> tuple[str, str]:
    return _identity("owner").peer_id, _identity("other").peer_id


def _messages() -> dict[str, list[Any]]:
    """Valid message bodies of every kind, built as the swarm builds them."""
    from protocol.messages import Assignment, Endpoint, Hello, Lease, NodeAdvert, RunControl, RunRecord
    from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, SyncSpec

    me, other = _peer_ids()
    spec = RunSpec(run_id="r1")
    spec2 = RunSpec(
        run_id="run-7",
        replicas=4,
        stages=3,
        model=ModelSpec(n_layers=6),
        sync=SyncSpec(method="diloco", aggregation="mean"),
        pipeline=PipelineSpec(link_k=[32, 64], wire_dtype="bfloat16"),
    )
    advert = dict(peer_id=me, version="0.1.0", device="cpu", memory_gb=16.0, tflops=1.5, price_per_hour=0.5)
    advert |= dict(host="127.0.0.1", port=4000, health_port=4001, timestamp=NOW)
    return {
        "NodeAdvert": [
            NodeAdvert(**advert),
            NodeAdvert(
                **advert,
                peer_mbps={other: 940.0},
                peer_rtt_ms={other: 0.4},
                state="training",
                run_id="r1",
                replica=1,
                stage=0,
                epoch=3,
                step=120,
                loss=math.nan,
                val_bpb=1.25,
                bytes_pipe=10**9,
            ),
            NodeAdvert(**advert, state="failed", error="worker died: ValueError: bad train.data"),
        ],
        "RunRecord": [
            RunRecord(spec=spec),
            RunRecord(spec=spec2, state="running", term=4, coordinator=me, updated=NOW),
        ],
        "Assignment": [
            Assignment(
                run_id="r1",
                term=2,
                epoch=5,
                peer_id=me,
                replica=1,
                stage=0,
                layers=[0, 2],
                spec=spec,
                next=Endpoint(peer_id=other, host="10.0.0.2", port=4100),
                stage_peers={"0": other, "1": me},
                issued_at=NOW,
            ),
            Assignment(
                run_id="run-7",
                term=1,
                epoch=1,
                peer_id=me,
                replica=3,
                stage=2,
                layers=[4, 6],
                spec=spec2,
                prev=Endpoint(peer_id=other, host="::1", port=1),
                start_step=-1,
            ),
            Assignment(run_id="r1", term=9, epoch=9, peer_id=me, replica=-1, stage=-1, layers=[], spec=spec),
        ],  # fmt: skip
        "Lease": [Lease(run_id="r1", term=3, holder=me, expires_at=NOW + 30)],
        "RunControl": [RunControl(run_id="r1", action="stop", issued_at=NOW)],
        "Hello": [
            Hello(
                run_id="r1", term=2, epoch=5, replica=1, stage=1, peer_id=me, to_peer_id=other, sent_at=NOW
            ),
            Hello(run_id="run-7", term=0, epoch=0, replica=0, stage=0, peer_id=me, start_step=40),
        ],
    }


_EXP_OF = {"NodeAdvert": NOW + 30, "RunRecord": NOW + 60, "Assignment": NOW + 60}
"""Kinds published in the DHT carry a signed expiry; the others travel in the store or on a link."""
_TRUSTED = {"RunRecord", "Assignment", "Lease", "RunControl"}
"""Kinds their readers open with a trust root (the operator or coordinator key)."""


class EnvelopeTarget(Target):
    """`open_envelope(data, cls, trusted)` for one message kind (SchemaError, VersionError, UntrustedSigner:
    ProtocolError; SignatureError: a ValueError)."""

    documented = (ProtocolError, SignatureError)

    def __init__(self, kind: str, *, more: dict[str, list[Any]] | None = None) -> None:
        import protocol.messages as messages

        self.name, self.cls = f"envelope:{kind}", getattr(messages, kind)
        owner = _identity("owner")
        all_bodies = _messages() | (more or {})
        self._seeds = [envelope_seed(owner, body, _EXP_OF.get(kind)) for body in all_bodies[kind]]
        self.trusted = {owner.public_key} if kind in _TRUSTED else None
        # splice and swap material: every kind's seeds, so a field may come from another message
        self.wires = [envelope_seed(owner, b).wire for bodies in all_bodies.values() for b in bodies]
        self.pool = [v for s in self._seeds for v in _values(s.body, [])]

    def seeds(self) -> list[Any]:
        return [s.wire for s in self._seeds]

    def generate(self, rng: random.Random) -> bytes:
        return mutated_envelope(rng.choice(self._seeds), rng, self.wires, self.pool)

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> bytes:
        """A signed envelope whose payload is the fill (the envelope itself is one map of 6 scalars)."""
        from protocol.envelope import MAX_ENVELOPE_BYTES, seal_payload

        seed = self._seeds[0]
        size = min(nbytes, MAX_ENVELOPE_BYTES) - 200  # room for the envelope's own fields
        return seal_payload(seed.identity, seed.kind, fill(size), expires_at=seed.exp)

    def decode(self, x: bytes) -> str:
        from protocol.envelope import open_envelope

        open_envelope(x, self.cls, self.trusted)
        return "ok"


class _StreamSocket:
    """A connected socket stand-in: recv_into hands out the stream in pieces of random size, as TCP may."""

    def __init__(self, data: bytes, rng: random.Random) -> None:
        self.data, self.at, self.rng = data, 0, rng

    def recv_into(self, view: memoryview, n: int) -> int:
        k = min(n, len(self.data) - self.at, self.rng.choice((1, 3, 7, 64, 4096, 1 << 30)))
        view[:k] = self.data[self.at : self.at + k]
        self.at += k
        return k


class FrameTarget(Target):
    """`recv_frame(sock)` until the stream ends, at the transport's default limit (FrameError: ProtocolError;
    ConnectionClosed at a clean end of stream)."""

    name = "frame"

    def __init__(self) -> None:
        from protocol.framing import DEFAULT_MAX_FRAME_BYTES, ConnectionClosed, encode_frame

        self.documented = (ProtocolError, ConnectionClosed)
        self.max_bytes = DEFAULT_MAX_FRAME_BYTES
        hello = envelope_seed(_identity("owner"), _messages()["Hello"][0]).wire
        rng = random.Random(0)
        act = bytes(rng.getrandbits(8) for _ in range(1024))
        streams = [[hello], [hello, act, act[:100]], [b""], [act * 8, b"\x00"]]
        self._seeds = []
        for frames in streams:
            wire, fields = b"", []
            for f in frames:
                fields.append(Field(len(wire), 4, "big"))
                wire += encode_frame(f)
            self._seeds.append((wire, fields))
        self.wires = [w for w, _ in self._seeds]

    def seeds(self) -> list[Any]:
        return [(w, 0) for w in self.wires]

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> tuple[bytes, int]:
        """One whole frame of the fill (the transport reads bytes; it parses no msgpack)."""
        from protocol.framing import encode_frame

        return encode_frame(fill(min(nbytes, self.max_bytes))), 0

    def generate(self, rng: random.Random) -> tuple[bytes, int]:
        wire, fields = rng.choice(self._seeds)
        return mutate_bytes(wire, rng, fields=fields, others=self.wires), rng.getrandbits(32)

    def decode(self, x: tuple[bytes, int]) -> str:
        from protocol.framing import ConnectionClosed, recv_frame

        sock = _StreamSocket(x[0], random.Random(x[1]))
        frames = 0
        while True:
            try:
                recv_frame(sock, self.max_bytes)  # type: ignore[arg-type]
            except ConnectionClosed:
                return "ok" if frames else "no frame"
            frames += 1


class SparseLoCoTarget(Target):
    """`decode_fragment` (FragmentError and subclasses: ProtocolError). With `expect`, it decodes as the node
    does (node/sync/sparseloco_sync.py: the slot's signer trusted, the expected header, max_params = the stage's
    size) and decompresses what it accepts."""

    _SHAPES: tuple[object, ...] = (
        [[2**39, 2**39]], [[2**15, 2**15]], [[1 << 20, 64]], [[1]] * 4000, [[4096] * 8], [[1] * 9],
        [[0, 5]], [[-1, 5]], [[64, 64], [64]], [[5, 7, 3]], [], [[2**30]],
    )  # fmt: skip

    def __init__(self, *, expect: bool) -> None:
        import torch

        from protocol.codecs import sparseloco_format as fmt
        from protocol.codecs.sparseloco import SparseLoCoConfig, compress

        self.name = "sparseloco_expect" if expect else "sparseloco"
        self.expect, self.fmt = expect, fmt
        self.identity = _identity("owner")
        g = torch.Generator().manual_seed(0)
        cases = [
            ([(64, 64), (64,)], SparseLoCoConfig()),
            ([(100, 37), (300,), (5, 7, 3)], SparseLoCoConfig(chunk=256, k=8, value_bits=4, dense_1d=False)),
            ([(1,), (128, 96)], SparseLoCoConfig(chunk=64, k=4, value_bits=1)),
            ([(2, 2), (3,)], SparseLoCoConfig(chunk=4, k=4, value_bits=3)),
        ]
        self._seeds = []
        for i, (shapes, cfg) in enumerate(cases):
            cf = compress([torch.randn(s, generator=g) for s in shapes], cfg)
            header = fmt.FragmentHeader.of(
                cf, run_id="r1", stage=1, fragment=i, round=7, replica=2, tokens=4096
            )
            payload = fmt.pack_payload(cf)
            h = pack(to_dict(header))
            self._seeds.append((header, h, payload, self._frame(h, payload)))
        self.wires = [s[3] for s in self._seeds]
        self.headers = [msgpack.unpackb(s[1], raw=False) for s in self._seeds]
        self.pool = [v for hd in self.headers for v in _values(hd, [])] + list(self._SHAPES)

    def _frame(self, h: bytes, payload: bytes, version: int = 1, magic: bytes = b"CRSL") -> bytes:
        """The signed frame (sparseloco_format's docstring), built by hand so any header bytes can be signed."""
        fmt = self.fmt
        body = b"".join(
            [struct.pack("<4sBI", magic, version, len(h)), h, struct.pack("<I", len(payload)), payload]
        )
        body += self.identity.public_key
        return body + self.identity.sign(fmt._DOMAIN + body)

    def seeds(self) -> list[Any]:
        return [(w, i) for i, w in enumerate(self.wires)]

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> tuple[bytes, int]:
        """A signed frame whose header is the fill (the header is parsed before `expect` is checked)."""
        return self._frame(fill(min(nbytes, self.fmt.MAX_HEADER_BYTES)), self._seeds[0][2]), 0

    def generate(self, rng: random.Random) -> tuple[bytes, int]:
        i = rng.randrange(len(self._seeds))
        _, h, payload, wire = self._seeds[i]
        mode = rng.random()
        if mode < 0.25:
            p_at = 9 + len(h)
            fields = [Field(4, 1), Field(5, 4), Field(p_at, 4), Field(p_at + 4, 2), Field(p_at + 6, 4)]
            return mutate_bytes(wire, rng, fields=fields, others=self.wires), i
        if mode < (0.4 if self.expect else 0.55):  # a hostile header, signed
            hd = mutate_obj(self.headers[i], rng, self.pool)
            if rng.random() < 0.5:  # room for the chunks the new shapes claim (up to 64 KiB)
                payload += bytes(rng.choice((0, 1, 2, 255)) for _ in range(rng.choice((1, 64)))) * rng.choice(
                    (1, 16, 1024)
                )
            h = pack(hd) if rng.random() < 0.9 else mutate_bytes(pack(hd), rng)
        else:  # a hostile payload under the valid header, signed: the Golomb and section parsers
            others = [s[2] for s in self._seeds]
            payload = mutate_bytes(payload, rng, fields=[Field(0, 2), Field(2, 4)], others=others)
        version, magic = (1, b"CRSL") if rng.random() < 0.95 else (rng.choice((0, 2, 255)), b"CRSX")
        return self._frame(h, payload, version, magic), i

    def decode(self, x: tuple[bytes, int]) -> str:
        import numpy as np

        from protocol.codecs.sparseloco import decompress

        data, i = x
        if not self.expect:
            self.fmt.decode_fragment(data)
            return "ok"
        header = self._seeds[i][0]
        numel = sum(math.prod(s) for s in header.shapes)
        _, cf, _ = self.fmt.decode_fragment(
            data, trusted={self.identity.public_key}, expect=header, max_params=max(numel, 1)
        )
        with np.errstate(over="ignore"):  # scale x table may overflow: counted, not warned about
            finite = all(bool(t.isfinite().all()) for t in decompress(cf))
        return "ok" if finite else "ok, decompressed to non-finite values"


class DenseTarget(Target):
    """`decode_dense(data, header, shapes, signer)` (open_envelope's errors; DenseFragmentError)."""

    name = "dense"
    documented = (ProtocolError, SignatureError)

    def __init__(self) -> None:
        import torch

        from protocol.codecs.dense_fragment import DenseFragment, encode_dense

        self.identity = _identity("owner")
        self.header = {"run_id": "r1", "stage": 0, "fragment": 1, "round": 3, "replica": 1}
        g = torch.Generator().manual_seed(1)
        cases = [[(4, 4), (4,)], [(3, 5, 2)], [(1,)], []]
        self._seeds = []
        for shapes in cases:
            tensors = [torch.randn(s, generator=g) for s in shapes]
            wire = encode_dense(self.identity, self.header, tensors, 4096)
            flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
            body = DenseFragment(
                shapes=[list(s) for s in shapes],
                data=flat.numpy().astype("<f4").tobytes(),
                tokens=4096,
                **self.header,
            )
            seed = EnvelopeSeed(self.identity, "DenseFragment", to_dict(body), None, wire)
            self._seeds.append((seed, [torch.Size(s) for s in shapes]))
        self.wires = [s.wire for s, _ in self._seeds]
        self.pool = [v for s, _ in self._seeds for v in _values(s.body, [])]

    def seeds(self) -> list[Any]:
        return [(w, i) for i, w in enumerate(self.wires)]

    def generate(self, rng: random.Random) -> tuple[bytes, int]:
        i = rng.randrange(len(self._seeds))
        seed = self._seeds[i][0]
        if rng.random() < 0.25:  # values edited in place (NaN, inf, another length), re-signed
            body = dict(seed.body, data=mutate_bytes(seed.body["data"], rng))
            seed = dataclasses.replace(seed, body=body)
            return mutated_envelope(seed, rng, [], []) if rng.random() < 0.2 else self._resign(seed), i
        return mutated_envelope(seed, rng, self.wires, self.pool), i

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> tuple[bytes, int]:
        """A fragment signed by the expected signer whose payload (the fragment's body) is the fill."""
        from protocol.codecs.dense_fragment import MAX_DENSE_FRAGMENT_BYTES
        from protocol.envelope import seal_payload

        size = min(nbytes, MAX_DENSE_FRAGMENT_BYTES) - 200
        return seal_payload(self.identity, "DenseFragment", fill(size)), 0

    def _resign(self, seed: EnvelopeSeed) -> bytes:
        from protocol.envelope import seal_payload

        return seal_payload(seed.identity, seed.kind, pack(seed.body))

    def decode(self, x: tuple[bytes, int]) -> str:
        from protocol.codecs.dense_fragment import decode_dense

        data, i = x
        decode_dense(data, self.header, self._seeds[i][1], self.identity.peer_id)
        return "ok"


class SubspaceTarget(Target):
    """`ActivationCodec.decode(data, b=..., kinds=...)` as a link's receiver calls it (ActivationCodecError:
    ProtocolError). Unsigned: every byte comes from the peer."""

    name = "subspace"

    def __init__(self) -> None:
        import torch

        from protocol.codecs.subspace import ActivationCodec, Kind

        g = torch.Generator().manual_seed(2)
        cases = [  # codec, kind, b, decode's b and kinds
            (ActivationCodec(d=16, k=4, vocab=256, seq_len=8), Kind.FORWARD, 2, None, (Kind.FORWARD, Kind.EVAL)),
            (ActivationCodec(d=16, k=4, vocab=256, seq_len=8), Kind.BACKWARD, 2, 2, (Kind.BACKWARD,)),
            (ActivationCodec(d=32, k=32, vocab=300, seq_len=4, wire_dtype="bfloat16"), Kind.EVAL, 3, None, None),
            (ActivationCodec(d=8, k=2, vocab=70_000, seq_len=3, wire_dtype="float16"), Kind.FORWARD, 1, 1, None),
        ]  # fmt: skip
        self._seeds = []
        for codec, kind, b, want_b, kinds in cases:
            Z = torch.randn(b, codec.seq_len, codec.k, generator=g)
            tokens = None
            if kind != Kind.BACKWARD:
                tokens = torch.randint(0, codec.vocab, (b, codec.seq_len + 1), generator=g)
            wire = codec.encode(kind, microbatch=5, step=11, Z=Z, tokens=tokens)
            self._seeds.append((codec, wire, want_b, kinds))
        self.wires = [s[1] for s in self._seeds]
        self.fields = [Field(o, n) for o, n in ((4, 1), (5, 1), (6, 1), (7, 1), (8, 4), (12, 8))]
        self.fields += [Field(o, 4) for o in (20, 24, 28)]

    def seeds(self) -> list[Any]:
        return [(w, i) for i, w in enumerate(self.wires)]

    def generate(self, rng: random.Random) -> tuple[bytes, int]:
        i = rng.randrange(len(self._seeds))
        wire = self._seeds[i][1]
        if rng.random() < 0.7:
            return mutate_bytes(wire, rng, fields=self.fields, others=self.wires), i
        # header fields edited and the body resized to match, so the size check passes and the value and
        # token checks run on hostile bytes
        head = bytearray(wire[:32])
        for _ in range(rng.randint(1, 3)):
            head = _edit_field(head, rng, self.fields)
        _, _, kind, dt, tok, _, _, b, L, k = struct.unpack("<4sBBBBIQIII", head)
        size = b * L * k * {1: 4, 2: 2, 3: 2}.get(dt, 4) + (
            0 if kind == 2 else b * (L + 1) * {1: 1, 2: 2}.get(tok, 4)
        )
        if size > 1 << 20:
            return bytes(head) + wire[32:], i
        body = (wire[32:] * (size // max(len(wire) - 32, 1) + 1))[:size]
        return bytes(head) + mutate_bytes(body, rng) if rng.random() < 0.5 else bytes(head) + body, i

    def decode(self, x: tuple[bytes, int]) -> str:
        data, i = x
        codec, _, want_b, kinds = self._seeds[i]
        codec.decode(data, b=want_b, kinds=kinds)
        return "ok"


class ValidatorTarget(Target):
    """`SignedSubkeyValidator.rejection(record)` on DHTRecords (documented: never raises; refuses what it
    cannot tie to a signer). An admitted record must satisfy the module's rules (checked here
    independently); an exception the validator caught internally is counted by type in the outcomes."""

    name = "dht_validator"
    documented = ()
    CAUGHT_OK = frozenset({"SchemaError", "VersionError", "SignatureError"})
    """Errors the validator may catch and turn into a refusal: the protocol's (msgpack's reach it wrapped in
    SchemaError by protocol/msgpack_limits.py)."""

    def __init__(self) -> None:
        from hivemind.dht.validation import DHTRecord

        from protocol import keys
        from protocol.net.dht_validator import LAYOUT, SignedSubkeyValidator, dht_key_id

        self.DHTRecord, self.layout = DHTRecord, LAYOUT
        self.validator = SignedSubkeyValidator(clock=lambda: NOW)
        owner, other = _identity("owner"), _identity("other")
        me, them = owner.peer_id, other.peer_id
        msgs = _messages()
        exp = NOW + 30
        self.keys = [
            dht_key_id(keys.NODES_KEY),
            dht_key_id(keys.RUNS_KEY),
            dht_key_id(keys.assignment_key(me)),
        ]
        self.keys.append(b"key")
        cases = [  # key, subkey, body; signed by the owner with a signed expiry
            (self.keys[0], me, msgs["NodeAdvert"][1]),
            (self.keys[1], f"r1@{me}", msgs["RunRecord"][1]),
            (self.keys[2], me, msgs["Assignment"][0]),
            (self.keys[3], f"x@{me}", msgs["Hello"][0]),
        ]
        self._seeds = [(k, sub, envelope_seed(owner, body, exp)) for k, sub, body in cases]
        # the same envelopes signed by someone else: owner-subkey records carrying a stranger's signature
        self._forged = [envelope_seed(other, body, exp) for _, _, body in cases]
        self.wires = [s.wire for _, _, s in self._seeds] + [s.wire for s in self._forged]
        self.pool = [v for _, _, s in self._seeds for v in _values(s.body, [])]
        self.subkeys: list[object] = [
            me,
            them,
            f"@{me}",
            f"{me}@",
            f"a@{them}",
            me[:-1],
            me + "x",
            f"a@b@{me}",
        ]
        self.subkeys += [me.lower(), "", None, 7, [me], b"", me.encode(), "x" * 300, "@" * 300 + me]
        self.expirations = [math.nan, math.inf, -math.inf, exp, exp + 1e-6, exp - 1, NOW, -1.0, 0.0, 1e308]

    def seeds(self) -> list[Any]:
        return [self.DHTRecord(k, pack(sub), pack(s.wire), s.exp) for k, sub, s in self._seeds]

    def generate(self, rng: random.Random) -> Any:
        key, subkey, seed = rng.choice(self._seeds)
        sub_b, value, expiration = pack(subkey), pack(seed.wire), seed.exp
        for _ in range(rng.choice((1, 1, 2, 3))):
            what = rng.randrange(6)
            if what == 0:
                key = rng.choice((*self.keys, mutate_bytes(key, rng), b""))
            elif what == 1:
                sub_b = pack(rng.choice(self.subkeys))
            elif what == 2:
                sub_b = rng.choice((mutate_bytes(sub_b, rng), msgpack.packb(None), b"", pack(Deep(600))))
            elif what == 3:
                wire = mutated_envelope(rng.choice((seed, *self._forged)), rng, self.wires, self.pool)
                value = pack(wire)
            elif what == 4:
                value = mutate_bytes(value, rng, others=[pack(w) for w in self.wires])
            else:
                expiration = rng.choice(self.expirations)
        return self.DHTRecord(key, sub_b, value, expiration)

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> Any:
        """A record whose value is the fill, at most one hivemind message (4 MiB: the DHT's bound on a value;
        the validator's own limit is an envelope of MAX_ENVELOPE_BYTES)."""
        from hivemind.p2p.p2p_daemon_bindings.control import DEFAULT_MAX_MSG_SIZE

        key, subkey, seed = self._seeds[0]
        return self.DHTRecord(key, pack(subkey), fill(min(nbytes, DEFAULT_MAX_MSG_SIZE)), seed.exp)

    def show(self, x: Any) -> dict[str, Any]:
        return {
            "key": x.key.hex(),
            "subkey": x.subkey[:MAX_HEX].hex(),
            "hex": x.value[:MAX_HEX].hex(),
            "bytes": len(x.value),
            "expiration_time": repr(x.expiration_time),
        }

    def decode(self, x: Any) -> str:
        reason = self.validator.rejection(x)
        if reason is None:
            self._check_admitted(x)
            return "admitted"
        m = re.match(r"unparsable record \((\w+)", reason)
        if m:
            if m.group(1) == "MemoryError":
                raise MemoryError(reason)
            if m.group(1) not in self.CAUGHT_OK:
                raise UndocumentedCaught(reason)
            return f"refused: unparsable ({m.group(1)})"
        return "refused"

    def _check_admitted(self, x: Any) -> None:
        """The module docstring's rules, restated: a subkey naming the signer, no later than signed."""
        from protocol.envelope import verified_header
        from protocol.identity import peer_id_of
        from protocol.net.dht_validator import MAX_RECORD_TTL_S

        subkey = msgpack.unpackb(x.subkey, raw=False)
        header = verified_header(msgpack.unpackb(x.value, raw=False))
        rule = self.layout.get(bytes(x.key))
        owner = subkey.rsplit("@", 1)[-1] if isinstance(subkey, str) else None
        broken = [
            (owner != peer_id_of(header.signer), "the subkey does not name the signer"),
            (header.expires_at is None, "no signed expiry"),
            (
                not x.expiration_time <= (header.expires_at or -math.inf),
                "DHT expiration beyond the signed one",
            ),
            ((header.expires_at or 0) > NOW + MAX_RECORD_TTL_S, "signed expiry too far ahead"),
            (rule is not None and header.kind != rule.kind, "wrong kind under a swarm-wide key"),
        ]
        for bad, why in broken:
            if bad:
                raise WronglyAdmitted(why)


class UndocumentedCaught(Exception):
    """The validator refused a record, but by catching an error outside the ones parsing may raise."""


class WronglyAdmitted(Exception):
    """The validator admitted a record its own rules refuse."""


# ---- objects read from the store (issue 21, acceptance 8) -----------------------------------------------


def noise(rng: random.Random) -> bytes:
    """Random bytes of a random length, sometimes behind a msgpack map's or a JSON list's first byte."""
    body = rng.randbytes(rng.choice((0, 1, 7, 64, 512, 4096)))
    return rng.choice((b"", b"\x85", b"\x86", b"[", b'["')) + body


NOISE = 0.03
"""Share of the store-read targets' inputs that are random bytes rather than a mutated seed."""


def _store_messages() -> dict[str, list[Any]]:
    """Valid bodies of the kinds read from the store: what a node, a coordinator or `export` GETs."""
    from protocol import keys
    from protocol.messages import CheckpointManifest, CheckpointPointer, RecordEntry, RoundRecord, RouteCounts

    me, other = _peer_ids()

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    slot: dict[str, Any] = dict(run_id="r1", stage=1, replica=2, round=7)
    tkey = keys.ckpt_tensors_key("r1", rnd=7, stage=1, replica=2)
    manifests = [
        CheckpointManifest(
            **slot,
            step=1400,
            created_at=NOW,
            tensors_key=tkey,
            tensors_bytes=123_456,
            tensors_sha256=sha("t"),
            meta={"data.position": 987_654_321, "lr": 3e-4, "tokenizer": "gpt2", "seed": -1},
        ),
        CheckpointManifest(
            run_id="run-7",
            stage=0,
            replica=0,
            round=0,
            step=0,
            created_at=NOW,
            tensors_key=keys.ckpt_tensors_key("run-7", rnd=0, stage=0, replica=0),
            tensors_bytes=0,
            tensors_sha256=sha(""),
        ),
    ]
    mkey = keys.ckpt_manifest_key("r1", rnd=7, stage=1, replica=2)
    owner = _identity("owner")
    return {
        # the round record's kind: drop this entry and "envelope:RoundRecord" in DECODERS with the record
        "RoundRecord": [
            RoundRecord(
                run_id="r1",
                stage=1,
                fragment=3,
                round=7,
                entries=[
                    RecordEntry(replica=0, signer=me, digest=sha("a")),
                    RecordEntry(replica=2, signer=other, digest=sha("b")),
                ],
            ),
            RoundRecord(run_id="run-7", stage=0, fragment=0, round=2**40, entries=[]),
        ],
        "CheckpointManifest": manifests,
        # an MoE run's per-step routing counts (node/sync/route_exchange.py)
        "RouteCounts": [
            RouteCounts(
                run_id="r1",
                group=1,
                step=70_000,
                replica=2,
                tokens=2048,
                experts=8,
                layers=[2, 3],
                counts=b"".join(int(v).to_bytes(4, "little") for v in [512] * 16),
            ),
            RouteCounts(
                run_id="run-7", group=0, step=0, replica=0, tokens=0, experts=1, layers=[], counts=b""
            ),
        ],
        "CheckpointPointer": [
            CheckpointPointer(
                **slot,
                manifest_key=mkey,
                manifest_sha256=hashlib.sha256(seal(owner, manifests[0])).hexdigest(),
            ),
            CheckpointPointer(
                run_id="run-7",
                stage=0,
                replica=0,
                round=0,
                manifest_key=keys.ckpt_manifest_key("run-7", rnd=0, stage=0, replica=0),
                manifest_sha256=sha("m"),
            ),
        ],
    }


class StoredEnvelopeTarget(EnvelopeTarget):
    """`open_envelope(data, cls, max_bytes=...)` as a reader of the store opens one kind: within the reader's
    size bound, no trusted set (the reader checks the signer after it, as protocol/checkpoint.py's
    `_check_signer` does). ProtocolError, SignatureError; a few inputs are noise. tests/test_fuzz.py also
    sends checkpoint inputs through `read_checkpoint` on a real store."""

    def __init__(self, name: str, kind: str, max_bytes: int) -> None:
        super().__init__(kind, more=_store_messages())
        self.name, self.max_bytes = name, max_bytes

    def generate(self, rng: random.Random) -> bytes:
        if rng.random() < NOISE:
            return noise(rng)
        return super().generate(rng)

    def flood(self, nbytes: int, fill: Callable[[int], bytes]) -> bytes:
        return super().flood(min(nbytes, self.max_bytes), fill)

    def decode(self, x: bytes) -> str:
        from protocol.envelope import open_envelope

        open_envelope(x, self.cls, max_bytes=self.max_bytes)
        return "ok"


def _checkpoint_target(what: str) -> Target:
    from protocol import checkpoint

    if what == "manifest":
        return StoredEnvelopeTarget(
            "checkpoint:manifest", "CheckpointManifest", checkpoint.MAX_MANIFEST_BYTES
        )
    return StoredEnvelopeTarget("checkpoint:pointer", "CheckpointPointer", checkpoint.MAX_POINTER_BYTES)


class CertificateTarget(Target):
    """`read_certificate(data)` (ProtocolError, SignatureError), then what every reader of a coordinator's
    signed object does with it, `OperatorTrust.delegation` (documented: Untrusted, naming one of REASONS;
    counted by reason). Seeds sealed by the operator; a fifth of the inputs are sealed by a stranger."""

    name = "certificate"
    documented = (ProtocolError, SignatureError)

    def __init__(self) -> None:
        from protocol.messages import MAX_DELEGATION_S, Delegation
        from protocol.trust.delegation import SKEW_S, OperatorTrust

        operator, subject, stranger = _identity("owner"), _identity("other"), _identity("stranger")
        self.trust = OperatorTrust(frozenset({operator.public_key}))
        self.subject = subject.public_key
        bodies = [
            Delegation(subject=subject.peer_id, run="*", issued_at=NOW - 60, expires_at=NOW + 86400),
            Delegation(
                subject=subject.peer_id, run="r1", issued_at=NOW - 1, expires_at=NOW - 1 + MAX_DELEGATION_S
            ),
            Delegation(subject=subject.peer_id, run="r1", issued_at=NOW + SKEW_S - 1, expires_at=NOW + 3600),
        ]
        self._seeds = [envelope_seed(operator, b) for b in bodies]
        self._forged = [envelope_seed(stranger, b) for b in bodies]  # they open; the rule refuses them
        others = [envelope_seed(operator, b).wire for bodies in _messages().values() for b in bodies[:1]]
        self.wires = [s.wire for s in self._seeds + self._forged] + others
        self.pool = [v for s in self._seeds for v in _values(s.body, [])]
        self.pool += [stranger.peer_id, operator.peer_id, "node", "", NOW - SKEW_S, NOW + SKEW_S, NOW + 1e9]

    def seeds(self) -> list[Any]:
        return [s.wire for s in self._seeds]

    def generate(self, rng: random.Random) -> bytes:
        if rng.random() < NOISE:
            return noise(rng)
        seed = rng.choice(self._forged if rng.random() < 0.2 else self._seeds)
        return mutated_envelope(seed, rng, self.wires, self.pool)

    def decode(self, x: bytes) -> str:
        from protocol.trust.delegation import Untrusted, read_certificate

        read_certificate(x)
        try:
            self.trust.delegation(self.subject, x, "r1", NOW)
        except Untrusted as e:
            return f"refused: {e.reason}"
        return "ok"


_DEEP_JSON = re.compile(r'"\\u0000DEEP(\d+)\\u0000"')
_JSON_PIECES = (
    "[", "]", '"', "\\", ",", ":", " ", "\t", "\r", "\r\n", "\x0b", "\x1c", "\x00", "\x7f",
    '"\\ud800"', '"\\u0000"', '"\\"', "1" * 4200, "-0", "1e999", "NaN", "-Infinity", "null", "true",
    '{"a":1}', "[]", "[[[[", "[" * 600 + "]" * 600, "[" * 5000, '["a",1,"' + "0" * 64 + '"]',
)  # fmt: skip
"""Text a hostile manifest splices in: JSON's structure, escapes, numbers json cannot hold, the characters
str.splitlines() breaks a line at, nesting."""
_JSON_SIZES = ("9" * 309, "1" * 4000, str(2**63), str(2**63 - 1), str(2**64), "1e400", "1e3", "-0", "0.0")
"""Sizes json reads as integers or floats beyond a float's range, a file's or msgpack's, or not whole."""


def _json_default(obj: object) -> object:
    if isinstance(obj, Deep):
        return f"\x00DEEP{obj.depth}\x00"
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    raise TypeError(f"cannot dump {type(obj).__name__}")


def dump_json(obj: object, rng: random.Random) -> str:
    """One JSON line of obj, mostly compact and ASCII (the canonical form), sometimes not; `Deep` expanded."""
    sep = (",", ":") if rng.random() < 0.9 else rng.choice(((", ", ": "), (",", ": "), (" ,", ":")))
    text = json.dumps(
        obj, separators=sep, ensure_ascii=rng.random() < 0.97, skipkeys=True, default=_json_default
    )
    return _DEEP_JSON.sub(lambda m: "[" * int(m.group(1)) + "0" + "]" * int(m.group(1)), text)


class CorpusManifestTarget(Target):
    """`parse_manifest(data, where)` as a node reads a corpus's manifest (node/data/corpus_store.py; the
    spec's `train.data_sha256`, when set, is checked before), then the sum of its sizes in GB, as the node's
    disk check makes it: ManifestError, a ValueError, and nothing else. Inputs:
    byte-level mutations, JSON splices, line edits (drop, repeat, swap, move across manifests) and each
    line's list edited as a structure, then written out again, plus noise."""

    name = "corpus_manifest"

    def __init__(self) -> None:
        from protocol.corpus import MAX_NAME_BYTES, ManifestError, ShardEntry, manifest_bytes

        self.documented = (ManifestError,)

        def sha(text: str) -> str:
            return hashlib.sha256(text.encode()).hexdigest()

        cases = [
            [ShardEntry(name="train.txt", size=1234, sha256=sha("a"))],
            [
                ShardEntry(name=f"books/part-{i:04d}.txt", size=10**6 + i, sha256=sha(str(i)))
                for i in range(6)
            ],
            [
                ShardEntry(name="données/été.txt", size=0, sha256=sha("e")),
                ShardEntry(name='a"b/[1]{2},x.txt', size=2**40, sha256=sha("q")),
                ShardEntry(name="z" * MAX_NAME_BYTES, size=7, sha256=sha("z")),
            ],
        ]
        self._seeds = [manifest_bytes(c) for c in cases]
        self.rows = [[json.loads(line) for line in s.decode().splitlines()] for s in self._seeds]
        self.pool = [v for rows in self.rows for v in _values(rows, [])]

    def seeds(self) -> list[Any]:
        return list(self._seeds)

    def generate(self, rng: random.Random) -> bytes:
        i = rng.randrange(len(self._seeds))
        mode = rng.random()
        if mode < NOISE:
            return noise(rng)
        if mode < 0.3:
            return mutate_bytes(self._seeds[i], rng, others=self._seeds)
        rows: list[Any] = _copy(self.rows[i])
        for _ in range(rng.choice((1, 1, 2, 3))):
            op = rng.randrange(9)
            j = rng.randrange(len(rows)) if rows else 0
            if op < 3 and rows and not isinstance(rows[j], _Raw):  # the list edited as a structure
                rows[j] = _Raw(dump_json(mutate_obj(rows[j], rng, self.pool), rng))  # once: it may nest deep
            elif op == 3 and rows:
                del rows[j]
            elif op == 4 and rows:
                rows.insert(j, rows[j] if rng.random() < 0.5 else _copy(rng.choice(rng.choice(self.rows))))
            elif op == 5 and len(rows) > 1:
                k = rng.randrange(len(rows))
                rows[j], rows[k] = rows[k], rows[j]
            elif op == 6:  # raw text in place of a line, or spliced into one
                piece = rng.choice(_JSON_PIECES)
                if rows and rng.random() < 0.5:
                    line = _line(rows[j], rng)
                    at = rng.randrange(len(line) + 1)
                    rows[j] = _Raw(line[:at] + piece + line[at:])
                else:
                    rows.insert(j, _Raw(piece))
            elif op == 7 and rows and not isinstance(rows[j], _Raw):  # a size no float or file holds
                name, _, sha = (rows[j] + [0, 0, 0])[:3]
                size = rng.choice(_JSON_SIZES)
                rows[j] = _Raw(f"[{dump_json(name, rng)},{size},{dump_json(sha, rng)}]")
            else:  # a line nested deep
                depth = rng.choice((1, 31, 600, 5000))
                rows.insert(j, _Raw("[" * depth + (_line(rows[j], rng) if rows else "") + "]" * depth))
        end = "\n" if rng.random() < 0.9 else rng.choice(("\r\n", "", "\n\n", "\x1c"))
        text = "".join(_line(r, rng) + end for r in rows)
        data = text.encode("utf-8", "surrogatepass")
        return mutate_bytes(data, rng) if rng.random() < 0.1 else data

    def decode(self, x: bytes) -> str:
        from protocol.corpus import parse_manifest

        entries = parse_manifest(x, "s3://corpora/books/crucible-manifest.jsonl")
        sum(e.size for e in entries) / 1e9  # what node/data/corpus_store.py's disk check does with them
        return "ok"


@dataclasses.dataclass(frozen=True)
class _Raw:
    """A manifest line written as it is (not dumped as JSON)."""

    text: str


def _line(row: object, rng: random.Random) -> str:
    return row.text if isinstance(row, _Raw) else dump_json(row, rng)


DECODERS: dict[str, Callable[[], Target]] = {
    "frame": FrameTarget,
    **{
        f"envelope:{k}": (lambda k=k: EnvelopeTarget(k))
        for k in ("NodeAdvert", "RunRecord", "Assignment", "Lease", "RunControl", "Hello")
    },
    "sparseloco": lambda: SparseLoCoTarget(expect=False),
    "sparseloco_expect": lambda: SparseLoCoTarget(expect=True),
    "dense": DenseTarget,
    "subspace": SubspaceTarget,
    "dht_validator": ValidatorTarget,
    # read from the store (issue 21)
    "envelope:RoundRecord": lambda: StoredEnvelopeTarget(
        "envelope:RoundRecord", "RoundRecord", MAX_ENVELOPE_BYTES
    ),
    "envelope:RouteCounts": lambda: StoredEnvelopeTarget(
        "envelope:RouteCounts", "RouteCounts", MAX_ROUTE_RECORD_BYTES
    ),
    "checkpoint:manifest": lambda: _checkpoint_target("manifest"),
    "checkpoint:pointer": lambda: _checkpoint_target("pointer"),
    "certificate": CertificateTarget,
    "corpus_manifest": CorpusManifestTarget,
}


# ---- one decoder's loop (in a child process) -----------------------------------------------------------


def input_rng(seed: int, name: str, i: int) -> random.Random:
    """The generator of input i of decoder `name`: inputs are reproducible one by one."""
    return random.Random(f"{seed}/{name}/{i}")


def vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _is_memory_error(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


@dataclasses.dataclass
class Outcome:
    """What decoding one input did."""

    label: str
    """"ok", what refused it (the error type), or the undocumented error's type."""
    seconds: float
    error: BaseException | None = None
    """An undocumented error, or a documented one wrapping a MemoryError."""
    memory_error: bool = False


def decode_one(target: Target, x: Any) -> Outcome:
    """Decode x once, timed; classify what it raised (a documented error that wraps a MemoryError, as
    `except Exception: raise SchemaError(...) from e` does, still counts as a MemoryError). A documented
    error is dropped here: its traceback would keep the decoder's buffers alive past this input."""
    t0 = time.perf_counter()
    try:
        label = target.decode(x)
    except target.documented as e:
        label = type(e).__name__
        cause = e.__cause__ or e.__context__
        while cause is not None and not _is_memory_error(cause):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return Outcome(f"{label} (from {type(cause).__name__})", time.perf_counter() - t0, e, True)
    except Exception as e:
        return Outcome(type(e).__name__, time.perf_counter() - t0, e, _is_memory_error(e))
    return Outcome(label, time.perf_counter() - t0)


def _where(e: BaseException) -> str:
    """The file and line that raised e."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "?"


def _finding(i: int, out: Outcome, target: Target, x: Any) -> dict[str, Any]:
    e = out.error
    assert e is not None
    return {
        "input": i,
        "exception": out.label,
        "message": str(e)[:300],
        "where": _where(e),
        "traceback": "".join(traceback.format_exception(e)[-8:])[-3000:],
        **target.show(x),
    }


def cap_address_space(mem_mb: float | None) -> int:
    """The process's address space now (bytes); with mem_mb, cap it at that + mem_mb MB for good."""
    gc.collect()
    baseline = vm_size_bytes()
    if mem_mb is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (baseline + int(mem_mb * 2**20), hard))
    return baseline


def run_decoder(
    name: str,
    n: int,
    seed: int = 0,
    *,
    mem_mb: float | None = 100,
    progress: Callable[[int], None] | None = None,
    log_every_s: float = 10.0,
) -> dict[str, Any]:
    """Fuzz one decoder with n inputs in this process; with mem_mb, cap the address space first (for good)."""
    target = DECODERS[name]()
    for x in target.seeds():
        outcome = target.decode(x)
        assert outcome in ("ok", "admitted"), f"{name}: a seed decodes as {outcome}"
    for i in range(min(n, 300)):  # warm-up: lazy imports, caches, numpy/torch kernels
        decode_one(target, target.generate(input_rng(seed, name + "/warm-up", i)))
    baseline = cap_address_space(mem_mb)
    outcomes: Counter[str] = Counter()
    findings: dict[tuple[str, str], dict[str, Any]] = {}
    bad, memory_error = 0, False
    slowest, slowest_i = 0.0, -1
    generator_errors, generator_error = 0, ""
    t_start = t_log = time.perf_counter()
    for i in range(n):
        try:
            x = target.generate(input_rng(seed, name, i))
        except Exception:  # a bug of this script, not of the decoder: counted, shown, skipped
            generator_errors += 1
            generator_error = generator_error or traceback.format_exc()[-2000:]
            continue
        if progress:
            progress(i)
        out = decode_one(target, x)
        outcomes[out.label] += 1
        if out.error is not None and (out.memory_error or not isinstance(out.error, target.documented)):
            memory_error |= out.memory_error
            bad += not out.memory_error
            key = (out.label, _where(out.error))
            if key not in findings and len(findings) < MAX_EXAMPLES:
                findings[key] = _finding(i, out, target, x)
        if out.seconds > slowest:
            slowest, slowest_i = out.seconds, i
        if time.perf_counter() - t_log > log_every_s:
            t_log = time.perf_counter()
            rate = (i + 1) / (t_log - t_start)
            print(
                f"fuzz {name}: {i + 1}/{n} ({rate:.0f}/s), {bad} bad, slowest {slowest:.3f} s",
                file=sys.stderr,
            )
    wall = time.perf_counter() - t_start
    return {
        "n": n,
        "bad_exceptions": bad,
        "slowest_s": round(slowest, 6),
        "slowest_input": slowest_i,
        "memory_error": memory_error,
        "inputs_per_s": round(n / wall, 1) if wall > 0 else None,
        "baseline_vm_mb": round(baseline / 2**20, 1),
        "mem_limit_mb": None if mem_mb is None else round(baseline / 2**20 + mem_mb, 1),
        "outcomes": dict(outcomes.most_common()),
        "generator_errors": generator_errors,
        **({"generator_error": generator_error} if generator_error else {}),
        "findings": list(findings.values()),
    }


def run_flood(name: str, mb: float, *, mem_mb: float | None = 100) -> dict[str, Any]:
    """Decode each `FLOODS` input of about `mb` MB (capped at the decoder's own size limit) under the cap:
    its time, outcome, and the most memory the decode held at once (tracemalloc, in a second decode)."""
    target = DECODERS[name]()
    inputs = {fill: target.flood(int(mb * 2**20), make) for fill, make in FLOODS.items()}
    if any(x is None for x in inputs.values()):
        return {"floods": None, "note": "no flood input: the decoder takes an exact size"}
    for s in target.seeds():  # warm-up
        target.decode(s)
    baseline = cap_address_space(mem_mb)
    floods = {}
    for fill, x in inputs.items():
        gc.collect()
        out = decode_one(target, x)
        peak_mb = None
        if not out.memory_error:  # again, to measure what it allocates (tracemalloc slows it down)
            tracemalloc.start()
            decode_one(target, x)
            peak_mb = round(tracemalloc.get_traced_memory()[1] / 2**20, 1)
            tracemalloc.stop()
        floods[fill] = {
            "bytes": len(x[0] if isinstance(x, tuple) else x if isinstance(x, bytes) else x.value),
            "seconds": round(out.seconds, 3),
            "memory_error": out.memory_error,
            "bad_exception": not out.memory_error
            and out.error is not None
            and not isinstance(out.error, target.documented),
            "outcome": out.label,
            "peak_alloc_mb": peak_mb,
        }
    return {"floods": floods, "mem_limit_mb": None if mem_mb is None else round(baseline / 2**20 + mem_mb, 1)}


def _child_main(args: argparse.Namespace) -> int:
    mm = mmap.mmap(os.open(args.progress_file, os.O_RDWR), 8) if args.progress_file else None

    def progress(i: int) -> None:
        if mm is not None:
            struct.pack_into("<q", mm, 0, i)

    if "torch" in sys.modules:  # one thread: no thread pool appears after the baseline is measured
        sys.modules["torch"].set_num_threads(1)
    if args.flood is not None:
        result = run_flood(args.child, args.flood, mem_mb=args.mem_mb)
    else:
        result = run_decoder(args.child, args.n, args.seed, mem_mb=args.mem_mb, progress=progress)
    line = json.dumps(result)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(line)
    else:
        print(line, flush=True)
    return 0


# ---- parent: one child per decoder -----------------------------------------------------------------------


def _start_child(
    name: str, n: int, seed: int, mem_mb: float, flood_mb: float | None, tmp: str
) -> subprocess.Popen[bytes]:
    progress = os.path.join(tmp, f"{name.replace(':', '-')}.progress")
    with open(progress, "wb") as f:
        f.write(struct.pack("<q", -1))
    cmd = [sys.executable, "-m", "scripts.fuzz", "--child", name, "--n", str(n), "--seed", str(seed)]
    cmd += ["--mem-mb", str(mem_mb), "--progress-file", progress, "--result-file", progress + ".json"]
    cmd += [] if flood_mb is None else ["--flood", str(flood_mb)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    what = f"{n} inputs" if flood_mb is None else f"floods of {flood_mb:g} MB"
    print(f"fuzz {name}: started ({what})", file=sys.stderr)
    return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL)


def _child_result(name: str, proc: subprocess.Popen[bytes], n: int, tmp: str) -> dict[str, Any]:
    progress = os.path.join(tmp, f"{name.replace(':', '-')}.progress")
    if proc.returncode == 0 and os.path.exists(progress + ".json"):
        with open(progress + ".json") as f:
            return json.load(f)
    with open(progress, "rb") as f:  # the child died (a signal, an abort) or timed out: on which input
        (last,) = struct.unpack("<q", f.read(8))
    crash = f"child exit status {proc.returncode} on input {last}"
    return {
        "n": n,
        "bad_exceptions": 1,
        "slowest_s": None,
        "memory_error": False,
        "inputs_per_s": None,
        "crashed": crash,
        "findings": [{"input": last, "exception": crash}],
    }


def fuzz(
    decoders: Sequence[str],
    n: int,
    seed: int = 0,
    *,
    jobs: int = 2,
    mem_mb: float = 100,
    timeout_s: float = 3600,
    flood_mb: float | None = None,
) -> dict[str, Any]:
    """Run each decoder's loop (or, with flood_mb, its flood probe) in its own child process, at most `jobs`
    at a time; per-decoder results."""
    pending, results = list(decoders), {}
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    with tempfile.TemporaryDirectory(prefix="crucible-fuzz-") as tmp:
        try:
            while pending or running:
                while pending and len(running) < jobs:
                    name = pending.pop(0)
                    running[name] = (_start_child(name, n, seed, mem_mb, flood_mb, tmp), time.monotonic())
                time.sleep(0.1)
                for name, (proc, t0) in list(running.items()):
                    if proc.poll() is None:
                        if time.monotonic() - t0 < timeout_s:
                            continue
                        proc.kill()
                        proc.wait()
                    del running[name]
                    r = results[name] = _child_result(name, proc, n, tmp)
                    print(f"fuzz {name}: done, {json.dumps(r)[:300]}", file=sys.stderr)
        finally:
            for proc, _ in running.values():  # interrupted: leave no child behind
                proc.kill()
                proc.wait()
    return {name: results[name] for name in decoders}


def _repro(name: str, i: int, seed: int) -> int:
    target = DECODERS[name]()
    x = target.generate(input_rng(seed, name, i))
    print(json.dumps(target.show(x)), file=sys.stderr)
    t0 = time.perf_counter()
    try:
        print(f"outcome: {target.decode(x)}", file=sys.stderr)
    except target.documented as e:
        print(f"refused ({type(e).__name__}): {e}", file=sys.stderr)
    finally:
        print(f"decode took {time.perf_counter() - t0:.4f} s", file=sys.stderr)
    return 0


def _clean(r: dict[str, Any]) -> bool:
    if "crashed" in r or r.get("memory_error"):
        return False
    if "floods" in r:
        floods = (r["floods"] or {}).values()
        return all(not f["memory_error"] and not f["bad_exception"] and f["seconds"] < SLOW_S for f in floods)
    return r["bad_exceptions"] == 0 and r["generator_errors"] == 0 and r["slowest_s"] < SLOW_S


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--check: the decoder names (of --decoders or --repro) as a run reads them, one JSON line; the
    targets are not built (the children build them; sparseloco's takes seconds)."""
    if args.repro:
        names = [args.repro[0]]
        if not args.repro[1].isdigit():
            p.error(f"--repro {args.repro[0]} {args.repro[1]}: INDEX must be a number (example: 1234)")
    elif args.list or args.decoders == "all":
        names = list(DECODERS)
    else:
        names = [d.strip() for d in args.decoders.split(",")]
    unknown = [d for d in names if d not in DECODERS]
    if unknown:
        p.error(f"unknown decoder(s) {unknown}; choose from {list(DECODERS)}")
    print(
        json.dumps({"check": "ok", "bench": "fuzz", "decoders": names, "n": args.n, "flood_mb": args.flood})
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100_000, help="inputs per decoder (default 100000)")
    p.add_argument(
        "--decoders",
        default="all",
        help="comma-separated names from --list (default all), e.g. frame,subspace",
    )
    p.add_argument("--seed", type=int, default=0, help="fuzzing seed: same seed, same inputs (default 0)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="decoders fuzzed at once")
    p.add_argument("--mem-mb", type=float, default=100, help="address space allowed above the baseline (MB)")
    p.add_argument("--timeout-s", type=float, default=3600, help="per-decoder wall-clock limit")
    p.add_argument(
        "--flood",
        type=float,
        metavar="MB",
        help="instead of fuzzing, decode a few inputs of MB megabytes (at most the decoder's own limit) of "
        "msgpack that unpacks worst (empty arrays, short strings, huge declared lengths) under the cap, "
        "e.g. --flood 16",
    )
    p.add_argument("--list", action="store_true", help="list the decoders and their documented errors")
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the flags and decoder names, print one JSON line, fuzz nothing",
    )
    p.add_argument("--repro", nargs=2, metavar=("DECODER", "INDEX"), help="rebuild and decode one input")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--progress-file", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child_main(args)
    if args.check:
        return _check(p, args)
    if args.list:
        for name, make in DECODERS.items():
            t = make()
            print(f"{name:22s} {', '.join(e.__name__ for e in t.documented) or 'never raises'}")
        return 0
    if args.repro:
        return _repro(args.repro[0], int(args.repro[1]), args.seed)
    names = list(DECODERS) if args.decoders == "all" else [d.strip() for d in args.decoders.split(",")]
    unknown = [d for d in names if d not in DECODERS]
    if unknown:
        p.error(f"unknown decoder(s) {unknown}; choose from {list(DECODERS)}")
    t0 = time.perf_counter()
    jobs = max(1, args.jobs)
    results = fuzz(
        names, args.n, args.seed, jobs=jobs, mem_mb=args.mem_mb, timeout_s=args.timeout_s, flood_mb=args.flood
    )
    clean = all(_clean(r) for r in results.values())
    summary = {"seed": args.seed, "mem_mb": args.mem_mb, "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps({"decoders": results, **summary, "clean": clean}))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())

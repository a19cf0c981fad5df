"""Checkpoints (issue 11): safetensors + signed manifest + signed LATEST, against a real S3 server (moto).

Every fault is made in the store on purpose (a truncated or swapped object, a manifest or pointer signed by
the wrong key or altered), and the reader must refuse it with a reason naming the problem and resume from
the previous checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import torch
from safetensors import safe_open

from protocol import keys
from protocol.checkpoint import (
    CheckpointMissing,
    CheckpointRefused,
    Refusal,
    list_rounds,
    read_checkpoint,
    read_round,
    write_checkpoint,
)
from protocol.envelope import open_envelope, seal
from protocol.identity import Identity
from protocol.messages import CheckpointManifest, CheckpointPointer
from protocol.net.store import MIN_PART_BYTES, ObjectChanged, ObjectStore, StoreConfig

STAGE = 1


@pytest.fixture(scope="module")
def store(moto_store: str) -> ObjectStore:
    s = ObjectStore(StoreConfig(endpoint_url=moto_store, bucket="checkpoints"))
    s.ensure_bucket()
    return s


@pytest.fixture
def run_id() -> str:
    return f"ckpt-{uuid.uuid4().hex[:12]}"


WRITER = Identity.from_seed(b"w" * 32)
ATTACKER = Identity.from_seed(b"a" * 32)
TRUSTED = {WRITER.public_key}


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    """Every kind of tensor a stage checkpoint holds, plus the awkward ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 16, generator=g)
    return {
        "model.w": w,
        "model.w_t": w.t(),  # non-contiguous, and shares w's memory (tied weights)
        "model.bf16": torch.randn(3, 33, generator=g).to(torch.bfloat16),
        "anchor.0": torch.randn(5, generator=g, dtype=torch.float64),
        "ef.0.0": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]),  # bits, not just values
        "optim.step": torch.tensor(12_345_678_901, dtype=torch.int64),  # 0-d
        "optim.empty": torch.empty(0, 3),
        "optim.mask": torch.tensor([True, False, True]),
        "model.idx": torch.randint(-(2**62), 2**62, (7,), generator=g, dtype=torch.int64),
    }


def _assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape, g.device.type) == (w.dtype, w.shape, "cpu"), name
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)), (
            f"{name} differs"
        )


def _write(store: ObjectStore, run_id: str, rnd: int, *, replica: int = 0, who: Identity = WRITER) -> None:
    write_checkpoint(
        store,
        who,
        run_id=run_id,
        stage=STAGE,
        replica=replica,
        round=rnd,
        step=100 * rnd,
        tensors=_mixed(rnd + 10 * replica),
        meta={"data_pos": 4096 * rnd, "lr": 3e-4, "shard": f"train-{rnd:03d}"},
    )


def _read(store: ObjectStore, run_id: str, **kw: Any) -> tuple[int | None, list[Refusal]]:
    refused: list[Refusal] = []
    ckpt = read_checkpoint(
        store, run_id=run_id, stage=STAGE, replica=0, trusted=TRUSTED, refused=refused, **kw
    )
    return (None if ckpt is None else ckpt.round), refused


# --- 1: round trip -------------------------------------------------------------------------------


def test_round_trip_is_bit_identical_with_meta(store: ObjectStore, run_id: str) -> None:
    tensors = _mixed(7)
    meta: dict[str, int | float | str] = {
        "data_pos": 123_456_789_012,
        "lr": 2.5e-4,
        "shard": "fineweb/000017",
    }
    up_before = store.bytes_up
    manifest = write_checkpoint(
        store, WRITER, run_id=run_id, stage=STAGE, replica=0, round=3, step=300, tensors=tensors, meta=meta
    )
    assert store.bytes_up - up_before > manifest.tensors_bytes  # the tensors object and two envelopes
    assert list_rounds(store, run_id) == [3]

    refused: list[Refusal] = []
    ckpt = read_checkpoint(store, run_id=run_id, stage=STAGE, replica=0, trusted=TRUSTED, refused=refused)
    assert ckpt is not None and refused == []
    assert (ckpt.round, ckpt.step, ckpt.meta, ckpt.signer) == (3, 300, meta, WRITER.public_key)
    assert type(ckpt.meta["data_pos"]) is int and type(ckpt.meta["lr"]) is float
    assert ckpt.manifest == manifest
    _assert_bit_identical(ckpt.tensors, tensors)

    # the stored object is a plain safetensors file whose sha256 the manifest holds
    blob = store.get(manifest.tensors_key)
    assert blob is not None and hashlib.sha256(blob).hexdigest() == manifest.tensors_sha256
    assert len(blob) == manifest.tensors_bytes
    # the LATEST pointer names this manifest by hash
    pointer_blob = store.get(keys.ckpt_pointer_key(run_id, stage=STAGE, replica=0))
    manifest_blob = store.get(keys.ckpt_manifest_key(run_id, rnd=3, stage=STAGE, replica=0))
    assert pointer_blob is not None and manifest_blob is not None
    pointer = open_envelope(pointer_blob, CheckpointPointer, TRUSTED).body
    assert (pointer.round, pointer.manifest_sha256) == (3, hashlib.sha256(manifest_blob).hexdigest())

    exact = read_round(store, run_id=run_id, stage=STAGE, replica=0, round=3, trusted=TRUSTED)
    _assert_bit_identical(exact.tensors, tensors)
    with pytest.raises(CheckpointMissing):
        read_round(store, run_id=run_id, stage=STAGE, replica=1, round=3, trusted=TRUSTED)


def test_safetensors_file_says_which_checkpoint_it_is(
    store: ObjectStore, run_id: str, tmp_path: Path
) -> None:
    _write(store, run_id, 2)
    blob = store.get(keys.ckpt_tensors_key(run_id, rnd=2, stage=STAGE, replica=0))
    assert blob is not None
    (tmp_path / "t.safetensors").write_bytes(blob)
    with safe_open(tmp_path / "t.safetensors", framework="pt") as f:
        md = f.metadata()
    assert md["crucible.run_id"] == run_id and (md["crucible.stage"], md["crucible.round"]) == ("1", "2")


def test_no_checkpoint_is_none(store: ObjectStore, run_id: str) -> None:
    assert _read(store, run_id) == (None, [])


def test_a_given_round_is_read_and_newer_ones_ignored(store: ObjectStore, run_id: str) -> None:
    for r in (1, 2, 4):
        _write(store, run_id, r)
    assert list_rounds(store, run_id) == [1, 2, 4]
    assert _read(store, run_id) == (4, [])
    assert _read(store, run_id, round=2) == (2, [])
    rnd, refused = _read(store, run_id, round=3)  # nothing at 3: named, so reported, then 2
    assert rnd == 2 and len(refused) == 1 and "no manifest" in refused[0].reason


def test_an_older_pointer_put_back_does_not_turn_the_run_back(store: ObjectStore, run_id: str) -> None:
    _write(store, run_id, 1)
    old_pointer = _get(store, _pkey(run_id))  # validly signed, names round 1
    _write(store, run_id, 2)
    store.put(_pkey(run_id), old_pointer)  # replayed by someone with store write access
    assert _read(store, run_id) == (2, [])
    # a newer round that does not verify is refused, and the pointer's round is used
    store.put(_tkey(run_id), b"x" * 10)
    rnd, refused = _read(store, run_id)
    assert rnd == 1 and len(refused) == 1 and "holds" in refused[0].reason


def test_bad_arguments_write_nothing(store: ObjectStore, run_id: str) -> None:
    _write(store, run_id, 1)
    bad: list[dict[str, object]] = [
        {"meta": {f"k{i}": i for i in range(65)}},
        {"meta": {"flag": True}},
        {"meta": {"x": float("nan")}},
        {"meta": {"": 1}},
        {"tensors": {"model.w": [1.0, 2.0]}},
        {"part_bytes": MIN_PART_BYTES - 1},
        {"step": -1},
    ]
    for override in bad:
        args: dict[str, Any] = {"run_id": run_id, "stage": STAGE, "replica": 0, "round": 2, "step": 200}
        args |= {"tensors": _mixed(2), "meta": {}} | override
        with pytest.raises(ValueError):
            write_checkpoint(store, WRITER, **args)
    assert list_rounds(store, run_id) == [1]
    assert _read(store, run_id) == (1, [])


# --- 2: refused checkpoints fall back to the previous one ---------------------------------------


@dataclass(frozen=True)
class Fault:
    name: str
    make: Callable[[ObjectStore, str], None]
    """Damages round 2 (rounds 1 and 2 of replica 0 and round 2 of replica 1 written validly before)."""
    used: int
    """The round the reader must resume from."""
    reasons: tuple[str, ...]
    """A phrase each refusal's reason must hold, in order."""


def _tkey(run: str, rnd: int = 2, replica: int = 0) -> str:
    return keys.ckpt_tensors_key(run, rnd=rnd, stage=STAGE, replica=replica)


def _mkey(run: str, rnd: int = 2, replica: int = 0) -> str:
    return keys.ckpt_manifest_key(run, rnd=rnd, stage=STAGE, replica=replica)


def _pkey(run: str, replica: int = 0) -> str:
    return keys.ckpt_pointer_key(run, stage=STAGE, replica=replica)


def _get(store: ObjectStore, key: str) -> bytes:
    data = store.get(key)
    assert data is not None, key
    return data


def _truncate(store: ObjectStore, run: str) -> None:
    store.put(_tkey(run), _get(store, _tkey(run))[:-100])


def _swap_tensors(store: ObjectStore, run: str) -> None:
    """Another valid safetensors file of the very same size: only the hash tells them apart."""
    other = _get(store, _tkey(run, replica=1))
    assert len(other) == len(_get(store, _tkey(run)))
    store.put(_tkey(run), other)


def _manifest_by_attacker(store: ObjectStore, run: str) -> None:
    body = open_envelope(_get(store, _mkey(run)), CheckpointManifest, TRUSTED).body
    store.put(_mkey(run), seal(ATTACKER, body))


def _manifest_bit_flipped(store: ObjectStore, run: str) -> None:
    blob = _get(store, _mkey(run))
    body = open_envelope(blob, CheckpointManifest, TRUSTED).body
    i = blob.index(body.tensors_sha256.encode())
    flipped = bytearray(blob)
    flipped[i] ^= 0x01  # one hex digit of the digest: still a well-formed manifest, but not the signed one
    store.put(_mkey(run), bytes(flipped))


def _manifest_of_round_1(store: ObjectStore, run: str) -> None:
    store.put(_mkey(run), _get(store, _mkey(run, rnd=1)))


def _manifest_resealed(store: ObjectStore, run: str) -> None:
    """Signed by the writer, but not the manifest the pointer vouches for."""
    body = open_envelope(_get(store, _mkey(run)), CheckpointManifest, TRUSTED).body
    store.put(_mkey(run), seal(WRITER, replace(body, created_at=body.created_at + 1)))


def _tensors_deleted(store: ObjectStore, run: str) -> None:
    store.delete(_tkey(run))


def _pointer_and_round_3_by_attacker(store: ObjectStore, run: str) -> None:
    _write(store, run, 3, who=ATTACKER)  # a whole checkpoint of its own, and a LATEST naming it


def _pointer_bit_flipped(store: ObjectStore, run: str) -> None:
    blob = bytearray(_get(store, _pkey(run)))
    blob[-1] ^= 0x01  # the signature's last byte
    store.put(_pkey(run), bytes(blob))


def _pointer_of_replica_1(store: ObjectStore, run: str) -> None:
    store.put(_pkey(run), _get(store, _pkey(run, replica=1)))


def _pointer_to_round_9(store: ObjectStore, run: str) -> None:
    """Validly signed, but round 9 was never written."""
    body = open_envelope(_get(store, _pkey(run)), CheckpointPointer, TRUSTED).body
    moved = replace(body, round=9, manifest_key=_mkey(run, rnd=9))
    store.put(_pkey(run), seal(WRITER, moved))


FAULTS = [
    Fault("truncated tensors", _truncate, 1, ("holds",)),
    Fault("tensors swapped, same size", _swap_tensors, 1, ("sha256",)),
    Fault("tensors deleted", _tensors_deleted, 1, ("tensors object is missing",)),
    Fault(
        "manifest signed by an untrusted key", _manifest_by_attacker, 1, ("not among the 1 key(s) trusted",)
    ),
    Fault("manifest bit flipped", _manifest_bit_flipped, 1, ("signature does not verify",)),
    Fault("manifest of round 1 copied to round 2", _manifest_of_round_1, 1, ("round=1, not 2",)),
    Fault("manifest replaced after the pointer", _manifest_resealed, 1, ("LATEST pointer vouches",)),
    # a refused pointer tells nothing: rounds are tried from the newest listed, each on its own signatures
    Fault(
        "pointer and a round-3 checkpoint by an untrusted key",
        _pointer_and_round_3_by_attacker,
        2,
        ("LATEST pointer is signed by", "manifest is signed by"),
    ),
    Fault("pointer bit flipped", _pointer_bit_flipped, 2, ("signature does not verify",)),
    Fault("pointer of replica 1 copied", _pointer_of_replica_1, 2, ("replica=1, not 0",)),
    Fault("pointer to a round never written", _pointer_to_round_9, 2, ("no manifest",)),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_a_bad_checkpoint_is_refused_and_the_previous_used(
    store: ObjectStore, run_id: str, fault: Fault
) -> None:
    _write(store, run_id, 1)
    _write(store, run_id, 2, replica=1)
    _write(store, run_id, 2)
    assert _read(store, run_id) == (2, [])

    fault.make(store, run_id)
    rnd, refused = _read(store, run_id)
    assert rnd == fault.used, [str(r) for r in refused]
    assert len(refused) == len(fault.reasons), [str(r) for r in refused]
    for refusal, phrase in zip(refused, fault.reasons, strict=True):
        assert phrase in refusal.reason, str(refusal)


def test_all_refused_is_none_with_every_reason(store: ObjectStore, run_id: str) -> None:
    _write(store, run_id, 1)
    _write(store, run_id, 2)
    refused: list[Refusal] = []
    stranger = {ATTACKER.public_key}
    got = read_checkpoint(store, run_id=run_id, stage=STAGE, replica=0, trusted=stranger, refused=refused)
    assert got is None
    assert [r.round for r in refused] == [None, 2, 1]
    assert all("not among the 1 key(s) trusted" in r.reason for r in refused)
    with pytest.raises(CheckpointRefused, match="not among"):
        read_round(store, run_id=run_id, stage=STAGE, replica=0, round=1, trusted=stranger)


def test_a_tensors_object_over_the_reader_s_bound_is_not_downloaded(store: ObjectStore, run_id: str) -> None:
    _write(store, run_id, 1)
    down = store.bytes_down
    rnd, refused = _read(store, run_id, max_bytes=100)
    assert rnd is None and "over this reader's bound of 100" in refused[0].reason
    assert store.bytes_down - down < 4096  # the manifest and the pointer only


# --- 3: large checkpoints go up in parts ---------------------------------------------------------


def test_moto_refuses_parts_under_5_mib(store: ObjectStore, run_id: str) -> None:
    """Why write_checkpoint refuses part_bytes < 5 MiB: the store takes such parts, then fails the upload."""
    key = f"{run_id}/small-parts"
    c = store.client
    up = c.create_multipart_upload(Bucket=store.bucket, Key=key)["UploadId"]
    parts = [
        {
            "PartNumber": n,
            "ETag": c.upload_part(
                Bucket=store.bucket, Key=key, UploadId=up, PartNumber=n, Body=b"x" * (1 << 20)
            )["ETag"],
        }
        for n in (1, 2)
    ]
    with pytest.raises(botocore.exceptions.ClientError, match="EntityTooSmall"):
        c.complete_multipart_upload(
            Bucket=store.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts}
        )
    c.abort_multipart_upload(Bucket=store.bucket, Key=key, UploadId=up)


def test_a_checkpoint_over_the_multipart_threshold_round_trips(store: ObjectStore, run_id: str) -> None:
    part = MIN_PART_BYTES  # 5 MiB parts and threshold
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.big": torch.randn(3 * (1 << 20), generator=g),  # 12 MiB of fp32
        "model.bf16": torch.randn(1 << 20, generator=g).to(torch.bfloat16),  # 2 MiB
        "optim.step": torch.tensor(5),
    }
    manifest = write_checkpoint(
        store,
        WRITER,
        run_id=run_id,
        stage=STAGE,
        replica=0,
        round=1,
        step=10,
        tensors=tensors,
        part_bytes=part,
    )
    assert manifest.tensors_bytes > 2 * part
    info = store.head(manifest.tensors_key)
    assert info is not None and info.etag.strip('"').endswith("-3")  # three parts: 5 + 5 + 4 MiB

    down = store.bytes_down
    ckpt = read_checkpoint(store, run_id=run_id, stage=STAGE, replica=0, trusted=TRUSTED, part_bytes=part)
    assert ckpt is not None and ckpt.round == 1
    _assert_bit_identical(ckpt.tensors, tensors)
    assert store.bytes_down - down >= manifest.tensors_bytes


def test_a_download_is_pinned_to_the_version_it_checked(
    store: ObjectStore, run_id: str, tmp_path: Path
) -> None:
    key = f"{run_id}/pinned"
    store.put(key, b"a" * 1000)
    seen = store.head(key)
    assert seen is not None
    store.put(key, b"b" * 1000)  # same size, another version
    with pytest.raises(ObjectChanged):
        store.download_file(key, tmp_path / "f", version=seen)
    assert store.download_file(key, tmp_path / "g") is not None
    assert (tmp_path / "g").read_bytes() == b"b" * 1000
    assert store.download_file(f"{run_id}/absent", tmp_path / "h") is None
    assert not os.path.exists(tmp_path / "h")

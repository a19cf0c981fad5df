"""Corpora in the object store: publish a folder as shards with their manifest, and fetch them back.

`publish_corpus` uploads each text file of a local corpus to `{prefix}/{name}` and then the manifest
(protocol/corpus.py) to `{prefix}/crucible-manifest.jsonl`; the corpus hash is the same as the folder's.
`fetch_corpus` reads the manifest (refusing one whose hash is not the spec's before any shard is fetched),
then streams each shard to a content-addressed cache on disk (`{cache}/shards/{sha256}`), checking its
size and sha256 as it arrives; a shard already cached is not fetched again. Nothing is held in memory:
node/data/corpus.py reads windows of the cached files.

A run's tokenizer.json can travel the same way (`publish_tokenizer`, `fetch_tokenizer`): one object at an
`s3://bucket/key` the spec names in `train.tokenizer`, checked against `train.tokenizer_sha256` as it
arrives, so no node needs a local path (`crucible-swarm --tokenizer FILE --data-in-store` puts it at
`s3://crucible/tokenizers/<sha256>.json`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path

from node.data.corpus_files import (
    SNIFF_BYTES,
    CorpusScan,
    DataError,
    file_sha256,
    is_text,
    manifest_of,
)
from protocol.corpus import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    ShardEntry,
    corpus_sha256,
    manifest_bytes,
    manifest_key,
    parse_manifest,
    parse_store_url,
    shard_key,
)
from protocol.net.store import ObjectStore, StoreError

log = logging.getLogger(__name__)

DISK_HEADROOM_BYTES = 1 << 30
"""Free disk a node keeps beyond the shards it fetches."""


def store_for(store: ObjectStore, bucket: str) -> ObjectStore:
    """`store` itself when it holds `bucket`, else a client of the same endpoint for that bucket."""
    if bucket == store.bucket:
        return store
    return ObjectStore(replace(store.cfg, bucket=bucket))


def publish_corpus(store: ObjectStore, scan: CorpusScan, url: str) -> tuple[list[ShardEntry], str]:
    """Upload the text files of `scan` as the shards of the corpus at `url` (s3://bucket/prefix), then
    its manifest (last: a reader finds the manifest only once every shard is there). Returns the
    manifest entries and the corpus hash (the folder's hash: names are relative)."""
    bucket, prefix = parse_store_url(url)
    target = store_for(store, bucket)
    entries = manifest_of(scan)
    by_name = {e.name: e for e in entries}
    for p in scan.files:
        name = p.relative_to(scan.root).as_posix()
        info = target.upload_file(p, shard_key(prefix, name))
        if info.size != by_name[name].size:
            raise DataError(
                f"corpus file {p} changed while it was uploaded ({by_name[name].size} -> {info.size} bytes)"
            )
    target.put(manifest_key(prefix), manifest_bytes(entries))
    return entries, corpus_sha256(entries)


def publish_tokenizer(store: ObjectStore, data: bytes, url: str) -> str:
    """Upload a tokenizer.json's bytes to `url` (s3://bucket/key); returns their sha256 (the spec's
    train.tokenizer_sha256)."""
    bucket, key = parse_store_url(url)
    if not key:
        raise DataError(
            f"train.tokenizer {url!r} names a bucket, not an object (example: s3://crucible/tok.json)"
        )
    store_for(store, bucket).put(key, data)
    return hashlib.sha256(data).hexdigest()


def fetch_tokenizer(
    store: ObjectStore, url: str, expected_sha256: str = "", max_bytes: int = 64 << 20
) -> bytes:
    """The tokenizer.json at `url`, at most `max_bytes`; DataError when it is missing, unreadable or (with
    `expected_sha256`) not the one the run spec names."""
    try:
        bucket, key = parse_store_url(url)
    except ManifestError as e:
        raise DataError(f"train.tokenizer {url!r}: {e}") from e
    try:
        data = store_for(store, bucket).get(key, max_bytes=max_bytes)
    except StoreError as e:
        raise DataError(f"train.tokenizer {url!r}: {e}") from e
    if data is None:
        raise DataError(
            f"train.tokenizer {url!r} does not exist in the store: upload it with "
            "node.data.corpus_store.publish_tokenizer, or `crucible-swarm --tokenizer FILE --data-in-store`"
        )
    found = hashlib.sha256(data).hexdigest()
    if expected_sha256 and found != expected_sha256:
        raise DataError(
            f"train.tokenizer {url!r} in the store has sha256 {found}, the run spec says {expected_sha256} "
            "(replaced or damaged in the store)"
        )
    return data


def read_manifest(store: ObjectStore, url: str, expected_sha256: str = "") -> tuple[list[ShardEntry], str]:
    """The shards of the corpus at `url` and its hash; DataError when the manifest is missing, malformed,
    or (with `expected_sha256`) not the one the run spec names."""
    try:
        bucket, prefix = parse_store_url(url)
    except ManifestError as e:
        raise DataError(f"train.data {url!r}: {e}") from e
    key = manifest_key(prefix)
    try:
        data = store_for(store, bucket).get(key, max_bytes=MAX_MANIFEST_BYTES)
    except StoreError as e:
        raise DataError(f"train.data {url!r}: cannot read its manifest s3://{bucket}/{key}: {e}") from e
    if data is None:
        raise DataError(
            f"train.data {url!r} has no manifest (s3://{bucket}/{key}): publish the corpus with "
            "node.data.corpus_store.publish_corpus, or `crucible-swarm --data DIR --data-in-store`"
        )
    found = hashlib.sha256(data).hexdigest()
    if expected_sha256 and found != expected_sha256:
        raise DataError(
            f"train.data {url!r}: its manifest hashes to sha256 {found}, the run spec says "
            f"{expected_sha256}: the store holds another corpus under this prefix"
        )
    try:
        return parse_manifest(data, f"s3://{bucket}/{key}"), found
    except ManifestError as e:
        raise DataError(f"train.data {url!r}: {e}") from e


def fetch_corpus(
    store: ObjectStore, url: str, cache: Path, expected_sha256: str = ""
) -> tuple[list[Path], list[ShardEntry], str]:
    """(local files in manifest order, the manifest, the corpus hash) of the corpus at `url`, every
    shard in `cache` with its size and sha256 checked; DataError naming the shard when one differs."""
    entries, sha = read_manifest(store, url, expected_sha256)
    bucket, prefix = parse_store_url(url)
    source = store_for(store, bucket)
    shards = cache / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    missing = [e for e in entries if not _cached(shards / e.sha256, e)]
    need = sum(e.size for e in missing)
    free = shutil.disk_usage(shards).free
    if need + DISK_HEADROOM_BYTES > free and need > 0:
        raise DataError(
            f"train.data {url!r}: {len(missing)} shards need {need / 1e9:.2f} GB on disk, {shards} has "
            f"{free / 1e9:.2f} GB free (keeping {DISK_HEADROOM_BYTES >> 30} GB spare); free some, or set "
            "--data-root on a larger disk"
        )
    if missing:
        log.info("corpus %s: fetching %d shards, %.1f MB, into %s", url, len(missing), need / 1e6, shards)
    for e in missing:
        _fetch_shard(source, shard_key(prefix, e.name), e, shards, url)
    return [shards / e.sha256 for e in entries], entries, sha


def _cached(path: Path, e: ShardEntry) -> bool:
    try:
        return path.stat().st_size == e.size  # written under its hash only after the hash was checked
    except OSError:
        return False


def _fetch_shard(store: ObjectStore, key: str, e: ShardEntry, shards: Path, url: str) -> None:
    """Stream one shard to `{shards}/{sha256}` (a temporary name until its size and hash are checked)."""
    info = store.head(key)
    if info is None:
        raise DataError(f"train.data {url!r}: shard {e.name} is listed in the manifest but absent ({key})")
    if info.size != e.size:
        raise DataError(
            f"train.data {url!r}: shard {e.name} holds {info.size} bytes, the manifest says {e.size}"
        )
    tmp = shards / f".{e.sha256}.{os.getpid()}.part"
    try:
        store.download_file(key, tmp, version=info, max_bytes=e.size)
        size, got = file_sha256(tmp)
        if got != e.sha256 or size != e.size:
            raise DataError(
                f"train.data {url!r}: shard {e.name} has sha256 {got}, the manifest says {e.sha256} "
                "(replaced or damaged in the store)"
            )
        with open(tmp, "rb") as f:
            head = f.read(SNIFF_BYTES)
        if not is_text(head):
            raise DataError(f"train.data {url!r}: shard {e.name} is not text (NUL bytes or invalid UTF-8)")
        os.replace(tmp, shards / e.sha256)
    except StoreError as err:
        raise DataError(f"train.data {url!r}: cannot fetch shard {e.name}: {err}") from err
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()

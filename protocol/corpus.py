"""A corpus's identity: its manifest and content hash, the run spec's `train.data_sha256`.

A corpus is a set of shards, each named by its path relative to the corpus root (a local folder, or an
`s3://bucket/prefix` in the object store) and given with its size and sha256. Its manifest is one JSON
line per shard, sorted by name, `["name",size,"sha256"]` (ASCII, no spaces); the corpus hash is the
sha256 of those bytes. Names are relative, so a folder and its copy in the store hash the same.

In the store the manifest lies beside the shards, at `{prefix}/crucible-manifest.jsonl`, and the shards at
`{prefix}/{name}`: a node reads the manifest first (and refuses a corpus whose manifest is not the one the
spec names, before fetching any shard), then checks each shard's size and sha256 as it reads it.
Pure functions: the node does the reading (node/data/corpus_store.py).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from protocol.schema import describe

MANIFEST_NAME = "crucible-manifest.jsonl"
"""The manifest's key under a corpus prefix in the store."""
MAX_MANIFEST_BYTES = 64 << 20
"""A manifest of ~500,000 shards; a larger object at the manifest's key is refused before download."""
MAX_NAME_BYTES = 900
"""A shard name's limit in UTF-8 bytes: with its prefix it stays within S3's 1024-byte keys."""
MAX_LINE_BYTES = 4096
"""A manifest line's limit: the longest valid one (a 900-byte name, every character escaped as JSON's
3 ASCII bytes per UTF-8 byte, a size and a sha256) is under 2,800."""
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_SCALAR = r'[^\[\]{}",]*(?:"(?:[^"\\]|\\.)*"[^\[\]{}",]*)?'
_FLAT_LIST = re.compile(rf"\[{_SCALAR}(?:,{_SCALAR})*\]")
"""A list of strings and bare values, nothing nested (a bracket or brace only inside a string): checked
before json sees the line, so no nesting reaches its recursive parser."""
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


class ManifestError(ValueError):
    """A manifest or a corpus URL is malformed; the message says where and what."""


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a corpus."""

    name: str
    """Path relative to the corpus root, '/'-separated."""
    size: int
    """Bytes."""
    sha256: str
    """Lowercase hex digest of its bytes."""


def check_sha256(where: str, value: str, *, empty_ok: bool = False) -> None:
    """Raise ValueError unless `value` is 64 lowercase hex digits (or empty, where that means unchecked)."""
    if empty_ok and value == "":
        return
    if not SHA256_HEX.fullmatch(value):
        raise ValueError(
            f"{where}={describe(value)} must be a sha256: 64 lowercase hex digits"
            + (" (or empty: not checked)" if empty_ok else "")
        )


def check_name(name: str) -> None:
    """Raise ManifestError unless `name` is a relative '/'-path of plain parts (no '.', '..', empty
    parts, backslashes or control characters) within MAX_NAME_BYTES and not the manifest's own name."""
    parts = name.split("/")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # a file name that is not UTF-8 (os gives it as surrogates)
        size = MAX_NAME_BYTES + 1
    bad = (
        not name
        or size > MAX_NAME_BYTES
        or any(p in ("", ".", "..") for p in parts)
        or "\\" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
        or name == MANIFEST_NAME
    )
    if bad:
        raise ManifestError(
            f"shard name {describe(name)} is not a relative path of plain parts "
            f"(example: books/part-0001.txt; at most {MAX_NAME_BYTES} bytes)"
        )


def manifest_bytes(entries: list[ShardEntry]) -> bytes:
    """The canonical manifest: one `["name",size,"sha256"]` line per shard, sorted by name."""
    seen: set[str] = set()
    lines = []
    for e in sorted(entries, key=lambda e: e.name):
        check_name(e.name)
        check_sha256(f"shard {e.name} sha256", e.sha256)
        if isinstance(e.size, bool) or not isinstance(e.size, int) or e.size < 0:
            raise ManifestError(f"shard {e.name}: size {describe(e.size)} must be a whole number >= 0")
        if e.name in seen:
            raise ManifestError(f"shard {e.name} is listed twice")
        seen.add(e.name)
        lines.append(json.dumps([e.name, e.size, e.sha256], separators=(",", ":")) + "\n")
    return "".join(lines).encode("ascii")


def corpus_sha256(entries: list[ShardEntry]) -> str:
    """The corpus's content hash: sha256 of its canonical manifest."""
    return hashlib.sha256(manifest_bytes(entries)).hexdigest()


def parse_manifest(data: bytes, where: str) -> list[ShardEntry]:
    """The shards of a stored manifest; ManifestError unless it is canonical (what was hashed is exactly
    what is read) and every line is well formed."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{where}: {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{where}: not ASCII at byte {e.start}") from e
    entries = []
    for i, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_LINE_BYTES:
            raise ManifestError(f"{where} line {i}: {len(line)} bytes, over the {MAX_LINE_BYTES}-byte limit")
        if not _FLAT_LIST.fullmatch(line):
            raise ManifestError(
                f"{where} line {i}: not a [name, size, sha256] JSON list: nested or not a list"
            )
        try:
            name, size, sha = json.loads(line)
        except Exception as e:  # whatever json raises for an untrusted line is this line's fault
            raise ManifestError(
                f"{where} line {i}: not a [name, size, sha256] JSON list: {str(e)[:200]}"
            ) from e
        if not isinstance(name, str) or not isinstance(sha, str):
            raise ManifestError(f"{where} line {i}: name and sha256 must be strings")
        if isinstance(size, int) and size > 2**63 - 1:  # no file is larger; the node divides sums by 1e9
            raise ManifestError(
                f"{where} line {i}: size {describe(size)} is more than a file holds (2^63 - 1)"
            )
        entries.append(ShardEntry(name=name, size=size, sha256=sha))
    try:
        canonical = manifest_bytes(entries)
    except ValueError as e:
        raise ManifestError(f"{where}: {e}") from e
    if canonical != data:
        raise ManifestError(
            f"{where} is not in canonical form (sorted by name, one compact JSON list per line, '\\n' "
            "after each): write it with node.data.corpus_store.publish_corpus"
        )
    if not entries:
        raise ManifestError(f"{where} lists no shard")
    return entries


def is_store_url(data: str) -> bool:
    return data.startswith("s3://")


def parse_store_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; the prefix without its trailing '/', possibly empty."""
    if not is_store_url(url):
        raise ManifestError(f"{describe(url)} is not an s3:// URL (example: s3://crucible/corpora/books)")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ManifestError(
            f"{describe(url)}: bucket {describe(bucket)} is not a bucket name: 3-63 lowercase letters, digits, "
            "dots or dashes (example: s3://crucible/corpora/books)"
        )
    prefix = prefix.rstrip("/")
    if prefix:
        try:
            check_name(prefix)
        except ManifestError:
            raise ManifestError(
                f"{describe(url)}: the prefix must be a '/'-path of plain parts (example: "
                "s3://crucible/corpora/books)"
            ) from None
    return bucket, prefix


def shard_key(prefix: str, name: str) -> str:
    """Where shard `name` of the corpus at `prefix` lies in the bucket."""
    return f"{prefix}/{name}" if prefix else name


def manifest_key(prefix: str) -> str:
    return shard_key(prefix, MANIFEST_NAME)


__all__ = [
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "ManifestError",
    "ShardEntry",
    "check_name",
    "check_sha256",
    "corpus_sha256",
    "is_store_url",
    "manifest_bytes",
    "manifest_key",
    "parse_manifest",
    "parse_store_url",
    "shard_key",
]

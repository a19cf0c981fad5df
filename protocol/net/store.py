"""Thin S3-compatible object store client (Cloudflare R2 in production; moto's server on loopback by default).

boto3 does the protocol; this adds byte accounting, conditional writes for the coordinator lease
(If-None-Match / If-Match -> 412 on conflict), and errors that say what to check.
"""

from __future__ import annotations

import builtins
import email.utils
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import boto3
import boto3.session
import botocore.config
import botocore.exceptions
import s3transfer.exceptions
import urllib3.exceptions
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from s3transfer.manager import TransferManager
from s3transfer.subscribers import BaseSubscriber

from protocol.net.store_config import StoreConfig


class StoreError(RuntimeError):
    """The object store could not be reached or refused a request."""


class StoreUnavailable(StoreError):
    """The store was overloaded or unreachable (5xx, SlowDown, no answer) through boto3's retries: a
    passing condition, which the caller's next attempt retries (nothing about the request was wrong)."""


TRANSIENT_CODES = frozenset(
    {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"}
)


def is_transient(e: Exception) -> bool:
    """Whether boto3's error `e` says the store was unavailable rather than that the request was wrong."""
    if isinstance(e, botocore.exceptions.ClientError):
        err = e.response.get("Error", {})
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return err.get("Code") in TRANSIENT_CODES or status >= 500
    return isinstance(
        e,
        botocore.exceptions.EndpointConnectionError
        | botocore.exceptions.ConnectionClosedError
        | botocore.exceptions.ReadTimeoutError
        | botocore.exceptions.ConnectTimeoutError,
    )


class ObjectTooLarge(StoreError):
    """An object is larger than the caller's bound for it; it was not downloaded."""


CLOCK_WINDOW_S = 300.0
"""How long answers' Date headers are pooled into one estimate of the store's clock."""
DEFAULT_PART_BYTES = 64 << 20
"""Multipart threshold and part size for file transfers: a 5 GB stage goes up in 75 parts."""
MIN_PART_BYTES = 5 << 20
"""S3's (and R2's, and moto's) smallest part but the last."""


def check_part_bytes(part_bytes: int) -> None:
    if part_bytes < MIN_PART_BYTES:
        raise ValueError(
            f"part_bytes={part_bytes} is below S3's {MIN_PART_BYTES}-byte (5 MiB) minimum part size; "
            "a multipart upload with smaller parts is refused when it completes"
        )


class ObjectUnreadable(StoreError):
    """The store refuses to serve an object it lists (archived, encrypted with a key we lack, denied): a
    4xx that asking again will not change."""


class ObjectChanged(StoreError):
    """An object was replaced or deleted while it was downloaded; nothing of it is usable."""


@dataclass(frozen=True)
class ObjectInfo:
    """One version of a stored object, as HEAD reports it."""

    size: int
    etag: str
    """Quoted, as S3 returns it; a multipart upload's ends in -<parts>."""


@dataclass(frozen=True)
class Listed:
    """One object as a LIST reports it."""

    t: int
    """Its LastModified, floored to the second (Unix time; S3's and R2's resolution). For a multipart
    object S3 dates it when the upload was created, not completed."""
    size: int
    etag: str
    storage_class: str


@dataclass(frozen=True)
class Listing:
    """One LIST of a prefix on the store's own clock."""

    objects: dict[str, Listed]
    now_s: int
    """The store's clock (its Date header) when it answered the first page, floored: every object whose
    PUT completed before then is listed (S3 and R2 list strongly consistently)."""


_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _credentials(cfg: StoreConfig, session: boto3.session.Session) -> tuple[str | None, str | None, str]:
    """(access key, secret key, where they came from). Keys in the config win; then boto3's own chain
    (None, None: boto3 resolves them per request and refreshes expiring ones); then, for a store on this
    host only, a placeholder. A remote store with no credentials anywhere is refused here, by name."""
    if cfg.access_key or cfg.secret_key:
        if not (cfg.access_key and cfg.secret_key):
            raise StoreError("store: set both access_key and secret_key, or neither (to use boto3's chain)")
        return cfg.access_key, cfg.secret_key, "config"
    found = session.get_credentials()
    if found is not None:
        return None, None, str(found.method)
    if urlsplit(cfg.endpoint_url).hostname in _LOOPBACK:
        return "crucible", "crucible", "loopback placeholder"
    raise StoreError(
        f"no credentials for the object store {cfg.endpoint_url}: set access_key and secret_key in the "
        "[store] section, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or an AWS profile "
        "(AWS_PROFILE, ~/.aws/credentials)"
    )


def s3_client(cfg: StoreConfig, timeout_s: float, **config: Any) -> tuple[Any, str]:
    """(a boto3 S3 client of `cfg`, where its credentials came from): the one place a client is built.
    `config`: more botocore Config settings (a presigner's signature_version)."""
    session = boto3.session.Session()
    access, secret, source = _credentials(cfg, session)
    client = session.client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        aws_access_key_id=access,
        aws_secret_access_key=secret,
        region_name=cfg.region if cfg.region != "auto" else "us-east-1",
        # "standard" retries: 429/503 SlowDown, throttling and resets, with exponential backoff and jitter
        config=botocore.config.Config(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"mode": "standard", "max_attempts": 3},
            # a node's store threads: each layer group's round I/O, checkpoint transfers, an MoE stage's
            # per-step records and the others' GETs at once (botocore's default pool of 10 overflows)
            max_pool_connections=32,
            **config,
        ),
    )
    return client, source


class StoreOps:
    """Counts and times S3 API calls by operation (GetObject, PutObject, ListObjectsV2, ...) and outcome
    ("ok", "not_found", "precondition_failed", "error"), from botocore's before-call / after-call events:
    one count per API call (retries inside a call are botocore's own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[tuple[str, str], int] = {}
        """(operation, outcome) -> calls."""
        self.seconds: dict[str, float] = {}
        """operation -> seconds spent in its calls, all outcomes."""

    def watch(self, client: Any) -> None:
        events = client.meta.events
        events.register("before-call.s3", self._before)
        events.register("after-call.s3", self._after)
        events.register("after-call-error.s3", self._failed)

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, float]]:
        with self._lock:
            return dict(self.calls), dict(self.seconds)

    def _before(self, model: Any, context: dict, **_: Any) -> None:
        context["crucible_t0"], context["crucible_op"] = time.perf_counter(), model.name

    def _after(self, model: Any, context: dict, http_response: Any, **_: Any) -> None:
        code = int(getattr(http_response, "status_code", 0) or 0)
        outcome = "ok" if code < 300 else {404: "not_found", 412: "precondition_failed"}.get(code, "error")
        self._note(model.name, outcome, context)

    def _failed(self, context: dict, **_: Any) -> None:
        # after-call-error carries no model: _before noted the operation in the request's context
        self._note(str(context.get("crucible_op", "unknown")), "error", context)

    def _note(self, op: str, outcome: str, context: dict) -> None:
        self.note(op, outcome, time.perf_counter() - context.pop("crucible_t0", time.perf_counter()))

    def note(self, op: str, outcome: str, dt: float) -> None:
        """Counts one call of `dt` seconds; also for calls made outside botocore (protocol/net/grants.py)."""
        with self._lock:
            self.calls[(op, outcome)] = self.calls.get((op, outcome), 0) + 1
            self.seconds[op] = self.seconds.get(op, 0.0) + dt


class ObjectStore:
    """Byte-counting boto3 wrapper; thread-safe (boto3 clients are)."""

    write_once = False
    """Whether this client writes each key at most once, and only keys it was granted (protocol/net/grants.py
    `GrantedStore`): then nothing it writes can be moved later (no pointer, no rewritten report)."""

    def may_write(self, key: str) -> bool:
        """Whether a write of `key` can be tried at all (a full credential may write anything)."""
        return True

    def __init__(self, cfg: StoreConfig, *, timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        self.bucket = cfg.bucket
        self.client, self.credential_source = s3_client(cfg, timeout_s)
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0
        self.ops = StoreOps()
        """Every S3 API call this client made (multipart parts and pinned ranged GETs included), by
        operation and outcome, with their latency: counted by botocore's own call events."""
        self.ops.watch(self.client)
        self._clock_offset_s: float | None = None
        """The store's clock minus ours: the largest (Date header - our clock) of its answers since
        `_clock_since` (a Date floors to the second, so each answer is at most a second low)."""
        self._clock_since = 0.0
        self.client.meta.events.register("after-call.s3", self._note_clock)

    def _note_clock(self, http_response: Any, **_: Any) -> None:
        when = _http_date(getattr(http_response, "headers", {}).get("Date"))
        if when is None:
            return
        now = time.time()
        offset = when - now
        if self._clock_offset_s is None or now - self._clock_since > CLOCK_WINDOW_S:
            self._clock_offset_s, self._clock_since = offset, now  # (re)start: our clock may have been set
        else:
            self._clock_offset_s = max(self._clock_offset_s, offset)

    def store_now(self) -> float:
        """The store's clock now, as far as its answers tell (at most about a second behind it, never
        ahead by more than an answer's latency); our clock until the store has answered."""
        return time.time() + (self._clock_offset_s or 0.0)

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.bytes_up += up
            self.bytes_down += down

    def _fail(self, what: str, e: Exception) -> StoreError:
        if is_transient(e):
            return StoreUnavailable(
                f"object store {self.cfg.endpoint_url} bucket {self.bucket!r}: {what} failed: {e}. "
                "The store is overloaded or unreachable for now; the next attempt retries"
            )
        return StoreError(
            f"object store {self.cfg.endpoint_url} bucket {self.bucket!r}: {what} failed: {e}. "
            "Check the endpoint URL, credentials and that the bucket exists"
        )

    def ensure_bucket(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.ClientError:
            try:
                self.client.create_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as e:
                if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise self._fail("create bucket", e) from e
        except botocore.exceptions.EndpointConnectionError as e:
            raise self._fail("connect", e) from e

    def put(self, key: str, data: bytes) -> str:
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._fail(f"PUT {key}", e) from e
        self._count(up=len(data))
        return str(r["ETag"])

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Create `key` only if it does not exist; returns the ETag, or None if it already existed."""
        return self._conditional_put(key, data, IfNoneMatch="*")

    def put_if_match(self, key: str, data: bytes, etag: str) -> str | None:
        """Replace `key` only if its ETag is still `etag`; returns the new ETag, or None on a lost race."""
        return self._conditional_put(key, data, IfMatch=etag)

    def _conditional_put(self, key: str, data: bytes, **cond: str) -> str | None:
        try:
            r = self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **cond)
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return None
            raise self._fail(f"conditional PUT {key}", e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"conditional PUT {key}", e) from e
        self._count(up=len(data))
        return str(r["ETag"])

    def get_with_etag(self, key: str, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """(bytes, ETag) of `key`, None if absent. max_bytes: refuse (ObjectTooLarge) an object larger
        than this before downloading its body, so whoever wrote the key cannot make us fetch gigabytes."""
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            size = int(r.get("ContentLength", 0))
            if max_bytes is not None and size > max_bytes:
                r["Body"].close()
                raise ObjectTooLarge(
                    f"object {key} holds {size} bytes, over the {max_bytes}-byte bound for it; not downloaded"
                )
            data = r["Body"].read()
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                return None
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if 400 <= status < 500 and status not in (408, 429):
                raise ObjectUnreadable(
                    f"GET {key}: the store refuses to serve it ({e}); if it refuses every object, check the "
                    "credentials"
                ) from e
            raise self._fail(f"GET {key}", e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"GET {key}", e) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:  # the body stalled or broke mid-read
            raise self._fail(f"GET {key} (reading the body)", e) from e
        self._count(down=len(data))
        return data, str(r["ETag"])

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        found = self.get_with_etag(key, max_bytes)
        return None if found is None else found[0]

    def list(self, prefix: str) -> list[str]:
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                keys.extend(obj["Key"] for obj in page.get("Contents", []))
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._fail(f"LIST {prefix}", e) from e
        return keys

    def list_stamped(self, prefix: str) -> Listing:
        """Every key under `prefix` with its LastModified, and the store's clock when it answered: what
        a rule decided by the store's own timestamps reads (node/sync/round_rule.py). A store that sends
        no Date header is read on our clock instead (the rule then trusts our clock's agreement with it)."""
        objects: dict[str, Listed] = {}
        now: int | None = None
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                if now is None:
                    sent = _http_date(page.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date"))
                    now = int(sent if sent is not None else time.time())
                for obj in page.get("Contents", []):
                    objects[obj["Key"]] = Listed(
                        t=int(obj["LastModified"].timestamp()),
                        size=int(obj.get("Size", 0)),
                        etag=str(obj.get("ETag", "")),
                        storage_class=str(obj.get("StorageClass", "STANDARD")),
                    )
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._fail(f"LIST {prefix}", e) from e
        return Listing(objects, now if now is not None else int(time.time()))

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._fail(f"DELETE {key}", e) from e

    # --- large objects (checkpoints): files, multipart, pinned downloads ---------------------------

    def head(self, key: str) -> ObjectInfo | None:
        """Size and ETag of `key` without its body; None if absent."""
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail(f"HEAD {key}", e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"HEAD {key}", e) from e
        return ObjectInfo(size=int(r["ContentLength"]), etag=str(r["ETag"]))

    def list_prefixes(self, prefix: str, delimiter: str = "/") -> builtins.list[str]:
        """The "folders" directly under `prefix` (S3 CommonPrefixes), each ending in `delimiter`. (The return
        type says `builtins.list`: in this class `list` is a method.)"""
        found: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, Delimiter=delimiter
            ):
                found.extend(p["Prefix"] for p in page.get("CommonPrefixes", []))
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._fail(f"LIST {prefix} (delimiter {delimiter!r})", e) from e
        return found

    def upload_file(
        self, path: str | os.PathLike[str], key: str, *, part_bytes: int = DEFAULT_PART_BYTES
    ) -> ObjectInfo:
        """Stream a local file to `key` with boto3's managed transfer: one PUT below `part_bytes`, else a
        multipart upload in `part_bytes` parts sent in parallel (S3 takes parts of 5 MiB to 5 GiB, at most
        10,000; s3transfer grows the parts of a larger file). Returns the stored object's size and ETag (a
        multipart ETag ends in -<parts>)."""
        check_part_bytes(part_bytes)
        progress = _Progress(lambda n: self._count(up=n))
        try:
            with create_transfer_manager(self.client, _transfer_config(part_bytes)) as manager:
                manager.upload(os.fspath(path), self.bucket, key, subscribers=[progress]).result()
        except (
            botocore.exceptions.ClientError,
            botocore.exceptions.BotoCoreError,
            s3transfer.exceptions.S3UploadFailedError,
        ) as e:
            raise self._fail(f"upload of {key}", e) from e
        info = self.head(key)
        if info is None:
            raise StoreError(f"object store {self.cfg.endpoint_url}: {key} is absent right after its upload")
        return info

    def download_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        version: ObjectInfo | None = None,
        max_bytes: int | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
    ) -> ObjectInfo | None:
        """Stream `key` into the file `path` (ranged GETs of `part_bytes` in parallel when large); None if
        absent. The download is pinned to one version of the object, `version` (from `head`) or what a HEAD
        finds now: every GET carries If-Match on its ETag, so an object replaced mid-way raises
        ObjectChanged instead of mixing two versions, and no more than its size is fetched. max_bytes:
        refuse (ObjectTooLarge) a larger object before fetching any of it."""
        check_part_bytes(part_bytes)
        info = version if version is not None else self.head(key)
        if info is None:
            return None
        if max_bytes is not None and info.size > max_bytes:
            raise ObjectTooLarge(
                f"object {key} holds {info.size} bytes, over the {max_bytes}-byte bound for it; not downloaded"
            )
        subscribers = [_Pin(info), _Progress(lambda n: self._count(down=n))]
        try:
            with _PinnedTransferManager(self.client, _transfer_config(part_bytes)) as manager:
                manager.download(
                    self.bucket, key, os.fspath(path), {"IfMatch": info.etag}, subscribers
                ).result()
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("PreconditionFailed", "412", "NoSuchKey", "404"):
                raise ObjectChanged(
                    f"object {key} was replaced or deleted while it was downloaded (ETag {info.etag} is gone)"
                ) from e
            raise self._fail(f"download of {key}", e) from e
        except s3transfer.exceptions.S3DownloadFailedError as e:  # what s3transfer makes of a 412
            raise ObjectChanged(
                f"object {key} was replaced while it was downloaded (ETag {info.etag} is gone)"
            ) from e
        except (botocore.exceptions.BotoCoreError, s3transfer.exceptions.RetriesExceededError) as e:
            raise self._fail(f"download of {key}", e) from e
        got = os.path.getsize(path)
        if got != info.size:
            raise ObjectChanged(f"object {key}: downloaded {got} bytes, its HEAD said {info.size}")
        return info


def _http_date(value: str | None) -> float | None:
    """Unix time of an HTTP date (`Wed, 02 Dec 2026 02:29:30 GMT`); None if absent or unreadable."""
    if not value:
        return None
    try:
        return email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None


def _transfer_config(part_bytes: int) -> TransferConfig:
    # "classic": s3transfer in Python on every host (the CRT client, where installed, counts and pins differently)
    return TransferConfig(
        multipart_threshold=part_bytes, multipart_chunksize=part_bytes, preferred_transfer_client="classic"
    )


class _PinnedTransferManager(TransferManager):  # type: ignore[misc]
    """s3transfer sends If-Match on the ranged GETs of a large object by itself; this lets a download pass
    it for the single GET of a small one too (s3transfer checks extra arguments against this list)."""

    ALLOWED_DOWNLOAD_ARGS = [*TransferManager.ALLOWED_DOWNLOAD_ARGS, "IfMatch"]


class _Pin(BaseSubscriber):  # type: ignore[misc]
    """Gives s3transfer the size and ETag up front: it skips its own HEAD, fetches no more than that size
    and pins every ranged GET to that ETag."""

    def __init__(self, info: ObjectInfo) -> None:
        self.info = info

    def on_queued(self, future: object, **kwargs: object) -> None:
        future.meta.provide_transfer_size(self.info.size)  # type: ignore[attr-defined]
        future.meta.provide_object_etag(self.info.etag)  # type: ignore[attr-defined]


class _Progress(BaseSubscriber):  # type: ignore[misc]
    def __init__(self, count: Callable[[int], None]) -> None:
        self.count = count

    def on_progress(self, future: object, bytes_transferred: int, **kwargs: object) -> None:
        self.count(bytes_transferred)

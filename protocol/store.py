"""Thin S3-compatible object store client (Cloudflare R2 in production; moto's server on loopback by default).

boto3 does the protocol; this adds byte accounting, conditional writes for the coordinator lease
(If-None-Match / If-Match -> 412 on conflict), and errors that say what to check.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import boto3
import boto3.session
import botocore.config
import botocore.exceptions


class StoreError(RuntimeError):
    """The object store could not be reached or refused a request."""


class ObjectTooLarge(StoreError):
    """An object is larger than the caller's bound for it; it was not downloaded."""


@dataclass(kw_only=True, frozen=True)
class StoreConfig:
    """Where the run's objects live."""

    endpoint_url: str
    """S3 endpoint, e.g. https://<account>.r2.cloudflarestorage.com or http://127.0.0.1:9000."""
    bucket: str = "crucible"
    """Bucket holding every run (each under its own prefix)."""
    access_key: str = ""
    """Access key id; empty = boto3's credential chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/credentials,
    instance roles), and on a loopback endpoint with none of those a placeholder the embedded store takes."""
    secret_key: str = ""
    """Secret key; empty = as for access_key."""
    region: str = "auto"
    """Region name (R2 uses "auto")."""


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


class ObjectStore:
    """Byte-counting boto3 wrapper; thread-safe (boto3 clients are)."""

    def __init__(self, cfg: StoreConfig, *, timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        self.bucket = cfg.bucket
        session = boto3.session.Session()
        access, secret, self.credential_source = _credentials(cfg, session)
        self.client = session.client(
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
            ),
        )
        self._lock = threading.Lock()
        self.bytes_up = 0
        self.bytes_down = 0

    def _count(self, up: int = 0, down: int = 0) -> None:
        with self._lock:
            self.bytes_up += up
            self.bytes_down += down

    def _fail(self, what: str, e: Exception) -> StoreError:
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
            raise self._fail(f"GET {key}", e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"GET {key}", e) from e
        self._count(down=len(data))
        return data, str(r["ETag"])

    def head_etag(self, key: str) -> str | None:
        """The ETag of `key` without its body; None if absent."""
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=key)
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._fail(f"HEAD {key}", e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail(f"HEAD {key}", e) from e
        return str(r["ETag"])

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

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise self._fail(f"DELETE {key}", e) from e

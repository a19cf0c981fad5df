"""Write grants: presigned, expiring, write-once URLs for exactly the keys a node writes (issue 21).

The coordinator holds the store's full credential; a node need not. The coordinator (`Grantor`) signs,
per key the node writes, a SigV4 presigned PUT that names `If-None-Match: *` among its signed headers
(`X-Amz-SignedHeaders=host;if-none-match`), and for a checkpoint a multipart upload it opens itself, with
each part's UploadPart and the CompleteMultipartUpload (If-None-Match again) presigned. The store (R2, S3;
scripts/store_front.py before moto locally) then refuses such a URL for any other method or key, after
its expiry, without the header, or once the key exists: a node that holds only its grants cannot
delete, overwrite or squat any key but its own, and its own only once. It reads with a read-only
credential (`GrantedStore`, an `ObjectStore` whose writes go through its grants).

A presigned URL is a bearer token: grants travel to their node only, never through the store.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

import botocore.config
import botocore.exceptions
import urllib3
import urllib3.exceptions

from protocol.net.store import (
    DEFAULT_PART_BYTES,
    ObjectInfo,
    ObjectStore,
    ObjectTooLarge,
    StoreError,
    check_part_bytes,
    s3_client,
)
from protocol.net.store_config import StoreConfig

WRITE_ONCE = {"If-None-Match": "*"}
"""The signed header every grant's write carries: the store refuses it when the key exists."""
MAX_EXPIRES_S = 7 * 24 * 3600
"""SigV4's longest presigned expiry (S3 and R2 refuse a longer X-Amz-Expires)."""
MAX_PARTS = 10_000
"""S3's (and R2's) most parts in one multipart upload."""
MAX_KEY_BYTES = 1024
MAX_URL_BYTES = 8192
MAX_WIRE_GRANTS = 100_000
"""The most grants (PUTs plus uploads) one `Grants.from_wire` takes."""


EXPIRY_MARGIN_S = 10.0
"""A grant expiring within this many seconds makes a write ask for newer ones first (a renewal)."""


class GrantError(ValueError):
    """A grant that is malformed (from the wire) or asked for outside its rules."""


class NoGrant(StoreError):
    """A write to a key this store holds no grant for: refused here, nothing was sent."""


@dataclass(frozen=True)
class Grant:
    """A presigned PUT of one key, with `If-None-Match: *` signed."""

    key: str
    url: str
    expires_at: float
    """Unix time, on the signer's clock, after which the store refuses the URL (floored to the second)."""


@dataclass(frozen=True)
class MultipartGrant:
    """A multipart upload of one key that the coordinator opened, with its pieces presigned."""

    key: str
    upload_id: str
    part_urls: tuple[str, ...]
    """UploadPart for part numbers 1..len(part_urls): at most that many parts."""
    complete_url: str
    """CompleteMultipartUpload, with `If-None-Match: *` signed."""
    expires_at: float
    """As Grant.expires_at, for every URL here."""


@dataclass(frozen=True)
class Grants:
    """What one node may write: single PUTs and multipart uploads, by key."""

    puts: tuple[Grant, ...] = ()
    uploads: tuple[MultipartGrant, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """Plain lists and scalars (msgpack or JSON), read back by `from_wire`."""
        return {
            "puts": [[g.key, g.url, g.expires_at] for g in self.puts],
            "uploads": [
                [u.key, u.upload_id, list(u.part_urls), u.complete_url, u.expires_at] for u in self.uploads
            ],
        }

    @classmethod
    def from_wire(cls, obj: object) -> Grants:
        """Grants from `to_wire`'s form; anything else is a GrantError saying what is wrong."""
        if not isinstance(obj, Mapping) or set(obj) != {"puts", "uploads"}:
            raise GrantError("grants: expected a map with exactly the fields puts and uploads")
        puts, uploads = obj["puts"], obj["uploads"]
        if not isinstance(puts, list) or not isinstance(uploads, list):
            raise GrantError("grants: puts and uploads must be lists")
        if len(puts) + len(uploads) > MAX_WIRE_GRANTS:
            raise GrantError(f"grants: {len(puts) + len(uploads)} grants, over the {MAX_WIRE_GRANTS} taken")
        out_puts = []
        for p in puts:
            if not (isinstance(p, list) and len(p) == 3):
                raise GrantError("grants: each put must be [key, url, expires_at]")
            out_puts.append(Grant(key=_key(p[0]), url=_url(p[1]), expires_at=_when(p[2])))
        out_uploads = []
        for u in uploads:
            if not (isinstance(u, list) and len(u) == 5 and isinstance(u[2], list)):
                raise GrantError(
                    "grants: each upload must be [key, upload_id, [part urls], complete url, expires_at]"
                )
            if not 1 <= len(u[2]) <= MAX_PARTS:
                raise GrantError(f"grants: an upload must have 1..{MAX_PARTS} part URLs, not {len(u[2])}")
            if not (isinstance(u[1], str) and 0 < len(u[1]) <= 1024):
                raise GrantError("grants: an upload id must be a string of 1..1024 characters")
            out_uploads.append(
                MultipartGrant(
                    key=_key(u[0]),
                    upload_id=u[1],
                    part_urls=tuple(_url(x) for x in u[2]),
                    complete_url=_url(u[3]),
                    expires_at=_when(u[4]),
                )
            )
        return cls(puts=tuple(out_puts), uploads=tuple(out_uploads))


def _key(v: object) -> str:
    if not (isinstance(v, str) and v and len(v.encode()) <= MAX_KEY_BYTES):
        raise GrantError(f"grants: a key must be a string of 1..{MAX_KEY_BYTES} bytes")
    return v


def _url(v: object) -> str:
    if not (isinstance(v, str) and v.startswith(("http://", "https://")) and len(v) <= MAX_URL_BYTES):
        raise GrantError(f"grants: a URL must be an http(s) URL of at most {MAX_URL_BYTES} characters")
    return v


def _when(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise GrantError("grants: expires_at must be a finite, non-negative Unix time")
    return float(v)


def _check_expires(expires_s: int) -> None:
    if not 1 <= expires_s <= MAX_EXPIRES_S:
        raise GrantError(
            f"expires_s={expires_s}: a presigned URL lives 1..{MAX_EXPIRES_S} seconds (7 days, SigV4's limit)"
        )


class Grantor:
    """Signs grants with the store's full credential: the coordinator's side."""

    def __init__(self, cfg: StoreConfig, *, timeout_s: float = 30.0) -> None:
        self.cfg = cfg
        # SigV4 ("s3v4"): botocore presigns with SigV2 by default, which R2 refuses and which signs no headers
        self.client, _ = s3_client(cfg, timeout_s, signature_version="s3v4")  # the coordinator's credential

    def _presign(self, op: str, expires_s: int, **params: Any) -> str:
        try:
            url = self.client.generate_presigned_url(
                op, Params={"Bucket": self.cfg.bucket, **params}, ExpiresIn=expires_s
            )
        except botocore.exceptions.BotoCoreError as e:
            raise StoreError(f"object store {self.cfg.endpoint_url}: cannot presign {op}: {e}") from e
        return str(url)

    def grant(self, key: str, expires_s: int) -> Grant:
        """A write-once PUT of `key` for `expires_s` seconds."""
        _check_expires(expires_s)
        expires_at = math.floor(time.time()) + expires_s  # at or before the signed X-Amz-Date + expiry
        return Grant(key, self._presign("put_object", expires_s, Key=key, IfNoneMatch="*"), expires_at)

    def grants(self, keys: Iterable[str], expires_s: int) -> Grants:
        return Grants(puts=tuple(self.grant(k, expires_s) for k in keys))

    def presign_create_multipart(self, key: str, expires_s: int) -> str:
        """A presigned CreateMultipartUpload of `key` (POST): for a node that starts its own upload and then
        asks for its parts (`presign_parts`). `open_multipart` needs no second trip to the coordinator."""
        _check_expires(expires_s)
        return self._presign("create_multipart_upload", expires_s, Key=key)

    def presign_parts(self, key: str, upload_id: str, parts: int, expires_s: int) -> tuple[str, ...]:
        """Presigned UploadPart URLs of `upload_id` for part numbers 1..parts."""
        _check_expires(expires_s)
        if not 1 <= parts <= MAX_PARTS:
            raise GrantError(f"parts={parts}: a multipart upload has 1..{MAX_PARTS} parts")
        return tuple(
            self._presign("upload_part", expires_s, Key=key, UploadId=upload_id, PartNumber=n)
            for n in range(1, parts + 1)
        )

    def presign_complete(self, key: str, upload_id: str, expires_s: int) -> str:
        """A presigned CompleteMultipartUpload of `upload_id`, with `If-None-Match: *` signed."""
        _check_expires(expires_s)
        return self._presign(
            "complete_multipart_upload", expires_s, Key=key, UploadId=upload_id, IfNoneMatch="*"
        )

    def open_multipart(self, key: str, parts: int, expires_s: int) -> MultipartGrant:
        """Opens a multipart upload of `key` (with the full credential) and presigns its pieces: a node can
        then write a checkpoint of up to `parts` parts without the coordinator, until the grant expires.
        An upload never completed holds its parts until `abort` (or a bucket lifecycle rule: R2's default
        aborts it after 7 days)."""
        _check_expires(expires_s)
        expires_at = math.floor(time.time()) + expires_s
        try:
            upload_id = str(self.client.create_multipart_upload(Bucket=self.cfg.bucket, Key=key)["UploadId"])
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as e:
            raise StoreError(
                f"object store {self.cfg.endpoint_url}: opening an upload of {key} failed: {e}"
            ) from e
        return MultipartGrant(
            key=key,
            upload_id=upload_id,
            part_urls=self.presign_parts(key, upload_id, parts, expires_s),
            complete_url=self.presign_complete(key, upload_id, expires_s),
            expires_at=expires_at,
        )

    def abort(self, upload: MultipartGrant) -> None:
        """Aborts an upload granted but not completed (its parts are deleted); one gone already is fine."""
        try:
            self.client.abort_multipart_upload(
                Bucket=self.cfg.bucket, Key=upload.key, UploadId=upload.upload_id
            )
        except botocore.exceptions.ClientError as e:
            if e.response["Error"]["Code"] not in ("NoSuchUpload", "404"):
                raise StoreError(f"object store {self.cfg.endpoint_url}: abort of {upload.key}: {e}") from e
        except botocore.exceptions.BotoCoreError as e:
            raise StoreError(f"object store {self.cfg.endpoint_url}: abort of {upload.key}: {e}") from e


@dataclass
class _Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes = field(repr=False)


_CODE = re.compile(rb"<Code>([^<]{1,128})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,512})</Message>")
_ETAG = re.compile(rb"<ETag>([^<]{1,256})</ETag>")


def _s3_error(body: bytes) -> str:
    code, message = _CODE.search(body), _MESSAGE.search(body)
    return ": ".join(m.group(1).decode(errors="replace") for m in (code, message) if m is not None)


class GrantedStore(ObjectStore):
    """An ObjectStore that reads with `cfg`'s credential (a read-only one) and writes only through its
    grants, over plain HTTP: `put_if_absent`, `put` (write-once too) and `upload_file` (a multipart grant,
    or one PUT for a file of at most `part_bytes`). It cannot delete or overwrite: `delete` and
    `put_if_match` raise StoreError, a key without a grant raises NoGrant before anything is sent."""

    write_once = True

    def __init__(
        self,
        cfg: StoreConfig,
        grants: Grants | None = None,
        *,
        timeout_s: float = 30.0,
        part_workers: int = 4,
        refill: Callable[[], None] | None = None,
        refill_every_s: float = 2.0,
    ) -> None:
        """refill: called (at most once per `refill_every_s`) when a write finds no grant, to fetch newer
        grants (`add_grants`) before the write gives up with NoGrant."""
        super().__init__(cfg, timeout_s=timeout_s)
        self._grants_lock = threading.Lock()
        self._refill, self.refill_every_s = refill, refill_every_s
        self._refill_lock = threading.Lock()
        self._refilled_at = -math.inf
        self.part_bytes: int | None = None
        """The part size of this store's multipart uploads, in place of the caller's (set from the grant
        mail: the coordinator sized the part count of its multipart grants for it); None: the caller's."""
        self._puts: dict[str, Grant] = {}
        self._uploads: dict[str, MultipartGrant] = {}
        self.part_workers = part_workers
        # retries as the boto3 client's: resets and 429/5xx with backoff (PUT and POST here are idempotent:
        # a repeated write-once PUT answers 412, a repeated completion the completed object)
        self._http = urllib3.PoolManager(
            num_pools=4,
            maxsize=max(4, part_workers),
            timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
            retries=urllib3.Retry(
                total=3,
                backoff_factor=0.2,
                status_forcelist=(429, 500, 502, 503, 504),
                allowed_methods=frozenset({"PUT", "POST"}),
                raise_on_status=False,
            ),
        )
        if grants is not None:
            self.add_grants(grants)

    def add_grants(self, grants: Grants) -> None:
        """Adds (or renews: of two grants of a key the one that expires later is kept) what this node may
        write."""
        with self._grants_lock:
            for g in grants.puts:
                if g.key not in self._puts or g.expires_at >= self._puts[g.key].expires_at:
                    self._puts[g.key] = g
            for u in grants.uploads:
                if u.key not in self._uploads or u.expires_at >= self._uploads[u.key].expires_at:
                    self._uploads[u.key] = u

    def _send(
        self, op: str, key: str, method: str, url: str, body: bytes, headers: dict[str, str]
    ) -> _Answer:
        t0 = time.perf_counter()
        try:
            r = self._http.request(method, url, body=body, headers=headers)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            self.ops.note(op, "error", time.perf_counter() - t0)
            raise self._fail(f"{op} {key} (through its grant)", e) from e
        status = r.status
        outcome = (
            "ok" if status < 300 else {404: "not_found", 412: "precondition_failed"}.get(status, "error")
        )
        self.ops.note(op, outcome, time.perf_counter() - t0)
        return _Answer(status, r.headers, r.data)

    def _refused(self, what: str, key: str, a: _Answer, expires_at: float) -> StoreError:
        hint = (
            "ask the coordinator for fresh grants"
            if time.time() > expires_at
            else "check the grant is this key's"
        )
        return StoreError(
            f"object store {self.cfg.endpoint_url} refused {what} {key} through its grant (expires "
            f"{time.strftime('%H:%M:%S', time.gmtime(expires_at))} UTC): {a.status} {_s3_error(a.body)}; {hint}"
        )

    def _ask_for_more(self) -> None:
        """A write found no grant: fetch newer ones (`refill`), unless asked within `refill_every_s`."""
        if self._refill is None:
            return
        with self._refill_lock:
            if time.monotonic() - self._refilled_at < self.refill_every_s:
                return
            self._refilled_at = time.monotonic()
            self._refill()

    def may_write(self, key: str) -> bool:
        return self.holds(key)

    def holds(self, key: str) -> bool:
        """Whether this store holds a grant to write `key` that is not about to expire, after asking for
        newer grants if not (one about to expire still counts: it is used if no newer one came)."""
        for attempt in range(2):
            with self._grants_lock:
                found = [g.expires_at for g in (self._puts.get(key), self._uploads.get(key)) if g is not None]
            if found and max(found) > time.time() + EXPIRY_MARGIN_S:
                return True
            if attempt == 0:
                self._ask_for_more()
        return bool(found)

    def _grant(self, key: str) -> Grant:
        self.holds(key)  # asks for newer grants when none is held or it is about to expire
        with self._grants_lock:
            g = self._puts.get(key)
        if g is None:
            raise NoGrant(f"no grant to write {key}: a node writes only the keys the coordinator granted it")
        return g

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        g = self._grant(key)
        a = self._send("PutObject", key, "PUT", g.url, data, WRITE_ONCE)
        if a.status == 412 or (a.status == 409 and b"ConditionalRequestConflict" in a.body):
            return None
        if a.status >= 300:
            raise self._refused("PUT", key, a, g.expires_at)
        self._count(up=len(data))
        return str(a.headers.get("ETag", ""))

    def put(self, key: str, data: bytes) -> str:
        """Writes `key` once: a grant cannot replace an object, so an existing key holding other bytes is
        a StoreError (the same bytes are this write, landed by an attempt whose answer was lost)."""
        etag = self.put_if_absent(key, data)
        if etag is None:
            try:
                found = self.get_with_etag(key, max_bytes=len(data))
            except ObjectTooLarge:
                found = None
            if found is None or found[0] != data:
                raise StoreError(f"{key} exists already: a grant writes its key once and cannot replace it")
            return found[1]
        return etag

    def put_if_match(self, key: str, data: bytes, etag: str) -> str | None:
        raise StoreError(f"cannot replace {key}: a node writing through grants writes each key once")

    def delete(self, key: str) -> None:
        raise StoreError(f"cannot delete {key}: a node writing through grants holds no delete right")

    def upload_file(
        self, path: str | os.PathLike[str], key: str, *, part_bytes: int = DEFAULT_PART_BYTES
    ) -> ObjectInfo:
        """Writes the file at `path` to `key` once: by its multipart grant (parts of `part_bytes`, larger
        if the grant has too few part URLs for them), or for a file of at most `part_bytes` by its PUT
        grant. Returns the stored object's size and ETag."""
        part_bytes = self.part_bytes or part_bytes
        check_part_bytes(part_bytes)
        size = os.path.getsize(path)
        self.holds(key)  # asks for newer grants when none is held or it is about to expire
        with self._grants_lock:
            upload, single = self._uploads.get(key), self._puts.get(key)
        if single is not None and (size <= part_bytes or upload is None):
            with open(path, "rb") as f:
                self.put(key, f.read())
        elif upload is not None:
            self._upload_parts(path, size, upload, part_bytes)
            with self._grants_lock:
                self._uploads.pop(key, None)  # its upload id is spent
        else:
            raise NoGrant(f"no grant to write {key}: a node writes only the keys the coordinator granted it")
        info = self.head(key)
        if info is None:
            raise StoreError(f"object store {self.cfg.endpoint_url}: {key} is absent right after its upload")
        return info

    def _upload_parts(
        self, path: str | os.PathLike[str], size: int, u: MultipartGrant, part_bytes: int
    ) -> None:
        part = max(part_bytes, -(-size // len(u.part_urls)))
        count = max(1, -(-size // part))

        def send(i: int) -> str:
            data = os.pread(fd, part, i * part)
            a = self._send("UploadPart", u.key, "PUT", u.part_urls[i], data, {})
            if a.status >= 300:
                raise self._refused(f"part {i + 1} of", u.key, a, u.expires_at)
            self._count(up=len(data))
            return str(a.headers.get("ETag", ""))

        with open(path, "rb") as f, ThreadPoolExecutor(max(1, min(self.part_workers, count))) as pool:
            fd = f.fileno()
            etags = list(pool.map(send, range(count)))
        body = (
            "<CompleteMultipartUpload>"
            + "".join(
                f"<Part><PartNumber>{n}</PartNumber><ETag>{escape(e)}</ETag></Part>"
                for n, e in enumerate(etags, 1)
            )
            + "</CompleteMultipartUpload>"
        ).encode()
        headers = {**WRITE_ONCE, "Content-Type": "application/xml"}
        a = self._send("CompleteMultipartUpload", u.key, "POST", u.complete_url, body, headers)
        if a.status == 412:
            raise StoreError(f"{u.key} exists already: a grant writes its key once and cannot replace it")
        # S3 may answer 200 and still fail the completion in the body
        if a.status >= 300 or _ETAG.search(a.body) is None:
            raise self._refused("the completion of", u.key, a, u.expires_at)

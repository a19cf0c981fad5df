"""A front before the embedded S3 server (moto) that checks every request's signature as R2 does.

moto takes any request: it checks neither a signature, nor a presigned URL's expiry, nor what a URL was
signed for, so a test on it cannot show that a node holding only its grants (protocol/net/grants.py) is
held to them. This front passes a request to moto only if R2 (or S3) would take it, by SigV4
(https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-authenticating-requests.html), recomputing the
signature with botocore's own signers and the known secret:

- header-signed (`Authorization: AWS4-HMAC-SHA256 ...`): a known key, the signature over the method, path,
  query and the headers it names, `X-Amz-Date` within 15 minutes, the body's SHA-256 equal to the signed
  `x-amz-content-sha256` (unless that says UNSIGNED-PAYLOAD or the trailer form);
- presigned (`?X-Amz-Signature=...`): the same signature over the query less X-Amz-Signature, with
  UNSIGNED-PAYLOAD; `X-Amz-Date + X-Amz-Expires` not passed; every signed header present (a grant's
  `If-None-Match: *`), so a URL cannot be used for another method or key, late, or without its condition;
- the read-only key pair: GET and HEAD only (reads and LISTs);
- anything else, unsigned or SigV2 (R2 takes neither) included: 403 with an S3 XML error.

Started by `scripts/embedded_store.py` (`s3_server(front=True)`, `embedded_store(..., front=True)`,
`python -m scripts.embedded_store --front`), or on its own:
  python -m scripts.store_front --upstream http://127.0.0.1:PORT [--host 127.0.0.1] [--port 0]
prints `FRONT http://HOST:PORT` once it serves, and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import hashlib
import hmac
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import quote, unquote
from xml.sax.saxutils import escape

import aiohttp
import yarl
from aiohttp import web
from botocore.auth import (
    SIGV4_TIMESTAMP,
    STREAMING_UNSIGNED_PAYLOAD_TRAILER,
    UNSIGNED_PAYLOAD,
    S3SigV4Auth,
    S3SigV4QueryAuth,
)
from botocore.awsrequest import AWSRequest
from botocore.compat import HTTPHeaders
from botocore.credentials import Credentials

ALGORITHM = "AWS4-HMAC-SHA256"
SKEW_S = 15 * 60
"""S3's allowed clock skew for a header-signed request (RequestTimeTooSkewed past it)."""
MAX_EXPIRES_S = 7 * 24 * 3600
"""The longest X-Amz-Expires SigV4 takes (7 days)."""
MAX_BODY_BYTES = 1 << 30
"""The largest request body the front reads (it hashes and forwards bodies whole): a checkpoint part is
64 MiB by default, a single PUT of the local swarm far less."""
FULL_KEY = ("crucible", "crucible")
"""The full credential: the loopback placeholder that protocol/net/store.py signs with when none is set."""
READ_ONLY_KEY = ("crucible-read-only", "crucible-read-only")
"""A second key pair, allowed GET and HEAD only: what a node that writes through grants reads with."""

_HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer")
    + ("transfer-encoding", "upgrade", "expect", "host", "content-length")
)
_HEX64 = re.compile(r"[0-9a-f]{64}")
_AUTH_HEADER = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([^,\s]+),\s*SignedHeaders=([^,\s]+),\s*Signature=(\S+)"
)


@dataclass(frozen=True)
class FrontKeys:
    """The key pairs the front knows: (access key id, secret)."""

    full: tuple[str, str] = FULL_KEY
    """May do anything: the coordinator's (and a single operator's) credential."""
    read_only: tuple[str, str] = READ_ONLY_KEY
    """GET and HEAD only."""


class Refused(Exception):
    """A request R2 would refuse: answered with an S3 XML error, never passed on."""

    def __init__(self, code: str, message: str, status: int = 403) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.status = code, message, status

    def xml(self) -> bytes:
        return (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{self.code}</Code><Message>{escape(self.message)}</Message></Error>"
        ).encode()


class _SignsNamedHeaders:
    """Makes a botocore SigV4 signer sign exactly the headers a request names (SignedHeaders), as a
    verifier must, instead of every header it finds."""

    signed: list[str]

    def headers_to_sign(self, request: AWSRequest) -> HTTPHeaders:
        out = HTTPHeaders()
        for name in self.signed:
            for value in request.headers.get_all(name) or ():
                out[name] = value
        return out


class _HeaderSigner(_SignsNamedHeaders, S3SigV4Auth):
    pass


class _QuerySigner(_SignsNamedHeaders, S3SigV4QueryAuth):
    pass


def _signature(
    signer_cls: type[_HeaderSigner] | type[_QuerySigner],
    secret: str,
    scope: list[str],
    signed: list[str],
    *,
    method: str,
    path: str,
    query: list[tuple[str, str]],
    headers: dict[str, list[str]],
    stamp: str,
) -> str:
    """The SigV4 signature of the request as described, by botocore's signer with the known secret."""
    access, _date, region, service, _ = scope
    signer = signer_cls(Credentials(access, secret), service, region)
    signer.signed = signed
    # S3 encodes the path once, as botocore sends it (`/` and `~` kept), whatever the client escaped
    request = AWSRequest(method=method, url="http://front" + quote(unquote(path), safe="/~"), params=query)
    for name in signed:
        for value in headers.get(name, ()):
            request.headers[name] = value
    request.context["timestamp"] = stamp
    canonical = signer.canonical_request(request)
    return str(signer.signature(signer.string_to_sign(request, canonical), request))


def _stamp_time(stamp: str) -> float:
    try:
        return calendar.timegm(time.strptime(stamp, SIGV4_TIMESTAMP))
    except ValueError:
        raise Refused("AccessDenied", f"X-Amz-Date {stamp!r} is not of the form 20260102T030405Z") from None


def _scope(credential: str, stamp: str) -> list[str]:
    """access/date/region/s3/aws4_request, checked."""
    scope = credential.split("/")
    if len(scope) != 5 or scope[3] != "s3" or scope[4] != "aws4_request" or scope[1] != stamp[:8]:
        raise Refused(
            "AuthorizationHeaderMalformed",
            f"credential {credential!r} is not ACCESS/{stamp[:8]}/REGION/s3/aws4_request",
            400,
        )
    return scope


def check(
    method: str, target: str, headers: dict[str, list[str]], body: bytes, keys: FrontKeys, now: float
) -> str:
    """Whether R2 would take this request: returns the access key it was signed with, or raises Refused.

    target: the request line's target as sent (path and query, still percent-encoded); headers: lowercase
    name -> values."""
    path, _, raw_query = target.partition("?")
    query = [(unquote(k), unquote(v)) for k, _, v in (p.partition("=") for p in raw_query.split("&") if p)]
    params = dict(query)
    auth = (headers.get("authorization") or [""])[0]
    if "X-Amz-Signature" in params and auth:
        raise Refused(
            "InvalidArgument", "only one auth mechanism allowed: a header or a presigned query", 400
        )
    if "X-Amz-Signature" in params:
        access = _check_presigned(method, path, query, params, headers, keys, now)
    elif auth.startswith(ALGORITHM + " "):
        access = _check_header_signed(method, path, query, auth, headers, body, keys, now)
    elif auth or "Signature" in params:
        raise Refused("AccessDenied", "only SigV4 (AWS4-HMAC-SHA256) signatures are accepted")
    else:
        raise Refused("AccessDenied", "the request is not signed: sign it or use a presigned URL")
    if access == keys.read_only[0] and method not in ("GET", "HEAD"):
        raise Refused("AccessDenied", f"the read-only key may not {method}")
    return access


def _secret(access: str, keys: FrontKeys) -> str:
    for known, secret in (keys.full, keys.read_only):
        if access == known:  # access key ids are not secret (and may hold anything: no compare_digest)
            return secret
    raise Refused("InvalidAccessKeyId", f"the access key {access!r} does not exist")


def _check_presigned(
    method: str,
    path: str,
    query: list[tuple[str, str]],
    params: dict[str, str],
    headers: dict[str, list[str]],
    keys: FrontKeys,
    now: float,
) -> str:
    missing = [
        p
        for p in ("X-Amz-Algorithm", "X-Amz-Credential", "X-Amz-Date", "X-Amz-Expires", "X-Amz-SignedHeaders")
        if p not in params
    ]
    if missing or params["X-Amz-Algorithm"] != ALGORITHM:
        raise Refused(
            "AuthorizationQueryParametersError",
            f"a presigned URL needs X-Amz-Algorithm={ALGORITHM}"
            + (f"; missing {', '.join(missing)}" if missing else ""),
            400,
        )
    stamp = params["X-Amz-Date"]
    scope = _scope(params["X-Amz-Credential"], stamp)
    given_expires = params["X-Amz-Expires"]
    expires = int(given_expires) if given_expires.isascii() and given_expires.isdigit() else -1
    if not 1 <= expires <= MAX_EXPIRES_S:
        raise Refused(
            "AuthorizationQueryParametersError", f"X-Amz-Expires must be 1..{MAX_EXPIRES_S} seconds", 400
        )
    signed_at = _stamp_time(stamp)
    if now > signed_at + expires:
        raise Refused("AccessDenied", "Request has expired")
    if signed_at > now + SKEW_S:
        raise Refused("AccessDenied", "Request is not valid yet")
    signed = params["X-Amz-SignedHeaders"].split(";")
    _check_signed_headers(signed, headers)
    unsigned = sorted(h for h in headers if h.startswith("x-amz-") and h not in signed)
    if unsigned:  # as S3 does: a grant's holder must not add a storage class, encryption or ACL of its own
        raise Refused(
            "AccessDenied", f"There were headers present in the request which were not signed: {unsigned}"
        )
    expected = _signature(
        _QuerySigner,
        _secret(scope[0], keys),
        scope,
        signed,
        method=method,
        path=path,
        query=[(k, v) for k, v in query if k != "X-Amz-Signature"],
        headers=headers,
        stamp=stamp,
    )
    if not hmac.compare_digest(expected.encode(), params["X-Amz-Signature"].encode()):
        raise Refused(
            "SignatureDoesNotMatch", "the signature does not match the method, key, query and signed headers"
        )
    return scope[0]


def _check_header_signed(
    method: str,
    path: str,
    query: list[tuple[str, str]],
    auth: str,
    headers: dict[str, list[str]],
    body: bytes,
    keys: FrontKeys,
    now: float,
) -> str:
    m = _AUTH_HEADER.fullmatch(auth.strip())
    stamp = (headers.get("x-amz-date") or [""])[0]
    if m is None or not stamp:
        raise Refused(
            "AuthorizationHeaderMalformed",
            "expected Authorization: AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=... "
            "and an X-Amz-Date header",
            400,
        )
    credential, signed_names, given = m.groups()
    scope = _scope(credential, stamp)
    if abs(now - _stamp_time(stamp)) > SKEW_S:
        raise Refused(
            "RequestTimeTooSkewed", "the difference between the request time and the server's is too large"
        )
    signed = signed_names.split(";")
    if "x-amz-content-sha256" not in signed:
        raise Refused("AccessDenied", "x-amz-content-sha256 must be a signed header")
    _check_signed_headers(signed, headers)
    content_sha = headers["x-amz-content-sha256"][0]
    if _HEX64.fullmatch(content_sha):
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), content_sha):
            raise Refused("XAmzContentSHA256Mismatch", "the body's SHA-256 is not x-amz-content-sha256", 400)
    elif content_sha not in (UNSIGNED_PAYLOAD, STREAMING_UNSIGNED_PAYLOAD_TRAILER):
        raise Refused(
            "NotImplemented", f"x-amz-content-sha256 {content_sha!r} is not taken by this front", 501
        )
    expected = _signature(
        _HeaderSigner,
        _secret(scope[0], keys),
        scope,
        signed,
        method=method,
        path=path,
        query=query,
        headers=headers,
        stamp=stamp,
    )
    if not hmac.compare_digest(expected.encode(), given.encode()):
        raise Refused("SignatureDoesNotMatch", "the signature does not match the request and its secret")
    return scope[0]


def _check_signed_headers(signed: list[str], headers: dict[str, list[str]]) -> None:
    if "host" not in signed:
        raise Refused("AccessDenied", "host must be a signed header")
    absent = [name for name in signed if name not in headers]
    if absent:
        raise Refused("AccessDenied", f"signed header(s) {', '.join(absent)} missing from the request")


@dataclass
class FrontStats:
    """What the front passed and refused, for tests to assert on."""

    passed: int = 0
    refused: list[tuple[str, str, str]] = field(default_factory=list)
    """(method, path, S3 error code) of each refused request."""


class StoreFront:
    """`url` serves the S3 API of `upstream` to requests that pass `check`; aiohttp on a thread of its own."""

    def __init__(self, upstream: str, keys: FrontKeys | None = None, host: str = "127.0.0.1", port: int = 0):
        self.upstream = upstream.rstrip("/")
        self.keys = keys or FrontKeys()
        self.stats = FrontStats()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="store-front", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        h, p = asyncio.run_coroutine_threadsafe(self._start(host, port), self._loop).result(timeout=30)
        self.url = f"http://{h}:{p}"

    async def _start(self, host: str, port: int) -> tuple[str, int]:
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=120)
        )
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.read()
        except (
            ConnectionResetError
        ):  # the client went away mid-request (its process killed): nothing to answer
            return web.Response(status=400)
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        target = request.raw_path
        try:
            await asyncio.to_thread(check, request.method, target, headers, body, self.keys, time.time())
        except Refused as e:
            with self._lock:
                self.stats.refused.append((request.method, target.partition("?")[0], e.code))
            return web.Response(status=e.status, body=e.xml(), content_type="application/xml")
        with self._lock:
            self.stats.passed += 1
        return await self._forward(request, target, body)

    async def _forward(self, request: web.Request, target: str, body: bytes) -> web.StreamResponse:
        assert self._session is not None
        sent = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        async with self._session.request(
            request.method,
            yarl.URL(self.upstream + target, encoded=True),
            headers=sent,
            data=body if body else None,
            allow_redirects=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        ) as up:
            payload = await up.read()
            kept: list[tuple[str, str]] = [
                (k, v) for k, v in up.headers.items() if k.lower() not in _HOP_BY_HOP
            ]
            if request.method == "HEAD" and "Content-Length" in up.headers:
                # no body, but the object's size as the store answered it
                kept.append(("Content-Length", up.headers["Content-Length"]))
                return web.Response(status=up.status, headers=kept)
            return web.Response(status=up.status, headers=kept, body=payload)


@contextlib.contextmanager
def store_front(
    upstream: str, keys: FrontKeys | None = None, host: str = "127.0.0.1", port: int = 0
) -> Iterator[StoreFront]:
    """A StoreFront before `upstream` for the `with` block."""
    front = StoreFront(upstream, keys, host, port)
    try:
        yield front
    finally:
        front.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Check SigV4 signatures before an S3 server, as R2 does.")
    ap.add_argument("--upstream", required=True, help="the S3 server to front, e.g. http://127.0.0.1:5000")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0, help="port (default: any free port)")
    args = ap.parse_args(argv)
    with store_front(args.upstream, host=args.host, port=args.port) as front:
        print(f"FRONT {front.url}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())

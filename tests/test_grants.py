"""Write grants on a store that enforces them as R2 does (issue 21, acceptance 6, the store's half).

A real moto server behind the real front (scripts/store_front.py) on loopback: the coordinator's
`Grantor` signs with the full key pair, the node (`GrantedStore`) holds only its grants and the read-only
key pair. What a node may do passes; every write outside its grants is refused by the store itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import boto3
import pytest
import urllib3

from protocol.net.grants import (
    MAX_EXPIRES_S,
    WRITE_ONCE,
    GrantedStore,
    GrantError,
    Grantor,
    Grants,
    NoGrant,
)
from protocol.net.store import MIN_PART_BYTES, ObjectStore, StoreConfig, StoreError
from scripts.embedded_store import embedded_store, s3_server
from scripts.store_front import FULL_KEY, READ_ONLY_KEY, StoreFront, store_front

BUCKET = "grants"
RUN = "run-g"
http = urllib3.PoolManager(retries=False)


@pytest.fixture(scope="module")
def front() -> Iterator[StoreFront]:
    """moto behind the front for this module; the bucket made with the full credential."""
    with s3_server() as upstream, store_front(upstream) as f:
        ObjectStore(_cfg(f, FULL_KEY)).ensure_bucket()
        yield f


def _cfg(front: StoreFront, key: tuple[str, str]) -> StoreConfig:
    return StoreConfig(endpoint_url=front.url, bucket=BUCKET, access_key=key[0], secret_key=key[1])


@pytest.fixture(scope="module")
def grantor(front: StoreFront) -> Grantor:
    return Grantor(_cfg(front, FULL_KEY))


@pytest.fixture(scope="module")
def reader(front: StoreFront) -> ObjectStore:
    return ObjectStore(_cfg(front, READ_ONLY_KEY))


def _refused(front: StoreFront, r: urllib3.BaseHTTPResponse, code: str) -> None:
    assert r.status in (400, 403), (r.status, r.data)
    assert f"<Code>{code}</Code>".encode() in r.data, r.data
    assert front.stats.refused[-1][2] == code


def _signed_headers(url: str) -> list[str]:
    return parse_qs(urlsplit(url).query)["X-Amz-SignedHeaders"][0].split(";")


def test_a_node_holding_only_its_grants_writes_its_key_and_a_multipart_checkpoint(
    front: StoreFront, grantor: Grantor, reader: ObjectStore, tmp_path: Path
) -> None:
    frag, ckpt = f"{RUN}/sync/0/r/1/fragment", f"{RUN}/ckpt/4/0/1/tensors"
    grant, upload = grantor.grant(frag, 600), grantor.open_multipart(ckpt, parts=3, expires_s=600)
    node = GrantedStore(_cfg(front, READ_ONLY_KEY), Grants(puts=(grant,), uploads=(upload,)))
    assert _signed_headers(grant.url) == ["host", "if-none-match"]
    assert _signed_headers(upload.complete_url) == ["host", "if-none-match"]

    assert node.put_if_absent(frag, b"my fragment")
    blob = os.urandom(3 * MIN_PART_BYTES)
    path = tmp_path / "tensors"
    path.write_bytes(blob)
    info = node.upload_file(path, ckpt, part_bytes=MIN_PART_BYTES)

    assert info.size == len(blob) and info.etag.endswith('-3"')
    assert reader.get(frag) == b"my fragment" and reader.get(ckpt) == blob
    calls, _ = node.ops.snapshot()
    assert calls[("PutObject", "ok")] == 1 and calls[("UploadPart", "ok")] == 3
    assert calls[("CompleteMultipartUpload", "ok")] == 1
    assert node.bytes_up == len(blob) + len(b"my fragment")
    assert node.get(ckpt) == blob  # and it reads with the read-only pair


def test_writes_outside_a_node_s_grants_are_refused_by_the_store(
    front: StoreFront, grantor: Grantor, reader: ObjectStore
) -> None:
    mine, other = f"{RUN}/sync/1/r/0/fragment", f"{RUN}/sync/1/r/1/fragment"
    g = grantor.grant(mine, 600)
    put = dict(WRITE_ONCE)

    # the URL of my key, used for another replica's key or method
    _refused(
        front,
        http.request("PUT", g.url.replace("/r/0/", "/r/1/"), body=b"x", headers=put),
        "SignatureDoesNotMatch",
    )
    _refused(front, http.request("DELETE", g.url, headers=put), "SignatureDoesNotMatch")
    # a forged signature; the signed condition left out, or changed
    forged = g.url[:-1] + ("0" if g.url[-1] != "0" else "1")
    _refused(front, http.request("PUT", forged, body=b"x", headers=put), "SignatureDoesNotMatch")
    _refused(front, http.request("PUT", g.url, body=b"x"), "AccessDenied")
    _refused(
        front,
        http.request("PUT", g.url, body=b"x", headers={"If-None-Match": '"abc"'}),
        "SignatureDoesNotMatch",
    )
    # a header of its own beside the signed ones (an archived storage class makes the object unreadable
    # to every replica that lists it; S3 refuses unsigned x-amz- headers on a presigned request)
    _refused(
        front,
        http.request("PUT", g.url, body=b"x", headers={**put, "x-amz-storage-class": "GLACIER"}),
        "AccessDenied",
    )
    # unsigned, and signed with SigV2 (R2 takes neither) or with a wrong secret
    _refused(front, http.request("PUT", f"{front.url}/{BUCKET}/{other}", body=b"x"), "AccessDenied")
    v2 = boto3.client(
        "s3",
        endpoint_url=front.url,
        aws_access_key_id=FULL_KEY[0],
        aws_secret_access_key=FULL_KEY[1],
        region_name="us-east-1",
    ).generate_presigned_url("put_object", Params={"Bucket": BUCKET, "Key": other})
    assert "Signature=" in v2 and "X-Amz-Signature" not in v2
    _refused(front, http.request("PUT", v2, body=b"x"), "AccessDenied")
    with pytest.raises(StoreError, match="SignatureDoesNotMatch"):
        ObjectStore(_cfg(front, (FULL_KEY[0], "not-the-secret"))).put(other, b"x")
    assert reader.get(other) is None and reader.get(mine) is None

    # a node holding only its grant: writes its key once, nothing else
    node = GrantedStore(_cfg(front, READ_ONLY_KEY), Grants(puts=(g,)))
    assert node.put_if_absent(mine, b"first")
    assert node.put_if_absent(mine, b"second") is None
    with pytest.raises(StoreError, match="exists already"):
        node.put(mine, b"second")
    assert node.put(mine, b"first")  # the same bytes: a retried write that had landed
    with pytest.raises(NoGrant):
        node.put_if_absent(other, b"x")
    with pytest.raises(StoreError, match="cannot delete"):
        node.delete(mine)
    r = http.request("PUT", g.url, body=b"third", headers=put)  # the store itself refuses the overwrite
    assert r.status == 412
    assert reader.get(mine) == b"first" and reader.get(other) is None

    # an expired grant
    late = f"{RUN}/sync/2/r/0/fragment"
    expired = grantor.grant(late, expires_s=1)
    time.sleep(max(0.0, expired.expires_at + 1.1 - time.time()))
    _refused(front, http.request("PUT", expired.url, body=b"x", headers=put), "AccessDenied")
    assert front.stats.refused[-1][1].endswith(late)
    with pytest.raises(StoreError, match="Request has expired.*fresh grants"):
        GrantedStore(_cfg(front, READ_ONLY_KEY), Grants(puts=(expired,))).put_if_absent(late, b"x")
    assert reader.get(late) is None


def test_a_multipart_grant_is_bound_to_its_parts_and_writes_its_key_once(
    front: StoreFront, grantor: Grantor, reader: ObjectStore, tmp_path: Path
) -> None:
    key = f"{RUN}/ckpt/8/0/0/tensors"
    first = grantor.open_multipart(key, parts=2, expires_s=600)
    part1 = first.part_urls[0]
    _refused(
        front,
        http.request("PUT", part1.replace("partNumber=1", "partNumber=2"), body=b"x"),
        "SignatureDoesNotMatch",
    )
    _refused(
        front, http.request("POST", first.complete_url, body=b"<x/>"), "AccessDenied"
    )  # no If-None-Match
    path = tmp_path / "small"
    path.write_bytes(b"checkpoint")
    GrantedStore(_cfg(front, READ_ONLY_KEY), Grants(uploads=(first,))).upload_file(path, key)
    assert reader.get(key) == b"checkpoint"
    # a second upload of the same key (granted to someone else, or replayed) cannot complete over it
    second = grantor.open_multipart(key, parts=1, expires_s=600)
    with pytest.raises(StoreError, match="exists already"):
        GrantedStore(_cfg(front, READ_ONLY_KEY), Grants(uploads=(second,))).upload_file(path, key)
    grantor.abort(second)
    assert reader.get(key) == b"checkpoint"


def test_the_read_only_key_reads_and_cannot_write(
    front: StoreFront, reader: ObjectStore, tmp_path: Path
) -> None:
    key = f"{RUN}/spec"
    ObjectStore(_cfg(front, FULL_KEY)).put(key, b"spec")  # the full key pair may do anything
    assert reader.get(key) == b"spec" and key in reader.list(f"{RUN}/")
    assert reader.head(key) is not None and reader.list_stamped(f"{RUN}/").objects
    n = len(front.stats.refused)
    path = tmp_path / "f"
    path.write_bytes(b"x")
    for write in (
        lambda: reader.put(key, b"x"),
        lambda: reader.put_if_absent(f"{RUN}/new", b"x"),
        lambda: reader.delete(key),
        lambda: reader.upload_file(path, f"{RUN}/new"),
    ):
        with pytest.raises(StoreError):
            write()
    assert {code for *_, code in front.stats.refused[n:]} == {"AccessDenied"}
    assert reader.get(key) == b"spec" and reader.get(f"{RUN}/new") is None


def test_the_embedded_store_serves_through_the_front_on_request() -> None:
    with embedded_store("crucible", front=True) as store:
        store.put("k", b"v")
        assert store.get("k") == b"v"
        r = http.request("GET", f"{store.cfg.endpoint_url}/crucible/k")
        assert r.status == 403 and b"<Code>AccessDenied</Code>" in r.data


def test_grants_cross_the_wire_and_malformed_ones_are_refused(grantor: Grantor) -> None:
    grants = Grants(puts=(grantor.grant("a/b", 60),), uploads=(grantor.open_multipart("a/c", 2, 60),))
    assert Grants.from_wire(grants.to_wire()) == grants
    wire = grants.to_wire()
    for bad in (
        None,
        {"puts": []},
        {**wire, "puts": [["a/b", "ftp://x", 1.0]]},
        {**wire, "puts": [["", grants.puts[0].url, 1.0]]},
        {**wire, "puts": [["a/b", grants.puts[0].url, float("nan")]]},
        {**wire, "uploads": [["a/c", "id", [], grants.uploads[0].complete_url, 1.0]]},
    ):
        with pytest.raises(GrantError):
            Grants.from_wire(bad)
    for expires_s in (0, MAX_EXPIRES_S + 1):
        with pytest.raises(GrantError, match="7 days"):
            grantor.grant("a/b", expires_s)

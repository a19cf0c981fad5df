"""Issue 21, the small ones: a hostile corpus manifest, tokenizer or data path, and a flood of malformed
HTTP requests. Each is refused with a clear error (or logged in bounded lines) and the node goes on.
Real files, real FIFOs (os.mkfifo), /dev/zero, real HTTP over loopback sockets."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from node.data.corpus import Corpus, DataSource, ShardReader
from node.data.corpus_files import DataError, scan_corpus
from node.data.tokenizer import MAX_TOKENIZER_BYTES
from node.health import HealthServer
from protocol.corpus import MAX_LINE_BYTES, ManifestError, ShardEntry, manifest_bytes, parse_manifest
from protocol.process.http_server import GuardedHTTPServer
from protocol.runspec import TrainSpec

pytestmark = pytest.mark.timeout(60)

SHA = "a" * 64
TEXT = ("a line of plain text for a corpus that is long enough to train on.\n" * 400).encode()


# --- corpus manifests ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "line",
    [
        b"[" * 100_000 + b"]" * 100_000,  # the report's case: RecursionError out of json
        b'["x",'
        + b"[" * 1500
        + b"]" * 1500
        + b',"'
        + SHA.encode()
        + b'"]',  # nested inside, under the line bound
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,  # another shape: objects
        b'["x",1,{"k":[1,2]}]',
        b'["x",1' + b"0" * 4300 + b',"' + SHA.encode() + b'"]',  # past int()'s digit limit
        b'["x",1,"' + b"b" * MAX_LINE_BYTES + b'"]',
    ],
    ids=["lists 100k deep", "nested in a list", "objects 100k deep", "object value", "huge int", "long line"],
)
def test_a_nested_or_oversized_manifest_line_is_a_manifest_error(line: bytes) -> None:
    good = manifest_bytes([ShardEntry(name="a.txt", size=1, sha256=SHA)])
    with pytest.raises(ManifestError, match="line 2: "):
        parse_manifest(good + line + b"\n", "s3://c/m")


def test_no_mutation_of_a_manifest_raises_anything_but_manifest_error() -> None:
    """2,000 random edits (brackets, quotes, escapes, digits, cuts) of a valid manifest."""
    entries = [ShardEntry(name=f"dir/part-{i:04d}.txt", size=i * 1000, sha256=f"{i:064x}") for i in range(8)]
    good = manifest_bytes(entries)
    assert parse_manifest(good, "m") == entries
    rng, alphabet = random.Random(21), b'[]{}",\\:0123456789-.eE nulltrue\n'
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[at : at + 1] = bytes([rng.choice(alphabet)])
            elif op == 1:
                data[at:at] = bytes([rng.choice(alphabet)]) * rng.choice((1, 2, 50, 1200))
            else:
                del data[at : at + rng.randint(1, 30)]
        try:
            parse_manifest(bytes(data), "m")
        except ManifestError:
            pass


# --- the tokenizer's path --------------------------------------------------------------------------
def _tokenizer(root: Path | str, ref: str) -> None:
    train = TrainSpec(data="stdlib", tokenizer=ref)
    DataSource(str(root)).tokenizer(train, 300)


def test_a_tokenizer_that_is_a_device_a_fifo_or_a_folder_is_refused_without_reading(tmp_path: Path) -> None:
    """/dev/zero used to be read forever (its size is 0); a FIFO with no writer blocked the open."""
    os.mkfifo(tmp_path / "tok.json")
    (tmp_path / "dir.json").mkdir()
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"train.tokenizer '/dev/zero' is a character device, not a regular"):
        _tokenizer(tmp_path, "/dev/zero")
    with pytest.raises(DataError, match=r"tok.json' is a FIFO, not a regular file"):
        _tokenizer(tmp_path, "tok.json")
    with pytest.raises(DataError, match=r"dir.json' is a directory, not a regular file"):
        _tokenizer(tmp_path, "dir.json")
    assert time.monotonic() - t0 < 5


def test_a_tokenizer_over_the_limit_is_refused_from_a_bounded_read(tmp_path: Path) -> None:
    with open(tmp_path / "big.json", "wb") as f:
        f.truncate(MAX_TOKENIZER_BYTES + 1)  # sparse: 64 MiB + 1 byte, nothing on disk
    with pytest.raises(DataError, match=f"'big.json' is over {MAX_TOKENIZER_BYTES >> 20} MiB"):
        _tokenizer(tmp_path, "big.json")


def test_a_relative_tokenizer_path_stays_under_the_data_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "secret.json"
    root.mkdir()
    outside.write_text("{}")
    (root / "link.json").symlink_to(outside)
    (root / "dev.json").symlink_to("/dev/zero")
    for ref in ("../secret.json", "link.json", "dev.json"):
        with pytest.raises(DataError, match=r"resolves to .*, outside --data-root .*: a relative path must"):
            _tokenizer(root, ref)
    with pytest.raises(DataError, match="not a `tokenizers` tokenizer.json"):  # absolute: read as named
        _tokenizer(root, str(outside))


# --- the corpus's paths ----------------------------------------------------------------------------
def _corpus(root: Path, data: str) -> Corpus:
    return DataSource(str(root)).corpus(TrainSpec(data=data, val_fraction=0.1), 256)


def test_relative_data_paths_stay_under_the_data_root(tmp_path: Path) -> None:
    """'..', a symlinked folder, a symlinked file inside a folder and a glob reaching out are refused; a
    symlink that stays inside is followed; an absolute path is read as named."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "books").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "a.txt").write_bytes(TEXT)
    (root / "books" / "own.txt").write_bytes(TEXT)
    (root / "out").symlink_to(elsewhere)
    (root / "mixed").mkdir()
    (root / "mixed" / "own.txt").write_bytes(TEXT)
    (root / "mixed" / "leak.txt").symlink_to(elsewhere / "a.txt")
    (root / "inside").symlink_to(root / "books")
    for ref, what in (
        ("../elsewhere", "train.data"),
        ("books/../../elsewhere/a.txt", "train.data"),
        ("out", "train.data"),
        ("mixed", "corpus file"),
        ("../*/a.txt", "train.data"),
    ):
        with pytest.raises(DataError, match=rf"^{what} .* resolves to .*outside --data-root"):
            _corpus(root, ref)
    assert _corpus(root, "inside").sha256 == _corpus(root, "books").sha256
    assert _corpus(root, str(elsewhere)).sha256


def test_a_corpus_that_names_a_device_or_a_fifo_is_refused_and_a_fifo_in_a_folder_is_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_bytes(TEXT)
    os.mkfifo(tmp_path / "books" / "pipe.txt")
    os.mkfifo(tmp_path / "alone.txt")
    with pytest.raises(DataError, match=r"--data '/dev/zero' is a character device: give 'stdlib'"):
        scan_corpus("/dev/zero")
    with pytest.raises(DataError, match=r"alone.txt' is a FIFO: give 'stdlib', a text file"):
        _corpus(tmp_path, "alone.txt")
    scan = scan_corpus(str(tmp_path / "books"))
    assert [p.name for p in scan.files] == ["a.txt"]
    # a file swapped for a FIFO after the scan: refused when it is opened, never waited on
    with pytest.raises(DataError, match="is a FIFO, not a regular file"):
        ShardReader([tmp_path / "alone.txt"], [10]).read(0, 5)


# --- malformed HTTP requests ------------------------------------------------------------------------
MALFORMED = (
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\0" * 40 + b"\r\n\r\n",  # a TLS hello
    b"GET /health HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
)


def _flood(port: int, n: int) -> None:
    for i in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(MALFORMED[i % len(MALFORMED)])
            assert s.recv(200).startswith(b"HTTP/1.0 400 Bad Request")


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith(("protocol.process.http_server", "aiohttp"))]


def test_a_flood_of_malformed_requests_logs_bounded_lines_and_the_server_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """500 malformed requests to the node's health port: at most 10 lines, none with a traceback (each
    used to be an ERROR with one), and /health answers."""
    caplog.set_level(logging.DEBUG, logger="protocol.process.http_server")
    health = HealthServer("127.0.0.1", 0, lambda: {"peer_id": "p", "state": "idle"})
    try:
        _flood(health.port, 500)
        with urllib.request.urlopen(f"http://127.0.0.1:{health.port}/health", timeout=5) as r:
            assert r.status == 200 and json.load(r)["status"] == "ok"
    finally:
        health.close()
    lines = _lines(caplog)
    assert 1 <= len(lines) <= 10 and not any(r.exc_info or r.exc_text for r in lines)
    assert (
        "health server: Error handling request from 127.0.0.1: malformed request (" in lines[0].getMessage()
    )
    assert all("\n" not in r.getMessage() for r in lines)
    assert health.request_log.suppressed == 490


def test_the_lines_not_logged_are_counted_in_one_line_when_the_interval_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The dashboard's server class with a 1 s interval: 3 lines, then one summary line even though
    the flood has stopped; the next interval logs again. A handler's own failure goes through the same
    bound and keeps its traceback (a bug, not a client's mistake)."""
    caplog.set_level(logging.DEBUG, logger="protocol.process.http_server")

    async def broken(request: web.BaseRequest) -> web.StreamResponse:
        raise RuntimeError("a bug")

    server = GuardedHTTPServer("127.0.0.1", 0, {"/broken": broken}, log_lines=3, log_interval_s=1.0)
    try:
        _flood(server.port, 50)
        deadline = time.monotonic() + 5
        while not any("more request errors" in r.getMessage() for r in _lines(caplog)):
            assert time.monotonic() < deadline, "no summary line"
            time.sleep(0.05)
        lines = _lines(caplog)
        assert len(lines) == 4
        assert lines[3].getMessage() == (
            "http server: 47 more request errors in 1 s not logged (at most 3 lines per 1 s)"
        )
        for _ in range(5):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}/broken", timeout=5)
            except urllib.error.HTTPError as e:
                assert e.code == 500
        time.sleep(0.2)
        bugs = [r for r in _lines(caplog)[4:] if "failed" in r.getMessage()]
        assert len(bugs) == 3 and bugs[0].exc_info is not None
    finally:
        server.close()

"""Issue 12: corpus specs are checked before anything starts; every text file counts, whatever its suffix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.data.corpus import load_corpus
from node.data.corpus_files import SNIFF_BYTES, DataError, is_text, scan_corpus

LICENCE = ("Permission is hereby granted, free of charge, to any person obtaining a copy. " * 60).encode()


def test_a_folder_of_licence_texts_without_suffixes_is_a_corpus(tmp_path: Path) -> None:
    for name in ("LICENSE", "COPYING", "NOTICE.apache", "README"):
        (tmp_path / name).write_bytes(LICENCE)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\0" * 100)  # hidden: not looked at
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 10)
    scan = scan_corpus(str(tmp_path))
    assert [p.name for p in scan.files] == ["COPYING", "LICENSE", "NOTICE.apache", "README"]
    assert scan.bytes == 4 * len(LICENCE) and [p.name for p in scan.binary] == ["logo.png"]
    assert scan.summary() == f"4 text files, {4 * len(LICENCE) / 1e3:.1f} KB (skipped 1 binary)"
    assert len(load_corpus(str(tmp_path))) == 4 * len(LICENCE)


@pytest.mark.parametrize(
    ("make", "phrase"),
    [
        (lambda d: None, "found 0 files, 0 text files, 0.0 KB"),
        (
            lambda d: [(d / f"b{i}.bin").write_bytes(os.urandom(4096) + b"\0") for i in range(3)],
            "skipped 3 binary",
        ),
        (lambda d: (d / "tiny.txt").write_text("hello"), "found 1 files, 1 text files"),
    ],
    ids=["empty folder", "only binary files", "too little text"],
)
def test_a_folder_without_enough_text_names_what_it_found(tmp_path: Path, make, phrase: str) -> None:  # type: ignore[no-untyped-def]
    make(tmp_path)
    with pytest.raises(DataError) as e:
        scan_corpus(str(tmp_path))
    assert phrase in str(e.value) and str(tmp_path) in str(e.value) and "example: --data" in str(e.value)


def test_a_missing_path_a_glob_without_matches_and_a_binary_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        scan_corpus(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="matches no file"):
        scan_corpus(str(tmp_path / "*.txt"))
    blob = tmp_path / "model.bin"
    blob.write_bytes(b"\0\1\2" * 10_000)
    with pytest.raises(DataError, match="is not text"):
        scan_corpus(str(blob))


def test_utf8_cut_at_the_sniff_boundary_is_still_text() -> None:
    text = ("é" * SNIFF_BYTES).encode()[: SNIFF_BYTES - 1]  # ends in half a character
    assert is_text(text) and not is_text(b"\xff\xfe" + text[2:]) and not is_text(b"ok\0")


def test_stdlib_is_a_corpus() -> None:
    scan = scan_corpus("stdlib")
    assert len(scan.files) > 100 and scan.bytes > 1_000_000 and not scan.binary

"""Which files a corpus spec names, and whether they hold text: checked before any process starts.

A spec is "stdlib" (the Python standard library's source), a file, a directory (every readable text file
under it, whatever its suffix: licence texts and READMEs have none) or a glob. A file counts as text
when its first 8 KiB hold no NUL byte and decode as UTF-8; anything else is skipped in a directory and
refused when named alone. No torch here: `crucible-swarm` runs this before it starts anything.

A run spec's paths are not trusted to name files: every file is opened with `open_regular` (a FIFO, a
device such as /dev/zero, a directory or a socket is refused, judged on the opened descriptor so a path
swapped after a check cannot block the node or feed it forever), a whole-file read has a byte bound
(`read_regular`), and a relative path must stay under the node's `--data-root` once symlinks and '..'
are resolved (`check_within`).
"""

from __future__ import annotations

import glob
import hashlib
import os
import stat
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from protocol.corpus import ShardEntry

SNIFF_BYTES = 8192
MIN_CORPUS_BYTES = 1024 * 16
"""Fewer bytes than this cannot fill a validation split and a training batch."""


class DataError(ValueError):
    """The corpus could not be loaded; the message says which path, what was found and what to do."""


@dataclass
class CorpusScan:
    """What a corpus spec holds: the text files used and what was skipped, with sizes."""

    source: str
    root: Path = Path(".")
    """What the files' manifest names are relative to: the folder, a single file's folder, the deepest
    folder holding every match of a glob, the standard library's folder."""
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    binary: list[Path] = field(default_factory=list)
    unreadable: list[Path] = field(default_factory=list)

    def summary(self) -> str:
        skipped = []
        if self.binary:
            skipped.append(f"{len(self.binary)} binary")
        if self.unreadable:
            skipped.append(f"{len(self.unreadable)} unreadable")
        rest = f" (skipped {', '.join(skipped)})" if skipped else ""
        size = f"{self.bytes / 1e6:.1f} MB" if self.bytes >= 1e6 else f"{self.bytes / 1e3:.1f} KB"
        return f"{len(self.files)} text files, {size}{rest}"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(path: Path | str, mode: int, what: str) -> DataError:
    return DataError(
        f"{what} {str(path)!r} is {_kind(mode)}, not a regular file: name a file (a FIFO or a device "
        "would block the node or never end)"
    )


def open_regular(path: Path | str, what: str = "corpus file") -> int:
    """A read-only descriptor of the regular file at `path`: OSError when it cannot be opened, DataError
    when it is anything but a regular file (checked before opening, so a device is never opened, and on
    the descriptor, so a FIFO swapped in between cannot block: it is opened non-blocking)."""
    before = os.stat(path)
    if not stat.S_ISREG(before.st_mode):
        raise _not_regular(path, before.st_mode, what)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode, what)
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path | str, max_bytes: int, what: str = "file") -> bytes:
    """At most `max_bytes + 1` bytes of the regular file at `path` (one more than the bound, so the
    caller can tell a file over it); errors as `open_regular`'s."""
    with os.fdopen(open_regular(path, what), "rb") as f:
        return f.read(max_bytes + 1)


def check_within(path: Path | str, root: Path | str, what: str) -> None:
    """DataError unless `path`, with symlinks and '..' resolved, lies under `root` (resolved too): a
    symlink inside the root that points outside is outside."""
    real, base = Path(path).resolve(), Path(root).expanduser().resolve()
    if not real.is_relative_to(base):
        raise DataError(
            f"{what} {str(path)!r} resolves to {str(real)!r}, outside --data-root {str(base)!r}: a "
            "relative path must stay under the data root (no '..' or symlinks leading out); give an "
            "absolute path to read elsewhere"
        )


def is_text(head: bytes) -> bool:
    """No NUL byte and valid UTF-8 (a multi-byte character cut at the end of `head` is allowed)."""
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


def _candidates(source: str) -> tuple[Path, list[Path], bool]:
    """(root, files, named_alone): the files a spec names and the folder their names are relative to;
    named_alone when the user named one file."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return root, sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts), False
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent, [path], True
    if path.exists() and not path.is_dir():
        raise DataError(
            f"--data {source!r} is {_kind(path.stat().st_mode)}: give 'stdlib', a text file, a directory "
            "or a glob like 'corpus/*.txt'"
        )
    if path.is_dir():
        hidden = lambda p: any(part.startswith(".") for part in p.relative_to(path).parts)  # noqa: E731
        return path, sorted(p for p in path.rglob("*") if p.is_file() and not hidden(p)), False
    matches = sorted(
        Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True) if os.path.isfile(p)
    )
    if not matches:
        what = "does not exist" if not any(c in source for c in "*?[") else "matches no file"
        raise DataError(
            f"--data {source!r} {what}: give 'stdlib', a text file, a directory or a glob like 'corpus/*.txt'"
        )
    return Path(os.path.commonpath([p.parent for p in matches])), matches, False


def scan_corpus(
    source: str, *, min_bytes: int = MIN_CORPUS_BYTES, within: Path | str | None = None
) -> CorpusScan:
    """The text files of `source` and their total size; DataError (with the counts found) when they
    hold fewer than `min_bytes`, when a file named alone is not text, or (with `within`, a data root)
    when a file resolves outside `within`."""
    root, files, alone = _candidates(source)
    scan = CorpusScan(source, root)
    for p in files:
        if within is not None:
            check_within(p, within, "corpus file")
        try:
            with os.fdopen(open_regular(p), "rb") as f:
                head = f.read(SNIFF_BYTES)
                size = os.fstat(f.fileno()).st_size
        except (OSError, DataError):  # gone, unreadable, or swapped for a FIFO since it was listed
            scan.unreadable.append(p)
            continue
        if source != "stdlib" and not is_text(head):  # (a few stdlib test files are Latin-1 on purpose)
            scan.binary.append(p)
            continue
        scan.files.append(p)
        scan.bytes += size
    if alone and scan.binary:
        raise DataError(f"--data {source!r} is not text (NUL bytes or invalid UTF-8 in its first 8 KiB)")
    if alone and scan.unreadable:
        raise DataError(f"--data {source!r} cannot be read (check its permissions)")
    if scan.bytes < min_bytes:
        raise DataError(
            f"--data {source!r}: found {len(files)} files, {scan.summary()}; need at least "
            f"{min_bytes // 1024} KB of UTF-8 text (example: --data ~/corpus or --data 'books/*.txt')"
        )
    return scan


def file_sha256(path: Path, chunk: int = 1 << 20) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks."""
    h, size = hashlib.sha256(), 0
    with os.fdopen(open_regular(path), "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def manifest_of(scan: CorpusScan) -> list[ShardEntry]:
    """The manifest entries of a scanned corpus (protocol/corpus.py), sorted by name (the order of the
    corpus's token stream, in a folder and in the store alike): each text file's name relative to the
    scan's root, its size and sha256, read now."""
    entries = []
    for p in scan.files:
        try:
            size, sha = file_sha256(p)
        except OSError as e:
            raise DataError(f"cannot read corpus file {p}: {e}") from e
        entries.append(ShardEntry(name=p.relative_to(scan.root).as_posix(), size=size, sha256=sha))
    return sorted(entries, key=lambda e: e.name)

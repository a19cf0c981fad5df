"""Corpora as random-access token streams, and deterministic batches from them.

A corpus (`train.data`) is "stdlib" (the Python standard library's source, on every machine), local text
files (a file, a folder, a glob; a relative path resolves under the node's `--data-root`) or
`s3://bucket/prefix` shards in the object store (node/data/corpus_store.py). Its token stream is the files'
bytes in name order, or with `train.tokenizer` their token ids (node/data/tokenizer.py, cached on disk). Nothing
is loaded whole and nothing is cut: windows are read from the files when a batch needs them.

The corpus's content hash (protocol/corpus.py) is computed as it is opened and must equal
`train.data_sha256` when the spec gives one. Batches are drawn by a generator seeded with
(data_seed, replica, step), so a restarted stage redraws exactly the batch it lost and every replica of a
run draws from the same stream; validation is the stream's tail.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from node.data.corpus_files import (
    DataError,
    check_within,
    manifest_of,
    open_regular,
    read_regular,
    scan_corpus,
)
from node.data.corpus_store import fetch_corpus, fetch_tokenizer
from node.data.tokenizer import (
    MAX_TOKENIZER_BYTES,
    LoadedTokenizer,
    check_vocab,
    encode_files,
    parse_tokenizer,
    token_byte_lengths,
)
from protocol.corpus import corpus_sha256, is_store_url
from protocol.net.store import ObjectStore
from protocol.runspec import TrainSpec

__all__ = ["Corpus", "DataError", "DataSource", "ShardReader", "TokenSpan", "load_corpus"]

log = logging.getLogger(__name__)

MIN_VAL_TOKENS = 4096
"""The validation tail holds at least this many tokens (val_fraction of a small corpus is less)."""
OPEN_FILES = 64
"""File descriptors a reader keeps open (the standard library alone is ~2,000 files)."""


class ShardReader:
    """The concatenation of files as one array of `itemsize`-byte items, read on demand (os.pread)."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: type[np.generic] = np.uint8) -> None:
        """sizes: each file's length in bytes, as its manifest records it (a file that has shrunk since is
        an error when a read reaches it)."""
        self.dtype = np.dtype(dtype)
        item = self.dtype.itemsize
        if any(s % item for s in sizes):
            raise DataError(f"a token file's size is not a multiple of {item} bytes: damaged cache")
        self.paths = list(paths)
        self.starts = [0]  # item offset of each file, and the total at the end
        for s in sizes:
            self.starts.append(self.starts[-1] + s // item)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.starts[-1]

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            try:
                fd = open_regular(self.paths[i])
            except OSError as e:
                raise DataError(f"cannot read corpus file {self.paths[i]}: {e}") from e
            self._fds[i] = fd
            if len(self._fds) > OPEN_FILES:
                os.close(self._fds.popitem(last=False)[1])
        else:
            self._fds.move_to_end(i)
        return fd

    def read(self, start: int, n: int) -> np.ndarray:
        """Items [start, start + n) of the concatenation."""
        if not 0 <= start <= start + n <= len(self):
            raise IndexError(f"read of [{start}, {start + n}) outside [0, {len(self)})")
        out = np.empty(n, dtype=self.dtype)
        view = out.view(np.uint8)
        item, done = self.dtype.itemsize, 0
        i = bisect.bisect_right(self.starts, start) - 1
        with self._lock:
            while done < n:
                while self.starts[i + 1] <= start + done:  # skip empty files
                    i += 1
                at = start + done - self.starts[i]
                k = min(n - done, self.starts[i + 1] - self.starts[i] - at)
                got = os.pread(self._fd(i), k * item, at * item)
                if len(got) != k * item:
                    raise DataError(f"corpus file {self.paths[i]} is shorter than when it was opened")
                view[done * item : (done + k) * item] = np.frombuffer(got, dtype=np.uint8)
                done += k
        return out

    def close(self) -> None:
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


@dataclass(frozen=True)
class TokenSpan:
    """Items [start, end) of a reader: the training part or the validation tail of a corpus."""

    reader: ShardReader
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start

    def windows(self, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
        """(b, seq_len + 1) int64 token ids beginning at each of `starts` (offsets into this span)."""
        rows = [self.reader.read(self.start + int(s), seq_len + 1) for s in starts]
        return torch.from_numpy(np.stack(rows).astype(np.int64))  # (b, L+1)


@dataclass
class Corpus:
    """A token stream split into training data and a validation tail."""

    train: TokenSpan
    val: TokenSpan
    sha256: str = ""
    """The corpus's content hash (protocol/corpus.py)."""
    vocab: int = 256
    """256 for bytes, else the tokenizer's vocabulary."""

    @classmethod
    def over(cls, reader: ShardReader, val_fraction: float, sha256: str = "", vocab: int = 256) -> Corpus:
        n = len(reader)
        n_val = min(max(int(n * val_fraction), MIN_VAL_TOKENS), n)
        return cls(TokenSpan(reader, 0, n - n_val), TokenSpan(reader, n - n_val, n), sha256, vocab)

    @classmethod
    def load(cls, source: str, val_fraction: float) -> Corpus:
        """A local corpus at byte level, unchecked (the benchmarks' and tests' way in)."""
        return DataSource().corpus(TrainSpec(data=source, val_fraction=val_fraction), 256)

    def _check(self, span: TokenSpan, seq_len: int, what: str) -> None:
        if len(span) < seq_len + 2:
            raise DataError(
                f"the corpus's {what} holds {len(span)} tokens, too few for windows of seq_len + 1 = "
                f"{seq_len + 1}: give more text (or a smaller model.seq_len)"
            )

    def train_batch(self, seed: int, replica: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
        """(batch, seq_len + 1) int64 token ids at random offsets, deterministic in (seed, replica, step)."""
        self._check(self.train, seq_len, "training part")
        g = torch.Generator().manual_seed((seed * 1_000_003 + replica) * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch,), generator=g)
        return self.train.windows(starts, seq_len)

    def val_batches(self, n_batches: int, batch: int, seq_len: int) -> list[torch.Tensor]:
        """Fixed, evenly spaced validation windows: the same on every node and every evaluation."""
        if n_batches == 0:
            return []
        self._check(self.val, seq_len, "validation tail")
        n = n_batches * batch
        span = len(self.val) - seq_len - 1
        starts = torch.tensor([math.floor(i * span / max(n - 1, 1)) for i in range(n)])
        return list(self.val.windows(starts, seq_len).split(batch))


def load_corpus(source: str) -> ShardReader:
    """The bytes of a local corpus's text files (name order), as a reader; nothing is read yet."""
    scan = scan_corpus(source)
    files = sorted(scan.files, key=lambda p: p.relative_to(scan.root).as_posix())  # the manifest's order
    return ShardReader(files, [p.stat().st_size for p in files])


def default_cache(root: str) -> Path:
    """Fetched shards and token files: `{data root}/.crucible-cache`, else ~/.crucible/cache."""
    return Path(root).expanduser() / ".crucible-cache" if root else Path("~/.crucible/cache").expanduser()


class DataSource:
    """Where this node finds what a run's spec names: relative paths under its data root, `s3://` through
    its store, fetched shards and token files in a cache. Opened corpora are kept for the next assignment."""

    def __init__(self, root: str = "", store: ObjectStore | None = None, cache: Path | None = None) -> None:
        self.root = root
        self.store = store
        self.cache = cache or default_cache(root)
        self._corpora: dict[tuple[str, str, str, str, float, int], Corpus] = {}
        self._lock = threading.Lock()

    def local_path(self, ref: str) -> str:
        """`ref` as this node reads it: "stdlib" and absolute or ~ paths as they are, a relative path or
        glob under the data root."""
        if ref == "stdlib" or not self.root:
            return ref
        expanded = os.path.expanduser(ref)
        return expanded if os.path.isabs(expanded) else os.path.join(os.path.expanduser(self.root), ref)

    def _root_for(self, ref: str) -> str | None:
        """The data root a relative `ref` must stay under; None for "stdlib", absolute and ~ paths (the
        operator named them outright) or a node without a data root."""
        if ref == "stdlib" or not self.root or os.path.isabs(os.path.expanduser(ref)):
            return None
        return self.root

    def _need_store(self, what: str, url: str) -> ObjectStore:
        if self.store is None:
            raise DataError(
                f"{what} {url!r} is in an object store, and this node has none (--store-endpoint)"
            )
        return self.store

    # --- the tokenizer ------------------------------------------------------------------------------
    def tokenizer(self, train: TrainSpec, vocab: int) -> LoadedTokenizer | None:
        """The run's tokenizer (None at byte level), its hash and vocabulary checked against the spec."""
        ref = train.tokenizer
        if not ref:
            return None
        if is_store_url(ref):
            store = self._need_store("train.tokenizer", ref)
            data = fetch_tokenizer(store, ref, train.tokenizer_sha256, MAX_TOKENIZER_BYTES)
        else:
            path = Path(self.local_path(ref)).expanduser()
            root = self._root_for(ref)
            if root is not None:
                check_within(path, root, "train.tokenizer")
            try:
                data = read_regular(path, MAX_TOKENIZER_BYTES, "train.tokenizer")
            except OSError as e:
                raise DataError(
                    f"train.tokenizer {ref!r} cannot be read on this node as {path}: {e.strerror or e} "
                    "(relative paths resolve under --data-root)"
                ) from e
            if len(data) > MAX_TOKENIZER_BYTES:
                raise DataError(f"train.tokenizer {ref!r} is over {MAX_TOKENIZER_BYTES >> 20} MiB")
        tok = parse_tokenizer(data, ref, train.tokenizer_sha256)
        check_vocab(tok, vocab)
        return tok

    def token_bytes(self, train: TrainSpec, vocab: int) -> torch.Tensor | None:
        """(vocab,) int64 text bytes per token id for bits per byte; None at byte level (one byte each)."""
        tok = self.tokenizer(train, vocab)
        return None if tok is None else torch.from_numpy(token_byte_lengths(tok))

    # --- the corpus ---------------------------------------------------------------------------------
    def corpus(self, train: TrainSpec, vocab: int) -> Corpus:
        """The run's corpus, its content hash checked against `train.data_sha256`; DataError saying what
        differs (both hashes) or what is missing."""
        key = (
            train.data,
            train.data_sha256,
            train.tokenizer,
            train.tokenizer_sha256,
            train.val_fraction,
            vocab,
        )
        with self._lock:
            if key not in self._corpora:
                self._corpora[key] = self._open(train, vocab)
            return self._corpora[key]

    def _open(self, train: TrainSpec, vocab: int) -> Corpus:
        tok = self.tokenizer(train, vocab)
        if tok is None and vocab < 256:
            raise DataError(f"model.vocab={vocab}: a byte-level run needs at least 256")
        if is_store_url(train.data):
            store = self._need_store("train.data", train.data)
            files, entries, sha = fetch_corpus(store, train.data, self.cache, train.data_sha256)
            where = train.data
        else:
            where = self.local_path(train.data)
            root = self._root_for(train.data)
            if root is not None:  # the path (or glob) itself, then each file it names
                check_within(where, root, "train.data")
            scan = scan_corpus(where, within=root)
            entries = manifest_of(scan)
            files = [scan.root / e.name for e in entries]
            sha = corpus_sha256(entries)
            if train.data_sha256 and sha != train.data_sha256:
                raise DataError(  # the hashes first: an advert carries the first 500 characters
                    f"train.data {train.data!r}: this node's copy has content hash sha256 {sha}, the run "
                    f"spec says {train.data_sha256}; put the run's corpus under this node's --data-root "
                    f"(read {where}: {scan.summary()})"
                )
        size = sum(e.size for e in entries)
        log.info("corpus %s: %d files, %.1f MB, sha256 %s", where, len(entries), size / 1e6, sha)
        if tok is None:
            return Corpus.over(ShardReader(files, [e.size for e in entries]), train.val_fraction, sha)
        tokens = self.cache / "tokens" / f"{sha}-{tok.sha256[:16]}.{np.dtype(tok.id_dtype()).name}"
        if not tokens.is_file():
            tokens.parent.mkdir(parents=True, exist_ok=True)
            n = encode_files(tok, files, tokens)
            log.info(
                "corpus %s: %d tokens (%.2f bytes each) cached in %s", where, n, size / max(n, 1), tokens
            )
        reader = ShardReader([tokens], [tokens.stat().st_size], tok.id_dtype())
        return Corpus.over(reader, train.val_fraction, sha, tok.vocab)

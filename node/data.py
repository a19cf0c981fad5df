"""Byte-level corpora and deterministic batch streams.

Default corpus: the Python standard library's own source (present on every machine, tens of MB).
`--data` takes text files, directories or globs. Batches are drawn by a generator seeded with
(data_seed, replica, step), so a restarted stage redraws exactly the batch it lost.
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_CORPUS_BYTES = 64 * 1024 * 1024  # memory cap per process; plenty for CPU-sized runs
_TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".toml", ".c", ".h", ".html")


class DataError(ValueError):
    """The corpus could not be loaded; the message says which path and why."""


def corpus_files(source: str) -> list[Path]:
    """Files of a corpus spec: "stdlib", a file, a directory (recursive) or a glob."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _TEXT_SUFFIXES)
    matches = sorted(Path(p) for p in glob.glob(source, recursive=True) if os.path.isfile(p))
    if not matches:
        raise DataError(
            f"--data {source!r} matches no file: give 'stdlib', a text file, a directory or a glob like 'corpus/*.txt'"
        )
    return matches


def load_corpus(source: str, max_bytes: int = MAX_CORPUS_BYTES) -> torch.Tensor:
    """All bytes of the corpus as a uint8 tensor (files in sorted order, capped at max_bytes)."""
    chunks, total = [], 0
    for p in corpus_files(source):
        try:
            b = p.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read corpus file {p}: {e}") from e
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise DataError(f"corpus {source!r} holds only {len(data)} bytes; give at least a few KB of text")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@dataclass
class Corpus:
    """Train/validation split of a byte corpus (validation = the tail)."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, source: str, val_fraction: float) -> Corpus:
        data = load_corpus(source)
        n_val = max(int(len(data) * val_fraction), 4096)
        return cls(train=data[:-n_val], val=data[-n_val:])

    def train_batch(self, seed: int, replica: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
        """(batch, seq_len + 1) int64 token ids at random offsets, deterministic in (seed, replica, step)."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + replica) * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch,), generator=g)
        return _windows(self.train, starts, seq_len)

    def val_batches(self, n_batches: int, batch: int, seq_len: int) -> list[torch.Tensor]:
        """Fixed, evenly spaced validation windows: the same on every node and every evaluation."""
        n = n_batches * batch
        span = len(self.val) - seq_len - 1
        starts = torch.tensor([math.floor(i * span / max(n - 1, 1)) for i in range(n)])
        return list(_windows(self.val, starts, seq_len).split(batch))


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # (b, L+1)
    return data[idx].long()

"""Byte-level corpora and deterministic batch streams.

Default corpus: the Python standard library's own source (present on every machine, tens of MB).
`--data` takes text files, directories or globs. Batches are drawn by a generator seeded with
(data_seed, replica, step), so a restarted stage redraws exactly the batch it lost.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from node.corpus_files import DataError, scan_corpus

__all__ = ["MAX_CORPUS_BYTES", "Corpus", "DataError", "load_corpus"]

log = logging.getLogger(__name__)

MAX_CORPUS_BYTES = 64 * 1024 * 1024  # memory cap per process; plenty for CPU-sized runs


def load_corpus(source: str, max_bytes: int = MAX_CORPUS_BYTES) -> torch.Tensor:
    """All bytes of the corpus's text files as a uint8 tensor (sorted order, capped at max_bytes)."""
    chunks, total = [], 0
    scan = scan_corpus(source)
    for p in scan.files:
        try:
            b = p.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read corpus file {p}: {e}") from e
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            log.warning("corpus %r: using its first %d MB (%s)", source, max_bytes >> 20, scan.summary())
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


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

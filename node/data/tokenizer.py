"""An optional `tokenizers` tokenizer beside the byte default: loading and checking it, the corpus as token
ids in a cache file, and the text bytes each token stands for.

Bits per byte stay the byte-level run's definition under a tokenizer: the validation tokens' summed loss
in nats over ln 2 times the UTF-8 bytes of the text they stand for,

    bpb = sum_i nll_i / (ln 2 * sum_i bytes(x_i)),

which at byte level (one byte per token) is the mean loss over ln 2. bytes(x) comes from a table over the
vocabulary (`token_byte_lengths`): exact for byte-level BPE (GPT-2, Llama 3: every character of a token
is one byte) and for byte-fallback tokens (`<0x41>`), the decoded text's length otherwise; special tokens
stand for no text.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from node.data.corpus_files import DataError, open_regular

log = logging.getLogger(__name__)

MAX_TOKENIZER_BYTES = 64 << 20
"""A tokenizer.json larger than this is refused (Llama 3's is 9 MB)."""
CHUNK_BYTES = 1 << 20
"""Text is tokenized in pieces of about this size, cut after a newline (never inside a character)."""
BATCH_CHUNKS = 16
"""Pieces handed to the tokenizer at once (it encodes a batch on several threads)."""
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer and what identifies it."""

    tokenizer: Any
    """A `tokenizers.Tokenizer`."""
    source: str
    """Where it came from (for messages)."""
    sha256: str
    """Hash of its tokenizer.json bytes."""

    @property
    def vocab(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def id_dtype(self) -> type[np.unsignedinteger]:
        return np.uint16 if self.vocab <= 1 << 16 else np.uint32


def parse_tokenizer(data: bytes, source: str, expected_sha256: str = "") -> LoadedTokenizer:
    """A tokenizer from its tokenizer.json bytes; DataError when they are not the spec's (by hash) or not a
    tokenizer."""
    from tokenizers import Tokenizer

    if len(data) > MAX_TOKENIZER_BYTES:
        raise DataError(
            f"train.tokenizer {source!r}: {len(data)} bytes, over {MAX_TOKENIZER_BYTES >> 20} MiB"
        )
    sha = hashlib.sha256(data).hexdigest()
    if expected_sha256 and sha != expected_sha256:
        raise DataError(
            f"train.tokenizer {source!r} on this node has sha256 {sha}, the run spec says {expected_sha256}"
        )
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception for a bad file
        raise DataError(
            f"train.tokenizer {source!r} is not a `tokenizers` tokenizer.json: {str(e)[:200]}"
        ) from e
    return LoadedTokenizer(tokenizer=tok, source=source, sha256=sha)


def check_vocab(tok: LoadedTokenizer, vocab: int) -> None:
    if tok.vocab != vocab:
        raise DataError(
            f"model.vocab={vocab} but the tokenizer {tok.source!r} has {tok.vocab} tokens: set "
            f"model.vocab = {tok.vocab} in the run spec"
        )


def token_byte_lengths(tok: LoadedTokenizer) -> np.ndarray:
    """(vocab,) int64: how many UTF-8 bytes of text each token id stands for (see the module docstring)."""
    from tokenizers import decoders, pre_tokenizers

    t = tok.tokenizer
    byte_level = isinstance(t.decoder, decoders.ByteLevel)
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    added = t.get_added_tokens_decoder()
    out = np.zeros(tok.vocab, dtype=np.int64)
    for i in range(tok.vocab):
        if i in added:
            a = added[i]
            out[i] = 0 if a.special else len(a.content.encode())
            continue
        s = t.id_to_token(i)
        if s is None:
            continue
        if byte_level and all(c in alphabet for c in s):
            out[i] = len(s)
        elif _BYTE_FALLBACK.fullmatch(s):
            out[i] = 1
        else:
            out[i] = len(t.decode([i], skip_special_tokens=False).encode())
    return out


def _pieces(path: Path):  # type: ignore[no-untyped-def]
    """The file's text in pieces of about CHUNK_BYTES, each cut after a newline (or at the end)."""
    carry = b""
    with os.fdopen(open_regular(path), "rb") as f:
        while block := f.read(CHUNK_BYTES):
            block = carry + block
            cut = block.rfind(b"\n") + 1
            if cut == 0 and len(block) < 4 * CHUNK_BYTES:
                carry = block  # no newline yet: read on (a line of over 4 MiB is cut anyway)
                continue
            cut = cut or len(block)
            carry = block[cut:]
            yield block[:cut].decode("utf-8", errors="replace")
    if carry:
        yield carry.decode("utf-8", errors="replace")


def encode_files(tok: LoadedTokenizer, files: list[Path], out: Path) -> int:
    """Tokenize `files` in order (concatenated, no separator) into `out`, raw ids of `tok.id_dtype()`;
    written under a temporary name and renamed when complete. Returns the number of tokens."""
    dtype = tok.id_dtype()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.part")
    n = 0
    try:
        with tmp.open("wb") as f:
            batch: list[str] = []

            def flush() -> None:
                nonlocal n
                for enc in tok.tokenizer.encode_batch(batch, add_special_tokens=False):
                    ids = np.asarray(enc.ids, dtype=dtype)
                    f.write(ids.tobytes())
                    n += len(ids)
                batch.clear()

            for p in files:
                for piece in _pieces(p):
                    batch.append(piece)
                    if len(batch) >= BATCH_CHUNKS:
                        flush()
            if batch:
                flush()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n

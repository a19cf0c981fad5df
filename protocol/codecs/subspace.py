"""Subspace-compressed pipeline links: the shared basis U, the token table T, and the activation codec.

Subspace Networks (Ramasinghe et al., "Subspace Networks: Scaling Decentralized Training with
Communication-Efficient Model Parallelism", NeurIPS 2025, arXiv 2506.01260; DESIGN section 4). With the
boundary hidden state X in R^{b x L x d}, token ids x, an orthonormal U in R^{d x k} and a fixed token
table T in R^{V x d} (RoPE, so no positional term P):

    send:      Z     = (X - T[x]) U          # (b, L, k), plus the token ids x
    receive:   X_hat = Z U^T + T[x]          # (b, L, d); equals X when X - T[x] lies in span(U)
    backward:  G_Z   = G_X U                 # (b, L, k): the gradient crosses k-wide too
               G_X'  = G_Z U^T               # what the sender back-propagates

`node/subspace_model.py` keeps the residual stream in span(U) + T[x] so that X_hat == X exactly.

Every stage derives U and T from the run's `projection_seed` alone (no communication). A link of width
k_b uses the first k_b columns of one basis (nested bases), so per-link k needs no extra agreement.

Wire format of one message (little-endian; one per microbatch per direction):

    offset size  field
    0      4     magic b"CSUB"
    4      1     version (1)
    5      1     kind: 1 forward (train), 2 backward (activation-gradient), 3 eval (forward, no backward)
    6      1     value dtype: 1 float32, 2 bfloat16, 3 float16
    7      1     token id dtype: 0 none (backward), 1 uint8, 2 uint16, 3 uint32 (smallest that holds vocab-1)
    8      4     microbatch id (u32)
    12     8     step (u64)
    20     4     b  (u32)
    24     4     L  (u32)
    28     4     k  (u32; k = d for a dense link)
    32     ...   Z or G_Z: b*L*k values, C order
    ...    ...   forward/eval only: token ids, b*(L+1) of them (inputs and the last stage's targets)
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from protocol.schema import ProtocolError

if TYPE_CHECKING:
    from protocol.runspec import ModelSpec, PipelineSpec

WireDType = Literal["float32", "bfloat16", "float16"]

MAGIC = b"CSUB"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIQIII")  # 32 bytes, see the module docstring
HEADER_BYTES = HEADER.size

_VALUE_DTYPES: dict[int, tuple[WireDType, torch.dtype]] = {
    1: ("float32", torch.float32),
    2: ("bfloat16", torch.bfloat16),
    3: ("float16", torch.float16),
}
_VALUE_CODES: dict[str, int] = {name: code for code, (name, _) in _VALUE_DTYPES.items()}
_TORCH_DTYPES: dict[str, torch.dtype] = dict(_VALUE_DTYPES.values())
_TOKEN_DTYPES: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 3: np.uint32}

EMBED_STD = 0.02  # node/model.py's embedding init std; T uses it so E + T starts like a plain embedding
MAX_ABS = 1e6
"""Default bound on |Z| and |G_Z| on a link (`ActivationCodec.max_abs`, the run spec's
`pipeline.wire_max_abs`). Honest values stay far below it: residual streams of pre-norm Llama-style nets
are O(1)-O(10) with a few "massive activations" of several thousand (Sun et al., arXiv 2402.17762), and
|Z_j| <= ||X - T[x]||_2 per token as U is orthonormal; activation gradients of a mean loss are well
below 1 (tiny values are fine, only large ones are bounded). Above it, the sender diverged or is hostile.
At the bound, X_hat = Z U^T and G_X = G_Z U^T stay below 1e6 sqrt(k) per entry, so the receiver's
norms (squares ~1e16) and matmuls stay finite in bf16 and fp32; float16 wires stop at 65504 anyway."""
_RAISE_HINT = "if honest values are this large, raise pipeline.wire_max_abs in the run spec"

assert sys.byteorder == "little", "the activation wire format assumes a little-endian host"


class ActivationCodecError(ProtocolError):
    """A pipeline activation message is malformed or does not match the link; the message says how."""


class Kind(IntEnum):
    """What a message carries."""

    FORWARD = 1
    """Training forward: Z and token ids; a backward message answers it."""
    BACKWARD = 2
    """Activation-gradient G_Z, no token ids."""
    EVAL = 3
    """Evaluation forward: Z and token ids, never answered."""


# --- basis and token table ---------------------------------------------------------------------------


def _generator(seed: int, what: str, index: int = 0) -> torch.Generator:
    # One independent CPU stream per (seed, purpose, index): CPU generators are bit-identical across hosts.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(what.encode())) * 1_000_003 + index)


def _basis64(d: int, k_max: int, seed: int) -> torch.Tensor:
    if not 0 < k_max <= d:
        raise ValueError(f"subspace width k_max={k_max} must be in 1..d={d}")
    # Column j is drawn from its own stream, so the first k columns do not depend on k_max: QR (Gram-Schmidt
    # order) then makes basis(d, k, s) == basis(d, k_max, s)[:, :k] for every k <= k_max (nested bases).
    G = torch.stack(
        [torch.randn(d, generator=_generator(seed, "basis", j), dtype=torch.float64) for j in range(k_max)], 1
    )  # (d, k_max)
    Q, R = torch.linalg.qr(G)
    return Q * torch.sign(torch.diagonal(R))  # unique Q: positive diag(R), whatever the LAPACK build


def basis(d: int, k_max: int, seed: int) -> torch.Tensor:
    """U in R^{d x k_max} with orthonormal columns: QR of a seeded Gaussian, in float64, cast to float32.

    Deterministic across machines (CPU generators, one per column, sign-normalised QR). Nested: the basis
    of a link with k_b <= k_max is U[:, :k_b], and equals basis(d, k_b, seed) to rounding.
    """
    return _basis64(d, k_max, seed).float()


def token_table(vocab: int, d: int, seed: int, k_embed: int | None) -> torch.Tensor:
    """The fixed token table T_perp in R^{V x d}: T = G (I - U U^T), G ~ N(0, EMBED_STD^2), U = basis(d, k_embed).

    k_embed is the width of the span the trainable embedding E is confined to (the narrowest compressed
    link), so E[x] + T[x] splits every token's embedding into a learned part in span(U) and a fixed part
    in its complement: the seed write-up's T_perp. Exactness does not need the orthogonality (X_hat = X
    whenever X - T[x] lies in the link's span, for any T); it is chosen because:
      * a T component inside span(U) would only be a frozen offset that E must learn around, while off
        span(U) T gives every token a full-rank, fixed identity that later layers can read but that never
        crosses a link: receivers rebuild it from the token ids;
      * E U U^T + G (I - U U^T) has the law of an unconstrained N(0, 0.02^2) embedding, so the constrained
        model starts like the plain one;
      * on the narrowest links the subtraction is harmless: (X - T[x]) U = X U - T[x] U = X U to rounding.
    k_embed=None (no compressed link): a plain Gaussian table (dense links do not use it).
    """
    G = torch.randn(vocab, d, generator=_generator(seed, "token_table"), dtype=torch.float64) * EMBED_STD
    if k_embed is not None:
        U = _basis64(d, k_embed, seed)
        G = G - (G @ U) @ U.T  # (V, d), in float64 so T U ~ 1e-17 before the cast
    return G.float()


# --- the linear maps ---------------------------------------------------------------------------------


def compress_activation(
    X: torch.Tensor, tokens: torch.Tensor, U: torch.Tensor | None, T: torch.Tensor | None
) -> torch.Tensor:
    """Z = (X - T[x]) U; X (b, L, d), tokens (b, L) inputs or (b, L+1) with targets. U None: dense link."""
    Xf = X.float()
    if T is not None:
        Xf = Xf - T[tokens[:, : X.shape[1]].to(T.device)]  # (b, L, d)
    return Xf if U is None else Xf @ U  # (b, L, k)


def decompress_activation(
    Z: torch.Tensor, tokens: torch.Tensor, U: torch.Tensor | None, T: torch.Tensor | None
) -> torch.Tensor:
    """X_hat = Z U^T + T[x]; Z (b, L, k) -> (b, L, d) float32."""
    Zf = Z.float() if U is None else Z.to(U.device, torch.float32)
    X = Zf if U is None else Zf @ U.T  # (b, L, d)
    if T is not None:
        X = X + T[tokens[:, : Z.shape[1]].to(T.device)]
    return X


def compress_gradient(G_X: torch.Tensor, U: torch.Tensor | None) -> torch.Tensor:
    """G_Z = G_X U; (b, L, d) -> (b, L, k)."""
    return G_X.float() if U is None else G_X.float() @ U


def decompress_gradient(G_Z: torch.Tensor, U: torch.Tensor | None) -> torch.Tensor:
    """G_X = G_Z U^T; (b, L, k) -> (b, L, d): the gradient the sender feeds to X.backward()."""
    return G_Z.float() if U is None else G_Z.to(U.device, torch.float32) @ U.T


# --- sizes -------------------------------------------------------------------------------------------


def token_dtype(vocab: int) -> type[np.unsignedinteger]:
    """Smallest unsigned integer type that holds every token id of the vocabulary."""
    if vocab <= 0:
        raise ValueError(f"vocab must be positive, got {vocab}")
    return np.uint8 if vocab <= 1 << 8 else np.uint16 if vocab <= 1 << 16 else np.uint32


def _token_code(vocab: int) -> int:
    tdt = token_dtype(vocab)
    return next(code for code, t in _TOKEN_DTYPES.items() if t is tdt)


def payload_bytes(b: int, L: int, k: int, dtype: WireDType, vocab: int, kind: Kind = Kind.FORWARD) -> int:
    """Bytes of one message on the wire, header and (forward/eval) token ids included."""
    value = _TORCH_DTYPES[dtype].itemsize
    tokens = 0 if kind == Kind.BACKWARD else b * (L + 1) * np.dtype(token_dtype(vocab)).itemsize
    return HEADER_BYTES + b * L * k * value + tokens


def dense_bytes(b: int, L: int, d: int) -> int:
    """The reference a ratio is measured against: a full-width fp32 tensor plus the header."""
    return HEADER_BYTES + b * L * d * 4


# --- the codec ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationHeader:
    """What one message says about its payload (hivemind `CompressionInfo` style)."""

    kind: Kind
    microbatch: int
    step: int
    b: int
    L: int
    k: int
    dtype: WireDType


@dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class ActivationMessage:
    header: ActivationHeader
    Z: torch.Tensor
    """(b, L, k) in the wire dtype: Z forward, G_Z backward."""
    tokens: torch.Tensor | None
    """(b, L+1) int64 token ids on forward/eval messages, None on backward ones."""


@dataclass(kw_only=True, frozen=True)
class ActivationCodec:
    """One pipeline link's message codec; both ends build it from the run spec (encode / decode / ratio)."""

    d: int
    """Model width d (a dense link has k = d)."""
    k: int
    """Values per token on the wire."""
    vocab: int
    """Vocabulary size V: decides the token id dtype and bounds the ids."""
    seq_len: int
    """L, tokens per sequence."""
    wire_dtype: WireDType = "float32"
    """Dtype of Z / G_Z on the wire."""
    max_abs: float = MAX_ABS
    """Largest |value| of Z or G_Z either end accepts (see `MAX_ABS`); the sender refuses to send more and
    the receiver rejects it, like NaN/inf."""

    def __post_init__(self) -> None:
        if not 0 < self.k <= self.d:
            raise ValueError(f"link width k={self.k} must be in 1..d={self.d}")
        m = self.max_abs
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < math.inf:
            raise ValueError(
                f"max_abs={self.max_abs!r} must be a positive finite number (default {MAX_ABS:g})"
            )
        if self.seq_len <= 0 or self.vocab <= 0:
            raise ValueError(f"seq_len={self.seq_len} and vocab={self.vocab} must be positive")
        if self.wire_dtype not in _VALUE_CODES:
            raise ValueError(f"wire dtype {self.wire_dtype!r} is not one of {list(_VALUE_CODES)}")

    @property
    def dense(self) -> bool:
        return self.k == self.d

    def nbytes(self, b: int, kind: Kind = Kind.FORWARD) -> int:
        return payload_bytes(b, self.seq_len, self.k, self.wire_dtype, self.vocab, kind)

    def ratio(self, b: int, kind: Kind = Kind.FORWARD) -> float:
        """Dense fp32 bytes / bytes on the wire, header (and token ids) included."""
        return dense_bytes(b, self.seq_len, self.d) / self.nbytes(b, kind)

    def encode(
        self,
        kind: Kind,
        *,
        microbatch: int,
        step: int,
        Z: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> bytes:
        """Pack Z (b, L, k) (cast to the wire dtype) and, forward/eval, tokens (b, L+1) into one message."""
        kind = Kind(kind)
        if Z.dim() != 3 or tuple(Z.shape[1:]) != (self.seq_len, self.k):
            raise ValueError(f"Z has shape {tuple(Z.shape)}, the link carries (b, {self.seq_len}, {self.k})")
        b = Z.shape[0]
        Zw = Z.detach().to("cpu", _TORCH_DTYPES[self.wire_dtype]).contiguous()
        peak = float(Zw.abs().amax()) if Zw.numel() else 0.0  # one pass; NaN and inf propagate
        if not math.isfinite(peak):
            hint = " (float16 overflows above 65504: use bfloat16)" if self.wire_dtype == "float16" else ""
            raise ValueError(f"refusing to send non-finite values in a {kind.name} message{hint}")
        if peak > self.max_abs:
            raise ValueError(
                f"refusing to send |value| = {peak:.4g} in a {kind.name} message: above the link's bound "
                f"{self.max_abs:g}; {_RAISE_HINT}"
            )
        token_code, token_bytes = 0, b""
        if kind != Kind.BACKWARD:
            if tokens is None or tuple(tokens.shape) != (b, self.seq_len + 1):
                got = None if tokens is None else tuple(tokens.shape)
                raise ValueError(
                    f"a {kind.name} message needs token ids of shape ({b}, {self.seq_len + 1}), got {got}"
                )
            token_code = _token_code(self.vocab)
            token_bytes = tokens.detach().cpu().numpy().astype(_TOKEN_DTYPES[token_code]).tobytes()
        elif tokens is not None:
            raise ValueError("a BACKWARD message carries no token ids")
        try:
            header = HEADER.pack(
                MAGIC, VERSION, int(kind), _VALUE_CODES[self.wire_dtype], token_code,
                microbatch, step, b, self.seq_len, self.k,
            )  # fmt: skip
        except struct.error as e:
            raise ValueError(
                f"microbatch={microbatch}, step={step} or b={b} does not fit the header: {e}"
            ) from e
        return b"".join((header, Zw.view(torch.uint8).numpy().tobytes(), token_bytes))

    def encode_async(
        self,
        kind: Kind,
        *,
        microbatch: int,
        step: int,
        Z: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> Callable[[], bytes]:
        """`encode`, with the device-to-host copy started now and the bytes made by whoever calls the
        result (a link's sender thread). On CUDA, Z is cast to the wire dtype on the device and copied,
        with the token ids, into pinned host memory on a side stream that waits for the compute stream:
        training goes on while the copy runs. Elsewhere the message is encoded at once."""
        if Z.device.type != "cuda":
            data = self.encode(kind, microbatch=microbatch, step=step, Z=Z, tokens=tokens)
            return lambda: data
        dev = Z.device
        Zw = Z.detach().to(_TORCH_DTYPES[self.wire_dtype])  # (b, L, k) on the device, wire dtype
        side = _copy_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            Z_host = torch.empty(Zw.shape, dtype=Zw.dtype, pin_memory=True)
            Z_host.copy_(Zw, non_blocking=True)
            t_host = None
            if tokens is not None:
                t_host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                t_host.copy_(tokens.detach(), non_blocking=True)
                tokens.record_stream(side)
            copied = torch.cuda.Event()
            copied.record(side)
        Zw.record_stream(side)  # the caching allocator must not reuse Zw before the copy ran

        def finish() -> bytes:
            copied.synchronize()
            return self.encode(kind, microbatch=microbatch, step=step, Z=Z_host, tokens=t_host)

        return finish

    def decode(
        self,
        data: bytes | bytearray | memoryview,
        *,
        b: int | None = None,
        kinds: tuple[Kind, ...] | None = None,
    ) -> ActivationMessage:
        """Parse and validate one message against this link: magic, version, kind, dtypes, (b, L, k),
        exact total size, token ids < vocab, finite values with |value| <= max_abs. b=None accepts any
        batch (size still checked); kinds=None accepts any kind. Raises ActivationCodecError saying what
        was wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ActivationCodecError(f"activation message: expected bytes, got {type(data).__name__}")
        mv = memoryview(data).cast("B")
        if len(mv) < HEADER_BYTES:
            raise ActivationCodecError(
                f"activation message of {len(mv)} bytes is shorter than its {HEADER_BYTES}-byte header"
            )
        magic, version, kind_code, dtype_code, token_code, microbatch, step, hb, hL, hk = HEADER.unpack_from(
            mv
        )
        if magic != MAGIC:
            raise ActivationCodecError(
                f"activation message starts with {bytes(magic)!r}, not {MAGIC!r}: the peer is not speaking "
                "the subspace link protocol"
            )
        if version != VERSION:
            raise ActivationCodecError(
                f"activation message version {version}, this build speaks {VERSION}; upgrade the older side"
            )
        try:
            kind = Kind(kind_code)
        except ValueError:
            raise ActivationCodecError(f"activation message kind {kind_code} is not one of 1, 2, 3") from None
        if kinds is not None and kind not in kinds:
            raise ActivationCodecError(
                f"expected a {' or '.join(k.name for k in kinds)} message, got {kind.name}"
            )
        if dtype_code not in _VALUE_DTYPES:
            raise ActivationCodecError(f"activation message value dtype code {dtype_code} is unknown")
        dtype_name, dtype = _VALUE_DTYPES[dtype_code]
        if dtype_name != self.wire_dtype:
            raise ActivationCodecError(
                f"activation message is {dtype_name}, the run's wire dtype is {self.wire_dtype}"
            )
        if (b is not None and hb != b) or hb == 0 or hL != self.seq_len or hk != self.k:
            want_b = "b>0" if b is None else str(b)
            raise ActivationCodecError(
                f"activation message shape ({hb}, {hL}, {hk}) does not match the link's ({want_b}, "
                f"{self.seq_len}, {self.k})"
            )
        want_token = 0 if kind == Kind.BACKWARD else _token_code(self.vocab)
        if token_code != want_token:
            raise ActivationCodecError(
                f"{kind.name} message has token id dtype code {token_code}, expected {want_token} "
                f"for vocab {self.vocab}"
            )
        value_bytes = hb * hL * hk * dtype.itemsize
        n_tokens = 0 if kind == Kind.BACKWARD else hb * (hL + 1)
        tdt = _TOKEN_DTYPES.get(token_code)
        want = HEADER_BYTES + value_bytes + (n_tokens * np.dtype(tdt).itemsize if tdt else 0)
        if len(mv) != want:
            raise ActivationCodecError(
                f"{kind.name} message of shape ({hb}, {hL}, {hk}) should be {want} bytes, got {len(mv)} "
                "(truncated or padded)"
            )
        Z = torch.frombuffer(bytearray(mv[HEADER_BYTES : HEADER_BYTES + value_bytes]), dtype=torch.uint8)
        Z = Z.view(dtype).view(hb, hL, hk)  # (b, L, k); bytearray copy: the tensor owns writable memory
        peak = float(Z.abs().amax())  # one pass over (b, L, k); NaN and inf propagate
        if not math.isfinite(peak):
            raise ActivationCodecError(
                f"{kind.name} message holds non-finite values (NaN/inf): the sender's stage diverged"
            )
        if peak > self.max_abs:
            raise ActivationCodecError(
                f"{kind.name} message holds |value| = {peak:.4g}, above the link's bound {self.max_abs:g}: "
                f"the sender's stage diverged or is hostile; {_RAISE_HINT}"
            )
        tokens = None
        if tdt is not None:
            ids = np.frombuffer(mv, dtype=tdt, count=n_tokens, offset=HEADER_BYTES + value_bytes)
            top = int(ids.max())
            if top >= self.vocab:
                raise ActivationCodecError(f"token id {top} is outside the vocabulary of {self.vocab}")
            tokens = torch.from_numpy(ids.astype(np.int64)).view(hb, hL + 1)  # (b, L+1)
        header = ActivationHeader(kind, microbatch, step, hb, hL, hk, dtype_name)
        return ActivationMessage(header, Z, tokens)


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for device-to-host copies of outgoing messages."""
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


# --- one boundary, as the stage runtime uses it ------------------------------------------------------

_KIND_OF = {"train": Kind.FORWARD, "eval": Kind.EVAL}
_NAME_OF = {Kind.FORWARD: "train", Kind.EVAL: "eval"}


@dataclass(frozen=True, eq=False)  # holds tensors: identity equality
class SubspaceBoundary:
    """A stage boundary: codec + U_k (None = dense) + T; node/pipeline/schedule.py's `BoundaryCodec` interface.

    Sender (stage s):   pack_fwd(X)  sends Z = (X - T[x]) U;   later  X.backward(unpack_bwd(msg))  uses
                        G_X = G_Z U^T.
    Receiver (s + 1):   X_hat = unpack_fwd(msg) (make it a leaf requiring grad), run the layers, then
                        pack_bwd(X_hat.grad) sends G_Z = X_hat.grad U.
    """

    codec: ActivationCodec
    U: torch.Tensor | None
    """(d, k) with orthonormal columns; None on a dense link (k = d)."""
    T: torch.Tensor | None
    """(V, d) token table, or None (dense link)."""

    def __post_init__(self) -> None:
        if (self.U is None) != self.codec.dense:
            raise ValueError(f"a link of width k={self.codec.k} < d={self.codec.d} needs U, a dense one none")
        if self.U is not None and tuple(self.U.shape) != (self.codec.d, self.codec.k):
            raise ValueError(
                f"U has shape {tuple(self.U.shape)}, the link needs ({self.codec.d}, {self.codec.k})"
            )

    def pack_fwd(self, kind: str, step: int, mb: int, h: torch.Tensor, tokens: torch.Tensor) -> bytes:
        """h (b, L, d) boundary state, tokens (b, L+1) -> one FORWARD/EVAL message carrying Z (b, L, k)."""
        with torch.no_grad():
            Z = compress_activation(h.detach(), tokens, self.U, self.T)  # (b, L, k)
        return self.codec.encode(_KIND_OF[kind], microbatch=mb, step=step, Z=Z, tokens=tokens)

    def pack_fwd_async(
        self, kind: str, step: int, mb: int, h: torch.Tensor, tokens: torch.Tensor
    ) -> Callable[[], bytes]:
        """`pack_fwd` whose device-to-host copy overlaps compute (`ActivationCodec.encode_async`)."""
        with torch.no_grad():
            Z = compress_activation(h.detach(), tokens, self.U, self.T)  # (b, L, k)
        return self.codec.encode_async(_KIND_OF[kind], microbatch=mb, step=step, Z=Z, tokens=tokens)

    def unpack_fwd(self, data: bytes) -> tuple[str, int, int, torch.Tensor, torch.Tensor]:
        """-> (kind, step, microbatch, X_hat (b, L, d) float32 without grad history, tokens (b, L+1))."""
        msg = self.codec.decode(data, kinds=(Kind.FORWARD, Kind.EVAL))
        assert msg.tokens is not None
        with torch.no_grad():
            X_hat = decompress_activation(msg.Z, msg.tokens, self.U, self.T)  # (b, L, d)
        h = msg.header
        return _NAME_OF[h.kind], h.step, h.microbatch, X_hat, msg.tokens

    def pack_bwd(self, step: int, mb: int, g: torch.Tensor) -> bytes:
        """g = X_hat.grad (b, L, d) -> one BACKWARD message carrying G_Z = g U (b, L, k)."""
        with torch.no_grad():
            G_Z = compress_gradient(g, self.U)  # (b, L, k)
        return self.codec.encode(Kind.BACKWARD, microbatch=mb, step=step, Z=G_Z)

    def pack_bwd_async(self, step: int, mb: int, g: torch.Tensor) -> Callable[[], bytes]:
        """`pack_bwd` whose device-to-host copy overlaps compute (`ActivationCodec.encode_async`)."""
        with torch.no_grad():
            G_Z = compress_gradient(g, self.U)  # (b, L, k)
        return self.codec.encode_async(Kind.BACKWARD, microbatch=mb, step=step, Z=G_Z)

    def unpack_bwd(self, data: bytes) -> tuple[int, int, torch.Tensor]:
        """-> (step, microbatch, G_X = G_Z U^T (b, L, d)) for the sender's X.backward(G_X)."""
        msg = self.codec.decode(data, kinds=(Kind.BACKWARD,))
        with torch.no_grad():
            G_X = decompress_gradient(msg.Z, self.U)  # (b, L, d)
        return msg.header.step, msg.header.microbatch, G_X


# --- which k confines each residual writer (shared by the node's constraint and the exporter) -------
@dataclass(frozen=True)
class SubspacePlan:
    """Which k confines each residual writer, derived from the model, the pipeline links and the split."""

    d: int
    link_k: tuple[int, ...]
    """Width of each boundary b = 0..S-2 as the run spec sets it (k = d: dense)."""
    wire_k: tuple[int, ...]
    """Width each boundary actually sends: wire_k[b] = min(link_k[b:]). Everything written before boundary b
    is also before every later boundary, so it already lies in the narrowest later span: extra columns would
    carry zeros (a dense link followed by a compressed one is compressed for free, and exactly)."""
    boundaries: tuple[int, ...]
    """Boundary b sits before layer boundaries[b] (= the end of stage b's range)."""
    k_max: int | None
    """Widest compressed link: U has k_max columns. None: no compressed link, nothing is constrained."""
    embed_k: int | None
    """E's rows are confined to span(U[:, :embed_k]) (the narrowest compressed link)."""
    write_k: dict[int, int] = field(default_factory=dict)
    """layer -> k that its attn.wo and mlp.w_down outputs are confined to; absent = full-rank."""


Layout = tuple[Sequence[tuple[int, int]], Sequence[int]]
"""One replica shape's (layer ranges, link_k) (`RunSpec.layouts`)."""


def _check_layout(
    model_spec: ModelSpec, ranges: Sequence[tuple[int, int]], link_k: Sequence[int]
) -> tuple[int, ...]:
    """The layout's link widths (d where dense), after checking the ranges cover the model in order."""
    d, S = model_spec.d_model, len(ranges)
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != model_spec.n_layers:
        raise ValueError(f"layer ranges {list(ranges)} must cover layers 0..{model_spec.n_layers} in order")
    if any(a >= b for a, b in ranges) or any(p[1] != q[0] for p, q in zip(ranges, ranges[1:], strict=False)):
        raise ValueError(f"layer ranges {list(ranges)} must be contiguous and non-empty")
    ks = tuple(link_k) if link_k else (d,) * (S - 1)
    if len(ks) != S - 1:
        raise ValueError(f"pipeline.link_k has {len(ks)} values; a {S}-stage split has {S - 1} links")
    for k in ks:
        if not 0 < k <= d:
            raise ValueError(f"pipeline.link_k value {k} must be in 1..d_model={d}")
    return ks


def _compressed(d: int, ranges: Sequence[tuple[int, int]], link_k: tuple[int, ...]) -> list[tuple[int, int]]:
    """(layer the boundary sits before, wire k) of each compressed boundary of one layout."""
    wire_k = [min(link_k[b:]) for b in range(len(link_k))]
    return [(end, k) for (_, end), k in zip(ranges[:-1], wire_k, strict=True) if k < d]


def subspace_plan(
    model_spec: ModelSpec,
    pipeline_spec: PipelineSpec,
    ranges: Sequence[tuple[int, int]],
    *,
    layouts: Sequence[Layout] = (),
) -> SubspacePlan:
    """wire_k[b] = min(link_k[b:]); k(l) = min{wire_k[b] < d : boundary b after layer l}; E: min over all.

    `layouts`: every (ranges, link_k) of the run's replicas (`RunSpec.layouts`; empty: this one alone).
    The plan is the model's, one for every shape: k(l) and E's k are the minima over all layouts' compressed
    boundaries, so each layer's consensus lies in a span every shape's links carry exactly; wire_k and
    boundaries are this layout's (`ranges`, `pipeline_spec.link_k`)."""
    d = model_spec.d_model
    link_k = _check_layout(model_spec, ranges, pipeline_spec.link_k)
    boundaries = tuple(end for _, end in ranges[:-1])
    wire_k = tuple(min(link_k[b:]) for b in range(len(link_k)))
    compressed = _compressed(d, ranges, link_k)
    for other_ranges, other_k in layouts:
        compressed += _compressed(d, other_ranges, _check_layout(model_spec, other_ranges, other_k))
    if not compressed:
        return SubspacePlan(
            d=d, link_k=link_k, wire_k=wire_k, boundaries=boundaries, k_max=None, embed_k=None
        )
    write_k = {}
    for layer in range(model_spec.n_layers):
        after = [k for at, k in compressed if layer < at]
        if after:
            write_k[layer] = min(after)
    return SubspacePlan(
        d=d,
        link_k=link_k,
        wire_k=wire_k,
        boundaries=boundaries,
        k_max=max(k for _, k in compressed),
        embed_k=min(k for _, k in compressed),
        write_k=write_k,
    )

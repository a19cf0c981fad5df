"""Dense boundary codec: activations cross the link at full width d in the run's wire dtype.

Message (msgpack): {"k": kind, "s": step, "m": microbatch, "shape": [...], "dt": dtype, "x": tensor bytes,
"t": token ids (uint8 for byte vocab)}. Decoding checks shape, dtype and size against what the run
spec implies, and raises BoundaryError naming the problem.
"""

from __future__ import annotations

import msgpack
import numpy as np
import torch

from protocol.schema import ProtocolError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KINDS = ("train", "eval")


class BoundaryError(ProtocolError):
    """A pipeline message was malformed or did not match the run's shapes."""


def _to_bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return (
            torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
        )
    np_dtype = {torch.float32: np.float32, torch.float16: np.float16}[dtype]
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy()).reshape(shape)


class DenseBoundary:
    """Full-width boundary codec (the baseline the subspace codec is measured against)."""

    def __init__(self, d_model: int, seq_len: int, vocab: int, wire_dtype: str = "float32") -> None:
        if wire_dtype not in _DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r} is not one of {list(_DTYPES)}")
        self.d, self.L, self.vocab = d_model, seq_len, vocab
        self.wire_dtype = wire_dtype
        self.token_dtype = np.uint8 if vocab <= 256 else np.uint32

    def pack_fwd(self, kind: str, step: int, mb: int, h: torch.Tensor, tokens: torch.Tensor) -> bytes:
        x = h.detach().to(_DTYPES[self.wire_dtype])
        t = tokens.numpy().astype(self.token_dtype).tobytes()
        return msgpack.packb(
            {
                "k": kind,
                "s": step,
                "m": mb,
                "shape": list(h.shape),
                "dt": self.wire_dtype,
                "x": _to_bytes(x),
                "t": t,
            }
        )

    def unpack_fwd(self, data: bytes) -> tuple[str, int, int, torch.Tensor, torch.Tensor]:
        msg = self._load(data)
        if msg.get("k") not in _KINDS:
            raise BoundaryError(f"pipeline message kind {msg.get('k')!r} is not one of {list(_KINDS)}")
        x = self._tensor(msg)
        b = x.shape[0]
        t = msg.get("t")
        itemsize = np.dtype(self.token_dtype).itemsize
        if not isinstance(t, bytes) or len(t) != b * (self.L + 1) * itemsize:
            raise BoundaryError(
                f"token ids: expected {b * (self.L + 1) * itemsize} bytes for ({b}, {self.L + 1})"
            )
        tokens = torch.from_numpy(np.frombuffer(t, dtype=self.token_dtype).astype(np.int64)).reshape(
            b, self.L + 1
        )
        if int(tokens.max()) >= self.vocab:
            raise BoundaryError(f"token id {int(tokens.max())} is outside the vocabulary of {self.vocab}")
        return msg["k"], msg["s"], msg["m"], x.float(), tokens

    def pack_bwd(self, step: int, mb: int, g: torch.Tensor) -> bytes:
        x = g.detach().to(_DTYPES[self.wire_dtype])
        return msgpack.packb(
            {
                "k": "grad",
                "s": step,
                "m": mb,
                "shape": list(g.shape),
                "dt": self.wire_dtype,
                "x": _to_bytes(x),
            }
        )

    def unpack_bwd(self, data: bytes) -> tuple[int, int, torch.Tensor]:
        msg = self._load(data)
        if msg.get("k") != "grad":
            raise BoundaryError(f"expected a gradient message, got kind {msg.get('k')!r}")
        return msg["s"], msg["m"], self._tensor(msg).float()

    # --- validation -------------------------------------------------------------------------------
    def _load(self, data: bytes) -> dict:
        try:
            msg = msgpack.unpackb(data, raw=False)
        except Exception as e:
            raise BoundaryError(f"pipeline message is not valid msgpack: {e}") from e
        if not isinstance(msg, dict):
            raise BoundaryError("pipeline message: expected a map")
        for f in ("s", "m"):
            if not isinstance(msg.get(f), int):
                raise BoundaryError(f"pipeline message field {f!r} must be an integer")
        return msg

    def _tensor(self, msg: dict) -> torch.Tensor:
        shape, dt, x = msg.get("shape"), msg.get("dt"), msg.get("x")
        if dt != self.wire_dtype:
            raise BoundaryError(f"wire dtype {dt!r} differs from the run's {self.wire_dtype!r}")
        if not (
            isinstance(shape, list) and len(shape) == 3 and shape[1:] == [self.L, self.d] and shape[0] > 0
        ):
            raise BoundaryError(f"tensor shape {shape!r} does not match (b, {self.L}, {self.d})")
        want = shape[0] * self.L * self.d * _DTYPES[dt].itemsize
        if not isinstance(x, bytes) or len(x) != want:
            raise BoundaryError(
                f"tensor payload holds {len(x) if isinstance(x, bytes) else 0} bytes, expected {want}"
            )
        t = _from_bytes(x, _DTYPES[dt], tuple(shape))
        if not torch.isfinite(t).all():
            raise BoundaryError("tensor holds non-finite values (NaN/inf): the sender's stage diverged")
        return t

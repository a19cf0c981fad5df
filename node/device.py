"""Where a node trains and in what precision: `--device auto|cuda|cuda:N|cpu`, run-spec `precision`.

Device resolution (DESIGN section 9). `auto` takes a CUDA device when torch sees one, else the CPU; on a
host with several GPUs and several nodes, each `auto` node takes **the lowest-numbered GPU that no other
Crucible node on this host has claimed**: a node claims GPU i by holding an exclusive `flock` on
`<claim_dir>/gpu<i>.lock` for its lifetime (the lock dies with the process, so a crashed node frees its
GPU at once). When every GPU is claimed, the node shares GPU `pid % n` and logs a warning. `cuda` means
`cuda:0`; `cuda:N` and `cpu` are taken as given (an unknown or absent device is a clear error).

Precision. `auto` resolves per node: "bf16" (bf16 autocast, fp32 master weights and fp32 optimizer state)
on CUDA, "fp32" on the CPU. Replicas may resolve differently: the consensus (anchor, aggregation) is
computed from fp32 bytes on the host either way.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import IO

import torch

from protocol.memory import Precision, precision_for_device

log = logging.getLogger(__name__)

DEFAULT_CLAIM_DIR = Path("~/.crucible/gpu-claims")


class DeviceError(ValueError):
    """The requested device or precision cannot be used here; the message says why and what to pass."""


class DeviceClaim:
    """A held claim on one GPU of this host (released on close or when the process exits)."""

    def __init__(self, index: int, handle: IO[str] | None) -> None:
        self.index, self._handle = index, handle

    def close(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):
                self._handle.close()
            self._handle = None


def _try_claim(claim_dir: Path, index: int) -> IO[str] | None:
    claim_dir.mkdir(parents=True, exist_ok=True)
    f = open(claim_dir / f"gpu{index}.lock", "a+")  # noqa: SIM115 - held for the claim's lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def claim_gpu(n_gpus: int, claim_dir: Path = DEFAULT_CLAIM_DIR) -> DeviceClaim:
    """The lowest-numbered of `n_gpus` GPUs not claimed by another node on this host (module docstring)."""
    claim_dir = claim_dir.expanduser()
    for i in range(n_gpus):
        handle = _try_claim(claim_dir, i)
        if handle is not None:
            return DeviceClaim(i, handle)
    shared = os.getpid() % n_gpus
    log.warning("all %d GPUs of this host are claimed by other nodes; sharing cuda:%d", n_gpus, shared)
    return DeviceClaim(shared, None)


def resolve_device(
    requested: str = "auto",
    *,
    cuda_count: int | None = None,
    claim_dir: Path = DEFAULT_CLAIM_DIR,
) -> tuple[torch.device, DeviceClaim | None]:
    """`auto|cuda|cuda:N|cpu` -> (torch device, the GPU claim an `auto` node holds, else None).

    cuda_count: how many CUDA devices torch sees (None: ask torch; tests pass a number)."""
    n = torch.cuda.device_count() if cuda_count is None else cuda_count
    req = requested.strip().lower()
    if req == "cpu":
        return torch.device("cpu"), None
    if req == "auto":
        if n == 0:
            return torch.device("cpu"), None
        claim = claim_gpu(n, claim_dir)
        return torch.device("cuda", claim.index), claim
    if req == "cuda" or req.startswith("cuda:"):
        index_text = req.partition(":")[2] or "0"
        if not index_text.isdigit():
            raise DeviceError(f"--device {requested!r}: the GPU index must be a number (example: cuda:1)")
        index = int(index_text)
        if n == 0:
            raise DeviceError(
                f"--device {requested!r}: torch sees no CUDA device on this host "
                "(check the driver with nvidia-smi, or pass --device cpu / auto)"
            )
        if index >= n:
            raise DeviceError(
                f"--device {requested!r}: this host has {n} CUDA device(s), cuda:0..cuda:{n - 1}"
            )
        return torch.device("cuda", index), None
    raise DeviceError(f"--device {requested!r} is not one of auto, cpu, cuda, cuda:N (example: cuda:0)")


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """`auto|fp32|bf16` -> what this node computes in: auto = bf16 autocast on CUDA, fp32 on the CPU
    (`protocol.memory.precision_for_device`, the rule the coordinator's memory estimate uses too)."""
    try:
        return precision_for_device(device.type, requested)
    except ValueError as e:
        raise DeviceError(str(e)) from e


def autocast(device: torch.device, precision: Precision) -> contextlib.AbstractContextManager[None]:
    """The forward pass's autocast context: bf16 matmuls over fp32 master weights, or nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timing, and before reading results on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H200, 139.8 GiB)` or `cpu`."""
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on the device now (CUDA: the driver's figure; CPU: available RAM; 0 if unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


__all__ = [
    "DeviceClaim",
    "DeviceError",
    "Precision",
    "autocast",
    "claim_gpu",
    "describe",
    "free_memory_bytes",
    "resolve_device",
    "resolve_precision",
    "synchronize",
]

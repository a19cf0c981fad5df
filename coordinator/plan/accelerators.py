"""Accelerator table: peak dense bf16 tensor throughput and memory, the denominators of MFU.

MFU is only comparable across runs when everyone divides by the same peak, so the figures here are the
vendors' *dense* (no 2:4 structured sparsity) bf16 tensor-core numbers from the datasheets, per GPU.
Sparse marketing figures are exactly twice these. The local CPU has no datasheet figure, so its "peak"
is measured by timing a matmul (`measure_cpu_tflops`); on CPU that measured rate plays the role of peak.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class Accelerator:
    """One accelerator model, per device (one GPU, not one 8-GPU server)."""

    name: str
    """Key used in pool files, e.g. `a100-80gb`."""
    peak_tflops: float
    """Dense bf16 tensor peak in TFLOP/s; 0 means "measure it" (the CPU)."""
    memory_gb: float
    """Device memory in GB (1e9 bytes) as the vendor states it."""
    source: str
    """Where the figures come from."""


# Datasheet figures, dense bf16, per GPU.
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        # NVIDIA A100 datasheet: BF16 tensor 312 TFLOPS (624 with sparsity), SXM and PCIe alike.
        Accelerator(name="a100-40gb", peak_tflops=312.0, memory_gb=40.0, source="NVIDIA A100 datasheet"),
        Accelerator(name="a100-80gb", peak_tflops=312.0, memory_gb=80.0, source="NVIDIA A100 datasheet"),
        # NVIDIA H100 datasheet: SXM BF16 1,979 TFLOPS with sparsity -> 989 dense; PCIe 1,513 -> 756.
        Accelerator(name="h100-sxm", peak_tflops=989.0, memory_gb=80.0, source="NVIDIA H100 datasheet"),
        Accelerator(name="h100-pcie", peak_tflops=756.0, memory_gb=80.0, source="NVIDIA H100 datasheet"),
        # NVIDIA H200 datasheet: same GH100 tensor cores as H100 SXM (1,979 sparse -> 989), 141 GB HBM3e.
        Accelerator(name="h200", peak_tflops=989.0, memory_gb=141.0, source="NVIDIA H200 datasheet"),
        # NVIDIA HGX B200 spec: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs -> 2,250 dense per GPU;
        # 1.4 TB HBM3e per 8 GPUs -> 180 GB.
        Accelerator(name="b200", peak_tflops=2250.0, memory_gb=180.0, source="NVIDIA HGX B200 spec"),
        # GB200 NVL72 runs B200 at 1,200 W: FP16/BF16 360 PFLOPS sparse per 72 GPUs -> 2,500 dense;
        # 13.4 TB HBM3e per 72 GPUs -> 186 GB.
        Accelerator(name="gb200", peak_tflops=2500.0, memory_gb=186.0, source="NVIDIA GB200 NVL72 spec"),
        # NVIDIA HGX B300 spec: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs -> 2,250 dense per GPU
        # (Blackwell Ultra raised FP4 and attention throughput, not bf16); 2.3 TB per 8 GPUs -> 288 GB.
        Accelerator(name="b300", peak_tflops=2250.0, memory_gb=288.0, source="NVIDIA HGX B300 spec"),
        # GB300 NVL72: 360 PFLOPS FP8 dense per 72 GPUs for training -> 5,000 FP8 -> 2,500 bf16 dense;
        # 288 GB HBM3e per GPU.
        Accelerator(name="gb300", peak_tflops=2500.0, memory_gb=288.0, source="NVIDIA GB300 NVL72 spec"),
        # No datasheet figure: the peak is measured on the local machine (see measure_cpu_tflops).
        Accelerator(name="cpu", peak_tflops=0.0, memory_gb=0.0, source="measured matmul on this host"),
    )
}


def get_accelerator(name: str) -> Accelerator:
    """The table entry for `name`; raises ValueError listing the known names."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        known = ", ".join(sorted(ACCELERATORS))
        raise ValueError(
            f"unknown accelerator {name!r}: use one of {known}, or give the measured TFLOP/s "
            f"with `tflops = ...` (example: tflops = 312.0)"
        ) from None


@functools.lru_cache(maxsize=4)
def measure_cpu_tflops(
    n: int = 1024, repeats: int = 5, dtype_name: str = "float32", threads: int | None = None
) -> float:
    """Measured dense matmul throughput of this CPU in TFLOP/s (best of `repeats`).

    An (n x n) @ (n x n) matmul costs 2 n^3 FLOPs. Uses torch's current intra-op thread count, the same
    threads a CPU stage trains with, so the figure is the CPU's achievable peak for training; `threads`
    measures with that many instead. With `threads=1` (one core: the local swarm's nodes run one thread
    each) the product runs on the calling thread and is timed by that thread's CPU clock, so other
    processes preempting it on a busy machine do not count. Cached: one measurement per argument set.
    """
    import torch  # deferred: planning a GPU pool must not pay torch's import time

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dtype = getattr(torch, dtype_name)
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)  # warm-up: first call allocates and picks a kernel
        clock = time.thread_time if threads == 1 else time.perf_counter
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            torch.matmul(a, b)
            best = min(best, clock() - t0)
    finally:
        torch.set_num_threads(before)
    return 2.0 * n**3 / best / 1e12


def peak_tflops(name: str) -> float:
    """Peak dense TFLOP/s per device for `name`, measuring the local CPU for `cpu`."""
    acc = get_accelerator(name)
    return acc.peak_tflops if acc.peak_tflops > 0 else measure_cpu_tflops()

"""Capacity probes a node advertises: device, memory, measured matmul TFLOP/s, store bandwidth."""

from __future__ import annotations

import os
import time
import uuid

import psutil
import torch

from protocol.store import ObjectStore, StoreError


def device_name() -> str:
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    return "cpu"


def memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return psutil.virtual_memory().total / 2**30


def measure_tflops(n: int = 512, seconds: float = 0.3) -> float:
    """Dense matmul throughput: 2 n^3 FLOPs per product, timed over ~`seconds` (fp32 on CPU, bf16 on GPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if dev == "cuda":
        n = max(n, 4096)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    a @ b  # warm-up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    if dev == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def measure_store_mbps(store: ObjectStore, nbytes: int = 1 << 20) -> float:
    """Upload bandwidth to the store (Mbit/s) from one PUT of `nbytes`; 0 if the store is unreachable."""
    key = f"_probe/{uuid.uuid4().hex}"
    data = os.urandom(nbytes)
    try:
        start = time.perf_counter()
        store.put(key, data)
        elapsed = time.perf_counter() - start
        store.delete(key)
    except StoreError:
        return 0.0
    return nbytes * 8 / elapsed / 1e6

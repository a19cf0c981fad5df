"""Capacity probes a node advertises: device, memory, measured matmul TFLOP/s, store bandwidth."""

from __future__ import annotations

import logging
import os
import time
import uuid

import psutil
import torch

from node.device import synchronize
from protocol import keys
from protocol.net.store import ObjectStore, StoreError

log = logging.getLogger(__name__)


def device_name(device: torch.device) -> str:
    """ "cuda:NVIDIA H200" for a GPU (the name placement and the planner's table read), "cpu" otherwise."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return "cpu"


def memory_gb(device: torch.device) -> float:
    """Total memory of the device in GiB (the host's RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return psutil.virtual_memory().total / 2**30


def measure_tflops(device: torch.device, dtype: torch.dtype, n: int = 512, seconds: float = 0.3) -> float:
    """Dense matmul peak of `dtype` on `device`: 2 n^3 FLOPs over the fastest single product in ~`seconds`
    (n >= 4096 on a GPU, whose small products are launch-bound). The fastest, not the mean: nodes start
    while other processes start too, and a peak averaged over their work would read low (an MFU against
    it, above 100%)."""
    if device.type == "cuda":
        n = max(n, 4096)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    synchronize(device)
    best, iters, start = float("inf"), 0, time.perf_counter()
    while iters < 3 or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        synchronize(device)  # the clock must time work done, not work queued
        best = min(best, time.perf_counter() - t0)
        iters += 1
    return 2 * n**3 / best / 1e12


def measure_store_mbps(store: ObjectStore, nbytes: int = 1 << 20) -> float:
    """Upload bandwidth to the store (Mbit/s) from one PUT of `nbytes`; 0 if the store is unreachable, or
    not measured (0) when the node writes through grants (it may not write and delete a probe key)."""
    if store.cfg.grants:
        log.info("store upload bandwidth not measured: this node writes through grants only (--store-grants)")
        return 0.0
    key = keys.bandwidth_probe_key(uuid.uuid4().hex)
    data = os.urandom(nbytes)
    try:
        start = time.perf_counter()
        store.put(key, data)
        elapsed = time.perf_counter() - start
        store.delete(key)
    except StoreError:
        return 0.0
    return nbytes * 8 / elapsed / 1e6


def measure_reference_block(device: torch.device, precision: str, repeats: int = 3) -> tuple[str, float]:
    """(name, seconds) of one forward + backward of the reference block (protocol/reference_block.py) on
    `device` in `precision` ("fp32" or "bf16": bf16 autocast over fp32 weights, as training runs): the
    fastest of `repeats` after a warm-up, so a moment of other work does not count."""
    from node.device import autocast
    from node.model import Block, rope_tables
    from protocol.reference_block import reference_block_for
    from protocol.runspec import ModelSpec

    ref = reference_block_for(device.type)
    spec = ModelSpec(d_model=ref.d_model, n_layers=1, n_heads=ref.n_heads, d_ff=ref.d_ff, seq_len=ref.seq_len)
    block = Block(spec, 0).to(device)
    cos, sin = (t.to(device) for t in rope_tables(ref.seq_len, ref.d_model // ref.n_heads, spec.rope_theta))
    x = torch.randn(ref.batch, ref.seq_len, ref.d_model, device=device, requires_grad=True)
    best = float("inf")
    for i in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        with autocast(device, precision):  # type: ignore[arg-type]
            y = block(x, cos, sin)
        y.float().square().mean().backward()
        synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - start)
    return ref.name, best

"""Economics: $/Mtok of a throughput, and the comparison with a reserved reference cluster.

DESIGN section 7: $/Mtok = (sum of $/h) / (tokens/s x 3600) x 1e6. The reference comparison follows
seed 000, "An AWS price comparison".
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def usd_per_mtok(usd_per_hour: float, tokens_per_s: float) -> float:
    """$/Mtok = ($/h) / (tokens/s x 3600) x 1e6."""
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


# -------------------------------------------------------------------------------------- economics
@dataclass(kw_only=True, frozen=True)
class ReferenceCluster:
    """A reserved, tightly interconnected cluster to compare against, matched to our GPU count."""

    usd_per_gpu_hour: float
    """E.g. AWS p4de.24xlarge Capacity Block: $17.712/h / 8 GPUs = $2.214."""
    mfu: float
    """MFU it is assumed to sustain (the seed uses the 65% ceiling: generous to the reference)."""
    peak_tflops_per_gpu: float | None = None
    """Its GPUs' peak; None means the same GPUs as ours."""
    name: str = "reference"

    def __post_init__(self) -> None:
        if self.usd_per_gpu_hour <= 0 or not 0 < self.mfu <= 1:
            raise ValueError("reference needs usd_per_gpu_hour > 0 and 0 < mfu <= 1")
        if self.peak_tflops_per_gpu is not None and self.peak_tflops_per_gpu <= 0:
            raise ValueError("reference peak_tflops_per_gpu must be > 0")

    @classmethod
    def from_instance(
        cls, *, usd_per_hour: float, gpus: int, mfu: float, name: str = "reference"
    ) -> ReferenceCluster:
        """From an instance price, e.g. from_instance(usd_per_hour=17.712, gpus=8, mfu=0.65)."""
        if gpus < 1:
            raise ValueError(f"reference instance needs >= 1 GPU (got {gpus})")
        return cls(usd_per_gpu_hour=usd_per_hour / gpus, mfu=mfu, name=name)


@dataclass(kw_only=True, frozen=True)
class Economics:
    """Unit economics of a throughput, ours against the reference cluster of the same GPU count."""

    tokens_per_s: float
    effective_mfu: float
    tax: float
    usd_per_hour: float
    usd_per_mtok: float
    reference_tokens_per_s: float | None
    """None (like the fields below) when no reference was given."""
    reference_usd_per_mtok: float | None
    saving: float | None
    """1 - ours / reference $/Mtok; positive means we are cheaper."""
    break_even_tokens_per_s: float | None
    """Tokens/s the reference would need to match our $/Mtok."""
    break_even_mfu: float | None


def economics(
    *,
    tokens_per_s: float,
    n_gpus: int,
    peak_tflops_per_gpu: float,
    flops_per_token: float,
    usd_per_gpu_hour: float,
    ceiling: float,
    reference: ReferenceCluster | None = None,
) -> Economics:
    """Economics of a measured (or predicted) throughput (seed 000, "An AWS price comparison")::

        MFU          = tokens/s x F / (n x peak)
        ref tokens/s = tokens/s x ref.mfu / MFU          (x ref.peak / peak for other GPUs)
        break-even   = ref $/h / (our $/Mtok x 3600 / 1e6),  its MFU = break-even x F / (n x ref.peak)

    For a mixed pool pass the means: peak = sum of peaks / n, price = sum of $/h / n.
    """
    if tokens_per_s <= 0 or n_gpus < 1 or peak_tflops_per_gpu <= 0 or flops_per_token <= 0:
        raise ValueError("tokens_per_s, n_gpus, peak_tflops_per_gpu and flops_per_token must be > 0")
    peak = n_gpus * peak_tflops_per_gpu * 1e12
    mfu = tokens_per_s * flops_per_token / peak
    usd_h = n_gpus * usd_per_gpu_hour
    ours = usd_per_mtok(usd_h, tokens_per_s)
    base = dict(
        tokens_per_s=tokens_per_s,
        effective_mfu=mfu,
        tax=1.0 - mfu / ceiling,
        usd_per_hour=usd_h,
        usd_per_mtok=ours,
    )
    if reference is None:
        return Economics(
            **base,
            reference_tokens_per_s=None,
            reference_usd_per_mtok=None,
            saving=None,
            break_even_tokens_per_s=None,
            break_even_mfu=None,
        )
    ref_peak = n_gpus * (reference.peak_tflops_per_gpu or peak_tflops_per_gpu) * 1e12
    ref_tps = reference.mfu * ref_peak / flops_per_token
    ref_usd_h = n_gpus * reference.usd_per_gpu_hour
    ref = usd_per_mtok(ref_usd_h, ref_tps)
    break_even = ref_usd_h / (ours * 3600.0 / 1e6) if ours > 0 else math.inf  # free GPUs: never
    return Economics(
        **base,
        reference_tokens_per_s=ref_tps,
        reference_usd_per_mtok=ref,
        saving=1.0 - ours / ref,
        break_even_tokens_per_s=break_even,
        break_even_mfu=break_even * flops_per_token / ref_peak,
    )

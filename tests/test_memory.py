"""protocol/memory.py: the table of bytes per parameter, stage estimates, and the reason a stage does not fit."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.memory import (
    BYTES_PER_PARAM,
    GB,
    StageMemory,
    bytes_per_param,
    captured_share,
    fits,
    in_flight,
    precision_for_device,
    stage_memory,
    stage_params,
)
from protocol.runspec import ModelSpec, PipelineSpec, RunSpec, SyncSpec, TrainSpec


def _spec(**changes: object) -> RunSpec:
    base = RunSpec(
        run_id="mem",
        stages=4,
        model=ModelSpec(vocab=256, d_model=256, n_layers=8, n_heads=4, d_ff=688, seq_len=256),
        train=TrainSpec(batch_size=8, microbatches=4),
        sync=SyncSpec(method="sparseloco", H=30, P=1, tau=0),
        pipeline=PipelineSpec(extra_in_flight=0),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _llama8b_shape(**changes: object) -> RunSpec:
    """Llama-3-8B widths (full attention, as node/model.py builds it), 32 layers over 8 stages."""
    model = ModelSpec(vocab=128256, d_model=4096, n_layers=32, n_heads=32, d_ff=14336, seq_len=2048)
    return _spec(stages=8, model=model, train=TrainSpec(batch_size=8, microbatches=8), **changes)


def test_table_and_components_add_up() -> None:
    assert BYTES_PER_PARAM["weights"] + BYTES_PER_PARAM["grads"] + BYTES_PER_PARAM["adamw"] == 16
    assert bytes_per_param("bf16") == 26  # + one bf16 copy, anchor, error feedback
    assert bytes_per_param("fp32") == 24
    assert bytes_per_param("fp32", method="diloco", outer_momentum=0.9) == 24
    spec = _spec()
    for s in range(spec.stages):
        m = stage_memory(spec, s, "bf16")
        parts = (m.weights, m.grads, m.optimizer, m.autocast_copies, m.outer_state, m.activations)
        assert m.total == sum(parts) and all(p > 0 for p in parts)
        n = stage_params(spec, s)
        assert (m.weights, m.grads, m.optimizer, m.outer_state) == (4 * n, 4 * n, 8 * n, 8 * n)
    assert sum(stage_params(spec, s) for s in range(spec.stages)) == spec.model.n_params


def test_bf16_adds_weight_copies_and_saves_activations() -> None:
    spec = _spec()
    for s in range(spec.stages):
        bf, fp = stage_memory(spec, s, "bf16"), stage_memory(spec, s, "fp32")
        assert (bf.weights, bf.grads, bf.optimizer, bf.outer_state) == (
            fp.weights,
            fp.grads,
            fp.optimizer,
            fp.outer_state,
        )
        assert fp.autocast_copies == 0 and bf.autocast_copies > 0
        assert bf.activations < fp.activations
    # one bf16 copy of every matmul weight per step: node/pipeline/schedule.py runs a step in one autocast region
    mid = stage_memory(spec, 1, "bf16")  # 2 layers, 3 microbatches in flight; norm gains are not cast
    assert mid.autocast_copies == 2 * (stage_params(spec, 1) - 2 * 2 * 256)
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        stage_memory(spec, 0, "auto")


def test_outer_state_follows_the_sync_method() -> None:
    n = stage_params(_spec(), 1)
    sparse = stage_memory(_spec(), 1, "fp32").outer_state
    dense = stage_memory(_spec(sync=SyncSpec(method="diloco", P=1, tau=0)), 1, "fp32").outer_state
    assert sparse - dense == 4 * n  # SparseLoCo's error feedback
    momentum = stage_memory(_spec(sync=SyncSpec(method="diloco", outer_momentum=0.9)), 1, "fp32")
    assert momentum.outer_state - dense == 4 * n
    overlap = stage_memory(_spec(sync=SyncSpec(method="sparseloco", H=30, P=4, tau=2)), 1, "fp32")
    assert overlap.outer_state - sparse == n  # a quarter of theta captured, 4 bytes each
    assert captured_share(30, 4, 0) == 0.0
    assert captured_share(30, 4, 2) == 0.25  # captures every 7 steps, applied 2 later: one pending
    assert captured_share(30, 4, 8) == 0.5
    assert captured_share(30, 1, 5) == 1.0


def test_in_flight_follows_the_1f1b_schedule() -> None:
    # node/pipeline/schedule.py: warm-up min(S - s - 1 + extra, M) forwards (none on the last stage), then 1F1B
    assert [in_flight(4, s, 0, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(4, s, 2, 8) for s in range(4)] == [6, 5, 4, 1]
    assert [in_flight(4, s, 2, 3) for s in range(4)] == [3, 3, 3, 1]  # never more than M
    with pytest.raises(ValueError, match="outside"):
        in_flight(4, 4, 0, 8)


def test_activations_grow_with_extra_in_flight_and_shrink_down_the_pipeline() -> None:
    M8 = TrainSpec(batch_size=16, microbatches=8)  # 2 sequences per microbatch; room for extra in flight
    for precision in ("fp32", "bf16"):
        plain = [stage_memory(_spec(train=M8), s, precision).activations for s in range(4)]
        assert plain[0] > plain[1] > plain[2]  # equal layers, fewer microbatches in flight
        deep = _spec(train=M8, pipeline=PipelineSpec(extra_in_flight=2))
        assert all(stage_memory(deep, s, precision).activations > plain[s] for s in range(3))
        assert stage_memory(deep, 3, precision).activations == plain[3]  # the last stage keeps one
        capped = _spec(pipeline=PipelineSpec(extra_in_flight=2))  # M = 4: stage 0 already has all 4
        assert stage_memory(capped, 0, precision) == stage_memory(_spec(), 0, precision)
        bigger = _spec(train=TrainSpec(batch_size=32, microbatches=8))  # twice the tokens per microbatch
        assert stage_memory(bigger, 1, precision).activations == 2 * plain[1]


def test_llama_8b_shaped_stage() -> None:
    spec = _llama8b_shape()
    n = stage_params(spec, 1)
    assert n == pytest.approx(0.973e9, rel=0.001)  # 4 layers of d = 4096, d_ff = 14336
    fp = stage_memory(spec, 1, "fp32")
    assert (fp.weights + fp.grads + fp.optimizer) / GB == pytest.approx(15.6, abs=0.05)
    bf = stage_memory(spec, 1, "bf16")
    # 7 microbatches in flight (1F1B, S = 8) share one bf16 copy; 2048 tokens x 4 layers x 262144 bytes each
    assert bf.autocast_copies == 2 * (n - 4 * 2 * 4096)
    assert bf.activations / GB == pytest.approx((7 * 2048 * (4 * 262144 + 4 * 4096) + 2048 * 262144) / GB)
    assert stage_memory(spec, 0, "bf16").weights - bf.weights == 4 * 128256 * 4096  # the embedding


# Measured on an H200 (torch 2.11, eager, fused AdamW): torch.cuda.max_memory_allocated over a training
# step of one stage, 1F1B order, outer state not allocated. The estimate may exceed a measurement
# (fits() keeps 10% headroom on top), but should not fall far below one. (bf16 rows with several
# microbatches in flight were measured when each forward had its own autocast region, a bf16 weight copy
# per microbatch; the step now shares one, and scripts/bench_gpu.py reports estimate vs peak.)
H200_MEASURED = [
    # (d, d_ff, heads, vocab, L, b, n_layers, stages, extra, stage, precision, bytes)
    (1024, 2816, 8, 32000, 1024, 2, 8, 4, 0, 3, "fp32", 2_115_767_296),
    (1024, 2816, 8, 32000, 1024, 2, 8, 4, 2, 0, "fp32", 3_182_014_976),
    (4096, 14336, 32, 128256, 2048, 1, 8, 4, 2, 3, "bf16", 22_527_464_448),
]


@pytest.mark.parametrize("row", H200_MEASURED)
def test_estimate_matches_a_measured_stage(
    row: tuple[int, int, int, int, int, int, int, int, int, int, str, int],
) -> None:
    d, f, heads, V, L, b, n_layers, S, extra, s, precision, measured = row
    spec = RunSpec(
        run_id="cal",
        stages=S,
        model=ModelSpec(vocab=V, d_model=d, n_layers=n_layers, n_heads=heads, d_ff=f, seq_len=L),
        train=TrainSpec(batch_size=b * 8, microbatches=8),
        pipeline=PipelineSpec(extra_in_flight=extra),
    )
    m = stage_memory(spec, s, precision)
    assert 0.97 <= (m.total - m.outer_state) / measured <= 1.25


def test_fits_names_the_figures() -> None:
    need = StageMemory(
        stage=1,
        precision="bf16",
        weights=int(4.1e9),
        grads=int(4.1e9),
        optimizer=int(8.2e9),
        autocast_copies=0,
        outer_state=int(8.2e9),
        activations=int(13.6e9),
    )
    assert need.describe() == "38.2 GB (weights 4.1, grads 4.1, AdamW 8.2, outer state 8.2, activations 13.6)"
    assert fits(need, int(50e9)) is None
    reason = fits(need, int(30e9))
    assert reason is not None
    assert reason.startswith("stage 1 needs 38.2 GB (weights 4.1, grads 4.1, AdamW 8.2, outer state 8.2")
    assert "but the node has 30.0 GB free (90% usable): use more stages" in reason
    assert fits(int(26.9e9), int(30e9)) is None
    assert fits(int(27.1e9), int(30e9)) == (
        "the stage needs 27.1 GB but the node has 30.0 GB free (90% usable): "
        "use more stages or a node with more memory"
    )
    assert fits(int(29e9), int(30e9), headroom=1.0) is None
    tiny = stage_memory(_spec(), 1, "fp32")  # a CPU-sized stage shows its parts in thousandths of a GB
    assert tiny.describe().startswith(f"{tiny.total / GB:.3f} GB (weights {tiny.weights / GB:.3f}, ")
    with pytest.raises(ValueError, match="headroom"):
        fits(1, 1, headroom=0.0)


def test_precision_for_device() -> None:
    assert precision_for_device("cuda:NVIDIA A100-SXM4-80GB") == "bf16"
    assert precision_for_device("cuda") == "bf16"
    assert precision_for_device("cpu") == "fp32"
    assert precision_for_device("cuda:0", "fp32") == "fp32"
    assert precision_for_device("cpu", "bf16") == "bf16"
    with pytest.raises(ValueError, match="auto, fp32, bf16"):
        precision_for_device("cpu", "fp16")

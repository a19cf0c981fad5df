"""Device resolution (auto / explicit / several nodes on one host), precision, and the inner step's device path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.plan.inputs import sustained_tflops
from node.device import DeviceError, claim_gpu, resolve_device, resolve_precision
from node.inner_step import inner_step, make_optimizer, prepare_stage
from node.model import build_stage, lm_loss
from node.probe import measure_reference_block
from protocol.reference_block import reference_block_for
from protocol.runspec import ModelSpec, TrainSpec

ROOT = Path(__file__).resolve().parents[1]


def test_auto_is_the_cpu_without_cuda_and_a_gpu_with_it(tmp_path: Path) -> None:
    dev, claim = resolve_device("auto", cuda_count=0, claim_dir=tmp_path)
    assert dev == torch.device("cpu") and claim is None
    dev, claim = resolve_device("auto", cuda_count=1, claim_dir=tmp_path)
    assert dev == torch.device("cuda", 0) and claim is not None and claim.index == 0
    claim.close()


def test_several_auto_nodes_on_one_host_spread_over_its_gpus(tmp_path: Path) -> None:
    first = claim_gpu(2, tmp_path)
    second = claim_gpu(2, tmp_path)
    assert (first.index, second.index) == (0, 1)
    third = claim_gpu(2, tmp_path)  # every GPU taken: shares one, holds no claim
    assert third.index in (0, 1) and third._handle is None
    first.close()  # a node that stops (or dies: the lock goes with the process) frees its GPU
    again = claim_gpu(2, tmp_path)
    assert again.index == 0
    for c in (second, third, again):
        c.close()


def test_a_claim_held_by_another_process_is_respected(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from node.device import claim_gpu; "
            f"c = claim_gpu(2, Path({str(tmp_path)!r})); print(c.index, flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "0"
        dev, claim = resolve_device("auto", cuda_count=2, claim_dir=tmp_path)
        assert dev == torch.device("cuda", 1) and claim is not None
        claim.close()
    finally:
        holder.kill()
        holder.wait(10)
    dev, claim = resolve_device("auto", cuda_count=2, claim_dir=tmp_path)  # the dead holder freed GPU 0
    assert dev == torch.device("cuda", 0) and claim is not None
    claim.close()


def test_explicit_devices_and_their_errors(tmp_path: Path) -> None:
    assert resolve_device("cpu", cuda_count=4)[0] == torch.device("cpu")
    assert resolve_device("cuda", cuda_count=2)[0] == torch.device("cuda", 0)
    assert resolve_device("cuda:1", cuda_count=2)[0] == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match="sees no CUDA device.*nvidia-smi"):
        resolve_device("cuda", cuda_count=0)
    with pytest.raises(DeviceError, match=r"has 2 CUDA device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2", cuda_count=2)
    with pytest.raises(DeviceError, match="must be a number"):
        resolve_device("cuda:x", cuda_count=2)
    with pytest.raises(DeviceError, match="not one of auto, cpu, cuda, cuda:N"):
        resolve_device("tpu", cuda_count=2)


def test_precision_auto_is_bf16_on_cuda_and_fp32_on_the_cpu() -> None:
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    with pytest.raises(DeviceError, match="not one of auto, fp32, bf16"):
        resolve_precision("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="train.precision"):
        TrainSpec(precision="fp8")  # type: ignore[arg-type]


def test_node_config_rejects_an_unknown_device() -> None:
    from node.daemon import NodeConfig

    assert NodeConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device 'gpu' is not one of"):
        NodeConfig(device="gpu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_inner_step_trains_in_either_precision_with_fp32_master_weights(precision: str) -> None:
    spec = ModelSpec(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=16)
    train = TrainSpec(total_steps=20, batch_size=4, microbatches=1, lr=1e-2, warmup_steps=1)
    module = prepare_stage(build_stage(spec, [(0, 2)], 0), torch.device("cpu"), precision)  # type: ignore[arg-type]
    opt = make_optimizer(module, train)
    tokens = torch.randint(0, spec.vocab, (4, spec.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def forward_backward() -> float:
        loss = lm_loss(module(tokens[:, :-1]), tokens)
        loss.backward()
        return float(loss.detach())

    losses = [inner_step(module, opt, train, step, forward_backward) for step in range(12)]
    assert losses[-1] < losses[0] - 0.5  # it learns the batch
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_join_with_device_cuda_on_a_cpu_host_says_so() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "node.cli", "join", "--device", "cuda", "--bootstrap",
         "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
         "--operator-key", "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
         "--store-endpoint", "http://127.0.0.1:1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "sees no CUDA device" in p.stderr and "Traceback" not in p.stderr


def test_an_assignment_that_does_not_fit_is_refused_with_the_figures() -> None:
    from node.daemon import memory_refusal
    from node.device import free_memory_bytes
    from protocol.messages import Assignment
    from protocol.runspec import RunSpec

    def assignment(model: ModelSpec) -> Assignment:
        spec = RunSpec(run_id="mem", stages=2, model=model)
        return Assignment(
            run_id="mem", term=1, epoch=1, peer_id="p", replica=0, stage=1, layers=[1, 2], spec=spec
        )

    cpu = torch.device("cpu")
    free = free_memory_bytes(cpu)
    assert free > 0
    assert memory_refusal(assignment(ModelSpec()), cpu, free) is None  # the local swarm's model fits
    huge = ModelSpec(d_model=16384, n_heads=128, d_ff=53248, n_layers=64, seq_len=4096)  # 200B+ params
    reason = memory_refusal(assignment(huge), cpu, free)
    assert reason is not None and "stage 1 needs" in reason and "GB free" in reason
    assert "more stages" in reason


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_reference_block_is_timed_on_the_nodes_device(precision: str) -> None:
    """What a node advertises as ref_block / ref_block_s: the CPU's shape, a positive time that the
    planner turns into a sustained rate below the machine's plausible range (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        name, seconds = measure_reference_block(torch.device("cpu"), precision)
    finally:
        torch.set_num_threads(threads)
    assert name == reference_block_for("cpu").name and seconds > 0
    assert 1e-4 < sustained_tflops(name, seconds) < 10.0  # TFLOP/s of one CPU thread

"""The benchmark scripts still run and print their one JSON line (smoke-sized; figures live in docs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def run_bench(*args: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=280, check=False
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_bench_codec_reports_the_ratio() -> None:
    out = run_bench("scripts.bench_codec", "--sizes", "1M")
    assert out["ratio"] > 150 and out["encode_gbps"] > 0 and out["decode_gbps"] > 0


def test_bench_pipeline_quick() -> None:
    out = run_bench(
        "scripts.bench_pipeline", "--microbatches", "2", "--micro-batch", "2", "--steps", "3", "--warmup", "1"
    )  # --quick's sizes, one more round
    assert 0 < out["payload_fraction"] < 0.5  # the k-wide subspace links send a fraction of dense
    sp = out["tax_spread"]  # the rounds alternate the arms' order; the median and its spread
    assert sp["min"] <= out["tax"] <= sp["max"] and len(out["tax_per_round"]) == 2 and sp["iqr"] >= 0


def test_bench_subspace_quality_quick() -> None:
    out = run_bench("scripts.bench_subspace_quality", "--quick", "--seq-len", "64", "--batch", "4")
    assert out["fwd_bytes_subspace"] < out["fwd_bytes_dense"] and out["val_bpb_subspace"] > 0
    assert out["off_subspace"] < 1e-3  # the constrained stages keep the residual stream in span(U)


def test_sweep_quality_runs_bench_quality_per_seed_and_arm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run_bench(
        "scripts.sweep_quality",
        "--seeds",
        "1",  # one seed: the per-seed loop and the gap statistics are the same code for two
        "--arms",
        "adamw,sparseloco",
        "--out",
        str(tmp_path),
        "--",
        *("--replicas", "2", "--steps", "60", "--H", "10", "--warmup", "10", "--eval-batches", "8"),
        *("--d-model", "64", "--batch", "4", "--threads", "1"),
    )
    assert out["failed"] == []
    assert set(out["val_bpb"]["1"]) == {"adamw", "sparseloco"}
    gap = out["gaps"]["sparseloco_vs_adamw"]
    assert gap["n"] == 1 and abs(gap["mean"]) < 0.5  # both arms trained: neither is off by half
    assert len(list(tmp_path.glob("seed*_*.log"))) == 2


def test_bench_placement_small_pools() -> None:
    out = run_bench("scripts.bench_placement", "--sizes", "100,1000")
    assert out["place_s_1000"] < 5.0  # 0.4 s measured; the bound leaves room for a loaded machine
    assert out["gain_vs_random"] > 0 and out["gain_vs_greedy"] > 0


def test_bench_attack_quick() -> None:
    """2 colluders of 5 aimed at the honest mean (reversed, orthogonal) in a 1-round run, 1 seed:
    both are left out by every replica, never an honest one; the figures are in docs/benchmarks.md."""
    out = run_bench("scripts.bench_attack", "--quick")
    (run,) = out["runs"]
    assert (run["replicas"], run["hostile_replicas"]) == (5, [3, 4])
    assert set(run["gap_summary"]) == {"reversed", "orthogonal"}
    for kind in ("reversed", "orthogonal"):
        assert run["bounded_and_left_out"][kind]["trimmed"][1] == 5 * 2  # replicas x colluders, 1 round
        assert run["honest_left_out"][kind]["trimmed"] == 0
        assert abs(run["gap_summary"][kind]["trimmed"]["mean"]) < 0.05
    assert out["honest_never_left_out"] is True


def test_bench_quality_mixed_batch_arm_weighs_by_tokens() -> None:
    """The mixed arm (issue 22 acceptance 4a): the last half of the replicas at twice the batch, and the
    aggregate's weights are the tokens each trained in the round (H x batch x seq_len)."""
    out = run_bench(
        "scripts.bench_quality", "--replicas", "2", "--steps", "40", "--H", "10", "--warmup", "10",
        "--eval-batches", "4", "--arms", "mixed_tokens", "--d-model", "64", "--batch", "4", "--threads", "1",
    )  # fmt: skip
    H, seq = out["H"], out["seq_len"]
    assert out["round_tokens"]["mixed_tokens"] == {"0": H * 4 * seq, "1": H * 8 * seq}
    assert out["val_bpb"]["mixed_tokens"] is not None and out["missing"] == out["rejected"] == 0


def test_bench_butterfly_reads_one_partner_message_per_round() -> None:
    out = run_bench("scripts.bench_butterfly", "--replicas", "4,6,8", "--d", "64")
    rows = {r["replicas"]: r for r in out["rows"]}
    assert 1.5 < rows[8]["ratio_x_n_minus_1"] < 2.5  # two parts from one partner, not N - 1 fragments
    assert rows[8]["butterfly_exchanges_to_mix"] == 3 and rows[4]["butterfly_exchanges_to_mix"] == 2
    assert rows[6]["butterfly_sit_out_share"] > 0 == rows[8]["butterfly_sit_out_share"]


def test_bench_quality_butterfly_arm_reads_one_message_per_exchange() -> None:
    """The butterfly arm (issue 23): 4 replicas pair up each round, every exchange blended, each replica
    downloading one partner's message per round (about twice its own upload: pseudo-gradient plus anchor
    difference), and the anchors apart (no consensus) but close."""
    out = run_bench(
        "scripts.bench_quality", "--replicas", "4", "--steps", "60", "--H", "10", "--warmup", "10",
        "--eval-batches", "4", "--arms", "butterfly,sparseloco", "--d-model", "64", "--batch", "4",
        "--timeout-s", "5", "--threads", "1",
    )  # fmt: skip
    rounds = out["steps"] // out["H"]
    assert {k: v for k, v in out["butterfly_pairs"].items() if k != "clipped"} == {
        "exchanged": 4 * rounds, "unpaired": 0, "missing": 0, "refused": 0, "disagreed": 0, "resynced": 0
    }  # fmt: skip
    down, up = out["bytes_down_per_round"], out["bytes_up_per_round"]
    assert 0.9 < down["butterfly"] / up["butterfly"] < 1.1  # one partner's message of its own size
    assert 2.5 < down["sparseloco"] / up["sparseloco"] < 3.5  # N - 1 = 3 fragments
    assert 0 < out["butterfly_spread"] < 1 and len(set(out["butterfly_val_bpb"])) > 1


def test_bench_quality_moe_arms_match_the_dense_active_parameters() -> None:
    """The MoE arms (issue 24): the same active parameters as the dense model (top-2 experts of half its
    width), the expert bias moved by the per-step barrier (the bench checks every replica's is the same)
    under SparseLoCo, and by the global batch under data-parallel AdamW; both train and report the load."""
    out = run_bench(
        "scripts.bench_quality", "--replicas", "2", "--steps", "30", "--H", "5", "--warmup", "5",
        "--eval-batches", "2", "--arms", "moe,moe_adamw", "--d-model", "64", "--batch", "4", "--threads", "1",
    )  # fmt: skip
    moe = out["moe"]
    assert abs(moe["active_params"] - moe["dense_params"]) / moe["dense_params"] < 0.01
    assert moe["params"] > 2 * moe["dense_params"]
    assert all(0 < v < 8 for v in out["val_bpb"].values())
    assert set(moe["load_ratio"]) == {"moe", "moe_adamw"}
    assert all(r >= 1.0 for arm in moe["load_ratio"].values() for r in arm.values())


def test_bench_relay_quick() -> None:
    out = run_bench(
        "scripts.bench_relay",
        "--total-mib",
        "2",
        "--repeats",
        "1",
        "--cut-every-mib",
        "1",
        "--replica-steps",
        "1",
    )
    assert out["bench"] == "relay" and out["relay_checked"]
    assert (
        out["relayed_mb_s"] > 0 and out["cuts"] >= 1 and out["resumes"] >= 1
    )  # a cut or two may share a resume
    assert out["replica_relayed_tokens_s"] > 0 and out["replica_direct_tokens_s"] > 0

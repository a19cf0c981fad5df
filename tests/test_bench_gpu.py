"""scripts/bench_gpu.py runs where a bare GPU machine leaves it: only torch, numpy and msgpack importable.

The smoke run (all three parts, tiny, on the CPU) runs with hivemind, boto3, moto, cryptography, base58 and
psutil made unimportable in the benchmark and in its stage processes (a sitecustomize on PYTHONPATH installs
an import blocker in every interpreter started with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("hivemind", "boto3", "botocore", "moto", "cryptography", "base58", "psutil")
BLOCKER = f"""
import sys

BLOCKED = {BLOCKED!r}


class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on a bare GPU machine")
        return None


sys.meta_path.insert(0, _Blocked())
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_gpu_smoke_runs_without_the_swarm_dependencies(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    probe = subprocess.run(
        [sys.executable, "-c", "import psutil"], env=env, capture_output=True, text=True, check=False
    )
    assert probe.returncode != 0 and "bare GPU machine" in probe.stderr  # the blocker is in force
    out_file = tmp_path / "bench_gpu.json"
    p = subprocess.run(
        [sys.executable, "-m", "scripts.bench_gpu", "--smoke", "--json-out", str(out_file)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert json.loads(out_file.read_text()) == out
    assert out["device"] == "cpu" and out["precision"] == "fp32"
    stage = out["stage"]
    assert stage["tokens_per_s"] > 0 and 0 < stage["mfu"] < 1.5 and not stage["compiled"]
    sl = out["sparseloco"]
    assert sl["device_gbps"] > 0 and sl["host_coding_s"] > 0 and sl["ratio_vs_fp32"] > 100
    assert sl["decode_cuda_equals_cpu"] and sl["aggregate_cuda_equals_cpu"]
    pipe = out["pipeline"]
    assert pipe["M"] == 4 and pipe["extra_in_flight"] == 2 and pipe["wire_dtype"] == "bfloat16"
    assert pipe["unshaped"]["tokens_per_s"] > 0 and pipe["shaped"]["tokens_per_s"] > 0
    assert -1 < pipe["tax"] < 1

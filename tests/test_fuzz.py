"""Mutation fuzzing of every decoder of untrusted bytes (issue 10, acceptance 2): a few thousand inputs each.

`python -m scripts.fuzz` runs 100,000 per decoder; docs/reliability.md has the measured figures. Here the
same script runs 2,000 per decoder, each decoder in its own child process under an address-space cap of its
baseline + 100 MB, and every decoder must refuse every hostile input with one of its documented error types,
in under a second, without a MemoryError.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.schema import ProtocolError
from scripts import fuzz

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
N = 2000

KNOWN_FINDINGS: dict[str, int] = {}
"""Decoder -> the exact number of undocumented exceptions it raises at N inputs (seed 0), for a crash found
and reported but not fixed yet. Empty: the random inputs (at most about a megabyte) find none."""

FLOOD_MB = 16
KNOWN_FLOOD_MEMORY_ERRORS = {"envelope:NodeAdvert", "dense", "dht_validator"}
"""Known finding (reported for issue 10, not fixed): msgpack turns every byte of untrusted input into a
Python object before anything bounds their number. An envelope of 16 MiB (its limit; unpacked before the
signature is checked), a dense fragment of 16 MiB (its limit is 1 GiB) and a DHT value of 4 MiB (one hivemind
message; the validator hides the MemoryError as an unparsable record) made of empty msgpack arrays go over
the 100 MB cap. When a fix lands, this test fails until the decoder leaves the set."""
KNOWN_FLOOD_SLOW = {"sparseloco", "sparseloco_expect"}
"""Same finding, under the cap: a fragment whose 1 MiB header is empty arrays (parsed before `expect` is
compared) takes about 1.4 s in a process with torch loaded (cyclic GC passes over a million new lists), so
no time bound is asserted for these two."""

ACCEPTED = {"ok", "admitted"}


def _run_fuzz(*args: str, timeout_s: float) -> tuple[int, dict, str]:
    """`python -m scripts.fuzz ARGS` in its own process group (killed whole on a timeout)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.fuzz", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    lines = out.decode().strip().splitlines()
    assert lines, f"scripts.fuzz printed nothing; stderr:\n{err.decode()[-3000:]}"
    return proc.returncode, json.loads(lines[-1]), err.decode()


@pytest.mark.timeout(300)
def test_every_decoder_refuses_mutated_valid_inputs_with_its_documented_errors() -> None:
    rc, result, log = _run_fuzz("--n", str(N), "--jobs", "2", timeout_s=280)
    decoders = result["decoders"]
    assert set(decoders) == set(fuzz.DECODERS)
    for name, r in decoders.items():
        assert "crashed" not in r, f"{name}: {r['crashed']}\n{log[-3000:]}"
        assert r["n"] == N and r["generator_errors"] == 0, r.get("generator_error")
        shown = json.dumps(r["findings"], indent=1)[:4000]
        assert r["bad_exceptions"] == KNOWN_FINDINGS.get(name, 0), f"{name}: undocumented exceptions\n{shown}"
        assert r["slowest_s"] < fuzz.SLOW_S, f"{name}: input {r['slowest_input']} took {r['slowest_s']} s"
        assert not r["memory_error"], f"{name}: an input went over {r['mem_limit_mb']} MB of address space"
        # the inputs reach every layer: some pass as valid, most are refused, and for every signed format
        # some are refused after their signature verified (re-signed hostile content)
        outcomes = r["outcomes"]
        accepted = sum(v for k, v in outcomes.items() if k.split(",")[0] in ACCEPTED)
        assert 0 < accepted < N // 2, f"{name}: {outcomes}"
    for name in ("envelope:Assignment", "dense"):
        assert decoders[name]["outcomes"]["SchemaError"] > N // 4
    for name in ("sparseloco", "sparseloco_expect"):
        assert decoders[name]["outcomes"]["FragmentError"] > N // 2
    clean = not KNOWN_FINDINGS
    assert result["clean"] is clean and rc == (0 if clean else 1)


@pytest.mark.timeout(180)
def test_a_flood_of_msgpack_containers_at_each_size_limit_is_a_known_finding() -> None:
    names = ["frame", "envelope:NodeAdvert", "sparseloco", "sparseloco_expect", "dense", "dht_validator"]
    _, result, log = _run_fuzz("--flood", str(FLOOD_MB), "--decoders", ",".join(names), timeout_s=170)
    decoders = result["decoders"]
    for name, r in decoders.items():
        assert "crashed" not in r and not r["bad_exception"], f"{name}: {r}\n{log[-3000:]}"
        if name not in KNOWN_FLOOD_SLOW | KNOWN_FLOOD_MEMORY_ERRORS:
            assert r["seconds"] < fuzz.SLOW_S, f"{name}: {r}"
    assert {name for name, r in decoders.items() if r["memory_error"]} == KNOWN_FLOOD_MEMORY_ERRORS
    assert decoders["frame"]["flood_bytes"] > FLOOD_MB * 2**20  # a whole 16 MiB frame, read under the cap
    for name in KNOWN_FLOOD_SLOW:
        assert decoders[name]["outcome"] == "FragmentError"


def test_each_input_is_rebuilt_alike_from_its_index() -> None:
    """`--repro DECODER I` must rebuild exactly the input the run decoded: nothing carries over between
    inputs (the shared tables of extreme values are never edited in place)."""
    for name, make in fuzz.DECODERS.items():
        a, b = make(), make()
        seq = [a.show(a.generate(fuzz.input_rng(0, name, i))) for i in range(100)]
        for i in (99, 50, 3):
            assert b.show(b.generate(fuzz.input_rng(0, name, i))) == seq[i], (name, i)


class _Scripted(fuzz.Target):
    """A decoder whose every outcome is known: the harness must count each one where it belongs."""

    name = "scripted"

    def seeds(self) -> list[bytes]:
        return [b"\x00"]

    def generate(self, rng: random.Random) -> bytes:
        return bytes([rng.randrange(4)])

    def decode(self, x: bytes) -> str:
        if x == b"\x01":
            raise TypeError("not a documented error")
        if x == b"\x02":
            raise MemoryError
        if x == b"\x03":
            raise ProtocolError("refused")
        return "ok"


def test_the_harness_counts_undocumented_errors_and_memory_errors(monkeypatch) -> None:
    monkeypatch.setitem(fuzz.DECODERS, "scripted", _Scripted)
    r = fuzz.run_decoder("scripted", 400, mem_mb=None)  # no cap: this is the test process
    o = r["outcomes"]
    assert sum(o.values()) == 400 and set(o) == {"ok", "TypeError", "MemoryError", "ProtocolError"}
    assert r["bad_exceptions"] == o["TypeError"] and r["memory_error"]
    found = {f["exception"] for f in r["findings"]}
    assert found == {"TypeError", "MemoryError"}
    example = next(f for f in r["findings"] if f["exception"] == "TypeError")
    assert example["hex"] == "01" and "not a documented error" in example["traceback"]

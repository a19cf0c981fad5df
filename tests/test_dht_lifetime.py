"""A process that holds a DHT peer and dies by SIGKILL (the OOM killer, a crash) takes its hivemind DHT
process and that one's p2pd with it: hivemind alone leaves both serving on, orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
HOLDER = """
import os, sys, time
from protocol.net.dht_client import DHTClient
from protocol.identity import Identity
c = DHTClient(Identity.generate())
print("READY", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_killed_holder_takes_its_dht_process_and_p2pd_with_it() -> None:
    family: list[psutil.Process] = []
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
        family = psutil.Process(p.pid).children(recursive=True)
        assert any("p2pd" in c.name() for c in family), [c.name() for c in family]  # DHT process + p2pd
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(c.is_running() and c.status() != "zombie" for c in family):
            time.sleep(0.1)
        left = [c.name() for c in family if c.is_running() and c.status() != "zombie"]
        assert not left, f"still running after their parent was killed: {left}"
    finally:
        if p.poll() is None:
            p.kill()
        for c in family:  # only what this test started
            if c.is_running():
                c.kill()

"""A stop that hangs is bounded: the stacks go to stderr and the process exits (protocol/process/signals.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

HUNG = """
import sys, threading, time
from protocol.process.signals import install_stop_signals
stopped = threading.Event()
install_stop_signals(stopped.set, grace_s={grace})
print("ready", flush=True)
stopped.wait()
print("stopping", flush=True)
time.sleep(3600)  # a shutdown step that never returns
"""


def _start(grace: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HUNG.format(grace=grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_hung_stop_ends_after_the_grace_with_the_stacks() -> None:
    p = _start(1.0)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0 and 0.9 < time.monotonic() - t0 < 10
    assert "stopping" in out and "did not finish within 1 s" in err
    assert 'File "<string>", line 9' in err  # the main thread's stack: where the stop hung


def test_a_second_signal_exits_at_once() -> None:
    p = _start(60.0)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGINT and time.monotonic() - t0 < 5

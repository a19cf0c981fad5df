"""Child processes for local swarms and swarm tests: own process group, log file, readiness line, timeouts."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path


class ProcessFailed(RuntimeError):
    """A child exited or did not become ready in time; the message quotes its log tail."""


class Child:
    """One OS process (new session, so killpg reaches everything it started), logging to a file."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.killed = False
        self._terminated = False
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = dict(os.environ)
        full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=full_env,
        )

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """Wait until the log matches `pattern`; raise ProcessFailed on exit or timeout."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = rx.search(self.log_text())
            if m:
                return m
            if self.proc.poll() is not None:
                raise ProcessFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise ProcessFailed(f"{self.name} not ready within {timeout_s:.0f} s:\n{self.tail()}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, for fault injection)."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM the process once (stop() waits for it), so several children stop at once. Only the
        process itself: it shuts down what it started (a node its DHT daemon, which it may still need
        on the way out); stop() SIGKILLs whatever of the group is left."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the group; returns the exit code of the graceful stop (None if killed)."""
        code: int | None = None
        if self.proc.poll() is None:
            self.terminate()
            try:
                code = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
        else:
            code = self.proc.returncode
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()
        return code

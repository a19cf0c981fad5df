"""A coordinator-eligible node runs the coordinator role as a supervised child process.

`crucible-node join --coordinator-eligible --coordinator-certificate CERT` starts
`crucible-coordinator serve` (a separate process, so node/ never imports coordinator/), signing with this
node's own key under the operator's certificate for it. Every candidate's coordinator competes for each
run's lease in the store; the holder leads that run and names itself in the run's DHT record, and when it
dies its lease lapses and another candidate takes over with a higher term (coordinator/lease.py). The node
restarts a child that exits, with exponential backoff, and stops it when the node stops.

The child is configured by a `ServeConfig` (protocol/process/serve_config.py), the object `serve` parses
its command line into: built here from the node's settings (`role_config`), handed to the child as its
command line, the store's keys by environment (`ps` shows a command line).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from node.config import NodeConfig
from protocol.process.serve_config import ServeConfig, store_fields
from protocol.process.settings import to_argv, to_env
from protocol.process.signals import die_with_parent

log = logging.getLogger(__name__)

BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0
HEALTHY_AFTER_S = 60.0
"""A child that ran this long resets the backoff."""


def role_config(cfg: NodeConfig, bootstrap: list[str]) -> ServeConfig:
    """The coordinator role of the node `cfg` configures: its swarm (`bootstrap`: the node's own, or its
    address when it started the swarm), its store, its key under its certificate, and its timers."""
    store = cfg.store
    assert store is not None  # NodeConfig: an eligible node has one
    return ServeConfig(
        bootstrap=bootstrap,
        host=cfg.host,
        **store_fields(store),
        key_file=str(Path(cfg.key_file).expanduser()),
        certificate=cfg.coordinator_certificate,
        operator_key=cfg.operator_key,
        lease_s=cfg.coordinator_lease_s,
        churn_grace_s=cfg.coordinator_churn_grace_s,
    )


class CoordinatorChild:
    """Starts, restarts (with backoff) and stops one `crucible-coordinator serve` process."""

    def __init__(self, config: ServeConfig, log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="coordinator-child", daemon=True)

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "serve", *to_argv(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its DHT daemon goes with it on stop
                preexec_fn=die_with_parent,  # a crashed node's coordinator does not lead on without it
                env={**os.environ, **to_env(self.config), "PYTHONUNBUFFERED": "1"},
            )
        self._started = time.monotonic()
        log.info("coordinator role started (pid %d, log %s)", self.proc.pid, self.log_path)

    def _supervise(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stop.wait(0.5):
            p = self.proc
            if p is None or p.poll() is None:
                continue
            ran = time.monotonic() - self._started
            backoff = BACKOFF_MIN_S if ran > HEALTHY_AFTER_S else min(2 * backoff, BACKOFF_MAX_S)
            log.warning(
                "coordinator role exited with %s after %.0f s (see %s); restarting in %.0f s",
                p.returncode,
                ran,
                self.log_path,
                backoff,
            )
            if self._stop.wait(backoff):
                return
            self.restarts += 1
            self._spawn()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stop.set()
        p = self.proc
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

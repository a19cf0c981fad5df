"""SIGINT/SIGTERM for the long-running roles (node, coordinator): stop cleanly, but within a bound.

The first signal asks the process to stop (its loop finishes the current step, the DHT and the store
clients shut down). A stop that hangs anyway (a library call that ignores its timeout) must not leave a
process that a supervisor or a test then has to SIGKILL without knowing why: after `grace_s` the stacks
of every thread go to stderr, and the process exits. A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child process (Linux): the kernel SIGKILLs it when the thread that started it ends, however
    its parent dies (SIGKILL, the OOM killer), so no child goes on serving without its parent."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def install_stop_signals(on_stop: Callable[[], None], grace_s: float = DEFAULT_GRACE_S) -> None:
    """Call on_stop() at the first SIGINT/SIGTERM and exit the process if it is still running
    `grace_s` later (with every thread's stack on stderr, to show what hung); exit at the second."""
    asked = threading.Event()

    def watchdog() -> None:
        asked.wait()
        time.sleep(grace_s)  # a process that stopped in time is gone by now (this thread is a daemon)
        log.warning("stop did not finish within %.0f s; exiting. The threads were doing:", grace_s)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(0)  # the stop was asked for: what had to be saved is in the store already

    def handler(signum: int, _frame: object) -> None:
        if asked.is_set():
            os._exit(128 + signum)
        asked.set()
        on_stop()

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)

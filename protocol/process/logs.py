"""Logging for every Crucible CLI: text for people, or one JSON object per line for log collectors.

    --log-format text   2026-12-01 05:40:00,123 INFO node.worker: run a r0/s1 step 10/20 ...
    --log-format json   {"ts": 1764567600.123, "level": "INFO", "logger": "node.worker", "msg": "...", "pid": 123}

Third-party libraries (hivemind, botocore, urllib3, aiohttp's access log) log at WARNING and above only:
their INFO lines say nothing a user acts on.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
NOISY = ("hivemind", "botocore", "boto3", "s3transfer", "urllib3", "aiohttp.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


LEVEL_NAMES = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}
"""Fixed names for the json format: hivemind renames WARNING to "WARN" for the whole process."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (Unix seconds), level, logger, msg, pid; exc when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": LEVEL_NAMES.get(record.levelno, record.levelname),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": os.getpid(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def add_log_args(p: argparse.ArgumentParser, default: str = "WARNING") -> None:
    """--log-level and --log-format, the same on every command of a CLI."""
    p.add_argument("--log-level", default=default, choices=LOG_LEVELS, help=f"default {default}")
    p.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text (default) or json: one object per line (ts, level, logger, msg, pid)",
    )


def json_line(msg: str, logger: str, **fields: object) -> str:
    """A line a CLI prints (a ready line) as one JSON object in the json format's shape (ts, level,
    logger, msg, pid) plus `fields`, so a log collector reading the json format parses it too."""
    out: dict[str, object] = {
        "ts": round(time.time(), 3),
        "level": "INFO",
        "logger": logger,
        "msg": msg,
        "pid": os.getpid(),
    }
    out.update(fields)
    return json.dumps(out, default=str)


class _StderrHandler(logging.Handler):
    """Writes to sys.stderr as it is when a record is emitted, not when logging was configured: whoever
    swaps sys.stderr later (a test harness capturing a command run in-process, a daemon redirecting it)
    does not leave the root logger writing into a closed stream from every thread."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's own contract: report through handleError, never raise
            self.handleError(record)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger on stderr (replacing any handler set before)."""
    if fmt not in LOG_FORMATS:
        raise ValueError(
            f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)} (example: --log-format json)"
        )
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def version() -> str:
    """The installed package's version (the source tree's when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("crucible")
    except PackageNotFoundError:
        return "0+unknown"


__all__ = [
    "LOG_FORMATS",
    "LOG_LEVELS",
    "NOISY",
    "JsonFormatter",
    "add_log_args",
    "json_line",
    "setup_logging",
    "version",
]

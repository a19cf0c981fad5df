"""Checks of a running swarm's /metrics, dashboard and HTTP error answers (issue 14), used by
tests/test_swarm.py against its module swarm: Prometheus's own parser, real headless Chromium, real
HTTP requests."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

CHROMIUM = os.environ.get("CRUCIBLE_CHROMIUM", "/usr/bin/chromium")
OUTPUT = Path(os.environ.get("CRUCIBLE_TEST_OUTPUT", Path(__file__).resolve().parent.parent / "test-output"))
"""Where the dashboard screenshot is saved (beside the test output; git ignores it)."""
CHROMIUM_FLAGS = [
    # the closed network: no background connections, no component updates (they fail and slow startup)
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)], parsed by prometheus_client's text parser (which raises on
    anything that is not the exposition format)."""
    with urllib.request.urlopen(url, timeout=20) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain"), r.headers["Content-Type"]
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("crucible_"), fam.name
        if fam.type == "counter":  # the parser strips _total from the family; every sample keeps it
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def http_status(url: str, method: str = "GET") -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        body = e.read()
        return e.code, json.loads(body) if body else {}


def bad_requests_get_4xx(base: str, cases: list[tuple[str, str, int]]) -> None:
    """Every (method, path, expected 4xx) gets that status and a JSON message saying what was wrong."""
    for method, path, want in cases:
        code, body = http_status(base.rstrip("/") + path, method)
        assert code == want, f"{method} {path}: {code} {body}"
        assert isinstance(body.get("error"), str) and len(body["error"]) > 10, f"{method} {path}: {body}"


def chromium(url: str, *args: str, timeout_s: float = 90) -> str:
    """Run Debian's chromium headless on `url`; its stdout (the DOM with --dump-dom)."""
    assert Path(CHROMIUM).exists(), (
        f"{CHROMIUM} is missing: the dashboard test drives Debian's chromium (apt-get install chromium; "
        ".ci/run installs it) or set CRUCIBLE_CHROMIUM"
    )
    profile = tempfile.mkdtemp(prefix="crucible-chromium-")
    try:
        p = subprocess.run(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def plot_ticks(dom: str, plot_id: str) -> tuple[list[str], list[str]]:
    """The labels of a dashboard plot's x (time) and y ticks, left to right and bottom to top."""
    m = re.search(rf'<svg id="{plot_id}"', dom)
    assert m, f"no plot {plot_id} in {dom[:2000]}"
    svg = dom[m.start() : dom.index("</svg>", m.start())]
    xs, ys = (re.findall(rf'<text class="tick-{axis}"[^>]*>([^<]*)</text>', svg) for axis in "xy")
    return xs, ys


def readable_ticks(xs: list[str], ys: list[str]) -> None:
    """A few ticks on each axis: elapsed time (0s, 30s, 1m, 1m30s, 2h05), numbers as 2,940 or 12.5k,
    never 2.94e+3."""
    assert len(xs) >= 3 and all(re.fullmatch(r"\d+[hms](\d\d[ms]?)?", x) for x in xs), xs
    assert len(ys) >= 3 and all(re.fullmatch(r"-?\d{1,3}(,\d{3})*(\.\d+)?[kMG]?", y) for y in ys), ys


def dashboard_shows_run(dashboard: str, run_id: str) -> Path:
    """The page, rendered by a real browser with its scripts run, shows the run, a loss plot with points and
    a tokens/s figure; returns the screenshot's path."""
    url = f"{dashboard}?run={run_id}"
    dom = chromium(url, "--virtual-time-budget=5000", "--dump-dom")
    assert f"run {run_id}:" in dom, dom[:3000]
    loss = re.search(r'<svg id="plot-loss"[^>]*data-points="(\d+)"', dom)
    assert loss and int(loss.group(1)) >= 2, f"no loss plot in {dom[:3000]}"
    plot = dom[loss.start() : dom.index("</svg>", loss.start())]
    polyline = re.search(r'<polyline points="([^"]+)"', plot)
    assert polyline and len(polyline.group(1).split()) >= 2, plot[:2000]
    tps = re.search(r'<b id="tokens-per-s">([^<]*)</b>', dom)
    assert tps and re.fullmatch(r"\d+", tps.group(1)), f"tokens/s not shown: {tps and tps.group(0)}"
    tps_plot = re.search(r'<svg id="plot-tps"[^>]*data-points="(\d+)"', dom)
    assert tps_plot and int(tps_plot.group(1)) >= 2
    for plot_id in ("plot-loss", "plot-tps", "plot-bytes"):  # issue 19: axes labelled, not just 0 and max
        readable_ticks(*plot_ticks(dom, plot_id))
    OUTPUT.mkdir(parents=True, exist_ok=True)
    shot = OUTPUT / "dashboard.png"
    shot.unlink(missing_ok=True)
    chromium(url, "--virtual-time-budget=5000", "--window-size=1400,1500", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000, shot
    return shot

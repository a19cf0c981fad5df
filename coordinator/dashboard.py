"""The coordinator's web dashboard and API (protocol/process/http_server.py: capped connections, request deadlines,
4xx with a message for a bad request, never a 500).

    GET /                          the dashboard (HTML; ?run=ID selects a run)
    GET /api/runs                  every run seen: state and latest figures
    GET /api/runs/ID               one run: spec summary, prediction, replicas x stages grid, latest figures
    GET /api/runs/ID/history       its samples (?since=UNIX_TIME&limit=N)
    GET /api/nodes                 the nodes advertising in the DHT
    GET /metrics                   Prometheus text format (coordinator/metrics.py)

The page draws its plots (loss, tokens/s, MFU and tax, $/Mtok, bytes on each path) as SVG from the API and
polls it every 2 s; its first data come embedded in the page, so it shows figures without a round trip.
Nothing is loaded from elsewhere (hosts here and many providers' hosts reach no CDN).
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING

from aiohttp import web

from coordinator.metrics import coordinator_families
from protocol.process.http_server import BadRequest, GuardedHTTPServer, check_query, query_int
from protocol.process.metrics import CONTENT_TYPE, render

if TYPE_CHECKING:
    from coordinator.service import Coordinator

MAX_HISTORY = 3600


def _clean(x: object) -> object:
    """JSON has no NaN or inf: a diverged loss is shown as missing."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(
        text=json.dumps(_clean(data), allow_nan=False), status=status, content_type="application/json"
    )


class Dashboard(GuardedHTTPServer):
    def __init__(self, coord: Coordinator, host: str, port: int) -> None:
        self.coord = coord
        super().__init__(
            host,
            port,
            {
                "/": self._page,
                "/api/runs": self._runs,
                "/api/runs/": self._one_run,
                "/api/nodes": self._nodes,
                "/metrics": self._metrics,
            },
            name="dashboard",
            port_flag="--http-port",
        )

    # --- helpers ---------------------------------------------------------------------------------------
    def _run_or_404(self, run_id: str) -> dict:
        runs = self.coord.view["runs"]
        if run_id not in runs:
            known = ", ".join(sorted(runs)[:10]) or "none yet"
            raise BadRequest(
                f"no run {run_id[:100]!r}; known runs: {known}", status=404, reason="unknown_run"
            )
        return runs[run_id]

    def _history(self, run_id: str, request: web.BaseRequest) -> list[dict]:
        raw = request.query.get("since", "0")
        try:
            since = float(raw)
        except ValueError:
            raise BadRequest(
                f"query since={raw[:40]!r} is not a number (example: ?since={time.time():.0f})"
            ) from None
        if not since >= 0 or since == float("inf"):
            raise BadRequest(f"query since={raw[:40]!r} must be a finite time >= 0 (Unix seconds)")
        limit = query_int(request, "limit", MAX_HISTORY, 1, MAX_HISTORY)
        return [s.as_dict() for s in self.coord.history.samples(run_id, since)][-limit:]

    # --- routes ----------------------------------------------------------------------------------------
    async def _runs(self, request: web.BaseRequest) -> web.Response:
        check_query(request, set())
        view = self.coord.view
        return _json(
            {
                "coordinator": view["coordinator"],
                "updated": view["updated"],
                "runs": list(view["runs"].values()),
            }
        )

    async def _one_run(self, request: web.BaseRequest) -> web.Response:
        parts = request.path[len("/api/runs/") :].split("/")
        if len(parts) == 1 and parts[0]:
            check_query(request, set())
            return _json(self._run_or_404(parts[0]))
        if len(parts) == 2 and parts[0] and parts[1] == "history":
            check_query(request, {"since", "limit"})
            self._run_or_404(parts[0])
            return _json({"run_id": parts[0], "samples": self._history(parts[0], request)})
        raise BadRequest(
            f"no such path {request.path[:200]!r}; try /api/runs/RUN_ID or /api/runs/RUN_ID/history",
            status=404,
            reason="not_found",
        )

    async def _nodes(self, request: web.BaseRequest) -> web.Response:
        check_query(request, set())
        return _json({"nodes": list(self.coord.view["nodes"].values())})

    async def _metrics(self, request: web.BaseRequest) -> web.Response:
        check_query(request, set())
        return web.Response(
            body=render(lambda: coordinator_families(self.coord, self)),
            headers={"Content-Type": CONTENT_TYPE},
        )

    async def _page(self, request: web.BaseRequest) -> web.Response:
        check_query(request, {"run"})
        view = self.coord.view
        runs = view["runs"]
        selected = request.query.get("run")
        if selected is not None:
            self._run_or_404(selected)
        else:  # the run training now, else the newest
            live = [r for r in runs.values() if r["state"] == "running" and r["led_here"]]
            selected = (live or list(runs.values()) or [{"run_id": ""}])[0]["run_id"]
        initial = {
            "coordinator": view["coordinator"],
            "runs": list(runs.values()),
            "selected": selected,
            "history": [s.as_dict() for s in self.coord.history.samples(selected)] if selected else [],
        }
        # "<" escaped: a run id cannot close the script element
        data = json.dumps(_clean(initial), allow_nan=False).replace("<", "\\u003c")
        return web.Response(text=PAGE.replace("__INITIAL__", data), content_type="text/html")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Crucible dashboard</title>
<style>
body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 8px} h2{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0} td.l,th.l{text-align:left} a{color:#1a5fb4}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:12px}
.plot{background:#fff;border:1px solid #ddd;padding:6px} .plot h3{font-size:13px;margin:0 0 4px}
.cell{font:12px monospace;text-align:left} .training{background:#e8f5e9} .failed,.lost{background:#ffebee}
.done{background:#e3f2fd} .dropped{background:#eeeeee;color:#666} .legend span{margin-right:10px} .muted{color:#777}
#run-reason{margin:4px 0;font-weight:600}
#figures span{display:inline-block;margin-right:18px}
</style></head><body>
<h1>Crucible <span class="muted" id="coordinator"></span></h1>
<table id="runs"><thead><tr><th class="l">run</th><th class="l">state</th><th>step</th><th>tokens/s</th>
<th>MFU</th><th>tax</th><th>$/Mtok</th><th>loss (bits/token)</th><th>val bits/byte</th></tr></thead><tbody></tbody></table>
<div id="run"><h2 id="run-title"></h2><div id="run-state" class="muted"></div><div id="run-reason"></div>
<div id="figures"><span>tokens/s <b id="tokens-per-s">-</b></span><span>effective MFU <b id="mfu">-</b></span>
<span>tax <b id="tax">-</b></span><span>$/Mtok <b id="usd-per-mtok">-</b></span><span>predicted <b id="predicted">-</b></span></div>
<h2>replicas &times; stages</h2><table id="grid"></table>
<h2>over time</h2><div class="plots">
<div class="plot"><h3>loss</h3><svg id="plot-loss" width="420" height="180"></svg><div class="legend" id="legend-loss"></div></div>
<div class="plot"><h3>tokens/s</h3><svg id="plot-tps" width="420" height="180"></svg><div class="legend" id="legend-tps"></div></div>
<div class="plot"><h3>effective MFU and low-bandwidth tax (%)</h3><svg id="plot-mfu" width="420" height="180"></svg><div class="legend" id="legend-mfu"></div></div>
<div class="plot"><h3>$ per million tokens</h3><svg id="plot-cost" width="420" height="180"></svg><div class="legend" id="legend-cost"></div></div>
<div class="plot"><h3>bytes on each path (MB)</h3><svg id="plot-bytes" width="420" height="180"></svg><div class="legend" id="legend-bytes"></div></div>
</div></div>
<script id="initial" type="application/json">__INITIAL__</script>
<script>
"use strict";
const LN2 = Math.log(2), NS = "http://www.w3.org/2000/svg";
let state = JSON.parse(document.getElementById("initial").textContent);
const fmt = (x, d) => (x === null || x === undefined) ? "-" : Number(x).toFixed(d);
const el = (tag, text, cls) => { const e = document.createElement(tag); if (text !== undefined) e.textContent = text; if (cls) e.className = cls; return e; };
const short = p => p ? p.slice(-8) : "";

// Axis ticks: a few round values (1, 2 or 5 x 10^k; elapsed time in round seconds, minutes, hours)
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
function niceStep(span, n) {
  const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map(m => m * mag).find(x => x >= raw * (1 - 1e-9));
}
function ticksOf(lo, hi, step) {
  const out = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) out.push(i * step);
  return out;
}
function fmtElapsed(t) {
  t = Math.round(t);
  if (t < 60) return `${t}s`;
  if (t < 3600) { const m = Math.floor(t / 60), sec = t % 60; return sec ? `${m}m${String(sec).padStart(2, "0")}s` : `${m}m`; }
  const h = Math.floor(t / 3600), m = Math.round((t % 3600) / 60);
  return m ? `${h}h${String(m).padStart(2, "0")}` : `${h}h`;
}
// 2,940 below 10,000, then 12.5k, 3.2M, 1.1G: the unit and decimals from the axis's largest tick and its step
function valueFormat(ticks, step) {
  const top = Math.max(...ticks.map(Math.abs));
  const [unit, scale] = top >= 1e9 ? ["G", 1e9] : top >= 1e6 ? ["M", 1e6] : top >= 1e4 ? ["k", 1e3] : ["", 1];
  const d = Math.min(6, Math.max(0, -Math.floor(Math.log10(step / scale) + 1e-9)));
  return v => Math.abs(v) < step * 1e-9 ? "0" : (v / scale).toLocaleString("en-US", {minimumFractionDigits: d, maximumFractionDigits: d}) + unit;
}

function plot(id, series, events, t0) {
  const svg = document.getElementById(id), W = 420, H = 180, L = 48, B = 20;
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const pts = series.flatMap(s => s.points);
  svg.dataset.points = String(pts.length);
  const legend = document.getElementById(id.replace("plot", "legend"));
  legend.textContent = "";
  if (pts.length === 0) { const t = document.createElementNS(NS, "text"); t.setAttribute("x", 150); t.setAttribute("y", 90); t.textContent = "no data yet"; svg.appendChild(t); return; }
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const ex = (events || []).map(e => e.t - t0).filter(x => x >= 0);  // marks after the last sample still show
  let x0 = Math.min(0, ...xs), x1 = Math.max(...xs, ...ex), y0 = Math.min(0, ...ys), y1 = Math.max(...ys);
  if (x1 === x0) x1 = x0 + 1; if (y1 === y0) y1 = y0 + (y0 ? Math.abs(y0) : 1);
  const ystep = niceStep(y1 - y0, 4);
  y0 = Math.floor(y0 / ystep + 1e-9) * ystep; y1 = Math.ceil(y1 / ystep - 1e-9) * ystep;  // round bounds
  const xstep = TIME_STEPS.find(x => x >= (x1 - x0) / 5) || 86400 * Math.ceil((x1 - x0) / 5 / 86400);
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - 8), sy = y => H - B - (y - y0) / (y1 - y0) * (H - B - 8);
  const text = (cls, x, y, anchor, label) => {
    const t = document.createElementNS(NS, "text"); t.setAttribute("class", cls); t.setAttribute("x", x); t.setAttribute("y", y);
    t.setAttribute("font-size", "10"); t.setAttribute("text-anchor", anchor); t.setAttribute("fill", "#555"); t.textContent = label; svg.appendChild(t);
  };
  const yticks = ticksOf(y0, y1, ystep), fy = valueFormat(yticks, ystep);
  for (const v of yticks) {
    const grid = document.createElementNS(NS, "path");
    grid.setAttribute("d", `M${L},${sy(v).toFixed(1)} L${W - 8},${sy(v).toFixed(1)}`); grid.setAttribute("stroke", "#eee"); svg.appendChild(grid);
    text("tick-y", L - 4, sy(v) + 3.5, "end", fy(v));
  }
  for (const v of ticksOf(x0, x1, xstep)) text("tick-x", sx(v), H - 6, "middle", fmtElapsed(v));
  const axis = document.createElementNS(NS, "path");
  axis.setAttribute("d", `M${L},4 L${L},${H - B} L${W - 4},${H - B}`); axis.setAttribute("stroke", "#999"); axis.setAttribute("fill", "none");
  svg.appendChild(axis);
  for (const s of series) {
    if (s.points.length === 0) continue;
    const line = document.createElementNS(NS, "polyline");
    line.setAttribute("points", s.points.map(p => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" "));
    line.setAttribute("fill", "none"); line.setAttribute("stroke", s.color); line.setAttribute("stroke-width", "1.8");
    line.setAttribute("class", "series"); line.dataset.series = s.name;
    svg.appendChild(line);
    const k = el("span", `\\u25A0 ${s.name}`); k.style.color = s.color; legend.appendChild(k);
  }
  for (const e of events || []) {  // faults and recoveries on the time axis (the coordinator's view of them)
    const x = e.t - t0;
    if (x < x0) continue;
    const mark = document.createElementNS(NS, "path");
    mark.setAttribute("d", `M${sx(x).toFixed(1)},4 L${sx(x).toFixed(1)},${H - B}`);
    mark.setAttribute("stroke", e.kind === "fault" ? "#c62828" : "#2e7d32"); mark.setAttribute("stroke-width", "1");
    if (e.kind === "fault") mark.setAttribute("stroke-dasharray", "3,2");
    mark.setAttribute("class", `event ${e.kind}`);
    const tip = document.createElementNS(NS, "title"); tip.textContent = `${e.kind}: ${e.what}`; mark.appendChild(tip);
    svg.appendChild(mark);
  }
  if ((events || []).length) {
    for (const [kind, color] of [["fault", "#c62828"], ["recovery", "#2e7d32"]]) {
      const k = el("span", `| ${kind}`); k.style.color = color; legend.appendChild(k);
    }
  }
  legend.appendChild(el("span", "x: elapsed time", "muted"));
}

function series(hist, name, color, f) {
  const t0 = hist.length ? hist[0].t : 0;
  return {name, color, points: hist.filter(h => f(h) !== null && f(h) !== undefined && isFinite(f(h))).map(h => [h.t - t0, f(h)])};
}

function render() {
  document.getElementById("coordinator").textContent = "coordinator " + short(state.coordinator);
  const tbody = document.querySelector("#runs tbody"); tbody.textContent = "";
  for (const r of state.runs) {
    const tr = el("tr"), a = el("a", r.run_id); a.href = "?run=" + encodeURIComponent(r.run_id);
    const td = el("td", undefined, "l"); td.appendChild(a); tr.appendChild(td);
    const x = r.latest || {};
    tr.appendChild(el("td", r.state, "l"));
    for (const v of [`${x.step ?? "-"}/${r.total_steps}`, fmt(x.tokens_per_s, 0), x.effective_mfu === undefined ? "-" : fmt(100 * x.effective_mfu, 2) + "%",
                     x.tax === undefined ? "-" : fmt(100 * x.tax, 1) + "%", fmt(x.usd_per_mtok, 4), x.loss == null ? "-" : fmt(x.loss / LN2, 3), fmt(x.val_bpb, 3)])
      tr.appendChild(el("td", v));
    tbody.appendChild(tr);
  }
  const r = state.runs.find(x => x.run_id === state.selected);
  document.getElementById("run").style.display = r ? "" : "none";
  if (!r) return;
  document.getElementById("run-title").textContent = `run ${r.run_id}: ${r.state}`;
  document.getElementById("run-state").textContent =
    `${r.replicas} replicas x ${r.stages} stages, ${r.sync}, d_model ${r.model.d_model}, ${r.model.n_layers} layers; term ${r.term}` +
    (r.epoch !== null ? `, epoch ${r.epoch}` : "") + (r.led_here ? "" : ` (led by coordinator ${short(r.coordinator)})`);
  document.getElementById("run-reason").textContent = r.reason ? `${r.state}: ${r.reason}` : "";
  const x = r.latest || {};
  document.getElementById("tokens-per-s").textContent = fmt(x.tokens_per_s, 0);
  document.getElementById("mfu").textContent = x.effective_mfu === undefined ? "-" : fmt(100 * x.effective_mfu, 2) + "%";
  document.getElementById("tax").textContent = x.tax === undefined ? "-" : fmt(100 * x.tax, 1) + "%";
  document.getElementById("usd-per-mtok").textContent = fmt(x.usd_per_mtok, 4);
  document.getElementById("predicted").textContent = r.prediction ? `${fmt(r.prediction.tokens_per_s, 0)} tokens/s, MFU ${fmt(100 * r.prediction.effective_mfu, 2)}%` : "-";
  const grid = document.getElementById("grid"); grid.textContent = "";
  const head = el("tr"); head.appendChild(el("th", "replica", "l"));
  for (let s = 0; s < r.stages; s++) head.appendChild(el("th", `stage ${s}`, "l"));
  grid.appendChild(head);
  r.grid.forEach((row, i) => {
    const mixed = r.batches && new Set(r.batches).size > 1;  // replicas of different batch sizes
    const split = r.splits && new Set(r.splits.map(x => x.join("+"))).size > 1;  // or layer splits
    const shape = [split ? `layers ${r.splits[i].join("+")}` : "", mixed ? `batch ${r.batches[i]}` : ""].filter(x => x);
    const tr = el("tr"); tr.appendChild(el("td", shape.length ? `${i} (${shape.join(", ")})` : String(i), "l"));
    for (const c of row) {
      if (!c) { tr.appendChild(el("td", "-", "cell")); continue; }
      const what = c.state === "dropped out" ? `dropped out at step ${c.step}` : `${c.state} step ${c.step} ${fmt(c.tokens_per_s, 0)} tok/s`
        + (c.expert_load && Object.keys(c.expert_load).length  // MoE: max/mean tokens per expert, by layer
          ? `\nexpert load ${Object.entries(c.expert_load).map(([l, v]) => `L${l} ${fmt(v, 2)}`).join(" ")}` : "")
        + (c.relayed && c.relayed.length ? `\nrelayed link to ${c.relayed.map(short).join(", ")}` : "")
        + (c.reachable === false ? `\nunreachable (NAT)` : "");
      const td = el("td", `${short(c.peer_id)} ${c.device}\\n${what}` + (c.error ? `\\n${c.error}` : ""), "cell " + c.state.split(" ")[0]);
      td.style.whiteSpace = "pre"; tr.appendChild(td);
    }
    grid.appendChild(tr);
  });
  const h = state.history || [], ev = r ? r.events : [], t0 = h.length ? h[0].t : 0;
  plot("plot-loss", [series(h, "train bits/token", "#c62828", p => p.loss === null ? null : p.loss / LN2), series(h, "validation bits/byte", "#1565c0", p => p.val_bpb)], ev, t0);
  plot("plot-tps", [series(h, "measured", "#2e7d32", p => p.tokens_per_s)], ev, t0);
  plot("plot-mfu", [series(h, "effective MFU", "#6a1b9a", p => 100 * p.effective_mfu), series(h, "tax", "#ef6c00", p => 100 * p.tax)], ev, t0);
  plot("plot-cost", [series(h, "$/Mtok", "#37474f", p => p.usd_per_mtok)], ev, t0);
  plot("plot-bytes", [series(h, "pipeline", "#00838f", p => p.bytes_pipe / 1e6), series(h, "store", "#8d6e63", p => p.bytes_store / 1e6)], ev, t0);
}

async function poll() {
  try {
    const runs = await (await fetch("/api/runs")).json();
    state.runs = runs.runs; state.coordinator = runs.coordinator;
    if (state.selected) {
      const r = await fetch(`/api/runs/${encodeURIComponent(state.selected)}/history`);
      if (r.ok) state.history = (await r.json()).samples;
    }
    render();
  } catch (e) { document.getElementById("run-state").textContent = "dashboard: " + e; }
}
render();
setInterval(poll, 2000);
</script></body></html>
"""

__all__ = ["Dashboard"]

"""One command, a whole swarm on localhost: embedded S3 store, bootstrap peer, coordinator and R x S nodes,
each its own OS process, training a small Llama-style model on a real corpus, with live progress and a
final report.

  crucible-swarm                         # 2 replicas x 2 stages on the Python standard library's source
  crucible-swarm --data ~/corpus --steps 600 --sync sparseloco
  crucible-swarm --data ~/corpus --tokenizer tokenizer.json --data-in-store   # BPE; shards in the store
  crucible-swarm --steps 60 --H 30 --bandwidth-mbps 20 --delay-ms 5   # WAN-shaped pipeline links

Every flag, and the run spec they make, is checked before anything starts (a mistake: one line, exit 2).
The store, bootstrap peer and coordinator start first; the planner's calibration for this machine
(scripts/calibrate_local.py) runs then, before the nodes start, since each node times its matmul and
reference block as it starts and the probes would slow those figures. Once the run is placed the
coordinator predicts it from the nodes' adverts (coordinator/placement.py `predict_placement`); its
dashboard shows that figure and crucible-swarm prints the same one, read from the dashboard's API, with
the calibration's beside it. Progress lines and the report show both next to what is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from node.data.corpus_files import CorpusScan, DataError, manifest_of, scan_corpus
from protocol.corpus import corpus_sha256, is_store_url
from protocol.process.cli_errors import UsageError, bad_input, check_file, run_cli
from scripts.procs import Child, ProcessFailed

if TYPE_CHECKING:
    from protocol.runspec import RunSpec

NODE_PRICE_PER_HOUR = 0.10
"""$/h every swarm node advertises; the prediction prices tokens with it."""

# Fault timers of a swarm on one host. Its DHT answers in milliseconds, so nodes refresh their adverts
# every 3 s (TTL 9 s) and the coordinator counts a node gone after 2 x 6 s of silence (the defaults,
# 30 s / 10 s, leave room for the internet) and takes over a lapsed lease after 8 s (default 15 s).
LOCAL_ADVERT_TTL_S = 9.0
LOCAL_CHURN_GRACE_S = 6.0
LOCAL_LEASE_S = 8.0
LOCAL_PREEMPT_NOTICE_S = 5.0
"""A node given notice (SIGTERM) trains on to its next checkpoint for at most this long (default 10 s):
the local swarm's rounds are seconds long, and its stop waits 20 s for every node."""

DEFAULT_RUN = """\
[run]
run_id = "{run_id}"
replicas = {replicas}
stages = {stages}
eval_every = {eval_every}

[model]
d_model = 256
n_layers = 4
n_heads = 4
d_ff = 688
seq_len = 256

[train]
total_steps = {steps}
batch_size = 8
microbatches = 4
lr = 3e-3
warmup_steps = 20
eval_batches = 4

[sync]
method = "{sync}"
H = {H}
beta = {beta}
alpha = 1.0
timeout_s = 120.0

[pipeline]
wire_dtype = "float32"
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="crucible-swarm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from protocol.process.logs import version

    ap.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    ap.add_argument("--replicas", type=int, default=2, help="R: pipeline replicas (default 2)")
    ap.add_argument("--stages", type=int, default=2, help="S: stages per replica (default 2)")
    ap.add_argument("--steps", type=int, default=240, help="inner steps per replica (default 240)")
    ap.add_argument("--H", type=int, default=10, help="inner steps per outer round (default 10)")
    ap.add_argument(
        "--beta",
        type=float,
        default=0.7,
        help="SparseLoCo error-feedback decay (default 0.7: with tens of rounds a short memory trains "
        "better than the paper's 0.95; docs/benchmarks.md)",
    )
    ap.add_argument(
        "--eval-every-steps",
        type=int,
        default=30,
        help="validate about every this many inner steps, at a round boundary (default 30)",
    )
    ap.add_argument(
        "--sync",
        default="sparseloco",
        choices=["diloco", "sparseloco"],
        help="cross-replica method: sparseloco (default) or the dense diloco baseline",
    )
    ap.add_argument(
        "--data", default="stdlib", help="corpus: 'stdlib' (default), a text file, a directory or a glob"
    )
    ap.add_argument(
        "--tokenizer",
        type=Path,
        help="a `tokenizers` tokenizer.json to train on its tokens instead of bytes (model.vocab is set "
        "from it; validation still reports bits per byte)",
    )
    ap.add_argument(
        "--data-in-store",
        action="store_true",
        help="copy the corpus into the embedded store as shards with a manifest "
        "(s3://crucible/corpus/<hash>) and have the nodes stream it from there, as a swarm on R2 does",
    )
    ap.add_argument("--run-toml", type=Path, help="use this run spec instead of the generated one")
    ap.add_argument("--run-id", default="", help="run id (default: swarm-<time>)")
    ap.add_argument(
        "--out", type=Path, help="directory for logs, keys and the report (default runs/<run id>)"
    )
    ap.add_argument("--timeout-s", type=float, default=900, help="give up after this long (default 900)")
    link = ap.add_argument_group("pipeline links (set [pipeline] in the generated run.toml)")
    link.add_argument(
        "--bandwidth-mbps",
        type=float,
        help="in-process shaper: Mbit/s per direction of every pipeline link (example: --bandwidth-mbps 20)",
    )
    link.add_argument(
        "--delay-ms", type=float, help="in-process shaper: one-way delay per link (example: --delay-ms 5)"
    )
    link.add_argument(
        "--link-k",
        type=_int_list,
        help="subspace width of each of the S-1 links, comma-separated; 256 (= d_model) is dense "
        "(default: 32 on every link, k/d = 1/8; example: --link-k 256 for dense)",
    )
    ap.add_argument(
        "--device",
        default="auto",
        metavar="auto|cuda|cuda:N|cpu",
        help="where the nodes train (default auto: a CUDA GPU where there is one, the nodes spread over "
        "the host's GPUs, else the CPU)",
    )
    ap.add_argument(
        "--spares",
        type=int,
        default=0,
        help="start this many spare nodes: the coordinator rebuilds a replica that lost a node with one "
        "(default 0; a node that dies is replaced by a new process either way)",
    )
    ap.add_argument("--debug", action="store_true", help="show tracebacks of unexpected errors")
    ap.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip the local calibration (its prediction of this machine's CPU sharing) before the nodes "
        "start (saves ~20 s); the coordinator's prediction from the adverts is printed either way",
    )
    return ap.parse_args(argv)


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (example: 32,64)"
        ) from None


def toml_value(v: object) -> str:
    """`v` as a TOML value: JSON's form, with non-ASCII text kept as it is (TOML has no surrogate-pair
    escapes) and DEL escaped (TOML refuses it raw); a path with a space or a double quote stays exact."""
    return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")


def set_pipeline(run_toml: str, **values: object) -> str:
    """`run_toml` with these [pipeline] keys set (see set_keys)."""
    return set_keys(run_toml, "pipeline", **values)


def set_keys(run_toml: str, section: str, **values: object) -> str:
    """`run_toml` with these keys of [section] set (replaced if present, the section added if missing);
    None values are left alone."""
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return run_toml
    lines = run_toml.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.strip() == f"[{section}]"), None)
    if head is None:
        lines += ["", f"[{section}]"]
        head = len(lines) - 1
    end = next((i for i in range(head + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines))
    body = [ln for ln in lines[head + 1 : end] if ln.split("=")[0].strip() not in values]
    new = [f"{k} = {toml_value(v)}" for k, v in values.items()]
    out = "\n".join(lines[: head + 1] + new + body + lines[end:]) + "\n"
    tomllib.loads(out)  # a bad value must fail here, not in every node
    return out


def _get_status(url: str, timeout_s: float = 5.0) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


class Swarm:
    """Starts and stops the processes of a local swarm; usable from tests too."""

    def __init__(
        self,
        out: Path,
        n_nodes: int,
        *,
        node_env: dict[str, str] | None = None,
        device: str = "auto",
        node_args: dict[int, list[str]] | None = None,
        coordinator: bool = True,
        relay_args: list[str] | None = None,
    ) -> None:
        """node_args: extra `crucible-node join` flags for node i (e.g. an emulated slow link);
        coordinator: start a standalone coordinator (False: coordinator-eligible nodes lead); relay_args:
        the bootstrap peer also relays, with these flags (e.g. ["--relay-port", "0"]), and every node
        is given its address (--relay)."""
        self.node_args = node_args or {}
        self.relay_args, self.relay = relay_args, ""
        self.with_coordinator = coordinator
        self.dashboard = ""
        """URL of the coordinator's dashboard (its ready line names it)."""
        self.one_shots: list[Child] = []
        """Commands that end by themselves (launch): waited for, not signalled, by `stop`."""
        self.device = device
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.n_nodes = n_nodes
        self.node_env = node_env or {}
        self.nodes: list[Child] = []
        self.health: list[str] = []
        self.generation = 0
        """How many times restart() brought the swarm back (log names get a -N suffix)."""
        self.restarts = 0
        """Coordinators started after the first died."""

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        c = Child(name, args, self.out, env)
        self.children.append(c)
        return c

    def start(self, ready_timeout_s: float = 120, before_nodes: Callable[[], None] | None = None) -> None:
        """Start the store, the bootstrap peer, the coordinator, then the nodes; `before_nodes` runs once
        the others are ready and before any node starts (crucible-swarm calibrates there: a node times
        its matmul and reference block as it starts, and must not share the cores with the probes)."""
        store = self._spawn("store", ["-m", "scripts.embedded_store", "--front"])
        self.store_url = store.wait_for(r"STORE (\S+)", ready_timeout_s).group(1)
        self._start_swarm(ready_timeout_s, before_nodes)

    def restart(self, ready_timeout_s: float = 120) -> dict[str, int | None]:
        """A whole-swarm restart: stop every process but the store, then start the bootstrap peer, the
        coordinator and the nodes again with the same key files (the store keeps the runs' state).
        Returns the exit codes of the graceful stops."""
        store = self.children[0]
        for c in self.nodes:
            c.terminate()
        codes = {c.name: c.stop() for c in reversed(self.children[1:])}
        self.children, self.nodes, self.health = [store], [], []
        self.generation += 1
        self._start_swarm(ready_timeout_s)
        return codes

    def _name(self, base: str) -> str:
        return base if self.generation == 0 else f"{base}-{self.generation}"

    def _start_swarm(self, ready_timeout_s: float, before_nodes: Callable[[], None] | None = None) -> None:
        from protocol.identity import Identity

        boot = self._spawn(
            self._name("bootstrap"),
            [
                "-m",
                "node.cli",
                "bootstrap",
                "--key-file",
                str(self.out / "bootstrap.key"),
                *(self.relay_args or []),
            ],
        )
        self.bootstrap = boot.wait_for(r"BOOTSTRAP (\S+)", ready_timeout_s).group(1)
        if self.relay_args is not None:
            self.relay = boot.wait_for(r"RELAY (\S+)", ready_timeout_s).group(1)
        self.operator_key_file = self.out / "operator.key"
        self.operator = Identity.load_or_create(self.operator_key_file)
        if self.with_coordinator:
            self.coordinator = self._spawn(
                self._name("coordinator"),
                [
                    "-m",
                    "coordinator.cli",
                    "serve",
                    *self.swarm_flags(),
                    *self.operator_flags(),
                    *self.coordinator_flags(),
                ],
            )
        if before_nodes is not None:
            if self.with_coordinator:
                self.dashboard = self.coordinator.wait_for(r"dashboard=(\S+)", ready_timeout_s).group(1)
            before_nodes()
        for i in range(self.n_nodes):
            self.add_node(i)
        if self.with_coordinator and before_nodes is None:  # the nodes start meanwhile
            self.dashboard = self.coordinator.wait_for(r"dashboard=(\S+)", ready_timeout_s).group(1)
        for node in self.nodes:
            self.health.append(node.wait_for(r"health=(\S+)/health", ready_timeout_s).group(1))
        self.write_pids()

    def add_node(self, i: int, *, store_url: str | None = None, name: str | None = None) -> Child:
        """Start node i (its key file node{i}.key); `store_url` gives it its own way to the store (tests put
        a fault proxy there); `name`: its log's name, for a node i started again (default node{i})."""
        flags = self.swarm_flags()
        if store_url is not None:
            flags[flags.index("--store-endpoint") + 1] = store_url
        node = self._spawn(
            self._name(name or f"node{i}"),
            [
                "-m",
                "node.cli",
                "join",
                *flags,
                "--operator-key",
                self.operator.peer_id,
                "--key-file",
                str(self.out / f"node{i}.key"),
                "--torch-threads",
                "1",
                "--device",
                self.device,
                "--price-per-hour",
                f"{NODE_PRICE_PER_HOUR:.2f}",
                "--advert-ttl-s",
                f"{LOCAL_ADVERT_TTL_S:g}",
                "--preempt-notice-s",
                f"{LOCAL_PREEMPT_NOTICE_S:g}",
                *(["--relay", self.relay] if self.relay else []),
                *self.node_args.get(i, []),
            ],
            self.node_env,
        )
        self.nodes.append(node)
        return node

    def respawn_node(self, ready_timeout_s: float = 90) -> Child:
        """Start one more node with a new identity (a node process died: the coordinator rebuilds its
        replica with this one, resuming from the latest consensus checkpoint)."""
        node = self.add_node(len(self.nodes))
        self.health.append(node.wait_for(r"health=(\S+)/health", ready_timeout_s).group(1))
        self.write_pids()
        return node

    def respawn_coordinator(self, ready_timeout_s: float = 90) -> Child:
        """Start another coordinator with the operator key: it takes over the runs' leases when they
        lapse and rebuilds their placement from the store (the nodes keep training meanwhile)."""
        self.restarts += 1
        self.coordinator = self._spawn(
            self._name(f"coordinator-{self.restarts}"),
            [
                "-m",
                "coordinator.cli",
                "serve",
                *self.swarm_flags(),
                *self.operator_flags(),
                *self.coordinator_flags(),
            ],
        )
        self.dashboard = self.coordinator.wait_for(r"dashboard=(\S+)", ready_timeout_s).group(1)
        self.write_pids()
        return self.coordinator

    def write_pids(self) -> None:
        """processes.json: name -> pid of every live child (to kill one by hand, or from a test)."""
        pids = {c.name: c.proc.pid for c in self.children if c.alive}
        (self.out / "processes.json").write_text(json.dumps(pids, indent=1))

    def swarm_flags(self) -> list[str]:
        return ["--bootstrap", self.bootstrap, "--store-endpoint", self.store_url]

    def operator_flags(self) -> list[str]:
        return ["--operator-key-file", str(self.operator_key_file)]

    @staticmethod
    def coordinator_flags() -> list[str]:
        return ["--lease-s", f"{LOCAL_LEASE_S:g}", "--churn-grace-s", f"{LOCAL_CHURN_GRACE_S:g}"]

    def launch(self, *run_tomls: Path) -> None:
        """`crucible-coordinator launch` each run spec, all at once (a launch joins the DHT: seconds each, so
        runs launched one after another would not be concurrent)."""
        launches = [
            self._spawn(
                self._name("launch"),
                ["-m", "coordinator.cli", "launch", str(t), *self.swarm_flags(), *self.operator_flags()],
            )
            for t in run_tomls
        ]
        for c in launches:
            c.wait_for(r"launched run", 120)
            self.one_shots.append(c)  # it exits by itself once its DHT client shut down: `stop` lets it

    def export(self, run_id: str, out_dir: Path, timeout_s: float = 300.0) -> str:
        """`crucible-coordinator export` of the run's newest checkpointed round into out_dir (the command a
        user runs against R2), while the embedded store still serves; returns its line, raises
        ProcessFailed with its output when it fails."""
        child = self._spawn(
            self._name("export"),
            ["-m", "coordinator.cli", "export", run_id, "--out", str(out_dir),
             "--operator-key", self.operator.peer_id, "--store-endpoint", self.store_url],
        )  # fmt: skip
        try:
            code = child.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            child.stop(timeout_s=5)
            raise ProcessFailed(f"export of run {run_id} did not finish within {timeout_s:.0f} s") from None
        if code != 0:
            raise ProcessFailed(f"export of run {run_id} exited with {code}:\n{child.tail()}")
        return child.log_text().strip().splitlines()[-1]

    def statuses(self) -> list[dict | None]:
        return [_get_status(f"{h}/status") for h in self.health]

    def stop(self) -> dict[str, int | None]:
        for c in self.one_shots:  # a launch still shutting its DHT client down exits 0 by itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(30)
        codes = {}
        for c in self.nodes:  # the nodes all at once (each takes a moment to leave the DHT), then the rest
            c.terminate()
        for c in reversed(self.children):
            codes[c.name] = c.stop()
        return codes


class Progress:
    """What the progress lines and the report count for one run across faults.

    - step: each replica is as far as its slowest stage, the run as far as its furthest replica, and a
      line never shows less than the one before (a rebuilt replica resumes from its checkpoint, behind);
    - bytes on each path: summed over every node the run had (`CumulativeCounters`: a node that died
      keeps what it moved, a restarted one counts from 0), so they never dip at a rebuild;
    - the run's first validation: the step-0 figures (a rebuilt replica's history starts at its
      checkpoint's step).
    """

    def __init__(self, run_id: str) -> None:
        from coordinator.run_figures import CumulativeCounters

        self.run_id = run_id
        self.bytes = CumulativeCounters()
        self.step = 0
        self.total_steps = 0
        self.start_val: dict[int, float] = {}
        """Replica -> its last stage's validation at step 0."""
        self.metrics: list[dict] = []
        """The run's nodes' metrics at the last observation."""

    def observe(self, statuses: list[dict | None]) -> None:
        mine = [st for st in statuses if st and (st["metrics"] or {}).get("run_id") == self.run_id]
        self.metrics = [st["metrics"] for st in mine]
        by_replica: dict[int, list[int]] = {}
        for st in mine:
            m = st["metrics"]
            self.bytes.observe(
                st.get("peer_id") or f"r{m['replica']}s{m['stage']}",
                {k: m[k] for k in ("bytes_pipe_sent", "bytes_store_up", "bytes_store_down")},
            )
            self.total_steps = max(self.total_steps, m["total_steps"])
            if m["state"] in ("training", "done"):
                by_replica.setdefault(m["replica"], []).append(m["step"])
            hist = m.get("val_history") or []
            if hist and hist[0][0] == 0:
                self.start_val.setdefault(m["replica"], hist[0][1])
        if by_replica:
            self.step = max(self.step, max(min(v) for v in by_replica.values()))

    def line(self, elapsed: float, predicted: float | None = None) -> str:
        """One progress line: training in bits per token (a byte without a tokenizer), validation in bits
        per byte (the text's bytes whatever the tokenizer), as on `status` and the dashboard."""
        ms = self.metrics
        if not ms:
            return f"[{elapsed:5.0f}s] waiting for nodes"
        losses = [x for m in ms if (x := m.get("train_loss_bits_per_token")) is not None]
        vals = [x for m in ms if (x := m.get("validation_loss_bits_per_byte")) is not None]
        tok = sum(m["tokens_per_s"] for m in ms if m["stage"] == 0)
        step = (
            f"{self.step}/{self.total_steps}"
            if self.step or any(m["state"] == "training" for m in ms)
            else "-"
        )
        loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
        val = f"{sum(vals) / len(vals):.3f}" if vals else "-"
        pred = f" (predicted {predicted:5.0f})" if predicted else ""
        b = self.bytes
        return (
            f"[{elapsed:5.0f}s] step {step:>9}  train {loss:>6} bits/token  val {val:>6} bits/byte  "
            f"{tok:7.0f} tok/s{pred}  pipeline {_fmt_bytes(b.total('bytes_pipe_sent')):>9}  store up "
            f"{_fmt_bytes(b.total('bytes_store_up')):>8} down {_fmt_bytes(b.total('bytes_store_down')):>8}"
        )


def publish(prep: Prepared, store_url: str) -> None:
    """--data-in-store: the corpus's shards and manifest, and the tokenizer.json, into the store."""
    if prep.upload is None:
        return
    from node.data.corpus_store import publish_corpus, publish_tokenizer
    from protocol.net.store import ObjectStore, StoreConfig

    store = ObjectStore(StoreConfig(endpoint_url=store_url))
    publish_corpus(store, prep.upload, prep.data_url)
    print(f"  corpus     {prep.data_url} ({prep.upload.summary()})", flush=True)
    if prep.tokenizer_url:
        publish_tokenizer(store, prep.tokenizer_bytes, prep.tokenizer_url)
        print(f"  tokenizer  {prep.tokenizer_url} ({len(prep.tokenizer_bytes) / 1e6:.1f} MB)", flush=True)


def coordinator_prediction(dashboard: str, run_id: str) -> dict | None:
    """The planner's prediction the coordinator made for the run's placement from the nodes' adverts
    (`coordinator.placement.predict_placement`), as its dashboard shows it (GET /api/runs/RUN); None until
    the run is placed."""
    if not dashboard:
        return None
    got = _get_status(f"{dashboard.rstrip('/')}/api/runs/{run_id}")
    pred = got.get("prediction") if isinstance(got, dict) else None
    return pred if isinstance(pred, dict) and pred.get("tokens_per_s") else None


def prediction_line(prediction: dict, calibrated: dict | None = None) -> str:
    """The prediction as crucible-swarm prints it: the coordinator's figures (the dashboard's), and the
    local calibration's tokens/s beside them."""
    p = prediction
    usd = f", ${p['usd_per_mtok']:,.3f}/Mtok" if p.get("usd_per_mtok") is not None else ""
    cal = (
        f"; calibrated for this machine's CPU sharing {calibrated['tokens_per_s']:,.0f} tokens/s"
        if calibrated
        else ""
    )
    return (
        f"  predicted: {p['tokens_per_s']:,.0f} tokens/s, MFU {100 * p['effective_mfu']:.1f}%, tax "
        f"{100 * p['tax']:.1f}%{usd} (the planner on the nodes' adverts, as on the dashboard){cal}"
    )


class StepClock:
    """When each node was first seen at (or past) each inner step: the measured side of the report.

    Steady-state throughput counts only inner steps that hold nothing but training. At a round boundary
    b (every H steps) a stage applies the outer sync before it reports step b, then saves the checkpoint
    and evaluates before step b + 1 starts; the first step also carries start-up. So per round the clean
    stretch is from step b + 1 to step b' - 1 (H - 2 steps), timed by the polls that first saw each
    count (the poll lag, under the poll interval, is the same at both ends and cancels on average).
    Per replica the stretches of its S stage nodes are averaged; replicas add up.
    """

    def __init__(self) -> None:
        self.first_seen: dict[tuple[int, int], dict[int, float]] = {}

    def observe(self, statuses: list[dict | None], now: float, run_id: str) -> None:
        for st in statuses:
            m = st["metrics"] if st else None
            if not m or m.get("run_id") != run_id or m["state"] not in ("training", "done"):
                continue
            seen = self.first_seen.setdefault((m["replica"], m["stage"]), {})
            for n in range(max(seen, default=0) + 1, m["step"] + 1):
                seen[n] = now

    def as_dict(self, t0: float) -> dict[str, dict[int, float]]:
        """{"r0s1": {step: seconds after t0}} for steps.json."""
        return {
            f"r{r}s{s}": {n: round(t - t0, 3) for n, t in seen.items()}
            for (r, s), seen in sorted(self.first_seen.items())
        }

    def steady_steps_per_s(self, H: int, total: int) -> dict[int, float]:
        """Replica -> inner steps/s over the clean stretches (class docstring)."""
        per_node: dict[tuple[int, int], float] = {}
        for node, seen in self.first_seen.items():
            steps = seconds = 0.0
            for b in range(0, total, H):
                lo, hi = b + 1, min(b + H, total) - 1
                if hi > lo and lo in seen and hi in seen:
                    steps, seconds = steps + hi - lo, seconds + seen[hi] - seen[lo]
            if seconds > 0:
                per_node[node] = steps / seconds
        replicas = {r for r, _ in per_node}
        return {
            r: sum(v for (rr, _), v in per_node.items() if rr == r) / sum(1 for rr, _ in per_node if rr == r)
            for r in replicas
        }

    def overall_steps_per_s(self, total: int) -> dict[int, float]:
        """Replica -> steps/s from step 1 to the last step: outer syncs, checkpoints and the evaluations
        between rounds included (start-up and the final evaluation are not)."""
        out: dict[int, list[float]] = {}
        for (r, _), seen in self.first_seen.items():
            if 1 in seen and total in seen and seen[total] > seen[1]:
                out.setdefault(r, []).append((total - 1) / (seen[total] - seen[1]))
        return {r: sum(v) / len(v) for r, v in out.items()}


class CpuMeter:
    """Cores used between the first and the last snapshot: the whole machine, and the swarm's processes
    by role (node processes themselves: training, links, health; their children: DHT and p2pd; the
    store, bootstrap and coordinator with their children; this monitor).

    The prediction assumes the CPU left to the node processes stays as the calibration found it; other
    work starting or stopping on the machine during the run shows here as `cpu_other_cores`.
    """

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots
        """Child name -> pid; names starting with "node" are node processes."""
        self.first: tuple[float, float, dict[int, tuple[str, float]]] | None = None
        self.last: tuple[float, float, dict[int, tuple[str, float]]] | None = None

    def _snapshot(self) -> tuple[float, float, dict[int, tuple[str, float]]]:
        """(time, machine busy CPU s, pid -> (role, CPU s))."""
        import psutil

        t = psutil.cpu_times()
        machine = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        procs: list[tuple[str, psutil.Process]] = [("monitor", psutil.Process())]
        for name, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                kids = root.children(recursive=True)
            except psutil.Error:
                continue
            node = name.startswith("node")
            procs.append(("node" if node else "daemon", root))
            procs += [("node_children" if node else "daemon", k) for k in kids]
        cpu = {}
        for role, pr in procs:
            try:
                c = pr.cpu_times()  # the monitor's waited-for children (calibration probes) are not counted
            except psutil.Error:
                continue
            cpu[pr.pid] = (role, c.user + c.system)
        return time.monotonic(), machine, cpu

    def sample(self) -> None:
        snap = self._snapshot()
        if self.first is None:
            self.first = snap
        self.last = snap

    def report(self) -> dict:
        if self.first is None or self.last is None or self.last[0] - self.first[0] < 1.0:
            return {}
        dt = self.last[0] - self.first[0]
        roles = dict.fromkeys(("node", "node_children", "daemon", "monitor"), 0.0)
        for pid, (role, sec) in self.last[2].items():
            roles[role] += (sec - self.first[2].get(pid, (role, 0.0))[1]) / dt
        machine = (self.last[1] - self.first[1]) / dt
        swarm = sum(roles.values())
        out = {
            "cpu_busy_cores": round(machine, 2),
            "cpu_swarm_cores": round(swarm, 2),
            "cpu_other_cores": round(max(0.0, machine - swarm), 2),
        }
        out.update({f"cpu_{role}_cores": round(v, 3) for role, v in roles.items()})
        return out


def calibrate_and_predict(run_toml: Path, store_url: str) -> tuple[dict, str] | None:
    """The planner's calibration on this machine and its prediction for the run (None if it failed)."""
    from dataclasses import asdict

    from protocol.runspec import load_run_spec
    from scripts.calibrate_local import CalibrationError, calibrate, describe, local_swarm_model

    try:
        spec = load_run_spec(run_toml)
        cal = calibrate(spec, store_endpoint=store_url, usd_per_node_hour=NODE_PRICE_PER_HOUR)
    except (ValueError, OSError, CalibrationError) as e:
        print(f"crucible-swarm: calibration failed, no prediction: {e}", file=sys.stderr, flush=True)
        return None
    model = local_swarm_model(spec, cal)
    p = model.prediction
    pred = {
        "tokens_per_s": round(p.tokens_per_s, 1),
        "effective_mfu": round(p.effective_mfu, 4),
        "tax": round(p.tax, 4),
        "usd_per_hour": round(p.usd_per_hour, 4),
        "usd_per_mtok": round(p.usd_per_mtok, 4),
        "flops_per_token": p.flops_per_token,
        "peak_tflops": p.peak_tflops,
        "ceiling": round(model.ceiling, 4),
        "phi": round(model.phi, 4),
        "busy_processes": round(model.busy, 3),
        "other_threads": round(model.other_threads, 3),
        "step_s": [round(t, 4) for t in p.step_s],
        "breakdown": {k: round(v, 4) for k, v in asdict(p.breakdown).items()},
        "calibration": asdict(cal),
    }
    return pred, describe(cal, model)


def throughput_report(
    clock: StepClock,
    run_toml: Path,
    prediction: dict | None,
    calibrated: dict | None,
    usd_per_hour: float,
) -> dict:
    """Measured steady-state tokens/s next to the prediction (the coordinator's, from the nodes' adverts:
    the dashboard's figure) and the local calibration's; the measured MFU, tax and $/Mtok by the
    planner's definitions over the same peaks as the prediction (`planner.figures_at`), else the
    calibration's (the machine's C cores)."""
    from coordinator.plan.planner import Figures, figures_at

    spec = tomllib.loads(run_toml.read_text())
    train, sync = spec.get("train", {}), spec.get("sync", {})
    total, H = int(train.get("total_steps", 300)), int(sync.get("H", 30))
    tokens_per_step = int(train.get("batch_size", 8)) * int(spec.get("model", {}).get("seq_len", 256))
    steady = clock.steady_steps_per_s(H, total)
    overall = clock.overall_steps_per_s(total)
    measured = sum(steady.values()) * tokens_per_step if steady else None

    def error(pred: dict | None) -> float | None:
        return round(pred["tokens_per_s"] / measured - 1, 4) if pred and measured else None

    out: dict = {
        "measured_tokens_per_s": round(measured, 1) if measured else None,
        "measured_tokens_per_s_with_rounds": round(sum(overall.values()) * tokens_per_step, 1)
        if overall
        else None,
        "measured_replicas": len(steady),
        "predicted_tokens_per_s": prediction["tokens_per_s"] if prediction else None,
        "prediction_error": error(prediction),
        "prediction": prediction,
        "calibrated_tokens_per_s": calibrated["tokens_per_s"] if calibrated else None,
        "calibration_error": error(calibrated),
        "calibration": calibrated,
    }
    if not measured:
        return out
    if prediction and prediction.get("effective_mfu"):
        at = Figures(
            effective_mfu=prediction["effective_mfu"],
            tax=prediction["tax"],
            usd_per_mtok=prediction.get("usd_per_mtok"),
        )
        fig = figures_at(at, prediction["tokens_per_s"], measured)
        out["measured_effective_mfu"] = round(fig.effective_mfu, 4)
        out["measured_tax"] = round(fig.tax, 4)
    elif calibrated:
        mfu = measured * calibrated["flops_per_token"] / (calibrated["peak_tflops"] * 1e12)
        out["measured_effective_mfu"] = round(mfu, 4)
        out["measured_tax"] = round(1 - mfu / calibrated["ceiling"], 4)
    if "measured_effective_mfu" in out:
        out["measured_usd_per_mtok"] = round(usd_per_hour / (measured * 3600) * 1e6, 4)
    return out


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt("terminated")


SETTLE_AFTER_FAULT_S = 2 * LOCAL_CHURN_GRACE_S + 15.0
"""After a fault, the run counts as finished only when nothing trains for this long: the coordinator
needs its churn grace (2 x LOCAL_CHURN_GRACE_S) and a placement to rebuild a broken replica."""


@dataclass
class Prepared:
    """What preflight found: the run, its spec's text (the corpus's hashes filled in) and, with
    --data-in-store, the local corpus to copy into the store once it runs."""

    run_id: str
    replicas: int
    stages: int
    run_toml: str
    upload: CorpusScan | None = None
    data_url: str = ""
    tokenized: bool = False
    tokenizer_url: str = ""
    """With --data-in-store and a tokenizer: where the tokenizer.json goes in the store."""
    tokenizer_bytes: bytes = b""
    stage_counts: tuple[int, ...] = ()
    """Each replica's stages where a [[shapes]] table gives some their own (empty: `stages` for all)."""


STORE_CORPUS = "s3://crucible/corpus/{sha256}"
"""Where --data-in-store puts the corpus in the embedded store."""
STORE_TOKENIZER = "s3://crucible/tokenizers/{sha256}.json"
"""Where --data-in-store puts the run's tokenizer.json (by its hash: no name a corpus file could take)."""

SPEC_FLAGS: dict[str, tuple[str, str, str]] = {
    "pipeline.link_k": ("--link-k", "link_k", "--link-k 32"),
    "pipeline.bandwidth_mbps": ("--bandwidth-mbps", "bandwidth_mbps", "--bandwidth-mbps 20"),
    "pipeline.delay_ms": ("--delay-ms", "delay_ms", "--delay-ms 5"),
    "train.total_steps": ("--steps", "steps", "--steps 240"),
    "sync.H": ("--H", "H", "--H 10"),
    "sync.beta": ("--beta", "beta", "--beta 0.7"),
    "eval_every": ("--eval-every-steps", "eval_every_steps", "--eval-every-steps 30"),
    "replicas": ("--replicas", "replicas", "--replicas 2"),
    "stages": ("--stages", "stages", "--stages 2"),
    "run_id": ("--run-id", "run_id", "--run-id my-run-1"),
    "model.vocab": ("--tokenizer", "tokenizer", "--tokenizer tokenizer.json"),
}
"""Run spec key -> (the flag that sets it in the generated spec, its argparse name, an example)."""


def check_spec(text: str, args: argparse.Namespace) -> RunSpec:
    """The RunSpec of `text`, or UsageError naming what is wrong: for a generated spec the flag that set
    the key the spec refuses (`SPEC_FLAGS`), for --run-toml the file and its key."""
    import tempfile

    from protocol.runspec import load_run_spec

    with tempfile.TemporaryDirectory(prefix="crucible-swarm-") as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(text)
        try:
            return load_run_spec(path)
        except ValueError as e:
            problem = str(e).removeprefix(f"{path}: ")
    if args.run_toml:
        raise bad_input("--run-toml", str(args.run_toml), problem)
    named = [
        (m.start(), key)
        for key in SPEC_FLAGS
        if (m := re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", problem)) is not None
    ]
    if not named:
        raise UsageError(f"the run spec crucible-swarm builds from its flags is refused: {problem}")
    flag, attr, example = SPEC_FLAGS[min(named)[1]]
    value = getattr(args, attr)
    if isinstance(value, list):
        value = ",".join(str(v) for v in value)
    shown = value if value is not None else "(default)"
    raise bad_input(flag, shown, problem, None if "(example:" in problem else example)


def check_device(device: str) -> None:
    """`--device` names a device this host has (auto and cpu always do); UsageError otherwise, before
    any process starts (a node would refuse it only once the whole swarm runs)."""
    if device.strip().lower() in ("auto", "cpu"):
        return
    from node.device import DeviceError, resolve_device

    try:
        resolve_device(device)  # claims nothing for a named GPU
    except DeviceError as e:
        raise UsageError(str(e)) from e


def generated_run(args: argparse.Namespace, run_id: str) -> str:
    """The run.toml crucible-swarm writes from its flags (the [train] data keys are set by preflight)."""
    return set_pipeline(
        DEFAULT_RUN.format(
            run_id=run_id,
            replicas=args.replicas,
            stages=args.stages,
            steps=args.steps,
            H=args.H,
            sync=args.sync,
            beta=args.beta,
            eval_every=max(1, round(args.eval_every_steps / args.H)),
        ),
        # subspace-compressed links by default: k = d/8 on every boundary (DESIGN section 4)
        link_k=args.link_k if args.link_k is not None else [256 // 8] * (args.stages - 1),
        bandwidth_mbps=args.bandwidth_mbps,
        delay_ms=args.delay_ms,
    )


def preflight(args: argparse.Namespace) -> Prepared:
    """Check every input before a process starts, hash the corpus (and the tokenizer) and put the hashes
    in the spec, so every stage-0 node checks that it trains on the same bytes. UsageError names the flag
    and the value."""
    for flag, value, low in (
        ("--replicas", args.replicas, 1),
        ("--stages", args.stages, 1),
        ("--steps", args.steps, 1),
        ("--H", args.H, 1),
        ("--eval-every-steps", args.eval_every_steps, 1),
        ("--spares", args.spares, 0),
    ):
        if value < low:
            raise bad_input(flag, value, f"must be at least {low}", f"{flag} {max(low, 2)}")
    if args.timeout_s <= 0:
        raise bad_input("--timeout-s", args.timeout_s, "must be positive", "--timeout-s 900")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise bad_input("--out", str(args.out), "is a file, not a folder", "--out runs/my-run")
    if importlib.util.find_spec("moto") is None:
        raise UsageError(
            "crucible-swarm runs an embedded S3 store (moto), which is not installed: "
            "`bash scripts/setup.sh` installs it, or pip install -e '.[swarm]'"
        )
    from protocol.runspec import load_run_spec

    if args.run_toml:
        check_file("--run-toml", args.run_toml, "run spec")
        try:
            spec = load_run_spec(args.run_toml)
        except (ValueError, OSError) as e:
            raise bad_input("--run-toml", str(args.run_toml), str(e)) from e
        run_id, replicas, stages = spec.run_id, spec.replicas, spec.stages
        counts = tuple(spec.stages_of(r) for r in range(replicas)) if spec.mixed_layout else ()
        text, data, tokenizer = args.run_toml.read_text(), spec.train.data, spec.train.tokenizer
        data_flag, tok_flag = f"[train] data in {args.run_toml}", f"[train] tokenizer in {args.run_toml}"
    else:
        spec = None
        run_id = args.run_id or time.strftime("swarm-%Y%m%d-%H%M%S")
        replicas, stages, counts = args.replicas, args.stages, ()
        text, data = generated_run(args, run_id), args.data
        tokenizer = str(args.tokenizer) if args.tokenizer else ""
        data_flag, tok_flag = "--data", "--tokenizer"
    check_spec(text, args)  # the flags' spec, before the corpus is read (seconds for a large one)
    check_device(args.device)
    if is_store_url(data):
        raise bad_input(
            data_flag,
            data,
            "the embedded store starts empty; give the local corpus and --data-in-store (it is copied "
            "to s3://crucible/corpus/<hash> and streamed from there)",
            "--data ~/corpus --data-in-store",
        )
    if is_store_url(tokenizer):
        raise bad_input(
            tok_flag,
            tokenizer,
            "the embedded store starts empty; give the local tokenizer.json and --data-in-store (it is "
            "copied into the store with the corpus)",
            "--tokenizer tokenizer.json --data-in-store",
        )
    local = data if data == "stdlib" else os.path.abspath(os.path.expanduser(data))
    try:
        scan = scan_corpus(local)
        sha = corpus_sha256(manifest_of(scan))
    except DataError as e:
        raise UsageError(str(e)) from e
    if spec is not None and spec.train.data_sha256 and spec.train.data_sha256 != sha:
        raise bad_input(
            data_flag,
            data,
            f"its content hash is sha256 {sha}, the spec's data_sha256 says {spec.train.data_sha256}",
        )
    train: dict[str, object] = {"data": local, "data_sha256": sha}
    data_url = ""
    if args.data_in_store:
        data_url = STORE_CORPUS.format(sha256=sha)
        train["data"] = data_url
    vocab = None
    tok_url, tok_bytes = "", b""
    if tokenizer:
        from node.data.tokenizer import parse_tokenizer

        path = os.path.abspath(os.path.expanduser(tokenizer))
        try:
            tok_bytes = Path(path).read_bytes()
            tok = parse_tokenizer(tok_bytes, path)
        except (OSError, DataError) as e:
            raise bad_input(tok_flag, tokenizer, str(getattr(e, "strerror", None) or e)) from e
        if spec is not None and spec.model.vocab != tok.vocab:
            raise bad_input(
                f"[model] vocab in {args.run_toml}",
                spec.model.vocab,
                f"the tokenizer {tokenizer} has {tok.vocab} tokens",
                f"vocab = {tok.vocab}",
            )
        if data_url:  # the nodes fetch it from the store with the corpus: no local path in the spec
            tok_url = STORE_TOKENIZER.format(sha256=tok.sha256)
        train.update(tokenizer=tok_url or path, tokenizer_sha256=tok.sha256)
        vocab = tok.vocab
    text = set_keys(text, "train", **train)
    if spec is None and vocab is not None:
        text = set_keys(text, "model", vocab=vocab)
    check_spec(text, args)
    tokens = f", tokenizer {tokenizer} ({vocab} tokens)" if tokenizer else ""
    where = ", copied to the store" if data_url else ""
    print(f"crucible-swarm: data {data}: {scan.summary()}, sha256 {sha}{tokens}{where}", flush=True)
    return Prepared(
        run_id,
        replicas,
        stages,
        text,
        scan if data_url else None,
        data_url,
        bool(tokenizer),
        tokenizer_url=tok_url,
        tokenizer_bytes=tok_bytes if tok_url else b"",
        stage_counts=counts,
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli("crucible-swarm", _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    prep = preflight(args)
    run_id, replicas, stages = prep.run_id, prep.replicas, prep.stages
    out = args.out or Path("runs") / run_id
    out.mkdir(parents=True, exist_ok=True)
    run_toml = out / "run.toml"  # (for --run-toml, its copy with the corpus's hashes)
    run_toml.write_text(prep.run_toml)
    per_replica = (
        dict(enumerate(prep.stage_counts)) if prep.stage_counts else dict.fromkeys(range(replicas), stages)
    )
    n = sum(per_replica.values())
    spares = f" + {args.spares} spare node(s)" if args.spares else ""
    print(
        f"crucible-swarm: run {run_id}: {replicas} replicas x "
        f"{'/'.join(map(str, prep.stage_counts)) if prep.stage_counts else stages} stages{spares}; logs in {out}/",
        flush=True,
    )
    swarm = Swarm(out, n + args.spares, device=args.device)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed swarm still stops every child it started
    t0 = time.monotonic()
    ok = False
    faults: list[dict] = []
    calibrated: dict | None = None

    def before_nodes() -> None:
        """Store, bootstrap peer and coordinator are up: fill the store, then calibrate, all before the
        nodes start (each times itself as it starts; the probes would slow those figures)."""
        nonlocal calibrated
        print(
            f"  store      {swarm.store_url}\n  bootstrap  {swarm.bootstrap}\n  operator   {swarm.operator.peer_id}\n"
            f"  dashboard  {swarm.dashboard}  (live plots; Prometheus at {swarm.dashboard}metrics)",
            flush=True,
        )
        publish(prep, swarm.store_url)
        if not args.no_calibrate:
            print("  calibrating the planner on this machine (before the nodes start) ...", flush=True)
            got = calibrate_and_predict(run_toml, swarm.store_url)
            if got:
                calibrated, text = got
                print(text, flush=True)

    try:
        swarm.start(before_nodes=before_nodes)
        swarm.launch(run_toml)
        t_launch = time.monotonic()
        last_print = 0.0
        clock = StepClock()
        progress = Progress(run_id)
        cpu = CpuMeter({c.name: c.proc.pid for c in swarm.children})
        quiet_since: float | None = None
        prediction: dict | None = None  # the coordinator's, from the nodes' adverts (the dashboard's)
        while time.monotonic() - t0 < args.timeout_s:
            sts = swarm.statuses()
            now = time.monotonic()
            clock.observe(sts, now, run_id)
            progress.observe(sts)
            if prediction is None and (prediction := coordinator_prediction(swarm.dashboard, run_id)):
                print(prediction_line(prediction, calibrated), flush=True)
            ms = [s["metrics"] for s in sts if s]
            if clock.first_seen and not all(m["state"] == "done" for m in ms):
                cpu.sample()  # from the first trained step to the last poll before every node is done
            if now - last_print >= 10:
                predicted = prediction["tokens_per_s"] if prediction else None
                print(progress.line(now - t0, predicted), flush=True)
                last_print = now
            faults += supervise(swarm, now - t0)
            faults += reported_failures(swarm, sts, faults, run_id, now - t0)
            mine = [m for m in ms if m["run_id"] == run_id]
            if not faults:
                if len(mine) == n and all(m["state"] in ("done", "failed") for m in mine):
                    break
            elif (finished := complete_replicas(mine, per_replica)) and not any(
                m["state"] in ("assigned", "training") for m in mine
            ):
                if len(finished) == replicas:
                    break
                quiet_since = quiet_since or now  # the survivors are done: give a rebuild its chance
                if now - quiet_since > SETTLE_AFTER_FAULT_S:
                    break
            else:
                quiet_since = None
            time.sleep(1)
        else:
            raise ProcessFailed(f"run did not finish within {args.timeout_s:.0f} s")
        sts = swarm.statuses()
        progress.observe(sts)
        ms = [m for s in sts if s and (m := s["metrics"])["run_id"] == run_id]
        report = build_report(run_id, ms, time.monotonic() - t_launch, swarm.store_url, progress)
        report["faults"] = faults
        report.update(throughput_report(clock, run_toml, prediction, calibrated, n * NODE_PRICE_PER_HOUR))
        report.update(cpu.report())
        (out / "steps.json").write_text(json.dumps(clock.as_dict(t_launch)))
        if report["completed"]:  # the consensus as a Hugging Face Llama folder, the way a user exports one
            try:
                report["export"] = swarm.export(run_id, out / "hf")
            except ProcessFailed as e:
                report["export"] = f"failed: {e}"
        (out / "report.json").write_text(json.dumps(report, indent=2))
        print_report(report, out)
        ok = report["completed"] and not report.get("export", "").startswith("failed")
    except (ProcessFailed, KeyboardInterrupt) as e:
        print(f"crucible-swarm: {e}", file=sys.stderr)
    finally:
        codes = swarm.stop()
        unclean = {
            k: v for k, v in codes.items() if v not in (0, -15) and not any(f["process"] == k for f in faults)
        }
        if unclean:
            print(f"  processes that did not exit cleanly: {unclean}", file=sys.stderr)
    return 0 if ok else 1


MAX_RESPAWNS = 8
"""Node processes crucible-swarm starts in place of dead ones (a crash loop must not run forever)."""


def supervise(swarm: Swarm, elapsed: float) -> list[dict]:
    """Notice children that died, say so, and keep the swarm going: a new node in place of a dead one
    (the coordinator rebuilds its replica from the checkpoint), a new coordinator in place of a dead one
    (it takes the lease over when it lapses). Returns the faults seen now."""
    seen: list[dict] = []
    for c in list(swarm.nodes):
        if c.alive or getattr(c, "reported", False):
            continue
        c.reported = True  # type: ignore[attr-defined]
        fault = {"at_s": round(elapsed, 1), "process": c.name, "event": f"exited with {c.proc.returncode}"}
        respawned = len(swarm.nodes) - swarm.n_nodes
        if respawned < MAX_RESPAWNS:
            node = swarm.respawn_node()
            fault["action"] = f"started {node.name}; the coordinator rebuilds the replica from its checkpoint"
        else:
            fault["action"] = f"none: {MAX_RESPAWNS} nodes restarted already"
        seen.append(fault)
    if not swarm.coordinator.alive:
        old = swarm.coordinator
        fault = {
            "at_s": round(elapsed, 1),
            "process": old.name,
            "event": f"exited with {old.proc.returncode}",
        }
        new = swarm.respawn_coordinator()
        fault["action"] = f"started {new.name}; it takes the run over when the lease lapses"
        seen.append(fault)
    for f in seen:
        print(f"[{f['at_s']:5.0f}s] FAULT {f['process']} {f['event']}: {f['action']}", flush=True)
    return seen


def reported_failures(
    swarm: Swarm, statuses: list[dict | None], known: list[dict], run_id: str, elapsed: float
) -> list[dict]:
    """Workers that report `failed` (with the reason their node gives), each once per node and reason."""
    seen = {(f["process"], f["event"]) for f in known}
    new = []
    for node, st in zip(swarm.nodes, statuses, strict=False):
        m = st["metrics"] if st else None
        if not m or m["run_id"] != run_id or m["state"] != "failed":
            continue
        event = f"reported failed (replica {m['replica']}, stage {m['stage']}): {m['error'] or 'no reason'}"
        if (node.name, event) not in seen:
            f = {
                "at_s": round(elapsed, 1),
                "process": node.name,
                "event": event,
                "action": "the coordinator rebuilds or drops its replica",
            }
            print(f"[{f['at_s']:5.0f}s] FAULT {f['process']} {f['event']}", flush=True)
            new.append(f)
    return new


def complete_replicas(ms: list[dict], stages: int | dict[int, int]) -> set[int]:
    """Replicas whose every stage is done (`stages`: each replica's stage count, or one for all)."""
    done = {(m["replica"], m["stage"]) for m in ms if m["state"] == "done"}
    of = (lambda r: stages.get(r, 0)) if isinstance(stages, dict) else (lambda r: stages)
    return {r for r, _ in done if all((r, s) in done for s in range(of(r)))}


def build_report(
    run_id: str, ms: list[dict], seconds: float, store_url: str, progress: Progress | None = None
) -> dict:
    """Figures of the run from its live nodes' metrics; quality and consensus from the replicas that
    finished (a replica that dropped out after a fault has no final weights to compare). `progress`:
    what was seen during the run (`Progress`): the step-0 validation and the bytes of nodes that died
    or restarted since; without it, what the live nodes report now."""
    if not ms:
        raise ProcessFailed(f"no live node reports run {run_id}; see the logs")
    stages: dict[int, int] = {}  # each replica's stage count, as its nodes report (splits may differ)
    for x in ms:
        stages[x["replica"]] = max(stages.get(x["replica"], 0), x["stage"] + 1)
    complete = complete_replicas(ms, stages)
    finished = [m for m in ms if m["replica"] in complete and m["state"] == "done"]
    last = [m for m in finished or ms if m["stage"] == stages[m["replica"]] - 1]
    hist = {m["replica"]: m["val_history"] for m in last}
    # the run starts where every replica started, at step 0: a rebuilt replica's history begins at the
    # checkpoint it resumed from, so its first figure is not the run's start
    start = [h[0][1] for h in hist.values() if h and h[0][0] == 0]
    if progress is not None and progress.start_val:
        start = list(progress.start_val.values())
    end = [h[-1][1] for h in hist.values() if h]
    if progress is not None:
        up, down = progress.bytes.total("bytes_store_up"), progress.bytes.total("bytes_store_down")
        pipe = progress.bytes.total("bytes_pipe_sent")
    else:
        up, down = sum(m["bytes_store_up"] for m in ms), sum(m["bytes_store_down"] for m in ms)
        pipe = sum(m["bytes_pipe_sent"] for m in ms)
    steps = max(m["step"] for m in ms)
    replicas = len({m["replica"] for m in ms})
    by_group: dict[str, set[str]] = {}  # layer group -> its final weights' digests over the replicas
    for m in finished:
        for g, digest in (m.get("group_sha256") or {"s" + str(m["stage"]): m["weights_sha256"]}).items():
            by_group.setdefault(g, set()).add(digest)
    return {
        "run_id": run_id,
        "all_done": all(m["state"] == "done" for m in ms),
        "completed": bool(complete),
        "replicas_done": sorted(complete),
        "seconds": round(seconds, 1),
        "steps": steps,
        # what the first stages trained (each replica at its own batch; a rebuilt one since it resumed)
        "tokens": sum(m["tokens"] for m in ms if m["stage"] == 0),
        "val_bpb_start": round(sum(start) / len(start), 4) if start else None,
        "val_bpb_end": round(sum(end) / len(end), 4) if end else None,
        "val_bpb_drop": round(1 - sum(end) / sum(start), 4) if start and end else None,
        "val_history": hist,
        "replicas": replicas,
        "consensus_identical": bool(by_group) and all(len(v) == 1 and "" not in v for v in by_group.values()),
        "bytes_pipeline": pipe,
        "bytes_store_up": up,
        "bytes_store_down": down,
        "pipe_wait_s": round(sum(m["pipe_wait_s"] for m in ms), 1),
        "sync_wait_s": round(sum(m["sync_wait_s"] for m in ms), 1),
        "routing": _routing(ms),
        "store_url": store_url,
    }


def _routing(ms: list[dict]) -> dict | None:
    """An MoE run's per-step barrier of routing statistics (node/sync/route_exchange.py) over its stages:
    the training time it stalled per step, its bytes per step, the expert load (max/mean, the worst
    layer's), and whether every replica's stage held the same bias at the last step they share; None for a
    dense run."""
    moe = [m for m in ms if m.get("routing")]
    if not moe:
        return None
    steps = sum(m["routing"]["steps"] for m in moe)
    same = True
    for stage in {m["stage"] for m in moe}:
        histories = [dict(map(tuple, m["expert_bias_history"])) for m in moe if m["stage"] == stage]
        common = set.intersection(*(set(h) for h in histories))
        same = same and bool(common) and len({h[max(common)] for h in histories}) == 1
    return {
        "stall_ms_per_step": round(1e3 * sum(m["routing"]["wait_s"] for m in moe) / max(steps, 1), 2),
        "bytes_per_step": round(
            sum(m["routing"]["bytes_up"] + m["routing"]["bytes_down"] for m in moe) / max(steps, 1)
        ),
        "missing": sum(m["routing"]["missing"] for m in moe),
        "rejected": sum(m["routing"]["rejected"] for m in moe),
        "expert_load_max": max((v for m in moe for v in m["expert_load"].values()), default=None),
        "bias_identical": same,
    }


def print_report(r: dict, out: Path) -> None:
    print("\n== crucible-swarm report ==")
    state = (
        "done"
        if r["all_done"]
        else f"done by replica(s) {r['replicas_done']}"
        if r["completed"]
        else "INCOMPLETE"
    )
    print(
        f"run {r['run_id']}: {state} in {r['seconds']:.0f} s, {r['steps']} steps, {r['tokens'] / 1e6:.2f} M tokens"
    )
    for f in r.get("faults", []):
        print(f"fault at {f['at_s']:.0f} s: {f['process']} {f['event']}; {f['action']}")
    if r["val_bpb_start"] is not None:
        print(
            f"validation bits/byte: {r['val_bpb_start']:.3f} -> {r['val_bpb_end']:.3f} ({100 * r['val_bpb_drop']:.1f}% lower)"
        )
    print(f"consensus weights identical across replicas: {r['consensus_identical']}")
    if r.get("export"):
        print(f"export: {r['export']}")
        if not r["export"].startswith("failed"):
            print(f"  generate: .venv/bin/python -m scripts.generate {out / 'hf'} --prompt 'def '")
    print(
        f"bytes: pipeline {_fmt_bytes(r['bytes_pipeline'])}, store up {_fmt_bytes(r['bytes_store_up'])}, "
        f"down {_fmt_bytes(r['bytes_store_down'])}; waits: pipeline {r['pipe_wait_s']} s, sync {r['sync_wait_s']} s"
    )
    rt = r.get("routing")
    if rt:
        print(
            f"MoE routing barrier: {rt['stall_ms_per_step']} ms stalled a stage step, "
            f"{rt['bytes_per_step'] / 1e3:.1f} kB a stage step; missing {rt['missing']}, rejected {rt['rejected']}; "
            f"expert load max/mean up to {rt['expert_load_max']}; expert bias identical across replicas: "
            f"{rt['bias_identical']}"
        )
    if r.get("measured_tokens_per_s"):
        vs = ""
        for what, err_key in (("predicted", "prediction_error"), ("calibrated", "calibration_error")):
            pred, err = r.get(f"{what}_tokens_per_s"), r.get(err_key)
            if pred and err is not None:
                vs += f", {what} {pred:,.0f} ({100 * err:+.1f}%)"
        rounds = r.get("measured_tokens_per_s_with_rounds")
        with_rounds = f"; {rounds:,.0f} tokens/s with syncs and evaluations" if rounds else ""
        print(
            f"steady-state throughput: measured {r['measured_tokens_per_s']:,.0f} tokens/s{vs}{with_rounds}"
        )
    if r.get("measured_effective_mfu") is not None:
        p = r["prediction"] or r["calibration"]
        usd = p.get("usd_per_mtok")
        print(
            f"  MFU {100 * r['measured_effective_mfu']:.1f}% (predicted {100 * p['effective_mfu']:.1f}%), "
            f"tax {100 * r['measured_tax']:.1f}% (predicted {100 * p['tax']:.1f}%), "
            f"${r['measured_usd_per_mtok']:.3f}/Mtok"
            + (f" (predicted ${usd:.3f})" if usd is not None else "")
        )
    if r.get("cpu_busy_cores") is not None:
        print(
            f"  CPU while training: {r['cpu_busy_cores']:.2f} cores busy, {r['cpu_swarm_cores']:.2f} by the swarm "
            f"({r['cpu_node_cores']:.2f} in the node processes, {r['cpu_node_children_cores']:.2f} in their DHT "
            f"daemons), {r['cpu_other_cores']:.2f} by other work"
        )
    print(f"report: {out}/report.json   logs: {out}/*.log")


if __name__ == "__main__":
    sys.exit(main())

"""One command, a whole swarm on localhost: embedded S3 store, bootstrap peer, coordinator and R x S nodes,
each its own OS process, training a small Llama-style model on a real corpus, with live progress and a
final report.

  crucible-swarm                         # 2 replicas x 2 stages on the Python standard library's source
  crucible-swarm --data ~/corpus --steps 600 --sync sparseloco
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import tomllib

from scripts.procs import Child, ProcessFailed

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
data = "{data}"
eval_batches = 4

[sync]
method = "{sync}"
H = {H}
alpha = 1.0
timeout_s = 120.0

[pipeline]
wire_dtype = "float32"
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="crucible-swarm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--replicas", type=int, default=2, help="R: pipeline replicas (default 2)")
    ap.add_argument("--stages", type=int, default=2, help="S: stages per replica (default 2)")
    ap.add_argument("--steps", type=int, default=240, help="inner steps per replica (default 240)")
    ap.add_argument("--H", type=int, default=30, help="inner steps per outer round (default 30)")
    ap.add_argument("--sync", default="diloco", choices=["diloco", "sparseloco"], help="cross-replica method")
    ap.add_argument(
        "--data", default="stdlib", help="corpus: 'stdlib' (default), a text file, a directory or a glob"
    )
    ap.add_argument("--run-toml", type=Path, help="use this run spec instead of the generated one")
    ap.add_argument("--run-id", default="", help="run id (default: swarm-<time>)")
    ap.add_argument(
        "--out", type=Path, help="directory for logs, keys and the report (default runs/<run id>)"
    )
    ap.add_argument("--timeout-s", type=float, default=900, help="give up after this long (default 900)")
    return ap.parse_args(argv)


def _get_status(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


class Swarm:
    """Starts and stops the processes of a local swarm; usable from tests too."""

    def __init__(self, out: Path, n_nodes: int, *, node_env: dict[str, str] | None = None) -> None:
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.n_nodes = n_nodes
        self.node_env = node_env or {}
        self.nodes: list[Child] = []
        self.health: list[str] = []

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        c = Child(name, args, self.out, env)
        self.children.append(c)
        return c

    def start(self, ready_timeout_s: float = 120) -> None:
        from protocol.identity import Identity

        store = self._spawn("store", ["-m", "scripts.embedded_store"])
        self.store_url = store.wait_for(r"STORE (\S+)", ready_timeout_s).group(1)
        boot = self._spawn(
            "bootstrap", ["-m", "node.cli", "bootstrap", "--key-file", str(self.out / "bootstrap.key")]
        )
        self.bootstrap = boot.wait_for(r"BOOTSTRAP (\S+)", ready_timeout_s).group(1)
        self.operator_key_file = self.out / "operator.key"
        self.operator = Identity.load_or_create(self.operator_key_file)
        self.coordinator = self._spawn(
            "coordinator", ["-m", "coordinator.cli", "serve", *self.swarm_flags(), *self.operator_flags()]
        )
        for i in range(self.n_nodes):
            self.add_node(i)
        self.coordinator.wait_for(r"crucible-coordinator ready", ready_timeout_s)
        for node in self.nodes:
            self.health.append(node.wait_for(r"health=(\S+)/health", ready_timeout_s).group(1))

    def add_node(self, i: int) -> Child:
        node = self._spawn(
            f"node{i}",
            [
                "-m",
                "node.cli",
                "join",
                *self.swarm_flags(),
                "--operator-key",
                self.operator.peer_id,
                "--key-file",
                str(self.out / f"node{i}.key"),
                "--torch-threads",
                "1",
                "--price-per-hour",
                "0.10",
            ],
            self.node_env,
        )
        self.nodes.append(node)
        return node

    def swarm_flags(self) -> list[str]:
        return ["--bootstrap", self.bootstrap, "--store-endpoint", self.store_url]

    def operator_flags(self) -> list[str]:
        return ["--operator-key-file", str(self.operator_key_file)]

    def launch(self, run_toml: Path) -> None:
        c = self._spawn(
            "launch",
            ["-m", "coordinator.cli", "launch", str(run_toml), *self.swarm_flags(), *self.operator_flags()],
        )
        c.wait_for(r"launched run", 120)

    def statuses(self) -> list[dict | None]:
        return [_get_status(f"{h}/status") for h in self.health]

    def stop(self) -> dict[str, int | None]:
        codes = {}
        for c in reversed(self.children):
            codes[c.name] = c.stop()
        return codes


def progress_line(statuses: list[dict | None], elapsed: float) -> str:
    ms = [s["metrics"] for s in statuses if s]
    if not ms:
        return f"[{elapsed:5.0f}s] waiting for nodes"
    steps = [m["step"] for m in ms if m["state"] in ("training", "done")]
    losses = [m["loss"] for m in ms if m.get("loss") is not None]
    vals = [m["val_bpb"] for m in ms if m.get("val_bpb") is not None]
    tok = sum(m["tokens_per_s"] for m in ms if m["stage"] == 0)
    pipe = sum(m["bytes_pipe_sent"] for m in ms)
    store = sum(m["bytes_store_up"] + m["bytes_store_down"] for m in ms)
    total = max((m["total_steps"] for m in ms), default=0)
    step = f"{min(steps)}/{total}" if steps else "-"
    loss = f"{sum(losses) / len(losses) / 0.6931:.3f}" if losses else "-"
    val = f"{sum(vals) / len(vals):.3f}" if vals else "-"
    return (
        f"[{elapsed:5.0f}s] step {step:>9}  train {loss:>6} bits/byte  val {val:>6} bits/byte  "
        f"{tok:7.0f} tok/s  pipeline {_fmt_bytes(pipe):>9}  store {_fmt_bytes(store):>9}"
    )


def _raise_interrupt(*_: object) -> None:
    raise KeyboardInterrupt("terminated")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_id = args.run_id or time.strftime("swarm-%Y%m%d-%H%M%S")
    out = args.out or Path("runs") / run_id
    if args.run_toml:
        run_toml = args.run_toml
        spec = tomllib.loads(run_toml.read_text())
        run_id = spec["run"]["run_id"]
        replicas, stages = spec["run"].get("replicas", 2), spec["run"].get("stages", 2)
    else:
        replicas, stages = args.replicas, args.stages
        out.mkdir(parents=True, exist_ok=True)
        run_toml = out / "run.toml"
        run_toml.write_text(
            DEFAULT_RUN.format(
                run_id=run_id,
                replicas=replicas,
                stages=stages,
                steps=args.steps,
                H=args.H,
                sync=args.sync,
                data=args.data,
                eval_every=1,
            )
        )
    n = replicas * stages
    print(f"crucible-swarm: run {run_id}: {replicas} replicas x {stages} stages; logs in {out}/", flush=True)
    swarm = Swarm(out, n)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # a killed swarm still stops every child it started
    t0 = time.monotonic()
    ok = False
    try:
        swarm.start()
        print(
            f"  store      {swarm.store_url}\n  bootstrap  {swarm.bootstrap}\n  operator   {swarm.operator.peer_id}",
            flush=True,
        )
        swarm.launch(run_toml)
        t_launch = time.monotonic()
        last_print = 0.0
        while time.monotonic() - t0 < args.timeout_s:
            sts = swarm.statuses()
            now = time.monotonic()
            if now - last_print >= 10:
                print(progress_line(sts, now - t0), flush=True)
                last_print = now
            ms = [s["metrics"] for s in sts if s]
            if len(ms) == n and all(m["run_id"] == run_id and m["state"] in ("done", "failed") for m in ms):
                break
            dead = [c.name for c in swarm.nodes if not c.alive]
            if dead:
                raise ProcessFailed(f"{', '.join(dead)} exited unexpectedly; see {out}/")
            time.sleep(1)
        else:
            raise ProcessFailed(f"run did not finish within {args.timeout_s:.0f} s")
        ms = [s["metrics"] for s in swarm.statuses() if s]
        report = build_report(run_id, ms, time.monotonic() - t_launch, swarm.store_url)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        print_report(report, out)
        ok = report["all_done"]
    except (ProcessFailed, KeyboardInterrupt) as e:
        print(f"crucible-swarm: {e}", file=sys.stderr)
    finally:
        codes = swarm.stop()
        unclean = {k: v for k, v in codes.items() if v not in (0, -15)}
        if unclean:
            print(f"  processes that did not exit cleanly: {unclean}", file=sys.stderr)
    return 0 if ok else 1


def build_report(run_id: str, ms: list[dict], seconds: float, store_url: str) -> dict:
    last = [m for m in ms if m["stage"] == max(x["stage"] for x in ms)]
    hist = {m["replica"]: m["val_history"] for m in last}
    start = [h[0][1] for h in hist.values() if h]
    end = [h[-1][1] for h in hist.values() if h]
    steps = max(m["step"] for m in ms)
    replicas = len({m["replica"] for m in ms})
    by_stage: dict[int, set[str]] = {}
    for m in ms:
        by_stage.setdefault(m["stage"], set()).add(m["weights_sha256"])
    return {
        "run_id": run_id,
        "all_done": all(m["state"] == "done" for m in ms),
        "seconds": round(seconds, 1),
        "steps": steps,
        "tokens": sum(m["step"] for m in ms if m["stage"] == 0) * 8 * 256,
        "val_bpb_start": round(sum(start) / len(start), 4) if start else None,
        "val_bpb_end": round(sum(end) / len(end), 4) if end else None,
        "val_bpb_drop": round(1 - sum(end) / sum(start), 4) if start and end else None,
        "val_history": hist,
        "replicas": replicas,
        "consensus_identical": all(len(v) == 1 and "" not in v for v in by_stage.values()),
        "bytes_pipeline": sum(m["bytes_pipe_sent"] for m in ms),
        "bytes_store_up": sum(m["bytes_store_up"] for m in ms),
        "bytes_store_down": sum(m["bytes_store_down"] for m in ms),
        "pipe_wait_s": round(sum(m["pipe_wait_s"] for m in ms), 1),
        "sync_wait_s": round(sum(m["sync_wait_s"] for m in ms), 1),
        "store_url": store_url,
    }


def print_report(r: dict, out: Path) -> None:
    print("\n== crucible-swarm report ==")
    print(
        f"run {r['run_id']}: {'done' if r['all_done'] else 'INCOMPLETE'} in {r['seconds']:.0f} s, {r['steps']} steps, "
        f"{r['tokens'] / 1e6:.2f} M tokens"
    )
    if r["val_bpb_start"] is not None:
        print(
            f"validation bits/byte: {r['val_bpb_start']:.3f} -> {r['val_bpb_end']:.3f} ({100 * r['val_bpb_drop']:.1f}% lower)"
        )
    print(f"consensus weights identical across replicas: {r['consensus_identical']}")
    print(
        f"bytes: pipeline {_fmt_bytes(r['bytes_pipeline'])}, store up {_fmt_bytes(r['bytes_store_up'])}, "
        f"down {_fmt_bytes(r['bytes_store_down'])}; waits: pipeline {r['pipe_wait_s']} s, sync {r['sync_wait_s']} s"
    )
    print(f"report: {out}/report.json   logs: {out}/*.log")


if __name__ == "__main__":
    sys.exit(main())

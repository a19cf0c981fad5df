"""Every command that docs/benchmarks.md documents still runs as written.

Each documented command line that runs a `scripts.*` module (`python -m scripts.X ...`, `scripts/X.py ...`, or
a bare `sweep_quality ...` in the prose) is run in this process as `main(["--check", *its flags])`: its flags
are parsed exactly as for a real run and every arm's settings and run spec are built (where a real run would
be refused, so is the check), but nothing trains, no server or process starts. A command the code can no
longer run fails here, naming it.
"""

from __future__ import annotations

import importlib
import io
import json
import re
import shlex
import threading
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
MIN_COMMANDS = 26
"""Commands the doc held when this test was written: finding fewer means the parser lost some."""
NOT_RUN = {
    "scripts/netns_swarm.sh": "needs root, `ip netns` and `tc`: it builds two network namespaces and "
    "shapes their links (its own --check measures them); what it runs inside is bench_pipeline, whose "
    "commands run here",
    "scripts/setup.sh": "installs the virtual environment (minutes, over the network); the main job it "
    "chains to, crucible-swarm (scripts.local_swarm), starts a whole swarm of processes and is run by "
    "tests/test_swarm.py",
}
"""Shell scripts the doc runs, and why this test leaves them out."""
PLACEHOLDERS = {"KIND": "flip", "RULE": "trimmed"}
"""An example value for each upper-case placeholder a documented command holds."""
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
CHECK_S = 10.0
"""Far above what a check takes (milliseconds once imported), far below a real run (minutes)."""


@dataclass(frozen=True)
class Command:
    text: str
    """As the doc writes it, without its comment and with single spaces."""
    module: str
    """X of scripts.X."""
    args: tuple[str, ...]


def scripts() -> set[str]:
    return {p.stem for p in (ROOT / "scripts").glob("*.py") if not p.stem.startswith("_")}


def parse(text: str, fenced: bool) -> Command | None:
    """The command in one line of a code block (fenced) or one inline code span, None if it runs no script.
    Inline, `scripts/X.py` or a bare `X` without flags names a file, not a command."""
    tokens = shlex.split(text, comments=fenced)
    if any(tok.endswith(name) for tok in tokens for name in NOT_RUN):
        return None  # a shell script this test leaves out, for the reason NOT_RUN gives
    for i, tok in enumerate(tokens):
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("scripts."):
            module, rest = tokens[i + 1].removeprefix("scripts."), tokens[i + 2 :]
        elif m := re.fullmatch(r"(?:\./)?scripts/(\w+)\.py", tok):
            module, rest = m[1], tokens[i + 1 :]
        elif i == 0 and not fenced and tok in scripts():
            module, rest = tok, tokens[1:]
        else:
            continue
        if not rest and not fenced and "-m" not in tokens:
            return None
        args = tuple(PLACEHOLDERS.get(a, a) for a in rest)
        return Command(text=" ".join(tokens), module=module, args=args)
    if fenced and any("scripts" in tok for tok in tokens):
        raise AssertionError(f"`{text.strip()}` runs something of scripts/ that this test cannot run")
    return None


def commands(doc: str) -> list[Command]:
    """Every documented command line that runs a scripts.* module, in order, each once."""
    found: list[Command] = []
    for block in FENCE.findall(doc):
        found += [c for line in block.splitlines() if (c := parse(line, fenced=True))]
    names = scripts()
    for span in SPAN.findall(FENCE.sub("", doc)):
        text = " ".join(span.split())  # a span may break across lines
        if "scripts" in text or text.split(" ")[0] in names:
            found += [c for c in [parse(text, fenced=False)] if c]
    return list(dict.fromkeys(found))


def run_check(module: str, args: list[str]) -> tuple[object, str, str]:
    """scripts.<module>.main(["--check", *args]) in this process: (exit code, stdout, stderr)."""
    main = importlib.import_module(f"scripts.{module}").main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc: object = main(["--check", *args])
        except SystemExit as e:  # argparse errors, refusals
            rc = e.code
    return (0 if rc is None else rc), out.getvalue(), err.getvalue()


DOCUMENTED = commands(DOC.read_text())


def test_the_doc_still_holds_its_commands() -> None:
    assert len(DOCUMENTED) >= MIN_COMMANDS, [c.text for c in DOCUMENTED]
    placeholders = [a for c in DOCUMENTED for a in c.args if re.fullmatch(r"[A-Z][A-Z_]+", a)]
    assert not placeholders, f"add an example value for {placeholders} to PLACEHOLDERS"


@pytest.mark.parametrize("cmd", DOCUMENTED, ids=[c.text for c in DOCUMENTED])
def test_documented_command_runs(cmd: Command) -> None:
    importlib.import_module(f"scripts.{cmd.module}")  # imports are not what the time bound is about
    me, threads = psutil.Process(), threading.active_count()
    t0 = time.perf_counter()
    rc, out, err = run_check(cmd.module, list(cmd.args))
    took = time.perf_counter() - t0
    assert rc == 0, f"`{cmd.text}` can no longer run (exit {rc}):\n{err[-3000:]}"
    result = json.loads(out.strip().splitlines()[-1])
    assert result["check"] == "ok", result
    assert took < CHECK_S, f"`{cmd.text}` --check took {took:.1f} s: it must build settings, not run"
    assert not me.children() and threading.active_count() == threads, "--check started a process or thread"


def test_a_command_the_run_spec_refuses_fails_its_check() -> None:
    # the recorded H = 5 with 5 fragments leaves no inner step for tau = 1: the spec refuses it
    doc = "```\npython -m scripts.bench_quality --H 5 --P 5  # refused\n```\n"
    doc += "and in prose, `sweep_quality --seeds 1 -- --P 5`\n"
    found = commands(doc)
    assert [c.module for c in found] == ["bench_quality", "sweep_quality"]
    for c in found:
        rc, _, err = run_check(c.module, list(c.args))
        assert rc == 2 and "sync.tau=1 must satisfy 0 <= tau < H/P=1 (H=5, P=5)" in err, err


def test_arms_not_selected_are_not_built() -> None:
    rc, out, err = run_check("bench_quality", ["--arms", "adamw,sparseloco", "--P", "5"])
    assert rc == 0, err
    assert set(json.loads(out)["arms"]) == {"adamw", "sparseloco"}


def test_streaming_arms_default_to_settings_the_spec_accepts() -> None:
    rc, out, err = run_check("bench_quality", ["--arms", "stream_tau1,stream_tau2"])
    assert rc == 0, err
    arms = json.loads(out)["arms"]
    assert [(arms[a]["H"], arms[a]["P"], arms[a]["tau"]) for a in arms] == [(5, 2, 1), (5, 1, 2)]

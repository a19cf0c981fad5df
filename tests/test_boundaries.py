"""node/ and coordinator/ meet only through protocol/: neither imports the other, and coordinator/ does
not even start node/ code (it reads what nodes measure from their adverts)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module.split(".")[0])
    return out


def test_node_and_coordinator_import_only_protocol_of_each_other() -> None:
    for role, other in (("node", "coordinator"), ("coordinator", "node")):
        bad = [p.name for p in (ROOT / role).glob("*.py") if other in _imports(p)]
        assert not bad, f"{role}/ modules import {other}/: {bad}"


def test_coordinator_spawns_no_node_module() -> None:
    spawn = re.compile(r"""["']node\.[a-z_]+["']|-m\s+node\.""")
    bad = [p.name for p in (ROOT / "coordinator").glob("*.py") if spawn.search(p.read_text())]
    assert not bad, f"coordinator/ modules name node/ modules to run: {bad}"

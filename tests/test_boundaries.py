"""The layout's rules (README, "Layout"): protocol/ at the bottom; node/ and coordinator/ meet only through
it, and coordinator/ does not even start node/ code (it reads what nodes measure from their adverts); inside
a node the pipeline path (node/pipeline/) and the sync path (node/sync/) do not import each other; and the
size limits that keep each folder, class and function readable."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "node", "coordinator")
MAX_MODULES = 15  # per folder, directly (its __init__.py aside)
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 100


def _modules(package: str) -> Iterator[Path]:
    yield from sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module path `path` imports, in full ("node.sync.outer_sync"), lazy imports included."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names}
    return out


def _imports_from(path: Path, prefix: str) -> set[str]:
    return {m for m in _imports(path) if m == prefix or m.startswith(prefix + ".")}


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("protocol", ("node", "coordinator")), ("node", ("coordinator",)), ("coordinator", ("node",))],
)
def test_the_layers(package: str, forbidden: tuple[str, ...]) -> None:
    bad = {_rel(p): sorted(m) for p in _modules(package) for f in forbidden if (m := _imports_from(p, f))}
    assert not bad, f"{package}/ imports {'/'.join(forbidden)}/: {bad}"


@pytest.mark.parametrize(("path", "other"), [("node/pipeline", "node.sync"), ("node/sync", "node.pipeline")])
def test_the_pipeline_path_and_the_sync_path_do_not_import_each_other(path: str, other: str) -> None:
    bad = {_rel(p): sorted(m) for p in sorted((ROOT / path).rglob("*.py")) if (m := _imports_from(p, other))}
    assert not bad, f"{path}/ imports {other}: {bad}"


def test_coordinator_spawns_no_node_module() -> None:
    spawn = re.compile(r"""["']node\.[a-z_]+["']|-m\s+node\.""")
    bad = [_rel(p) for p in _modules("coordinator") if spawn.search(p.read_text())]
    assert not bad, f"coordinator/ modules name node/ modules to run: {bad}"


def test_no_folder_holds_more_than_15_modules() -> None:
    folders = {p.parent for pkg in PACKAGES for p in _modules(pkg)}
    counts = {_rel(f): len([p for p in f.glob("*.py") if p.name != "__init__.py"]) for f in folders}
    over = {f: n for f, n in counts.items() if n > MAX_MODULES}
    assert not over, f"folders over {MAX_MODULES} modules (group them into a subpackage): {over}"


def test_no_class_over_400_lines_and_no_function_over_100() -> None:
    over = []
    for pkg in PACKAGES:
        for p in _modules(pkg):
            for n in ast.walk(ast.parse(p.read_text(), str(p))):
                lines = (n.end_lineno or n.lineno) - n.lineno + 1 if isinstance(n, ast.stmt) else 0
                if isinstance(n, ast.ClassDef) and lines > MAX_CLASS_LINES:
                    over.append(f"class {_rel(p)}:{n.name} ({lines} lines)")
                elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                    over.append(f"function {_rel(p)}:{n.name} ({lines} lines)")
    assert not over, f"over {MAX_CLASS_LINES} lines a class / {MAX_FUNCTION_LINES} a function: {over}"


def test_no_import_cycle_between_modules() -> None:
    """Module-level and lazy imports alike: a cycle hidden in a function or under TYPE_CHECKING is still one."""
    names = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for pkg in PACKAGES
        for p in _modules(pkg)
    }
    graph = {m: {i for i in _imports(p) if i in names and i != m} for m, p in names.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_the_readme_layout_table_names_every_folder() -> None:
    """The README's "Layout" table says what each folder is for: one row per package folder, no row for a
    folder that is gone."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Layout") :].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `([\w/]+)/` \|", table, flags=re.M))
    folders = {_rel(p.parent) for pkg in PACKAGES for p in _modules(pkg)} | {"tests/helpers"}
    assert folders <= rows, f"folders without a row in the README's layout table: {sorted(folders - rows)}"
    gone = {r for r in rows if not (ROOT / r).is_dir()}
    assert not gone, f"rows of the README's layout table for folders that do not exist: {sorted(gone)}"

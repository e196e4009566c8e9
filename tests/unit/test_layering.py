"""The tree tells the data flow: the import graph of drmas/ read from the source (ast).

- No import cycle between drmas's subpackages (and top-level modules): each one can be
  read, tested and replaced from below.
- Nothing outside drmas/launch/ imports it: the launcher starts processes, it is no
  library the processes lean on.
- drmas/protocol imports nothing of drmas; drmas/config imports nothing but itself.
- No module over 500 lines, no function over 60.

Imports under `if TYPE_CHECKING:` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from collections import Counter, defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "drmas"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _runtime_imports(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute names of the drmas modules imported at run time (any depth, lazily too)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(base)
            found.extend(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [name for name in found if name == "drmas" or name.startswith("drmas.")]


def _unit(name: str) -> str:
    """drmas.broker.state -> broker; drmas.plugins -> plugins."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "drmas"


def _graph() -> dict[str, dict[str, set[str]]]:
    """unit -> imported unit -> the files that import it."""
    modules = _modules()
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for imported in _runtime_imports(tree, name, path.name == "__init__.py"):
            src, dst = _unit(name), _unit(imported)
            if src != dst and dst != "drmas":
                edges[src][dst].add(str(path.relative_to(PACKAGE.parent)))
    return edges


def _cycles(edges: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(edges):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycle_between_subpackages() -> None:
    edges = _graph()
    problems = []
    for component in _cycles(edges):
        lines = [
            f"  {a} -> {b}: {', '.join(sorted(edges[a][b]))}"
            for a in component
            for b in component
            if b in edges.get(a, {})
        ]
        problems.append(f"cycle {component}:\n" + "\n".join(lines))
    assert not problems, "\n".join(problems)


def test_nothing_outside_launch_imports_it() -> None:
    users = {src: files for src, dsts in _graph().items() for dst, files in dsts.items()
             if dst == "launch" and src != "launch"}  # fmt: skip
    assert not users, f"drmas.launch imported from {users}"


@pytest.mark.parametrize(("unit", "allowed"), [("protocol", set()), ("config", set())])
def test_ground_floor_imports_nothing_above_it(unit: str, allowed: set[str]) -> None:
    imported = set(_graph().get(unit, {}))
    assert imported <= allowed, f"drmas.{unit} imports {sorted(imported - allowed)}"


def test_modules_and_functions_stay_small() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        if (lines := text.count("\n")) > MAX_MODULE_LINES:
            too_long.append(f"{where}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)


def test_the_graph_reader_sees_what_it_should(tmp_path: Path) -> None:
    """The checks above can fail: relative, lazy and TYPE_CHECKING imports are read right."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import state\n"
        "from ..protocol import messages\n"
        "if TYPE_CHECKING:\n"
        "    from drmas.launch import cli\n"
        "def f():\n"
        "    import drmas.teams.base\n"
    )
    found = _runtime_imports(ast.parse(source), "drmas.broker.server", is_package=False)
    assert "drmas.broker.state" in found and "drmas.protocol.messages" in found
    assert "drmas.teams.base" in found
    assert not [n for n in found if n.startswith("drmas.launch")]
    edges = {"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}, "d": {"a": {"w"}}}
    assert _cycles(edges) == [["a", "b", "c"]]  # type: ignore[arg-type]


def test_test_files_have_unique_names() -> None:
    """pytest imports test files by their base name (the tests folders are not packages
    of their own), so two test_x.py in different folders stop the whole run at collection
    with "import file mismatch"."""
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []

"""No import circle in ekit_core or ekit_runtime: each module imports only modules below it.

The graph is read from the source (the AST), not from ``sys.modules``, so an
import that runs late still counts: module-level imports, function-local
ones and those under ``if TYPE_CHECKING:`` alike, and
``importlib.import_module("a.constant")``. ``from package import name``
names the submodule ``package.name`` when there is one, else the package's
``__init__``; ``import a.b`` names ``a.b`` (the parents it runs first are
not edges, or every submodule would close a loop with its package).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from itertools import pairwise
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "ekit_core").is_dir())
PACKAGES = ("ekit_core", "ekit_runtime")

Graph = dict[str, dict[str, int]]
"""module -> {module it imports: the line of the first such import}."""


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``: dotted name (a package by its own name) -> file."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imported(node: ast.AST, here: str, is_package: bool) -> Iterator[tuple[str, tuple[str, ...]]]:
    """What one node imports: (module, the names taken from it) pairs, dotted and absolute."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, ()
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = here.split(".") if is_package else here.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        yield base, tuple(alias.name for alias in node.names)
    elif (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module" and node.args
        and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
    ):
        yield node.args[0].value, ()


def _target(name: str, known: Mapping[str, Path]) -> str | None:
    """The module of ours ``name`` names: itself, or its longest known prefix; ``None``: not ours."""
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else None


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> Graph:
    """Who imports whom among the modules of ``packages``, wherever in a file the import is."""
    known = modules(root, packages)
    graph: Graph = {name: {} for name in known}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for module, names in _imported(node, name, is_package):
                targets = [f"{module}.{n}" if f"{module}.{n}" in known else module for n in names]
                for target in map(lambda t: _target(t, known), targets or [module]):
                    if target is not None and target != name:
                        graph[name].setdefault(target, getattr(node, "lineno", 0))
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth: the longest import path, a few dozen
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def loop_in(graph: Graph, part: list[str]) -> list[str]:
    """One loop through the circle ``part``, as ``a:line -> b:line -> ... -> a`` steps."""
    members = set(part)
    start = part[0]
    path, seen = [start], {start}
    while True:  # every module of a circle has an edge to another of it: walk until one repeats
        step = next(w for w in sorted(graph[path[-1]]) if w in members)
        if step in seen:
            loop = [*path[path.index(step):], step]
            return [*(f"{a} (line {graph[a][b]})" for a, b in pairwise(loop)), step]
        path.append(step)
        seen.add(step)


def describe(graph: Graph) -> list[str]:
    """Each circle of ``graph``, named, with one loop through it."""
    return [
        f"circle of {len(part)}: {', '.join(part)}; e.g. " + " -> ".join(loop_in(graph, part))
        for part in circles(graph)
    ]


def test_ekit_core_and_ekit_runtime_have_no_import_circle() -> None:
    # No circle is kept by name: the last (the PostgreSQL queue and its loop
    # session) was parted by moving what both run into queue/postgres_sql.py.
    assert describe(import_graph()) == []


FLOOR_ROW = re.compile(r"^\| (\d+) \| (.*?) \|", re.M)


def documented_floors(page: Path = ROOT / "docs" / "architecture.md") -> dict[str, int]:
    """The floor docs/architecture.md gives each ``ekit_core`` module (``ekit_core`` itself: its face)."""
    floors: dict[str, int] = {}
    for floor, cell in FLOOR_ROW.findall(page.read_text(encoding="utf-8")):
        for name in re.findall(r"`([\w.]+)`", cell):
            floors[name if name == "ekit_core" else f"ekit_core.{name}"] = int(floor)
    return floors


def test_the_documented_floors_are_the_code_s() -> None:
    graph = import_graph()
    floors = documented_floors()
    assert sorted(floors) == sorted(m for m in graph if m.startswith("ekit_core"))
    upward = [f"{m} (floor {floors[m]}) imports {t} (floor {floors[t]})"
              for m in floors for t in graph[m] if t in floors and floors[t] > floors[m]]
    assert upward == []


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def test_a_circle_closed_late_is_found_and_named(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg.b import B\nA = 1\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\nB = 2\n",
        "pkg/c.py": "def f():\n    from . import a\n    return a\nC = 3\n",
        "pkg/d.py": "import pkg.a\nfrom pkg import e\n",
        "pkg/e.py": "X = 0\n",
    })
    graph = import_graph(root, ("pkg",))
    assert graph["pkg.c"] == {"pkg.a": 2}  # function-local, relative, "from . import submodule"
    assert graph["pkg.d"] == {"pkg.a": 1, "pkg.e": 2}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert describe(graph) == [
        "circle of 3: pkg.a, pkg.b, pkg.c; e.g. pkg.a (line 1) -> pkg.b (line 3) -> pkg.c (line 2) -> pkg.a"
    ]


def test_a_name_taken_from_a_package_ties_to_its_init(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "pkg/__init__.py": "from pkg.low import helper\nVERSION = 1\n",
        "pkg/low.py": "import importlib\n\ndef helper():\n    from pkg import VERSION\n    return VERSION\n",
        "pkg/late.py": "import importlib\nmod = importlib.import_module('pkg.low')\n",
    })
    graph = import_graph(root, ("pkg",))
    assert graph["pkg.late"] == {"pkg.low": 2}
    assert circles(graph) == [["pkg", "pkg.low"]]

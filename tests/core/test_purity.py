"""ekit_core stays pure: no module of it imports I/O, time, randomness or the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import ekit_core

FORBIDDEN = {
    "asyncio", "os", "io", "time", "random", "threading", "logging", "pathlib",
    "socket", "sqlite3", "subprocess", "ekit_runtime", "multiprocessing", "concurrent",
    "shutil", "tempfile", "signal", "datetime", "uuid", "secrets", "pickle", "marshal",
    "importlib",  # a module named at run time could be any of the above, or the runtime
}


def _imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            roots.add("__import__")
    return roots


def test_core_imports_nothing_impure() -> None:
    package = Path(ekit_core.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert files, "no core modules found"
    offenders = {
        str(f.relative_to(package)): sorted(_imported_roots(f) & (FORBIDDEN | {"__import__"}))
        for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_scanner_catches_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os.path\nfrom asyncio import sleep\nfrom . import x\n")
    assert _imported_roots(module) & FORBIDDEN == {"os", "asyncio"}


def test_packages_ship_py_typed() -> None:
    import ekit_runtime

    for package in (ekit_core, ekit_runtime):
        assert (Path(package.__file__).parent / "py.typed").is_file()


def test_no_module_can_execute_what_it_loads() -> None:
    """Loading a checkpoint never executes code: no pickle, marshal, shelve, eval or exec."""
    import ekit_runtime

    risky_modules = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
    offenders: dict[str, list[str]] = {}
    for package in (ekit_core, ekit_runtime):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            found = sorted(_imported_roots(path) & risky_modules)
            found += [
                node.func.id
                for node in ast.walk(tree)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"eval", "exec"}
            ]
            if found:
                offenders[str(path.relative_to(root.parent))] = found
    assert offenders == {}


def test_events_and_results_are_frozen() -> None:
    import dataclasses

    from ekit_core import StepFinished, Succeeded, TokenUsage

    event = StepFinished("a", 1, TokenUsage(), None)
    result = Succeeded("a", 1)
    for value in (event, result):
        try:
            value.name = "b"  # type: ignore[misc]
        except dataclasses.FrozenInstanceError:
            continue
        raise AssertionError(f"{type(value).__name__} is mutable")

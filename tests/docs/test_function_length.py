"""No function in the two packages is longer than 60 lines (the style guide's limit).

Long functions hide rules; this keeps each rule in a function short enough to
read at once. Lines are counted from the ``def`` to the last line of the body.
"""

from __future__ import annotations

import ast
from pathlib import Path

LIMIT = 60
ROOT = Path(__file__).resolve().parents[2]


def long_functions() -> list[str]:
    found = []
    for package in ("ekit_core", "ekit_runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > LIMIT:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length})")
    return found


def test_no_function_is_longer_than_the_limit() -> None:
    assert long_functions() == []


CORE_LIMIT = 50  # the core, where the scheduling rules live, is held to a tighter limit
CORE_PARAMETERS = 6


def core_functions_over_the_limits() -> list[str]:
    found = []
    for path in sorted((ROOT / "ekit_core").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > CORE_LIMIT:
                found.append(f"{where} ({length} lines)")
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            count -= bool(args.args and args.args[0].arg in ("self", "cls"))
            if node.name.startswith("_") and not node.name.startswith("__") and count > CORE_PARAMETERS:
                found.append(f"{where} ({count} parameters)")
    return found


def test_no_core_function_is_over_50_lines_nor_a_private_one_over_6_parameters() -> None:
    assert core_functions_over_the_limits() == []

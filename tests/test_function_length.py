"""No function in the two packages is longer than 60 lines (the style guide's limit).

Long functions hide rules; this keeps each rule in a function short enough to
read at once. Lines are counted from the ``def`` to the last line of the body.
"""

from __future__ import annotations

import ast
from pathlib import Path

LIMIT = 60
ROOT = Path(__file__).resolve().parent.parent


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

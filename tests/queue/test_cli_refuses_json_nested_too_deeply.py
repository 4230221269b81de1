"""JSON given to ``ekit queue`` that nests too deeply to read is the user's input error, not a bug.

``json.loads`` raises ``RecursionError`` (no ``ValueError``) past Python's
recursion limit, so ``--context``, ``--options``, ``--option KEY=VALUE`` and
``answer``'s VALUE_JSON of 3,000 ``[`` printed "ekit: internal error:
RecursionError ...", which the CLI reserves for its own bugs. Each now says
which argument is nested too deeply, and nothing is submitted or answered.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_runtime.cli import main
from ekit_runtime.queue import SqliteQueue

DEEP = "[" * 3_000 + "]" * 3_000


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["submit", "w", "--context", DEEP], "--context"),
        (["submit", "w", "--options", DEEP], "--options"),
        (["submit", "w", "--option", f"only={DEEP}"], "--option only"),
        (["answer", "r", "s", DEEP], "VALUE_JSON"),
    ],
    ids=["context", "options", "option", "answer"],
)
def test_json_nested_too_deeply_is_an_input_error_naming_the_argument(
    argv: list[str], named: str, tmp_path: Any, capsys: Any
) -> None:
    path = str(tmp_path / "q.db")
    SqliteQueue(path).close()
    assert main(["queue", "--queue", path, *argv]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err
    assert named in err and "nested too deeply" in err
    queue = SqliteQueue(path)
    try:
        assert queue.runs() == []
    finally:
        queue.close()

"""An iteration that returns a ``Done`` (a subclass of it too) ends its loop.

The runner unwrapped any ``Done`` (``isinstance``) but ended the loop only for
``Done`` itself (``type(...) is``): an iteration returning a subclass had its
value recorded as an iteration that did not end, and the loop ran on to fail
at its cap, its end silently dropped.
"""

from __future__ import annotations

from typing import Any

from ekit_runtime import Done, Repeat, Step, Workflow


class Answer(Done):
    """A user's own kind of ending."""


def test_an_iteration_returning_a_done_subclass_ends_its_loop() -> None:
    calls: list[int] = []

    def agent(ctx: Any) -> Any:
        n = ctx["agent"].number
        calls.append(n)
        return Answer(f"answer {n}") if n == 2 else n

    result = Workflow([Step("agent", agent, repeat=Repeat(5))]).run_sync()
    assert calls == [1, 2]
    assert result.outputs["agent"] == "answer 2"

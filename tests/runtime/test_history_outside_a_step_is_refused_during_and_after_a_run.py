"""``history()`` outside a step is refused while a loop runs and after it, in the driver's task.

The runner sets what an attempt may read in its own context as the attempt's task is made
and resets it at once (the task keeps its copy). Code of the driver's task itself, a
``checkpoint_fn`` called between attempts or the caller once ``run()`` returned, must still
get the ``LookupError`` the docs promise, never the history of the attempt started last.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ekit_runtime import Done, Repeat, Step, Workflow, history


def _refused() -> str:
    try:
        history("agent")
    except LookupError as exc:
        return str(exc)
    return "read"


def test_the_driver_task_reads_no_history_during_or_after_the_run() -> None:
    async def turn(context: Any) -> Any:
        number = context["agent"].number
        assert len(history("agent")) == number - 1  # (inside: the iterations before it)
        return Done(number) if number == 4 else number

    async def drive() -> tuple[list[str], str, Any]:
        during: list[str] = []
        result = await Workflow([Step("agent", turn, repeat=Repeat(6))]).run(
            checkpoint_fn=lambda cp: during.append(_refused()))
        return during, _refused(), result.outputs["agent"]

    during, after, output = asyncio.run(drive())
    assert output == 4
    assert during and all("is only set inside a step" in said for said in during)
    assert "is only set inside a step" in after


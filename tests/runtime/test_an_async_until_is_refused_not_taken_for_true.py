"""A loop's ``until`` is a plain call: an ``async def`` one is refused by name.

Called, an ``async def`` condition returns a coroutine, which is truthy: the
loop ended after its first iteration whatever the output (a silent
truncation; only a "never awaited" warning told). Refused where the
``Repeat`` is made; and an ``until`` that returns an awaitable anyway (a
lambda around one) fails the attempt naming the field, never ends the loop.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest

from ekit_runtime import Repeat, Step, Workflow


async def _at_least_three(output: int) -> bool:
    return output >= 3


def test_an_async_def_until_is_refused_where_the_repeat_is_made() -> None:
    with pytest.raises(ValueError, match=r"Repeat\.until"):
        Repeat(5, until=_at_least_three)


def test_an_until_returning_an_awaitable_fails_the_attempt_and_never_ends_the_loop() -> None:
    calls: list[int] = []

    def agent(ctx: Any) -> int:
        calls.append(ctx["agent"].number)
        return int(ctx["agent"].number)

    def until(output: int) -> Any:
        return asyncio.sleep(0, output >= 3)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no coroutine left unawaited)
        with pytest.raises(TypeError, match=r"until"):
            Workflow([Step("agent", agent, repeat=Repeat(5, until=until))]).run_sync()
    assert calls == [1]

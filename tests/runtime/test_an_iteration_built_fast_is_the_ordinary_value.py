"""What an iteration finds under its loop's name is an ordinary ``Iteration``.

The runner builds it through ``loops.iteration`` (its slots set directly, not through the
frozen ``__init__``: a speed trick, see there). The value a step sees must be the one the
docs promise: equal to ``Iteration(number, previous)``, hashed alike, and as immutable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_runtime import Done, Iteration, Repeat, Step, Workflow
from ekit_runtime.loops import iteration


@given(number=st.integers(1, 10**6), previous=st.one_of(st.none(), st.integers(), st.text(max_size=5)))
def test_the_fast_iteration_equals_the_ordinary_one(number: int, previous: Any) -> None:
    fast, ordinary = iteration(number, previous), Iteration(number, previous)
    assert type(fast) is Iteration
    assert fast == ordinary and hash(fast) == hash(ordinary) and repr(fast) == repr(ordinary)
    assert (fast.number, fast.previous) == (number, previous)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.number = number + 1  # type: ignore[misc]
    assert dataclasses.replace(fast, previous="x") == Iteration(number, "x")


def test_each_iteration_sees_its_number_and_the_output_before_it() -> None:
    seen: list[Iteration] = []

    async def turn(context: Any) -> Any:
        it = context["agent"]
        seen.append(it)
        return Done(it.number * 10) if it.number == 3 else it.number * 10

    # (An async iteration without until: the runner's fast path, its coroutine the task.)
    result = asyncio.run(Workflow([Step("agent", turn, repeat=Repeat(5))]).run())
    assert result.outputs["agent"] == 30
    assert seen == [Iteration(1, None), Iteration(2, 10), Iteration(3, 20)]
    assert all(type(it) is Iteration for it in seen)

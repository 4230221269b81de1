"""A loop cannot opt into the cross-run cache yet: refused by name when the step is made.

A cache hit hands back an iteration's output but not its decision to end the
loop (``Done``, ``until``), so a cached loop would run on to its cap, paying
nothing and ending in a ``LoopError``. Until hits carry that decision, the
combination is refused before anything runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_runtime import Done, Repeat, Step


def _turn(ctx: Any) -> Any:
    return Done(ctx["agent"].number)


def test_a_cached_loop_is_refused_naming_the_step() -> None:
    with pytest.raises(ValueError, match=r"step 'agent'.*cache=True.*loop"):
        Step("agent", _turn, repeat=Repeat(max_iterations=3), cache=True)


def test_a_loop_without_the_cache_and_a_cached_plain_step_are_made() -> None:
    assert Step("agent", _turn, repeat=Repeat(max_iterations=3)).repeat == Repeat(max_iterations=3)
    assert Step("draft", _turn, cache=True).cache is True

"""Loops in the shell: how a step declares one, what an iteration sees, how it says it is done.

The core owns a loop (see :mod:`ekit_core.shapes`, ``repeat``, and the
rules in :mod:`ekit_core.transitions`): iteration ``k`` of step ``agent`` is
a step of the running graph of its own, ``agent#k``, grown once ``agent#(k-1)``
is recorded. This module holds what a user writes:

- :class:`Repeat`, given as ``Step(..., repeat=Repeat(max_iterations=20))``;
- :class:`Iteration`, what an iteration finds in its context under the
  loop's own name: its number and the previous iteration's output;
- :class:`Done`, what an iteration returns to end its loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Done", "Iteration", "Repeat"]


@dataclass(frozen=True, slots=True)
class Repeat:
    """A step that repeats: one iteration at a time, until one says it is done.

    ``max_iterations`` caps the loop: an iteration at the cap that does not
    end it fails the step (``LoopError``, naming it), never a hang or a
    silent truncation. An iteration ends the loop by returning
    :class:`Done`, or when ``until(output)`` holds for its output (a plain
    call, asked once per iteration in the iteration's attempt; one that
    raises fails that attempt). ``keep_last`` lets the run's checkpoints keep
    the outputs of the last ``keep_last`` iterations only: older ones are
    compacted (dropped and counted), so a long loop's checkpoint stays
    bounded. ``max_iterations`` and ``keep_last`` are in the graph's
    fingerprint; ``until`` is code, and is not.
    """

    max_iterations: int
    until: Callable[[Any], Any] | None = None
    keep_last: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_iterations", "keep_last"):
            value = getattr(self, name)
            if value is None and name == "keep_last":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Repeat.{name} must be an int >= 1, got {value!r:.80}")
        if self.until is not None and not callable(self.until):
            raise ValueError(f"Repeat.until must be callable or None, got {type(self.until).__name__}")
        if inspect.iscoroutinefunction(self.until):  # (its coroutine is truthy: it would end at once)
            raise ValueError("Repeat.until must be a plain call, not async def: ask in the "
                             "iteration, and return Done(value) there")


@dataclass(frozen=True, slots=True)
class Iteration:
    """What iteration ``number`` (from 1) of a loop sees under the loop's own name in its
    context: ``previous`` is the output of the iteration before it (the state the loop
    carries), ``None`` for the first."""

    number: int
    previous: Any = None


@dataclass(frozen=True, slots=True)
class Done:
    """Returned by an iteration: ``value`` is its output, and its loop ends with it.

    ``value`` may be anything a step returns (a ``PatternResult`` carries its usage).
    """

    value: Any

"""Loops in the shell: how a step declares one, what an iteration sees, how it says it is done.

The core owns a loop (see :mod:`ekit_core.shapes`, ``repeat``, and the
rules in :mod:`ekit_core.transitions`): iteration ``k`` of step ``agent`` is
a step of the running graph of its own, ``agent#k``, grown once ``agent#(k-1)``
is recorded. This module holds what a user writes:

- :class:`Repeat`, given as ``Step(..., repeat=Repeat(max_iterations=20))``;
- :class:`Iteration`, what an iteration finds in its context under the
  loop's own name: its number and the previous iteration's output;
- :class:`Done`, what an iteration returns to end its loop;
- :func:`history`, called inside a step that needs a loop (or inside an
  iteration of it): the loop's recorded iterations, as a :class:`History`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from ekit_core.shapes import iteration_name

if TYPE_CHECKING:
    from ekit_core.state import State

__all__ = ["Done", "History", "HistoryError", "Iteration", "Repeat", "history"]


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


_new = object.__new__
_SET_NUMBER = Iteration.__dict__["number"].__set__
_SET_PREVIOUS = Iteration.__dict__["previous"].__set__


def iteration(number: int, previous: Any) -> Iteration:
    """``Iteration(number, previous)``, as the runner builds one for every iteration: its
    fields set through their slots' own setters, not the frozen ``__init__`` (a call, and
    ``object.__setattr__`` looked up and called per field: about 2k instructions an
    iteration more, measured on the loop benchmark). The same value, as immutable."""
    made: Iteration = _new(Iteration)
    _SET_NUMBER(made, number)
    _SET_PREVIOUS(made, previous)
    return made


@dataclass(frozen=True, slots=True)
class Done:
    """Returned by an iteration: ``value`` is its output, and its loop ends with it.

    ``value`` may be anything a step returns (a ``PatternResult`` carries its usage).
    """

    value: Any


class HistoryError(LookupError):
    """An iteration :func:`history` cannot hand back: compacted by ``keep_last`` (its output
    was let go of), or not recorded. ``loop`` and ``iteration`` name it (``loop#iteration``)."""

    def __init__(self, loop: str, iteration: int, message: str) -> None:
        super().__init__(message)
        self.loop, self.iteration = loop, iteration

    def __str__(self) -> str:  # (a KeyError would quote it)
        return str(self.args[0])


@dataclass(frozen=True, slots=True)
class History:
    """A loop's recorded iterations, as a step that needs the loop (or an iteration of it)
    sees them: iterations ``1`` to ``len(history)``, of which the first ``compacted`` were
    let go of by ``keep_last`` and the rest are ``kept`` (iteration ``compacted + 1`` first).

    ``history[k]`` is iteration ``k``'s output (from 1, as ``Iteration.number``); one
    compacted or not recorded raises :class:`HistoryError` naming ``loop#k``.
    ``items()`` yields ``(k, output)`` for the kept ones, oldest first.
    """

    loop: str
    compacted: int
    kept: tuple[Any, ...]

    def __len__(self) -> int:
        return self.compacted + len(self.kept)

    def __getitem__(self, k: int) -> Any:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"history of loop {self.loop!r}: an iteration is an int from 1, "
                            f"got {type(k).__name__}")
        name, last = iteration_name(self.loop, k), len(self)
        if 1 <= k <= self.compacted:
            raise HistoryError(self.loop, k, (
                f"{name}: iteration {k} of loop {self.loop!r} was compacted (keep_last): its "
                f"output was let go of; kept are iterations {self.compacted + 1} to {last}"))
        if self.compacted < k <= last:
            return self.kept[k - self.compacted - 1]
        recorded = f"1 to {last}" if last else "none yet"
        raise HistoryError(self.loop, k, f"{name}: loop {self.loop!r} has no iteration {k} "
                                         f"recorded (recorded: {recorded})")

    def items(self) -> Iterator[tuple[int, Any]]:
        """``(k, output)`` of each kept iteration, oldest first."""
        return enumerate(self.kept, self.compacted + 1)


_Reading: TypeAlias = "tuple[str, tuple[str, ...], str | None, State]"
"""What the attempt running in this context may read: its name, its step's dependencies,
the loop it is an iteration of (if it is one), and the run's state as it started. A plain
tuple, the loops it may read worked out by :func:`history` when asked (:func:`_readable`):
set once per attempt of a run with loops, a frozen dataclass and its loops worked out up
front cost an iteration about 4k instructions."""

READING: ContextVar[_Reading] = ContextVar("ekit_loop_history")
"""What the attempt about to start may read with :func:`history` (perhaps no loop: it is then
told so by name): the runner sets it in a run that has loops, as an attempt starts, and resets
it once the attempt's task is made (the task keeps its own copy). Set and reset by the runner
itself, not through functions of this module: two Python calls an iteration (about 1k
instructions, measured on the loop benchmark)."""


def _readable(needs: tuple[str, ...], loop: str | None, state: State) -> tuple[str, ...]:
    """The loops an attempt may read: those its step needs, and the one it is an iteration of."""
    shapes = state.spec.declared_graph.shapes
    readable = tuple(d for d in needs if (shape := shapes.get(d)) is not None and shape.repeat is not None)
    return readable if loop is None else (*readable, loop)


def history(loop: str) -> History:
    """The recorded iterations of ``loop``, read inside a step that needs it (all of them,
    the loop having ended) or inside one of its iterations (those before it).

    Iterations ``keep_last`` compacted are counted, not kept: indexing one raises
    :class:`HistoryError` naming it. A step that does not need ``loop``, or code outside a
    step of a run, gets a ``LookupError`` naming them. Read in the step's own process
    (the default executor, its threads, inline), as :func:`~ekit_runtime.ask` is.
    """
    reading = READING.get(None)
    if reading is None:
        raise LookupError(f"history({loop!r}) is only set inside a step that needs the loop "
                          f"{loop!r}, or inside an iteration of it, in the run's own process")
    unit, needs, own, state = reading
    readable = _readable(needs, own, state)
    if loop not in readable:
        named = ", ".join(map(repr, readable)) or "none"
        raise LookupError(f"step {unit!r} cannot read the history of {loop!r}: it is "
                          f"no loop the step needs (loops it needs: {named})")
    shaped = state.spec.shaped
    compacted = shaped.compacted.get(loop, 0) if shaped is not None else 0
    outputs, kept = state.outputs, []
    k = compacted + 1
    shape = state.spec.declared_graph.shapes.get(loop)
    exit_step = loop if shape is None or shape.child is None else shape.child  # (a body's output)
    while (name := iteration_name(exit_step, k)) in outputs:
        kept.append(outputs[name])
        k += 1
    return History(loop, compacted, tuple(kept))

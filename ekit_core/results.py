"""What ``apply`` folds into a state, the inputs of the state machine, and what ``plan`` returns.

Each is a small frozen value. ``Start`` is what ``plan`` returns, in a
:class:`Batch`; the shell hands it back to ``apply`` once it has launched
the attempt. ``Began`` says
that an attempt which first had to wait (a retry delay, an approval) has
begun its work. ``Succeeded``, ``Failed``, ``Denied``, ``Interrupted`` and ``Asked``
say how an attempt ended; ``Skipped`` that it did not run, its step's
condition being false; ``Cancelled`` that the whole run is being cancelled.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ekit_core._frozen import twin
from ekit_core.exchanges import Question
from ekit_core.usage import NO_USAGE, TokenUsage

__all__ = [
    "APPROVAL",
    "CONDITION",
    "DELAY",
    "Ended",
    "Asked",
    "AttemptEnd",
    "AttemptOutcome",
    "Batch",
    "Began",
    "Cancelled",
    "Denied",
    "Failed",
    "Gate",
    "HeldSucceeded",
    "Input",
    "Interrupted",
    "Skipped",
    "Start",
    "Succeeded",
    "batch",
    "first_start",
    "succeeded",
]


Gate: TypeAlias = Literal["delay", "condition", "approval"]
"""What an attempt may do before its work begins (see :attr:`Start.gates`)."""

DELAY: Gate = "delay"
"""Wait out ``Start.delay`` seconds (a retry's backoff)."""
CONDITION: Gate = "condition"
"""Ask the step's condition: false, the attempt ends :class:`Skipped`; raising, :class:`Failed`."""
APPROVAL: Gate = "approval"
"""Ask the run's approval callback: refused, the attempt ends :class:`Denied`."""

_ORDER: tuple[Gate, ...] = (DELAY, CONDITION, APPROVAL)
# Every combination's gates, in the one order: built once, read by index.
_GATES: dict[tuple[bool, bool, bool], tuple[Gate, ...]] = {
    (d, c, a): tuple(g for g, on in zip(_ORDER, (d, c, a), strict=True) if on)
    for d in (False, True) for c in (False, True) for a in (False, True)
}


@dataclass(frozen=True, slots=True)
class Start:
    """Start attempt ``attempt`` of step ``name``.

    What the attempt does before its work begins is :attr:`gates`, in order,
    which the shell follows literally: it waits ``delay`` seconds (a retry's
    backoff), then, if ``condition`` is true, asks its step's condition
    (:mod:`ekit_core.shapes`), then, if ``approval`` is true, asks the run's
    approval callback; an attempt with a gate reports :class:`Began` when its
    work begins, and one that its condition skips never begins.
    """

    name: str
    attempt: int = 1
    delay: float = 0.0
    approval: bool = False
    condition: bool = False

    @property
    def gated(self) -> bool:
        """Whether the attempt waits (delay, condition or approval) before its work begins."""
        return self.delay > 0 or self.approval or self.condition

    @property
    def gates(self) -> tuple[Gate, ...]:
        """What the attempt does before its work begins, in the order to do it: some of
        :data:`DELAY`, :data:`CONDITION`, :data:`APPROVAL`. Empty: its work begins at once.

        The core decides (:func:`~ekit_core.plan`) which an attempt has: a retry's
        delay; its step's condition and the run's approval on a first attempt, and
        again after one that raised before they answered (``Setbacks.unanswered``).
        """
        return _GATES[self.delay > 0, self.condition, self.approval]


@dataclass(frozen=True, slots=True)
class Batch:
    """What the shell does next: ``starts`` in declaration order, and ``withdraw``.

    ``withdraw`` names gated attempts of a halted run (still waiting out a
    retry delay or an approval): the shell cancels them and reports each as
    :class:`Interrupted`.
    """

    starts: tuple[Start, ...] = ()
    withdraw: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.starts)

    def __iter__(self) -> Iterator[Start]:
        return iter(self.starts)

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the steps to start."""
        return tuple(s.name for s in self.starts)


@dataclass(frozen=True, slots=True)
class Began:
    """The gated attempt of step ``name`` finished waiting and began its work."""

    name: str


@dataclass(frozen=True, slots=True)
class Succeeded:
    """Step ``name`` returned ``output`` having spent ``usage``.

    ``duration`` is the seconds the attempt took and ``began`` when it began
    (UTC epoch seconds), both the shell's clocks: the core records them in
    the checkpoint when the run records durations.
    """

    name: str
    output: Any
    usage: TokenUsage = NO_USAGE
    duration: float | None = None
    began: float | None = None


@dataclass(frozen=True, slots=True)
class HeldSucceeded(Succeeded):
    """A :class:`Succeeded` whose attempt a limit held before it began.

    ``held`` names each limit that held it (``"max_concurrency"``,
    ``"resource:gpu"``, ``"limit:tokens_per_minute"``, ``"retry_delay"``) with
    the seconds it did, in the order they held it. Folded as a success; a run
    that records durations also records the holds beside ``began`` (the
    checkpoint's ``held``). A class of its own, not a field of every success:
    the usual attempt, which nothing held, costs nothing more.
    """

    held: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Ended(Succeeded):
    """Iteration ``name`` of a loop (``step#k``) returned ``output`` and says its loop is done.

    A :class:`Succeeded` in every other way: the iteration's output and usage
    are recorded, and the loop step records that output as its own in the
    same transition (no iteration ``k+1`` is grown). The shell reports it when
    the body returned ``Done(value)`` or the loop's ``until`` held.
    """


@dataclass(frozen=True, slots=True)
class Failed:
    """Step ``name`` raised ``error`` (a timeout is a ``TimeoutError``).

    ``retry_after`` is the wait in seconds the failure asked for, if any (an
    HTTP ``Retry-After``, read by the shell: see
    :func:`ekit_runtime.retry_after`): a retry waits at least that long, and
    one asked for longer than the policy's ``max_retry_after`` is not made.

    ``gate`` is the gate whose call raised (:data:`CONDITION` or
    :data:`APPROVAL`), for an attempt that failed before its work began; the
    gates before it answered. After an approval that raised, the retry asks
    the approval again, not the condition, which had held.
    """

    name: str
    error: BaseException
    duration: float | None = None
    retry_after: float | None = None
    gate: Gate | None = None
    # When the attempt began (UTC epoch seconds, the shell's clock): the
    # failure record keeps it, with when it ended, when durations are recorded.
    began: float | None = None


@dataclass(frozen=True, slots=True)
class Denied:
    """The approval callback refused step ``name`` for ``reason``."""

    name: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Interrupted:
    """The in-flight attempt of step ``name`` was cancelled before it finished."""

    name: str


@dataclass(frozen=True, slots=True)
class Asked:
    """The attempt of step ``name`` asked ``question``, which has no answer recorded.

    The step waits (neither failed nor done: no retry, nothing that needs
    it starts) until an answer is recorded; see :mod:`ekit_core.human`.
    """

    name: str
    question: Question


@dataclass(frozen=True, slots=True)
class Skipped:
    """Step ``name``'s condition was false: it is skipped, for ``reason``, and never runs."""

    name: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The run is being cancelled: start nothing more."""

    reason: str = "cancelled"


AttemptEnd: TypeAlias = Succeeded | Failed | Denied | Interrupted | Asked
"""How one attempt of a step ended (a run's *outcome* is how the whole run ended)."""

AttemptOutcome: TypeAlias = AttemptEnd
"""The former name of :data:`AttemptEnd`, kept for old imports."""

Input: TypeAlias = (
    Start | Began | Succeeded | Ended | Failed | Denied | Interrupted | Asked | Skipped | Cancelled
)
"""Anything :func:`~ekit_core.apply` folds into a state."""


# -- built fast (see ekit_core._frozen): once per step each ---------------------------

_SucceededTwin = twin(Succeeded)
_StartTwin = twin(Start)
_BatchTwin = twin(Batch)


def succeeded(name: str, output: Any, usage: TokenUsage, duration: float | None,
              began: float | None = None) -> Succeeded:
    """``Succeeded(name, output, usage, duration, began)``: what the shell reports when a
    step returns."""
    value = _SucceededTwin()
    value.name = name
    value.output = output
    value.usage = usage
    value.duration = duration
    value.began = began
    value.__class__ = Succeeded
    made: Succeeded = value  # (not typing.cast: a Python call per value built; see _frozen)
    return made


def first_start(name: str) -> Start:
    """``Start(name)``: a plain first attempt (no delay, no condition, no approval)."""
    value = _StartTwin()
    value.name = name
    value.attempt = 1
    value.delay = 0.0
    value.approval = False
    value.condition = False
    value.__class__ = Start
    made: Start = value  # (not typing.cast: a Python call per value built; see _frozen)
    return made


def batch(starts: tuple[Start, ...]) -> Batch:
    """``Batch(starts)``: starts, and no gated attempt to withdraw."""
    value = _BatchTwin()
    value.starts = starts
    value.withdraw = ()
    value.__class__ = Batch
    made: Batch = value  # (not typing.cast: a Python call per value built; see _frozen)
    return made

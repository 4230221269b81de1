"""What ``apply`` folds into a state: the inputs of the state machine.

Each is a small frozen value. ``Start`` is what ``plan`` returns; the shell
hands it back to ``apply`` once it has launched the attempt. ``Began`` says
that an attempt which first had to wait (a retry delay, an approval) has
begun its work. ``Succeeded``, ``Failed``, ``Denied`` and ``Interrupted``
say how an attempt ended; ``Skipped`` that it did not run, its step's
condition being false; ``Cancelled`` that the whole run is being cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from ekit_core._fast import twin
from ekit_core.usage import NO_USAGE, TokenUsage

__all__ = [
    "AttemptEnd",
    "AttemptOutcome",
    "Began",
    "Cancelled",
    "Denied",
    "Failed",
    "Input",
    "Interrupted",
    "Skipped",
    "Start",
    "Succeeded",
    "first_start",
    "succeeded",
]


@dataclass(frozen=True, slots=True)
class Start:
    """Start attempt ``attempt`` of step ``name``.

    The attempt first waits ``delay`` seconds (a retry's backoff), then, if
    ``approval`` is true, asks the run's approval callback; an attempt that
    does either reports :class:`Began` when its work begins.
    """

    name: str
    attempt: int = 1
    delay: float = 0.0
    approval: bool = False

    @property
    def gated(self) -> bool:
        """Whether the attempt waits (delay or approval) before its work begins."""
        return self.delay > 0 or self.approval


@dataclass(frozen=True, slots=True)
class Began:
    """The gated attempt of step ``name`` finished waiting and began its work."""

    name: str


@dataclass(frozen=True, slots=True)
class Succeeded:
    """Step ``name`` returned ``output`` having spent ``usage``."""

    name: str
    output: Any
    usage: TokenUsage = NO_USAGE
    duration: float | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """Step ``name`` raised ``error`` (a timeout is a ``TimeoutError``)."""

    name: str
    error: BaseException
    duration: float | None = None


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
class Skipped:
    """Step ``name``'s condition was false: it is skipped, for ``reason``, and never runs."""

    name: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The run is being cancelled: start nothing more."""

    reason: str = "cancelled"


def succeeded(name: str, output: Any, usage: TokenUsage, duration: float | None) -> Succeeded:
    """``Succeeded(...)`` for the shell, one per step, built through a twin class.

    See :mod:`ekit_core._fast` for why; the value is the same.
    """
    value = _SucceededDraft()
    value.name = name
    value.output = output
    value.usage = usage
    value.duration = duration
    value.__class__ = Succeeded
    return cast(Succeeded, value)


_SucceededDraft = twin(Succeeded)


def first_start(name: str) -> Start:
    """``Start(name)``, a plain first attempt, built through a twin class (one per step)."""
    value = _StartDraft()
    value.name = name
    value.attempt = 1
    value.delay = 0.0
    value.approval = False
    value.__class__ = Start
    return cast(Start, value)


_StartDraft = twin(Start)

AttemptEnd: TypeAlias = Succeeded | Failed | Denied | Interrupted
"""How one attempt of a step ended (a run's *outcome* is how the whole run ended)."""

AttemptOutcome: TypeAlias = AttemptEnd
"""The former name of :data:`AttemptEnd`, kept for old imports."""

Input: TypeAlias = Start | Began | Succeeded | Failed | Denied | Interrupted | Skipped | Cancelled
"""Anything :func:`~ekit_core.apply` folds into a state."""

"""Trace events: what each transition did, as small frozen values.

``apply`` and ``initial_state`` record the events of a transition on the
state they return (``state.events``), so the same inputs always give the
same events. The shell forwards them to a ``trace`` callback, adding only
``CheckpointSaved``, the one thing that happens outside the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from ekit_core.usage import TokenUsage

__all__ = [
    "CheckpointSaved",
    "Event",
    "RunFinished",
    "RunStarted",
    "StepDenied",
    "StepFailed",
    "StepFinished",
    "StepInterrupted",
    "StepRetried",
    "StepSkipped",
    "StepStarted",
]


@dataclass(frozen=True, slots=True)
class RunStarted:
    """A run began: ``total`` steps, ``recorded`` of them already done by a checkpoint."""

    total: int
    recorded: int


@dataclass(frozen=True, slots=True)
class StepSkipped:
    """A resumed run skips ``name`` because the checkpoint records its output."""

    name: str


@dataclass(frozen=True, slots=True)
class StepStarted:
    """Attempt ``attempt`` of ``name`` was launched (after ``delay`` seconds of backoff)."""

    name: str
    attempt: int
    delay: float


@dataclass(frozen=True, slots=True)
class StepFinished:
    """``name`` succeeded on attempt ``attempt``."""

    name: str
    attempt: int
    usage: TokenUsage
    duration: float | None


@dataclass(frozen=True, slots=True)
class StepRetried:
    """Attempt ``attempt`` of ``name`` failed and the step will run again after ``delay``."""

    name: str
    attempt: int
    error_type: str
    message: str
    delay: float
    duration: float | None


@dataclass(frozen=True, slots=True)
class StepFailed:
    """``name`` failed on attempt ``attempt`` and will not be retried in this run."""

    name: str
    attempt: int
    error_type: str
    message: str
    duration: float | None


@dataclass(frozen=True, slots=True)
class StepDenied:
    """The approval callback refused ``name``."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepInterrupted:
    """The attempt of ``name`` in flight was cancelled; the step is not done."""

    name: str


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """The shell handed a checkpoint with ``step_index`` completed steps to ``checkpoint_fn``."""

    step_index: int


@dataclass(frozen=True, slots=True)
class RunFinished:
    """The run settled with ``outcome``.

    One of ``"finished"``, ``"failed"``, ``"budget_exceeded"``, ``"denied"``,
    ``"cancelled"``.
    """

    outcome: str
    completed: int
    total: int
    cost: TokenUsage


Event = (
    RunStarted
    | StepSkipped
    | StepStarted
    | StepFinished
    | StepRetried
    | StepFailed
    | StepDenied
    | StepInterrupted
    | CheckpointSaved
    | RunFinished
)

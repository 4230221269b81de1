"""Trace events: what each transition did, as small frozen values.

Words used here: a step *finished* when its output is recorded; the run is
*complete* when every output is; it has *settled* when nothing is in flight
and nothing more will start, with an *outcome* saying how it ended.

``apply`` and ``initial_state`` record the events of a transition on the
state they return (``state.events``), so the same inputs always give the
same events. The shell forwards them to a ``trace`` callback, adding only
``CheckpointSaved``, the one thing that happens outside the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from ekit_core.exchanges import Question
from ekit_core.usage import TokenUsage

Outcome: TypeAlias = Literal["finished", "failed", "budget_exceeded", "denied", "cancelled",
                             "waiting"]
"""How a run ended: every output recorded, the kind of halt that stopped it, or
``"waiting"``: nothing else could run while steps wait for a person's answer."""

__all__ = [
    "CheckpointSaved",
    "Outcome",
    "Event",
    "RunSettled",
    "RunStarted",
    "StepCacheHit",
    "StepDenied",
    "StepFailed",
    "StepFinished",
    "StepInterrupted",
    "StepOutdated",
    "StepPartial",
    "StepRetried",
    "StepSkipped",
    "StepStarted",
    "StepWaiting",
]


@dataclass(frozen=True, slots=True)
class RunStarted:
    """A run began: ``total`` steps, ``recorded`` of them recorded by a checkpoint and
    ``skipped`` of them skipped by a condition it records.

    Counted as :func:`ekit_core.progress.run_progress` counts the checkpoint:
    a resume's items (of mapped steps whose input is recorded) are in all
    three, so the expansions it announces (``StepExpanded`` with
    ``at_start``) are counted here already.
    """

    total: int
    recorded: int
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class StepSkipped:
    """Step ``name`` will not run: a resumed run found its output recorded
    (``reason`` is empty), or its condition was false, or it needs a step
    that was skipped so (``reason`` says which)."""

    name: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StepExpanded:
    """Mapped step ``name`` expanded into ``items`` items (``recorded`` of them recorded already).

    The run's total grows by ``items``: a progress display counts them from
    here. A loop announces each iteration it grows after its first as
    ``StepExpanded(loop, 1)``. A resume announces the expansions its recorded outputs make, with
    ``at_start``: those items are counted in ``RunStarted`` already.
    """

    name: str
    items: int
    recorded: int = 0
    at_start: bool = False


@dataclass(frozen=True, slots=True)
class StepOutdated:
    """A resumed run drops the recorded output of ``name`` and runs it again, for ``reason``.

    Its ``version`` tag changed, its dependencies changed, or it depends on
    a step that runs again for one of those reasons.
    """

    name: str
    reason: str


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
    """Attempt ``attempt`` of ``name`` failed and the step will run again after ``delay``.

    ``retry_after`` is the wait the failure asked for (an HTTP
    ``Retry-After``), or ``None``: ``delay`` is the jittered backoff, or
    ``retry_after`` when that is longer.
    """

    name: str
    attempt: int
    error_type: str
    message: str
    delay: float
    duration: float | None
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class StepFailed:
    """``name`` failed on attempt ``attempt`` and will not be retried in this run.

    ``retry_after`` is the wait the failure asked for, or ``None``; when it
    is more than the policy's ``max_retry_after``, that is why a step with
    attempts left was not retried.
    """

    name: str
    attempt: int
    error_type: str
    message: str
    duration: float | None
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class StepDenied:
    """The approval callback refused ``name``."""

    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepWaiting:
    """``name`` asked ``question`` (its ``number``-th, from 1) and waits for a person's answer.

    A resumed run announces the questions still waiting when it starts.
    """

    name: str
    question: Question
    number: int = 1


@dataclass(frozen=True, slots=True)
class StepInterrupted:
    """The attempt of ``name`` in flight was cancelled; the step is not done."""

    name: str


@dataclass(frozen=True, slots=True)
class StepPartial:
    """Running step ``name`` reported ``value`` as part of its output, the ``index``-th time.

    Sent by the shell while the step runs (an async generator step's yields,
    or :func:`ekit_runtime.partial` calls), never by the core and never
    recorded: a checkpoint holds only a step's final output, and a resume runs
    an unfinished step again from its start.
    """

    name: str
    value: object
    index: int
    delta: str | None = None
    """What an async generator step's text yield adds to its text so far, ``None`` otherwise.

    The convention of such a step is to yield its text so far, so ``value``
    grows with each yield, and a reader that keeps the text needs only
    ``delta``: the new end (``value`` minus the previous yield; the first
    yield extends ``""``), or, when ``replaces`` is true (a yield that does
    not start with the previous one), all of ``value``, in place of the text.
    A :func:`~ekit_runtime.partial` call, and a yield that is not a ``str``,
    have ``None``: their ``value`` stands alone.
    """
    replaces: bool = False
    """``delta`` replaces the text so far rather than extends it (see ``delta``)."""


@dataclass(frozen=True, slots=True)
class StepCacheHit:
    """The run's cache handed back the output of ``name`` (a step or an item) instead of running it.

    ``key`` is the cache entry's key, ``saved`` the usage that making the
    output had cost (what the hit saved). Sent by the shell (see
    docs/cache.md) right before the ``StepFinished`` of that output, which
    reports no usage; the checkpoint records the hit in ``cache_hits``.
    """

    name: str
    key: str
    saved: TokenUsage


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    """The shell handed a checkpoint with ``step_index`` completed steps to ``checkpoint_fn``."""

    step_index: int


@dataclass(frozen=True, slots=True)
class RunSettled:
    """The run is over: nothing is in flight and nothing more will start.

    ``outcome`` says how it ended: ``"finished"`` (every output recorded),
    ``"failed"``, ``"budget_exceeded"``, ``"denied"``, ``"cancelled"``, or
    ``"waiting"`` (steps wait for an answer, and nothing else could run).
    ``completed`` outputs are recorded and ``skipped`` steps were skipped by
    a condition, of ``total`` steps (counted as
    :func:`ekit_core.progress.run_progress` counts the run's checkpoint). A run with
    ``only`` (:mod:`ekit_core.selection`) never settles ``left_out`` of them,
    outside its selection: finished, it settled the other ``total - left_out``.
    """

    outcome: Outcome
    completed: int
    total: int
    cost: TokenUsage
    left_out: int = 0
    skipped: int = 0


Event = (
    RunStarted
    | StepSkipped
    | StepOutdated
    | StepExpanded
    | StepStarted
    | StepFinished
    | StepRetried
    | StepFailed
    | StepDenied
    | StepInterrupted
    | StepWaiting
    | StepPartial
    | StepCacheHit
    | CheckpointSaved
    | RunSettled
)

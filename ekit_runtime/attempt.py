"""What one attempt of one step is: the value the runner hands its executor.

The runner builds an :class:`Attempt` for every attempt that goes through an
executor, and the executor runs it: ``attempt.step.run(attempt.context)``,
wherever it likes. The attempt carries the step's durable identity, DBOS
style: its ``number`` counts attempts across runs (it continues after the
failed attempts the resumed checkpoint records, and after the attempts whose
output a rewind or a changed version, dependencies or shape let go of: see
:func:`ekit_core.state.attempt_number`), so an attempt that finished but
whose checkpoint was never saved runs again under the same number, other
work never does, and ``key`` (``run_id/step/number``) is what a side effect
can be deduplicated on.

Inside the step the same identity is :func:`attempt_key`, a
``contextvars.ContextVar`` set around the attempt: every attempt runs in its
own task, a sync step's thread gets a copy of that task's context, and the
Dask executor sets it again on the worker. It is set in every run that has a
``run_id`` (every queued run has one; ``workflow.run(..., run_id=...)``
gives one to a run of your own); a run without one keeps its fastest path,
on which no attempt value is built at all.

:class:`Attempt` and :class:`AttemptKey` are defined in
:mod:`ekit_runtime.step`, beside the step an attempt holds and the executor
that runs it (the three refer to one another), and re-exported here.
"""

from __future__ import annotations

from contextvars import ContextVar

from ekit_runtime.step import Attempt, AttemptKey

__all__ = ["Attempt", "AttemptKey", "attempt_key", "holding", "note_hold"]


CURRENT: ContextVar[AttemptKey] = ContextVar("ekit_attempt_key")
"""The key of the attempt running in this context: set by the runner and the executors."""

HOLDS: ContextVar[dict[str, float] | None] = ContextVar("ekit_attempt_holds", default=None)
"""The limits that held the attempt running in this context before it began, each with the
seconds it did (see :func:`note_hold`): set by the runner, in a run that records times, in
each attempt's own task before its gates and ``before_attempt``; ``None`` elsewhere."""


def holding() -> dict[str, float]:
    """The holds of the attempt running in this context, made empty (and set) if none are yet:
    the runner's, in a run that records times (a retry's delay may have set them already)."""
    holds = HOLDS.get()
    if holds is None:
        holds = {}
        HOLDS.set(holds)
    return holds


def note_hold(limit: str, seconds: float) -> None:
    """Say that ``limit`` held the calling attempt back ``seconds`` before it began.

    For a ``before_attempt`` hook (a queue's worker calls it for its fleet
    limits: ``"limit:tokens_per_minute"``, ``"resource:gpu"``): in a run that
    records durations, the attempt's checkpoint entry then says which limit
    held it, and how long (the checkpoint's ``held``, shown on the
    dashboard's timeline). Seconds told twice for one limit add up. Does
    nothing outside an attempt of such a run, or for a hold of no time.
    """
    holds = HOLDS.get()
    if holds is not None and seconds > 0:
        holds[limit] = holds.get(limit, 0.0) + seconds


def attempt_key() -> AttemptKey:
    """The key of the step attempt calling this.

    Set inside every step of a run that has a run id: a queued run, or
    ``workflow.run(..., run_id=...)``. Raises ``LookupError`` anywhere else
    (a run given no id, or outside a step).
    """
    try:
        return CURRENT.get()
    except LookupError:
        raise LookupError(
            "attempt_key() is only set inside a step of a run that has a run id: a queued run, "
            "or workflow.run(..., run_id=...)"
        ) from None

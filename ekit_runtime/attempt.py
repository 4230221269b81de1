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
"""

from __future__ import annotations

from collections.abc import MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ekit_core.shapes import item_name

if TYPE_CHECKING:
    from ekit_runtime.step import Step

__all__ = ["Attempt", "AttemptKey", "attempt_key"]


@dataclass(frozen=True, slots=True)
class AttemptKey:
    """Which attempt of which step of which run is running: ``str(key)`` is ``run/step/attempt``."""

    run_id: str
    step: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.run_id}/{self.step}/{self.attempt}"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of ``step``, as the runner hands it to an executor.

    - ``step``: the :class:`~ekit_runtime.step.Step` to run;
    - ``context``: what ``step.run`` is called with;
    - ``number``: the attempt's number counted across runs, from 1: one more
      than the failed attempts recorded for the step so far and the attempts
      whose output was let go of (the checkpoint's ``redone``);
    - ``run_id``: the run's id, or ``None`` for a run given none;
    - ``item``: for an item of a mapped step, the item's key (else ``None``).
    """

    step: Step
    context: MutableMapping[str, Any]
    number: int = 1
    run_id: str | None = None
    item: str | None = None

    @property
    def name(self) -> str:
        """What the attempt runs: the step's name, or its item's (``step[key]``)."""
        return self.step.name if self.item is None else item_name(self.step.name, self.item)

    @property
    def key(self) -> AttemptKey | None:
        """The attempt's idempotency key (``run_id/name/number``), or ``None`` without a run id."""
        if self.run_id is None:
            return None
        return AttemptKey(self.run_id, self.name, self.number)


CURRENT: ContextVar[AttemptKey] = ContextVar("ekit_attempt_key")
"""The key of the attempt running in this context: set by the runner and the executors."""


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

"""Idempotency keys: the stable ``(run id, step, attempt)`` of the step attempt running now.

A worker drives each run through a copy of its workflow whose steps first
set :func:`attempt_key` (a ``contextvars.ContextVar``: every attempt runs in
its own task, so concurrent steps each see their own key) and, when the
fleet has a call or token rate limit, wait at its gate. The attempt number
continues from the failures the resumed checkpoint records, so a step that
finished but whose checkpoint was never saved runs again under the same key:
an external side effect keyed on it can be deduplicated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.executors import is_async_step
from ekit_runtime.step import Step, StepFn
from ekit_runtime.workflow import Workflow

__all__ = ["AttemptKey", "attempt_key", "keyed_workflow"]

Gate = Callable[[], Awaitable[None]]
"""Awaited before each step attempt starts (the fleet's usage limits)."""


@dataclass(frozen=True, slots=True)
class AttemptKey:
    """Which attempt of which step of which run is running: ``str(key)`` is ``run/step/attempt``."""

    run_id: str
    step: str
    attempt: int

    def __str__(self) -> str:
        return f"{self.run_id}/{self.step}/{self.attempt}"


_CURRENT: ContextVar[AttemptKey] = ContextVar("ekit_attempt_key")


def attempt_key() -> AttemptKey:
    """The key of the step attempt calling this, inside a run driven by a queue worker.

    Raises ``LookupError`` anywhere else (a plain ``workflow.run``, or outside
    a step).
    """
    try:
        return _CURRENT.get()
    except LookupError:
        raise LookupError(
            "attempt_key() is only set inside a step of a run driven by an ekit queue worker"
        ) from None


def _keyed_step(step: Step, run_id: str, first: int, gate: Gate | None) -> Step:
    if step.executor is not None:
        # Its attempts run elsewhere (a Dask worker): the key could not follow.
        return step
    body: StepFn = step.run
    # The default executor's rule, kept: a sync step runs in a thread unless inline.
    blocking = not is_async_step(step) and not step.inline
    attempts = [first]

    async def run(context: dict[str, Any]) -> Any:
        attempts[0] += 1
        key = AttemptKey(run_id, step.name, attempts[0])
        if gate is not None:
            await gate()
        # Set inside the attempt's own task (the runner starts each attempt as
        # a task with a copied context), so siblings never see this key.
        _CURRENT.set(key)
        if blocking:
            # to_thread copies the context, key included, into the thread.
            returned = await asyncio.to_thread(body, context)
        else:
            returned = body(context)
        if inspect.isawaitable(returned):
            returned = await returned
        return returned

    return dataclasses.replace(step, run=run, blocking=False, inline=False)


def keyed_workflow(
    workflow: Workflow, run_id: str, checkpoint: WorkflowCheckpoint | None, gate: Gate | None = None
) -> Workflow:
    """A copy of ``workflow`` (same graph and fingerprint) whose steps set :func:`attempt_key`.

    ``checkpoint`` is what the run resumes from: attempt numbers continue
    after the failed attempts it records. ``gate`` is awaited before each
    attempt's body runs.
    """
    failures = checkpoint.failures if checkpoint is not None else {}
    return Workflow(
        [
            _keyed_step(s, run_id, failures[s.name].attempts if s.name in failures else 0, gate)
            for s in workflow.steps
        ]
    )

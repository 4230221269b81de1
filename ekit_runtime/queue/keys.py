"""Idempotency keys, and the worker's say right before each step attempt starts.

A worker runs each run it drives with :class:`KeyedExecutor` around the
run's executor (and around each executor a step names for itself): before
every attempt it awaits the worker's admission (the fleet's usage limits, a
save still pending, the worker's own view of its lease), then sets
:func:`attempt_key` (a ``contextvars.ContextVar``: every attempt runs in its
own task, so concurrent steps each see their own key) and hands the attempt
to the executor it wraps. Where a step runs is therefore the same rule
whoever drives the run: the default executor's thread pool for a sync step,
the loop for an async or ``inline`` one, the step's own executor (a Dask
cluster) if it names one, and the key travels with the step's function.

The attempt number continues from the failures the resumed checkpoint
records, so a step that finished but whose checkpoint was never saved runs
again under the same key: an external side effect keyed on it can be
deduplicated.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import threading
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.executors import Executor, LocalExecutor, is_async_step
from ekit_runtime.step import Step, StepFn
from ekit_runtime.workflow import Workflow

__all__ = ["AttemptKey", "KeyedExecutor", "attempt_key", "busy_sync_steps", "keyed", "run_context"]

Admit = Callable[[], Awaitable[None]]
"""Awaited right before an attempt starts. It returns to let the attempt
start, and never returns (it waits to be cancelled with the run) when the
attempt must not start."""


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


@dataclass(slots=True)
class _Run:
    """One driven run, as its attempts see it: its id, its admission, attempts counted per step."""

    run_id: str
    admit: Admit
    attempts: dict[str, int]


_RUN: ContextVar[_Run | None] = ContextVar("ekit_keyed_run", default=None)


def run_context(run_id: str, checkpoint: WorkflowCheckpoint | None, admit: Admit) -> contextvars.Context:
    """A context to run one run's task in: its attempts get keys of ``run_id`` and await ``admit``.

    ``checkpoint`` is what the run resumes from: attempt numbers continue
    after the failed attempts it records.
    """
    failures = checkpoint.failures if checkpoint is not None else {}
    context = contextvars.copy_context()
    context.run(_RUN.set, _Run(run_id, admit, {name: f.attempts for name, f in failures.items()}))
    return context


class KeyedExecutor(Executor):
    """``inner``, with each attempt of a run bound by :func:`run_context` admitted and keyed first.

    Outside such a run it is ``inner`` and nothing else.
    """

    def __init__(self, inner: Executor) -> None:
        self.inner = inner

    def check(self, steps: Sequence[Step]) -> None:
        """What ``inner`` refuses."""
        self.inner.check(steps)

    async def run(self, step: Step, context: MutableMapping[str, Any]) -> Any:
        """Await the run's admission, set the attempt's key, and run the attempt in ``inner``."""
        run = _RUN.get()
        if run is None:
            return await self.inner.run(step, context)
        await run.admit()
        # Counted once admitted: an attempt that never started takes no number.
        attempt = run.attempts[step.name] = run.attempts.get(step.name, 0) + 1
        key = AttemptKey(run.run_id, step.name, attempt)
        # Nothing is awaited between the admission and the hand-over: the
        # attempt starts with the admission's verdict still true.
        token = _CURRENT.set(key)
        try:
            return await self.inner.run(self._carrying(step, key), context)
        finally:
            _CURRENT.reset(token)

    def _carrying(self, step: Step, key: AttemptKey) -> Step:
        """``step`` with a function that sets ``key`` wherever ``inner`` calls it."""
        if isinstance(self.inner, LocalExecutor) and is_async_step(step):
            return step  # awaited in this very task, which holds the key already
        # A thread of a pool, or another process (Dask pickles the function,
        # key and all): the key must travel with the function.
        body: StepFn = (_KeyedAsync if is_async_step(step) else _Keyed)(step.run, key)
        return dataclasses.replace(step, run=body)


_busy = [0]
_busy_lock = threading.Lock()


def busy_sync_steps() -> int:
    """How many sync step functions of keyed attempts are running in this process right now.

    Counted until the function returns, even when its attempt was cancelled:
    Python cannot stop a thread, so ``ekit worker`` reads this to exit
    without waiting for such threads once it has given their runs back.
    """
    return _busy[0]


class _Keyed:
    """A sync step function that runs with its attempt's key set (and unset after)."""

    __slots__ = ("__weakref__", "body", "key")

    def __init__(self, body: StepFn, key: AttemptKey) -> None:
        self.body, self.key = body, key

    def __call__(self, context: Any) -> Any:
        token = _CURRENT.set(self.key)
        with _busy_lock:
            _busy[0] += 1
        try:
            returned = self.body(context)
        finally:
            with _busy_lock:
                _busy[0] -= 1
            _CURRENT.reset(token)
        if inspect.isawaitable(returned):
            return _keyed_await(self.key, returned)
        return returned


class _KeyedAsync(_Keyed):
    """An async step function that runs with its attempt's key set."""

    __slots__ = ()

    async def __call__(self, context: Any) -> Any:
        token = _CURRENT.set(self.key)
        try:
            return await self.body(context)
        finally:
            _CURRENT.reset(token)


async def _keyed_await(key: AttemptKey, awaitable: Awaitable[Any]) -> Any:
    token = _CURRENT.set(key)
    try:
        return await awaitable
    finally:
        _CURRENT.reset(token)


def keyed(workflow: Workflow) -> Workflow:
    """``workflow``, with each executor its steps name wrapped in a :class:`KeyedExecutor`.

    The same graph and fingerprint; ``workflow`` itself when no step names
    an executor (the run's executor is wrapped by whoever runs it). Built
    once per workflow, not per run.
    """
    if not any(s.executor is not None for s in workflow.steps):
        return workflow
    wrapped: dict[int, KeyedExecutor] = {}

    def wrap(executor: Executor) -> KeyedExecutor:
        if isinstance(executor, KeyedExecutor):
            return executor
        return wrapped.setdefault(id(executor), KeyedExecutor(executor))

    return Workflow(
        [
            s if s.executor is None else dataclasses.replace(s, executor=wrap(s.executor))
            for s in workflow.steps
        ]
    )

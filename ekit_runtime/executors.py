"""Where a step's attempt runs: the executor protocol and the default executor.

:class:`Executor`, the protocol, is defined in :mod:`ekit_runtime.step` (a
step names its executor, which runs attempts of steps) and re-exported here.

An executor runs one attempt of one step, given an
:class:`~ekit_runtime.attempt.Attempt` (the step, its context and the
attempt's durable identity), and returns what the step returned (or raises
what it raised). Nothing else:
retries, timeouts, budgets and approval stay the core's decisions, the
runner stays the only owner of the run's state and the only caller of
``checkpoint_fn``, and cancelling the task awaiting :meth:`Executor.run`
must cancel the attempt (as far as the executor can). Choose one per run
(``Workflow.run(..., executor=...)``) and override it per step
(``Step(..., executor=...)``).

The default, :class:`LocalExecutor`, runs async steps on the event loop and
sync steps in a worker thread, so that a sync step (most LLM SDK clients are
sync) never blocks its siblings and its timeout can fire.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import os
import threading
import warnings
import weakref
from collections.abc import Callable, MutableMapping
from time import perf_counter
from typing import Any

from ekit_core.numbers import check_number
from ekit_runtime.step import Attempt, Executor, Step
from ekit_runtime.streaming import drain_stream

__all__ = [
    "DEFAULT_EXECUTOR",
    "BlockingStepWarning",
    "Executor",
    "LocalExecutor",
    "busy_sync_steps",
    "is_async_step",
]


class BlockingStepWarning(RuntimeWarning):
    """A step ran on the event loop's thread long enough to stall every other step."""


def is_async_step(step: Step) -> bool:
    """Whether ``step.run`` is an ``async def`` function (or a callable whose ``__call__`` is)."""
    run = step.run
    return inspect.iscoroutinefunction(run) or inspect.iscoroutinefunction(
        getattr(run, "__call__", None)  # noqa: B004 - a callable object's own method
    )


class LocalExecutor(Executor):
    """Async steps on the event loop; sync steps in a thread of a pool of ``max_threads``.

    ``Step(..., inline=True)`` runs a cheap sync step on the loop's thread
    instead, saving the hop to a thread (about 50 microseconds). An inline
    step that takes longer than ``warn_after`` seconds triggers one
    :class:`BlockingStepWarning` per step name, since it stalled every other
    step meanwhile.

    A sync step's timeout fails the step at its deadline, but Python cannot
    stop a thread: the thread runs on until the function returns, its result
    is discarded, and it keeps its place in the pool until then. The pool's
    threads are created as needed and shared by every run using this
    executor; the interpreter waits for running ones at exit.
    """

    def __init__(self, *, max_threads: int = 64, warn_after: float = 0.1) -> None:
        if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
            raise ValueError(f"max_threads must be an int >= 1, got {max_threads!r}")
        self.max_threads = max_threads
        self.warn_after = check_number(warn_after, "warn_after")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        _EXECUTORS.add(self)
        self._warned: set[str] = set()
        # Sync functions seen returning awaitables, by identity: weakly, so
        # that a workflow's steps are not kept alive by the shared executor.
        self._wraps_async: weakref.WeakSet[Any] = weakref.WeakSet()

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # A forked child inherits the pool object but none of its
                # threads: a pool from before a fork would never run a step.
                self._pid = os.getpid()
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.max_threads, thread_name_prefix="ekit-step"
                )
            return self._pool

    async def run(self, attempt: Attempt) -> Any:
        """Await an async step here, run a sync one in a thread (or inline), and return its value.

        A sync function that returns an awaitable (a ``lambda`` around an
        ``async def``) only builds a coroutine: once seen doing so, it is
        called on the loop from then on, since a thread would buy nothing.
        A thread runs the step in a copy of the attempt's context, so that
        :func:`~ekit_runtime.attempt.attempt_key` answers there too.
        """
        step, context = attempt.step, attempt.context
        if is_async_step(step):
            return await step.run(context)
        if step.inline or step.run in self._wraps_async:
            began = perf_counter()
            returned = step.run(context)
            self._warn_if_slow(step.name, perf_counter() - began)
        else:
            returned = await self._in_thread(step, context)
        if inspect.isawaitable(returned):
            with contextlib.suppress(TypeError):  # a callable weakref cannot follow
                self._wraps_async.add(step.run)
            returned = await returned
        elif inspect.isasyncgen(returned):  # a streaming step: see ekit_runtime.streaming
            with contextlib.suppress(TypeError):
                self._wraps_async.add(step.run)
            returned = await drain_stream(returned)
        return returned

    async def _in_thread(self, step: Step, context: MutableMapping[str, Any]) -> Any:
        work = self._threads().submit(contextvars.copy_context().run, _counted, step.run, context)
        try:
            return await asyncio.wrap_future(work)
        except asyncio.CancelledError:
            # The thread runs on; what it returns is dropped, and a coroutine
            # it built must be closed rather than left never awaited.
            work.add_done_callback(_close_returned)
            raise

    def _warn_if_slow(self, name: str, seconds: float) -> None:
        if seconds >= self.warn_after and name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                BlockingStepWarning(
                    f"step {name!r} ran inline for {seconds:.2f}s, blocking the event loop and "
                    "every other step; drop inline=True so that it runs in a thread"
                ),
                stacklevel=2,
            )

    def shutdown(self) -> None:
        """Let the pool's idle threads go (running ones finish first); it is re-created on demand."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


_busy = [0]
_busy_lock = threading.Lock()


def busy_sync_steps() -> int:
    """How many sync step functions are running in a :class:`LocalExecutor`'s threads right now.

    Counted until the function returns, even when its attempt was cancelled:
    Python cannot stop a thread, so ``ekit worker`` reads this to exit
    without waiting for such threads once it has given their runs back.
    """
    return _busy[0]


def _counted(body: Callable[[Any], Any], context: Any) -> Any:
    with _busy_lock:
        _busy[0] += 1
    try:
        return body(context)
    finally:
        with _busy_lock:
            _busy[0] -= 1


def _close_returned(work: concurrent.futures.Future[Any]) -> None:
    if not work.cancelled() and work.exception() is None:
        returned = work.result()
        if inspect.iscoroutine(returned):
            returned.close()


def _after_fork_in_child() -> None:
    # The parent's threads do not survive a fork, and a lock one of them held
    # would stay held: every executor starts afresh in the child.
    for executor in list(_EXECUTORS):
        executor._lock = threading.Lock()
        executor._pool = None


_EXECUTORS: weakref.WeakSet[LocalExecutor] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

DEFAULT_EXECUTOR = LocalExecutor()
"""The executor of every step that names none, in every run that names none."""

"""Partial output of a running step: reported as events, never recorded.

A step that streams (tokens from an LLM, rows from a query) reports what it
has so far in one of two ways:

- it is an ``async def`` with ``yield``: every value it yields is reported,
  and its output is the *last* value it yielded (so yield the text so far,
  as it grows: the last yield is the whole text). Each report of a ``str``
  yield also says what it added to the previous one
  (:attr:`~ekit_core.events.StepPartial.delta`), which is all a queue's
  stream publishes: n tokens cost O(n) bytes there, not O(n^2);
- it calls :func:`partial` with each piece, from an async or a sync step,
  and returns its output as usual.

Each report reaches the run's ``trace`` callbacks as a
:class:`~ekit_core.events.StepPartial` at once, while the step runs, and
before the step's own ``StepFinished``. Nothing of it is recorded: the
checkpoint holds only the final output, so a resume runs a step that had
not finished from its start (its partial output is gone with the process).

Where nobody listens (a run without ``trace``), :func:`partial` returns at
once and costs the run nothing per step. A step that runs on another
machine (the Dask executor) reports nothing: there is no trace there. What
an attempt reports once it has ended (its thread running on past its
timeout, a task it left behind) is dropped: it would come after the step's
outcome, or after ``RunSettled``, which is always a run's last event.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import warnings
from collections.abc import AsyncGenerator, Callable
from contextvars import ContextVar
from typing import Any

from ekit_core.events import StepPartial
from ekit_runtime.errors import TraceCallbackWarning

__all__ = ["PartialSink", "drain_stream", "partial"]


class PartialSink:
    """Where the partial output of one attempt goes: the run's trace callbacks, on its loop.

    Built by the runner for each attempt of a run that has a ``trace``, and
    set in the attempt's context (:data:`SINK`), which a sync step's thread
    inherits. A report from another thread is handed to the loop's thread,
    so callbacks always run where the run's other events do.
    """

    __slots__ = ("_callbacks", "_count", "_loop", "_open", "_pending", "_thread", "name")

    def __init__(
        self,
        name: str,
        callbacks: tuple[Callable[[Any], Any], ...],
        loop: asyncio.AbstractEventLoop,
        pending: set[asyncio.Future[Any]],
    ) -> None:
        self.name = name
        self._callbacks = callbacks
        self._loop = loop
        self._thread = threading.get_ident()
        self._pending = pending
        self._count = 0
        self._open = True

    def close(self, _attempt: object = None) -> None:
        """The attempt ended (its task is ``_attempt``): what it reports from now on is dropped.

        Its thread may run on past a timeout, and a task it started may
        outlive it; their reports would follow the step's outcome, or even
        the run's ``RunSettled``, which is always the last event.
        """
        self._open = False

    def send(self, value: object, delta: str | None = None, replaces: bool = False) -> None:
        """Report ``value`` (from any thread: another one's report is handed to the loop);
        ``delta`` and ``replaces``: see :class:`~ekit_core.events.StepPartial`."""
        if threading.get_ident() == self._thread:
            self._deliver(value, delta, replaces)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: the run is over
                self._loop.call_soon_threadsafe(self._deliver, value, delta, replaces)

    def _deliver(self, value: object, delta: str | None = None, replaces: bool = False) -> None:
        if not self._open:
            return
        event = StepPartial(self.name, value, self._count, delta, replaces)
        self._count += 1
        for callback in self._callbacks:
            try:
                returned = callback(event)
            except Exception as exc:
                _dropped(exc)
                continue
            if asyncio.iscoroutine(returned) or isinstance(returned, asyncio.Future):
                # An async callback runs as a task; the runner awaits every
                # such task before it emits the run's next event, so a step's
                # partial events reach each callback before its StepFinished.
                task = asyncio.ensure_future(returned)
                self._pending.add(task)
                task.add_done_callback(_settled(self._pending))


def _settled(pending: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def done(task: asyncio.Future[Any]) -> None:
        pending.discard(task)
        if not task.cancelled() and isinstance(task.exception(), Exception):
            _dropped(task.exception())

    return done


def _dropped(exc: BaseException | None) -> None:
    warnings.warn(TraceCallbackWarning.dropped(exc, "StepPartial"), stacklevel=3)


SINK: ContextVar[PartialSink | None] = ContextVar("ekit_partial_sink", default=None)
"""The sink of the attempt running in this context; ``None`` where nobody listens."""


def partial(value: object) -> None:
    """Report ``value`` as partial output of the step calling this; a no-op where nobody listens.

    Call it from inside a step, async or sync, as often as you like (each
    call is one :class:`~ekit_core.events.StepPartial` event, numbered from
    0 within the attempt). The value is handed to the run's ``trace``
    callbacks as it is, never stored: the step's return value alone is its
    output. Outside a step, or in a run with no ``trace``, it does nothing.
    """
    sink = SINK.get()
    if sink is not None:
        sink.send(value)


async def drain_stream(stream: AsyncGenerator[Any, Any]) -> Any:
    """Run an async generator step to its end: report each value it yields; return the last.

    ``None`` if it yielded nothing. Cancelling the awaiting task closes the
    generator (its ``finally`` blocks run), as leaving an ``async for`` early does.
    A ``str`` yield is reported with what it adds to the previous ``str`` yield
    (its ``delta``), so that a reader keeping the text never copies it whole.
    """
    last: Any = None
    text = ""  # the previous str yield: what the next one is expected to extend
    async with contextlib.aclosing(stream):
        async for value in stream:
            sink = SINK.get()
            if sink is not None:
                if isinstance(value, str):
                    if value.startswith(text):
                        sink.send(value, value[len(text):])
                    else:
                        sink.send(value, value, True)
                    text = value
                else:
                    sink.send(value)
            last = value
    return last

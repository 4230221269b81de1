"""ekit's ``logging`` records: the ``ekit.run``, ``ekit.step`` and ``ekit.worker`` loggers.

Silent by default, as a library is: the ``ekit`` logger has a
``logging.NullHandler``, so nothing reaches stderr until the application
configures logging (``logging.basicConfig(level=logging.INFO)``, a handler
of its own) or runs ``ekit worker``, which prints the records itself.

- ``ekit.run``: a run started or resumed (how many steps were recorded), and
  how it settled (INFO).
- ``ekit.step``: an attempt that failed and will be retried, with the error
  and the delay (INFO); a step that failed for good, was denied, cancelled
  or outdated (INFO); each attempt started and succeeded, with its duration,
  and steps skipped or expanded (DEBUG).
- ``ekit.worker``: a worker claimed a run, and how its drive ended
  (finished, cancelled, released: INFO; failed, lease lost, a database that
  fails: WARNING).

A run's own records are INFO or DEBUG: its failure reaches the caller as an
exception, and a library does not also warn about what it raises. A worker,
which keeps a run's failure to itself, logs it at WARNING.

Every record ekit logs carries the attributes :data:`FIELDS` names
(``None`` when they do not apply), so a format such as
``"%(run_id)s %(step)s %(message)s"`` works on every ``ekit.*`` record, and
:class:`JsonFormatter` writes them as JSON. Event-specific ones
(:data:`DETAILS`) are set only on the records they belong to.

What it costs: a run decides once, as it starts, whether anyone listens
(``ekit.run`` or ``ekit.step`` enabled for INFO). If nobody does, the run
builds no event for logging and pays nothing per step; if someone does, the
run's events go to a trace callback of this module, as they would to a
``trace=`` callback. So a change of level takes effect at the next run.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from ekit_core import (
    Event,
    RunSettled,
    RunStarted,
    StepDenied,
    StepExpanded,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepOutdated,
    StepRetried,
    StepSkipped,
    StepStarted,
)
from ekit_core.progress import Progress

__all__ = [
    "DETAILS",
    "FIELDS",
    "RUN",
    "STEP",
    "WORKER",
    "JsonFormatter",
    "TextFormatter",
    "bind_log_fields",
    "log_event",
    "log_fields",
    "run_trace",
    "with_run_trace",
]

RUN = logging.getLogger("ekit.run")
"""Runs starting, resuming and settling."""
STEP = logging.getLogger("ekit.step")
"""Attempts: started, succeeded, failed, retried, timed out, cancelled."""
WORKER = logging.getLogger("ekit.worker")
"""Queue workers: claims, how each drive ended, leases lost, runs released or parked."""

logging.getLogger("ekit").addHandler(logging.NullHandler())

FIELDS: tuple[str, ...] = ("event", "run_id", "workflow", "worker", "epoch", "step", "attempt")
"""The attributes every ``ekit.*`` record has (``None`` where they do not apply).

- ``event``: what happened, one word: ``run_started``, ``run_resumed``,
  ``run_settled``; ``step_started``, ``step_succeeded``, ``step_retrying``,
  ``step_failed``, ``step_denied``, ``step_cancelled``, ``step_skipped``,
  ``step_expanded``, ``step_outdated``; ``claimed``, ``finished``,
  ``failed``, ``cancelled``, ``released``, ``lease_lost``, ``parked`` and
  the worker's troubles (``claim_failed``, ``save_failed``, ``end_failed``,
  ``renew_failed``, ``drive_failed``, ``left``); ``worker_started``
  (``ekit worker``, before its first claim); ``index_missing`` (a
  PostgreSQL queue opened by a role that could not build the claims' index).
- ``run_id``: the run's id (``None`` for a run started without one).
- ``workflow``, ``worker``, ``epoch``: under a queue worker, the workflow's
  name in its registry, the worker's name, and the lease's epoch.
- ``step``: the step (or item of a mapped step, ``name[key]``).
- ``attempt``: the attempt's number in this run, as the retry policy counts it.
"""

DETAILS: tuple[str, ...] = (
    "delay", "duration", "error_type", "error", "reason", "outcome", "completed", "total",
    "recorded", "items", "status",
)
"""Attributes set only on the records they belong to: ``delay`` (seconds before
a retry or a delayed start), ``duration`` (seconds an attempt took),
``error_type`` and ``error`` (the exception's type name and message),
``reason`` (of a denial, a skip, an outdated step, a parked run),
``outcome``, ``completed`` and ``total`` (of a settled run),
``recorded`` (steps a checkpoint had recorded), ``items`` (of an expanded
step), ``status`` (a run's status as the worker recorded it)."""

_RESERVED = frozenset(FIELDS) | frozenset(DETAILS)
_DEFAULTS: dict[str, Any] = dict.fromkeys(FIELDS)
_NO_FIELDS: Mapping[str, Any] = MappingProxyType({})
_CONTEXT: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "ekit_log_fields", default=_NO_FIELDS
)


@contextmanager
def log_fields(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (of :data:`FIELDS`) to every ekit record logged within the ``with`` block.

    A run made inside it keeps them to the end (its log callback reads them
    once, as it is made), and tasks started inside inherit them (asyncio
    copies the context into each task). A queue worker binds ``worker``,
    ``workflow`` and ``epoch`` in each run's task (:func:`bind_log_fields`).
    """
    _check_fields(fields)
    token = _CONTEXT.set({**_CONTEXT.get(), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def bind_log_fields(**fields: Any) -> None:
    """Add ``fields`` (of :data:`FIELDS`) to every ekit record logged from here on in this context.

    Meant for the first line of an asyncio task (each task runs in a copy of
    the context, so they last as long as the task and reach the tasks it
    starts). Elsewhere, prefer :func:`log_fields`, which undoes them.
    """
    _check_fields(fields)
    _CONTEXT.set({**_CONTEXT.get(), **fields})


def _check_fields(fields: Mapping[str, Any]) -> None:
    unknown = set(fields) - _RESERVED
    if unknown:
        raise ValueError(f"log_fields: unknown field(s) {sorted(unknown)}; known: {FIELDS}")


def log_event(
    logger: logging.Logger, level: int, event: str, message: str, *args: Any, **fields: Any
) -> None:
    """Log ``message % args`` on ``logger`` with ``event`` and ``fields`` as record attributes.

    Every attribute of :data:`FIELDS` is set (``None`` when neither
    ``fields`` nor the context of :func:`log_fields` gives it); ``fields``
    may also hold any of :data:`DETAILS`. For example, a worker parking a run::

        log_event(WORKER, logging.INFO, "parked", "worker %s: run %r parked: %s",
                  name, run_id, why, run_id=run_id, step=step, reason=why)
    """
    if not logger.isEnabledFor(level):
        return
    logger.log(level, message, *args, extra=_extra(event, fields), stacklevel=2)


def _extra(event: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    return {**_DEFAULTS, **_CONTEXT.get(), **fields, "event": event}


def run_trace(run_id: str | None) -> Callable[[Event], None] | None:
    """The trace callback that logs a run's events, or ``None`` if nobody listens.

    Asked once per run, as it starts: nobody listens unless ``ekit.run`` or
    ``ekit.step`` is enabled for INFO. The callback holds the run's id and
    the fields of :func:`log_fields` in force now.
    """
    if not (RUN.isEnabledFor(logging.INFO) or STEP.isEnabledFor(logging.INFO)):
        return None
    return _RunLog(run_id, dict(_CONTEXT.get()))


def with_run_trace(trace: Any, run_id: str | None) -> Any:
    """``trace`` (a callback, a sequence of them, or ``None``) with the run's log callback last.

    ``trace`` itself when nobody listens (see :func:`run_trace`).
    """
    logged = run_trace(run_id)
    if logged is None:
        return trace
    if trace is None:
        return (logged,)
    if isinstance(trace, list | tuple):
        return (*trace, logged)
    return (trace, logged)


def _span(seconds: float) -> str:
    """``seconds`` for people: ``12.3 ms`` under a second, else ``1.50 s``."""
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


def _seconds(value: float | None) -> str:
    return "" if value is None else f" in {_span(value)}"


class _RunLog:
    """Turns one run's events into records: a trace callback."""

    __slots__ = ("_base", "_prefix")

    def __init__(self, run_id: str | None, context: Mapping[str, Any]) -> None:
        self._base = {**_DEFAULTS, **context, "run_id": run_id}
        self._prefix = "" if run_id is None else f"run {run_id!r}: "

    def _log(self, logger: logging.Logger, level: int, event: str, message: str, **fields: Any) -> None:
        if logger.isEnabledFor(level):
            logger.log(level, self._prefix + message, extra={**self._base, **fields, "event": event})

    def __call__(self, event: Event) -> None:
        """Log ``event`` if its logger is enabled for its level (a trace callback)."""
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _started(self, e: StepStarted) -> None:
        if STEP.isEnabledFor(logging.DEBUG):
            after = f" after a {_span(e.delay)} delay" if e.delay else ""
            self._log(STEP, logging.DEBUG, "step_started",
                      f"step {e.name!r} attempt {e.attempt} started{after}",
                      step=e.name, attempt=e.attempt, delay=e.delay)

    def _finished(self, e: StepFinished) -> None:
        if STEP.isEnabledFor(logging.DEBUG):
            self._log(STEP, logging.DEBUG, "step_succeeded",
                      f"step {e.name!r} attempt {e.attempt} succeeded{_seconds(e.duration)}",
                      step=e.name, attempt=e.attempt, duration=e.duration)

    def _retried(self, e: StepRetried) -> None:
        self._log(STEP, logging.INFO, "step_retrying",
                  f"step {e.name!r} attempt {e.attempt} failed{_seconds(e.duration)} "
                  f"({e.error_type}: {e.message}); retrying in {_span(e.delay)}",
                  step=e.name, attempt=e.attempt, delay=e.delay, duration=e.duration,
                  error_type=e.error_type, error=e.message)

    def _failed(self, e: StepFailed) -> None:
        self._log(STEP, logging.INFO, "step_failed",
                  f"step {e.name!r} attempt {e.attempt} failed{_seconds(e.duration)} "
                  f"({e.error_type}: {e.message}); not retried",
                  step=e.name, attempt=e.attempt, duration=e.duration,
                  error_type=e.error_type, error=e.message)

    def _skipped(self, e: StepSkipped) -> None:
        if e.reason:  # a recorded step, skipped by a resume, is counted by run_resumed instead
            self._log(STEP, logging.DEBUG, "step_skipped", f"step {e.name!r} skipped: {e.reason}",
                      step=e.name, reason=e.reason)

    def _run_started(self, e: RunStarted) -> None:
        if e.recorded or e.skipped:  # (counted as ekit_core.progress counts: the worker's line agrees)
            counted = Progress(e.recorded, e.skipped, 0, e.total)
            self._log(RUN, logging.INFO, "run_resumed", f"resumed, {counted.text()}",
                      recorded=counted.done, total=e.total)
        else:
            self._log(RUN, logging.INFO, "run_started", f"started, {e.total} steps",
                      recorded=0, total=e.total)

    def _settled(self, e: RunSettled) -> None:
        counted = Progress(e.completed, e.skipped, 0, e.total)
        self._log(RUN, logging.INFO, "run_settled", f"{e.outcome.replace('_', ' ')}, {counted.text()}",
                  outcome=e.outcome, completed=counted.done, total=e.total)

    def _interrupted(self, e: StepInterrupted) -> None:
        self._log(STEP, logging.INFO, "step_cancelled", f"step {e.name!r} cancelled", step=e.name)

    def _denied(self, e: StepDenied) -> None:
        self._log(STEP, logging.INFO, "step_denied", f"step {e.name!r} denied: {e.reason}",
                  step=e.name, reason=e.reason)

    def _outdated(self, e: StepOutdated) -> None:
        self._log(STEP, logging.INFO, "step_outdated", f"step {e.name!r} runs again: {e.reason}",
                  step=e.name, reason=e.reason)

    def _expanded(self, e: StepExpanded) -> None:
        self._log(STEP, logging.DEBUG, "step_expanded",
                  f"step {e.name!r} expanded into {e.items} items ({e.recorded} recorded)",
                  step=e.name, items=e.items, recorded=e.recorded)


_HANDLERS: dict[type, Callable[[_RunLog, Any], None]] = {
    StepStarted: _RunLog._started,
    StepFinished: _RunLog._finished,
    StepRetried: _RunLog._retried,
    StepFailed: _RunLog._failed,
    StepSkipped: _RunLog._skipped,
    RunStarted: _RunLog._run_started,
    RunSettled: _RunLog._settled,
    StepInterrupted: _RunLog._interrupted,
    StepDenied: _RunLog._denied,
    StepOutdated: _RunLog._outdated,
    StepExpanded: _RunLog._expanded,
}


def _utc(record: logging.LogRecord) -> str:
    seconds = int(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """One human line per record: ``TIME LEVEL LOGGER: MESSAGE`` (UTC time, to the millisecond).

    ekit's messages name the run, the step and the attempt they are about
    (and the worker's name the worker); an exception's traceback follows on
    the lines after, as with ``logging.Formatter``.
    """

    def format(self, record: logging.LogRecord) -> str:
        """The line for ``record``."""
        line = f"{_utc(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line.

    Keys: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, then
    the :data:`FIELDS` and :data:`DETAILS` attributes the record has and that
    are not ``None``, and ``exception`` (its traceback) if it has one. Values
    JSON cannot hold are written as their ``str``.
    """

    def __init__(self, fields: Sequence[str] = (*FIELDS, *DETAILS)) -> None:
        """``fields``: the record attributes to write (default: every ekit attribute)."""
        super().__init__()
        self.fields = tuple(fields)

    def format(self, record: logging.LogRecord) -> str:
        """The JSON line for ``record``."""
        out: dict[str, Any] = {
            "time": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in self.fields:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)

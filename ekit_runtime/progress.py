"""A stdlib progress reporter: a ``trace`` callback that shows how a run is going.

This module owns how progress looks on a terminal and in a log. It only
reads events (see :mod:`ekit_core.events`); it never changes a run. On a
terminal it keeps one status line up to date (steps done out of the total,
steps in flight, tokens spent, elapsed time); anywhere else (a CI log, a
pipe, a file) it writes one plain line per step that finished, failed or
will be retried, and one when the run ends, so the log reads top to bottom.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from ekit_core import (
    Event,
    RunSettled,
    RunStarted,
    StepDenied,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepRetried,
    StepSkipped,
    StepStarted,
)
from ekit_runtime.runner import SAVE_FAILED_NOTE

__all__ = ["ProgressPrinter"]

_CLEAR_LINE = "\x1b[K"
_SHOWN_RUNNING = 3


def _ending(event: RunSettled) -> str:
    """How the run ended, in words: a run stopped by a failed save says so, not "cancelled".

    The core settles such a run as cancelled (it stops starting steps, as on
    Ctrl-C); the save's error is the one the runner is handling while it
    reports the end, so it is what ``sys.exc_info`` sees here.
    """
    if event.outcome == "cancelled":
        cause = sys.exc_info()[1]
        notes = getattr(cause, "__notes__", None) or ()
        if any(isinstance(n, str) and n.startswith(SAVE_FAILED_NOTE) for n in notes):
            return f"stopped: its checkpoint could not be saved ({type(cause).__name__}: {cause})"
    return event.outcome


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    return f"{minutes}m{secs:02d}s"


class ProgressPrinter:
    """Print a run's progress; pass an instance as ``trace=``.

    - ``stream``: where to write; ``None`` means ``sys.stderr`` at the time
      of each write (so redirections made later are honoured).
    - ``clock``: a monotonic clock in seconds, injectable for tests.
    - ``tty``: ``True`` rewrites one status line in place (``\\r`` and an
      erase-to-end-of-line code), at most once per ``interval`` seconds,
      printing retries and failures above it; ``False`` writes plain lines.
      ``None`` (the default) asks ``stream.isatty()``.
    - ``interval``: the least time between two redraws of the status line.

    One printer can watch several runs one after another: ``RunStarted``
    resets its counts. It is a plain synchronous callable, so it never
    delays the run by more than a write.
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        tty: bool | None = None,
        interval: float = 0.1,
    ) -> None:
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {type(clock).__name__}")
        if tty is not None and not isinstance(tty, bool):
            raise ValueError(f"tty must be True, False or None, got {tty!r}")
        if isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0:
            raise ValueError(f"interval must be a number of seconds >= 0, got {interval!r}")
        self._stream = stream
        self._clock = clock
        self._tty = tty
        self._interval = float(interval)
        self._reset()

    def _reset(self) -> None:
        self._total = 0
        self._done = 0
        self._skipped = 0
        self._failed = 0
        self._tokens = 0
        self._running: dict[str, None] = {}
        self._started_at: float | None = None
        self._drawn_at: float | None = None
        self._line_open = False

    # -- what it has seen ----------------------------------------------------

    @property
    def total(self) -> int:
        """Steps in the run being watched."""
        return self._total

    @property
    def done(self) -> int:
        """Steps whose output is recorded, those skipped on resume included."""
        return self._done

    @property
    def skipped(self) -> int:
        """Steps skipped because the checkpoint resumed from recorded them."""
        return self._skipped

    @property
    def running(self) -> tuple[str, ...]:
        """Steps in flight, in the order they started."""
        return tuple(self._running)

    @property
    def tokens(self) -> int:
        """Input plus output tokens spent by the steps that finished in this run."""
        return self._tokens

    def elapsed(self) -> float:
        """Seconds since the run started (0 before it has)."""
        if self._started_at is None:
            return 0.0
        return max(0.0, self._clock() - self._started_at)

    def status(self) -> str:
        """The one-line summary the terminal mode shows."""
        parts = [f"{self._done}/{self._total} steps"]
        if self._running:
            names = list(self._running)
            shown = ", ".join(names[:_SHOWN_RUNNING])
            if len(names) > _SHOWN_RUNNING:
                shown += f", +{len(names) - _SHOWN_RUNNING}"
            parts.append(f"{len(names)} running ({shown})")
        parts.append(f"{self._tokens:,} tokens")
        parts.append(_seconds(self.elapsed()))
        return " | ".join(parts)

    # -- the callback --------------------------------------------------------

    def __call__(self, event: Event) -> None:
        """Take one trace event: update the counts, then draw or print."""
        if isinstance(event, RunStarted):
            self._reset()
            self._started_at = self._clock()
            self._total = event.total
            self._done = event.recorded
            if not self._is_tty():
                resumed = f", {event.recorded} recorded" if event.recorded else ""
                self._line(f"run started: {event.total} steps{resumed}")
            self._draw(force=True)
        elif isinstance(event, StepSkipped):
            self._skipped += 1
        elif isinstance(event, StepStarted):
            self._running[event.name] = None
            self._draw()
        elif isinstance(event, StepFinished):
            self._running.pop(event.name, None)
            self._done += 1
            self._tokens += event.usage.total_tokens
            if not self._is_tty():
                took = "" if event.duration is None else f" in {_seconds(event.duration)}"
                self._line(
                    f"{self._prefix()} done {event.name}{took}, "
                    f"{event.usage.total_tokens:,} tokens"
                )
            self._draw()
        elif isinstance(event, StepRetried):
            self._running.pop(event.name, None)
            self._note(
                f"{self._prefix()} retry {event.name} after attempt {event.attempt}: "
                f"{event.error_type}: {event.message} (next in {_seconds(event.delay)})"
            )
        elif isinstance(event, StepFailed):
            self._running.pop(event.name, None)
            self._failed += 1
            self._note(
                f"{self._prefix()} FAILED {event.name} on attempt {event.attempt}: "
                f"{event.error_type}: {event.message}"
            )
        elif isinstance(event, StepDenied):
            self._running.pop(event.name, None)
            reason = f": {event.reason}" if event.reason else ""
            self._note(f"{self._prefix()} DENIED {event.name}{reason}")
        elif isinstance(event, StepInterrupted):
            self._running.pop(event.name, None)
            self._draw()
        elif isinstance(event, RunSettled):
            self._running.clear()
            self._done = event.completed
            summary = (
                f"run {_ending(event)}: {event.completed}/{event.total} steps"
                + (f" ({self._skipped} skipped)" if self._skipped else "")
                + f", {self._tokens:,} tokens this run, {_seconds(self.elapsed())}"
            )
            if self._is_tty():
                self._draw(force=True)
                self._end_line()
            self._line(summary)

    # -- output ----------------------------------------------------------------

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        if self._tty is None:
            try:
                self._tty = bool(self._out().isatty())
            except (AttributeError, ValueError, OSError):
                # A closed or exotic stream: plain lines are always safe.
                self._tty = False
        return self._tty

    def _prefix(self) -> str:
        return f"[{self._done}/{self._total} {_seconds(self.elapsed())}]"

    def _write(self, text: str) -> None:
        out = self._out()
        out.write(text)
        out.flush()

    def _line(self, text: str) -> None:
        self._write(text + "\n")

    def _end_line(self) -> None:
        if self._line_open:
            self._write("\n")
            self._line_open = False

    def _note(self, text: str) -> None:
        """A line worth keeping: above the status line on a terminal."""
        if self._is_tty():
            self._write("\r" + text + _CLEAR_LINE + "\n")
            self._line_open = False
            self._draw(force=True)
        else:
            self._line(text)

    def _draw(self, *, force: bool = False) -> None:
        if not self._is_tty():
            return
        now = self._clock()
        # Redrawing on every event would flood a slow terminal during a wide fan-out.
        if not force and self._drawn_at is not None and now - self._drawn_at < self._interval:
            return
        self._drawn_at = now
        self._write("\r" + self.status() + _CLEAR_LINE)
        self._line_open = True

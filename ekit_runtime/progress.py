"""A stdlib progress reporter: a ``trace`` callback that shows how a run is going.

This module owns how progress looks on a terminal and in a log. It only
reads events (see :mod:`ekit_core.events`); it never changes a run. On a
terminal it keeps one status line up to date (a bar of steps done out of
the total, an estimate of the time left once a step of this run finished,
the steps in flight with how long each has run, tokens spent, elapsed
time), and redraws it every ``tick`` seconds while the run goes, so that a
long step shows its time growing; anywhere else (a CI log, a pipe, a file,
or a terminal with ``NO_COLOR`` set or ``TERM=dumb``) it writes one plain
line per step that finished, failed or will be retried, and one when the
run ends, with no control codes, so the log reads top to bottom.

A run with run-time shapes (:mod:`ekit_core.shapes`) counts its items as
steps: the total starts at the declared steps and grows by each expansion's
items when the core announces it (``StepExpanded``), and a mapped
step's collected output counts once, when it is collected. A step (or item)
skipped by a condition counts as done, and is marked so (``skipped NAME:
reason`` in a log, ``N skipped by a condition`` at the end). Which names
are items it reads from ``graph=`` when given (exact), else from their form
``step[key]``; a graph without shapes prints as it always did. With
``graph=``, a step whose child workflow ends says so, with the tokens its
child's steps used this run.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from ekit_core import (
    Event,
    RunSettled,
    RunStarted,
    StepCacheHit,
    StepDenied,
    StepExpanded,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepPartial,
    StepRetried,
    StepSkipped,
    StepStarted,
    StepWaiting,
)
from ekit_core.children import parent_of
from ekit_core.numbers import check_number
from ekit_core.shapes import Shape
from ekit_runtime.runner import SAVE_FAILED_NOTE

__all__ = ["ProgressPrinter"]

_CLEAR_LINE = "\x1b[K"
_SHOWN_RUNNING = 3
_BAR = 20  # characters of the bar
_PARTIAL_SHOWN = 24  # characters of a running step's latest partial output, its end


def _plain_terminal() -> bool:
    """Whether the environment asks for no control codes (https://no-color.org, a dumb terminal)."""
    return bool(os.environ.get("NO_COLOR")) or os.environ.get("TERM") == "dumb"


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


def _with_children(graph: Any) -> Mapping[str, Shape] | None:
    """The shapes of ``graph`` if it has a step with a child workflow, else ``None``."""
    if graph is None:
        return None
    shapes = getattr(getattr(graph, "graph", graph), "shapes", None) or {}
    return shapes if any(s.child is not None for s in shapes.values()) else None


def _mapped_steps(graph: Any) -> frozenset[str] | None:
    """The mapped steps of ``graph`` (a ``GraphSpec`` or anything with one as ``.graph``);
    ``None`` when no graph is given (items are then told by their form)."""
    if graph is None:
        return None
    spec = getattr(graph, "graph", graph)
    shapes = getattr(spec, "shapes", None)
    if not isinstance(getattr(spec, "names", None), tuple) or shapes is None:
        raise ValueError(f"graph must be a GraphSpec or a Workflow, got {type(graph).__name__}")
    return frozenset(n for n, s in shapes.items() if s.map_over is not None)


def _item_of(name: str, mapped: frozenset[str] | None) -> str | None:
    """The mapped step ``name`` is an item of (``step[key]``), or ``None`` for a step."""
    if not name.endswith("]"):
        return None
    cut = name.find("[")
    if cut <= 0:
        return None
    if mapped is None:
        return name[:cut]
    while cut > 0:  # a mapped step's own name may hold a "[" too
        if name[:cut] in mapped:
            return name[:cut]
        cut = name.find("[", cut + 1)
    return None


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
    - ``tick``: on a terminal, redraw the status line every ``tick``
      seconds while the run goes (on the running event loop), so that the
      time of a long step keeps growing; ``None`` redraws on events only.
      :meth:`tick` redraws by hand.
    - ``graph``: the run's ``GraphSpec`` (or ``Workflow``), so that items
      are told from steps by the mapped steps it declares rather than by
      their ``step[key]`` form; ``None`` (the default) goes by the form.
    - ``label``: text put before every line, as ``label: ``, so that the
      lines of runs printed to one stream side by side (an ``ekit worker
      --trace progress`` drives several) tell whose they are; ``None``
      (the default) puts nothing.

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
        graph: Any = None,
        tick: float | None = 1.0,
        label: str | None = None,
    ) -> None:
        if not callable(clock):
            raise ValueError(f"clock must be callable, got {type(clock).__name__}")
        if tty is not None and not isinstance(tty, bool):
            raise ValueError(f"tty must be True, False or None, got {tty!r}")
        interval = check_number(interval, "interval")
        if tick is not None:
            tick = check_number(tick, "tick", above_low=True)
        if label is not None and not isinstance(label, str):
            raise ValueError(f"label must be a str or None, got {type(label).__name__}")
        self._label = "" if not label else f"{label}: "
        self._tick_every = None if tick is None else float(tick)
        self._timer: asyncio.TimerHandle | None = None
        self._stream = stream
        self._clock = clock
        self._tty = tty
        self._interval = float(interval)
        self._mapped = _mapped_steps(graph)
        self._shapes = _with_children(graph)
        self._reset()

    def _reset(self) -> None:
        self._total = 0
        self._done = 0
        self._skipped = 0
        self._by_condition = 0
        # Tokens of each child workflow's steps this run, by the step whose child it is.
        self._child_tokens: dict[str, int] = {}
        # Items seen, by their mapped step (the total grows by each).
        self._items: dict[str, set[str]] = {}
        self._expanded: set[str] = set()  # mapped steps whose StepExpanded was seen
        self._failed = 0
        self._waiting: set[str] = set()  # steps waiting for a person's answer
        self._tokens = 0
        self._saved = 0  # tokens the cache's hits saved
        self._running: dict[str, float] = {}  # step in flight -> when it started
        self._partial: dict[str, str] = {}  # step in flight -> the tail of its latest partial output
        self._done_at_start = 0  # recorded before this run: not part of its pace
        self._early_skips: set[str] = set()  # items told skipped before their step expanded
        self._started_at: float | None = None
        self._drawn_at: float | None = None
        self._line_open = False

    # -- what it has seen ----------------------------------------------------

    @property
    def total(self) -> int:
        """Steps in the run being watched (and the items seen so far, in a shaped run)."""
        return self._total

    @property
    def done(self) -> int:
        """Steps whose output is recorded, those skipped on resume or by a condition included."""
        return self._done

    @property
    def skipped(self) -> int:
        """Steps skipped because the checkpoint resumed from recorded them."""
        return self._skipped

    @property
    def skipped_by_condition(self) -> int:
        """Steps and items skipped because a condition was false (counted as done)."""
        return self._by_condition

    @property
    def items(self) -> int:
        """Items of mapped steps seen so far (0 in a graph without shapes)."""
        return sum(len(v) for v in self._items.values())

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

    def remaining(self) -> float | None:
        """Seconds left at this run's pace so far, or ``None`` before a step of it finished."""
        ran = self._done - self._done_at_start
        left = self._total - self._done
        if ran <= 0 or left <= 0:
            return None
        return self.elapsed() / ran * left

    def status(self) -> str:
        """The one-line summary the terminal mode shows."""
        total = max(self._total, 1)
        filled = min(_BAR, _BAR * self._done // total)
        parts = [f"[{'#' * filled}{'.' * (_BAR - filled)}] {self._done}/{self._total} steps"]
        remaining = self.remaining()
        if remaining is not None:
            parts[0] += f", ~{_seconds(remaining)} left"
        if self._running:
            now = self._clock()
            shown = [f"{name} {_seconds(max(0.0, now - began))}{self._partial.get(name, '')}"
                     for name, began in list(self._running.items())[:_SHOWN_RUNNING]]
            more = len(self._running) - len(shown)
            parts.append(f"{len(self._running)} running ({', '.join(shown)}{f', +{more}' if more else ''})")
        parts.append(f"{self._tokens:,} tokens")
        if self._saved:
            parts.append(f"{self._saved:,} saved by the cache")
        parts.append(_seconds(self.elapsed()))
        return " | ".join(parts)

    def tick(self) -> None:
        """Redraw the status line now (on a terminal): what the timer does every ``tick`` seconds."""
        if self._started_at is not None:
            self._draw(force=True)

    # -- the callback --------------------------------------------------------

    def __call__(self, event: Event) -> None:
        """Take one trace event: update the counts, then draw or print."""
        if isinstance(event, RunStarted):
            self._run_started(event)
        elif isinstance(event, StepExpanded):
            self._expansion(event)
        elif isinstance(event, StepSkipped):
            self._skip(event)
        elif isinstance(event, StepStarted):
            self._count_item(event.name)
            self._running[event.name] = self._clock()
            self._partial.pop(event.name, None)  # (a retry starts its output afresh)
            self._draw()
        elif isinstance(event, StepFinished):
            self._partial.pop(event.name, None)
            self._finished(event)
        elif isinstance(event, StepPartial):
            self._partial_output(event)
        elif isinstance(event, StepCacheHit):
            self._saved += event.saved.total_tokens
            if not self._is_tty():
                self._line(f"{self._prefix()} cache hit {event.name}, saved "
                           f"{event.saved.total_tokens:,} tokens")
        elif isinstance(event, StepRetried | StepFailed):
            self._setback(event)
        elif isinstance(event, StepDenied):
            self._running.pop(event.name, None)
            reason = f": {event.reason}" if event.reason else ""
            self._note(f"{self._prefix()} DENIED {event.name}{reason}")
        elif isinstance(event, StepInterrupted):
            self._running.pop(event.name, None)
            self._draw()
        elif isinstance(event, StepWaiting):
            self._running.pop(event.name, None)
            self._waiting.add(event.name)
            self._note(f"{self._prefix()} WAITING {event.name} for an answer: {event.question.prompt}")
        elif isinstance(event, RunSettled):
            self._stop_ticking()
            self._running.clear()
            # A finished run settled every step: the ones skipped by a
            # condition are done too (a resume does not announce those it read).
            done = (event.total - event.left_out if event.outcome == "finished"
                    else event.completed + self._by_condition)
            self._done, self._total = done, max(event.total, self._total)
            notes = [f"{self._skipped} skipped"] if self._skipped else []
            if event.left_out:  # a run with only: outside its selection, for a later run
                notes.append(f"{event.left_out} left out")
            if self._by_condition:
                notes.append(f"{self._by_condition} skipped by a condition")
            if self._waiting:
                notes.append(f"{len(self._waiting)} waiting for an answer")
            summary = (
                f"run {_ending(event)}: {done}/{event.total} steps"
                + (f" ({', '.join(notes)})" if notes else "")
                + f", {self._tokens:,} tokens this run, {_seconds(self.elapsed())}"
            )
            if self._is_tty():
                self._draw(force=True)
                self._end_line()
            self._line(summary)

    def _setback(self, event: StepRetried | StepFailed) -> None:
        """Note an attempt that failed: retried (and when), or failed for good."""
        self._running.pop(event.name, None)
        if isinstance(event, StepRetried):
            self._note(
                f"{self._prefix()} retry {event.name} after attempt {event.attempt}: "
                f"{event.error_type}: {event.message} (next in {_seconds(event.delay)}"
                f"{' as the server asked' if event.retry_after == event.delay else ''})"
            )
            return
        self._failed += 1
        self._note(
            f"{self._prefix()} FAILED {event.name} on attempt {event.attempt}: "
            f"{event.error_type}: {event.message}"
            + ("" if event.retry_after is None
               else f" (the server asked to wait {_seconds(event.retry_after)})")
        )

    def _partial_output(self, event: StepPartial) -> None:
        """Show the end of a running step's latest partial output beside it (its text, one line)."""
        if event.name not in self._running:
            return
        text = event.value if isinstance(event.value, str) else repr(event.value)
        text = " ".join(text.split())
        self._partial[event.name] = f' "{text[-_PARTIAL_SHOWN:]}"' if text else ""
        self._draw()

    def _skip(self, event: StepSkipped) -> None:
        if not event.reason:  # recorded: counted as done, and as skipped, by RunStarted
            return
        step = _item_of(event.name, self._mapped)
        if step is not None and step not in self._expanded:
            self._early_skips.add(event.name)  # (see _expansion)
        self._count_item(event.name)
        self._running.pop(event.name, None)
        self._done += 1
        self._by_condition += 1
        if not self._is_tty():
            self._line(f"{self._prefix()} skipped {event.name}: {event.reason}")
        self._draw()

    def _finished(self, event: StepFinished) -> None:
        self._count_item(event.name)
        self._running.pop(event.name, None)
        self._done += 1
        self._tokens += event.usage.total_tokens
        shapes = self._shapes
        if shapes is not None:  # a graph with children: roll each step's tokens up to them
            owner = parent_of(event.name, shapes)
            while owner is not None:
                self._child_tokens[owner] = self._child_tokens.get(owner, 0) + event.usage.total_tokens
                owner = parent_of(owner, shapes)
        if not self._is_tty():
            items = self._items.get(event.name)
            if items is not None and event.duration is None:
                self._line(f"{self._prefix()} collected {event.name} from {len(items):,} item(s)")
            elif shapes is not None and event.name in shapes and shapes[event.name].child:
                self._line(f"{self._prefix()} done {event.name}, its child workflow's output; "
                           f"{self._child_tokens.get(event.name, 0):,} tokens in its steps this run")
            else:
                took = "" if event.duration is None else f" in {_seconds(event.duration)}"
                self._line(
                    f"{self._prefix()} done {event.name}{took}, "
                    f"{event.usage.total_tokens:,} tokens"
                )
        self._draw()

    def _run_started(self, event: RunStarted) -> None:
        self._stop_ticking()
        self._reset()
        self._started_at = self._clock()
        self._total = event.total
        # (Counted as ekit_core.progress counts: a resume's items and skips are in it.)
        self._done = self._done_at_start = event.recorded + event.skipped
        # Every recorded step or item is skipped by this run, a loop's iterations too (only the
        # declared steps among them are told one by one, as StepSkipped).
        self._skipped = event.recorded
        self._start_ticking()
        if not self._is_tty():
            resumed = f", {event.recorded:,} recorded" if event.recorded else ""
            resumed += f", {event.skipped:,} skipped" if event.skipped else ""
            self._line(f"run started: {event.total:,} steps{resumed}")
        self._draw(force=True)

    def _expansion(self, event: StepExpanded) -> None:
        """The exact count: the total grows by every item at once, a resume's recorded ones done."""
        # Items told before their step's expansion were counted one by one: an item an early
        # cutoff kept is told as skipped (its input unchanged) just before, and ``recorded``
        # counts it again. Each is counted once, as kept output, not as a condition's skip.
        seen = self._items.get(event.name, set())
        early = len(self._early_skips & seen)
        self._expanded.add(event.name)
        self._by_condition -= early
        if event.at_start:  # a resume's: RunStarted counted its items, those told before too
            self._total -= len(seen)
            self._done -= early
            return
        self._total += event.items - len(seen)
        self._done += event.recorded - early
        self._done_at_start += event.recorded
        self._draw()

    def _count_item(self, name: str) -> None:
        """Grow the total by ``name`` if it is an item not seen before."""
        step = _item_of(name, self._mapped)
        if step is None:
            return
        seen = self._items.setdefault(step, set())
        if name not in seen:
            seen.add(name)
            if step not in self._expanded:  # counted by its StepExpanded already
                self._total += 1

    # -- output ----------------------------------------------------------------

    def _start_ticking(self) -> None:
        """Redraw every ``tick`` seconds on the running loop (a terminal only; none: no timer)."""
        if self._tick_every is None or not self._is_tty():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # driven by hand (the pure core, a test): tick() redraws
        self._timer = loop.call_later(self._tick_every, self._on_tick)

    def _on_tick(self) -> None:
        self._timer = None
        self.tick()
        self._start_ticking()

    def _stop_ticking(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        if self._tty is None:
            try:
                self._tty = bool(self._out().isatty()) and not _plain_terminal()
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
        self._write(self._label + text + "\n")

    def _end_line(self) -> None:
        if self._line_open:
            self._write("\n")
            self._line_open = False

    def _note(self, text: str) -> None:
        """A line worth keeping: above the status line on a terminal."""
        if self._is_tty():
            self._write("\r" + self._label + text + _CLEAR_LINE + "\n")
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
        self._write("\r" + self._label + self.status() + _CLEAR_LINE)
        self._line_open = True

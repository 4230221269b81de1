"""A run page's timeline, drawn as inline SVG by the server: each attempt of each step as a bar.

A Gantt chart over the run's checkpoint: time runs left to right, one row
per step (and per item of a mapped step, under its step), each group a
``<g class="step">``. A bar is an attempt (``<rect class="attempt
outcome-<outcome>">``): ``recorded`` (the attempt whose output is recorded:
``began`` and ``durations``), ``failed`` (a step's latest failed attempt:
its failure record's ``began`` and ``ended``; earlier failed attempts keep
no times, their count is in the bar's title), ``waiting`` (a person's
answer: from when the step could ask, the end of its dependencies' recorded
attempts, or the previous answer, to the answer's time, or to the chart's
end while none is given), ``held`` (before a recorded attempt, each limit
that held it, named: the checkpoint's ``held``; and, in a run with
``drives``, a wait no limit was recorded for) and ``skipped`` (a mark
where the step was decided). Only runs that record durations have times; the chart then
says how to have them. Each attempt names the worker that ran it: the
checkpoint's ``drives`` (one per drive: a worker and when it began) give
the drive an attempt began in; a checkpoint without them, the run's owner.
Every text is escaped; each bar's ``data-`` fields hold its figures for
tests and tools.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape

from ekit_core import DriveRecord, WorkflowCheckpoint

__all__ = ["OUTCOMES", "Bar", "bars", "held_text", "timeline_svg", "utc_text", "worker_at"]

OUTCOMES = ("recorded", "failed", "waiting", "held", "skipped")
"""The outcomes a bar is coloured by (class ``outcome-<outcome>``)."""

_W, _LABEL, _RIGHT, _ROW, _TOP, _AXIS = 960, 170, 16, 18, 8, 24

_CHAR = 6.2  # the width of a character of a held bar's label, in the chart's units

HELD_MIN = 0.05
"""Seconds an attempt must have been held back before it began for a ``held`` bar: below
that, the gap is the run's own dispatch, not a limit."""


@dataclass(frozen=True, slots=True)
class Bar:
    """One attempt (or wait) of ``name``, a step or an item of step ``step``: from ``began`` to
    ``ended`` (UTC epoch seconds; ``ended`` is ``None`` while a wait goes on)."""

    step: str
    name: str
    outcome: str
    began: float
    ended: float | None
    note: str = ""
    limit: str = ""  # a held bar's: the limit that held the attempt ("" when none is recorded)


def worker_at(drives: Sequence[DriveRecord], at: float) -> str | None:
    """The worker of the drive that ``at`` falls in: the last one to begin at or before it
    (drives never overlap: one driver at a time); ``None`` before the first."""
    i = bisect.bisect_right([d.began for d in drives], at)
    return drives[i - 1].worker if i else None


def _step_of(name: str, graph: Mapping[str, object]) -> str:
    if name in graph or not name.endswith("]"):
        return name
    return name.partition("[")[0]


def _moment(at: object) -> float | None:
    """An answer's ``at`` as epoch seconds: a number, or ISO 8601 text; else ``None``."""
    if isinstance(at, bool):
        return None
    if isinstance(at, int | float):
        return float(at) if 0 <= at < 2.0**53 / 1e6 else None
    if isinstance(at, str):
        try:
            parsed = datetime.fromisoformat(at)
        except ValueError:
            return None
        return parsed.timestamp() if parsed.tzinfo is not None else None
    return None


def bars(cp: WorkflowCheckpoint) -> list[Bar]:
    """The bars of ``cp``'s attempts and waits, in no particular order."""
    graph: Mapping[str, tuple[str, ...]] = cp.graph or {}
    durations, began = cp.durations, cp.began
    ends: dict[str, float] = {}
    out: list[Bar] = []
    for name, moment in began.items():
        seconds = durations.get(name)
        if seconds is None:
            continue
        step, ended = _step_of(name, graph), moment + seconds
        ends[name] = ended
        if step != name:  # a mapped step is done when its last item is
            ends[step] = max(ended, ends.get(step, ended))
        out.append(Bar(_step_of(name, graph), name, "recorded", moment, moment + seconds,
                       f"recorded: took {seconds:,.3f} s"))
    for name, failure in cp.failures.items():
        if failure.began is None or failure.ended is None:
            continue
        earlier = failure.attempts - 1
        note = f"failed: {failure.error_type}: {failure.message}" + (
            f" (attempt {failure.attempts}; {earlier} earlier failed attempt(s) kept no times)"
            if earlier else "")
        out.append(Bar(_step_of(name, graph), name, "failed", failure.began, failure.ended, note))
    first = min((b.began for b in out), default=None)

    def ready(name: str) -> float | None:
        deps = graph.get(_step_of(name, graph), ())
        known = [ends[d] for d in deps if d in ends]
        return max(known) if known else first

    answered: dict[str, float] = {}

    for name, exchanges in cp.asked.items():
        start: float | None = ready(name)
        for i, exchange in enumerate(exchanges, 1):
            answer = exchange.answer
            at = None if answer is None else _moment(answer.at)
            if start is None:
                start = at
            if start is None:
                continue
            who = "" if answer is None else f" by {answer.by or '-'}"
            note = (f"waiting for a person: question {i} ({exchange.question.kind}): "
                    f"{exchange.question.prompt}; " + ("not answered yet" if answer is None
                                                       else f"answered{who}"))
            end = None if answer is None else (start if at is None else max(at, start))
            out.append(Bar(_step_of(name, graph), name, "waiting", start, end, note))
            if end is not None:
                start = end
                answered[name] = end
    out += _held(cp, out, ready, answered)
    for name, why in cp.skipped.items():
        at = ready(name)
        if at is not None:
            out.append(Bar(_step_of(name, graph), name, "skipped", at, at, f"skipped: {why}"))
    return out


def held_text(limit: str, seconds: float) -> str:
    """``held 1.25 s by resource:gpu``: one recorded hold, as the timeline and the step table say it."""
    return f"held {seconds:,.3f} s by {limit}"


def _held(cp: WorkflowCheckpoint, found: list[Bar], ready: Callable[[str], float | None],
          answered: Mapping[str, float]) -> list[Bar]:
    """``held`` bars before each recorded attempt that a limit held, or that began well after
    it could.

    The checkpoint's ``held`` names each limit that held the attempt and for how long: one
    bar each, named, back to back up to when it began, in the order they held it. Before
    them (or, with none recorded, up to when it began), a bar with no limit for the rest of
    the wait since it could begin (its dependencies recorded, its failed attempt or its wait
    for a person over, its drive begun) when that is at least :data:`HELD_MIN`: a checkpoint
    written before limits were recorded, or the worker's own dispatch. That one only with
    ``drives``: without them, when a resume began is unknown, and the time between two runs
    would pass for a hold."""
    drives, recorded = cp.drives, cp.held
    if not drives and not recorded:
        return []
    starts = [d.began for d in drives]
    out = []
    for b in found:
        if b.outcome != "recorded":
            continue
        end = b.began
        for limit, seconds in reversed(tuple(recorded.get(b.name, {}).items())):
            out.append(Bar(b.step, b.name, "held", end - seconds, end,
                           f"{held_text(limit, seconds)} before it began", limit))
            end -= seconds
        if not drives:
            continue
        since = ready(b.name)
        failure = cp.failures.get(b.name)
        moments = [m for m in (since, answered.get(b.name),
                               None if failure is None else failure.ended) if m is not None]
        i = bisect.bisect_right(starts, b.began)
        if i:
            moments.append(starts[i - 1])
        if not moments:
            continue
        since = max(moments)
        if end - since >= HELD_MIN:
            out.append(Bar(b.step, b.name, "held", since, end,
                           f"waited {end - since:,.3f} s before it began, though it could start; "
                           "no limit was recorded holding it (the worker's own dispatch: a save "
                           "it waited for, a lease renewal; or a checkpoint written before ekit "
                           "recorded which limit held an attempt)"))
    return out


def _clock(at: float, start: float, span: float) -> str:
    """A tick's label: the first one the time of day (UTC), the others the time since it."""
    if at > start:
        since = at - start
        return (f"+{since:.3g} s" if since < 60 else f"+{since / 60:.3g} min" if since < 3600
                else f"+{since / 3600:.3g} h")
    try:
        return time.strftime("%H:%M:%S UTC" if span < 86400 else "%m-%d %H:%M UTC", time.gmtime(at))
    except (OverflowError, OSError, ValueError):
        return "?"


def utc_text(at: float) -> str:
    """``at`` (UTC epoch seconds) as ``2026-12-07 18:20:01.250 UTC``."""
    return _utc(at)


def _utc(at: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d} UTC"
    except (OverflowError, OSError, ValueError):
        return repr(at)


def _rows(found: list[Bar], graph: Mapping[str, object]) -> list[tuple[str, str]]:
    """``(step, name)`` of each row, grouped by step in the graph's order (a step's own row
    first, then its items by when they first began)."""
    earliest: dict[str, float] = {}
    for b in found:
        earliest[b.name] = min(b.began, earliest.get(b.name, b.began))
    order = {name: i for i, name in enumerate(graph)}
    steps = sorted({b.step for b in found}, key=lambda s: (order.get(s, len(order)), s))
    rows: list[tuple[str, str]] = []
    for step in steps:
        names = sorted({b.name for b in found if b.step == step},
                       key=lambda n: (n != step, earliest[n], n))
        rows.extend((step, n) for n in names)
    return rows


def _bar(b: Bar, x0: float, y: float, width: float, worker: str | None) -> str:
    """One bar's ``<rect>``, its figures in ``data-`` fields and its ``<title>``, escaped
    (``worker``: who ran it, for an attempt; a wait or a skip names none)."""
    if b.outcome not in ("recorded", "failed"):
        worker = None
    on = f" on worker {worker}" if worker else ""
    until = "now (still waiting)" if b.ended is None else _utc(b.ended)
    title = f"{b.name}: {b.note}; {_utc(b.began)} to {until}{on}"
    attrs = (f'data-name="{escape(b.name, quote=True)}" data-outcome="{b.outcome}" '
             f'data-began="{b.began!r}" data-ended="{"" if b.ended is None else repr(b.ended)}"'
             + (f' data-worker="{escape(worker, quote=True)}"' if worker else "")
             + (f' data-limit="{escape(b.limit, quote=True)}"' if b.limit else ""))
    rect = (f'<rect class="attempt outcome-{b.outcome}" x="{x0:.1f}" y="{y + 3}" '
            f'width="{width:.1f}" height="{_ROW - 6}" {attrs}>'
            f"<title>{escape(title, quote=True)}</title></rect>")
    if not b.limit:
        return rect
    # The limit's name on the bar, cut to what fits (the title has it whole).
    fits = int((width - 4) // _CHAR)
    if fits < 3:
        return rect
    shown = b.limit if len(b.limit) <= fits else b.limit[:fits - 1] + "\u2026"
    return (rect + f'<text class="held-label" x="{x0 + 2:.1f}" y="{y + _ROW - 6}" '
            f'data-name="{escape(b.name, quote=True)}" data-limit="{escape(b.limit, quote=True)}">'
            f"{escape(shown)}</text>")


def timeline_svg(cp: WorkflowCheckpoint, worker: str | None = None, now: float | None = None) -> str:
    """The SVG text of ``cp``'s timeline (``""`` when it records no time); each attempt's worker
    is read off the checkpoint's ``drives``, else ``worker`` (a queue's run: its owner)."""
    found = bars(cp)
    drives = cp.drives
    if not found:
        return ""
    graph: Mapping[str, object] = cp.graph or {}
    start = min(b.began for b in found)
    end = max(b.began if b.ended is None else b.ended for b in found)
    if now is not None and any(b.ended is None for b in found):  # a wait goes on: up to now
        end = max(end, now)
    span = max(end - start, 1e-3)
    rows = _rows(found, graph)
    index = {name: i for i, (_, name) in enumerate(rows)}
    plot_w = _W - _LABEL - _RIGHT
    height = _TOP + len(rows) * _ROW + _AXIS

    def x(at: float) -> float:
        return _LABEL + plot_w * (at - start) / span

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="timeline-chart" class="chart timeline" '
        f'width="{_W}" height="{height}" viewBox="0 0 {_W} {height}" role="img" '
        f'aria-label="each attempt of each step on a time axis" data-start="{start!r}" '
        f'data-end="{end!r}">',
    ]
    bottom = _TOP + len(rows) * _ROW
    for i in range(5):
        at = start + span * i / 4
        px = x(at)
        out.append(f'<line class="grid" x1="{px:.1f}" y1="{_TOP}" x2="{px:.1f}" y2="{bottom}"/>'
                   f'<text class="axis-label" x="{px:.1f}" y="{bottom + 14}" '
                   f'text-anchor="{"start" if i == 0 else "end" if i == 4 else "middle"}">'
                   f"{escape(_clock(at, start, span))}</text>")
    by_step: dict[str, list[Bar]] = {}
    for b in found:
        by_step.setdefault(b.step, []).append(b)
    for step in dict.fromkeys(s for s, _ in rows):
        group = [f'<g class="step" data-step="{escape(step, quote=True)}">']
        for name in dict.fromkeys(n for s, n in rows if s == step):
            y = _TOP + index[name] * _ROW
            label = name if name == step else "  " + name
            group.append(f'<text class="row-label{"" if name == step else " item"}" x="{_LABEL - 6}" '
                         f'y="{y + _ROW - 5}" text-anchor="end">{escape(label)}</text>')
        for b in sorted(by_step[step], key=lambda b: (index[b.name], b.began)):
            x0 = x(b.began)
            width = max(2.0, x(end if b.ended is None else b.ended) - x0)
            ran_on = (worker_at(drives, b.began) or worker) if drives else worker
            group.append(_bar(b, x0, _TOP + index[b.name] * _ROW, width, ran_on))
        group.append("</g>")
        out.append("".join(group))
    out.append("</svg>")
    return "\n".join(out)

"""A queued run's live stream: its events and its steps' partial output, read from an offset.

This module owns the stream's rules; the backends (:mod:`.sqlite`,
:mod:`.postgres`) only store its rows. A worker publishes what the runs it
drives do (:mod:`ekit_runtime.queue.publisher`); anyone reads it back from
an offset with :meth:`RunQueue.stream` (a blocking iterator),
:meth:`RunQueue.astream` (an async one), ``ekit queue watch RUN`` or the
dashboard's server-sent events.

- **Append-only, numbered.** Each stored event has an ``offset``: 1, 2, 3
  ... within its run, never reused, never reordered. ``after=N`` reads the
  events from ``N + 1``; a reader that resumes with the offset of the last
  event it saw sees no gap and no repeat.
- **Bounded.** A run keeps its last ``cap`` events (the worker's
  ``stream_cap``); older ones are dropped, oldest first. A reader that asks
  for an offset already dropped is told: the first thing it reads is a
  ``gap`` event (never a silent jump), whose ``offset`` is the last one
  dropped, so that reading on after it resumes where the stream still is.
- **Fenced.** A worker's writes carry its lease, checked in the same
  transaction as the write: a worker that lost its lease publishes nothing.
- **Pruned with the run**: :meth:`RunQueue.prune` deletes its stream too.

The kinds a worker publishes are :data:`KINDS`; a reader adds two of its
own, never stored: ``gap`` (above) and ``end``, the last event of a stream
whose run has ended (``data``: its status and error; ``offset``: the
stream's last), after which the iterators stop.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ekit_runtime.queue.records import FINAL_STATUSES, check_run_id

__all__ = [
    "DEFAULT_CAP",
    "KINDS",
    "READ_LIMIT",
    "Published",
    "StreamEvent",
    "StreamPage",
    "StreamRows",
    "check_after",
    "check_cap",
    "check_read",
    "page_of",
]

KINDS: dict[str, str] = {
    "claimed": "a worker took the run (data: worker, resumed); a new epoch begins",
    "started": "an attempt of a step began (data: attempt)",
    "partial": "a piece of a running step's output, as partial() reported it (data: the value), or "
               "what an async generator step's text yield added to its previous one (data: that text)",
    "rewritten": "an async generator step yielded text that does not extend its previous yield "
                 "(data: the whole text, replacing what the step's partial events built)",
    "finished": "a step's output was saved (data: attempt, usage)",
    "retried": "an attempt failed and will be retried (data: attempt, error, delay)",
    "failed": "a step failed for good (data: attempt, error)",
    "waiting": "a step waits for a person's answer (data: question)",
    "dropped": "the worker's buffer overflowed and lost events (data: events, how many)",
}
"""The kinds of event a worker publishes, and what each means."""

DEFAULT_CAP = 100_000
"""Events a run's stream keeps unless the worker says otherwise (``Worker(stream_cap=...)``)."""

READ_LIMIT = 1000
"""At most this many events come back from one read of the database."""

_MAX_OFFSET = 2**63 - 1


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One event of a run's stream.

    ``offset`` is its place (from 1); ``epoch`` the lease it was published
    under (a new ``claimed`` event starts each); ``at`` when the worker saw
    it (epoch seconds); ``kind`` one of :data:`KINDS` (or the reader's
    ``gap`` and ``end``); ``step`` the step or item it is about, if any;
    ``data`` plain JSON data.
    """

    offset: int
    kind: str
    step: str | None
    data: Any
    epoch: int
    at: float

    def to_dict(self) -> dict[str, Any]:
        """The event as plain data (what ``ekit queue watch --json`` and the dashboard send)."""
        return {
            "offset": self.offset, "kind": self.kind, "step": self.step, "data": self.data,
            "epoch": self.epoch, "at": self.at,
        }


class Published(NamedTuple):
    """An event as a worker hands it to the queue: its kind, step, data as JSON text, and time."""

    kind: str
    step: str | None
    data: str
    at: float


class StreamRows(NamedTuple):
    """What one read of a backend returns: the run's state and the rows after an offset, one snapshot."""

    status: str
    error: str | None
    epoch: int
    first: int | None
    """The oldest offset the stream still keeps (``None``: it keeps none)."""
    last: int
    """The newest offset ever written (0: none was)."""
    rows: Sequence[tuple[int, str, str | None, str, int, float]]
    """``(offset, kind, step, data, epoch, at)`` in offset order, at most the limit asked."""


@dataclass(frozen=True, slots=True)
class StreamPage:
    """One read of a stream: the events after an offset, and whether the run has ended."""

    events: tuple[StreamEvent, ...]
    next_after: int
    """The offset to read after next time (the last event's here, else the one asked)."""
    ended: bool
    """The run is over and every event it will ever have is in this page (the last is ``end``)."""
    status: str


def check_after(after: object) -> int:
    """``after`` if it is an offset a reader may ask from: a whole number from 0 (a ``ValueError`` else)."""
    if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= _MAX_OFFSET:
        raise ValueError(f"after must be a whole number from 0 (an event's offset), got {after!r:.80}")
    return after


def check_cap(cap: object) -> int:
    """``cap`` if it is how many events a stream may keep: a whole number from 1 to 10,000,000."""
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= 10_000_000:
        raise ValueError(f"stream_cap must be a whole number from 1 to 10000000, got {cap!r:.80}")
    return cap


def check_read(run_id: object, after: object, limit: object = READ_LIMIT) -> tuple[str, int, int]:
    """A read's arguments, checked before the database is touched."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= READ_LIMIT:
        raise ValueError(f"limit must be a whole number from 1 to {READ_LIMIT}, got {limit!r:.80}")
    return check_run_id(run_id), check_after(after), limit


def page_of(run_id: str, after: int, limit: int, found: StreamRows) -> StreamPage:
    """The page a reader gets from one read: a ``gap`` first if it asked below what is kept,
    an ``end`` last if the run is over and nothing more will come."""
    if after > found.last:
        raise ValueError(
            f"after={after} is past the last event of run {run_id!r}'s stream (offset {found.last}): "
            "no reader can have seen it"
        )
    events: list[StreamEvent] = []
    if found.first is not None and after < found.first - 1:
        # Dropped by the cap: told, never skipped in silence.
        events.append(StreamEvent(
            found.first - 1, "gap", None, {"dropped_from": after + 1, "dropped_to": found.first - 1},
            found.epoch, time.time(),
        ))
    for offset, kind, step, data, epoch, at in found.rows:
        events.append(StreamEvent(offset, kind, step, _data(data), epoch, at))
    next_after = events[-1].offset if events else after
    ended = found.status in FINAL_STATUSES and len(found.rows) < limit
    if ended:
        events.append(StreamEvent(
            found.last, "end", None, {"status": found.status, "error": found.error}, found.epoch, time.time(),
        ))
    return StreamPage(tuple(events), next_after, ended, found.status)


def _data(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # (written by a worker of this module, so only a row edited by hand)
        return text

"""A durable run queue with leases and fencing, and the workers that drain it.

Submit runs of registered workflows to a queue; workers (``ekit worker``, or
:class:`Worker` inside your own event loop) claim them under a lease, drive
them with the runtime and save every checkpoint to the queue, each write
fenced by the lease's epoch. A lease that expires is taken by any live
worker, which resumes the run from its last checkpoint. See ``docs/queue.md``.

- :class:`SqliteQueue`: the embedded default (one machine, several processes).
- :class:`PostgresQueue`: several machines (needs the ``postgres`` extra,
  psycopg 3, imported only when this name is used).
- :func:`open_queue`: either, from a URL (``sqlite:///path`` or
  ``postgresql://...``).
- :data:`RUN_OPTIONS`: the plain-data run options a run may be submitted
  with (``submit(..., options=...)``), applied by the worker that drives it.
- :class:`StreamEvent`, :class:`StreamPage`: a run's live stream, as
  :meth:`RunQueue.stream` and :meth:`RunQueue.read_stream` hand it out
  (see ``docs/streams.md``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ekit_runtime.attempt import AttemptKey, attempt_key
from ekit_runtime.queue.contract import Ending, RunQueue
from ekit_runtime.queue.options import RUN_OPTIONS
from ekit_runtime.queue.records import (
    FINAL_STATUSES,
    STATUSES,
    InFlight,
    Lease,
    LeaseLostError,
    Limits,
    QueueUnavailableError,
    RunInfo,
    RunsPage,
    RunStateError,
    RunStatus,
    UnknownRunError,
)
from ekit_runtime.queue.sqlite import SqliteQueue
from ekit_runtime.queue.streams import StreamEvent, StreamPage
from ekit_runtime.queue.worker import StepsFailed, TraceFactory, Worker
from ekit_runtime.redaction import is_keyword_dsn, redacted

if TYPE_CHECKING:
    from ekit_runtime.queue.postgres import PostgresQueue

__all__ = [
    "FINAL_STATUSES",
    "RUN_OPTIONS",
    "STATUSES",
    "AttemptKey",
    "Ending",
    "InFlight",
    "Lease",
    "LeaseLostError",
    "Limits",
    "PostgresQueue",
    "QueueUnavailableError",
    "RunInfo",
    "RunQueue",
    "RunStateError",
    "RunStatus",
    "RunsPage",
    "SqliteQueue",
    "StepsFailed",
    "StreamEvent",
    "StreamPage",
    "TraceFactory",
    "UnknownRunError",
    "Worker",
    "attempt_key",
    "open_queue",
]


def __getattr__(name: str) -> Any:
    # PostgresQueue imports psycopg: only when someone asks for it.
    if name == "PostgresQueue":
        from ekit_runtime.queue.postgres import PostgresQueue

        return PostgresQueue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A word and "=" at the start: a key=value string of some kind, never a queue
# file we would create (is_keyword_dsn says whether libpq would take it).
_KEYWORD = re.compile(r"\s*([A-Za-z_]+)\s*=")


def open_queue(url: str, **options: Any) -> RunQueue:
    """Open the queue at ``url``, whichever way it is written.

    - SQLite: ``sqlite:///relative.db``, ``sqlite:////abs/path.db``, or a
      plain file path.
    - PostgreSQL: a libpq URL (``postgresql://...`` / ``postgres://...``) or
      a libpq key=value string (``host=db port=5432 dbname=runs``).

    Anything else (another scheme such as ``mysql://``) is a
    :class:`QueueUnavailableError` (a ``ValueError``), with any password in
    ``url`` hidden. ``options`` go to the backend's constructor (``limits=``, ...).
    """
    if not isinstance(url, str):
        # Never its repr: bytes or any other object may spell a password.
        raise ValueError(f"queue url must be a non-empty string, got {type(url).__name__}")
    if not url.strip():
        raise ValueError(f"queue url must be a non-empty string, got {url!r}")
    keyword = _KEYWORD.match(url)
    if url.startswith(("postgresql://", "postgres://")) or is_keyword_dsn(url):
        from ekit_runtime.queue.postgres import PostgresQueue

        return PostgresQueue(url, **options)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://").removeprefix("/")
        if not path:
            raise QueueUnavailableError(url, "names no database file (sqlite:///PATH)")
        return SqliteQueue(path, **options)
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", url) or keyword is not None:
        raise QueueUnavailableError(
            redacted(url),
            "not a queue url: expected sqlite:///PATH or postgresql://... (or a file path, "
            "./NAME for a file so named, or a libpq key=value string: host=... dbname=...)",
        )
    return SqliteQueue(url, **options)

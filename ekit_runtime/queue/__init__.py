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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ekit_runtime.queue.contract import RunQueue
from ekit_runtime.queue.keys import AttemptKey, attempt_key
from ekit_runtime.queue.records import (
    FINAL_STATUSES,
    STATUSES,
    Lease,
    LeaseLostError,
    Limits,
    RunInfo,
    RunStatus,
    UnknownRunError,
)
from ekit_runtime.queue.sqlite import SqliteQueue
from ekit_runtime.queue.worker import Worker

if TYPE_CHECKING:
    from ekit_runtime.queue.postgres import PostgresQueue

__all__ = [
    "FINAL_STATUSES",
    "STATUSES",
    "AttemptKey",
    "Lease",
    "LeaseLostError",
    "Limits",
    "PostgresQueue",
    "RunInfo",
    "RunQueue",
    "RunStatus",
    "SqliteQueue",
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


def open_queue(url: str, **options: Any) -> RunQueue:
    """Open the queue at ``url``: ``sqlite:///relative.db``, ``sqlite:////abs/path.db``,
    a plain file path (SQLite), or ``postgresql://...`` / ``postgres://...`` (a libpq URL).

    ``options`` go to the backend's constructor (``limits=``, ...).
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"queue url must be a non-empty string, got {url!r}")
    if url.startswith(("postgresql://", "postgres://")):
        from ekit_runtime.queue.postgres import PostgresQueue

        return PostgresQueue(url, **options)
    if url.startswith("sqlite://"):
        path = url.removeprefix("sqlite://").removeprefix("/")
        if not path:
            raise ValueError(f"queue url {url!r} names no database file")
        return SqliteQueue(path, **options)
    if "://" in url:
        raise ValueError(f"queue url {url!r}: expected sqlite:///PATH or postgresql://...")
    return SqliteQueue(url, **options)

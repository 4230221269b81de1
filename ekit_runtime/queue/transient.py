"""Which database errors a worker waits out, and which it lets end it.

A worker retries a call that failed for a reason that passes by itself:

- SQLite: the database is locked or busy (another process holds the write
  lock past the busy timeout), the disk is full (``SQLITE_FULL``: the
  transaction was rolled back, the file is intact, and the same save
  succeeds once space is freed), or an I/O error (``SQLITE_IOERR``).
- PostgreSQL: the session is gone (ended by ``pg_terminate_backend``, a
  failover, a proxy or server restart: ``AdminShutdown``, "the connection is
  closed", "server closed the connection unexpectedly"; the queue reconnects
  at its next call), the server is unreachable, starting, shutting down, out
  of connections, memory or disk (class 08, 53, 57, 58), or it rolled the
  transaction back (a deadlock, a serialisation failure, a lock or an
  idle-in-transaction timeout).

Anything else is permanent: a queue schema that is not what this version
expects (``no such table``, ``CorruptStoreError``), a value over the server's
limits (class 54), bad credentials or a database that does not exist, a bad
argument (``ValueError``), a refused write (``LeaseLostError``), a closed
queue, a bug. Retrying those would only hide them.
"""

from __future__ import annotations

import sqlite3
import sys
from typing import Any

__all__ = ["is_transient"]

# SQLite's primary result codes for failures that pass: another connection
# holds a lock, the disk is full, an I/O error, a WAL-index race.
_SQLITE_TRANSIENT = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_PROTOCOL,
    }
)
_SQLITE_IOERR_CORRUPTFS = sqlite3.SQLITE_IOERR | (33 << 8)  # the file system itself is damaged
_SQLITE_WORDING = ("locked", "busy", "disk is full", "disk i/o error")

# PostgreSQL SQLSTATE classes that pass: connection exception, transaction
# rollback, insufficient resources, operator intervention, system error.
_PG_TRANSIENT_CLASSES = frozenset({"08", "40", "53", "57", "58"})
_PG_TRANSIENT_STATES = frozenset({"25P03", "55P03"})  # idle-in-transaction timeout, lock not available
# What libpq says, without a SQLSTATE, when connecting fails for a reason waiting will not fix.
_PG_PERMANENT_WORDING = ("authentication", "pg_hba.conf", "does not exist")


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a database error that may succeed if the call is made again later."""
    if isinstance(exc, sqlite3.Error):
        return _sqlite_transient(exc)
    # psycopg is an optional extra: if it was never imported, this is not one of its errors.
    pg = sys.modules.get("psycopg")
    if pg is None or not isinstance(exc, pg.Error):
        return False
    return _pg_transient(exc, pg)


def _sqlite_transient(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        # Extended codes keep the primary one in the low byte.
        return code & 0xFF in _SQLITE_TRANSIENT and code != _SQLITE_IOERR_CORRUPTFS
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    # Raised without a code (by hand, or by an older sqlite3): go by SQLite's wording.
    text = str(exc).lower()
    return any(word in text for word in _SQLITE_WORDING)


def _pg_transient(exc: BaseException, pg: Any) -> bool:
    sqlstate = getattr(exc, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate:
        return sqlstate[:2] in _PG_TRANSIENT_CLASSES or sqlstate in _PG_TRANSIENT_STATES
    text = str(exc).lower()
    if isinstance(exc, pg.InterfaceError):
        # A connection caught in a state other than ready or broken: the queue reopens it.
        return text.startswith("cannot execute operations: the connection is in status")
    if not isinstance(exc, pg.OperationalError) or isinstance(exc, pg.errors.ProgramLimitExceeded):
        return False
    # No SQLSTATE: raised by the client. The connection is closed or lost, the
    # server cannot be reached ... unless the server refused who we are.
    return not any(word in text for word in _PG_PERMANENT_WORDING)

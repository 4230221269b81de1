"""Which database errors a worker waits out, and which it lets end it.

A worker retries a call that failed for a reason that passes by itself: the
SQLite database is locked or busy (another process holds the write lock past
the busy timeout), or the PostgreSQL server is unreachable, restarting, out of
connections, or rolled the transaction back (a deadlock, a serialisation
failure, an idle-in-transaction timeout). Anything else is permanent: a queue
schema that is not what this version expects (``no such table``,
``CorruptStoreError``), a bad argument (``ValueError``), a closed queue, a bug.
Retrying those would only hide them.
"""

from __future__ import annotations

import sqlite3
import sys

__all__ = ["is_transient"]

# SQLite's primary result codes for "another connection holds a lock".
_SQLITE_TRANSIENT = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a database error that may succeed if the call is made again later."""
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF in _SQLITE_TRANSIENT  # extended codes keep the primary one in the low byte
        # Raised without a code (by hand, or by an older sqlite3): go by SQLite's wording.
        text = str(exc).lower()
        return "locked" in text or "busy" in text
    # psycopg is an optional extra: if it was never imported, this is not one of its errors.
    pg = sys.modules.get("psycopg")
    if pg is None or not isinstance(exc, pg.Error):
        return False
    # psycopg files deadlocks and serialisation failures (class 40) under
    # OperationalError too; the idle-in-transaction timeout is an InternalError.
    if isinstance(exc, pg.errors.IdleInTransactionSessionTimeout):
        return True
    if not isinstance(exc, pg.OperationalError):
        return False
    # Class 28 (bad credentials) is an OperationalError too, but waiting will not fix it.
    sqlstate = getattr(exc, "sqlstate", None)
    return not (isinstance(sqlstate, str) and sqlstate.startswith("28"))

"""The PostgreSQL plumbing shared by ``PostgresStore`` and ``PostgresQueue``: psycopg, imported here only.

Importing this module imports psycopg 3 (the optional ``postgres`` extra);
nothing else in ekit does, so the core install keeps zero dependencies.
Connections are autocommit: a single statement is its own transaction, and
multi-statement ones are explicit ``with conn.transaction()`` blocks, so no
transaction is ever left open between calls (or while a step runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from ekit_runtime.redaction import scrub

try:
    import psycopg
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        "the PostgreSQL backends need psycopg 3: pip install 'ekit-workflows[postgres]'", name=exc.name
    ) from exc

__all__ = ["IDLE_TIMEOUT", "PgConnection", "connect", "psycopg"]

T = TypeVar("T")

# Any fixed number: serialises schema creation between processes starting at once
# (CREATE TABLE IF NOT EXISTS is not safe against a concurrent twin).
_SCHEMA_LOCK = 0x656B6974

# A session's idle_in_transaction_session_timeout (args: "<ms>ms"). Without it
# a client that stops inside a transaction (paused, or its network gone)
# keeps that transaction's row locks until TCP gives up, which can be hours;
# SET takes no parameters, set_config does.
IDLE_TIMEOUT = "SELECT set_config('idle_in_transaction_session_timeout', %s, false)"


def connect(conninfo: str) -> psycopg.Connection[Any]:
    """``psycopg.connect(conninfo, autocommit=True)``, its errors free of the password.

    libpq quotes a URL it cannot parse back in its message (``invalid
    percent-encoded token: "pa%zzSECRET"``): the error is raised again, of
    the same class, with the password scrubbed from its text (or the text
    withheld, see :func:`ekit_runtime.redaction.scrub`) and without the
    original as its cause or context, which a traceback would print.
    """
    try:
        return psycopg.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        safe = _scrubbed(exc, conninfo)
    raise safe from None


def _scrubbed(exc: psycopg.Error, conninfo: str) -> psycopg.Error:
    text = scrub(str(exc), conninfo)
    try:
        safe = type(exc)(text)
    except Exception:  # a subclass with a constructor of its own
        safe = psycopg.OperationalError(text)
    for note in getattr(exc, "__notes__", ()):
        safe.add_note(scrub(str(note), conninfo))
    return safe


class PgConnection:
    """One autocommit psycopg connection, reopened if it broke, used by one thread at a time."""

    def __init__(
        self,
        conninfo: str | psycopg.Connection[Any],
        schema: str,
        probe: str,
        *,
        idle_timeout: float | None = None,
    ) -> None:
        """Connect (or adopt an open connection) and run ``schema`` (DDL) unless table ``probe`` exists.

        ``idle_timeout`` (seconds) sets the session's
        ``idle_in_transaction_session_timeout``, here and on every reconnect.
        """
        self._lock = threading.RLock()
        self._idle_ms = None if idle_timeout is None else max(1, round(idle_timeout * 1000))
        if isinstance(conninfo, psycopg.Connection):
            self._conninfo: str | None = None
            self.conn: psycopg.Connection[Any] = conninfo
            conninfo.autocommit = True
            self._configure(conninfo)
        elif isinstance(conninfo, str) and conninfo:
            self._conninfo = conninfo
            self.conn = self._connect(conninfo)
        else:
            # Its type only, never its value: a DSN given as bytes holds the password.
            got = "an empty string" if conninfo == "" else type(conninfo).__name__
            raise ValueError(f"dsn must be a libpq connection string or a psycopg.Connection, got {got}")
        row = self.conn.execute("SELECT to_regclass(%s) IS NOT NULL", (probe,)).fetchone()
        if row is not None and row[0]:
            # Already there: skip the DDL, which would queue behind any
            # transaction holding the table (a worker paused mid-claim).
            return
        with self.transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute(schema)

    @contextmanager
    def transaction(self, *, snapshot: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """One transaction; ``snapshot=True`` makes it a read-only REPEATABLE READ one."""
        with self._lock:
            conn = self._connection()
            with conn.transaction():
                if snapshot:
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                yield conn

    def run(self, body: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``body(conn)`` with the connection, outside any transaction (each statement commits)."""
        with self._lock:
            return body(self._connection())

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn.broken and self._conninfo is not None:
            self.conn = self._connect(self._conninfo)
        return self.conn

    def _connect(self, conninfo: str) -> psycopg.Connection[Any]:
        conn = connect(conninfo)
        try:
            self._configure(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        if self._idle_ms is not None:
            conn.execute(IDLE_TIMEOUT, (f"{self._idle_ms}ms",))

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()

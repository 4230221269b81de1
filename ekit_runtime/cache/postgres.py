"""``PostgresCache``: the cross-run cache in PostgreSQL, for a fleet of workers on many hosts.

The table and the rules are :class:`~ekit_runtime.cache.sqlite.SqliteCache`'s:
one row per entry keyed by the entry's key, ``INSERT ... ON CONFLICT DO
NOTHING`` then a read of the row stored, in one transaction, so that two
workers filling one key leave one row and both go on with it; a transaction
commits whole or not at all, so a worker killed mid-write leaves nothing torn.
Importing this module imports psycopg (the ``postgres`` extra).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ekit_core import TokenUsage
from ekit_runtime.cache.base import Cache, CacheEntry
from ekit_runtime.cache.sqlite import check_bounds
from ekit_runtime.stores.codec import default_dumps, default_loads
from ekit_runtime.stores.pg import PgConnection, psycopg

__all__ = ["PostgresCache"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_cache (
    key text PRIMARY KEY,
    head text NOT NULL,
    step text NOT NULL,
    reads text NOT NULL,
    output text NOT NULL,
    input_tokens bigint NOT NULL,
    output_tokens bigint NOT NULL,
    llm_calls bigint NOT NULL,
    created double precision NOT NULL,
    size bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS ekit_cache_by_head ON ekit_cache (head, created);
CREATE INDEX IF NOT EXISTS ekit_cache_by_age ON ekit_cache (created);
"""

_COLUMNS = "key, head, step, reads, output, input_tokens, output_tokens, llm_calls, created"


class PostgresCache(Cache):
    """The cache in database ``dsn`` (a libpq URL or key=value string, or an open psycopg
    connection); bounds as :class:`~ekit_runtime.cache.sqlite.SqliteCache`'s."""

    def __init__(self, dsn: str | psycopg.Connection[Any], *, max_entries: int | None = None,
                 max_age: float | None = None, max_bytes: int | None = None) -> None:
        check_bounds(max_entries, max_age, max_bytes)
        self.max_entries, self.max_age, self.max_bytes = max_entries, max_age, max_bytes
        self._db = PgConnection(dsn, _SCHEMA, "ekit_cache", idle_timeout=60.0)

    def __repr__(self) -> str:
        return "PostgresCache(...)"  # never the DSN: it may hold a password

    def close(self) -> None:
        """Close the connection."""
        self._db.close()

    def candidates(self, head: str) -> list[CacheEntry]:
        """The entries under ``head`` younger than ``max_age``, newest first."""
        fresh = time.time() - self.max_age if self.max_age is not None else float("-inf")
        rows = self._again(lambda: self._db.run(lambda conn: conn.execute(
            f"SELECT {_COLUMNS} FROM ekit_cache WHERE head = %s AND created >= %s ORDER BY created DESC",
            (head, fresh)).fetchall()))
        return [_entry(row) for row in rows]

    def put(self, entry: CacheEntry) -> CacheEntry:
        """Store ``entry`` unless its key is taken (then the stored one wins); the stored entry."""
        key, reads, u = entry.key, default_dumps(dict(entry.reads)), entry.usage
        if "\x00" in entry.output or "\x00" in reads or "\x00" in entry.step:
            return entry  # PostgreSQL text holds no NUL: not stored, the run goes on with its own
        def write() -> Any:
            with self._db.transaction() as conn:
                conn.execute(
                    f"INSERT INTO ekit_cache ({_COLUMNS}, size) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (key) DO NOTHING",
                    (key, entry.head, entry.step, reads, entry.output, u.input_tokens, u.output_tokens,
                     u.llm_calls, entry.created, len(entry.output) + len(reads)))
                row = conn.execute(f"SELECT {_COLUMNS} FROM ekit_cache WHERE key = %s", (key,)).fetchone()
                self._bound(conn, key)
            return row

        row = self._again(write)
        assert row is not None
        return _entry(row)

    def _again(self, body: Callable[[], T]) -> T:
        """``body()``, once more on a new session if the server had dropped this one (a restart,
        an administrator, a proxy's idle cut): found only at the first statement sent on it. A
        failed transaction committed nothing, and the insert is idempotent: asking again is safe."""
        try:
            return body()
        except psycopg.OperationalError:
            if not self._db.conn.broken:
                raise
            return body()

    def _bound(self, conn: Any, keep: str | None, max_entries: int | None = None,
               max_age: float | None = None, max_bytes: int | None = None) -> int:
        max_entries = max_entries if max_entries is not None else self.max_entries
        max_age = max_age if max_age is not None else self.max_age
        max_bytes = max_bytes if max_bytes is not None else self.max_bytes
        dropped = 0
        if max_age is not None:
            dropped += conn.execute("DELETE FROM ekit_cache WHERE created < %s AND key IS DISTINCT FROM %s",
                                    (time.time() - max_age, keep)).rowcount
        if max_entries is not None:
            dropped += conn.execute(
                "DELETE FROM ekit_cache WHERE key IS DISTINCT FROM %s AND key IN (SELECT key FROM "
                "ekit_cache ORDER BY created DESC, key OFFSET %s)", (keep, max_entries)).rowcount
        if max_bytes is not None:
            dropped += conn.execute(
                "DELETE FROM ekit_cache WHERE key IS DISTINCT FROM %s AND key IN (SELECT key FROM "
                "(SELECT key, SUM(size) OVER (ORDER BY created DESC, key) AS running FROM ekit_cache) t "
                "WHERE running > %s)", (keep, max_bytes)).rowcount
        return dropped

    def entries(self) -> Iterator[CacheEntry]:
        """Every entry, newest first."""
        rows = self._db.run(lambda conn: conn.execute(
            f"SELECT {_COLUMNS} FROM ekit_cache ORDER BY created DESC").fetchall())
        return iter([_entry(row) for row in rows])

    def prune(self, *, max_entries: int | None = None, max_age: float | None = None,
              max_bytes: int | None = None) -> int:
        """Drop the oldest entries past the bounds given (the cache's own where not given)."""
        check_bounds(max_entries, max_age, max_bytes)
        with self._db.transaction() as conn:
            return self._bound(conn, None, max_entries, max_age, max_bytes)


def _entry(row: Any) -> CacheEntry:
    _key, head, step, reads, output, i, o, calls, created = row
    return CacheEntry(str(head), default_loads(str(reads)), str(output),
                      TokenUsage(int(i), int(o), int(calls)), float(created), str(step))

"""``PostgresCache``: the cross-run cache in PostgreSQL, for a fleet of workers on many hosts.

The tables and the rules are :class:`~ekit_runtime.cache.sqlite.SqliteCache`'s:
one row per entry keyed by the entry's key, ``INSERT ... ON CONFLICT DO
NOTHING`` then a read of the row stored, in one transaction, so that two
workers filling one key leave one row and both go on with it; a transaction
commits whole or not at all, so a worker killed mid-write leaves nothing torn.
The sets of keys each head's entries read (``ekit_cache_reads``) are written in
the same transaction: a lookup fetches by key, reading no entry made from other
inputs. A database written before that table existed is indexed when opened.
Importing this module imports psycopg (the ``postgres`` extra).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ekit_core import TokenUsage
from ekit_runtime.cache.base import Cache, CacheEntry, Hasher, find_by_key_sets, key_set, loads
from ekit_runtime.cache.sqlite import FEW, check_bounds
from ekit_runtime.stores.codec import default_dumps
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
CREATE TABLE IF NOT EXISTS ekit_cache_reads (
    head text NOT NULL,
    keys text NOT NULL,
    PRIMARY KEY (head, keys)
);
"""
# ekit_cache_reads: for each head, every set of keys its entries read (as SqliteCache keeps
# them), written in the transaction that writes the entry. A lookup reads those and fetches
# the entries by key: it never reads the entries made from other inputs.

_COLUMNS = "key, head, step, reads, output, input_tokens, output_tokens, llm_calls, created"
_E_COLUMNS = ", ".join(f"e.{c}" for c in _COLUMNS.split(", "))
_INDEXING = 0x656B6963  # the advisory lock under which one process indexes an old database


class PostgresCache(Cache):
    """The cache in database ``dsn`` (a libpq URL or key=value string, or an open psycopg
    connection); bounds as :class:`~ekit_runtime.cache.sqlite.SqliteCache`'s."""

    def __init__(self, dsn: str | psycopg.Connection[Any], *, max_entries: int | None = None,
                 max_age: float | None = None, max_bytes: int | None = None) -> None:
        check_bounds(max_entries, max_age, max_bytes)
        self.max_entries, self.max_age, self.max_bytes = max_entries, max_age, max_bytes
        # (probed by the newest table: a database made before it gets it, the rest exists)
        self._db = PgConnection(dsn, _SCHEMA, "ekit_cache_reads", idle_timeout=60.0)
        self._index_reads()

    def _index_reads(self) -> None:
        """Fill ``ekit_cache_reads`` from the entries of a database written before it existed."""
        def empty_index(conn: Any) -> bool:
            return (conn.execute("SELECT 1 FROM ekit_cache_reads LIMIT 1").fetchone() is None
                    and conn.execute("SELECT 1 FROM ekit_cache LIMIT 1").fetchone() is not None)

        if not self._db.run(empty_index):
            return
        with self._db.transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_INDEXING,))  # one process indexes
            if not empty_index(conn):
                return
            rows = conn.execute("SELECT DISTINCT head, reads FROM ekit_cache").fetchall()
            sets = sorted({(str(h), key_set(loads(str(r)))) for h, r in rows})
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO ekit_cache_reads VALUES (%s, %s) ON CONFLICT DO NOTHING", sets)

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

    def few(self, heads: Sequence[str]) -> dict[str, list[CacheEntry] | None]:
        """See :meth:`Cache.few`: one query, reading at most ``FEW + 1`` entries a head."""
        unique = list(dict.fromkeys(heads))
        fresh = time.time() - self.max_age if self.max_age is not None else float("-inf")
        rows = self._again(lambda: self._db.run(lambda conn: conn.execute(
            f"SELECT {_E_COLUMNS} FROM unnest(%s::text[]) AS w(h) CROSS JOIN LATERAL ("
            f"SELECT {_COLUMNS} FROM ekit_cache AS c WHERE c.head = w.h AND c.created >= %s "
            f"ORDER BY c.created DESC LIMIT {FEW + 1}) AS e", (unique, fresh)).fetchall()))
        by_head: dict[str, list[CacheEntry] | None] = {h: [] for h in unique}
        for row in rows:  # (newest first under each head, as the query reads them)
            listed = by_head[row[1]]
            if listed is not None:
                listed.append(_entry(row))
                if len(listed) > FEW:
                    by_head[row[1]] = None
        for listed in by_head.values():
            if listed is not None:
                listed.sort(key=lambda e: e.created, reverse=True)
        return by_head

    def find(self, wanted: Sequence[tuple[str, Hasher]]) -> list[CacheEntry | None]:
        """See :meth:`Cache.find`: two indexed queries (the key sets read under the heads, then
        the entries by key), whichever the number of entries under a head."""
        heads = list(dict.fromkeys(head for head, _ in wanted))
        rows = self._again(lambda: self._db.run(lambda conn: conn.execute(
            "SELECT head, keys FROM ekit_cache_reads WHERE head = ANY(%s)", (heads,)).fetchall()))
        key_sets: dict[str, list[list[str]]] = {}
        for head, keys in rows:
            key_sets.setdefault(head, []).append(loads(keys))
        return find_by_key_sets(wanted, key_sets, self._by_keys)

    def _by_keys(self, pairs: list[tuple[str, str]]) -> list[CacheEntry]:
        """The fresh entries stored under the keys of ``pairs`` (``(head, key)``)."""
        keys = [key for _, key in pairs]
        fresh = time.time() - self.max_age if self.max_age is not None else float("-inf")
        rows = self._again(lambda: self._db.run(lambda conn: conn.execute(
            f"SELECT {_COLUMNS} FROM ekit_cache WHERE key = ANY(%s) AND created >= %s",
            (keys, fresh)).fetchall()))
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
                conn.execute("INSERT INTO ekit_cache_reads VALUES (%s, %s) ON CONFLICT DO NOTHING",
                             (entry.head, key_set(entry.reads)))
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
        if dropped:  # (a head's key sets stay while it has entries: few, and harmless)
            conn.execute("DELETE FROM ekit_cache_reads AS r WHERE NOT EXISTS "
                         "(SELECT 1 FROM ekit_cache AS e WHERE e.head = r.head)")
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
    key, head, step, reads, output, i, o, calls, created = row
    return CacheEntry._read_back(str(head), loads(str(reads)), str(output),
                                 TokenUsage(int(i), int(o), int(calls)), float(created), str(step), str(key))

"""``SqliteCache``: the cross-run cache in one SQLite file (the embedded default).

One table, one row per entry, keyed by the entry's key (its head and its
reads: see :mod:`ekit_runtime.cache.base`). A ``put`` inserts the row unless
the key is taken and reads back the row stored, in one transaction: two
processes filling one key leave one row and both get it back. SQLite writes
a transaction whole or not at all (WAL, rolled back on open after a crash),
so a process killed while writing leaves no torn entry to serve.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ekit_core import TokenUsage
from ekit_core.usage import NO_USAGE
from ekit_runtime.cache.base import Cache, CacheEntry, Hasher, find_by_key_sets, key_set, loads
from ekit_runtime.stores.codec import default_dumps, default_loads

__all__ = ["SqliteCache"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_cache (
    key TEXT PRIMARY KEY,
    head TEXT NOT NULL,
    step TEXT NOT NULL,
    reads TEXT NOT NULL,
    output TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    llm_calls INTEGER NOT NULL,
    created REAL NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS ekit_cache_by_head ON ekit_cache (head, created);
CREATE INDEX IF NOT EXISTS ekit_cache_by_age ON ekit_cache (created);
CREATE TABLE IF NOT EXISTS ekit_cache_reads (
    head TEXT NOT NULL,
    keys TEXT NOT NULL,
    PRIMARY KEY (head, keys)
) WITHOUT ROWID;
"""
# ekit_cache_reads: for each head, every set of keys its entries read (a JSON list, sorted),
# usually one. A lookup reads those, hashes the step's values of each set's keys, and
# fetches the entries by key: it never reads the entries made from other inputs.

FEW = 8
"""A head with at most this many entries is read whole by :meth:`SqliteCache.few`."""
_CHUNK = 400  # ? parameters a query (SQLite's limit is 999 on old builds)

_COLUMNS = "key, head, step, reads, output, input_tokens, output_tokens, llm_calls, created"
_E_COLUMNS = ", ".join(f"e.{c}" for c in _COLUMNS.split(", "))


def check_bounds(max_entries: object, max_age: object, max_bytes: object) -> None:
    """Refuse, naming it, a bound that is not a positive number (``None``: no bound)."""
    for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {value!r:.80}")
    if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int | float)
                                or not max_age > 0 or max_age == float("inf")):
        raise ValueError(f"max_age must be None or a number of seconds > 0, got {max_age!r:.80}")


class SqliteCache(Cache):
    """The cache in the SQLite file at ``path`` (created if missing), shared by any process.

    ``max_entries``, ``max_age`` (seconds) and ``max_bytes`` (of stored
    outputs and reads) bound it: an entry older than ``max_age`` is never
    served, and each ``put`` drops the oldest entries past the bounds.
    """

    def __init__(self, path: str | os.PathLike[str], *, max_entries: int | None = None,
                 max_age: float | None = None, max_bytes: int | None = None) -> None:
        check_bounds(max_entries, max_age, max_bytes)
        self.path = Path(path)
        self.max_entries, self.max_age, self.max_bytes = max_entries, max_age, max_bytes
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False,
                                     timeout=60.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(_SCHEMA)
        self._index_reads()
        self._json = _FEW_JSON if _has_json(self._conn) else None

    def _index_reads(self) -> None:
        """Fill ``ekit_cache_reads`` from the entries of a file written before it existed."""
        conn = self._conn
        if conn.execute("SELECT 1 FROM ekit_cache_reads LIMIT 1").fetchone() is not None or (
                conn.execute("SELECT 1 FROM ekit_cache LIMIT 1").fetchone() is None):
            return
        with self._lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                rows = conn.execute("SELECT DISTINCT head, reads FROM ekit_cache").fetchall()
                conn.executemany("INSERT OR IGNORE INTO ekit_cache_reads VALUES (?, ?)",
                                 {(h, _keys(default_loads(r))) for h, r in rows})
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    local = True  # one local file: its calls are made on the loop (a thread hop costs more)

    def __repr__(self) -> str:
        return f"SqliteCache({str(self.path)!r})"

    def __enter__(self) -> SqliteCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        with self._lock:
            self._conn.close()

    def _fresh_after(self) -> float:
        return time.time() - self.max_age if self.max_age is not None else float("-inf")

    def candidates(self, head: str) -> list[CacheEntry]:
        """The entries under ``head`` younger than ``max_age``, newest first."""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {_COLUMNS} FROM ekit_cache WHERE head = ? AND created >= ? "
                "ORDER BY created DESC", (head, self._fresh_after())).fetchall()
        return [_entry(row) for row in rows]

    def few(self, heads: Sequence[str]) -> dict[str, list[CacheEntry] | None]:
        """See :meth:`Cache.few`: one query, reading at most ``FEW + 1`` entries a head."""
        unique = list(dict.fromkeys(heads))
        by_head: dict[str, list[CacheEntry] | None] = {h: [] for h in unique}
        fresh = self._fresh_after()
        with self._lock:
            for i in range(0, len(unique), _CHUNK):
                part = unique[i:i + _CHUNK]
                # Every entry of these heads, if they hold no more than FEW + 1 each on the
                # whole: a plain indexed read, about half the cost of the bounded one below.
                bound = (FEW + 1) * len(part)
                entries = self._plain_few(part, fresh, bound + 1)
                if len(entries) > bound:  # some head holds more: at most FEW + 1 of each, newest first
                    entries = [_entry(row) for row in self._conn.execute(
                        f"WITH wanted(h) AS (VALUES {', '.join(['(?)'] * len(part))}) "
                        f"SELECT {_E_COLUMNS} FROM wanted JOIN ekit_cache AS e ON e.key IN ("
                        "SELECT c.key FROM ekit_cache AS c WHERE c.head = wanted.h AND c.created >= ? "
                        f"ORDER BY c.created DESC LIMIT {FEW + 1})", (*part, fresh))]
                for entry in entries:
                    listed = by_head[entry.head]
                    if listed is not None:
                        listed.append(entry)
                        if len(listed) > FEW:
                            by_head[entry.head] = None
        for listed in by_head.values():
            if listed is not None and len(listed) > 1:
                listed.sort(key=_created, reverse=True)
        return by_head

    def _plain_few(self, heads: list[str], fresh: float, limit: int) -> list[CacheEntry]:
        """Up to ``limit`` fresh entries under ``heads``, in no order. The heads go as one JSON
        text that ``json_each`` walks, where SQLite has it: a statement of one parameter, not
        one ``?`` a head to parse and bind and an ``IN`` list to sort (2k a head less); each
        row names its head by its place in the text, and its usage in one column, ``NULL`` for
        none (a column fewer to make into Python is about 1k a row)."""
        if self._json is not None:
            return [_json_entry(row, heads) for row in self._conn.execute(
                self._json, (default_dumps(heads), fresh, limit))]
        return [_entry(row) for row in self._conn.execute(
            f"SELECT {_COLUMNS} FROM ekit_cache WHERE head IN ({', '.join('?' * len(heads))}) "
            "AND created >= ? LIMIT ?", (*heads, fresh, limit))]

    def find(self, wanted: Sequence[tuple[str, Hasher]]) -> list[CacheEntry | None]:
        """See :meth:`Cache.find`: two indexed queries (the key sets read under the heads, then
        the entries by key), whichever the number of entries under a head."""
        heads = list(dict.fromkeys(head for head, _ in wanted))
        shapes: dict[str, list[list[str]]] = {}
        parsed: dict[str, list[str]] = {}  # a set's text -> its keys: most heads share a few sets
        with self._lock:
            for i in range(0, len(heads), _CHUNK):
                part = heads[i:i + _CHUNK]
                for head, keys in self._conn.execute(
                        "SELECT head, keys FROM ekit_cache_reads WHERE head IN "
                        f"({', '.join('?' * len(part))})", part):
                    read = parsed.get(keys)
                    if read is None:
                        read = parsed[keys] = loads(keys)
                    if head in shapes:
                        shapes[head].append(read)
                    else:
                        shapes[head] = [read]
        return find_by_key_sets(wanted, shapes, self._by_keys)

    def _by_keys(self, pairs: list[tuple[str, str]]) -> list[CacheEntry]:
        """The fresh entries stored under the keys of ``pairs`` (``(head, key)``)."""
        keys = [key for _, key in pairs]
        rows = []
        with self._lock:
            for i in range(0, len(keys), _CHUNK):
                part = keys[i:i + _CHUNK]
                rows += self._conn.execute(
                    f"SELECT {_COLUMNS} FROM ekit_cache WHERE key IN ({', '.join('?' * len(part))}) "
                    "AND created >= ?", (*part, self._fresh_after())).fetchall()
        return [_entry(row) for row in rows]

    def put(self, entry: CacheEntry) -> CacheEntry:
        """Store ``entry`` unless its key is taken (then the stored one wins); the stored entry."""
        key, reads = entry.key, default_dumps(dict(entry.reads))
        u = entry.usage
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(
                    f"INSERT INTO ekit_cache ({_COLUMNS}, size) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (key) DO NOTHING",
                    (key, entry.head, entry.step, reads, entry.output, u.input_tokens, u.output_tokens,
                     u.llm_calls, entry.created, len(entry.output) + len(reads)))
                row = conn.execute(f"SELECT {_COLUMNS} FROM ekit_cache WHERE key = ?", (key,)).fetchone()
                conn.execute("INSERT OR IGNORE INTO ekit_cache_reads VALUES (?, ?)",
                             (entry.head, _keys(entry.reads)))
                self._bound(conn, keep=key)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return _entry(row)

    def _bound(self, conn: sqlite3.Connection, keep: str | None = None, max_entries: int | None = None,
               max_age: float | None = None, max_bytes: int | None = None) -> int:
        """Drop what is past the bounds, oldest first (never ``keep``); how many rows went."""
        max_entries = max_entries if max_entries is not None else self.max_entries
        max_age = max_age if max_age is not None else self.max_age
        max_bytes = max_bytes if max_bytes is not None else self.max_bytes
        dropped = 0
        if max_age is not None:
            dropped += conn.execute("DELETE FROM ekit_cache WHERE created < ? AND key IS NOT ?",
                                    (time.time() - max_age, keep)).rowcount
        if max_entries is not None:
            dropped += conn.execute(
                "DELETE FROM ekit_cache WHERE key IS NOT ? AND key IN (SELECT key FROM ekit_cache "
                "ORDER BY created DESC LIMIT -1 OFFSET ?)", (keep, max_entries)).rowcount
        if max_bytes is not None:
            dropped += conn.execute(
                "DELETE FROM ekit_cache WHERE key IS NOT ? AND key IN (SELECT key FROM "
                "(SELECT key, SUM(size) OVER (ORDER BY created DESC, key) AS running FROM ekit_cache) "
                "WHERE running > ?)", (keep, max_bytes)).rowcount
        if dropped:  # (a head's key sets stay while it has entries: few, and harmless)
            conn.execute("DELETE FROM ekit_cache_reads WHERE head NOT IN (SELECT head FROM ekit_cache)")
        return dropped

    def entries(self) -> Iterator[CacheEntry]:
        """Every entry, newest first."""
        with self._lock:
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM ekit_cache ORDER BY created DESC").fetchall()
        return iter([_entry(row) for row in rows])

    def prune(self, *, max_entries: int | None = None, max_age: float | None = None,
              max_bytes: int | None = None) -> int:
        """Drop the oldest entries past the bounds given (the cache's own where not given)."""
        check_bounds(max_entries, max_age, max_bytes)
        with self._lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                dropped = self._bound(conn, None, max_entries, max_age, max_bytes)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return dropped


# CROSS JOIN: the heads drive, each one an index seek (SQLite keeps the order written).
_FEW_JSON = ("SELECT e.key, w.key, e.step, e.reads, e.output, NULLIF(e.input_tokens || ' ' || "
             "e.output_tokens || ' ' || e.llm_calls, '0 0 0'), e.created FROM json_each(?) AS w "
             "CROSS JOIN ekit_cache AS e ON e.head = w.value WHERE e.created >= ? LIMIT ?")


def _has_json(conn: sqlite3.Connection) -> bool:
    """Whether this SQLite has ``json_each`` (built in since 3.38, an option before)."""
    try:
        conn.execute("SELECT value FROM json_each('[1]')").fetchall()
    except sqlite3.OperationalError:
        return False
    return True


def _entry(row: tuple[Any, ...]) -> CacheEntry:
    key, head, step, reads, output, i, o, calls, created = row
    usage = TokenUsage(int(i), int(o), int(calls)) if i or o or calls else NO_USAGE
    return CacheEntry._read_back(str(head), {} if reads == "{}" else loads(str(reads)), str(output),
                                 usage, float(created), str(step), str(key))


def _json_entry(row: tuple[Any, ...], heads: list[str]) -> CacheEntry:
    """:func:`_entry` of a row of ``_FEW_JSON``: its head by its place in ``heads``, its usage
    as one text (``"IN OUT CALLS"``) or ``None``."""
    key, at, step, reads, output, used, created = row
    usage = NO_USAGE if used is None else TokenUsage(*map(int, str(used).split(" ")))
    return CacheEntry._read_back(heads[at], {} if reads == "{}" else loads(str(reads)), str(output),
                                 usage, float(created), str(step), str(key))


def _created(entry: CacheEntry) -> float:
    return entry.created


def _keys(reads: object) -> str:
    """The set of keys ``reads`` recorded, as ``ekit_cache_reads`` holds it."""
    return key_set(reads)  # type: ignore[arg-type]

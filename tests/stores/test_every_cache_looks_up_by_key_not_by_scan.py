"""Every ready-made cache answers a lookup by key, however many other inputs a step has seen.

What users rely on: a step run on a stream of documents (one cache entry per
document) is still looked up in a moment, on a shared directory and on
PostgreSQL as on SQLite. Each cache keeps the sets of keys each head's entries
read; a lookup hashes the step's values of those keys and reads the one entry
that key names, never the entries made from other inputs. A cache written
before that index existed is indexed when opened, and its entries still hit.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Cache, DirectoryCache, SqliteCache
from ekit_runtime.cache import CacheEntry, directory, sqlite
from ekit_runtime.cache.base import CachedStep
from tests.support.queue_backends import fresh_postgres

KINDS = ("sqlite", "directory", "postgres")


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def where(kind: str, tmp_path: Path) -> Iterator[str]:
    if kind == "postgres":
        with fresh_postgres() as url:
            yield url
        return
    yield str(tmp_path)


def open_cache(kind: str, where: str) -> Cache:
    if kind == "postgres":
        from ekit_runtime.cache.postgres import PostgresCache

        return PostgresCache(where)
    return SqliteCache(Path(where) / "cache.db") if kind == "sqlite" else DirectoryCache(Path(where) / "dir")


def count_entries_read(kind: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every entry the cache of ``kind`` reads from storage from now on."""
    read: list[Any] = []
    if kind == "postgres":
        from ekit_runtime.cache import postgres

        module: Any = postgres
        name = "_entry"
    else:
        module, name = (sqlite, "_entry") if kind == "sqlite" else (directory, "_read")
    real = getattr(module, name)

    def counted(arg: Any) -> Any:
        entry = real(arg)
        if entry is not None:  # (a file the directory cache opens in vain holds no entry)
            read.append(entry)
        return entry
    monkeypatch.setattr(module, name, counted)
    return read


def summarize(cache: Cache) -> CachedStep:
    return CachedStep(cache, "summarize", "f" * 32, None, (), lambda v: v, lambda v: v)


def test_a_lookup_reads_only_the_entry_its_inputs_name(kind: str, where: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = open_cache(kind, where)
    step = summarize(cache)
    head = step.head(None)
    for i in range(300):  # the step, run before on 300 other documents (and once with a second input)
        cache.put(CacheEntry(head, {"document": f"{i:064x}"}, f'"summary {i}"', step="summarize"))
    cache.put(CacheEntry(head, {"document": "0" * 64, "style": "-"}, '"short"', step="summarize"))
    seen = {"document": "seen before"}
    cache.put(CacheEntry(head, {"document": str(step.hasher(seen)("document"))}, '"its summary"'))
    read = count_entries_read(kind, monkeypatch)
    assert step.lookup(head, {"document": "a new one"}) is None
    assert read == []  # no entry holds these inputs: none is read
    hit = step.lookup(head, seen)
    assert hit is not None and hit.output == '"its summary"' and len(read) == 1
    cache.close()


def _unindex(kind: str, where: str) -> None:
    """Make the cache at ``where`` as a version without the index left it."""
    if kind == "sqlite":
        with sqlite3.connect(Path(where) / "cache.db") as conn:
            conn.execute("DROP TABLE ekit_cache_reads")
    elif kind == "directory":
        root = Path(where) / "dir"
        (root / ".ekit-indexed").unlink()
        for keys in root.glob("*/.keys"):
            shutil.rmtree(keys)
    else:
        import psycopg

        with psycopg.connect(where, autocommit=True) as conn:
            conn.execute("DROP TABLE ekit_cache_reads")


def test_a_cache_written_before_the_index_is_indexed_when_opened(kind: str, where: str) -> None:
    cache = open_cache(kind, where)
    step = summarize(cache)
    head, seen = step.head(None), {"document": "seen before"}
    cache.put(CacheEntry(head, {"document": str(step.hasher(seen)("document"))}, '"its summary"'))
    cache.put(CacheEntry(head, {}, '"read nothing"', created=1.0))
    cache.close()
    _unindex(kind, where)
    reopened = open_cache(kind, where)
    found = summarize(reopened).lookup(head, seen)
    assert found is not None and found.output == '"its summary"'
    assert summarize(reopened).lookup(head, {"document": "new"}) is not None  # the entry that read nothing
    reopened.close()


def test_a_damaged_index_file_costs_a_miss_and_the_next_write_mends_it(tmp_path: Path) -> None:
    cache = DirectoryCache(tmp_path / "dir")
    step = summarize(cache)
    head, seen = step.head(None), {"document": "seen before"}
    entry = CacheEntry(head, {"document": str(step.hasher(seen)("document"))}, '"its summary"')
    cache.put(entry)
    (index,) = (tmp_path / "dir" / head / ".keys").iterdir()
    index.write_bytes(index.read_bytes()[:-3])  # torn by hand
    assert step.lookup(head, seen) is None  # never a guess: a miss
    cache.put(entry)
    found = step.lookup(head, seen)
    assert found is not None and found.output == '"its summary"'

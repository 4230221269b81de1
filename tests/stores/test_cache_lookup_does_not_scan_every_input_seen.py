"""A cache lookup costs about the same however many other inputs a step was run with before.

What users rely on: a cache that has seen a step run on many inputs (a
summary step fed a stream of documents, one run each) still answers in a
moment. A lookup that read and parsed every entry recorded under the step's
head (its name, code, version, item), one per input ever seen, to compare
their reads with the context, was linear in the inputs seen. SqliteCache
keeps the sets of keys each head's entries read, and fetches by key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import SqliteCache
from ekit_runtime.cache import CacheEntry, sqlite
from ekit_runtime.cache.base import CachedStep


def test_a_lookup_reads_few_entries_among_many_inputs(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = SqliteCache(tmp_path / "cache.db")
    step = CachedStep(cache, "summarize", "f" * 32, None, (), lambda v: v, lambda v: v)
    head = step.head(None)
    for i in range(500):  # the step, run before on 500 other documents
        cache.put(CacheEntry(head, {"document": f"{i:064x}"}, '"a summary"', step="summarize"))
    read: list[Any] = []
    entry = sqlite._entry
    monkeypatch.setattr(sqlite, "_entry", lambda row: read.append(row) or entry(row))
    assert step.lookup(head, {"document": "a new one"}) is None
    assert len(read) <= 5
    # and the one entry that matches is found, read alone
    seen = {"document": "seen before"}
    cache.put(CacheEntry(head, {"document": str(step.hasher(seen)("document"))}, '"its summary"'))
    read.clear()
    hit = step.lookup(head, seen)
    assert hit is not None and hit.output == '"its summary"' and len(read) == 1
    cache.close()


def test_a_cache_file_written_before_the_index_is_indexed_when_opened(tmp_path: Path) -> None:
    import sqlite3

    where = tmp_path / "old.db"
    cache = SqliteCache(where)
    step = CachedStep(cache, "summarize", "f" * 32, None, (), lambda v: v, lambda v: v)
    head, seen = step.head(None), {"document": "seen before"}
    cache.put(CacheEntry(head, {"document": str(step.hasher(seen)("document"))}, '"its summary"'))
    cache.close()
    with sqlite3.connect(where) as conn:  # as a file from before ekit_cache_reads was kept
        conn.execute("DROP TABLE ekit_cache_reads")
    reopened = SqliteCache(where)
    found = CachedStep(reopened, "summarize", "f" * 32, None, (), lambda v: v, lambda v: v).lookup(head, seen)
    assert found is not None and found.output == '"its summary"'
    reopened.close()

"""A cache lookup costs about the same however many other inputs a step was run with before.

What users rely on: a cache that has seen a step run on many inputs (a
summary step fed a stream of documents, one run each) still answers in a
moment. Today a lookup reads and parses every entry recorded under the step's
head (its name, code, version, item), one per input ever seen, to compare
their reads with the context: linear in the inputs seen, so a fleet's cache
slows every step as it fills.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import SqliteCache
from ekit_runtime.cache import CacheEntry, sqlite
from ekit_runtime.cache.base import CachedStep


@pytest.mark.xfail(strict=True, reason="a lookup reads every entry under the step's head; entries "
                   "need an index by the set of keys read (their shape), then one fetch by key")
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
    cache.close()

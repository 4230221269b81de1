"""A cache that fails or holds damaged entries costs a miss at most, never a paid output or a run.

What users rely on: the cache saves calls; it must never lose one. A cache
that cannot store (a full disk, a dropped connection) after the step's call
was paid leaves the output with the run, which goes on (a warning says so);
an entry damaged by hand or by a fault (its reads or its output no longer
JSON) is a miss, and the step runs, instead of failing it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import SqliteCache, Step, Workflow
from ekit_runtime.cache import CacheEntry


class _CannotStore(SqliteCache):
    def put(self, entry: CacheEntry) -> CacheEntry:
        raise OSError("no space left on device")


def _workflow(calls: list[str]) -> Workflow:
    def paid(ctx: Mapping[str, Any]) -> str:
        calls.append("paid")
        return f"essay on {ctx['topic']}"

    return Workflow([Step("paid", paid, cache=True),
                     Step("after", lambda ctx: ctx["paid"] + "!", depends_on=("paid",))])


def test_a_cache_that_cannot_store_leaves_the_paid_output_with_the_run(tmp_path: Path) -> None:
    calls: list[str] = []
    cache = _CannotStore(tmp_path / "cache.db")
    with pytest.warns(RuntimeWarning, match="could not store the output of 'paid'"):
        result = asyncio.run(_workflow(calls).run({"topic": "tides"}, cache=cache))
    assert result.ok and result.outputs["after"] == "essay on tides!"
    assert calls == ["paid"]
    cache.close()


@pytest.mark.parametrize("column", ["reads", "output"])
def test_a_damaged_entry_is_a_miss_not_a_failed_step(tmp_path: Path, column: str) -> None:
    calls: list[str] = []
    path = tmp_path / "cache.db"
    with SqliteCache(path) as cache:
        asyncio.run(_workflow(calls).run({"topic": "tides"}, cache=cache))
    with sqlite3.connect(path) as db:
        db.execute(f"UPDATE ekit_cache SET {column} = 'not json {{'")
    calls.clear()
    with SqliteCache(path) as cache, pytest.warns(RuntimeWarning):
        result = asyncio.run(_workflow(calls).run({"topic": "tides"}, cache=cache))
    assert result.ok and result.outputs["after"] == "essay on tides!"
    assert calls == ["paid"]

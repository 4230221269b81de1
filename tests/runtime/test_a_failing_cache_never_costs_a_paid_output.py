"""A cache that fails or holds damaged entries costs a miss at most, never a paid output or a run.

What users rely on: the cache saves calls; it must never lose one. A cache
that cannot store (a full disk, a dropped connection) after the step's call
was paid leaves the output with the run, which goes on (a warning says so);
an entry damaged by hand or by a fault (its reads or its output no longer
JSON) is a miss, and the step runs, instead of failing it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Codec, SqliteCache, Step, Workflow
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


_MAKES: dict[str, Any] = {}  # (a dict: what it holds is not part of the fingerprint)
_CALLS: list[list[str]] = []


def _summarize(ctx: Mapping[str, Any]) -> Any:
    _CALLS[0].append("paid")
    return _MAKES["summary"](ctx["topic"])


def test_an_entry_its_codec_can_no_longer_decode_is_a_miss(tmp_path: Path) -> None:
    # The output type gained a field (its module changed, which no fingerprint sees): the entry
    # made with the old type cannot be rebuilt, so the step runs again rather than failing.
    @dataclasses.dataclass
    class Summary:
        title: str

    @dataclasses.dataclass
    class Grown:
        title: str
        score: float

    Grown.__name__ = Grown.__qualname__ = Summary.__qualname__  # the same type name, grown

    def workflow(kind: type, calls: list[str]) -> Workflow:
        _MAKES["summary"] = (lambda title: kind(title)) if kind is Summary else (
            lambda title: kind(title, 0.5))
        _CALLS[:] = [calls]
        return Workflow([Step("summarize", _summarize, cache=True)], codec=Codec(kind))

    calls: list[str] = []
    with SqliteCache(tmp_path / "cache.db") as cache:
        asyncio.run(workflow(Summary, calls).run({"topic": "tides"}, cache=cache))
        with pytest.warns(RuntimeWarning):
            result = asyncio.run(workflow(Grown, calls).run({"topic": "tides"}, cache=cache))
    assert result.ok and result.outputs["summarize"] == Grown("tides", 0.5)
    assert calls == ["paid", "paid"]

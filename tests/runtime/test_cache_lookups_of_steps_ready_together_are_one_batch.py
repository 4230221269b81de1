"""Cached attempts that become ready together during a run are looked up together.

What users rely on: a fan-out of cached steps (or a cached map's items) whose
input comes only during the run (a step that is not cached) asks the cache
once for all of them, not once per step, and each step gets exactly the hit
(or miss) it would have got alone: hits run nothing and are recorded, misses
run and are stored, a cache over the network (not ``local``) is asked once
in a worker thread that all the attempts await.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage
from ekit_runtime import PatternResult, SqliteCache, Step, Workflow


def _fan_out(calls: list[str], width: int, suffix: str = "") -> Workflow:
    def root(ctx: Mapping[str, Any]) -> str:
        calls.append("root")
        return f"root of {ctx['seed']}"

    def make(i: int) -> Any:
        async def branch(ctx: Mapping[str, Any]) -> PatternResult[str]:
            calls.append(f"b{i}")
            return PatternResult(f"{ctx['root']}/{i}{suffix}", cost=TokenUsage(10, 2, 1))
        return branch

    return Workflow([Step("root", root),
                     *(Step(f"b{i}", make(i), ("root",), cache=True) for i in range(width))])


def _selects(cache: SqliteCache) -> list[str]:
    statements: list[str] = []
    cache._conn.set_trace_callback(statements.append)
    return statements


def _lookups(statements: list[str]) -> list[str]:
    return [s for s in statements if s.lstrip().upper().startswith(("SELECT", "WITH"))]


def test_a_fan_out_ready_together_is_looked_up_in_one_batch(tmp_path: Path) -> None:
    calls: list[str] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        first = asyncio.run(_fan_out(calls, 8).run({"seed": "x"}, cache=cache))
        assert calls.count("root") == 1 and len(calls) == 9
        calls.clear()
        statements = _selects(cache)
        second = asyncio.run(_fan_out(calls, 8).run({"seed": "x"}, cache=cache))
    # root runs (it is not cached); the eight branches hit: two queries in all (the key
    # sets read under their heads, then the entries by key), not two per branch
    assert calls == ["root"]
    assert len(_lookups(statements)) == 2, statements
    assert second.outputs == first.outputs
    assert second.checkpoint is not None
    assert set(second.checkpoint.cache_hits) == {f"b{i}" for i in range(8)}
    assert second.checkpoint.cache_hits["b3"].saved == TokenUsage(10, 2, 1)
    assert second.cost == TokenUsage(0, 0, 0)


def test_each_step_of_a_batch_gets_its_own_hit_or_miss(tmp_path: Path) -> None:
    calls: list[str] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(_fan_out(calls, 3).run({"seed": "x"}, cache=cache))
        calls.clear()
        # five branches: b0..b2 were stored (same code, same input), b3 and b4 are new
        result = asyncio.run(_fan_out(calls, 5).run({"seed": "x"}, cache=cache))
        assert sorted(calls) == ["b3", "b4", "root"]
        assert [result.outputs[f"b{i}"] for i in range(5)] == [f"root of x/{i}" for i in range(5)]
        assert result.checkpoint is not None and set(result.checkpoint.cache_hits) == {"b0", "b1", "b2"}
        calls.clear()
        again = asyncio.run(_fan_out(calls, 5).run({"seed": "x"}, cache=cache))  # the misses were stored
        assert calls == ["root"] and again.outputs == result.outputs
        calls.clear()
        other = asyncio.run(_fan_out(calls, 5).run({"seed": "y"}, cache=cache))  # another input: all miss
    assert sorted(calls) == ["b0", "b1", "b2", "b3", "b4", "root"]
    assert other.outputs["b4"] == "root of y/4"
    assert other.checkpoint is not None and not other.checkpoint.cache_hits


def test_a_cached_maps_items_are_looked_up_in_one_batch(tmp_path: Path) -> None:
    calls: list[str] = []

    def topics(ctx: Mapping[str, Any]) -> list[str]:
        calls.append("topics")
        return ["tides", "winds", "waves", "rain"]

    def summary(ctx: Mapping[str, Any]) -> str:
        calls.append(f"summary:{ctx['topics']}")
        return f"about {ctx['topics']}"

    def workflow() -> Workflow:
        return Workflow([Step("topics", topics),
                         Step("summary", summary, ("topics",), map_over="topics", cache=True)])

    with SqliteCache(tmp_path / "c.db") as cache:
        first = asyncio.run(workflow().run(cache=cache))
        calls.clear()
        statements = _selects(cache)
        second = asyncio.run(workflow().run(cache=cache))
    assert calls == ["topics"]
    assert second.outputs == first.outputs
    assert second.checkpoint is not None and len(second.checkpoint.cache_hits) == 4
    assert len(_lookups(statements)) == 2, statements


class _Remote(SqliteCache):
    """A SQLite cache treated as one over the network: its calls are made in a worker thread."""

    local = False

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.finds: list[int] = []

    def find(self, wanted: Any) -> Any:
        self.finds.append(len(wanted))
        return super().find(wanted)


def test_a_cache_over_the_network_is_asked_once_in_a_thread_for_the_batch(tmp_path: Path) -> None:
    calls: list[str] = []
    cache = _Remote(tmp_path / "c.db")
    try:
        first = asyncio.run(_fan_out(calls, 6).run({"seed": "x"}, cache=cache))
        assert cache.finds == [6]  # (the first run's misses, asked together too)
        calls.clear()
        second = asyncio.run(_fan_out(calls, 6).run({"seed": "x"}, cache=cache))
    finally:
        cache.close()
    assert cache.finds == [6, 6]
    assert calls == ["root"] and second.outputs == first.outputs


@pytest.mark.parametrize("width", [1, 2])
def test_a_lone_or_paired_cached_step_still_hits(tmp_path: Path, width: int) -> None:
    calls: list[str] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(_fan_out(calls, width).run({"seed": "x"}, cache=cache))
        calls.clear()
        result = asyncio.run(_fan_out(calls, width).run({"seed": "x"}, cache=cache))
    assert calls == ["root"]
    assert result.checkpoint is not None and len(result.checkpoint.cache_hits) == width


@pytest.mark.parametrize("kind", ["directory", "postgres"])
def test_every_ready_made_cache_answers_a_batch_as_each_step_alone(kind: str, tmp_path: Path) -> None:
    from tests.support.queue_backends import fresh_postgres

    def run_twice(cache: Any) -> None:
        finds: list[int] = []
        real_find = cache.find

        def find(wanted: Any) -> Any:
            finds.append(len(wanted))
            return real_find(wanted)

        cache.find = find
        calls: list[str] = []
        asyncio.run(_fan_out(calls, 3).run({"seed": "x"}, cache=cache))
        calls.clear()
        result = asyncio.run(_fan_out(calls, 5).run({"seed": "x"}, cache=cache))
        assert sorted(calls) == ["b3", "b4", "root"]  # b0..b2 hit, b3 and b4 (new) run
        assert [result.outputs[f"b{i}"] for i in range(5)] == [f"root of x/{i}" for i in range(5)]
        assert result.checkpoint is not None and set(result.checkpoint.cache_hits) == {"b0", "b1", "b2"}
        assert finds == [3, 5]  # one lookup per run: each batch asked at once

    if kind == "directory":
        from ekit_runtime import DirectoryCache

        run_twice(DirectoryCache(tmp_path / "dir"))
        return
    from ekit_runtime.cache.postgres import PostgresCache

    with fresh_postgres() as url:
        cache = PostgresCache(url)
        try:
            run_twice(cache)
        finally:
            cache.close()

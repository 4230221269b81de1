"""Hits whose inputs are known when a run starts are found then, as a resume finds its recorded steps.

What users rely on: a run whose cached steps all hit calls none of them and
starts no attempt for them, looks the cache up in a few batched queries (not
one per step), saves a checkpoint holding every hit, and keeps every rule of
docs/cache.md: a step with a condition, one an approval gates, and one whose
inputs come only after a miss are still decided as the run goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime import PatternResult, SqliteCache, Step, Workflow
from ekit_runtime.cache import sqlite as sqlite_cache


def _chain(calls: list[str], n: int, **options: Any) -> Workflow:
    def make(i: int) -> Any:
        async def step(ctx: Mapping[str, Any]) -> PatternResult[str]:
            calls.append(f"s{i}")
            return PatternResult(f"{ctx['seed']}-{i}" if i == 0 else f"{ctx[f's{i - 1}']}-{i}",
                                 cost=TokenUsage(10, 1, 1))
        return step

    return Workflow([Step(f"s{i}", make(i), (f"s{i - 1}",) if i else (), cache=True, **options)
                     for i in range(n)])


def test_a_chain_of_hits_runs_nothing_and_looks_up_in_one_query(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        first = asyncio.run(_chain(calls, 30).run({"seed": "x"}, cache=cache))
        calls.clear()
        queries: list[str] = []
        finds: list[int] = []
        real_few = sqlite_cache.SqliteCache.few

        def find(self: SqliteCache, wanted: list[Any]) -> list[None]:
            finds.append(len(wanted))
            return [None] * len(wanted)

        def few(self: SqliteCache, heads: list[str]) -> Any:
            queries.append("few")
            return real_few(self, heads)

        monkeypatch.setattr(sqlite_cache.SqliteCache, "find", find)
        monkeypatch.setattr(sqlite_cache.SqliteCache, "few", few)
        saved: list[WorkflowCheckpoint] = []
        second = asyncio.run(_chain(calls, 30).run({"seed": "x"}, cache=cache, checkpoint_fn=saved.append))
    assert calls == [] and second.outputs == first.outputs
    assert queries == ["few"] and finds == []  # every head read at once, matched in memory
    assert second.cost == TokenUsage(0, 0, 0)
    assert saved and set(saved[-1].cache_hits) == {f"s{i}" for i in range(30)}
    assert saved[-1].cache_hits["s29"].saved == TokenUsage(10, 1, 1)


def test_the_hits_found_at_start_stop_at_the_first_miss_and_the_rest_runs(tmp_path: Path) -> None:
    calls: list[str] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(_chain(calls, 4).run({"seed": "x"}, cache=cache))
        calls.clear()
        asyncio.run(_chain(calls, 2).run({"seed": "y"}, cache=cache))  # s0, s1 for seed y
        calls.clear()
        result = asyncio.run(_chain(calls, 4).run({"seed": "y"}, cache=cache))
    # s0 and s1 hit as the run starts; s2 (its input new) runs; s3 follows it
    assert calls == ["s2", "s3"]
    assert result.outputs["s3"] == "y-0-1-2-3"
    assert result.checkpoint is not None and set(result.checkpoint.cache_hits) == {"s0", "s1"}


def test_a_resume_finds_the_hits_below_its_recorded_steps(tmp_path: Path) -> None:
    calls: list[str] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(_chain(calls, 3).run({"seed": "x"}, cache=cache))
        saved: list[WorkflowCheckpoint] = []
        asyncio.run(Workflow(_chain(calls, 3).steps[:1]).run({"seed": "x"}, checkpoint_fn=saved.append))
        calls.clear()
        result = asyncio.run(_chain(calls, 3).run(resume_from=saved[-1], cache=cache,
                                                  allow_graph_change=True))
    assert calls == []
    assert result.outputs["s2"] == "x-0-1-2"
    assert result.checkpoint is not None and set(result.checkpoint.cache_hits) == {"s1", "s2"}


def test_a_step_with_a_condition_is_asked_and_not_handed_back(tmp_path: Path) -> None:
    ran: list[str] = []

    def workflow(holds: bool) -> Workflow:
        def step(ctx: Mapping[str, Any]) -> str:
            ran.append("step")
            return "made"
        return Workflow([Step("step", step, cache=True, when=lambda ctx: holds)])

    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(workflow(True).run(cache=cache))
        result = asyncio.run(workflow(False).run(cache=cache))
    assert ran == ["step"]
    assert "step" not in result.outputs and "step" in result.checkpoint.skipped  # type: ignore[union-attr]


def test_an_approval_still_gates_a_step_the_cache_can_answer(tmp_path: Path) -> None:
    asked: list[str] = []
    calls: list[str] = []

    def approve(name: str, metadata: Any) -> bool:
        asked.append(name)
        return True

    with SqliteCache(tmp_path / "c.db") as cache:
        asyncio.run(_chain(calls, 2).run({"seed": "x"}, cache=cache))
        calls.clear()
        result = asyncio.run(_chain(calls, 2).run({"seed": "x"}, cache=cache, approval=approve))
    assert asked == ["s0", "s1"] and calls == []  # asked, then handed back by the attempt
    assert result.checkpoint is not None and set(result.checkpoint.cache_hits) == {"s0", "s1"}

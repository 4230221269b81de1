"""A run with cache hits is freed as soon as it ends (issue 45: a hit's cost).

What users rely on: once a run returns, what it held (its steps, states,
hits and the outputs in them) goes at once, by reference count, not when
the cyclic collector next runs (a long-lived worker, a notebook). A run with
hits saves its checkpoints through a method bound on its own runner, a
reference cycle while it runs; the run's end undoes it (run or states, all
hits or some), and every checkpoint still records the hits.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import SqliteCache, Step, Workflow


async def _one(context: Mapping[str, Any]) -> int:
    return 1


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _filled(path: Path, steps: list[Step]) -> None:
    with SqliteCache(path) as cache:
        asyncio.run(Workflow(steps).run(cache=cache))


async def _drive(runner: Any, how: str) -> None:
    if how == "run":
        await runner.run()
    else:
        async for _ in runner.states():
            pass


@pytest.mark.parametrize("how", ["run", "states"])
def test_a_run_whose_steps_all_hit_is_freed_when_it_ends(tmp_path: Path, no_collector: None,
                                                        how: str) -> None:
    steps = [Step(f"s{i}", _one, (f"s{i - 1}",) if i else (), cache=True) for i in range(5)]
    _filled(tmp_path / "c.db", steps)
    saved: list[WorkflowCheckpoint] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        runner = Workflow(steps).runner(cache=cache, checkpoint_fn=saved.append)
        assert runner.cache_hits  # (every step a hit: the run saves through the bound method)

        asyncio.run(_drive(runner, how))
        ended = weakref.ref(runner)
        del runner
    assert ended() is None, "the runner outlived its run: a reference cycle kept it"
    assert saved and set(saved[-1].cache_hits) == {f"s{i}" for i in range(5)}


def test_a_run_with_a_hit_and_steps_that_run_is_freed_too(tmp_path: Path, no_collector: None) -> None:
    _filled(tmp_path / "c.db", [Step("a", _one, cache=True)])
    saved: list[WorkflowCheckpoint] = []
    with SqliteCache(tmp_path / "c.db") as cache:
        flow = Workflow([Step("a", _one, cache=True), Step("b", _one, ("a",)),
                         Step("c", _one, ("b",), cache=True)])
        runner = flow.runner(cache=cache, checkpoint_fn=saved.append)
        asyncio.run(runner.run())  # (a hit as it starts, b runs, c misses and runs)
        ended = weakref.ref(runner)
        del runner
    assert ended() is None
    assert set(saved[-1].outputs) == {"a", "b", "c"} and set(saved[-1].cache_hits) == {"a"}

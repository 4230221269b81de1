"""A queue worker given a cache hands it to every run it drives, as ``run(cache=...)`` does.

What users rely on (docs/cache.md): a step with ``cache=True`` is not paid
again for the same code and inputs. Runs driven by a worker are runs too: a
fleet sharing one cache pays once for a call any of its runs made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import SqliteCache, Step, Workflow
from ekit_runtime.queue import RunQueue, Worker
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]


def test_a_second_queued_run_with_the_same_input_pays_nothing(queue: RunQueue, tmp_path: Path) -> None:
    calls: list[str] = []

    def paid(ctx: Mapping[str, Any]) -> str:
        calls.append(ctx["topic"])
        return f"essay on {ctx['topic']}"

    wf = Workflow([Step("paid", paid, cache=True)])
    with SqliteCache(tmp_path / "cache.db") as cache:
        worker = Worker(queue, {"essay": wf}, poll=0.01, cache=cache)
        first = queue.submit("essay", {"topic": "tides"}, run_id="first")
        assert asyncio.run(worker.run_until_idle()) == 1
        second = queue.submit("essay", {"topic": "tides"}, run_id="second")
        assert asyncio.run(worker.run_until_idle()) == 1
    assert worker.outcomes == {first: "finished", second: "finished"}
    assert calls == ["tides"]
    result = queue.result(second)
    assert result is not None and result.outputs["paid"] == "essay on tides"
    assert set(result.checkpoint.cache_hits) == {"paid"}


def test_a_worker_refuses_a_cache_that_is_not_one(queue: RunQueue) -> None:
    with pytest.raises(ValueError, match="cache"):
        Worker(queue, {"essay": Workflow([Step("a", lambda ctx: 1)])}, cache="cache.db")  # type: ignore[arg-type]

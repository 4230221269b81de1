"""Where a step runs is one rule, whoever drives the run: a plain run or a queue worker.

Sync steps run in the default executor's pool (64 threads), not asyncio's
small default one: 40 of them meeting at a barrier finish under ``run_sync``
and under a ``Worker`` alike. A step's own executor, ``inline=True`` and
the run's thread pool are honoured under a worker, and the attempt key
reaches the step wherever it runs, a Dask worker included.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.attempt import Attempt
from ekit_runtime.executors import DEFAULT_EXECUTOR, Executor
from ekit_runtime.queue import RunQueue, Worker, attempt_key
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

WIDTH = 40


def _meeting(barrier: threading.Barrier) -> Workflow:
    def meet(ctx: dict[str, Any]) -> int:
        # Every step must be running at once for any of them to pass.
        return barrier.wait()

    return Workflow([Step(f"s{i:02d}", meet) for i in range(WIDTH)])


@pytest.mark.timeout(60)
def test_forty_sync_steps_at_a_barrier_finish_under_run_sync_and_under_a_worker(queue: RunQueue) -> None:
    plain = _meeting(threading.Barrier(WIDTH, timeout=15)).run_sync()
    assert sorted(plain.outputs.values()) == list(range(WIDTH))
    run = queue.submit("wide", run_id="wide")
    worker = Worker(queue, {"wide": _meeting(threading.Barrier(WIDTH, timeout=15))}, poll=0.01)
    assert asyncio.run(worker.run_until_idle()) == 1
    assert worker.outcomes == {run: "finished"}, queue.status(run).error
    result = queue.result(run)
    assert result is not None and sorted(result.outputs.values()) == list(range(WIDTH))


class _Recording(Executor):
    """An executor of the step's own that runs each attempt in the default executor, noting it."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def run(self, attempt: Attempt) -> Any:
        self.ran.append(attempt.name)
        return await DEFAULT_EXECUTOR.run(attempt)


def test_a_worker_runs_steps_where_a_plain_run_does_with_their_keys(queue: RunQueue) -> None:
    seen: dict[str, str] = {}

    def where(name: str) -> Any:
        def body(ctx: dict[str, Any]) -> str:
            seen[name] = f"{threading.current_thread().name}|{attempt_key()}"
            return name

        return body

    async def on_loop(ctx: dict[str, Any]) -> str:
        seen["async"] = f"{threading.current_thread().name}|{attempt_key()}"
        return "async"

    own = _Recording()
    wf = Workflow(
        [
            Step("pooled", where("pooled")),
            Step("inline", where("inline"), inline=True),
            Step("own", where("own"), executor=own),
            Step("async", on_loop),
        ]
    )
    run = queue.submit("w", run_id="r")
    assert asyncio.run(Worker(queue, {"w": wf}, poll=0.01).run_until_idle()) == 1
    assert queue.status(run).status == "finished", queue.status(run).error
    assert own.ran == ["own"]  # the step's own executor ran it
    thread = {k: v.split("|")[0] for k, v in seen.items()}
    assert thread["pooled"].startswith("ekit-step") and thread["own"].startswith("ekit-step")
    assert thread["inline"] == thread["async"] == "MainThread"
    assert {k: v.split("|")[1] for k, v in seen.items()} == {n: f"r/{n}/1" for n in seen}
    # The key is set for the attempt only: none is left behind on the pool's threads.
    with pytest.raises(LookupError):
        attempt_key()


def _keyed_on_dask(ctx: dict[str, Any]) -> str:
    return str(attempt_key())


async def _keyed_on_dask_async(ctx: dict[str, Any]) -> str:
    return str(attempt_key())


@pytest.mark.timeout(120)
def test_the_attempt_key_reaches_a_step_on_a_dask_worker(queue: RunQueue) -> None:
    pytest.importorskip("distributed")
    from ekit_runtime.dask import DaskExecutor, local_cluster

    with local_cluster(n_workers=1, processes=False) as cluster, DaskExecutor(cluster) as dask:
        wf = Workflow(
            [
                Step("sync", _keyed_on_dask, executor=dask),
                Step("async", _keyed_on_dask_async, executor=dask),
            ]
        )
        run = queue.submit("w", run_id="far")
        assert asyncio.run(Worker(queue, {"w": wf}, poll=0.01).run_until_idle()) == 1
    result = queue.result(run)
    assert result is not None, queue.status(run).error
    assert dict(result.outputs) == {"sync": "far/sync/1", "async": "far/async/1"}

"""A worker tells the queue which attempts it runs now, and ``queue.in_flight`` reads them back.

What the dashboard colours ``running``: an attempt whose work has begun on
a live worker, under the run's current lease. A step whose inputs exist but
that a limit holds back (a resource's slots all taken) is not in flight,
nor is anything of a run that is not running, nor what a worker said under
an older lease. The announcements are advisory: a row that does not parse
is passed over, and the reading never fails for it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import InFlight, Limits, Worker, open_queue
from tests.support.queue_backends import queue_url, wait_for

__all__ = ["queue_url"]


@pytest.mark.timeout(180)
def test_the_attempts_a_worker_runs_are_in_flight_and_a_held_one_is_not(queue_url: str) -> None:
    go = asyncio.Event()
    began: list[str] = []

    async def first(ctx: Any) -> int:
        return 1

    def blocked(name: str) -> Any:
        async def run(ctx: Any) -> str:
            began.append(name)
            await go.wait()
            return name

        return run

    # b and c share a resource capped at one slot: one runs, the other is held.
    flow = Workflow([
        Step("a", first),
        Step("b", blocked("b"), ("a",), resource="api"),
        Step("c", blocked("c"), ("a",), resource="api"),
    ])

    async def main() -> None:
        with open_queue(queue_url, limits=Limits(resources={"api": 1})) as q, open_queue(queue_url) as reader:
            q.submit("flow", {}, run_id="r")
            assert reader.in_flight("r") == {}  # queued: nothing runs
            worker = Worker(q, {"flow": flow}, name="w-1", poll=0.02)
            task = asyncio.create_task(worker.run_until_idle())

            def one_in_flight() -> bool:
                assert not task.done()
                return len(began) == 1 and set(reader.in_flight("r")) == set(began)

            await asyncio.to_thread(wait_for, one_in_flight, timeout=60, what="the first attempt in flight")
            (running,) = began
            seen = reader.in_flight("r")
            assert seen == {running: InFlight(running, 1, "w-1", seen[running].since)}
            assert time.time() - 120 < seen[running].since <= time.time()
            assert reader.status("r").steps_done == 1  # a is recorded, not in flight
            go.set()
            assert await task == 1
            assert sorted(began) == ["b", "c"]
            assert reader.in_flight("r") == {}  # finished

    asyncio.run(main())


def test_only_live_workers_under_the_current_lease_count(queue_url: str) -> None:
    with open_queue(queue_url) as q:
        q.submit("flow", {}, run_id="r")
        q.submit("flow", {}, run_id="other")
        lease = q.claim("w-now", {"flow": None}, 60.0)
        assert lease is not None and (lease.run_id, lease.epoch) == ("r", 1)
        now = time.time()
        doing = {"r": (1, {"split[k1]": (now, 2)}), "other": (1, {"x": (now, 1)})}
        q.announce("w-now", {"flow": None}, 30.0, doing)
        q.announce("w-old", {"flow": None}, 30.0, {"r": (0, {"stale": (now, 1)})})  # an older lease's
        assert q.in_flight("r") == {"split[k1]": InFlight("split[k1]", 2, "w-now", now)}
        assert q.in_flight("other") == {}  # queued: whatever a worker says, nothing of it runs
        q.announce("w-now", {"flow": None}, 30.0)  # its attempt ended: the next announcement says so
        assert q.in_flight("r") == {}
        q.retire("w-now")
        assert q.in_flight("r") == {}


@pytest.mark.parametrize(
    "doing",
    [
        {"r": (1,)},
        {"r": ("one", {"a": (0.0, 1)})},
        {"r": (1, {"a": ("soon", 1)})},
        {7: (1, {"a": (0.0, 1)})},
        {"r": (1, ["a"])},
    ],
)
def test_a_malformed_announcement_is_refused_naming_doing(queue_url: str, doing: Any) -> None:
    with open_queue(queue_url) as q, pytest.raises(ValueError, match=r"doing|run_id"):
        q.announce("w", {"flow": None}, 30.0, doing)


def test_an_unknown_run_is_an_unknown_run_error(queue_url: str) -> None:
    from ekit_runtime.queue import UnknownRunError

    with open_queue(queue_url) as q, pytest.raises(UnknownRunError):
        q.in_flight("nobody")

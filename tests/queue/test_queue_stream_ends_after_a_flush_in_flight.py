"""A run's end is written after the flush in flight that holds its events (PostgreSQL's loop session).

The worker writes a run's end on its loop session while its stream flusher
publishes on the database thread. When the flusher had taken every event of
the run out of its buffer and was still publishing them as the run ended,
the end committed first, the flush's fence found the run over, and a
reader saw no event of the run but ``end`` (seen at load 11 in two stream
tests). Here the first flush is held until the run is over, or for a bound
that only a run's end waiting for the flush reaches.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from ekit_runtime import Step, Workflow, partial
from ekit_runtime.queue import Lease, Worker
from ekit_runtime.queue.postgres import PostgresQueue
from ekit_runtime.queue.streams import Published
from tests.support.queue_backends import postgres_url

__all__ = ["postgres_url"]

HOLD = 3.0  # how long the first flush waits for the run to end, at most

FIRST_FLUSH = threading.Event()


async def talks_then_returns(ctx: Any) -> str:
    partial("a token")
    return "done"


def test_a_runs_end_waits_for_the_flush_in_flight_that_holds_its_events(postgres_url: str) -> None:
    FIRST_FLUSH.clear()
    observer = PostgresQueue(postgres_url)
    held: list[str] = []

    class HeldFlush(PostgresQueue):
        def publish_many(self, batches: Sequence[tuple[Lease, Sequence[Published]]], cap: int) -> Any:
            if not FIRST_FLUSH.is_set() and any(e.kind == "finished" for _l, evs in batches for e in evs):
                FIRST_FLUSH.set()
                run_id = batches[0][0].run_id
                deadline = time.monotonic() + HOLD
                tick = threading.Event()
                while time.monotonic() < deadline and observer.status(run_id).status == "running":
                    tick.wait(0.01)
                held.append(observer.status(run_id).status)
            return super().publish_many(batches, cap)

    queue = HeldFlush(postgres_url)
    assert queue._loop_session() is not None  # the ends are written on the loop session, as by default
    try:
        run_id = queue.submit("talk", {})
        worker = Worker(queue, {"talk": Workflow([Step("talk", talks_then_returns)])}, poll=0.01,
                        stream_every=0.01)
        asyncio.run(worker.run_until_idle())
        assert worker.outcomes[run_id] == "finished"
        kinds = [e.kind for e in observer.stream(run_id, follow=False)]
        # The run was still running when the held flush went on: its end waited for it.
        assert held == ["running"], held
        assert kinds == ["claimed", "started", "partial", "finished", "end"], kinds
    finally:
        queue.close()
        observer.close()

"""One flush of several runs' streams answers each run on its own, on SQLite and PostgreSQL.

A worker publishes all its runs' buffered events in one ``publish_many``
(PostgreSQL: one statement for all the runs): each run's events land under
its own offsets and its own cap, and a run whose lease is lost is refused
alone, in the order the runs were given.
"""

from __future__ import annotations

import json
import time

import pytest

from ekit_runtime.queue import LeaseLostError, RunQueue
from ekit_runtime.queue.records import Lease
from ekit_runtime.queue.streams import Published
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

pytestmark = pytest.mark.timeout(120)


def events(tag: str, n: int) -> list[Published]:
    return [Published("partial", "s", json.dumps(f"{tag}{i}"), time.time()) for i in range(n)]


def claimed(queue: RunQueue, n: int) -> dict[str, Lease]:
    for _ in range(n):
        queue.submit("w", {})
    leases = [queue.claim(f"w{i}", {"w": None}, 30) for i in range(n)]
    assert all(lease is not None for lease in leases)
    return {lease.run_id: lease for lease in leases if lease is not None}


def _steal(queue: RunQueue, run_id: str) -> None:
    """Another party takes the run: its epoch goes up, as a claim after an expiry makes it."""
    if queue.backend == "sqlite":
        queue.conn.execute(  # type: ignore[attr-defined]
            "UPDATE ekit_queue_runs SET epoch = epoch + 1 WHERE run_id = ?", (run_id,))
    else:
        queue.db.run(lambda c: c.execute(  # type: ignore[attr-defined]
            "UPDATE ekit_queue_runs SET epoch = epoch + 1 WHERE run_id = %s", (run_id,)))


def data(queue: RunQueue, run_id: str) -> list[object]:
    return [e.data for e in queue.stream(run_id, follow=False) if e.kind == "partial"]


def test_each_run_of_a_flush_gets_its_own_offsets_cap_and_refusal(queue: RunQueue) -> None:
    a, b, c = sorted(claimed(queue, 3).values(), key=lambda lease: lease.run_id)
    assert queue.publish_many([(a, events("a", 1)), (c, events("c", 2))], 4) == [1, 2]
    _steal(queue, b.run_id)
    # Not in run id order, one run over the cap in this one flush, one run lost.
    told = queue.publish_many([(c, events("C", 5)), (b, events("b", 3)), (a, events("A", 2))], 4)
    assert told[0] == 7 and told[2] == 3
    assert isinstance(told[1], LeaseLostError) and told[1].run_id == b.run_id
    assert data(queue, a.run_id) == ["a0", "A0", "A1"]
    assert data(queue, b.run_id) == []
    assert data(queue, c.run_id) == ["C1", "C2", "C3", "C4"]  # the newest 4 of its 7
    gap = next(iter(queue.stream(c.run_id, follow=False)))
    assert gap.kind == "gap" and gap.data == {"dropped_from": 1, "dropped_to": 3}
    # The next flush numbers on from each run's newest offset.
    assert queue.publish_many([(a, events("n", 1)), (c, events("n", 1))], 4) == [4, 8]
    assert data(queue, c.run_id) == ["C2", "C3", "C4", "n0"]

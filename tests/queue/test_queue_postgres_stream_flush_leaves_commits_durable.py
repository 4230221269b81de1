"""A PostgreSQL stream flush's commit need not wait for the disk, and only that commit.

What users rely on: a stream is not a checkpoint, so a flush of runs'
streams commits with ``synchronous_commit`` off (a server crash may lose the
newest stream rows, never a save). The setting is the flush's transaction's
own (``set_config(..., true)`` in its locks' statement): the queue's
connection, which next commits a checkpoint or an ending, must commit it
durably again, as the server is configured.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from ekit_runtime.queue import PostgresQueue, open_queue
from ekit_runtime.queue.postgres_sql import _STREAM_LOCK, _STREAM_LOCKS
from ekit_runtime.queue.streams import Published
from tests.support.queue_backends import postgres_url

__all__ = ["postgres_url"]

pytestmark = pytest.mark.timeout(120)


def _setting(queue: PostgresQueue) -> str:
    row = queue.db.run(lambda c: c.execute("SHOW synchronous_commit").fetchone())
    assert row is not None
    return str(row[0])


def test_a_flush_commits_without_the_disk_and_leaves_the_connection_durable(postgres_url: str) -> None:
    queue = open_queue(postgres_url)
    try:
        assert isinstance(queue, PostgresQueue)
        configured = _setting(queue)
        assert configured != "off"
        for i in range(2):
            queue.submit("w", run_id=f"r{i}")
        leases = [queue.claim("me", {"w": None}, 60) for _ in range(2)]
        batches: list[Any] = [(lease, [Published("partial", "s", json.dumps("x"), time.time())])
                              for lease in leases]
        assert queue.publish_many(batches, 10) == [1, 1]
        assert _setting(queue) == configured  # the next save's commit waits for the disk again
        # Inside the flush's transaction its locks' statement turned it off, for that commit.
        with queue.db.transaction() as conn:
            conn.execute(_STREAM_LOCKS, (_STREAM_LOCK, json.dumps(["r0", "r1"]))).fetchall()
            seen = conn.execute("SHOW synchronous_commit").fetchone()
        assert seen is not None and seen[0] == "off"
        assert _setting(queue) == configured
    finally:
        queue.close()

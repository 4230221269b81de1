"""A SQLite queue waits out another process's write lock in short naps, and fails only past its timeout.

SQLite's own busy handler sleeps 1 ms first, then 2, 5, 10 ms, while a
queue's write transaction holds the lock for a fraction of a millisecond:
two workers spent more time asleep than writing. The queue waits itself,
starting at a tenth of SQLite's first sleep. These tests hold the lock from
a real second connection (as another process would) and pin what users rely
on: the waiting call goes through once the lock is free, its first nap is
shorter than SQLite's first sleep, a lock held past the timeout fails with
the transient "database is locked" (the worker waits it out) and writes
nothing, and errors other than a lock are never retried.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

import ekit_runtime.queue.sqlite as sqlite_queue
from ekit_runtime import Step, Workflow
from ekit_runtime.queue import LeaseLostError, SqliteQueue, UnknownRunError
from ekit_runtime.queue.transient import is_transient
from tests.support.queue_backends import naps, wait_for

__all__ = ["naps"]  # (a fixture)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "q.db")


def _holder(path: str) -> sqlite3.Connection:
    """Another connection holding the database's write lock (as another process's transaction)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_a_write_waits_for_the_lock_in_short_naps_then_commits(path: str, naps: list[float]) -> None:
    queue = SqliteQueue(path)
    holder = _holder(path)
    done = threading.Event()
    errors: list[BaseException] = []

    def submit() -> None:
        try:
            queue.submit("w", run_id="waited")
        except BaseException as exc:  # reported below
            errors.append(exc)
        done.set()

    worker = threading.Thread(target=submit)
    worker.start()
    # Still waiting after several naps: the lock is really held, and it is waited for.
    wait_for(lambda: len(naps) >= 3, timeout=30, what="the submit to nap while the lock is held")
    assert not done.is_set()
    holder.execute("ROLLBACK")
    assert done.wait(30)
    worker.join()
    assert not errors, errors
    assert queue.status("waited").status == "queued"
    # SQLite's own handler first sleeps 1 ms; the queue's first nap is 0.05-0.15 ms.
    assert naps[0] < 0.0002
    assert all(n <= sqlite_queue._NAP_MAX_LONG * 1.5 for n in naps)
    holder.close()
    queue.close()


def test_a_lock_held_past_the_timeout_fails_transiently_and_writes_nothing(
    path: str, naps: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    queue = SqliteQueue(path)
    queue.submit("w", run_id="r")
    lease = queue.claim("me", {"w": None}, 60)
    assert lease is not None
    checkpoints: list[Any] = []
    Workflow([Step("a", lambda ctx: 1)]).run_sync(checkpoint_fn=checkpoints.append)
    monkeypatch.setattr(sqlite_queue, "_BUSY_TIMEOUT", 0.2)
    holder = _holder(path)
    with pytest.raises(sqlite3.OperationalError) as locked:
        queue.save(lease, checkpoints[-1], 60)
    holder.execute("ROLLBACK")
    holder.close()
    assert "locked" in str(locked.value) and is_transient(locked.value)
    assert naps, "it waited before giving up"
    assert queue.checkpoint("r") is None  # nothing of the refused save was written
    # The lock is free again: the same save goes through.
    assert queue.save(lease, checkpoints[-1], 60) is False
    assert queue.checkpoint("r") is not None
    queue.close()


def test_reads_wait_for_nothing_and_other_errors_are_not_retried(path: str, naps: list[float]) -> None:
    queue = SqliteQueue(path)
    queue.submit("w", run_id="r")
    holder = _holder(path)
    # A read takes no write lock (WAL): it answers while another connection writes.
    assert queue.status("r").status == "queued"
    holder.execute("ROLLBACK")
    holder.close()
    with pytest.raises(UnknownRunError):
        queue.status("nowhere")
    lease = queue.claim("me", {"w": None}, 60)
    assert lease is not None
    queue.finish(lease, "finished")
    with pytest.raises(LeaseLostError):
        queue.renew(lease, 60)
    assert naps == []  # none of these met a lock, and a refusal is not one
    queue.close()

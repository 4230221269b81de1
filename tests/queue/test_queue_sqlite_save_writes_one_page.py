"""The usual SQLite save writes one page of the log, as a bare insert of its entry does.

A save of a step's output alone (decision 015) fences by reading the run's
row and writes only the entry, which carries the run's counts as of that
save. Each commit appends to the write-ahead log one frame per page it
changed, so the log's growth counts the pages: one per save here, where
writing the run's row too made it two. The lease is renewed (the row
written) only when less than half of it is left, and a run that leaves
``running`` gets its newest counts folded into its row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import WorkflowCheckpoint
from ekit_runtime.queue import Ending, Lease, SqliteQueue
from tests.support.queue_backends import chain_checkpoints

STEPS = 20


def _frames(queue: SqliteQueue) -> int:
    """The frames the log holds (since it was last emptied)."""
    page = queue.conn.execute("PRAGMA page_size").fetchone()[0]
    size = os.path.getsize(f"{queue.path}-wal")
    return 0 if size == 0 else (size - 32) // (page + 24)


def _claimed(path: Path, lease_seconds: float) -> tuple[SqliteQueue, Lease, list[WorkflowCheckpoint]]:
    queue = SqliteQueue(path)
    queue.submit("chain", run_id="r")
    lease = queue.claim("w", {"chain": None}, lease_seconds)
    assert lease is not None
    checkpoints = chain_checkpoints(STEPS)
    queue.save(lease, checkpoints[0], lease_seconds)  # the first save writes the run in full
    queue.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert _frames(queue) == 0
    return queue, lease, checkpoints


def test_each_save_of_a_step_writes_one_page_as_a_bare_insert_does(tmp_path: Path) -> None:
    queue, lease, checkpoints = _claimed(tmp_path / "q.db", 600)
    before = queue.status("r")
    for k, checkpoint in enumerate(checkpoints[1:], start=1):
        assert queue.save(lease, checkpoint, 600) is False
        assert _frames(queue) == k, f"save {k} wrote {_frames(queue) - k + 1} pages"
    # The run's row was not written: its lease and its time are as the claim left them...
    after = queue.status("r")
    assert (after.lease_until, after.updated_at) == (before.lease_until, before.updated_at)
    # ... yet a reader sees the last save's counts and progress, and its checkpoint.
    assert after.steps_done == STEPS and after.steps_done != before.steps_done
    assert queue.checkpoint("r") == checkpoints[-1]
    # A bare insert of a row in its own transaction, for comparison: one page too.
    queue.conn.execute("CREATE TABLE bare (name TEXT, value TEXT)")
    queue.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    queue.conn.execute("BEGIN IMMEDIATE")
    queue.conn.execute("INSERT INTO bare VALUES ('s', 'out')")
    queue.conn.execute("COMMIT")
    assert _frames(queue) == 1
    queue.close()


def test_a_save_renews_the_lease_once_less_than_half_of_it_is_left(tmp_path: Path) -> None:
    queue, lease, checkpoints = _claimed(tmp_path / "q.db", 600)
    queue.conn.execute("UPDATE ekit_queue_runs SET updated_at = 0")  # (so that a move shows)
    queue.renew(lease, 100)  # less than half of the 600 s the saves ask for
    renewal = queue.status("r")
    short = renewal.lease_until
    assert short is not None
    # A renewal moves the run's updated_at (a save of a step alone does not).
    assert renewal.updated_at == pytest.approx(short - 100, abs=1e-3)
    queue.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    queue.save(lease, checkpoints[1], 600)
    assert _frames(queue) == 2  # the entry and, this time, the run's row
    renewed = queue.status("r").lease_until
    assert renewed is not None and renewed >= short + 400
    queue.save(lease, checkpoints[2], 600)
    assert _frames(queue) == 3  # more than half left again: the entry alone
    assert queue.status("r").lease_until == renewed
    queue.close()


def _row_counts(queue: SqliteQueue) -> tuple[Any, ...]:
    row = queue.conn.execute(
        "SELECT steps_done, step_index, counted >= (SELECT max(saved) FROM ekit_queue_entries) "
        "FROM ekit_queue_runs WHERE run_id = 'r'"
    ).fetchone()
    return tuple(row)


@pytest.mark.parametrize(
    "how", ["ending in a batch", "cancel of an expired lease", "sweep of an abandoned run"]
)
def test_a_run_that_leaves_running_holds_its_counts_in_its_row(tmp_path: Path, how: str) -> None:
    # A listing reads a run's entries only while it runs; every write that ends that folds the
    # newest entry's counts into the row.
    queue, lease, checkpoints = _claimed(tmp_path / "q.db", 600)
    for checkpoint in checkpoints[1:]:
        queue.save(lease, checkpoint, 600)
    assert _row_counts(queue) == (1, 1, 0)  # (the row as the save in full left it)
    if how == "ending in a batch":
        saved, ended = queue.write_many([], [Ending(lease, "finished")], 600)
        assert saved == [] and ended == [None]
    else:
        if how == "sweep of an abandoned run":
            assert queue.cancel("r") is True  # flagged: the lease is live
        queue.conn.execute("UPDATE ekit_queue_runs SET lease_until = 0")
        if how == "cancel of an expired lease":
            assert queue.cancel("r") is True
        else:
            assert queue.claim("other", {"chain": None}, 60) is None  # cancels it, leases nothing
    info = queue.status("r")
    assert info.status == ("finished" if how == "ending in a batch" else "cancelled")
    assert _row_counts(queue) == (STEPS, STEPS, 1)
    assert info.steps_done == STEPS and queue.checkpoint("r") == checkpoints[-1]
    queue.close()

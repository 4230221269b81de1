"""A save of a timed step (a run that records durations) costs the SQLite queue what an untimed one does.

A step that spent nothing but was timed is saved as its output's entry and a
usage entry holding only its time (``seconds``, ``began``: docs/stores.md).
Both go through the narrow view of the usual save (decision 015): the run's
row is not written, the log grows by one page per save, and the checkpoint
reads back with its durations. This is what lets queued runs record their
times by default (docs/queue.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import SqliteQueue

STEPS = 20


def timed_chain() -> list[WorkflowCheckpoint]:
    seen: list[WorkflowCheckpoint] = []
    steps = [Step(f"s{i}", lambda ctx, i=i: f"out{i}", (f"s{i - 1}",) if i else ()) for i in range(STEPS)]
    Workflow(steps).run_sync(checkpoint_fn=seen.append, durations=True)
    return seen


def _frames(queue: SqliteQueue) -> int:
    page = queue.conn.execute("PRAGMA page_size").fetchone()[0]
    size = os.path.getsize(f"{queue.path}-wal")
    return 0 if size == 0 else (size - 32) // (page + 24)


def test_each_timed_save_goes_through_the_narrow_view_and_writes_one_page(tmp_path: Path) -> None:
    checkpoints = timed_chain()
    assert all(len(cp.durations) == cp.step_index for cp in checkpoints[1:])
    queue = SqliteQueue(tmp_path / "q.db")
    queue.submit("chain", run_id="r")
    lease = queue.claim("w", {"chain": None}, 600)
    assert lease is not None
    queue.save(lease, checkpoints[0], 600)  # the first save writes the run in full
    queue.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = queue.status("r")
    seen: list[str] = []
    queue.conn.set_trace_callback(seen.append)
    for k, checkpoint in enumerate(checkpoints[1:], start=1):
        assert queue.save(lease, checkpoint, 600) is False
        assert _frames(queue) == k, f"save {k} wrote {_frames(queue) - k + 1} pages"
    saves = [s for s in seen if not s.startswith("PRAGMA page_size")]  # (this test's own reads)
    assert saves and all(s.startswith("INSERT INTO ekit_queue_steps") for s in saves), saves[:1]
    after = queue.status("r")
    assert (after.lease_until, after.updated_at) == (before.lease_until, before.updated_at)
    assert after.steps_done == STEPS
    read = queue.checkpoint("r")
    assert read == checkpoints[-1]
    assert dict(read.durations) == dict(checkpoints[-1].durations) and len(read.began) == STEPS
    queue.close()

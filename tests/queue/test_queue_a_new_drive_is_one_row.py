"""A queued run's new drive (each claim) is saved as one row appended, not as the run again.

What users rely on: every claim of a queued run begins a drive, recorded in
the checkpoint's ``drives`` (who ran what: the dashboard's timeline). A
claim or resume of a long run must not rewrite all its outputs to record
one worker's name: the first save of the drive writes the drive as a row of
its own beside the step's rows, on both backends, and every checkpoint
loads back with every drive. A queue written before drives were rows (each
drive in the run's header) loads and resumes alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import ekit_runtime.queue.base
from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Lease, RunQueue
from ekit_runtime.stores.rows import EncodedCheckpoint
from tests.support.queue_backends import queue, queue_url

__all__ = ["queue", "queue_url"]

STEPS = 30


class Stop(Exception):
    """Ends a drive after some saves, as a worker that dies would."""


def _chain() -> Workflow:
    return Workflow([Step(f"s{i}", lambda ctx, i=i: "x" * 200 + str(i), (f"s{i - 1}",) if i else ())
                     for i in range(STEPS)])


def _drive(q: RunQueue, lease: Lease, worker: str, saves: int | None = None) -> list[WorkflowCheckpoint]:
    """Drive the run under ``lease`` as ``worker`` from its checkpoint, for ``saves`` saves (None: to
    its end), each saved through the queue and read back as saved."""
    seen: list[WorkflowCheckpoint] = []

    def save(cp: WorkflowCheckpoint) -> None:
        q.save(lease, cp, 60)
        seen.append(cp)
        assert q.checkpoint(lease.run_id) == cp, len(seen)
        if saves is not None and len(seen) == saves:
            raise Stop

    with pytest.raises(Stop) if saves is not None else contextlib.nullcontext():
        _chain().run_sync(resume_from=lease.checkpoint, checkpoint_fn=save, worker=worker)
    return seen


@pytest.fixture
def encoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[EncodedCheckpoint]]:
    written: list[EncodedCheckpoint] = []
    real = ekit_runtime.queue.base.encode_checkpoint

    def spy(*args: Any, **kw: Any) -> EncodedCheckpoint:
        written.append(real(*args, **kw))
        return written[-1]

    monkeypatch.setattr(ekit_runtime.queue.base, "encode_checkpoint", spy)
    yield written


def _claim(q: RunQueue) -> Lease:
    lease = q.claim("me", {"w": _chain().graph.fingerprint}, 60)
    assert lease is not None
    return lease


def test_each_drive_after_the_first_saves_one_row_more_and_not_the_run(
        queue: RunQueue, encoded: list[EncodedCheckpoint]) -> None:
    queue.submit("w", run_id="r")
    lease = _claim(queue)
    _drive(queue, lease, "host-a:1", saves=10)
    assert encoded[0].full  # (the run's first save writes its header)
    workers = ["host-a:1"]
    for n, worker in enumerate(("host-b:2", "host-c:3"), 1):
        queue.release(lease)
        lease = _claim(queue)
        encoded.clear()
        seen = _drive(queue, lease, worker, saves=5)
        workers.append(worker)
        one = encoded[0]
        assert not one.full, "a new drive rewrote the run"
        assert sorted(kind for kind, _name, _value in one.rows) == ["drive", "output"], one.rows
        assert [name for kind, name, _ in one.rows if kind == "drive"] == [str(n)]
        assert sum(len(v) for _, _, v in one.rows) < 400  # (a step's output and the drive, not 30)
        assert [d.worker for d in seen[-1].drives] == workers
    queue.release(lease)
    last = _drive(queue, _claim(queue), "host-d:4")
    assert [d.worker for d in last[-1].drives] == [*workers, "host-d:4"]
    assert len(last[-1].outputs) == STEPS


def test_a_run_whose_drives_are_in_its_header_loads_and_gains_rows(
        queue: RunQueue, encoded: list[EncodedCheckpoint], monkeypatch: pytest.MonkeyPatch) -> None:
    """As a queue of the release before writes a run: every drive in its header (each new drive a
    save in full); then this release drives it on."""
    real = ekit_runtime.queue.base.encode_checkpoint
    monkeypatch.setattr(ekit_runtime.queue.base, "encode_checkpoint",
                        lambda *a, **kw: real(*a, **{**kw, "drive_rows": False}))
    queue.submit("w", run_id="r")
    lease = _claim(queue)
    _drive(queue, lease, "old-a", saves=4)
    queue.release(lease)
    lease = _claim(queue)
    before = _drive(queue, lease, "old-b", saves=4)
    assert [d.worker for d in before[-1].drives] == ["old-a", "old-b"]
    monkeypatch.setattr(ekit_runtime.queue.base, "encode_checkpoint", real)
    queue.release(lease)
    lease = _claim(queue)
    assert lease.checkpoint == before[-1]
    seen = _drive(queue, lease, "new-c", saves=3)  # (each read back as saved: see _drive)
    assert [d.worker for d in seen[-1].drives] == ["old-a", "old-b", "new-c"]
    queue.release(lease)
    last = _drive(queue, _claim(queue), "new-d")
    assert [d.worker for d in last[-1].drives] == ["old-a", "old-b", "new-c", "new-d"]
    assert len(last[-1].outputs) == STEPS

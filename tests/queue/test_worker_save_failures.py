"""A save that fails for a reason that passes is never the run's failure.

The real failures: a PostgreSQL session ended on the server
(``pg_terminate_backend``) while a step runs, so that the step's save is the
first call on the dead connection; a SQLite database that is full
(``max_page_count``, SQLite's own ``SQLITE_FULL``). The worker retries the
save while its lease may hold (no step starts meanwhile) and the finished
output reaches the queue; once the lease may have run out it gives the run
up (``lost``, never ``failed``) and the next taker resumes from what was
stored. A save that fails for good (an output that cannot be encoded) stays
the run's failure.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, RunQueue, SqliteQueue, Worker, open_queue
from ekit_runtime.queue.transient import is_transient
from tests.support.queue_backends import postgres_url, queue, queue_url, wait_for

__all__ = ["postgres_url", "queue", "queue_url"]


def _after_a(started: asyncio.Event, release: asyncio.Event, log: list[str]) -> Workflow:
    """``a`` (waits for ``release``) then ``b``; each records its start in ``log``."""

    async def a(ctx: dict[str, Any]) -> str:
        log.append("a")
        started.set()
        await release.wait()
        return "A" * 5000  # big enough to need new pages in a full SQLite file

    async def b(ctx: dict[str, Any]) -> str:
        log.append("b")
        return "B"

    return Workflow([Step("a", a), Step("b", b, ("a",))])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ekit.worker" and r.levelno >= 30]


_VICTIM = "ekit-victim-worker"
_SESSIONS = "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()"


def _terminate(conn: Any, sessions: str = _SESSIONS) -> None:
    """End, on the server, the worker's sessions (its queue's, and its loop's for its writes and
    claims) that ``sessions`` finds; wait until they are gone."""
    pids = [row[0] for row in conn.execute(sessions, (_VICTIM,)).fetchall()]
    assert pids, "the worker has no session to end"
    for pid in pids:
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    # Those sessions, not the name: the worker's retry may already have
    # reconnected under the same application_name.
    gone = "SELECT 1 FROM pg_stat_activity WHERE pid = ANY(%s)"
    wait_for(lambda: not conn.execute(gone, (pids,)).fetchall(), timeout=10, what="the sessions to go")


def _kill_during(admin_url: str, when: str, release: Any) -> None:
    """End the worker's session while its step runs (``idle``), or while the step's save waits on a lock."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn, psycopg.connect(admin_url) as locker:
        if when == "idle":
            _terminate(conn)
            release()
            return
        # Hold the run's row: the save's UPDATE waits for it, inside the call.
        locker.execute("SELECT 1 FROM ekit_queue_runs WHERE run_id = 'dropped' FOR UPDATE")
        release()
        waiting = _SESSIONS + " AND wait_event_type = 'Lock'"
        wait_for(lambda: conn.execute(waiting, (_VICTIM,)).fetchall(), timeout=10, what="the save to wait")
        _terminate(conn, waiting)  # the session inside the save's statement
        locker.commit()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["idle", "mid-save"])
def test_a_session_ended_on_the_server_during_a_step_does_not_fail_the_run(
    postgres_url: str, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    admin = open_queue(postgres_url)
    run = admin.submit("w", run_id="dropped")
    mine = open_queue(postgres_url + f"&application_name={_VICTIM}")
    log: list[str] = []

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        # No heartbeat during the test: the step's save is the first call after the kill.
        worker = Worker(
            mine, {"w": _after_a(started, release, log)}, lease_seconds=60, heartbeat=50, poll=0.01
        )
        task = asyncio.create_task(worker.run_until_idle())
        await started.wait()
        go = functools.partial(loop.call_soon_threadsafe, release.set)
        await asyncio.to_thread(_kill_during, postgres_url, when, go)
        await task
        assert worker.outcomes == {run: "finished"}

    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        asyncio.run(main())
    info = admin.status(run)
    assert (info.status, info.epoch, info.error) == ("finished", 1, None)
    result = admin.result(run)
    assert result is not None and dict(result.outputs) == {"a": "A" * 5000, "b": "B"}
    assert log == ["a", "b"]
    # The save whose session ended in it was made again (a session ended
    # while idle is replaced before the save): the run was never given up.
    assert not any("giving the run up" in m or "lost" in m for m in _warnings(caplog)), _warnings(caplog)
    mine.close()
    admin.close()


class _FullOnce:
    """The SQLite queue, its file limited to its current size until the first save fails for it.

    The failure is SQLite's own (``SQLITE_FULL``: ``max_page_count`` reached);
    space is given back on the worker's database thread right after it.
    """

    def __init__(self, inner: SqliteQueue) -> None:
        self._inner = inner
        self.errors: list[BaseException] = []
        (pages,) = inner.conn.execute("PRAGMA page_count").fetchone()
        inner.conn.execute(f"PRAGMA max_page_count = {pages}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # The worker saves through save_many; RunQueue's makes each save with self.save (this one).
    save_many = RunQueue.save_many
    write_many = RunQueue.write_many

    def save(self, lease: Lease, checkpoint: Any, lease_seconds: float) -> bool:
        try:
            return self._inner.save(lease, checkpoint, lease_seconds)
        except sqlite3.Error as exc:
            self.errors.append(exc)
            self._inner.conn.execute("PRAGMA max_page_count = 1073741823")  # the disk has room again
            raise


@pytest.mark.timeout(60)
def test_a_full_sqlite_disk_during_a_save_does_not_fail_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inner = SqliteQueue(tmp_path / "q.db")
    run = inner.submit("w", run_id="full")
    full = _FullOnce(inner)
    log: list[str] = []

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()
        worker = Worker(
            full,  # type: ignore[arg-type]
            {"w": _after_a(started, release, log)},
            lease_seconds=60,
            heartbeat=50,
            poll=0.01,
        )
        task = asyncio.create_task(worker.run_until_idle())
        await started.wait()
        release.set()
        await task
        assert worker.outcomes == {run: "finished"}

    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        asyncio.run(main())
    assert len(full.errors) == 1 and "full" in str(full.errors[0])
    # The backend's classification: a full disk passes once space is freed.
    assert is_transient(full.errors[0])
    result = inner.result(run)
    assert result is not None and dict(result.outputs) == {"a": "A" * 5000, "b": "B"}
    assert log == ["a", "b"]
    assert any("saving run 'full' (epoch 1) failed" in m for m in _warnings(caplog))
    inner.close()


class _Unreachable:
    """The queue, once a run is claimed: every save and renewal fails with a transient error."""

    def __init__(self, inner: RunQueue) -> None:
        self._inner = inner
        self.saves = self.renews = self.finishes = self.claims = 0

    def claim(self, worker: str, workflows: Any, lease_seconds: float) -> Lease | None:
        self.claims += 1  # one lease only: after it, the queue looks empty to this worker
        return self._inner.claim(worker, workflows, lease_seconds) if self.claims == 1 else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # The worker claims through claim_many; RunQueue's claims each run with self.claim (this one).
    claim_many = RunQueue.claim_many

    # The worker saves through save_many; RunQueue's makes each save with self.save (this one).
    save_many = RunQueue.save_many
    write_many = RunQueue.write_many

    def save(self, lease: Lease, checkpoint: Any, lease_seconds: float) -> bool:
        self.saves += 1
        raise sqlite3.OperationalError("database is locked")

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        self.renews += 1
        raise sqlite3.OperationalError("database is locked")

    def finish(self, lease: Lease, status: Any, error: str | None = None) -> None:
        self.finishes += 1
        self._inner.finish(lease, status, error)


@pytest.mark.timeout(60)
def test_a_save_failing_until_the_lease_may_lapse_gives_the_run_up_and_starts_nothing(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    run = queue.submit("w", run_id="given-up")
    flaky = _Unreachable(queue)
    log: list[str] = []
    lease = 0.6

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()
        release.set()
        # The worker retries for as long as the lease may hold, then lets the run go.
        worker = Worker(
            flaky,  # type: ignore[arg-type]
            {"w": _after_a(started, release, log)},
            lease_seconds=lease,
            heartbeat=0.1,
            poll=0.01,
        )
        await worker.run_until_idle()
        assert worker.outcomes == {run: "lost"}

    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        asyncio.run(main())
    # b depends on a, whose save never went through: it was never started.
    assert log == ["a"]
    assert flaky.saves >= 3 and flaky.finishes == 0  # retried, and never marked failed
    assert queue.status(run).status == "running" and queue.status(run).error is None
    warned = _warnings(caplog)
    assert any("saving run 'given-up' (epoch 1) failed" in m and "retrying" in m for m in warned), warned
    # Given up by the save's retries or by the heartbeat's, whichever saw the lease run out first.
    assert any("giving the run up" in m or "treating it as lost" in m for m in warned), warned
    # Its lease expires; the next taker resumes and finishes it.
    wait_for(lambda: _claimable(queue), timeout=10, what="the lease to expire")
    again: list[str] = []

    async def retake() -> None:
        started, release = asyncio.Event(), asyncio.Event()
        release.set()
        assert await Worker(queue, {"w": _after_a(started, release, again)}, poll=0.01).run_until_idle() == 1

    asyncio.run(retake())
    assert queue.status(run).status == "finished" and again == ["a", "b"]


def _claimable(queue: RunQueue) -> bool:
    info = queue.runs()[0]
    return info.lease_until is not None and info.lease_until < time.time()


def test_an_output_that_cannot_be_stored_is_still_the_runs_failure(queue: RunQueue) -> None:
    run = queue.submit("w", run_id="bad-output")

    async def a(ctx: dict[str, Any]) -> object:
        return object()  # no JSON for it: a ValueError from the save, not transient

    worker = Worker(queue, {"w": Workflow([Step("a", a)])}, poll=0.01)
    assert asyncio.run(worker.run_until_idle()) == 1
    info = queue.status(run)
    assert worker.outcomes == {run: "failed"} and info.status == "failed"
    assert info.error is not None and "cannot encode the output of step 'a'" in info.error

"""The worker against a failing database, on SQLite and PostgreSQL.

Failures are injected by wrapping the real queue (every call not overridden
goes to the database), so each test knows exactly which call fails and when;
the steps wait on events the wrapper sets, never on sleeps.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import Lease, LeaseLostError, RunQueue, Worker, open_queue
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.stores import CorruptStoreError
from tests.support.queue_backends import postgres_url, queue, queue_url, wait_for

__all__ = ["postgres_url", "queue", "queue_url"]


def _transient(backend: str) -> Exception:
    """The error a backend's driver raises when the database cannot answer just now."""
    if backend == "postgres":
        import psycopg

        return psycopg.OperationalError("server closed the connection unexpectedly")
    return sqlite3.OperationalError("database is locked")


class _Failing:
    """The queue, with ``renew`` and ``claim`` failing as a test says (called on the worker's db thread)."""

    def __init__(
        self,
        inner: RunQueue,
        *,
        renew_failures: float = 0,
        claim_failures: int = 0,
        finish_failures: float = 0,
    ) -> None:
        self._inner = inner
        self.renew_failures, self.claim_failures = renew_failures, claim_failures
        self.finish_failures = finish_failures
        self.renews = self.claims = self.finishes = 0
        self.claim_times: list[float] = []
        self.renewed = threading.Event()  # set by the first renewal that succeeds
        self.claim_error: Exception = _transient(inner.backend)
        self.one_lease = False  # True: after the first lease, report an empty queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # The worker claims through claim_many; RunQueue's claims each run with self.claim (this one).
    claim_many = RunQueue.claim_many

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        self.renews += 1
        if self.renews <= self.renew_failures:
            raise _transient(self._inner.backend)
        cancel = self._inner.renew(lease, lease_seconds)
        self.renewed.set()
        return cancel

    def claim(self, worker: str, workflows: Any, lease_seconds: float) -> Lease | None:
        self.claim_times.append(time.monotonic())
        self.claims += 1
        if self.claims <= self.claim_failures:
            raise self.claim_error
        if self.one_lease and self.claims > self.claim_failures + 1:
            return None
        return self._inner.claim(worker, workflows, lease_seconds)

    # The worker ends runs through write_many; RunQueue's ends each with self.finish (this one).
    write_many = RunQueue.write_many

    def finish(self, lease: Lease, status: Any, error: str | None = None) -> None:
        self.finishes += 1
        if self.finishes <= self.finish_failures:
            raise _transient(self._inner.backend)
        self._inner.finish(lease, status, error)


def _waits_for(event: threading.Event) -> Workflow:
    async def wait(ctx: dict[str, Any]) -> str:
        # A real wait on the event (on a thread), bounded so a bug fails the test rather than hanging it.
        assert await asyncio.to_thread(event.wait, 60), "no renewal succeeded"
        return "renewed"

    return Workflow([Step("wait", wait)])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "ekit.worker" and r.levelno == logging.WARNING
    ]


def test_a_failed_renewal_is_logged_and_retried_at_the_next_heartbeat(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = _Failing(queue, renew_failures=2)
    run = queue.submit("w", run_id="beat")
    worker = Worker(flaky, {"w": _waits_for(flaky.renewed)}, lease_seconds=30, heartbeat=0.05, poll=0.01)
    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        assert asyncio.run(worker.run_until_idle()) == 1
    # The third renewal went through on the same lease: the run was never lost.
    assert worker.outcomes == {run: "finished"} and flaky.renews >= 3
    assert queue.status(run).epoch == 1 and queue.status(run).status == "finished"
    warned = _warnings(caplog)
    assert len(warned) == 2, warned
    error = str(_transient(queue.backend))
    for message in warned:
        assert (
            "'beat' (epoch 1)" in message and error in message and "retrying at the next heartbeat" in message
        )


def test_an_ending_that_fails_transiently_is_retried_and_the_run_ends_on_its_own_lease(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = _Failing(queue, finish_failures=2)
    run = queue.submit("w", run_id="ends")
    done = threading.Event()
    done.set()
    worker = Worker(flaky, {"w": _waits_for(done)}, lease_seconds=30, poll=0.01)
    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        assert asyncio.run(worker.run_until_idle()) == 1
    # Ended by this worker, on its lease: not left running for another to take.
    assert worker.outcomes == {run: "finished"} and flaky.finishes == 3
    info = queue.status(run)
    assert (info.status, info.epoch) == ("finished", 1)
    warned = _warnings(caplog)
    assert len(warned) == 2, warned  # the 1st and 2nd failures in a row
    error = str(_transient(queue.backend))
    for message in warned:
        assert "marking run 'ends' (epoch 1) finished failed" in message and error in message
        assert "retrying" in message
    events = [getattr(r, "event", None) for r in caplog.records if r.name == "ekit.worker"]
    assert events.count("end_failed") == 2


def test_an_ending_that_keeps_failing_is_given_up_once_the_lease_may_have_run_out(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = _Failing(queue, finish_failures=float("inf"))
    flaky.one_lease = True
    run = queue.submit("w", run_id="stuck")
    done = threading.Event()
    done.set()
    worker = Worker(flaky, {"w": _waits_for(done)}, lease_seconds=0.6, heartbeat=0.1, poll=0.01)
    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        assert asyncio.run(worker.run_until_idle()) == 1
    # Retried, then given up as before: the run stays running until its lease
    # runs out, and the next taker (which resumes from its checkpoint) ends it.
    assert flaky.finishes >= 3
    assert queue.status(run).status == "running"
    errors = [
        r.getMessage() for r in caplog.records if r.name == "ekit.worker" and r.levelno >= logging.ERROR
    ]
    assert any("driving run 'stuck' failed" in m for m in errors), errors


def test_a_renewal_that_keeps_failing_loses_the_lease_once_it_has_run_out(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    flaky = _Failing(queue, renew_failures=float("inf"))
    flaky.one_lease = True
    run = queue.submit("w", run_id="lapsed")
    lease_seconds = 0.6

    async def forever(ctx: dict[str, Any]) -> str:
        await asyncio.Event().wait()  # only the worker's cancel ends it
        return "never"

    worker = Worker(
        flaky,
        {"w": Workflow([Step("s", forever)])},
        lease_seconds=lease_seconds,
        heartbeat=0.1,
        poll=0.01,
    )
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        assert asyncio.run(worker.run_until_idle()) == 1
    assert time.monotonic() - began >= lease_seconds  # it kept the run while the lease could hold
    assert worker.outcomes == {run: "lost"} and flaky.finishes == 0  # and wrote nothing more
    warned = _warnings(caplog)
    assert any("retrying at the next heartbeat" in m for m in warned), warned
    assert any("'lapsed' (epoch 1)" in m and "has run out; treating it as lost" in m for m in warned)
    assert any("was lost; stopped driving it and wrote nothing more" in m for m in warned)
    with pytest.raises(LeaseLostError):  # the database agrees: the lease is gone
        queue.renew(Lease(run, 1, "w", MappingProxyType({}), None, 0.0), 5)


def test_transient_claim_errors_are_logged_and_retried_with_a_doubling_backoff(
    queue: RunQueue, caplog: pytest.LogCaptureFixture
) -> None:
    poll = 0.01
    flaky = _Failing(queue, claim_failures=4)
    run = queue.submit("w", run_id="claimed")
    flaky.renewed.set()  # the step need not wait for a renewal here
    worker = Worker(flaky, {"w": _waits_for(flaky.renewed)}, poll=poll)
    with caplog.at_level(logging.WARNING, logger="ekit.worker"):
        assert asyncio.run(worker.run_until_idle()) == 1
    assert worker.outcomes == {run: "finished"}
    warned = _warnings(caplog)
    assert len(warned) == 4, warned
    assert all(str(flaky.claim_error) in m and "claiming a run failed" in m for m in warned)
    assert [m.rsplit("(failure ", 1)[1] for m in warned] == [
        "1 in a row)",
        "2 in a row)",
        "3 in a row)",
        "4 in a row)",
    ]
    gaps = [b - a for a, b in zip(flaky.claim_times, flaky.claim_times[1:], strict=False)]
    for n, gap in enumerate(gaps[:4]):
        assert gap >= poll * 2**n - 0.002, f"retry {n + 1} came after {gap:.4f}s"


def test_the_claim_backoff_is_bounded(queue: RunQueue) -> None:
    worker = Worker(queue, {"w": _waits_for(threading.Event())}, poll=0.5)
    delays = []
    for failures in (1, 2, 3, 4, 5, 10, 1000):
        worker._claim_failures = failures
        delays.append(worker._backoff())
    assert delays == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    slow = Worker(queue, {"w": _waits_for(threading.Event())}, poll=8.0)
    slow._claim_failures = 50
    assert slow._backoff() == 8.0  # never shorter than the worker's own poll


def test_a_permanent_claim_error_ends_the_worker(queue: RunQueue) -> None:
    flaky = _Failing(queue, claim_failures=1)
    flaky.claim_error = CorruptStoreError("the queue", "header is not an object")
    queue.submit("w")
    worker = Worker(flaky, {"w": _waits_for(threading.Event())}, poll=0.01)
    with pytest.raises(CorruptStoreError, match="header is not an object"):
        asyncio.run(worker.run())
    assert flaky.claims == 1  # not retried


def test_a_queue_with_a_wrong_schema_ends_the_worker(queue_url: str) -> None:
    q = open_queue(queue_url)
    q.submit("w")
    other = open_queue(queue_url)
    # Another tool (or an older ekit) left the tables in a shape this version cannot use.
    if queue_url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(queue_url, autocommit=True) as conn:
            conn.execute("ALTER TABLE ekit_queue_runs RENAME COLUMN epoch TO generation")
        expected: type[Exception] = psycopg.errors.UndefinedColumn
    else:
        other.conn.execute("ALTER TABLE ekit_queue_runs RENAME COLUMN epoch TO generation")  # type: ignore[attr-defined]
        expected = sqlite3.OperationalError
    with pytest.raises(expected, match="epoch"):
        asyncio.run(Worker(q, {"w": _waits_for(threading.Event())}, poll=0.01).run())
    q.close()
    other.close()


def test_which_errors_are_transient(tmp_path: Any) -> None:
    path = str(tmp_path / "locked.db")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    waiter = sqlite3.connect(path, timeout=0, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError) as locked:
        waiter.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError) as missing:
        waiter.execute("SELECT * FROM nowhere")
    holder.execute("ROLLBACK")
    holder.close()
    waiter.close()
    assert is_transient(locked.value)  # a real SQLITE_BUSY, with its error code
    assert is_transient(sqlite3.OperationalError("database table is locked"))  # no code: by its wording
    for permanent in (
        missing.value,
        CorruptStoreError("q.db", "header is not an object"),
        ValueError("lease_seconds must be a positive number"),
        LeaseLostError("r", 1),
        sqlite3.DatabaseError("file is not a database"),
    ):
        assert not is_transient(permanent), permanent


def test_which_postgres_errors_are_transient() -> None:
    psycopg = pytest.importorskip("psycopg")
    errors = psycopg.errors
    for transient in (
        psycopg.OperationalError("connection refused"),
        errors.AdminShutdown("terminating connection due to administrator command"),
        errors.SerializationFailure("could not serialize access"),
        errors.DeadlockDetected("deadlock detected"),
        errors.IdleInTransactionSessionTimeout("terminating connection due to idle-in-transaction timeout"),
    ):
        assert is_transient(transient), transient
    for permanent in (
        errors.UndefinedTable('relation "ekit_queue_runs" does not exist'),
        errors.InvalidPassword("password authentication failed"),
        psycopg.InterfaceError("the connection is closed"),
    ):
        assert not is_transient(permanent), permanent


def test_a_client_stalled_inside_a_transaction_does_not_strand_a_run(postgres_url: str) -> None:
    import psycopg

    from ekit_runtime.queue import PostgresQueue

    stalled = PostgresQueue(postgres_url, idle_timeout=0.5)
    run = stalled.submit("w", run_id="held")
    taker = open_queue(postgres_url)
    # What a worker paused (or cut off) in the middle of a claim leaves behind:
    # an open transaction holding the run's row. Claims skip locked rows, so
    # until the server ends that transaction nobody can take the run.
    with pytest.raises(psycopg.Error), stalled.db.transaction() as conn:
        conn.execute("SELECT 1 FROM ekit_queue_runs WHERE run_id = %s FOR UPDATE", (run,))
        assert taker.claim("taker", {"w": None}, 30) is None
        lease = wait_for(
            lambda: taker.claim("taker", {"w": None}, 30), timeout=30, what="the stalled transaction to end"
        )
        assert lease.run_id == run and lease.epoch == 1
    # The stalled queue reconnects at its next call, with the same timeout.
    assert stalled.status(run).owner == "taker"
    row = stalled.db.conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()
    assert row is not None and row[0] == "500ms"
    stalled.close()
    taker.close()

"""A storage failure during a save is transient, leaves the database intact, and the next call succeeds.

The worker retries a save that raised an error :func:`is_transient` calls
transient, for as long as its lease may be valid; these tests pin the
queue's side of that contract, with real failures: a PostgreSQL session
ended by the server (``pg_terminate_backend``) in the middle of a save and
between two calls, and a full disk under SQLite (SQLite's own page limit,
and a real full tmpfs where this machine lets the test mount one).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime import PatternResult, Step, TokenUsage, Workflow
from ekit_runtime.queue import LeaseLostError, SqliteQueue
from ekit_runtime.queue.transient import is_transient
from tests.support.queue_backends import postgres_url, wait_for

__all__ = ["postgres_url"]


def _checkpoints(steps: int, size: int = 10) -> list[WorkflowCheckpoint]:
    """The checkpoints a chain of ``steps`` steps saves, one per step; each step costs one call."""

    def step(i: int) -> Any:
        return lambda ctx: PatternResult(f"{i}:" + "x" * size, cost=TokenUsage(10, 5, 1))

    chain = Workflow([Step(f"s{i}", step(i), (f"s{i - 1}",) if i else ()) for i in range(steps)])
    seen: list[WorkflowCheckpoint] = []
    chain.run_sync(checkpoint_fn=seen.append)
    by_index = {cp.step_index: cp for cp in seen}
    return [by_index[i] for i in sorted(by_index)][-steps:]


# -- PostgreSQL: a session the server ends -------------------------------------


@pytest.fixture
def admin(postgres_url: str) -> Iterator[Any]:
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        yield conn


def _gone(admin: Any, pid: int) -> bool:
    return admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0] == 0


def _usage_calls(admin: Any) -> int:
    return int(admin.execute("SELECT coalesce(sum(llm_calls), 0) FROM ekit_queue_usage").fetchone()[0])


def test_a_session_ended_in_the_middle_of_a_save_is_transient_and_the_retry_lands(
    postgres_url: str, admin: Any
) -> None:
    import psycopg

    from ekit_runtime.queue import PostgresQueue

    q = PostgresQueue(postgres_url)
    first, second = _checkpoints(2)
    run = q.submit("w", run_id="dropped")
    lease = q.claim("w1", {"w": None}, 30)
    assert lease is not None
    q.save(lease, first, 30)
    pid = q.db.conn.info.backend_pid
    # Hold the run's row so that the next save is caught inside its statement,
    # then end its session there: a failover or a proxy restart mid-save.
    admin.execute("BEGIN")
    admin.execute("SELECT 1 FROM ekit_queue_runs WHERE run_id = %s FOR UPDATE", (run,))
    raised: list[BaseException] = []

    def save() -> None:
        try:
            q.save(lease, second, 30)
        except BaseException as exc:
            raised.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    wait_for(
        lambda: admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        == ("Lock",),
        timeout=10,
        what="the save to wait on the row lock",
    )
    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    saver.join(10)
    admin.execute("ROLLBACK")
    assert len(raised) == 1 and isinstance(raised[0], psycopg.Error), raised
    assert is_transient(raised[0]), raised[0]
    assert q.checkpoint(run) == first  # this call reconnected; the dropped save wrote nothing
    assert q.db.conn.info.backend_pid != pid
    # Whether the dropped save committed is unknown to the queue: the next one is a full rewrite.
    assert q._encode(lease, second).full
    assert q.save(lease, second, 30) is False  # the retried save lands
    assert q.checkpoint(run) == second
    # The retry counted the second step's call once, not the whole run again.
    assert _usage_calls(admin) == 2
    q.finish(lease, "finished")
    assert q.status(run).status == "finished"
    q.close()


def test_a_session_ended_between_calls_is_reopened_before_the_next_call(
    postgres_url: str, admin: Any
) -> None:
    from ekit_runtime.queue import PostgresQueue

    q = PostgresQueue(postgres_url)
    first, second, third = _checkpoints(3)
    run = q.submit("w", run_id="idle-drop")
    q.submit("w", run_id="other")
    lease = q.claim("w1", {"w": None}, 30)
    assert lease is not None
    q.save(lease, first, 30)
    calls = {
        "delta save": lambda: q.save(lease, second, 30),
        "renew": lambda: q.renew(lease, 30),
        "status": lambda: q.status(run),
        "checkpoint": lambda: q.checkpoint(run),  # a snapshot transaction
        "claim": lambda: q.claim("w1", {"w": None}, 30),  # a read-write transaction
        "full save": lambda: q.save(lease, third, 30),
    }
    for what, call in calls.items():
        pid = q.db.conn.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda pid=pid: _gone(admin, pid), timeout=10, what="the session to end")
        call()  # the server's goodbye is read first: the call runs on a new session
        assert q.db.conn.info.backend_pid != pid, what
    assert q.checkpoint(run) == third
    assert q.status("other").status == "running"
    assert _usage_calls(admin) == 3
    q.close()


def test_a_closed_queue_is_refused_and_not_waited_out(postgres_url: str) -> None:
    from ekit_runtime.queue import PostgresQueue

    q = PostgresQueue(postgres_url)
    run = q.submit("w")
    q.close()
    with pytest.raises(RuntimeError, match="closed") as closed:
        q.status(run)
    assert not is_transient(closed.value)


def test_a_fenced_write_that_matches_no_row_stays_lease_lost_not_transient(postgres_url: str) -> None:
    from ekit_runtime.queue import PostgresQueue

    q = PostgresQueue(postgres_url)
    q.submit("w", run_id="r")
    lease = q.claim("w1", {"w": None}, 30)
    assert lease is not None
    q.cancel("r")
    q.finish(lease, "cancelled")
    with pytest.raises(LeaseLostError) as lost:
        q.save(lease, _checkpoints(1)[0], 30)
    assert not is_transient(lost.value)
    q.close()


# -- SQLite: a full disk --------------------------------------------------------


def _integrity(path: Path) -> str:
    conn = sqlite3.connect(path)
    try:
        return str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()


def test_sqlite_full_during_a_save_is_transient_and_the_next_save_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "q.db"
    q = SqliteQueue(path)
    first, second, third = _checkpoints(3, size=200_000)
    run = q.submit("w", run_id="full")
    lease = q.claim("w1", {"w": None}, 30)
    assert lease is not None
    q.save(lease, first, 30)
    # SQLite's own limit on the database's size: past it, a write fails with
    # SQLITE_FULL exactly as on a full disk.
    (pages,) = q.conn.execute("PRAGMA page_count").fetchone()
    q.conn.execute(f"PRAGMA max_page_count = {pages + 2}")
    with pytest.raises(sqlite3.OperationalError) as full:
        q.save(lease, second, 30)
    assert full.value.sqlite_errorcode == sqlite3.SQLITE_FULL
    assert is_transient(full.value)
    assert _integrity(path) == "ok"
    assert q.checkpoint(run) == first  # rolled back whole
    assert q._encode(lease, second).full  # the failed save is not built on
    q.conn.execute("PRAGMA max_page_count = 1073741823")  # space is back
    assert q.save(lease, second, 30) is False
    q.save(lease, third, 30)
    assert q.checkpoint(run) == third and _integrity(path) == "ok"
    q.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs mounted for this test (needs root and a mount namespace that allows it)."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; the SQLITE_FULL test above covers the rule")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def _fill(folder: Path) -> Path:
    filler = folder / "filler"
    with open(filler, "wb") as out:
        try:
            while True:
                out.write(b"\0" * 65536)
                out.flush()
        except OSError:
            pass
    return filler


def test_a_really_full_disk_fails_a_save_transiently_and_the_database_stays_intact(small_disk: Path) -> None:
    path = small_disk / "q.db"
    q = SqliteQueue(path)
    first, second = _checkpoints(2, size=500_000)
    run = q.submit("w", run_id="disk")
    lease = q.claim("w1", {"w": None}, 30)
    assert lease is not None
    q.save(lease, first, 30)
    filler = _fill(small_disk)
    with pytest.raises(sqlite3.OperationalError) as full:
        q.save(lease, second, 30)
    assert is_transient(full.value), full.value
    filler.unlink()
    assert q.checkpoint(run) == first and _integrity(path) == "ok"
    assert q.save(lease, second, 30) is False
    assert q.checkpoint(run) == second
    q.close()


# -- the classification, error by error -----------------------------------------------


def _sqlite_error(cls: type[sqlite3.Error], code: int, text: str) -> sqlite3.Error:
    exc = cls(text)
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


def test_which_storage_errors_pass_by_themselves() -> None:
    psycopg = pytest.importorskip("psycopg")
    errors = psycopg.errors
    refused = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
    transient = [
        _sqlite_error(sqlite3.OperationalError, sqlite3.SQLITE_FULL, "database or disk is full"),
        _sqlite_error(sqlite3.OperationalError, sqlite3.SQLITE_IOERR_WRITE, "disk I/O error"),
        _sqlite_error(sqlite3.OperationalError, sqlite3.SQLITE_BUSY_SNAPSHOT, "database is locked"),
        sqlite3.OperationalError("database or disk is full"),  # no code: by its wording
        errors.AdminShutdown("terminating connection due to administrator command"),
        errors.CrashShutdown("terminating connection because of crash of another server process"),
        errors.CannotConnectNow("the database system is starting up"),
        errors.TooManyConnections("sorry, too many clients already"),
        errors.DiskFull("could not extend file: No space left on device"),
        errors.LockNotAvailable("canceling statement due to lock timeout"),
        psycopg.OperationalError("the connection is closed"),
        psycopg.OperationalError("consuming input failed: server closed the connection unexpectedly"),
        psycopg.OperationalError(refused + "Connection refused"),
        psycopg.InterfaceError("cannot execute operations: the connection is in status 2"),
    ]
    permanent = [
        _sqlite_error(sqlite3.DatabaseError, sqlite3.SQLITE_CORRUPT, "database disk image is malformed"),
        _sqlite_error(sqlite3.DatabaseError, sqlite3.SQLITE_NOTADB, "file is not a database"),
        _sqlite_error(sqlite3.OperationalError, sqlite3.SQLITE_IOERR | (33 << 8), "disk I/O error"),
        _sqlite_error(sqlite3.OperationalError, sqlite3.SQLITE_ERROR, "no such table: ekit_queue_runs"),
        errors.ProgramLimitExceeded("index row size 3000 exceeds btree version 4 maximum 2704"),
        errors.StringDataRightTruncation("value too long"),
        errors.UntranslatableCharacter("unsupported Unicode escape sequence"),
        errors.InvalidPassword("password authentication failed for user \"ekit\""),
        errors.UndefinedColumn('column "epoch" does not exist'),
        psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes"),
        psycopg.OperationalError(refused + 'FATAL:  password authentication failed for user "ekit"'),
        psycopg.OperationalError(refused + 'FATAL:  database "runs" does not exist'),
        psycopg.InterfaceError("the cursor is closed"),
        LeaseLostError("r", 1),
        ValueError("run_id must not contain a NUL character"),
    ]
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []

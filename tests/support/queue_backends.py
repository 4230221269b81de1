"""Test support for the run queue: a fresh queue on each backend, and reading it from outside.

The PostgreSQL backend runs against the real server that ``.ci/postgres``
starts (``EKIT_TEST_POSTGRES_DSN``); each test gets a database of its own.
Without that variable the PostgreSQL tests FAIL, so CI can never skip them
silently; a developer without PostgreSQL sets ``EKIT_SKIP_POSTGRES=1`` to
skip them.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sqlite3
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Step, Workflow, WorkflowCheckpoint
from ekit_runtime.queue import Lease, RunQueue, open_queue

BACKENDS = ("sqlite", "postgres")
DSN_VAR = "EKIT_TEST_POSTGRES_DSN"
SKIP_VAR = "EKIT_SKIP_POSTGRES"


def postgres_dsn() -> str:
    """The server's DSN, or a skip (only when the developer asked) or a failure.

    Without ``EKIT_TEST_POSTGRES_DSN`` (a plain ``pytest`` as the README says
    to run it), a throwaway server is started with ``.ci/postgres`` for this
    test session and stopped at its end, so the README's command tests the
    real thing too; if that cannot be done here, the tests fail saying why.
    """
    dsn = os.environ.get(DSN_VAR)
    if dsn:
        return dsn
    if os.environ.get(SKIP_VAR) == "1":
        pytest.skip(f"{SKIP_VAR}=1: PostgreSQL tests skipped")
    try:
        return _start_throwaway_server()
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.fail(
            f"{DSN_VAR} is not set and no throwaway server could be started ({exc}): start one "
            f"with '. .ci/postgres' (bash .ci/run does), or set {SKIP_VAR}=1 to skip these tests",
            pytrace=False,
        )


def _start_throwaway_server() -> str:
    script = Path(__file__).resolve().parents[2] / ".ci" / "postgres"
    done = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise subprocess.SubprocessError(done.stderr.strip()[-300:] or f"exit {done.returncode}")
    for line in done.stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            os.environ[key] = value.strip("'")  # children (worker processes) inherit it
    atexit.register(_stop_throwaway_server, os.environ["EKIT_TEST_POSTGRES_DIR"])
    return os.environ[DSN_VAR]


def _stop_throwaway_server(folder: str) -> None:
    pg_ctl = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    if pg_ctl:
        command = [str(pg_ctl[-1]), "-D", f"{folder}/data", "-m", "immediate", "-w", "stop"]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, capture_output=True, timeout=60, check=False)
    shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def fresh_postgres() -> Iterator[str]:
    """A URL for a new, empty database on the test server, dropped afterwards."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    dsn = postgres_dsn()
    name = f"ekit_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    params = conninfo_to_dict(dsn)
    params["dbname"] = name
    try:
        yield "postgresql://?" + "&".join(f"{k}={v}" for k, v in params.items())
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=BACKENDS)
def queue_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL for an empty queue on each backend (a temporary SQLite file, a fresh database)."""
    if request.param == "sqlite":
        yield str(tmp_path / "queue.db")
        return
    with fresh_postgres() as url:
        yield url


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL for a fresh, empty PostgreSQL database."""
    with fresh_postgres() as url:
        yield url


@pytest.fixture
def queue(queue_url: str) -> Iterator[RunQueue]:
    """An open, empty queue on each backend."""
    q = open_queue(queue_url)
    try:
        yield q
    finally:
        q.close()


def chain_checkpoints(steps: int, prefix: str = "out") -> list[WorkflowCheckpoint]:
    """The checkpoints of a run of a chain of ``steps`` steps, ``s<i>`` returning ``<prefix><i>``."""
    seen: list[WorkflowCheckpoint] = []
    chain = [
        Step(f"s{i}", lambda ctx, i=i: f"{prefix}{i}", (f"s{i - 1}",) if i else ()) for i in range(steps)
    ]
    Workflow(chain).run_sync(checkpoint_fn=seen.append)
    return seen


def claim_runs(queue: RunQueue, count: int) -> list[Lease]:
    """Submit runs ``r0`` .. of workflow ``w`` and claim each (worker ``me``, 60 s leases)."""
    for i in range(count):
        queue.submit("w", run_id=f"r{i}")
    leases = [queue.claim("me", {"w": None}, 60) for _ in range(count)]
    assert all(lease is not None for lease in leases)
    return [lease for lease in leases if lease is not None]


@pytest.fixture
def statements(queue: RunQueue, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The statements ``queue``'s connection runs from now on (SQLite: its trace; PostgreSQL:
    psycopg's execute), so that a test can count them: a batch that fails and is made again
    write by write must not pass for one statement."""
    seen: list[str] = []
    if queue.backend == "sqlite":
        # (A trigger's statements are reported with the text that fired them: repeats are one.)
        conn = queue.conn  # type: ignore[attr-defined]
        conn.set_trace_callback(lambda sql: None if seen and seen[-1] == sql else seen.append(sql))
    else:
        import psycopg

        real = psycopg.Connection.execute

        def execute(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(str(query))
            return real(self, query, *args, **kwargs)

        monkeypatch.setattr(psycopg.Connection, "execute", execute)
    yield seen


def live_leases(url: str) -> int:
    """How many runs hold an unexpired lease, read straight from the database on its own clock."""
    sql = "SELECT count(*) FROM ekit_queue_runs WHERE status = 'running' AND lease_until > {now}"
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute(sql.format(now="extract(epoch from now())")).fetchone()
            assert row is not None
            return int(row[0])
    conn = sqlite3.connect(url, timeout=30)
    try:
        return int(conn.execute(sql.format(now="?"), (time.time(),)).fetchone()[0])
    finally:
        conn.close()


def audit_stale_writes(url: str) -> None:
    """Record, from now on, every entry written under an epoch older than its run's (a zombie's write).

    A trigger in the queue's own database, so that a write the fence lets
    through is caught when it happens, even if a later write hides it.
    """
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS test_stale_writes "
                "(run_id text, name text, epoch bigint, newest bigint)"
            )
            conn.execute(
                "CREATE OR REPLACE FUNCTION test_audit_entry() RETURNS trigger AS $$ DECLARE newest bigint; "
                "BEGIN SELECT epoch INTO newest FROM ekit_queue_runs WHERE run_id = NEW.run_id; "
                "IF NEW.epoch < newest THEN INSERT INTO test_stale_writes VALUES "
                "(NEW.run_id, NEW.name, NEW.epoch, newest); END IF; RETURN NEW; END $$ LANGUAGE plpgsql"
            )
            conn.execute(
                "CREATE OR REPLACE TRIGGER test_audit_entry AFTER INSERT OR UPDATE ON ekit_queue_entries "
                "FOR EACH ROW EXECUTE FUNCTION test_audit_entry()"
            )
        return
    lite = sqlite3.connect(url, timeout=30, isolation_level=None)
    try:
        lite.execute("CREATE TABLE IF NOT EXISTS test_stale_writes (run_id, name, epoch, newest)")
        for event in ("INSERT", "UPDATE"):
            lite.execute(
                f"CREATE TRIGGER IF NOT EXISTS test_audit_entry_{event.lower()} AFTER {event} "
                "ON ekit_queue_entries WHEN NEW.epoch < (SELECT epoch FROM ekit_queue_runs "
                "WHERE run_id = NEW.run_id) BEGIN INSERT INTO test_stale_writes VALUES (NEW.run_id, "
                "NEW.name, NEW.epoch, (SELECT epoch FROM ekit_queue_runs WHERE run_id = NEW.run_id)); END"
            )
    finally:
        lite.close()


def stale_writes(url: str) -> list[tuple[Any, ...]]:
    """What :func:`audit_stale_writes` recorded: ``(run_id, step, epoch written, the run's epoch)``."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            return [tuple(r) for r in conn.execute("SELECT * FROM test_stale_writes").fetchall()]
    lite = sqlite3.connect(url, timeout=30)
    try:
        return [tuple(r) for r in lite.execute("SELECT * FROM test_stale_writes").fetchall()]
    finally:
        lite.close()


def entry_epochs(url: str, run_id: str) -> dict[str, int]:
    """``step name -> epoch of the lease that wrote its output`` for one run."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            rows: list[Any] = conn.execute(
                "SELECT name, epoch FROM ekit_queue_entries WHERE run_id = %s AND kind = 'output'", (run_id,)
            ).fetchall()
    else:
        conn2 = sqlite3.connect(url, timeout=30)
        try:
            rows = conn2.execute(
                "SELECT name, epoch FROM ekit_queue_entries WHERE run_id = ? AND kind = 'output'", (run_id,)
            ).fetchall()
        finally:
            conn2.close()
    return {name: epoch for name, epoch in rows}


def open_writes(url: str) -> int:
    """How many other connections are inside a write transaction that only their client can end.

    SQLite: 1 if another connection holds the write lock (a ``BEGIN IMMEDIATE``
    of ours cannot start). PostgreSQL: the sessions idle inside a transaction
    (a statement the server is still running ends by itself, so those are
    waited out first).
    """
    if url.startswith("postgresql://"):
        import psycopg

        others = (
            "datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        with psycopg.connect(url, autocommit=True) as conn:

            def count(state: str) -> int:
                sql = f"SELECT count(*) FROM pg_stat_activity WHERE {others} AND state LIKE %s"
                row = conn.execute(sql, (state,)).fetchone()
                return int(row[0]) if row is not None else 0

            wait_for(lambda: count("active") == 0, timeout=30, what="running statements to end")
            return count("idle in transaction%")
    conn2 = sqlite3.connect(url, timeout=0, isolation_level=None)
    try:
        conn2.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if "locked" not in str(exc):
            raise
        return 1
    finally:
        if conn2.in_transaction:
            conn2.execute("ROLLBACK")
        conn2.close()
    return 0


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (by SIGSTOP): the kill delivers the signal, not the stop."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:  # no procfs (macOS): ask ps
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout
    return state.strip()[:1] in ("T", "t")


def pause_outside_writes(pid: int, url: str, *, tries: int = 50) -> int:
    """SIGSTOP ``pid`` at a moment it holds no write transaction open; return the tries it took.

    A pause inside a write transaction is another case (docs/queue.md): on
    SQLite it holds the write lock, so every other worker waits for the paused
    one. When a SIGSTOP lands in one, the process is let go (SIGCONT) until
    that transaction has ended, and stopped again.
    """
    for attempt in range(1, tries + 1):
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: stopped(pid), timeout=30, what=f"process {pid} to stop")
        if open_writes(url) == 0:
            return attempt
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: open_writes(url) == 0, timeout=30, what=f"process {pid} to end its write")
    raise AssertionError(f"process {pid} was inside a write transaction at each of {tries} SIGSTOPs")


def wait_for(condition: Any, *, timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``condition()`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def update_run(url: str, sql: str, run_id: str) -> None:
    """Run ``sql`` (an UPDATE whose ``{p}`` stands for the run's id) on its own connection to
    the queue at ``url``, either backend: a change no verb of the queue makes."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.format(p="%s"), (run_id,))
        return
    conn = sqlite3.connect(url, timeout=30, isolation_level=None)
    try:
        conn.execute(sql.format(p="?"), (run_id,))
    finally:
        conn.close()


def expire_lease(url: str, run_id: str) -> None:
    """Make the run's lease expire now, as if its worker had died an hour ago (either backend)."""
    update_run(url, "UPDATE ekit_queue_runs SET lease_until = lease_until - 3600 WHERE run_id = {p}", run_id)


@pytest.fixture
def naps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Every nap a SQLite queue takes while it waits for another connection's lock (really slept)."""
    import ekit_runtime.queue.sqlite as sqlite_queue

    taken: list[float] = []
    real = sqlite_queue._nap

    def nap(seconds: float) -> None:
        taken.append(seconds)
        real(seconds)

    monkeypatch.setattr(sqlite_queue, "_nap", nap)
    yield taken

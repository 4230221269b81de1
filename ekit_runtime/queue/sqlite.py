"""``SqliteQueue``: the embedded run queue, for several worker processes on one machine.

This module owns the queue's SQLite schema. ``ekit_queue_runs`` holds one row
per run: what was submitted, its status, its lease (``epoch``, the fencing
token, and ``lease_until``) and the non-per-step parts of its latest
checkpoint; ``ekit_queue_entries`` one row per recorded output, per-step
usage and skipped step (kind ``skip``), tagged with the epoch that wrote it. ``ekit_queue_starts`` and
``ekit_queue_usage`` are the trailing windows the rate limits count, and
``ekit_queue_config`` holds the fleet's :class:`Limits`.

Every write is one ``BEGIN IMMEDIATE`` transaction, so SQLite's write lock
serialises claims, saves and renewals across processes: the fencing check
(``epoch = ? AND lease_until > now``) and the write it guards commit together
or not at all. Reads take a deferred transaction (one WAL snapshot, no lock).
The clock is the machine's (``time.time()``), shared by every process.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime.queue.base import RunQueue, layout_before, progress, schema_columns, schema_problem
from ekit_runtime.queue.lifecycle import (
    ABANDONED,
    CLAIM_ORDER,
    CLAIMABLE,
    FINAL,
    HELD,
    IN_WINDOW,
    LEFT_WINDOW,
    LIVE,
    MATCHES,
    PARK_STATUS,
    RELEASE_STATUS,
    REOPENED_AS,
    UNCHANGED,
    at_cap,
    at_start_rate,
    cancel_effect,
    live,
    render,
    usage_limited,
    usage_reason,
    usage_wait,
)
from ekit_runtime.queue.records import (
    Lease,
    Limits,
    QueueUnavailableError,
    RunInfo,
    RunStatus,
    UnknownRunError,
    check_age,
    check_run_id,
    check_status,
)
from ekit_runtime.stores.codec import Dumps, Loads
from ekit_runtime.stores.errors import CorruptStoreError
from ekit_runtime.stores.rows import EncodedCheckpoint

__all__ = ["SqliteQueue"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_queue_runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL UNIQUE,
    workflow TEXT NOT NULL,
    context TEXT NOT NULL,
    priority INTEGER NOT NULL,
    status TEXT NOT NULL,
    epoch INTEGER NOT NULL DEFAULT 0,
    owner TEXT,
    lease_until REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    fingerprint TEXT,
    header TEXT,
    step_index INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    llm_calls INTEGER NOT NULL DEFAULT 0,
    failures TEXT NOT NULL DEFAULT '{}',
    saves INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    options TEXT NOT NULL DEFAULT '{}',
    steps_done INTEGER NOT NULL DEFAULT 0,
    steps_total INTEGER,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS ekit_queue_runs_claim ON ekit_queue_runs (status, priority DESC, seq);
CREATE TABLE IF NOT EXISTS ekit_queue_entries (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
CREATE TABLE IF NOT EXISTS ekit_queue_starts (at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ekit_queue_usage (
    at REAL NOT NULL, llm_calls INTEGER NOT NULL, tokens INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS ekit_queue_config (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ekit_queue_workers (
    name TEXT PRIMARY KEY, workflows TEXT NOT NULL, last_seen REAL NOT NULL, until REAL NOT NULL
);
"""

_COLUMNS = schema_columns(_SCHEMA)
# What this version added to the previous release's layout: a database of
# that layout gains these on open (ALTER TABLE ... ADD COLUMN), in one write.
_ADDED = {
    "ekit_queue_runs": {
        "options": "TEXT NOT NULL DEFAULT '{}'",
        "steps_done": "INTEGER NOT NULL DEFAULT 0",
        "steps_total": "INTEGER",
        "reason": "TEXT",
    }
}
_BEFORE = layout_before(_COLUMNS, _ADDED, ("ekit_queue_workers",))

_INFO = (
    "run_id, workflow, status, priority, epoch, owner, lease_until, cancel_requested, "
    "error, created_at, updated_at, fingerprint, "
    "options, steps_done, steps_total, input_tokens, output_tokens, llm_calls, reason"
)
# The lifecycle's named placeholders in SQLite's terms: every one a parameter,
# the clock too (the machine's, time.time(), shared by every process).
_DIALECT = {"now": "?", "since": "?", "run_id": "?", "epoch": "?", "workflow": "?", "fingerprint": "?"}
_HELD = render(HELD, _DIALECT)  # args: run_id, epoch, now
_LIVE = render(LIVE, _DIALECT)  # args: now
_CLAIMABLE = render(CLAIMABLE, _DIALECT)  # args: now
_ABANDONED = render(ABANDONED, _DIALECT)  # args: now
_MATCHES = render(MATCHES, _DIALECT)  # args: workflow, fingerprint
_IN_WINDOW = render(IN_WINDOW, _DIALECT)  # args: now - window
_LEFT_WINDOW = render(LEFT_WINDOW, _DIALECT)  # args: now - window
_UNCHANGED = render(UNCHANGED, _DIALECT)  # args: run_id, epoch, now
_COUNTS = "step_index = ?, input_tokens = ?, output_tokens = ?, llm_calls = ?, failures = ?"


class SqliteQueue(RunQueue):
    """A durable run queue in one SQLite database file (WAL), shared by worker processes.

    ``path`` is the database file (created if missing). ``limits``, when
    given, replaces the fleet's stored :class:`Limits`. ``durable=False``
    sets ``synchronous=NORMAL`` (a killed process loses nothing; a power cut
    may lose the last commits). ``dumps``/``loads`` encode outputs and
    contexts (JSON by default). An object may be shared by the threads of
    one process; each process opens its own.

    A file that is not an SQLite database, or whose queue tables are not a
    queue's, is a ``CorruptStoreError`` naming it; a file that cannot be
    opened, a :class:`QueueUnavailableError`.
    """

    backend = "sqlite"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        limits: Limits | None = None,
        durable: bool = True,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
    ) -> None:
        """Open (creating if needed) the queue at ``path``."""
        super().__init__(dumps=dumps, loads=loads)
        self.path = os.fspath(path)
        try:
            self.conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=60.0
            )
        except sqlite3.Error as exc:
            raise QueueUnavailableError(self.path, f"cannot open the queue's database ({exc})") from None
        try:
            self._open(durable)
        except BaseException as exc:
            self.conn.close()
            if isinstance(exc, sqlite3.Error):
                raise self._open_error(exc) from exc
            raise
        if limits is not None:
            self.set_limits(limits)

    def _open(self, durable: bool) -> None:
        """Configure the connection, create the tables if missing and check they are the queue's."""
        conn = self.conn
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        conn.executescript(_SCHEMA)
        problem = schema_problem(_BEFORE, self._found(conn))
        if problem is None and schema_problem(_COLUMNS, self._found(conn)) is not None:
            self._tx(self._add_columns)  # a queue of the previous release: bring it up to date
            problem = schema_problem(_COLUMNS, self._found(conn))
        if problem is not None:
            raise CorruptStoreError(self.path, problem)

    @staticmethod
    def _found(conn: sqlite3.Connection) -> dict[str, set[str]]:
        return {table: {row[1] for row in conn.execute(f"PRAGMA table_info({table})")} for table in _COLUMNS}

    def _add_columns(self, conn: sqlite3.Connection) -> None:
        """Add the columns this version added, those still missing (read again under the write lock)."""
        found = self._found(conn)
        for table, columns in _ADDED.items():
            for name, kind in columns.items():
                if name not in found[table]:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def _open_error(self, exc: sqlite3.Error) -> ValueError:
        """The error naming the file for an ``sqlite3`` error raised while opening it."""
        code = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF
        if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
            return CorruptStoreError(self.path, f"not a usable SQLite database ({exc})")
        if code == sqlite3.SQLITE_ERROR:
            # CREATE ... IF NOT EXISTS kept a table, view or index of that name that is not the queue's.
            return CorruptStoreError(
                self.path, f"holds tables that are not a run queue's ({exc}); use another database"
            )
        # Locked past the timeout, read-only, out of space, an I/O error: the file is not at fault.
        return QueueUnavailableError(self.path, f"cannot open the queue's database ({exc})")

    def _tx(self, body: Callable[[sqlite3.Connection], T], *, write: bool = True) -> T:
        """Run ``body`` in one transaction (``BEGIN IMMEDIATE`` to write); roll back on any error."""
        with self._lock:
            conn = self.conn
            if conn.in_transaction:
                # A ROLLBACK that failed (disk full, I/O error) left one open: end it first.
                conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                result = body(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    # A failing ROLLBACK must not hide why the transaction failed.
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                raise
            return result

    # -- submitting and asking ----------------------------------------------

    def submit(
        self,
        workflow: str,
        context: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        priority: int = 0,
        options: Mapping[str, Any] | None = None,
    ) -> str:
        """Queue a run of ``workflow`` and return its run id.

        With ``run_id`` the call is idempotent: submitting an id that is
        already queued (a retried submit) changes nothing and returns it; a
        different ``workflow`` for that id is a ``ValueError``. Higher
        ``priority`` runs are claimed first, then the oldest. ``options`` are
        the run's plain-data run options (:data:`~ekit_runtime.queue.options.RUN_OPTIONS`),
        stored with it and applied by the worker that drives it.
        """
        sub = self._submission(workflow, context, run_id, priority, options)
        now = time.time()

        def body(conn: sqlite3.Connection) -> str:
            conn.execute(
                "INSERT INTO ekit_queue_runs (run_id, workflow, context, priority, status, "
                "created_at, updated_at, options) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?) "
                "ON CONFLICT(run_id) DO NOTHING",
                (sub.run_id, sub.workflow, sub.context, sub.priority, now, now, sub.options),
            )
            stored = conn.execute(
                "SELECT workflow FROM ekit_queue_runs WHERE run_id = ?", (sub.run_id,)
            ).fetchone()[0]
            if stored != sub.workflow:
                raise ValueError(
                    f"run_id {sub.run_id!r} was already submitted for workflow {stored!r}, "
                    f"not {sub.workflow!r}"
                )
            return sub.run_id

        return self._tx(body)

    def status(self, run_id: str) -> RunInfo:
        """The run's record; :class:`UnknownRunError` (a ``LookupError``) if there is none."""
        check_run_id(run_id)
        rows, served = self._tx(
            lambda c: self._infos(c, "WHERE run_id = ?", (run_id,)), write=False
        )
        if not rows:
            raise UnknownRunError(run_id)
        return self._run_info(rows[0], served)

    def runs(self, status: RunStatus | None = None) -> list[RunInfo]:
        """Every run (or those with ``status``), in submission order."""
        check_status(status)
        where, args = ("WHERE status = ?", (status,)) if status is not None else ("", ())
        rows, served = self._tx(lambda c: self._infos(c, where, args), write=False)
        return [self._run_info(r, served) for r in rows]

    def _infos(
        self, conn: sqlite3.Connection, where: str, args: tuple[Any, ...]
    ) -> tuple[list[Any], dict[str, set[str | None]]]:
        """The runs' rows and what the live workers serve, in one snapshot."""
        rows = conn.execute(f"SELECT {_INFO} FROM ekit_queue_runs {where} ORDER BY seq", args).fetchall()
        workers = conn.execute(
            "SELECT workflows FROM ekit_queue_workers WHERE until > ?", (time.time(),)
        ).fetchall()
        return rows, self._served(workers)

    def checkpoint(self, run_id: str) -> WorkflowCheckpoint | None:
        """The run's latest saved checkpoint, ``None`` before its first save."""
        check_run_id(run_id)
        return self._tx(lambda c: self._load(c, run_id, missing_ok=False), write=False)

    def _load(self, conn: sqlite3.Connection, run_id: str, *, missing_ok: bool) -> WorkflowCheckpoint | None:
        row = conn.execute(
            "SELECT header, step_index, input_tokens, output_tokens, llm_calls, failures "
            "FROM ekit_queue_runs WHERE run_id = ?",
            (run_id,),
        ).fetchone()

        def entries() -> list[tuple[str, str, str]]:
            return conn.execute(
                "SELECT kind, name, value FROM ekit_queue_entries WHERE run_id = ? ORDER BY rowid", (run_id,)
            ).fetchall()

        return self._decode_run(row, run_id, entries, f"{self.path}, run {run_id!r}", missing_ok=missing_ok)

    def cancel(self, run_id: str) -> bool:
        """Ask for the run to stop; ``False`` if it had already ended.

        A queued run (or one whose lease expired) is cancelled at once; a
        running one is flagged, and its worker stops it at its next heartbeat
        or save, saving a final checkpoint first.
        """
        check_run_id(run_id)
        now = time.time()

        def body(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "SELECT status, lease_until FROM ekit_queue_runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            if row is None:
                raise UnknownRunError(run_id)
            status, until = row
            effect = cancel_effect(status, live(status, until, now))
            if effect == "ended":
                return False
            if effect == "flag":
                conn.execute("UPDATE ekit_queue_runs SET cancel_requested = 1 WHERE run_id = ?", (run_id,))
            else:
                conn.execute(
                    "UPDATE ekit_queue_runs SET status = 'cancelled', epoch = epoch + 1, "
                    "lease_until = NULL, cancel_requested = 1, updated_at = ? WHERE run_id = ?",
                    (now, run_id),
                )
            return True

        return self._tx(body)

    def prune(self, older_than: float) -> int:
        """Delete finished, failed and cancelled runs last updated over ``older_than`` s ago."""
        cutoff = time.time() - check_age(older_than)

        def body(conn: sqlite3.Connection) -> int:
            final = f"{FINAL} AND updated_at < ?"
            conn.execute(
                f"DELETE FROM ekit_queue_entries WHERE run_id IN "
                f"(SELECT run_id FROM ekit_queue_runs WHERE {final})",
                (cutoff,),
            )
            return conn.execute(f"DELETE FROM ekit_queue_runs WHERE {final}", (cutoff,)).rowcount

        return self._tx(body)

    # -- a person's verbs: retry, rewind, fork (RunQueue's docstrings) ------

    def _reopen(
        self,
        run_id: str,
        verb: str,
        change: Callable[[str, WorkflowCheckpoint | None], WorkflowCheckpoint] | None,
        *,
        step: str | None = None,
    ) -> tuple[RunInfo, WorkflowCheckpoint | None]:
        def body(conn: sqlite3.Connection) -> tuple[RunInfo, WorkflowCheckpoint | None]:
            now = time.time()
            row = conn.execute(
                f"SELECT status, epoch, {_LIVE} FROM ekit_queue_runs WHERE run_id = ?", (now, run_id)
            ).fetchone()
            if row is None:
                raise UnknownRunError(run_id)
            status, epoch, lease_live = row
            self._refuse_reopening(run_id, verb, status, bool(lease_live), step)
            written = None
            sets, args = "", []
            if change is not None:
                written = change(status, self._load(conn, run_id, missing_ok=False))
                enc = self._encode_whole(written)
                sets, args = f", header = ?, fingerprint = ?, {_COUNTS}, steps_done = ?, steps_total = ?", [
                    enc.header, written.fingerprint, *enc.counts, enc.failures, *progress(written)
                ]
            updated = conn.execute(
                f"UPDATE ekit_queue_runs SET status = '{REOPENED_AS}', epoch = epoch + 1, "
                f"lease_until = NULL, cancel_requested = 0, error = NULL, reason = NULL, "
                f"updated_at = ?{sets} WHERE {_UNCHANGED}",
                (now, *args, run_id, epoch, now),
            ).rowcount
            if updated != 1:
                self._changed(run_id, status, verb, step)
            if change is not None:
                self._write_entries(conn, run_id, enc, epoch + 1)
            self._forget(run_id)
            rows, served = self._infos(conn, "WHERE run_id = ?", (run_id,))
            return self._run_info(rows[0], served), written

        return self._tx(body)

    def _fork(
        self,
        source: str,
        new_run_id: str,
        priority: int | None,
        change: Callable[[str, WorkflowCheckpoint | None], WorkflowCheckpoint | None],
    ) -> None:
        def body(conn: sqlite3.Connection) -> None:
            now = time.time()
            row = conn.execute("SELECT status FROM ekit_queue_runs WHERE run_id = ?", (source,)).fetchone()
            if row is None:
                raise UnknownRunError(source)
            if conn.execute("SELECT 1 FROM ekit_queue_runs WHERE run_id = ?", (new_run_id,)).fetchone():
                raise self._taken(new_run_id)
            enc, columns = self._fork_row(change(row[0], self._load(conn, source, missing_ok=False)))
            conn.execute(
                "INSERT INTO ekit_queue_runs (run_id, workflow, context, options, priority, status, "
                "created_at, updated_at, header, fingerprint, step_index, input_tokens, output_tokens, "
                "llm_calls, failures, steps_done, steps_total) SELECT ?, workflow, context, options, "
                "coalesce(?, priority), 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ? "
                "FROM ekit_queue_runs WHERE run_id = ?",
                (new_run_id, priority, now, now, *columns, source),
            )
            if enc is not None:
                self._write_entries(conn, new_run_id, enc, 0)

        self._tx(body)

    @staticmethod
    def _write_entries(conn: sqlite3.Connection, run_id: str, enc: EncodedCheckpoint, epoch: int) -> None:
        """Replace the run's entries with those of a checkpoint written in full."""
        conn.execute("DELETE FROM ekit_queue_entries WHERE run_id = ?", (run_id,))
        conn.executemany(
            "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) VALUES (?, ?, ?, ?, ?)",
            [(run_id, kind, name, value, epoch) for kind, name, value in enc.rows],
        )

    def limits(self) -> Limits:
        """The fleet's limits as stored in the database."""
        return self._tx(self._read_limits, write=False)

    def set_limits(self, limits: Limits) -> None:
        """Store ``limits`` for every worker of this queue (they apply at the next claim)."""
        text = self._limits_text(limits)
        self._tx(
            lambda c: c.execute(
                "INSERT INTO ekit_queue_config (key, value) VALUES ('limits', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (text,),
            )
        )

    def _read_limits(self, conn: sqlite3.Connection) -> Limits:
        row = conn.execute("SELECT value FROM ekit_queue_config WHERE key = 'limits'").fetchone()
        return self._limits_from(row)

    # -- the worker's side --------------------------------------------------

    def claim(self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float) -> Lease | None:
        """Lease the next claimable run of one of ``workflows``, or ``None``.

        ``workflows`` maps each workflow name the worker can drive to its
        graph fingerprint; a run whose saved checkpoint has another
        fingerprint is left for a worker that has that version. Claimable:
        queued, or running with an expired lease. Each claim increments the
        run's epoch. ``None`` also when the fleet is at a limit.
        """
        names = self._workflows(workflows)
        seconds = self._lease_seconds(lease_seconds)
        who = self._worker_name(worker)
        return self._tx(lambda c: self._claim(c, who, names, seconds))

    def _claim(
        self, conn: sqlite3.Connection, worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> Lease | None:
        now = time.time()
        # A run whose cancel was asked while its worker was alive, and whose
        # worker then died, is cancelled here rather than resumed.
        conn.execute(
            "UPDATE ekit_queue_runs SET status = 'cancelled', epoch = epoch + 1, lease_until = NULL, "
            f"updated_at = ? WHERE {_ABANDONED}",
            (now, now),
        )
        if not self._below_limits(conn, now):
            return None
        match = " OR ".join(f"({_MATCHES})" for _ in names)
        row = conn.execute(
            f"SELECT run_id, epoch, workflow, context, options FROM ekit_queue_runs "
            f"WHERE {_CLAIMABLE} AND ({match}) ORDER BY {CLAIM_ORDER} LIMIT 1",
            (now, *[v for pair in names for v in pair]),
        ).fetchone()
        if row is None:
            return None
        run_id, epoch, workflow, context, options = row
        until = now + seconds
        conn.execute(
            "UPDATE ekit_queue_runs SET status = 'running', epoch = ?, owner = ?, lease_until = ?, "
            "updated_at = ?, reason = NULL WHERE run_id = ?",
            (epoch + 1, worker, until, now, run_id),
        )
        conn.execute("INSERT INTO ekit_queue_starts (at) VALUES (?)", (now,))
        checkpoint = self._load(conn, run_id, missing_ok=True)
        return self._granted(run_id, epoch + 1, workflow, context, checkpoint, until, options)

    def _below_limits(self, conn: sqlite3.Connection, now: float) -> bool:
        """Whether one more lease keeps the fleet within its cap and its start rate."""
        limits = self._read_limits(conn)
        if limits.max_in_flight is not None:
            (leases,) = conn.execute(f"SELECT count(*) FROM ekit_queue_runs WHERE {_LIVE}", (now,)).fetchone()
            if at_cap(limits, leases):
                return False
        start = now - limits.window
        conn.execute(f"DELETE FROM ekit_queue_starts WHERE {_LEFT_WINDOW}", (start,))
        conn.execute(f"DELETE FROM ekit_queue_usage WHERE {_LEFT_WINDOW}", (start,))
        if limits.runs_per_minute is not None:
            (started,) = conn.execute(
                f"SELECT count(*) FROM ekit_queue_starts WHERE {_IN_WINDOW}", (start,)
            ).fetchone()
            if at_start_rate(limits, started):
                return False
        return True

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend ``lease`` by ``lease_seconds`` from now; return whether a cancel was asked.

        Raises :class:`LeaseLostError` if the lease expired or was taken over.
        """
        seconds = self._lease_seconds(lease_seconds)

        def body(conn: sqlite3.Connection) -> bool:
            now = time.time()
            self._fence(
                conn,
                lease,
                conn.execute(
                    f"UPDATE ekit_queue_runs SET lease_until = ? WHERE {_HELD}",
                    (now + seconds, lease.run_id, lease.epoch, now),
                ).rowcount,
            )
            return self._cancel_asked(conn, lease.run_id)

        return self._tx(body)

    def _fence(self, conn: sqlite3.Connection, lease: Lease, updated: int) -> None:
        if updated != 1:
            self._lost(lease)

    @staticmethod
    def _cancel_asked(conn: sqlite3.Connection, run_id: str) -> bool:
        row = conn.execute(
            "SELECT cancel_requested FROM ekit_queue_runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        return bool(row[0])

    def save(self, lease: Lease, checkpoint: WorkflowCheckpoint, lease_seconds: float) -> bool:
        """Store ``checkpoint`` under ``lease`` and renew it; return whether a cancel was asked.

        One transaction: the fencing check and the rows it guards commit
        together. Raises :class:`LeaseLostError`, writing nothing, if the
        lease is no longer held; ``UnencodableError`` before the transaction
        for an output that cannot be encoded.
        """
        seconds = self._lease_seconds(lease_seconds)
        with self._lock:
            encoded, added = self._prepare_save(lease, checkpoint)
            cancel = self._tx(lambda c: self._write(c, lease, encoded, seconds, checkpoint, added))
            self._remember(lease, checkpoint)
            return cancel

    def _write(
        self,
        conn: sqlite3.Connection,
        lease: Lease,
        enc: EncodedCheckpoint,
        seconds: float,
        checkpoint: WorkflowCheckpoint,
        added: TokenUsage,
    ) -> bool:
        now = time.time()
        sets = "step_index = ?, input_tokens = ?, output_tokens = ?, llm_calls = ?, failures = ?, "
        args: list[Any] = [*enc.counts, enc.failures]
        sets += "steps_done = ?, steps_total = ?, "  # RunInfo's progress, read without decoding
        args += progress(checkpoint)
        if enc.full:
            sets += "header = ?, fingerprint = ?, "
            args += [enc.header, checkpoint.fingerprint]
        updated = conn.execute(
            f"UPDATE ekit_queue_runs SET {sets}saves = saves + 1, lease_until = ?, updated_at = ? "
            f"WHERE {_HELD}",
            (*args, now + seconds, now, lease.run_id, lease.epoch, now),
        ).rowcount
        self._fence(conn, lease, updated)
        if enc.full:
            conn.execute("DELETE FROM ekit_queue_entries WHERE run_id = ?", (lease.run_id,))
        conn.executemany(
            "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch",
            [(lease.run_id, kind, name, value, lease.epoch) for kind, name, value in enc.rows],
        )
        if self._uses(added):
            conn.execute(
                "INSERT INTO ekit_queue_usage (at, llm_calls, tokens) VALUES (?, ?, ?)",
                (now, added.llm_calls, added.input_tokens + added.output_tokens),
            )
        return self._cancel_asked(conn, lease.run_id)

    def finish(self, lease: Lease, status: RunStatus, error: str | None = None) -> None:
        """End the run under ``lease`` as ``finished``, ``failed`` or ``cancelled``.

        Raises :class:`LeaseLostError` if the lease is no longer held.
        """
        error = self._final(status, error)

        def body(conn: sqlite3.Connection) -> None:
            now = time.time()
            updated = conn.execute(
                f"UPDATE ekit_queue_runs SET status = ?, error = ?, lease_until = NULL, updated_at = ? "
                f"WHERE {_HELD}",
                (status, error, now, lease.run_id, lease.epoch, now),
            ).rowcount
            self._fence(conn, lease, updated)

        self._tx(body)
        self._forget(lease.run_id)

    def release(self, lease: Lease) -> bool:
        """Give the run back to the queue (a worker shutting down); ``False`` if already lost.

        A run whose cancel was asked meanwhile is ended ``cancelled`` instead.
        """

        def body(conn: sqlite3.Connection) -> bool:
            now = time.time()
            return (
                conn.execute(
                    f"UPDATE ekit_queue_runs SET status = {RELEASE_STATUS}, lease_until = NULL, "
                    f"owner = NULL, updated_at = ? WHERE {_HELD}",
                    (now, lease.run_id, lease.epoch, now),
                ).rowcount
                == 1
            )

        released = self._tx(body)
        self._forget(lease.run_id)
        return released

    def park(self, lease: Lease, reason: str) -> None:
        """Park the run under ``lease``: ``waiting``, no lease, no owner (see :meth:`RunQueue.park`)."""
        text = self._park_reason(reason)

        def body(conn: sqlite3.Connection) -> None:
            now = time.time()
            updated = conn.execute(
                f"UPDATE ekit_queue_runs SET status = {PARK_STATUS}, lease_until = NULL, owner = NULL, "
                f"reason = ?, updated_at = ? WHERE {_HELD}",
                (text, now, lease.run_id, lease.epoch, now),
            ).rowcount
            self._fence(conn, lease, updated)

        self._tx(body)
        self._forget(lease.run_id)

    def usage_wait(self) -> float:
        """Seconds until the fleet's recorded usage drops below its call and token limits (0: go)."""
        return self.usage_hold()[0]

    def usage_hold(self) -> tuple[float, str | None]:
        """:meth:`usage_wait`, and which limit holds (``"rate limit llm_calls_per_minute"``), or ``None``."""

        def body(conn: sqlite3.Connection) -> tuple[float, str | None]:
            limits = self._read_limits(conn)
            if not usage_limited(limits):
                return 0.0, None
            now = time.time()
            start = now - limits.window
            calls, tokens, oldest = conn.execute(
                "SELECT coalesce(sum(llm_calls), 0), coalesce(sum(tokens), 0), min(at) "
                f"FROM ekit_queue_usage WHERE {_IN_WINDOW}",
                (start,),
            ).fetchone()
            wait = usage_wait(limits, calls, tokens, oldest, now)
            return wait, usage_reason(limits, calls, tokens) if wait > 0 else None

        return self._tx(body, write=False)

    # -- why a run waits, and who serves what --------------------------------

    def set_reason(self, lease: Lease, reason: str | None) -> None:
        """Record why the run under ``lease`` waits (``None``: it goes on); fenced like a save."""
        text = self._reason_text(reason)

        def body(conn: sqlite3.Connection) -> None:
            now = time.time()
            self._fence(
                conn,
                lease,
                conn.execute(
                    f"UPDATE ekit_queue_runs SET reason = ? WHERE {_HELD}",
                    (text, lease.run_id, lease.epoch, now),
                ).rowcount,
            )

        self._tx(body)

    def announce(self, worker: str, workflows: Mapping[str, str | None], seconds: float) -> None:
        """Record that ``worker`` serves ``workflows`` (name -> fingerprint) for ``seconds`` from now."""
        name, served, ttl = self._presence(worker, workflows, seconds)

        def body(conn: sqlite3.Connection) -> None:
            now = time.time()
            conn.execute(
                "INSERT INTO ekit_queue_workers (name, workflows, last_seen, until) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET workflows = excluded.workflows, "
                "last_seen = excluded.last_seen, until = excluded.until",
                (name, served, now, now + ttl),
            )
            # Workers gone for a day are forgotten: the table stays as small as the fleet.
            conn.execute("DELETE FROM ekit_queue_workers WHERE until < ?", (now - 86_400,))

        self._tx(body)

    def retire(self, worker: str) -> None:
        """Forget ``worker``'s announcement (it stopped)."""
        name = self._worker_name(worker)
        self._tx(lambda c: c.execute("DELETE FROM ekit_queue_workers WHERE name = ?", (name,)))

    def close(self) -> None:
        """Close the database connection."""
        self.conn.close()

    def __repr__(self) -> str:
        return f"SqliteQueue({self.path!r})"

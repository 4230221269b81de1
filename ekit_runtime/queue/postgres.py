"""``PostgresQueue``: the run queue on PostgreSQL (psycopg 3), for workers on several machines.

This module owns the queue's PostgreSQL schema: the same tables as the
SQLite queue (``ekit_queue_runs``, ``ekit_queue_entries`` with one row per
output, usage and skip, ``ekit_queue_starts``, ``ekit_queue_usage``, ``ekit_queue_config``).
Time is the server's (``now()``), so machines with skewed clocks agree on
when a lease expires.

- A claim is one short transaction: ``SELECT ... FOR UPDATE SKIP LOCKED``
  picks a claimable run that no other claim or save holds, reading the
  claimable runs in claim order off an index of their own
  (``ekit_queue_runs_pick``), and the same transaction increments its
  epoch. When the fleet has a cap or a start rate, the claim first locks the
  config row, so concurrent claims count in turn.
- A save is one statement: the ``UPDATE`` of the run row carries the fencing
  check (``epoch = %s AND lease_until > now()``), and the new output rows are
  inserted by the same statement only for the row it matched, so a refused
  save writes nothing. It inserts only the outputs new since the last save:
  O(that step's output). A full rewrite (a new run) is one statement too.
  So every write a lease holder makes (save, renew, finish, release) is one
  statement, and a holder that is paused or cut off between two calls holds
  no lock: a takeover never waits for it.
- No connection is borrowed and no transaction is open while a step runs:
  every call is one statement or one transaction, in autocommit mode. The
  multi-statement ones (claim, submit, cancel, prune) run under the server's
  ``idle_in_transaction_session_timeout`` (``idle_timeout``), so a client
  that stalls or vanishes inside one has its transaction rolled back and its
  locks released instead of holding a run's row or the fleet's config row.
- The queue's sessions plan each statement once and use no bitmap scan
  (``_SESSION``), so that a claim and a batch of writes cost the same
  whatever the queue held before (docs/decisions/012).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime import logs
from ekit_runtime.logs import log_event
from ekit_runtime.queue.base import (
    Doing,
    Ending,
    More,
    RunQueue,
    check_one_per_run,
    claim_limit,
    handed_over,
    progress,
    schema_problem,
)
from ekit_runtime.queue.lifecycle import (
    FINAL,
    PARK_STATUS,
    RELEASE_STATUS,
    REOPENED_AS,
    at_cap,
    at_start_rate,
    slot_free,
    usage_limited,
    usage_reason,
    usage_wait,
)
from ekit_runtime.queue.postgres_loop import LoopSession
from ekit_runtime.queue.postgres_sql import (
    _ABANDONED,
    _BEFORE,
    _COLUMNS,
    _HELD,
    _IN_WINDOW,
    _INFO,
    _LEFT_WINDOW,
    _LIVE,
    _MAX_IDLE,
    _NOW,
    _PICK_INDEX,
    _QUICK_CLAIM,
    _ROWS,
    _SAVE_FULL,
    _SCHEMA,
    _SLOT_HELD,
    _SLOT_LOCK,
    _STREAM_APPEND,
    _STREAM_CAP,
    _STREAM_LOCK,
    _STREAM_TABLE,
    _UNCHANGED,
    _UPGRADE,
    _WHOLE,
    _Batch,
    _columns,
    _columns_found,
    _has_pick_index,
    _has_stream_table,
    _names,
    _pick,
    _QueueConnection,
    _quick_args,
)
from ekit_runtime.queue.records import (
    Lease,
    LeaseLostError,
    Limits,
    QueueUnavailableError,
    RunInfo,
    RunsPage,
    RunStatus,
    UnknownRunError,
    check_run_id,
    check_seconds,
    check_status,
)
from ekit_runtime.queue.streams import Published, StreamRows
from ekit_runtime.redaction import redacted, scrub
from ekit_runtime.stores.codec import Dumps, Loads
from ekit_runtime.stores.errors import CorruptStoreError
from ekit_runtime.stores.pg import _SCHEMA_LOCK, psycopg
from ekit_runtime.stores.rows import EncodedCheckpoint

__all__ = ["PostgresQueue"]

T = TypeVar("T")


class PostgresQueue(RunQueue):
    """A durable run queue in a PostgreSQL database, shared by workers on any number of machines.

    ``dsn`` is a libpq connection string or URL (or an open
    ``psycopg.Connection``, switched to autocommit). ``limits``, when given,
    replaces the fleet's stored :class:`Limits`. ``idle_timeout`` (seconds,
    default 10) is how long the server lets this connection sit idle inside
    an open transaction before it rolls the transaction back and closes the
    session (the next call reconnects). ``dumps``/``loads`` encode outputs
    and contexts (JSON by default). One connection per object, used by one
    thread at a time; a session the server ended fails the call that meets
    it (a transient error) and the next call reconnects.

    ``async_session`` (default ``True``): a :class:`Worker` on this queue
    awaits its batches of writes and its claims on its event loop, through
    an asynchronous session of its own (a second connection per worker; see
    :mod:`ekit_runtime.queue.postgres_loop`). ``False`` keeps every call on
    the worker's database thread and one connection per worker, for a
    server whose connections are counted tight.

    A server that cannot be reached, or a DSN that cannot be parsed, is a
    :class:`QueueUnavailableError` naming the DSN with its password hidden;
    a database whose queue tables lack columns, a ``CorruptStoreError``.
    """

    backend = "postgres"

    def __init__(
        self,
        dsn: str | psycopg.Connection[Any],
        *,
        limits: Limits | None = None,
        idle_timeout: float = 10.0,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
        async_session: bool = True,
    ) -> None:
        """Connect and create the queue's tables if missing."""
        super().__init__(dumps=dumps, loads=loads)
        if not isinstance(async_session, bool):
            raise ValueError(f"async_session must be True or False, got {type(async_session).__name__}")
        self.async_session = async_session
        idle = check_seconds(idle_timeout, "idle_timeout")
        if idle > _MAX_IDLE:  # the server keeps it in milliseconds, in a 32-bit int
            raise ValueError(f"idle_timeout must be at most {_MAX_IDLE} seconds, got {idle_timeout!r}")
        # Named in errors with its password hidden; the driver's own words are scrubbed of it too.
        self.where = redacted(dsn) if isinstance(dsn, str) else "postgresql (an open connection)"
        try:
            self.db = _QueueConnection(dsn, _SCHEMA, "ekit_queue_runs", idle_timeout=idle)
            problem = schema_problem(_BEFORE, self.db.run(_columns_found))
            if problem is None and schema_problem(_COLUMNS, self.db.run(_columns_found)) is not None:
                # A queue of the previous release: bring it up to date.
                with self.db.transaction() as conn:
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    conn.execute(_UPGRADE)
                problem = schema_problem(_COLUMNS, self.db.run(_columns_found))
            if problem is None and not self.db.run(_has_pick_index):
                self._build_pick_index()
            if problem is None and not self.db.run(_has_stream_table):
                self._build_stream_table()
        except psycopg.Error as exc:
            said = " ".join(str(exc).split())
            if isinstance(dsn, str):
                said = scrub(said, dsn)
            raise QueueUnavailableError(
                self.where, f"cannot open the queue's database ({type(exc).__name__}: {said})"
            ) from None
        if problem is not None:
            self.db.close()
            raise CorruptStoreError(self.where, problem)
        if limits is not None:
            self.set_limits(limits)

    def _build_pick_index(self) -> None:
        """Build ``ekit_queue_runs_pick`` for a queue made before it (see :meth:`_add_to_schema`):
        a role that does not own the table leaves claims reading every queued run, as before it."""
        self._add_to_schema(
            _PICK_INDEX, "index_missing",
            "queue %s: cannot build index ekit_queue_runs_pick (%s); each claim reads every queued "
            "run until the table's owner opens the queue once",
        )

    def _build_stream_table(self) -> None:
        """Create ``ekit_queue_stream`` for a queue made before it (see :meth:`_add_to_schema`): a
        role that may not create tables leaves its workers publishing nothing (each flush is
        refused and logged) and reading a stream saying why."""
        self._add_to_schema(
            _STREAM_TABLE, "stream_table_missing",
            "queue %s: cannot create table ekit_queue_stream (%s); runs publish no stream until "
            "the owner of the queue's tables opens the queue once",
        )

    def _add_to_schema(self, statement: str, event: str, warning: str) -> None:
        """Run ``statement`` once, under the schema lock. A role without the privilege opens the
        queue all the same, and a warning (``event``) says what is missing until the table's
        owner opens the queue once."""
        try:
            with self.db.transaction() as conn:
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                conn.execute(statement)
        except psycopg.errors.InsufficientPrivilege as exc:
            log_event(logs.WORKER, logging.WARNING, event, warning, self.where, " ".join(str(exc).split()))

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
        """Queue a run of ``workflow`` with its ``options``; idempotent by ``run_id`` (see SqliteQueue)."""
        sub = self._submission(workflow, context, run_id, priority, options)
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO ekit_queue_runs (run_id, workflow, context, priority, status, created_at, "
                f"updated_at, options) VALUES (%s, %s, %s, %s, 'queued', {_NOW}, {_NOW}, %s) "
                "ON CONFLICT (run_id) DO NOTHING",
                (sub.run_id, sub.workflow, sub.context, sub.priority, sub.options),
            )
            row = conn.execute(
                "SELECT workflow FROM ekit_queue_runs WHERE run_id = %s", (sub.run_id,)
            ).fetchone()
        if row is None or row[0] != sub.workflow:
            raise ValueError(
                f"run_id {sub.run_id!r} was already submitted for workflow {row and row[0]!r}, "
                f"not {sub.workflow!r}"
            )
        return sub.run_id

    def status(self, run_id: str) -> RunInfo:
        """The run's record; :class:`UnknownRunError` if there is none."""
        check_run_id(run_id)
        rows, served = self._infos("WHERE run_id = %s", (run_id,))
        if not rows:
            raise UnknownRunError(run_id)
        return self._run_info(rows[0], served)

    def runs(self, status: RunStatus | None = None) -> list[RunInfo]:
        """Every run (or those with ``status``), in submission order."""
        check_status(status)
        where, args = ("WHERE status = %s", (status,)) if status is not None else ("", ())
        rows, served = self._infos(where, args)
        return [self._run_info(r, served) for r in rows]

    def _infos(self, where: str, args: tuple[Any, ...]) -> tuple[list[Any], dict[str, set[str | None]]]:
        """The runs' rows and what the live workers serve, in one snapshot."""
        with self.db.transaction(snapshot=True) as conn:
            rows = conn.execute(f"SELECT {_INFO} FROM ekit_queue_runs {where} ORDER BY seq", args).fetchall()
            workers = conn.execute(
                f"SELECT workflows FROM ekit_queue_workers WHERE until > {_NOW}"
            ).fetchall()
        return rows, self._served(workers)

    def checkpoint(self, run_id: str) -> WorkflowCheckpoint | None:
        """The run's latest saved checkpoint (one snapshot), ``None`` before its first save."""
        check_run_id(run_id)
        with self.db.transaction(snapshot=True) as conn:
            return self._load(conn, run_id, missing_ok=False)

    def _load(
        self, conn: psycopg.Connection[Any], run_id: str, *, missing_ok: bool
    ) -> WorkflowCheckpoint | None:
        row = conn.execute(
            "SELECT header, step_index, input_tokens, output_tokens, llm_calls, failures "
            "FROM ekit_queue_runs WHERE run_id = %s",
            (run_id,),
        ).fetchone()

        def entries() -> list[tuple[str, str, str]]:
            return conn.execute(
                "SELECT kind, name, value FROM ekit_queue_entries WHERE run_id = %s ORDER BY seq", (run_id,)
            ).fetchall()

        return self._decode_run(row, run_id, entries, f"postgresql run {run_id!r}", missing_ok=missing_ok)

    # -- the verbs' statements (the verbs themselves: RunQueue) --------------

    def _transaction(self, body: Callable[[psycopg.Connection[Any]], T]) -> T:
        with self.db.transaction() as conn:
            return body(conn)

    def _cancel_read(self, tx: psycopg.Connection[Any], run_id: str) -> tuple[str, bool] | None:
        row = tx.execute(
            f"SELECT status, {_LIVE} FROM ekit_queue_runs WHERE run_id = %s FOR UPDATE", (run_id,)
        ).fetchone()
        return None if row is None else (row[0], bool(row[1]))

    def _cancel_write(self, tx: psycopg.Connection[Any], run_id: str, *, flag: bool) -> None:
        if flag:
            tx.execute("UPDATE ekit_queue_runs SET cancel_requested = true WHERE run_id = %s", (run_id,))
        else:
            tx.execute(
                "UPDATE ekit_queue_runs SET status = 'cancelled', epoch = epoch + 1, lease_until = NULL, "
                f"cancel_requested = true, updated_at = {_NOW} WHERE run_id = %s",
                (run_id,),
            )

    def _prune_write(self, conn: psycopg.Connection[Any], age: float) -> int:
        final = f"{FINAL} AND updated_at < {_NOW} - %s"
        conn.execute(
            "DELETE FROM ekit_queue_stream WHERE run_id IN "
            f"(SELECT run_id FROM ekit_queue_runs WHERE {final})",
            (age,),
        )
        conn.execute(
            "DELETE FROM ekit_queue_entries WHERE run_id IN "
            f"(SELECT run_id FROM ekit_queue_runs WHERE {final})",
            (age,),
        )
        return conn.execute(f"DELETE FROM ekit_queue_runs WHERE {final}", (age,)).rowcount

    # -- a person's verbs: retry, rewind, fork (RunQueue's docstrings) ------
    #
    # One transaction each (READ COMMITTED): the read takes no lock, and the
    # write carries the epoch it read (UNCHANGED). A claim or another write
    # that commits in between changes the epoch, so this UPDATE then matches
    # nothing (it waits for a concurrent writer's commit, then checks again)
    # and the call is refused, writing nothing.

    def _reopen_read(self, tx: psycopg.Connection[Any], run_id: str) -> tuple[RunStatus, int, bool] | None:
        row = tx.execute(
            f"SELECT status, epoch, {_LIVE} FROM ekit_queue_runs WHERE run_id = %s", (run_id,)
        ).fetchone()
        return None if row is None else (row[0], row[1], bool(row[2]))

    def _reopen_write(
        self, tx: psycopg.Connection[Any], run_id: str, epoch: int, written: WorkflowCheckpoint | None
    ) -> RunInfo | None:
        sets, args = "", []
        if written is not None:
            enc = self._encode_whole(written)
            sets = (
                ", header = %s, fingerprint = %s, step_index = %s, input_tokens = %s, "
                "output_tokens = %s, llm_calls = %s, failures = %s, steps_done = %s, steps_total = %s"
            )
            args = [enc.header, written.fingerprint, *enc.counts, enc.failures, *progress(written)]
        info = tx.execute(
            f"UPDATE ekit_queue_runs SET status = '{REOPENED_AS}', epoch = epoch + 1, "
            f"lease_until = NULL, cancel_requested = false, error = NULL, reason = NULL, "
            f"updated_at = {_NOW}{sets} "
            f"WHERE {_UNCHANGED} RETURNING {_INFO}",
            (*args, run_id, epoch),
        ).fetchone()
        if info is None:
            return None
        if written is not None:
            tx.execute("DELETE FROM ekit_queue_entries WHERE run_id = %s", (run_id,))
            tx.execute(_WHOLE, (run_id, epoch + 1, *_columns(enc.rows)))
        workers = tx.execute(f"SELECT workflows FROM ekit_queue_workers WHERE until > {_NOW}").fetchall()
        return self._run_info(info, self._served(workers))

    def _fork_read(self, tx: psycopg.Connection[Any], source: str, new_run_id: str) -> RunStatus | None:
        row = tx.execute("SELECT status FROM ekit_queue_runs WHERE run_id = %s", (source,)).fetchone()
        return None if row is None else row[0]  # (a taken id: told by the insert's ON CONFLICT)

    def _fork_write(
        self,
        tx: psycopg.Connection[Any],
        source: str,
        new_run_id: str,
        priority: int | None,
        options: str | None,
        enc: EncodedCheckpoint | None,
        columns: list[Any],
    ) -> bool:
        inserted = tx.execute(
            "INSERT INTO ekit_queue_runs (run_id, workflow, context, options, priority, status, "
            "created_at, updated_at, header, fingerprint, step_index, input_tokens, output_tokens, "
            "llm_calls, failures, steps_done, steps_total) SELECT %s, workflow, context, "
            f"coalesce(%s, options), coalesce(%s, priority), 'queued', {_NOW}, {_NOW}, "
            "%s, %s, %s, %s, %s, %s, %s, %s, %s "
            "FROM ekit_queue_runs WHERE run_id = %s "
            "ON CONFLICT (run_id) DO NOTHING RETURNING run_id",
            (new_run_id, options, priority, *columns, source),
        ).fetchone()
        if inserted is None:
            return False
        if enc is not None:
            tx.execute(_WHOLE, (new_run_id, 0, *_columns(enc.rows)))
        return True

    def limits(self) -> Limits:
        """The fleet's limits as stored in the database."""
        return self.db.run(self._read_limits)

    def set_limits(self, limits: Limits) -> None:
        """Store ``limits`` for every worker of this queue (they apply at the next claim)."""
        text = self._limits_text(limits)
        self.db.run(
            lambda c: c.execute("UPDATE ekit_queue_config SET value = %s WHERE key = 'limits'", (text,))
        )

    def _read_limits(self, conn: psycopg.Connection[Any], *, lock: bool = False) -> Limits:
        return self._read_limits_text(conn, lock=lock)[1]

    def _read_limits_text(
        self, conn: psycopg.Connection[Any], *, lock: bool = False
    ) -> tuple[str | None, Limits]:
        """The fleet's limits as stored (the text, ``None`` if none is) and as read."""
        row = conn.execute(
            "SELECT value FROM ekit_queue_config WHERE key = 'limits'" + (" FOR UPDATE" if lock else "")
        ).fetchone()
        return (None if row is None else row[0]), self._limits_from(row)

    _quick: tuple[str | None, Limits] | None = None

    def _granted_quick(self, row: tuple[Any, ...], limits: Limits) -> Lease:
        """The lease a quick claim returned, with the run's checkpoint (its entries read now)."""
        run_id, epoch, workflow, context, until, options, *stored = row
        checkpoint = None
        if stored[0] is not None:
            # Read after the claim committed: the lease is held, so no other writer changes them.
            def entries() -> list[tuple[str, str, str]]:
                return self.db.run(
                    lambda c: c.execute(
                        "SELECT kind, name, value FROM ekit_queue_entries WHERE run_id = %s ORDER BY seq",
                        (run_id,),
                    ).fetchall()
                )

            checkpoint = self._decode_run(tuple(stored), run_id, entries, f"postgresql run {run_id!r}",
                                          missing_ok=True)
        return self._granted(run_id, epoch, workflow, context, checkpoint, until, options, limits)

    # -- the worker's side --------------------------------------------------

    def claim(self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float) -> Lease | None:
        """Lease the next claimable run of one of ``workflows`` (see :meth:`SqliteQueue.claim`)."""
        names = self._workflows(workflows)
        seconds = self._lease_seconds(lease_seconds)
        who = self._worker_name(worker)
        quick = self._quick
        if quick is not None:
            args = _quick_args(quick, who, seconds, names, 1)
            row = self.db.run(lambda c: c.execute(_QUICK_CLAIM, args).fetchone())
            if row is not None:
                return self._granted_quick(row, quick[1])
            # Nothing to claim, or the limits changed: the claim in full says which.
        return self._claim_in_full(who, names, seconds)

    def _claim_in_full(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> Lease | None:
        """A claim in full (see :meth:`_claim`), in one transaction, with the run's checkpoint."""
        with self.db.transaction() as conn:
            claimed = self._claim(conn, worker, names, seconds)
            if claimed is None:
                return None
            (run_id, epoch, workflow, context, until, options), limits = claimed
            checkpoint = self._load(conn, run_id, missing_ok=True)
        return self._granted(run_id, epoch, workflow, context, checkpoint, until, options, limits)

    def claim_many(
        self, worker: str, workflows: Mapping[str, str | None], lease_seconds: float, limit: int
    ) -> list[Lease]:
        """Lease up to ``limit`` claimable runs, as that many calls of :meth:`claim` would.

        While the fleet has no limit a claim counts, one statement leases
        them all (one commit); otherwise each is a claim in full, one by one.
        """
        limit = claim_limit(limit)
        quick = self._quick
        if limit == 1 or quick is None:
            return super().claim_many(worker, workflows, lease_seconds, limit)
        names = self._workflows(workflows)
        seconds = self._lease_seconds(lease_seconds)
        who = self._worker_name(worker)
        args = _quick_args(quick, who, seconds, names, limit)
        rows = self.db.run(lambda c: c.execute(_QUICK_CLAIM, args).fetchall())
        if not rows:
            # Nothing to claim, or the limits changed: the claims in full say which.
            return super().claim_many(worker, workflows, lease_seconds, limit)
        return handed_over(rows, lambda row: self._granted_quick(row, quick[1]), self._give_back)

    def _give_back(self, leased: Sequence[tuple[Any, ...]]) -> None:
        """Release runs a claim leased but could not hand over (their rows: run id, epoch first)."""
        self.db.run(
            lambda c: c.execute(
                f"UPDATE ekit_queue_runs SET status = {RELEASE_STATUS}, lease_until = NULL, owner = NULL, "
                f"updated_at = {_NOW} FROM unnest(%s::text[], %s::bigint[]) AS x(rid, ep) "
                "WHERE run_id = x.rid AND epoch = x.ep AND status = 'running'",
                ([row[0] for row in leased], [row[1] for row in leased]),
            )
        )

    def _claim(
        self, conn: psycopg.Connection[Any], worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> tuple[tuple[Any, ...], Limits] | None:
        """The claimed run's row (see :meth:`claim`) and the limits the claim read, or ``None``."""
        conn.execute(
            f"UPDATE ekit_queue_runs SET status = 'cancelled', epoch = epoch + 1, lease_until = NULL, "
            f"updated_at = {_NOW} WHERE {_ABANDONED}"
        )
        text, limits = self._read_limits_text(conn)
        # Later claims are quick (see _QUICK_CLAIM) while the fleet has no limit a claim counts.
        counted = limits.max_in_flight is not None or limits.runs_per_minute is not None
        self._quick = None if counted else (text, limits)
        conn.execute(f"DELETE FROM ekit_queue_usage WHERE {_LEFT_WINDOW}", (limits.window,))
        if limits.max_in_flight is not None or limits.runs_per_minute is not None:
            # Serialise the claims that count: without this, two claims could
            # both see one free slot and both take it.
            limits = self._read_limits(conn, lock=True)
            if not self._below_limits(conn, limits):
                return None
        # The pick (locking the row, skipping rows others hold) and the lease
        # in one statement: one round trip fewer per claim.
        claimed: tuple[Any, ...] | None = conn.execute(
            f"UPDATE ekit_queue_runs SET status = 'running', epoch = epoch + 1, owner = %s, "
            f"lease_until = {_NOW} + %s, updated_at = {_NOW}, reason = NULL WHERE run_id = ("
            f"{_pick('', '1')}) "
            "RETURNING run_id, epoch, workflow, context, lease_until, options",
            (worker, seconds, *_names(names)),
        ).fetchone()
        if claimed is None:
            return None
        if limits.runs_per_minute is not None:
            conn.execute(f"INSERT INTO ekit_queue_starts (at) VALUES ({_NOW})")
        return claimed, limits

    @staticmethod
    def _below_limits(conn: psycopg.Connection[Any], limits: Limits) -> bool:
        if limits.max_in_flight is not None:
            row = conn.execute(
                f"SELECT count(*) FROM ekit_queue_runs WHERE {_LIVE}"
            ).fetchone()
            if row is not None and at_cap(limits, row[0]):
                return False
        if limits.runs_per_minute is not None:
            conn.execute(f"DELETE FROM ekit_queue_starts WHERE {_LEFT_WINDOW}", (limits.window,))
            row = conn.execute("SELECT count(*) FROM ekit_queue_starts").fetchone()
            if row is not None and at_start_rate(limits, row[0]):
                return False
        return True

    def renew(self, lease: Lease, lease_seconds: float) -> bool:
        """Extend ``lease``; return whether a cancel was asked. :class:`LeaseLostError` if lost."""
        seconds = self._lease_seconds(lease_seconds)
        row = self.db.run(
            lambda c: c.execute(
                f"UPDATE ekit_queue_runs SET lease_until = {_NOW} + %s "
                f"WHERE {_HELD} RETURNING cancel_requested",
                (seconds, lease.run_id, lease.epoch),
            ).fetchone()
        )
        return self._fenced(lease, row)

    def _fenced(self, lease: Lease, row: tuple[Any, ...] | None) -> bool:
        if row is None:
            self._lost(lease)
        return bool(row[0])

    def save(self, lease: Lease, checkpoint: WorkflowCheckpoint, lease_seconds: float) -> bool:
        """Store ``checkpoint`` under ``lease`` and renew it in full; return whether a cancel was asked.

        Raises :class:`LeaseLostError`, writing nothing, if the lease is no
        longer held.
        """
        seconds = self._lease_seconds(lease_seconds)
        with self.db._lock:
            encoded, added = self._prepare_save(lease, checkpoint)
            done, total = progress(checkpoint)  # RunInfo's progress, read without decoding
            if encoded.full:
                cancel = self._save_full(lease, encoded, seconds, checkpoint, added, done, total)
            else:
                cancel = self._save_delta(lease, encoded, seconds, added, done, total)
            self._remember(lease, checkpoint)
            return cancel

    def save_many(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        lease_seconds: float,
        more: More | None = None,
    ) -> list[bool | Exception]:
        """Store several runs' checkpoints: :meth:`write_many` with no endings."""
        check_one_per_run(saves)
        if len(saves) < 2:
            return super().save_many(saves, lease_seconds)  # (alone: no statement to share)
        return self.write_many(saves, (), lease_seconds, more)[0]

    def write_many(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        endings: Sequence[Ending],
        lease_seconds: float,
        more: More | None = None,
    ) -> tuple[list[bool | Exception], list[Exception | None]]:
        """Store several runs' checkpoints and end other runs in one statement: one commit for all.

        Each write is fenced on its own, as in :meth:`save` and :meth:`finish`:
        a lease that is no longer held refuses its write alone (its outcome
        is :class:`LeaseLostError`, and nothing is written for it). If the
        statement fails for another reason (a dropped session), each of its writes is
        made again alone, so that each meets its own error. ``more`` is not
        asked: the server commits concurrent writers' transactions together.
        """
        check_one_per_run(saves, endings)
        if len(saves) + len(endings) < 2:
            return super().write_many(saves, endings, lease_seconds)
        with self.db._lock:
            batch = _Batch(self, self.db, saves, endings, lease_seconds)
            if batch.args is not None:
                batch.write()
        return batch.outcomes, batch.ended

    def _loop_session(self) -> LoopSession | None:
        """A session of the worker's event loop for its writes and claims (see
        :mod:`ekit_runtime.queue.postgres_loop`), or ``None``: every call on the
        worker's database thread.

        ``None`` for a queue made with ``async_session=False``, for a queue on
        an adopted connection (its owner decides what connects) and for a
        subclass that makes its writes or claims its own way.
        """
        own = type(self)
        if not self.async_session or self.db._conninfo is None or any(
            getattr(own, verb) is not getattr(PostgresQueue, verb)
            for verb in (
                "write_many", "claim_many", "claim", "save", "finish", "_granted_quick", "_claim_in_full"
            )
        ):
            return None
        return LoopSession(self, self.db._conninfo, self.db._idle_ms)

    def _save_delta(
        self,
        lease: Lease,
        enc: EncodedCheckpoint,
        seconds: float,
        added: TokenUsage,
        done: int,
        total: int | None,
    ) -> bool:
        used = self._uses(added)
        kinds, names, values = _columns(enc.rows)
        # One statement: the fenced UPDATE, and inserts that exist only for the row it matched.
        sql = (
            "WITH fenced AS (UPDATE ekit_queue_runs SET step_index = %s, input_tokens = %s, "
            "output_tokens = %s, llm_calls = %s, failures = %s, saves = saves + 1, "
            "steps_done = %s, steps_total = %s, "
            f"lease_until = {_NOW} + %s, updated_at = {_NOW} WHERE {_HELD} "
            "RETURNING run_id, cancel_requested), "
            "added AS (" + _ROWS + "), "
            f"used AS (INSERT INTO ekit_queue_usage (at, llm_calls, tokens) SELECT {_NOW}, %s, %s "
            "FROM fenced WHERE %s) "
            "SELECT cancel_requested FROM fenced"
        )
        args = (
            *enc.counts,
            enc.failures,
            done,
            total,
            seconds,
            lease.run_id,
            lease.epoch,
            lease.epoch,
            kinds,
            names,
            values,
            added.llm_calls,
            added.total_tokens,
            used,
        )
        row = self.db.run(lambda c: c.execute(sql, args).fetchone())
        return self._fenced(lease, row)

    def _save_full(
        self,
        lease: Lease,
        enc: EncodedCheckpoint,
        seconds: float,
        checkpoint: WorkflowCheckpoint,
        added: TokenUsage,
        done: int,
        total: int | None,
    ) -> bool:
        kinds, names, values = _columns(enc.rows)
        used = self._uses(added)
        # One statement, like the delta: a worker paused between the statements
        # of a transaction would keep the run's row locked, so no claim could
        # take the run over until it woke (claims skip locked rows).
        args = (
            enc.header,
            checkpoint.fingerprint,
            *enc.counts,
            enc.failures,
            done,
            total,
            seconds,
            lease.run_id,
            lease.epoch,
            kinds,
            names,
            values,
            lease.epoch,
            added.llm_calls,
            added.total_tokens,
            used,
        )
        row = self.db.run(lambda c: c.execute(_SAVE_FULL, args).fetchone())
        return self._fenced(lease, row)

    def finish(self, lease: Lease, status: RunStatus, error: str | None = None) -> None:
        """End the run under ``lease``; :class:`LeaseLostError` if the lease is no longer held."""
        error = self._final(status, error)
        row = self.db.run(
            lambda c: c.execute(
                "UPDATE ekit_queue_runs SET status = %s, error = %s, lease_until = NULL, "
                f"updated_at = {_NOW} "
                f"WHERE {_HELD} RETURNING cancel_requested",
                (status, error, lease.run_id, lease.epoch),
            ).fetchone()
        )
        self._fenced(lease, row)
        self._forget(lease.run_id)

    def _release_write(self, lease: Lease) -> bool:
        row = self.db.run(
            lambda c: c.execute(
                f"UPDATE ekit_queue_runs SET status = {RELEASE_STATUS}, lease_until = NULL, "
                f"owner = NULL, updated_at = {_NOW} WHERE {_HELD} RETURNING run_id",
                (lease.run_id, lease.epoch),
            ).fetchone()
        )
        return row is not None

    def acquire_slot(self, lease: Lease, resource: str, holder: str) -> bool:
        """Take a slot of ``resource`` for ``holder`` under ``lease`` if one is free (see ``RunQueue``).

        One short transaction that first takes an advisory lock on the
        resource (``pg_advisory_xact_lock``, held to its commit): takers of one
        resource count and insert in turn, each counting in a snapshot taken
        after the previous taker committed, so two never share the last slot.
        Takers of other resources, and every other call, do not wait for it.
        """
        resource, holder = self._slot(lease, resource, holder)
        with self.db.transaction() as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_SLOT_LOCK, resource))
            # A statement after the lock: its snapshot sees every slot committed before.
            row = conn.execute(
                f"SELECT EXISTS (SELECT 1 FROM ekit_queue_runs WHERE {_HELD}), "
                f"(SELECT count(*) FROM ekit_queue_slots s WHERE s.resource = %s AND {_SLOT_HELD}), "
                "(SELECT value FROM ekit_queue_config WHERE key = 'limits')",
                (lease.run_id, lease.epoch, resource),
            ).fetchone()
            assert row is not None
            fenced, held, limits = row
            if not fenced:
                self._lost(lease)
            caps = self._limits_from(None if limits is None else (limits,)).resources
            if not slot_free(caps.get(resource), held):
                return False
            conn.execute(
                f"DELETE FROM ekit_queue_slots s WHERE s.resource = %s AND NOT {_SLOT_HELD}", (resource,)
            )
            conn.execute(
                "INSERT INTO ekit_queue_slots (resource, holder, run_id, epoch, at) "
                f"VALUES (%s, %s, %s, %s, {_NOW})",
                (resource, holder, lease.run_id, lease.epoch),
            )
        return True

    def release_slot(self, lease: Lease, resource: str, holder: str) -> None:
        """Give back the slot ``holder`` took of ``resource`` under ``lease`` (see ``RunQueue``)."""
        resource, holder = self._slot(lease, resource, holder)
        self.db.run(
            lambda c: c.execute(
                "DELETE FROM ekit_queue_slots WHERE resource = %s AND holder = %s AND epoch = %s",
                (resource, holder, lease.epoch),
            )
        )

    def slots_held(self) -> dict[str, int]:
        """``resource -> slots held now`` across the fleet (see ``RunQueue``)."""
        rows = self.db.run(
            lambda c: c.execute(
                f"SELECT s.resource, count(*) FROM ekit_queue_slots s WHERE {_SLOT_HELD} "
                "GROUP BY s.resource ORDER BY s.resource"
            ).fetchall()
        )
        return {name: int(count) for name, count in rows}

    def _park_write(self, lease: Lease, text: str) -> None:
        row = self.db.run(
            lambda c: c.execute(
                f"UPDATE ekit_queue_runs SET status = {PARK_STATUS}, lease_until = NULL, owner = NULL, "
                f"reason = %s, updated_at = {_NOW} WHERE {_HELD} RETURNING cancel_requested",
                (text, lease.run_id, lease.epoch),
            ).fetchone()
        )
        self._fenced(lease, row)

    def usage_hold(self) -> tuple[float, str | None]:
        """:meth:`usage_wait`, and which limit holds (``"rate limit llm_calls_per_minute"``), or ``None``."""

        def body(conn: psycopg.Connection[Any]) -> tuple[float, str | None]:
            limits = self._read_limits(conn)
            if not usage_limited(limits):
                return 0.0, None
            row = conn.execute(
                f"SELECT coalesce(sum(llm_calls), 0), coalesce(sum(tokens), 0), min(at), {_NOW} "
                f"FROM ekit_queue_usage WHERE {_IN_WINDOW}",
                (limits.window,),
            ).fetchone()
            assert row is not None
            calls, tokens, oldest, now = row
            wait = usage_wait(limits, calls, tokens, oldest, now)
            return wait, usage_reason(limits, calls, tokens) if wait > 0 else None

        return self.db.run(body)

    # -- why a run waits, and who serves what --------------------------------

    def set_reason(self, lease: Lease, reason: str | None) -> None:
        """Record why the run under ``lease`` waits (``None``: it goes on); fenced like a save."""
        text = self._reason_text(reason)
        row = self.db.run(
            lambda c: c.execute(
                f"UPDATE ekit_queue_runs SET reason = %s WHERE {_HELD} RETURNING cancel_requested",
                (text, lease.run_id, lease.epoch),
            ).fetchone()
        )
        self._fenced(lease, row)

    def announce(
        self, worker: str, workflows: Mapping[str, str | None], seconds: float, doing: Doing | None = None
    ) -> None:
        """Record that ``worker`` serves ``workflows`` (name -> fingerprint) for ``seconds`` from now."""
        name, served, ttl, doing_text = self._presence(worker, workflows, seconds, doing)
        sql = (
            "INSERT INTO ekit_queue_workers (name, workflows, last_seen, until, doing) "
            f"VALUES (%s, %s, {_NOW}, {_NOW} + %s, %s) ON CONFLICT (name) DO UPDATE SET "
            "workflows = excluded.workflows, last_seen = excluded.last_seen, until = excluded.until, "
            "doing = excluded.doing"
        )

        def body(conn: psycopg.Connection[Any]) -> None:
            conn.execute(sql, (name, served, ttl, doing_text))
            # Workers gone for a day are forgotten: the table stays as small as the fleet.
            conn.execute(f"DELETE FROM ekit_queue_workers WHERE until < {_NOW} - 86400")

        self.db.run(body)

    def retire(self, worker: str) -> None:
        """Forget ``worker``'s announcement (it stopped)."""
        name = self._worker_name(worker)
        self.db.run(lambda c: c.execute("DELETE FROM ekit_queue_workers WHERE name = %s", (name,)))

    def _doing_rows(self) -> list[tuple[str, str]]:
        """``(worker, doing)`` of the live workers that announced attempts in flight."""
        rows = self.db.run(
            lambda c: c.execute(
                f"SELECT name, doing FROM ekit_queue_workers WHERE until > {_NOW} AND doing IS NOT NULL"
            ).fetchall()
        )
        return [(str(name), str(text)) for name, text in rows]

    # -- the runs' live streams (ekit_runtime.queue.streams) -----------------

    def publish_many(
        self, batches: Sequence[tuple[Lease, Sequence[Published]]], cap: int
    ) -> list[int | Exception]:
        """Append each run's events to its stream, in one transaction (see ``RunQueue.publish_many``).

        The runs' offsets are numbered under a transaction-scoped advisory
        lock per run (taken in run id order: two publishers never wait for
        each other in a cycle), not a lock of the run's row, which the
        worker's saves and claims update meanwhile (a row lock here met
        their batches' row locks in the other order: a deadlock, broken by
        the server after a second). The fence is read after the lock is
        taken: a claim that took the run over committed before a publisher
        of its new epoch could take that lock, so a publisher of the old
        epoch that takes it later finds the lease gone and writes nothing.
        """
        given = self._publishable(batches, cap)
        checked = sorted(given, key=lambda b: b[0].run_id)
        if not checked:
            return []
        done: dict[str, int | Exception] = {}
        # Pipelined: the whole flush is one round trip to the server (and its commit), not a
        # few per run; a worker's database thread waits for the loop's GIL at each one.
        with self.db.transaction() as conn:
            with conn.pipeline():
                # A stream is not a checkpoint: its commit does not wait for the server's disk (a
                # crash of the server may lose its last rows, never a save's; the server's next
                # durable commit makes them durable).
                conn.execute("SET LOCAL synchronous_commit TO off")
                counted = []
                for lease, events in checked:
                    run_id = lease.run_id
                    conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_STREAM_LOCK, run_id))
                    counted.append(conn.execute(_STREAM_APPEND, (
                        run_id, run_id, lease.epoch, [e.kind for e in events], [e.step for e in events],
                        [e.data for e in events], [e.at for e in events],
                    )))
                    conn.execute(_STREAM_CAP, (run_id, run_id, cap))
            for (lease, _events), cur in zip(checked, counted, strict=True):
                row = cur.fetchone()
                if row is None or not row[0]:
                    done[lease.run_id] = LeaseLostError(lease.run_id, lease.epoch)
                else:
                    done[lease.run_id] = int(row[1])
        return [done[lease.run_id] for lease, _events in given]

    def _stream_rows(self, run_id: str, after: int, limit: int) -> StreamRows:
        with self.db.transaction(snapshot=True) as conn:
            row = conn.execute(
                "SELECT status, error, epoch FROM ekit_queue_runs WHERE run_id = %s", (run_id,)
            ).fetchone()
            if row is None:
                raise UnknownRunError(run_id)
            bounds = conn.execute(
                "SELECT min(pos), coalesce(max(pos), 0) FROM ekit_queue_stream WHERE run_id = %s", (run_id,)
            ).fetchone()
            rows = conn.execute(
                "SELECT pos, kind, step, data, epoch, at FROM ekit_queue_stream "
                "WHERE run_id = %s AND pos > %s ORDER BY pos LIMIT %s", (run_id, after, limit)
            ).fetchall()
        first, last = (None, 0) if bounds is None else (bounds[0], int(bounds[1]))
        return StreamRows(row[0], row[1], int(row[2]), None if first is None else int(first), last,
                          [(int(p), k, st, d, int(e), float(a)) for p, k, st, d, e, a in rows])

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def __repr__(self) -> str:
        return "PostgresQueue(...)"

    # -- one page of runs, filtered and counted in SQL (the dashboard) ------------

    def runs_page(
        self,
        status: RunStatus | None = None,
        *,
        workflow: str | None = None,
        limit: int | None = None,
        offset: int = 0,
        newest_first: bool = False,
    ) -> RunsPage:
        """One page of the matching runs and how many match in all (see :meth:`RunQueue.runs_page`).

        One read-only REPEATABLE READ snapshot: a ``count(*)``, then ``ORDER
        BY seq LIMIT ... OFFSET ...``, then the live workers for the queued
        runs' reasons.
        """
        status, workflow, limit, offset = self._page_args(status, workflow, limit, offset, newest_first)
        where, args = self._page_filter(status, workflow, "%s")
        order = "DESC" if newest_first else "ASC"
        rows: list[Any] = []
        workers: list[Any] = []
        with self.db.transaction(snapshot=True) as conn:
            row = conn.execute(f"SELECT count(*) FROM ekit_queue_runs {where}", args).fetchone()
            total = 0 if row is None else int(row[0])
            if offset < total and limit != 0:
                rows = conn.execute(
                    f"SELECT {_INFO} FROM ekit_queue_runs {where} ORDER BY seq {order} "
                    "LIMIT %s::bigint OFFSET %s::bigint",
                    (*args, limit, offset),
                ).fetchall()
                workers = conn.execute(
                    f"SELECT workflows FROM ekit_queue_workers WHERE until > {_NOW}"
                ).fetchall()
        served = self._served(workers)
        return RunsPage([self._run_info(r, served) for r in rows], total)

    def workflow_names(self) -> list[str]:
        """The workflow of every run the queue holds, each once, in code point order (``SELECT DISTINCT``)."""
        with self.db.transaction(snapshot=True) as conn:
            rows = conn.execute(
                'SELECT DISTINCT workflow COLLATE "C" AS w FROM ekit_queue_runs ORDER BY w'
            ).fetchall()
        return [name for (name,) in rows]

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
    More,
    RunQueue,
    Submission,
    Writes,
    Written,
    progress,
    schema_problem,
)
from ekit_runtime.queue.lifecycle import (
    FINAL,
    REOPENED_AS,
)
from ekit_runtime.queue.links import JOIN_LOCK, NOT_A_KEPT_CHILD, POSTGRES_LINKS
from ekit_runtime.queue.postgres_loop import LoopSession
from ekit_runtime.queue.postgres_sql import (
    _BEFORE,
    _COLUMNS,
    _HELD,
    _INFO,
    _MAX_IDLE,
    _NOW,
    _PICK_INDEX,
    _QUICK_CLAIM,
    _ROWS,
    _SAVE_COMPACTING,
    _SAVE_FULL,
    _SCHEMA,
    _SLOT_LOCK,
    _STREAM_LOCK,
    _STREAM_LOCKS,
    _STREAM_PUBLISH,
    _STREAM_TABLE,
    _UNCHANGED,
    _UPGRADE,
    _WHOLE,
    _columns,
    _columns_found,
    _has_pick_index,
    _has_stream_table,
    _names,
    _pick,
    _publish_args,
    _QueueConnection,
    _quick_args,
    _said,
    _writes_args,
)
from ekit_runtime.queue.records import (
    Lease,
    LeaseLostError,
    Limits,
    QueueUnavailableError,
    RunInfo,
    RunStatus,
    check_seconds,
)
from ekit_runtime.queue.streams import Published
from ekit_runtime.redaction import redacted, scrub
from ekit_runtime.stores.codec import Dumps, Loads
from ekit_runtime.stores.errors import CorruptStoreError
from ekit_runtime.stores.pg import _SCHEMA_LOCK, psycopg
from ekit_runtime.stores.rows import EncodedCheckpoint

__all__ = ["PostgresQueue"]

T = TypeVar("T")


def _has_links(conn: psycopg.Connection[Any]) -> bool:
    """Whether the child runs' link table and the join's trigger exist (``queue.links``)."""
    row = conn.execute(
        "SELECT to_regclass('ekit_queue_children') IS NOT NULL AND EXISTS "
        "(SELECT 1 FROM pg_trigger WHERE tgname = 'ekit_queue_wake_parent') AND EXISTS "
        "(SELECT 1 FROM pg_trigger WHERE tgname = 'ekit_queue_close_children')"
    ).fetchone()
    return bool(row and row[0])


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
            self._write_lock = self.db._lock
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
            if problem is None and not self.db.run(_has_links):
                self._add_to_schema(
                    POSTGRES_LINKS, "links_missing",
                    "queue %s: cannot create table ekit_queue_children and its trigger (%s); no "
                    "run can run a queued child until the owner of the queue's tables opens it once",
                )
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

    # -- the dialect of the statements RunQueue writes once -------------------

    _for_update = " FOR UPDATE"
    _join_lock = f"SELECT pg_advisory_xact_lock({JOIN_LOCK}, hashtext(:run_id))"
    _reopen_lock = f"SELECT pg_advisory_xact_lock({JOIN_LOCK}, hashtext(%s))"
    _code_points = ' COLLATE "C"'

    def _placeholder(self, name: str) -> str:
        return _NOW if name == "now" else f"%({name})s"  # (the clock is the server's)

    def _snapshot(self, body: Callable[[psycopg.Connection[Any]], T]) -> T:
        with self.db.transaction(snapshot=True) as conn:
            return body(conn)

    def _read(self, body: Callable[[psycopg.Connection[Any]], T]) -> T:
        return self.db.run(body)

    _run = _read  # (autocommit: each statement its own transaction)

    def _fenced_row(self, tx: psycopg.Connection[Any], sql: str, args: Mapping[str, Any]) -> bool | None:
        row = tx.execute(sql + " RETURNING cancel_requested", args).fetchone()
        return None if row is None else bool(row[0])

    def _slot_lock(self, tx: psycopg.Connection[Any], resource: str) -> None:
        # Held to the commit: takers of one resource count and insert in turn; others do not wait.
        tx.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_SLOT_LOCK, resource))

    def _submit_write(self, tx: psycopg.Connection[Any], sub: Submission, status: RunStatus) -> None:
        tx.execute(
            "INSERT INTO ekit_queue_runs (run_id, workflow, context, priority, status, created_at, "
            f"updated_at, options) VALUES (%s, %s, %s, %s, %s, {_NOW}, {_NOW}, %s) "
            "ON CONFLICT (run_id) DO NOTHING",
            (sub.run_id, sub.workflow, sub.context, sub.priority, status, sub.options),
        )

    def _info_sql(self, where: str, order: str = "ASC", tail: str = "") -> str:
        return f"SELECT {_INFO} FROM ekit_queue_runs {where} ORDER BY seq {order} {tail}"

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

    def _prune_write(self, conn: psycopg.Connection[Any], age: float) -> int:
        final = f"{FINAL} AND updated_at < {_NOW} - %s AND {NOT_A_KEPT_CHILD}"
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
        # Under the join's lock, taken before the row: a child's end that skips the row of a parent
        # it would wake (it cannot wait for it, see links.py) waits for this lock instead, so it
        # finds the parent still waiting if this write rolls back. The row is then taken SKIP
        # LOCKED, never waited for while holding the lock: a writer in flight refuses this one.
        tx.execute(self._reopen_lock, (run_id,))
        info = tx.execute(
            f"UPDATE ekit_queue_runs SET status = '{REOPENED_AS}', epoch = epoch + 1, "
            f"lease_until = NULL, cancel_requested = false, error = NULL, reason = NULL, "
            f"updated_at = {_NOW}{sets} "
            f"WHERE {_UNCHANGED} AND run_id IN (SELECT run_id FROM ekit_queue_runs WHERE run_id = %s "
            f"FOR UPDATE SKIP LOCKED) RETURNING {_INFO}",
            (*args, run_id, epoch, run_id),
        ).fetchone()
        if info is None:
            return None
        if written is not None:
            tx.execute("DELETE FROM ekit_queue_entries WHERE run_id = %s", (run_id,))
            tx.execute(_WHOLE, (run_id, epoch + 1, *_columns(enc.rows)))
        workers = tx.execute(f"SELECT workflows FROM ekit_queue_workers WHERE until > {_NOW}").fetchall()
        return self._run_info(info, self._served(workers))

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

    claim_many = RunQueue._claim_many_at_once

    def _quick_claim(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float,
        quick: tuple[str | None, Limits], limit: int,
    ) -> list[tuple[Any, ...]]:
        args = _quick_args(quick, worker, seconds, names, limit)
        return self.db.run(lambda c: c.execute(_QUICK_CLAIM, args).fetchall())

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

    def _claim(
        self, conn: psycopg.Connection[Any], worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> tuple[tuple[Any, ...], Limits] | None:
        """The claimed run's row (see :meth:`claim`) and the limits the claim read, or ``None``."""
        self._sweep_abandoned(conn)
        text, limits = self._read_limits_text(conn)
        # Later claims are quick (see _QUICK_CLAIM) while the fleet has no limit a claim counts.
        counted = limits.max_in_flight is not None or limits.runs_per_minute is not None
        self._quick = None if counted else (text, limits)
        self._trim_usage(conn, limits.window)
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
            self._count_start(conn)
        return claimed, limits

    def _fenced(self, lease: Lease, row: tuple[Any, ...] | None) -> bool:
        if row is None:
            self._lost(lease)
        return bool(row[0])

    # -- saves and endings: RunQueue writes them once, these are PostgreSQL's statements
    #
    # A save is one statement (the fenced UPDATE, and inserts that exist only
    # for the row it matched), renewing the whole lease; a worker's batch of
    # two writes or more is one statement too (``_WRITES``). A statement that
    # fails as a whole (a dropped session) has each of its writes made again
    # alone, so that each meets its own error. A batch does not ask ``more``:
    # the server commits concurrent writers' transactions together.

    save_many = RunQueue._save_many_at_once
    write_many = RunQueue._write_many_at_once

    def _save_one(
        self, lease: Lease, checkpoint: WorkflowCheckpoint, enc: EncodedCheckpoint, added: TokenUsage,
        seconds: float,
    ) -> bool:
        done, total = progress(checkpoint)  # RunInfo's progress, read without decoding
        if enc.full:
            return self._save_full(lease, enc, seconds, checkpoint, added, done, total)
        if enc.recount is not None:
            return self._save_compacting(lease, enc, seconds, added, done, total)
        return self._save_delta(lease, enc, seconds, added, done, total)

    def _save_compacting(
        self, lease: Lease, enc: EncodedCheckpoint, seconds: float, added: TokenUsage, done: int,
        total: int | None,
    ) -> bool:
        kinds, names, values = _columns(enc.rows)
        args = (
            enc.recount, *enc.counts, enc.failures, done, total, seconds, lease.run_id, lease.epoch,
            lease.epoch, kinds, names, values, added.llm_calls, added.total_tokens, self._uses(added),
            list(enc.gone),
        )
        return self._fenced(lease, self.db.run(lambda c: c.execute(_SAVE_COMPACTING, args).fetchone()))

    def _batches(self, writes: int) -> bool:
        return writes >= 2  # (alone: no statement to share)

    def _write_batch(
        self, writes: Writes, saves: Sequence[tuple[Lease, WorkflowCheckpoint]], more: More | None,
        seconds: float,
    ) -> None:
        rows: list[Written] = []
        writes.take(saves, rows)
        rows += writes.ends
        statement = _writes_args(rows, seconds)
        if statement is None:
            return
        sql, args = statement
        try:
            made = dict(self.db.run(lambda c: c.execute(sql, args).fetchall()))
        except Exception as exc:
            writes.failed(rows, exc, transient=False)  # not a refusal: the session, the server
        else:
            writes.told(rows, _said(rows, made))

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

    # -- the runs' live streams (ekit_runtime.queue.streams) -----------------

    publish_many = RunQueue._publish_many_at_once

    def _publish(self, batches: list[tuple[Lease, list[Published]]], cap: int) -> dict[str, int | Exception]:
        """See :meth:`RunQueue._publish`.

        The runs' offsets are numbered under a transaction-scoped advisory
        lock per run (taken in run id order), not a lock of the run's row,
        which the worker's saves and claims update meanwhile (a row lock here
        met their batches' row locks in the other order: a deadlock, broken by
        the server after a second). The fence is read after the lock is
        taken: a claim that took the run over committed before a publisher
        of its new epoch could take that lock, so a publisher of the old
        epoch that takes it later finds the lease gone and writes nothing.
        """
        ids, runs = _publish_args(batches)
        # Pipelined: the whole flush is one round trip to the server (and its commit), whatever
        # the runs; a worker's database thread waits for the loop's GIL at each one.
        with self.db.transaction() as conn:
            with conn.pipeline():
                # A stream is not a checkpoint: its commit does not wait for the server's disk (a
                # crash of the server may lose its last rows, never a save's; the server's next
                # durable commit makes them durable): _STREAM_LOCKS says so.
                conn.execute(_STREAM_LOCKS, (_STREAM_LOCK, ids))
                appended = conn.execute(_STREAM_PUBLISH, {"runs": runs, "cap": cap})
            newest = {run_id: int(last) for run_id, _count, last in appended.fetchall()}
        return {
            lease.run_id: newest.get(lease.run_id, LeaseLostError(lease.run_id, lease.epoch))
            for lease, _events in batches
        }

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def __repr__(self) -> str:
        return "PostgresQueue(...)"

    # -- one page of runs, filtered and counted in SQL (the dashboard) ------------

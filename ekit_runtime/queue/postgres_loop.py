"""``LoopSession``: a worker's batches of writes and its claims on PostgreSQL, awaited on its event loop.

A worker makes its database calls on a thread of its own, so that a slow
database never stalls the steps running on its event loop. Each call then
crosses between the loop and that thread twice, and each crossing waits
for a thread to be woken and to win the GIL: on a busy 2-core machine,
about 0.1 to 0.2 ms each way, paid by every save of every run. Two workers
on one machine lost a third of their throughput to it (docs/decisions/013).

The calls a worker makes for every run, its batches of writes
(``_WRITES``) and its quick claims (``_QUICK_CLAIM``), go instead through an
asynchronous psycopg connection of the worker's own, awaited on the loop: a
socket the loop already watches, no thread. The statements, their
arguments and the reading of their answers are the queue's own
(``Writes``, ``_writes_args``, ``_said``, ``_quick_args``, ``_granted_quick``), so a write is fenced and
answered exactly as on the thread.

Anything this session cannot do falls back to the thread, where the
queue's proven path decides:

- a statement that fails as a whole (a dropped session, a server restarting)
  has each of its writes made again alone on the thread, as ``write_many``
  does there, so that each meets its own error (lease lost, transient);
- a quick claim that fails or finds nothing is followed by a claim in full
  on the thread, which says whether the queue is empty or the fleet's
  limits changed; the runs a claim leased with a stored checkpoint have it
  read on the thread;
- after a failure, the session is closed and, for ``_PAUSE`` seconds, every
  call goes to the thread, so that a database that is down is not asked twice
  per call.

A session that the server ended while idle is noticed before it is used,
as the queue's own connection does, and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, cast

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue.base import (
    Ending,
    RunQueue,
    Writes,
    Written,
    check_one_per_run,
    claim_limit,
    handed_over,
)
from ekit_runtime.queue.postgres_sql import (
    _QUICK_CLAIM,
    _SESSION,
    _QueueConnection,
    _quick_args,
    _said,
    _writes_args,
    farewell,
    hung_up,
)
from ekit_runtime.queue.records import Lease, Limits
from ekit_runtime.stores.pg import IDLE_TIMEOUT, psycopg

__all__ = ["LoopSession"]

# After a failure, the seconds during which every call goes to the thread.
_PAUSE = 1.0

_Outcomes = tuple[list[bool | Exception], list[Exception | None]]


class _PostgresParts(Protocol):
    """What the session asks of a ``PostgresQueue`` beyond a ``RunQueue``'s verbs.

    Named here rather than imported: the queue opens this session
    (``PostgresQueue._loop_session``), so this module sits below it.
    """

    db: _QueueConnection
    _quick: tuple[str | None, Limits] | None

    def _claim_in_full(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> Lease | None:
        ...

    def _granted_quick(self, row: tuple[Any, ...], limits: Limits) -> Lease:
        ...

    def _give_back(self, leased: Sequence[tuple[Any, ...]]) -> None:
        ...


class LoopSession:
    """One worker's asynchronous session for its writes and claims (see the module docstring).

    Opened at its first call, on the loop that awaits it; :meth:`aclose`
    closes it. Used by one loop only. A claim and a write asked together
    share the session: psycopg's lock makes one wait for the other's answer
    (as they did on the one thread).
    """

    def __init__(self, queue: RunQueue, conninfo: str, idle_ms: int | None) -> None:
        self.queue = queue
        self._pg = cast(_PostgresParts, queue)
        self._conninfo, self._idle_ms = conninfo, idle_ms
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._farewell = False
        self._paused_until = 0.0
        self._opening = asyncio.Lock()

    async def write_many(
        self,
        saves: Sequence[tuple[Lease, WorkflowCheckpoint]],
        endings: Sequence[Ending],
        lease_seconds: float,
        executor: Executor,
    ) -> _Outcomes:
        """``queue.write_many(saves, endings, lease_seconds)``, its statement awaited on the loop."""
        loop = asyncio.get_running_loop()
        check_one_per_run(saves, endings)
        queue = self.queue
        writes = Writes(queue, endings, lease_seconds)
        rows: list[Written] = []
        writes.take(saves, rows)
        rows += writes.ends
        statement = _writes_args(rows, queue._lease_seconds(lease_seconds))
        if statement is None:
            return writes.saved, writes.ended
        conn = await self._session()
        if conn is None:
            await loop.run_in_executor(executor, self._write_here, writes, rows, statement)
            return writes.saved, writes.ended
        try:
            cursor = await conn.execute(*statement)
            made = dict(await cursor.fetchall())
        except BaseException as exc:
            await self._failed(conn)
            if not isinstance(exc, Exception):
                raise  # (cancelled: the group commit tells each caller; the next save is in full)
            await loop.run_in_executor(executor, functools.partial(writes.failed, rows, exc, transient=False))
        else:
            writes.told(rows, _said(rows, made))
        return writes.saved, writes.ended

    def _write_here(
        self, writes: Writes, rows: list[Written], statement: tuple[str, tuple[str, ...]]
    ) -> None:
        """The batch's statement on the queue's own connection (this thread), and each outcome."""
        try:
            made = dict(self._pg.db.run(lambda c: c.execute(*statement).fetchall()))
        except Exception as exc:
            writes.failed(rows, exc, transient=False)  # not a refusal: the session, the server
        else:
            writes.told(rows, _said(rows, made))

    async def claim_many(
        self,
        worker: str,
        workflows: Mapping[str, str | None],
        lease_seconds: float,
        limit: int,
        executor: Executor,
    ) -> list[Lease]:
        """``queue.claim_many(...)``, its quick claim awaited on the loop."""
        queue, pg = self.queue, self._pg
        loop = asyncio.get_running_loop()
        quick = pg._quick
        who, names = queue._worker_name(worker), queue._workflows(workflows)
        seconds = queue._lease_seconds(lease_seconds)
        args = None if quick is None else _quick_args(quick, who, seconds, names, claim_limit(limit))
        conn = None if args is None else await self._session()
        if quick is None or conn is None:
            return await loop.run_in_executor(
                executor, queue.claim_many, worker, workflows, lease_seconds, limit
            )
        try:
            cursor = await conn.execute(_QUICK_CLAIM, args)
            rows = await cursor.fetchall()
        except BaseException as exc:
            # The claim may have committed unheard: its leases then run out,
            # as on the thread after a lost answer, and their runs are claimed again.
            await self._failed(conn)
            if not isinstance(exc, Exception):
                raise
            rows = []
        if not rows:
            # Nothing to claim, the limits changed, or the session failed: a
            # claim in full (not claim_many, which would make the quick claim
            # again first) says which.
            lease = await loop.run_in_executor(executor, pg._claim_in_full, who, names, seconds)
            return [] if lease is None else [lease]

        def grant(row: tuple[Any, ...]) -> Lease:
            return pg._granted_quick(row, quick[1])

        def give_back(rows: Sequence[tuple[Any, ...]]) -> None:
            # Best effort, on the thread, not awaited: else their leases run out.
            executor.submit(pg._give_back, rows)

        if any(row[6] is not None for row in rows):
            # A run with a stored checkpoint: its entries are read on the thread.
            return await loop.run_in_executor(executor, handed_over, rows, grant, pg._give_back)
        return handed_over(rows, grant, give_back)

    async def _session(self) -> psycopg.AsyncConnection[Any] | None:
        """The open session, opened if needed; ``None``: make this call on the thread."""
        if self._pg.db._closed_by_caller or time.monotonic() < self._paused_until:
            return None
        async with self._opening:  # (a claim and a write asked together open one session)
            conn = self._conn
            if (
                conn is not None
                # Only while idle: a session in a call is read by that call.
                and conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
                and (hung_up(conn.pgconn) or self._farewell)
            ):
                # Ended by the server while idle (a restart, pg_terminate_backend):
                # replaced now, as the queue's own connection is.
                self._conn = None
                with contextlib.suppress(Exception):
                    await conn.close()
                conn = None
            if conn is None:
                try:
                    conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
                except Exception:
                    # Not reported here: the call goes to the thread, whose own
                    # connection says what is wrong (its message scrubbed of the password).
                    self._paused_until = time.monotonic() + _PAUSE
                    return None
                try:
                    await self._configure(conn)
                except Exception:
                    await self._failed(conn)
                    return None
                self._conn = conn
            return conn

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The queue's session settings (``PgConnection._configure``, ``_SESSION``), and its farewell."""
        self._farewell = False

        def heard(diag: psycopg.errors.Diagnostic) -> None:
            if farewell(diag):
                self._farewell = True

        conn.add_notice_handler(heard)
        if self._idle_ms is not None:
            await conn.execute(IDLE_TIMEOUT, (f"{self._idle_ms}ms",))
        await conn.execute(_SESSION)

    async def _failed(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Close the session after a failure; the calls of the next ``_PAUSE`` seconds go to the thread."""
        if self._conn is conn:
            self._conn = None
        self._paused_until = time.monotonic() + _PAUSE
        with contextlib.suppress(Exception):  # (a broken session: nothing to tell)
            await conn.close()  # (no wait inside: safe in a task being cancelled)

    async def aclose(self) -> None:
        """Close the session (the worker's loop is ending)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

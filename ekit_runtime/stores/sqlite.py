"""``SqliteStore``: the checkpoints of many runs in one SQLite database (WAL).

This module owns the database schema. ``ekit_runs`` holds one row per run
id: the parts of the checkpoint that are not per step (``header``: format
version, context, fingerprint, graph), the ``step_index``, the usage so far,
the failures and a save counter. ``ekit_entries`` holds one row per recorded
output and per-step usage, each value encoded on its own, and ``ekit_skips``
one row per step skipped by a condition, with why (a table of its own:
``ekit_entries`` allows only those two kinds, and SQLite cannot change a
table's constraint in place; a database made before it gains it when
opened). A save is one
transaction that inserts only the new rows and updates the run's row, so it
costs O(that step's output) (a loop compacting its iterations, ``keep_last``,
also deletes the rows of those it lets go of and writes the header again:
O(one iteration) per iteration); the first save of a store object, or a
checkpoint that does not extend the previous one, rewrites the run in full,
with each output's first text (the mutation rule). Reads take a deferred
transaction: one consistent snapshot without the write lock.

One writer per run: a store takes the run's lock file (``<database>-ekit-
<run>-<hash>.lock``, see :class:`~ekit_runtime.stores.locks.WriteLock`)
at its first save, and a save whose run row's counter is not the one this
store last read or wrote is refused rather than written over.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ekit_core import WorkflowCheckpoint
from ekit_runtime.run_ids import check_run_id
from ekit_runtime.stores.base import Store, require_checkpoint
from ekit_runtime.stores.codec import Dumps, Loads, check_checkpoint_text, codec
from ekit_runtime.stores.errors import CorruptStoreError, StoreLockedError
from ekit_runtime.stores.files import check_store_path, kind_of
from ekit_runtime.stores.locks import ProcessLock, WriteLock, holding
from ekit_runtime.stores.rows import EncodedCheckpoint, OutputTexts, decode_checkpoint, encode_checkpoint

if TYPE_CHECKING:
    import sqlite3

__all__ = ["SqliteStore"]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_runs (
    run_id TEXT PRIMARY KEY,
    header TEXT NOT NULL,
    step_index INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    llm_calls INTEGER NOT NULL,
    failures TEXT NOT NULL,
    saves INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS ekit_entries (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL CHECK (kind IN ('output', 'usage')),
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
"""
# Apart, so that a read-only database made before skips opens still (it has none).
_SKIPS = """
CREATE TABLE IF NOT EXISTS ekit_skips (
    run_id TEXT NOT NULL,
    name TEXT NOT NULL,
    reason TEXT NOT NULL,
    PRIMARY KEY (run_id, name)
);
"""

# Each table's columns and primary key, as _SCHEMA makes them.
_TABLES = {
    "ekit_runs": (
        frozenset({"run_id", "header", "step_index", "input_tokens", "output_tokens",
                   "llm_calls", "failures", "saves", "updated_at"}),
        ("run_id",),
    ),
    "ekit_entries": (frozenset({"run_id", "kind", "name", "value"}), ("run_id", "kind", "name")),
    "ekit_skips": (frozenset({"run_id", "name", "reason"}), ("run_id", "name")),
}

def _damaged(exc: BaseException) -> bool:
    """Whether a sqlite3 error says the file is not a database or is corrupt."""
    import sqlite3

    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)


def _name_error(exc: BaseException, path: str) -> None:
    """Put the database's name in front of an sqlite3 error's message, keeping its type."""
    # args, not a new exception: callers may catch sqlite3.OperationalError
    # and read sqlite_errorcode, and the traceback stays the original one.
    if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(f"{path}: "):
        exc.args = (f"{path}: {exc.args[0]}", *exc.args[1:])


def _check_tables(conn: sqlite3.Connection, path: str) -> None:
    """Raise :class:`CorruptStoreError` if ``ekit_runs`` or ``ekit_entries`` are not the store's.

    ``CREATE TABLE IF NOT EXISTS`` keeps a table of that name whatever its
    columns (or a view), and the first save would then fail inside SQL.
    """
    import sqlite3

    for table, (columns, key) in _TABLES.items():
        found = conn.execute("SELECT type FROM sqlite_master WHERE name=?", (table,)).fetchone()
        if found is None and table == "ekit_skips":
            continue  # a read-only database made before skips (see _open)
        info = conn.execute(f"PRAGMA table_info({table})").fetchall()
        names = [r[1] for r in info]
        primary = tuple(r[1] for r in sorted((r for r in info if r[5]), key=lambda r: r[5]))
        problem = None
        if found is None or found[0] != "table":
            problem = f"{table} is a {found[0] if found else 'missing table'}, not the store's table"
        elif set(names) != columns or primary != key:
            problem = (f"{table} is a table of its own (columns {', '.join(names)}; primary key "
                       f"{', '.join(primary) or 'none'}), not SqliteStore's")
        else:
            try:
                # load() orders entries by rowid, which a WITHOUT ROWID table lacks.
                conn.execute(f"SELECT rowid FROM {table} LIMIT 0").fetchall()
            except sqlite3.OperationalError:
                problem = f"{table} is a WITHOUT ROWID table of its own, not SqliteStore's"
        if problem is not None:
            raise CorruptStoreError(
                path, f"{problem}; use another database, or rename that table"
            )


def _connect(path: str) -> sqlite3.Connection:
    import sqlite3

    try:
        # Autocommit mode: transactions are the explicit BEGIN/COMMIT of the store.
        return sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    except sqlite3.Error as exc:
        _name_error(exc, path)
        raise


def _check_companions(path: str) -> None:
    """Refuse a database whose ``-wal``, ``-shm`` or ``-journal`` file is not a regular file.

    SQLite never opens those through a link (nor could it use a FIFO), and
    would only say "unable to open database file", naming neither.
    """
    file = os.path.realpath(path)
    for suffix in ("-wal", "-shm", "-journal"):
        try:
            mode = os.lstat(file + suffix).st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise ValueError(
                f"database {path!r}: its file {file + suffix} is {kind_of(mode)}, where SQLite "
                "keeps a regular file of its own (it never follows a link there); remove it if "
                "no process uses the database"
            )


def _lock_file(file: str, run_id: str) -> str:
    """The lock file of ``run_id`` in the database ``file``: readable, and unique per run id."""
    slug = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in run_id[:32])
    digest = hashlib.sha256(run_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{file}-ekit-{slug}-{digest}.lock"

class SqliteStore(Store):
    """Keep the checkpoints of many runs, keyed by ``run_id``, in one SQLite database.

    ``database`` is a path (opened in WAL mode) or an open
    ``sqlite3.Connection`` (used as configured; it must not be inside a
    transaction when a save begins). Use the store as ``checkpoint_fn=store``
    to save under ``run_id``; ``load(run_id=None)`` returns the latest
    checkpoint of that run (this store's by default) or ``None``; ``runs()``
    lists the run ids; ``delete(run_id)`` forgets one.

    Each save is one ``BEGIN IMMEDIATE`` transaction: a crash leaves the
    previous checkpoint or the new one. ``durable=False`` sets
    ``synchronous=NORMAL`` (safe against a killed process, may lose the
    last saves on a power cut). ``dumps``/``loads`` encode each output.
    Saves are synchronous.

    One writer per run id, enforced: the first save (or ``delete`` of the
    run) takes a lock on ``<database>-ekit-<run>-<hash>.lock``, held until
    :meth:`close` (or the end of a ``with`` block, or of the process); a
    second writer of that run is refused with
    :class:`~ekit_runtime.stores.StoreLockedError`, and so is a save after
    another writer saved the run this store had loaded or saved. Other runs
    of the database, and :meth:`load`, need no lock. Every ``sqlite3``
    error a store raises names the database. Under :meth:`Workflow.run
    <ekit_runtime.Workflow.run>` the lock is taken, and the rest checked,
    before the first step (:meth:`prepare_run`).
    """

    def __init__(
        self,
        database: str | os.PathLike[str] | sqlite3.Connection,
        *,
        run_id: str,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
        durable: bool = True,
    ) -> None:
        """Open (or share) ``database`` and create the store's tables if missing.

        Raises :class:`~ekit_runtime.stores.CorruptStoreError` (a
        ``ValueError``) naming the file when it is not a SQLite database, or
        when it has an ``ekit_runs`` or ``ekit_entries`` of its own (another
        table of that name), and a ``ValueError`` naming ``database`` when
        its folder is missing or it is not a regular file (a directory, a
        FIFO...); a connection the store opened is closed on any failure here.
        """
        import sqlite3

        self.run_id = check_run_id(run_id)
        self.dumps, self.loads = codec(dumps, loads)
        self._lock = threading.Lock()
        self._owned = not isinstance(database, sqlite3.Connection)
        self.path = "<sqlite3.Connection>"
        if isinstance(database, sqlite3.Connection):
            self.conn = database
        else:
            self.path = os.fspath(database)
            if isinstance(self.path, str) and self.path not in ("", ":memory:"):
                check_store_path(self.path, "database")
                _check_companions(self.path)
            self.conn = _connect(self.path)
        try:
            file = self._open(durable)
        except BaseException as exc:
            if self._owned:
                self.conn.close()
            if isinstance(exc, sqlite3.Error):
                if _damaged(exc):
                    raise CorruptStoreError(
                        self.path, f"not a usable SQLite database ({exc})"
                    ) from exc
                _name_error(exc, self.path)
            raise
        self._file = file
        self._writer = self._lock_of(run_id)
        # What this object knows is stored for its run id: the checkpoint,
        # the run row's save counter (0: no row; ``None``: unknown, so the
        # next save rewrites the run unchecked) and each output's stored text.
        self._last: WorkflowCheckpoint | None = None
        self._saves: int | None = None
        self._texts = OutputTexts()

    def _open(self, durable: bool) -> str:
        """Configure the connection and check the tables; the database's file ("" if none)."""
        import sqlite3

        conn = self.conn
        if self._owned:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        file: str = next((r[2] for r in conn.execute("PRAGMA database_list") if r[1] == "main"), "")
        if not self._owned and file:
            self.path = file
        self._idle()
        # executescript commits on its own; the DDL is idempotent.
        conn.executescript(_SCHEMA)
        try:
            conn.executescript(_SKIPS)
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_READONLY:
                raise
        self._skips = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE name='ekit_skips'").fetchone() is not None
        _check_tables(conn, self.path)
        return os.path.realpath(file) if file else ""

    def _lock_of(self, run_id: str) -> WriteLock | ProcessLock:
        """The write lock of ``run_id``: a lock file beside the database, or one in this process."""
        if not self._file:
            # In memory: only this connection reaches the database.
            return ProcessLock(self.path, f"{id(self.conn)}:{run_id}", run_id=run_id)
        name = _lock_file(self._file, run_id)
        return WriteLock(self.path, lambda: name, run_id=run_id)

    def _idle(self) -> None:
        if self.conn.in_transaction:
            raise ValueError(
                "SqliteStore: the connection is inside a transaction; commit or roll it "
                "back before using the store"
            )

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        """Make an ``sqlite3`` error raised inside name the database (damage: CorruptStoreError)."""
        import sqlite3

        try:
            yield
        except sqlite3.Error as exc:
            if _damaged(exc):
                raise CorruptStoreError(self.path, f"damaged database ({exc})") from exc
            _name_error(exc, self.path)
            raise

    def _transaction(self, body: Callable[[], T], *, write: bool = True) -> T:
        """Run ``body`` in one transaction: ``BEGIN IMMEDIATE`` to write, deferred to read.

        A read needs one snapshot, not the write lock (in WAL mode readers
        never wait for a writer). On any error, including a failed COMMIT,
        the transaction is rolled back if SQLite has not already done so, and
        the original error propagates.
        """
        import sqlite3

        conn = self.conn
        self._idle()
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            result = body()
            conn.execute("COMMIT")
        except BaseException as exc:
            # Some errors (SQLITE_FULL, IOERR, INTERRUPT...) roll back by
            # themselves, and a failed COMMIT leaves the transaction open;
            # either way the connection must end up idle for the next save.
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error as rollback:
                    exc.add_note(f"and the rollback failed too: {rollback}")
            raise
        return result

    # -- saving -------------------------------------------------------------

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Record ``checkpoint`` as the latest of this store's run, in one transaction.

        Raises :class:`~ekit_runtime.stores.UnencodableError` (a ``ValueError``
        naming the step) if an output cannot be encoded, and
        :class:`~ekit_runtime.stores.StoreLockedError` if another writer holds
        the run or saved it since this store last read or wrote it; the
        stored checkpoint is then untouched.
        """
        require_checkpoint(checkpoint)
        with self._lock, self._named():
            self._writer.hold()
            encoded = encode_checkpoint(
                checkpoint, self._last, self.dumps, self._texts, engine="SQLite", compacting=True
            )
            # Unknown until the transaction commits: if it fails, save in full next time.
            self._last = None
            try:
                saves = self._transaction(lambda: self._write(encoded))
            except _Stale:
                raise self._stale() from None
            self._last = checkpoint
            self._saves = saves

    __call__ = save

    def prepare_run(self, checkpoint: WorkflowCheckpoint) -> None:
        """Refuse now, before any step runs, a run whose saves this store would refuse.

        :meth:`Workflow.run <ekit_runtime.Workflow.run>` calls it with the
        checkpoint the run starts from. It takes the run's write lock (kept
        until :meth:`close`; a refusal keeps none it took), and raises
        :class:`~ekit_runtime.stores.StoreLockedError` if another writer
        holds it, its lock file is not a regular file of this user's, the
        database is read-only, or another writer saved the run since this
        store loaded it; :class:`~ekit_runtime.stores.UnencodableError` if a
        step name, version tag, context value or recorded output cannot be
        encoded. Writes nothing but the lock file.
        """
        import sqlite3

        require_checkpoint(checkpoint)
        check_checkpoint_text(checkpoint)
        with self._lock, self._named():
            encode_checkpoint(checkpoint, None, self.dumps, self._texts, engine="SQLite")
            with holding(self._writer):
                try:
                    # A write that changes nothing: a read-only database (or
                    # file) refuses it, as it would the first save.
                    saves = self._transaction(self._probe)
                except sqlite3.OperationalError as exc:
                    if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_READONLY:
                        raise
                    raise StoreLockedError(
                        self.path, f"the database is read-only for this store ({exc}); nothing was saved",
                        run_id=self.run_id,
                    ) from exc
                if self._saves is not None and saves != self._saves:
                    raise self._stale()

    def _probe(self) -> int:
        self.conn.execute("UPDATE ekit_runs SET saves = saves WHERE 0")
        return self._saves_of(self.run_id)

    def _saves_of(self, run_id: str) -> int:
        row = self.conn.execute("SELECT saves FROM ekit_runs WHERE run_id=?", (run_id,)).fetchone()
        return 0 if row is None else int(row[0])

    def _stale(self) -> StoreLockedError:
        return StoreLockedError(
            self.path,
            "the run was saved by another writer since this store last read or wrote "
            "it; nothing was saved. load() again to continue from what is stored",
            run_id=self.run_id,
        )

    def _write(self, encoded: EncodedCheckpoint) -> int:
        conn, run_id = self.conn, self.run_id
        counts, failures, header = encoded.counts, encoded.failures, encoded.header
        now = time.time()
        if header is None:
            # (A compacting delta writes the header too: it holds the compacted counts.)
            recount = "" if encoded.recount is None else "header=?, "
            updated = conn.execute(
                f"UPDATE ekit_runs SET {recount}step_index=?, input_tokens=?, output_tokens=?, "
                "llm_calls=?, failures=?, saves=saves+1, updated_at=? "
                "WHERE run_id=? AND saves=?",
                (*(() if encoded.recount is None else (encoded.recount,)), *counts, failures, now,
                 run_id, self._saves),
            ).rowcount
            if updated != 1:
                raise _Stale
            if encoded.gone:
                conn.executemany(
                    "DELETE FROM ekit_entries WHERE run_id=? AND kind=? AND name=?",
                    [(run_id, kind, name) for name in encoded.gone for kind in ("output", "usage")],
                )
        else:
            if self._saves is not None and self._saves_of(run_id) != self._saves:
                raise _Stale
            conn.execute("DELETE FROM ekit_entries WHERE run_id=?", (run_id,))
            conn.execute("DELETE FROM ekit_skips WHERE run_id=?", (run_id,))
            conn.execute(
                "INSERT INTO ekit_runs (run_id, header, step_index, input_tokens, "
                "output_tokens, llm_calls, failures, saves, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?) "
                "ON CONFLICT(run_id) DO UPDATE SET header=excluded.header, "
                "step_index=excluded.step_index, input_tokens=excluded.input_tokens, "
                "output_tokens=excluded.output_tokens, llm_calls=excluded.llm_calls, "
                "failures=excluded.failures, saves=saves+1, updated_at=excluded.updated_at",
                (run_id, header, *counts, failures, now),
            )
        conn.executemany(
            "INSERT INTO ekit_entries (run_id, kind, name, value) VALUES (?, ?, ?, ?)",
            [(run_id, *row) for row in encoded.rows if row[0] != "skip"],
        )
        conn.executemany(
            "INSERT INTO ekit_skips (run_id, name, reason) VALUES (?, ?, ?)",
            [(run_id, name, why) for kind, name, why in encoded.rows if kind == "skip"],
        )
        saves: int = conn.execute(
            "SELECT saves FROM ekit_runs WHERE run_id=?", (run_id,)
        ).fetchone()[0]
        return saves

    # -- reading ------------------------------------------------------------

    def load(self, run_id: str | None = None) -> WorkflowCheckpoint | None:
        """The latest checkpoint of ``run_id`` (default: this store's), or ``None``.

        Raises :class:`~ekit_runtime.stores.CorruptStoreError` for stored data
        that does not decode (NaN and infinities included, with the default
        codec) and :class:`~ekit_core.CheckpointError` for data that is not a
        checkpoint (both ``ValueError``). Takes no lock.
        """
        run = self.run_id if run_id is None else run_id
        if not isinstance(run, str):
            raise ValueError(f"run_id must be a string, got {type(run).__name__}")
        with self._lock, self._named():
            row, entries = self._read(run)
            own = run == self.run_id
            if row is None:
                if own:
                    self._last, self._saves = None, 0
                    self._texts.clear()
                return None
            checkpoint = decode_checkpoint(
                row[0], tuple(row[1:5]), row[5], entries, self.loads,
                f"{self.path}, run {run!r}", self._texts if own else None,
            )
            if own:
                self._last, self._saves = checkpoint, row[6]
            return checkpoint

    def _read(self, run: str) -> tuple[Any, list[Any]]:
        def body() -> tuple[Any, list[Any]]:
            row = self.conn.execute(
                "SELECT header, step_index, input_tokens, output_tokens, llm_calls, "
                "failures, saves FROM ekit_runs WHERE run_id=?",
                (run,),
            ).fetchone()
            if row is None:
                return None, []
            entries = self.conn.execute(
                "SELECT kind, name, value FROM ekit_entries WHERE run_id=? ORDER BY rowid",
                (run,),
            ).fetchall()
            if self._skips:
                entries += self.conn.execute(
                    "SELECT 'skip', name, reason FROM ekit_skips WHERE run_id=? ORDER BY rowid",
                    (run,),
                ).fetchall()
            return row, entries

        # One transaction, so the run row and its entries come from one
        # snapshot; deferred, so a read neither takes nor waits for the write lock.
        return self._transaction(body, write=False)

    def runs(self) -> list[str]:
        """The run ids that have a saved checkpoint, sorted."""
        with self._lock, self._named():
            return [r[0] for r in self.conn.execute("SELECT run_id FROM ekit_runs ORDER BY run_id")]

    def delete(self, run_id: str) -> bool:
        """Forget every checkpoint of ``run_id``; ``True`` if there was one.

        A write: it takes the run's lock (and keeps it, for this store's own
        run), so it raises :class:`~ekit_runtime.stores.StoreLockedError` while
        another store writes that run.
        """
        with self._lock, self._named():
            own = run_id == self.run_id
            writer = self._writer if own else self._lock_of(run_id)
            writer.hold()

            def body() -> bool:
                self.conn.execute("DELETE FROM ekit_entries WHERE run_id=?", (run_id,))
                if self._skips:
                    self.conn.execute("DELETE FROM ekit_skips WHERE run_id=?", (run_id,))
                return self.conn.execute(
                    "DELETE FROM ekit_runs WHERE run_id=?", (run_id,)
                ).rowcount > 0

            try:
                found = self._transaction(body)
            finally:
                if not own:
                    writer.release()
            if own:
                self._last, self._saves = None, 0
                self._texts.clear()
            return found

    def close(self) -> None:
        """Release the run's write lock, and close the connection if this store opened it."""
        self._writer.release()
        if self._owned:
            self.conn.close()

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r}, run_id={self.run_id!r})"


class _Stale(Exception):
    """The run row changed since this store last read or wrote it."""

"""``SqliteStore``: the checkpoints of many runs in one SQLite database (WAL).

This module owns the database schema. ``ekit_runs`` holds one row per run
id: the parts of the checkpoint that are not per step (``header``: format
version, context, fingerprint, graph), the ``step_index``, the usage so far
and the failures. ``ekit_entries`` holds one row per recorded output and
per-step usage, each value encoded on its own. A save is one transaction
that inserts only the new rows and updates the run's row, so it costs
O(that step's output); the first save of a store object, or a checkpoint
that does not extend the previous one, rewrites the run in full. Reads take
a deferred transaction: one consistent snapshot without the write lock.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime.stores._common import (
    CorruptStoreError,
    Dumps,
    Loads,
    UnencodableError,
    default_dumps,
    encode_text,
    require_checkpoint,
    same_run,
)

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

# SQLite stores INTEGER as a signed 64-bit value; a larger Python int would
# raise OverflowError in the middle of the transaction.
_INT64 = range(-(2**63), 2**63)


def _damaged(exc: BaseException) -> bool:
    """Whether a sqlite3 error says the file is not a database or is corrupt."""
    import sqlite3

    return getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)


class SqliteStore:
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
    Saves are synchronous. One writer per run id.
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
        ``ValueError``) naming the file when it is not a SQLite database;
        a connection the store opened is closed on any failure here.
        """
        import sqlite3

        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        self.run_id = run_id
        self.dumps: Dumps = dumps if dumps is not None else default_dumps
        self.loads: Loads = loads if loads is not None else json.loads
        self._lock = threading.Lock()
        self._owned = not isinstance(database, sqlite3.Connection)
        if isinstance(database, sqlite3.Connection):
            self.conn = database
            self.path = "<sqlite3.Connection>"
        else:
            self.path = os.fspath(database)
            # Autocommit mode: transactions are the explicit BEGIN/COMMIT below.
            self.conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
        try:
            if self._owned:
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._idle()
            # executescript commits on its own; the DDL is idempotent.
            self.conn.executescript(_SCHEMA)
        except BaseException as exc:
            if self._owned:
                self.conn.close()
            if _damaged(exc):
                raise CorruptStoreError(self.path, f"not a usable SQLite database ({exc})") from exc
            raise
        # What this object knows is stored for its run id: the checkpoint and
        # the run row's save counter. ``None`` means "unknown": save in full.
        self._last: WorkflowCheckpoint | None = None
        self._saves = 0

    def _idle(self) -> None:
        if self.conn.in_transaction:
            raise ValueError(
                "SqliteStore: the connection is inside a transaction; commit or roll it "
                "back before using the store"
            )

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
        naming the step) before the transaction begins if an output cannot be
        encoded; the stored checkpoint is then untouched.
        """
        require_checkpoint(checkpoint)
        with self._lock:
            previous = self._last
            full = previous is None or not self._saves or not same_run(checkpoint, previous)
            rows: list[tuple[str, str, str]] | None = None
            if previous is not None and not full:
                delta = checkpoint.delta_since(previous)
                if delta.extends and not delta.context_changed:
                    rows = self._rows(delta.outputs, delta.step_usage)
            header = None
            if rows is None:
                header = self._header(checkpoint)
            new_rows = rows if rows is not None else self._rows(
                checkpoint.outputs.items(), checkpoint.step_usage.items()
            )
            failures = encode_text(
                {k: f.to_dict() for k, f in checkpoint.failures.items()}, default_dumps, ()
            )
            self._check_counts(checkpoint)
            # Unknown until the transaction commits: if it fails, save in full next time.
            self._last = None
            try:
                saves = self._transaction(
                    lambda: self._write(checkpoint, new_rows, failures, header)
                )
            except _Stale:
                all_rows = self._rows(checkpoint.outputs.items(), checkpoint.step_usage.items())
                saves = self._transaction(
                    lambda: self._write(
                        checkpoint, all_rows, failures, self._header(checkpoint)
                    )
                )
            self._last = checkpoint
            self._saves = saves

    __call__ = save

    @staticmethod
    def _check_counts(checkpoint: WorkflowCheckpoint) -> None:
        """Refuse, before the transaction, a count that does not fit an SQLite INTEGER."""
        cost = checkpoint.cost
        for name, value in (
            ("step_index", checkpoint.step_index),
            ("cost.input_tokens", cost.input_tokens),
            ("cost.output_tokens", cost.output_tokens),
            ("cost.llm_calls", cost.llm_calls),
        ):
            if value not in _INT64:
                raise UnencodableError(
                    f"cannot store {name} = {value}: SQLite integers are 64-bit; nothing was saved"
                )

    def _header(self, checkpoint: WorkflowCheckpoint) -> str:
        meta = checkpoint.to_dict()
        for key in ("outputs", "step_usage", "failures", "cost", "step_index"):
            del meta[key]
        return encode_text(meta, self.dumps, (), checkpoint.context)

    def _rows(
        self, outputs: Iterable[tuple[str, Any]], usage: Iterable[tuple[str, TokenUsage]]
    ) -> list[tuple[str, str, str]]:
        rows = [("output", k, encode_text(v, self.dumps, ((k, v),))) for k, v in outputs]
        rows.extend(("usage", k, default_dumps(u.to_dict())) for k, u in usage)
        return rows

    def _write(
        self,
        checkpoint: WorkflowCheckpoint,
        rows: list[tuple[str, str, str]],
        failures: str,
        header: str | None,
    ) -> int:
        conn, run_id, cost = self.conn, self.run_id, checkpoint.cost
        counts = (checkpoint.step_index, cost.input_tokens, cost.output_tokens, cost.llm_calls)
        now = time.time()
        if header is None:
            updated = conn.execute(
                "UPDATE ekit_runs SET step_index=?, input_tokens=?, output_tokens=?, "
                "llm_calls=?, failures=?, saves=saves+1, updated_at=? "
                "WHERE run_id=? AND saves=?",
                (*counts, failures, now, run_id, self._saves),
            ).rowcount
            if updated != 1:
                # Another writer saved this run since we last did: rewrite it whole.
                raise _Stale
        else:
            conn.execute("DELETE FROM ekit_entries WHERE run_id=?", (run_id,))
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
            [(run_id, *row) for row in rows],
        )
        saves: int = conn.execute(
            "SELECT saves FROM ekit_runs WHERE run_id=?", (run_id,)
        ).fetchone()[0]
        return saves

    # -- reading ------------------------------------------------------------

    def load(self, run_id: str | None = None) -> WorkflowCheckpoint | None:
        """The latest checkpoint of ``run_id`` (default: this store's), or ``None``.

        Raises :class:`~ekit_runtime.stores.CorruptStoreError` for stored data
        that does not decode and :class:`~ekit_core.CheckpointError` for data
        that is not a checkpoint (both ``ValueError``).
        """
        run = self.run_id if run_id is None else run_id
        if not isinstance(run, str):
            raise ValueError(f"run_id must be a string, got {type(run).__name__}")
        import sqlite3

        with self._lock:
            try:
                row, entries = self._read(run)
            except sqlite3.DatabaseError as exc:
                if _damaged(exc):
                    raise CorruptStoreError(self.path, f"damaged database ({exc})") from exc
                raise
            if row is None:
                if run == self.run_id:
                    self._last = None
                return None
            header, step_index, i, o, calls, failures, saves = row
            where = f"{self.path}, run {run!r}"
            data = self._decode(header, where, "header")
            if not isinstance(data, dict):
                raise CorruptStoreError(where, "header is not an object")
            data["step_index"] = step_index
            data["cost"] = {"input_tokens": i, "output_tokens": o, "llm_calls": calls}
            data["failures"] = self._decode(failures, where, "failures")
            outputs: dict[str, Any] = {}
            usage: dict[str, Any] = {}
            for kind, name, value in entries:
                if kind == "output":
                    outputs[name] = self._decode(value, where, f"output of step {name!r}")
                else:
                    usage[name] = self._decode(value, where, f"usage of step {name!r}")
            data["outputs"] = outputs
            data["step_usage"] = usage
            try:
                checkpoint = WorkflowCheckpoint.from_dict(data)
            except ValueError as exc:
                exc.add_note(f"while loading {where}")
                raise
            if run == self.run_id:
                self._last, self._saves = checkpoint, saves
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
            return row, entries

        # One transaction, so the run row and its entries come from one
        # snapshot; deferred, so a read neither takes nor waits for the write lock.
        return self._transaction(body, write=False)

    def _decode(self, text: str, where: str, what: str) -> Any:
        loads = json.loads if what in ("failures",) or what.startswith("usage") else self.loads
        try:
            return loads(text)
        except Exception as exc:
            raise CorruptStoreError(
                where, f"{what} does not decode ({type(exc).__name__}: {exc})"
            ) from exc

    def runs(self) -> list[str]:
        """The run ids that have a saved checkpoint, sorted."""
        with self._lock:
            return [r[0] for r in self.conn.execute("SELECT run_id FROM ekit_runs ORDER BY run_id")]

    def delete(self, run_id: str) -> bool:
        """Forget every checkpoint of ``run_id``; ``True`` if there was one."""
        with self._lock:
            def body() -> bool:
                self.conn.execute("DELETE FROM ekit_entries WHERE run_id=?", (run_id,))
                return self.conn.execute(
                    "DELETE FROM ekit_runs WHERE run_id=?", (run_id,)
                ).rowcount > 0

            found = self._transaction(body)
            if run_id == self.run_id:
                self._last = None
            return found

    def close(self) -> None:
        """Close the connection if this store opened it."""
        if self._owned:
            self.conn.close()

    def __enter__(self) -> SqliteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SqliteStore({self.path!r}, run_id={self.run_id!r})"


class _Stale(Exception):
    """The run row changed since this store last wrote it."""

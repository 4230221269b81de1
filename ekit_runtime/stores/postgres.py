"""``PostgresStore``: the checkpoints of many runs in PostgreSQL (psycopg 3, optional).

This module owns the store's schema: ``ekit_runs`` holds one row per run id
(the checkpoint's header, counts, failures, and a save counter) and
``ekit_entries`` one row per recorded output and per-step usage. A save that
extends the previous one is a single statement: it updates the run row only
if the save counter is still the one this store last wrote (else another
writer saved meanwhile, and the run is rewritten whole) and inserts only the
new entries, so it costs O(that step's output). Reads take one REPEATABLE
READ snapshot. Importing this module imports psycopg; ``ekit_runtime``
imports it only when ``PostgresStore`` is first used.
"""

from __future__ import annotations

import json
from typing import Any

from ekit_core import WorkflowCheckpoint
from ekit_runtime.stores._common import Dumps, Loads, default_dumps
from ekit_runtime.stores._pg import PgConnection, psycopg
from ekit_runtime.stores._rows import EncodedCheckpoint, decode_checkpoint, encode_checkpoint

__all__ = ["PostgresStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_runs (
    run_id text PRIMARY KEY,
    header text NOT NULL,
    step_index bigint NOT NULL,
    input_tokens bigint NOT NULL,
    output_tokens bigint NOT NULL,
    llm_calls bigint NOT NULL,
    failures text NOT NULL,
    saves bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS ekit_entries (
    seq bigserial,
    run_id text NOT NULL,
    kind text NOT NULL,
    name text NOT NULL,
    value text NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
"""

_INSERT = (
    "INSERT INTO ekit_entries (run_id, kind, name, value) "
    "SELECT {source}, e.kind, e.name, e.value "
    "FROM {origin}unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS e(kind, name, value, ord) "
    "ORDER BY e.ord ON CONFLICT (run_id, kind, name) DO UPDATE SET value = excluded.value"
)


class PostgresStore:
    """Keep the checkpoints of many runs, keyed by ``run_id``, in a PostgreSQL database.

    ``dsn`` is a libpq connection string or URL, or an open
    ``psycopg.Connection`` (switched to autocommit). Use as
    ``checkpoint_fn=store``; ``load(run_id=None)`` returns the latest
    checkpoint of that run (this store's by default) or ``None``; ``runs()``
    lists run ids; ``delete(run_id)`` forgets one. A save is one statement
    (or one transaction when the run is rewritten): a crash leaves the
    previous checkpoint or the new one. ``dumps``/``loads`` encode each
    output. One writer per run id; for many writers use the run queue.
    """

    def __init__(
        self,
        dsn: str | psycopg.Connection[Any],
        *,
        run_id: str,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
    ) -> None:
        """Connect and create the store's tables if missing."""
        if not isinstance(run_id, str) or not run_id:
            raise ValueError(f"run_id must be a non-empty string, got {run_id!r}")
        self.run_id = run_id
        self.dumps: Dumps = dumps if dumps is not None else default_dumps
        self.loads: Loads = loads if loads is not None else json.loads
        self.db = PgConnection(dsn, _SCHEMA, "ekit_runs")
        # What is stored for run_id, as this object last wrote or read it.
        self._last: WorkflowCheckpoint | None = None
        self._saves = 0

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Record ``checkpoint`` as the latest of this store's run.

        Raises ``UnencodableError`` (a ``ValueError`` naming the step) before
        anything is sent if an output cannot be encoded.
        """
        encoded = encode_checkpoint(checkpoint, self._last if self._saves else None, self.dumps)
        self._last = None  # unknown until the write commits
        saves = None if encoded.full else self._delta(encoded)
        if saves is None:
            full = encoded if encoded.full else encode_checkpoint(checkpoint, None, self.dumps)
            saves = self._full(full)
        self._last, self._saves = checkpoint, saves

    __call__ = save

    def _delta(self, enc: EncodedCheckpoint) -> int | None:
        kinds, names, values = ([r[i] for r in enc.rows] for i in range(3))
        sql = (
            "WITH run AS (UPDATE ekit_runs SET step_index = %s, input_tokens = %s, output_tokens = %s, "
            "llm_calls = %s, failures = %s, saves = saves + 1, updated_at = now() "
            "WHERE run_id = %s AND saves = %s RETURNING run_id, saves), "
            "added AS (" + _INSERT.format(source="run.run_id", origin="run, ") + ") "
            "SELECT saves FROM run"
        )
        args = (*enc.counts, enc.failures, self.run_id, self._saves, kinds, names, values)
        row = self.db.run(lambda c: c.execute(sql, args).fetchone())
        return None if row is None else int(row[0])

    def _full(self, enc: EncodedCheckpoint) -> int:
        kinds, names, values = ([r[i] for r in enc.rows] for i in range(3))
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM ekit_entries WHERE run_id = %s", (self.run_id,))
            row = conn.execute(
                "INSERT INTO ekit_runs (run_id, header, step_index, input_tokens, output_tokens, llm_calls, "
                "failures, saves) VALUES (%s, %s, %s, %s, %s, %s, %s, 1) ON CONFLICT (run_id) DO UPDATE SET "
                "header = excluded.header, step_index = excluded.step_index, "
                "input_tokens = excluded.input_tokens, output_tokens = excluded.output_tokens, "
                "llm_calls = excluded.llm_calls, failures = excluded.failures, "
                "saves = ekit_runs.saves + 1, updated_at = now() RETURNING saves",
                (self.run_id, enc.header, *enc.counts, enc.failures),
            ).fetchone()
            conn.execute(_INSERT.format(source="%s", origin=""), (self.run_id, kinds, names, values))
        assert row is not None
        return int(row[0])

    def load(self, run_id: str | None = None) -> WorkflowCheckpoint | None:
        """The latest checkpoint of ``run_id`` (default: this store's), or ``None``."""
        run = self.run_id if run_id is None else run_id
        if not isinstance(run, str):
            raise ValueError(f"run_id must be a string, got {type(run).__name__}")
        with self.db.transaction(snapshot=True) as conn:
            row = conn.execute(
                "SELECT header, step_index, input_tokens, output_tokens, llm_calls, failures, saves "
                "FROM ekit_runs WHERE run_id = %s",
                (run,),
            ).fetchone()
            entries = conn.execute(
                "SELECT kind, name, value FROM ekit_entries WHERE run_id = %s ORDER BY seq", (run,)
            ).fetchall()
        if row is None:
            if run == self.run_id:
                self._last, self._saves = None, 0
            return None
        checkpoint = decode_checkpoint(
            row[0], tuple(row[1:5]), row[5], entries, self.loads, f"postgresql run {run!r}"
        )
        if run == self.run_id:
            self._last, self._saves = checkpoint, int(row[6])
        return checkpoint

    def runs(self) -> list[str]:
        """The run ids that have a saved checkpoint, sorted."""
        rows = self.db.run(lambda c: c.execute("SELECT run_id FROM ekit_runs ORDER BY run_id").fetchall())
        return [r[0] for r in rows]

    def delete(self, run_id: str) -> bool:
        """Forget every checkpoint of ``run_id``; ``True`` if there was one."""
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM ekit_entries WHERE run_id = %s", (run_id,))
            found = conn.execute("DELETE FROM ekit_runs WHERE run_id = %s", (run_id,)).rowcount > 0
        if run_id == self.run_id:
            self._last, self._saves = None, 0
        return found

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def __enter__(self) -> PostgresStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresStore(run_id={self.run_id!r})"

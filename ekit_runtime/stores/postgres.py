"""``PostgresStore``: the checkpoints of many runs in PostgreSQL (psycopg 3, optional).

This module owns the store's schema: ``ekit_runs`` holds one row per run id
(the checkpoint's header, counts, failures, a save counter and the epoch of
the writer that holds the run) and ``ekit_entries`` one row per recorded
output, per-step usage and skipped step (kind ``skip``). A save that extends the previous one is a single
statement that updates the run row and inserts only the new entries, so it
costs O(that step's output); a loop compacting its iterations (``keep_last``)
also deletes, in that statement, the rows of those it lets go of and writes
the header again (its counts): O(one iteration) per iteration. Reads take one REPEATABLE READ snapshot.

One writer per run id, by fencing: the first save of a store object claims
the run, giving its row a new writer epoch (from the sequence
``ekit_run_writers``, so an epoch is never handed out twice, even to a run
deleted and saved again); every later save is conditional on that epoch in
the very statement that writes, so once another store object has claimed
the run, this one's saves write nothing and raise ``StoreLockedError``.
Nothing is held between saves: a crashed writer blocks nobody.

Importing this module imports psycopg; ``ekit_runtime`` imports it only when
``PostgresStore`` is first used.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ekit_core import WorkflowCheckpoint
from ekit_runtime.run_ids import check_run_id
from ekit_runtime.stores.base import Store, require_checkpoint
from ekit_runtime.stores.codec import Dumps, Loads, check_checkpoint_text, codec
from ekit_runtime.stores.errors import StoreLockedError
from ekit_runtime.stores.pg import PgConnection, psycopg
from ekit_runtime.stores.rows import (
    EncodedCheckpoint,
    OutputTexts,
    decode_checkpoint,
    encode_checkpoint,
    pg_text_problem,
)

__all__ = ["PostgresStore"]

# The ALTER brings a table made before fencing up to date; the schema runs
# only while the sequence (the probe) is missing, so once per database.
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
    writer bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE ekit_runs ADD COLUMN IF NOT EXISTS writer bigint NOT NULL DEFAULT 0;
CREATE TABLE IF NOT EXISTS ekit_entries (
    seq bigserial,
    run_id text NOT NULL,
    kind text NOT NULL,
    name text NOT NULL,
    value text NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
CREATE SEQUENCE IF NOT EXISTS ekit_run_writers;
"""
_PROBE = "ekit_run_writers"

_INSERT = (
    "INSERT INTO ekit_entries (run_id, kind, name, value) "
    "SELECT {source}, e.kind, e.name, e.value "
    "FROM {origin}unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS e(kind, name, value, ord) "
    "ORDER BY e.ord ON CONFLICT (run_id, kind, name) DO UPDATE SET value = excluded.value"
)

# A delta: the run row's counts, and the new entries only if that update
# matched, in one statement. {cond} is "saves" for a claim that extends what
# this store loaded (it takes a new epoch), "writer" for a save under the epoch held.
_DELTA = (
    "WITH run AS (UPDATE ekit_runs SET step_index = %s, input_tokens = %s, output_tokens = %s, "
    "llm_calls = %s, failures = %s, saves = saves + 1, writer = {writer}, updated_at = now() "
    "WHERE run_id = %s AND {cond} = %s RETURNING run_id, saves, writer), "
    "added AS (" + _INSERT.format(source="run.run_id", origin="run, ") + ") "
    "SELECT saves, writer FROM run"
)

# A compacting delta (keep_last): as _DELTA, and the header (its compacted
# counts) written again and the rows of the iterations let go of deleted, in
# the same statement. (Those names and the new entries' never meet: a
# statement's sub-statements must not change one row twice.)
_COMPACTING = (
    "WITH run AS (UPDATE ekit_runs SET header = %s, step_index = %s, input_tokens = %s, "
    "output_tokens = %s, llm_calls = %s, failures = %s, saves = saves + 1, writer = {writer}, "
    "updated_at = now() WHERE run_id = %s AND {cond} = %s RETURNING run_id, saves, writer), "
    "gone AS (DELETE FROM ekit_entries USING run WHERE ekit_entries.run_id = run.run_id "
    "AND ekit_entries.kind IN ('output', 'usage') AND ekit_entries.name = ANY(%s::text[])), "
    "added AS (" + _INSERT.format(source="run.run_id", origin="run, ") + ") "
    "SELECT saves, writer FROM run"
)

_COLUMNS = "header, step_index, input_tokens, output_tokens, llm_calls, failures"
# A full rewrite's run row, which also locks it for the rest of the transaction.
_CLAIM_ROW = (
    f"INSERT INTO ekit_runs (run_id, {_COLUMNS}, saves, writer) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, 1, nextval('ekit_run_writers')) ON CONFLICT (run_id) DO UPDATE SET "
    "header = excluded.header, step_index = excluded.step_index, "
    "input_tokens = excluded.input_tokens, output_tokens = excluded.output_tokens, "
    "llm_calls = excluded.llm_calls, failures = excluded.failures, "
    "saves = ekit_runs.saves + 1, writer = excluded.writer, updated_at = now() RETURNING saves, writer"
)
_FENCED_ROW = (
    "UPDATE ekit_runs SET header = %s, step_index = %s, input_tokens = %s, output_tokens = %s, "
    "llm_calls = %s, failures = %s, saves = saves + 1, updated_at = now() "
    "WHERE run_id = %s AND writer = %s RETURNING saves, writer"
)


def _pg_run_id(run_id: object, argument: str = "run_id") -> str:
    """``run_id`` if PostgreSQL can keep it as a key, else a ``ValueError`` naming ``argument``."""
    if not isinstance(run_id, str):
        raise ValueError(f"{argument} must be a string, got {type(run_id).__name__}")
    why = pg_text_problem(run_id)
    if why is not None:
        raise ValueError(f"{argument} {run_id!r} cannot be a PostgreSQL key: {why}")
    return run_id


class _Fenced(Exception):
    """The run row no longer carries this store's epoch; the transaction is rolled back."""


class PostgresStore(Store):
    """Keep the checkpoints of many runs, keyed by ``run_id``, in a PostgreSQL database.

    ``dsn`` is a libpq connection string or URL, or an open
    ``psycopg.Connection`` (switched to autocommit). Use as
    ``checkpoint_fn=store``; ``load(run_id=None)`` returns the latest
    checkpoint of that run (this store's by default) or ``None``; ``runs()``
    lists run ids; ``delete(run_id)`` forgets one. A save is one statement
    (or one transaction when the run is rewritten): a crash leaves the
    previous checkpoint or the new one. ``dumps``/``loads`` encode each
    output (strict JSON by default: NaN is refused both ways).

    One writer per run id, enforced by fencing: the first save of a store
    object claims the run, and from then on a save of any store object that
    claimed it before is refused with
    :class:`~ekit_runtime.stores.StoreLockedError`, writing nothing. So a
    new store object saving a run *takes it over*, deliberately: nothing is
    held between saves, and a crashed writer blocks nobody. :meth:`load`
    never claims. For many writers of many runs, use the run queue.

    PostgreSQL text holds no NUL character, and the store's keys at most
    1024 bytes of UTF-8 (``PG_KEY_BYTES``): a run id beyond that is refused
    when the store is made, a step name beyond it before the run's first
    step (:meth:`prepare_run`) or at the save, with a ``ValueError`` naming it.
    """

    def __init__(
        self,
        dsn: str | psycopg.Connection[Any],
        *,
        run_id: str,
        dumps: Dumps | None = None,
        loads: Loads | None = None,
    ) -> None:
        """Connect and create the store's tables if missing.

        Refuses a ``run_id`` PostgreSQL cannot keep (see above) before connecting.
        """
        self.run_id = _pg_run_id(check_run_id(run_id))
        self.dumps, self.loads = codec(dumps, loads)
        self.db = PgConnection(dsn, _SCHEMA, _PROBE)
        # What is stored for run_id, as this object last wrote or read it,
        # with the run row's save counter (0: no row) and each output's text.
        self._last: WorkflowCheckpoint | None = None
        self._saves = 0
        self._texts = OutputTexts()
        # The writer epoch this object claimed (None: not claimed yet), and
        # whether another writer has taken the run over since.
        self._epoch: int | None = None
        self._fenced = False

    def save(self, checkpoint: WorkflowCheckpoint) -> None:
        """Record ``checkpoint`` as the latest of this store's run; the first save claims the run.

        Raises ``UnencodableError`` (a ``ValueError`` naming the step) before
        anything is sent if an output cannot be encoded, and
        ``StoreLockedError``, writing nothing, once another store object has
        claimed the run (or deleted it) since this one did.
        """
        if self._fenced:
            raise self._refusal(None)
        previous = self._last if self._saves else None
        encoded = encode_checkpoint(checkpoint, previous, self.dumps, self._texts, engine="PostgreSQL",
                                    compacting=True)
        self._last = None  # unknown until the write commits
        row = None if encoded.full else self._delta(encoded)
        if row is None and self._epoch is not None and not encoded.full:
            self._fence()
        if row is None:
            full = encoded if encoded.full else encode_checkpoint(
                checkpoint, None, self.dumps, self._texts, engine="PostgreSQL"
            )
            row = self._full(full)
        self._last, (self._saves, self._epoch) = checkpoint, row

    __call__ = save

    def prepare_run(self, checkpoint: WorkflowCheckpoint) -> None:
        """Refuse now, before any step runs, a run whose saves PostgreSQL would reject.

        :meth:`Workflow.run <ekit_runtime.Workflow.run>` calls it with the
        checkpoint the run starts from: a step name, version tag, context
        value or recorded output that cannot be stored raises
        :class:`~ekit_runtime.stores.UnencodableError` naming it. Sends
        nothing and claims nothing: the first save still claims the run.
        """
        require_checkpoint(checkpoint)
        check_checkpoint_text(checkpoint, pg_text_problem)
        encode_checkpoint(checkpoint, None, self.dumps, self._texts, engine="PostgreSQL")

    def _delta(self, enc: EncodedCheckpoint) -> tuple[int, int] | None:
        """Add ``enc`` to the run in one statement; ``None`` if the run row's condition failed.

        Without an epoch this is a claim, conditional on the save counter
        this store loaded (else the run is rewritten whole, see :meth:`_full`).
        """
        kinds, names, values = ([r[i] for r in enc.rows] for i in range(3))
        template = _DELTA if enc.recount is None else _COMPACTING
        if self._epoch is None:
            sql = template.format(writer="nextval('ekit_run_writers')", cond="saves")
            expected = self._saves
        else:
            sql = template.format(writer="writer", cond="writer")
            expected = self._epoch
        args: tuple[Any, ...] = (*enc.counts, enc.failures, self.run_id, expected)
        if enc.recount is not None:
            args = (enc.recount, *args, list(enc.gone))
        args = (*args, kinds, names, values)
        row = self.db.run(lambda c: c.execute(sql, args).fetchone())
        return None if row is None else (int(row[0]), int(row[1]))

    def _full(self, enc: EncodedCheckpoint) -> tuple[int, int]:
        """Rewrite the run whole in one transaction: claiming it, or under this store's epoch.

        The run row is written first, which locks it: a concurrent claim
        waits for this transaction, and one that came first makes the
        fenced update match nothing, so the transaction is rolled back.
        """
        kinds, names, values = ([r[i] for r in enc.rows] for i in range(3))
        try:
            with self.db.transaction() as conn:
                if self._epoch is None:
                    cur = conn.execute(_CLAIM_ROW, (self.run_id, enc.header, *enc.counts, enc.failures))
                else:
                    args = (enc.header, *enc.counts, enc.failures, self.run_id, self._epoch)
                    cur = conn.execute(_FENCED_ROW, args)
                row = cur.fetchone()
                if row is None:
                    raise _Fenced
                conn.execute("DELETE FROM ekit_entries WHERE run_id = %s", (self.run_id,))
                conn.execute(_INSERT.format(source="%s", origin=""), (self.run_id, kinds, names, values))
        except _Fenced:
            self._fence()
        return int(row[0]), int(row[1])

    def _fence(self) -> NoReturn:
        """Refuse this save, and every later one: another writer claimed (or deleted) the run."""
        self._fenced = True
        found = self.db.run(
            lambda c: c.execute("SELECT writer FROM ekit_runs WHERE run_id = %s", (self.run_id,)).fetchone()
        )
        raise self._refusal(None if found is None else int(found[0]))

    def _refusal(self, epoch: int | None) -> StoreLockedError:
        now = "deleted" if epoch is None else f"claimed by another writer (epoch {epoch})"
        return StoreLockedError(
            "postgresql",
            f"the run was {now} after this store claimed it (epoch {self._epoch}); one writer "
            "per run id, so nothing was saved, and this store object will save nothing more. "
            "To take the run back, make a new PostgresStore, load() and save: that fences the other",
            run_id=self.run_id,
        )

    def load(self, run_id: str | None = None) -> WorkflowCheckpoint | None:
        """The latest checkpoint of ``run_id`` (default: this store's), or ``None``."""
        run = self.run_id if run_id is None else _pg_run_id(run_id)
        with self.db.transaction(snapshot=True) as conn:
            row = conn.execute(
                "SELECT header, step_index, input_tokens, output_tokens, llm_calls, failures, saves "
                "FROM ekit_runs WHERE run_id = %s",
                (run,),
            ).fetchone()
            entries = conn.execute(
                "SELECT kind, name, value FROM ekit_entries WHERE run_id = %s ORDER BY seq", (run,)
            ).fetchall()
        own = run == self.run_id
        if row is None:
            if own:
                self._last, self._saves = None, 0
                self._texts.clear()
            return None
        checkpoint = decode_checkpoint(
            row[0], tuple(row[1:5]), row[5], entries, self.loads, f"postgresql run {run!r}",
            self._texts if own else None,
        )
        if own:
            # Only what is stored is learnt: the epoch (claimed or not) stays as it was.
            self._last, self._saves = checkpoint, int(row[6])
        return checkpoint

    def runs(self) -> list[str]:
        """The run ids that have a saved checkpoint, sorted."""
        rows = self.db.run(lambda c: c.execute("SELECT run_id FROM ekit_runs ORDER BY run_id").fetchall())
        return [r[0] for r in rows]

    def delete(self, run_id: str) -> bool:
        """Forget every checkpoint of ``run_id``; ``True`` if there was one.

        Whoever writes that run is refused at its next save (its epoch is
        gone with the row). Deleting this store's own run starts it afresh:
        its next save claims the run again.
        """
        _pg_run_id(run_id)
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM ekit_entries WHERE run_id = %s", (run_id,))
            found = conn.execute("DELETE FROM ekit_runs WHERE run_id = %s", (run_id,)).rowcount > 0
        if run_id == self.run_id:
            self._last, self._saves, self._epoch, self._fenced = None, 0, None, False
            self._texts.clear()
        return found

    def close(self) -> None:
        """Close the connection."""
        self.db.close()

    def __repr__(self) -> str:
        return f"PostgresStore(run_id={self.run_id!r})"

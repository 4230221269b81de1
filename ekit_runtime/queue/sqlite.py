"""``SqliteQueue``: the embedded run queue, for several worker processes on one machine.

This module owns the queue's SQLite schema. ``ekit_queue_runs`` holds one row
per run: what was submitted, its status, its lease (``epoch``, the fencing
token, and ``lease_until``) and the counts of its latest checkpoint, the
small columns a save rewrites; ``ekit_queue_headers`` (keyed by the run's
``seq``) the large ones written once or rarely: the context it was submitted
with and its checkpoint's header (graph, versions, questions).
``ekit_queue_entries`` holds one row per recorded output, per-step usage and
skipped step (kind ``skip``), tagged with the epoch that wrote it, in a
``WITHOUT ROWID`` table keyed by (run, kind, name), with ``ord`` keeping the
order they were written in. The usual save, a step's output alone, writes
its entry and nothing else: the entry carries the run's counts as of that
save (``saved``, its number), so that the save fences by reading the run's
row and writes one page of the log, as one insert does (decision 015).
``ekit_queue_starts`` and
``ekit_queue_usage`` are the trailing windows the rate limits count, and
``ekit_queue_config`` holds the fleet's :class:`Limits`.

Every write is one ``BEGIN IMMEDIATE`` transaction, so SQLite's write lock
serialises claims, saves and renewals across processes: the fencing check
(``epoch = ? AND lease_until > now``) and the write it guards commit together
or not at all. Reads take a deferred transaction (one WAL snapshot, no lock).
A transaction that meets another process's lock waits for it in naps of a
fraction of a millisecond (not SQLite's busy handler, which sleeps 1 ms and
more), for up to 60 s.
The clock is the machine's (``time.time()``), shared by every process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime.queue.base import (
    Ending,
    More,
    Prepared,
    RunQueue,
    Submission,
    Writes,
    Written,
    layout_before,
    progress,
    schema_columns,
    schema_problem,
)
from ekit_runtime.queue.lifecycle import (
    CLAIM_ORDER,
    CLAIMABLE,
    FINAL,
    GRAPH_CHANGE_MARK,
    HELD,
    MATCHES,
    REOPENED_AS,
    UNCHANGED,
    render,
)
from ekit_runtime.queue.links import NOT_A_KEPT_CHILD, SQLITE_LINKS, sqlite_close_children
from ekit_runtime.queue.records import (
    Lease,
    LeaseLostError,
    Limits,
    QueueUnavailableError,
    RunInfo,
    RunStatus,
)
from ekit_runtime.queue.streams import Published
from ekit_runtime.queue.transient import is_transient
from ekit_runtime.stores.codec import Dumps, Loads
from ekit_runtime.stores.errors import CorruptStoreError
from ekit_runtime.stores.rows import EncodedCheckpoint

__all__ = ["SqliteQueue"]

T = TypeVar("T")

# How long a transaction waits for another process's lock before it fails
# with "database is locked" (a transient error the worker waits out).
_BUSY_TIMEOUT = 60.0
# SQLite's own busy handler sleeps 1 ms, then 2, 5, 10 ... while the write
# lock is held for a fraction of a millisecond (a commit and its fsync), so
# two workers spent more time asleep than writing. The queue waits itself
# instead, in naps that start at 0.1 ms and double up to 2 ms (20 ms once it
# has waited a second: a holder that is paused is not polled hard), each
# jittered so that waiters do not wake in step.
_NAP_FIRST = 0.0001
_NAP_MAX = 0.002
_NAP_MAX_LONG = 0.02
_nap = time.sleep  # (tests watch the naps through this name)
# RETURNING (one statement for the fenced write and the cancel flag) is SQLite 3.35's.
_RETURNING = sqlite3.sqlite_version_info >= (3, 35, 0)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_queue_runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL UNIQUE,
    workflow TEXT NOT NULL,
    priority INTEGER NOT NULL,
    status TEXT NOT NULL,
    epoch INTEGER NOT NULL DEFAULT 0,
    owner TEXT,
    lease_until REAL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    fingerprint TEXT,
    step_index INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    llm_calls INTEGER NOT NULL DEFAULT 0,
    failures TEXT NOT NULL DEFAULT '{}',
    counted INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    options TEXT NOT NULL DEFAULT '{}',
    steps_done INTEGER NOT NULL DEFAULT 0,
    steps_total INTEGER,
    reason TEXT
);
CREATE INDEX IF NOT EXISTS ekit_queue_runs_claim ON ekit_queue_runs (status, priority DESC, seq);
CREATE TABLE IF NOT EXISTS ekit_queue_headers (
    seq INTEGER PRIMARY KEY,
    context TEXT NOT NULL,
    header TEXT
);
CREATE TABLE IF NOT EXISTS ekit_queue_entries (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    value TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    ord INTEGER NOT NULL,
    saved INTEGER,
    step_index INTEGER,
    input_tokens INTEGER,
    output_tokens INTEGER,
    llm_calls INTEGER,
    failures TEXT,
    steps_done INTEGER,
    steps_total INTEGER,
    PRIMARY KEY (run_id, kind, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS ekit_queue_starts (at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ekit_queue_usage (
    at REAL NOT NULL, llm_calls INTEGER NOT NULL, tokens INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS ekit_queue_config (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS ekit_queue_slots (
    resource TEXT NOT NULL, holder TEXT NOT NULL, run_id TEXT NOT NULL, epoch INTEGER NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ekit_queue_slots_resource ON ekit_queue_slots (resource);
CREATE TABLE IF NOT EXISTS ekit_queue_workers (
    name TEXT PRIMARY KEY, workflows TEXT NOT NULL, last_seen REAL NOT NULL, until REAL NOT NULL,
    doing TEXT
);
"""

_COLUMNS = schema_columns(_SCHEMA)

# Each run's live stream (ekit_runtime.queue.streams): kept out of _SCHEMA,
# whose tables are the layout an upgrade checks and rebuilds. A file of any
# layout gains it on open (IF NOT EXISTS), and a process of an earlier
# release ignores it; prune deletes a run's rows with the run.
_STREAM_TABLE = """CREATE TABLE IF NOT EXISTS ekit_queue_stream (
    run_id TEXT NOT NULL, pos INTEGER NOT NULL, kind TEXT NOT NULL, step TEXT, data TEXT NOT NULL,
    epoch INTEGER NOT NULL, at REAL NOT NULL, PRIMARY KEY (run_id, pos)
) WITHOUT ROWID"""


def _statement(start: str) -> str:
    """The statement of ``_SCHEMA`` that begins with ``start``."""
    return next(s.strip() for s in _SCHEMA.split(";") if s.strip().startswith(start.strip()))


# The layout before this one (the previous release's): every save rewrote
# the run's row, which counted them (``saves``, the high bits of ``ord``),
# and an entry held its output alone.
_COUNTED_IN_ENTRIES = {
    "saved": "INTEGER", "step_index": "INTEGER", "input_tokens": "INTEGER", "output_tokens": "INTEGER",
    "llm_calls": "INTEGER", "failures": "TEXT", "steps_done": "INTEGER", "steps_total": "INTEGER",
}
_PREVIOUS = {
    **_COLUMNS,
    "ekit_queue_runs": _COLUMNS["ekit_queue_runs"] - {"counted"} | {"saves"},
    "ekit_queue_entries": _COLUMNS["ekit_queue_entries"] - set(_COUNTED_IN_ENTRIES),
}
# The one before it: the run's context and header lived in its row of
# ekit_queue_runs, so every save rewrote them, and ekit_queue_entries was a
# rowid table beside an index of its key (a save's commit wrote three pages
# of the log where one insert writes one).
_BEFORE_PREVIOUS = {
    **{t: c for t, c in _PREVIOUS.items() if t != "ekit_queue_headers"},
    "ekit_queue_runs": _PREVIOUS["ekit_queue_runs"] | {"context", "header"},
    "ekit_queue_entries": _PREVIOUS["ekit_queue_entries"] - {"ord"},
    "ekit_queue_workers": _PREVIOUS["ekit_queue_workers"] - {"doing"},
}
# What that layout had added to the one before it (those columns have
# defaults here, so a table of either is copied into this layout alike).
_ADDED = {
    "ekit_queue_runs": {
        "options": "TEXT NOT NULL DEFAULT '{}'",
        "steps_done": "INTEGER NOT NULL DEFAULT 0",
        "steps_total": "INTEGER",
        "reason": "TEXT",
    },
}
# Columns this layout added to a table an upgrade keeps as it is (ALTER TABLE
# ... ADD COLUMN): what a worker runs now, told with its announcements.
_KEPT_GAIN = {"ekit_queue_workers": {"doing": "TEXT"}}
# The views (with their triggers) of the layouts before this one.
_EARLIER_VIEWS = ("ekit_queue_save", "ekit_queue_saves", "ekit_queue_writes", "ekit_queue_steps")
# The oldest layout a database may hold and still be brought up to date on
# open (or any between it and _PREVIOUS).
_OLDEST = layout_before(_BEFORE_PREVIOUS, _ADDED, ("ekit_queue_workers", "ekit_queue_slots"))
# One save's entries sort after every entry written before it: ord is the
# save's number (see SqliteQueue._number) shifted past the entries one save
# may write, plus the entry's place in that save.
_ORD_SHIFT = 32

# A row written again (a save retried after its commit was not known to
# succeed) keeps its place (ord), as a rowid table's row kept its rowid.
_UPSERT_ENTRY = (
    "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord) VALUES (?, ?, ?, ?, ?, ?) "
    "ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch"
)

_INFO = (
    "run_id, workflow, status, priority, epoch, owner, lease_until, cancel_requested, "
    "error, created_at, updated_at, fingerprint, "
    "options, steps_done, steps_total, input_tokens, output_tokens, llm_calls, reason"
)
# RunInfo's columns read from the run's row or, newer, from its entry with
# the highest ``saved`` (see _STEP_PROCEDURES): the one picked by
# _NEWEST_ENTRY (by key, so that two entries of one number could not give a
# run two rows). Only a running run is looked up: every write that takes a
# run out of ``running`` folds its newest counts into its row (_FOLD), so a
# listing of finished runs reads no entries. (A running run's lookup reads
# its entries, without an index: one on (run, saved) would be a second page
# in every save.)
_COUNTED_INFO = {"steps_done", "steps_total", "input_tokens", "output_tokens", "llm_calls"}
_INFO_NEWEST = ", ".join(
    f"CASE WHEN e.saved IS NULL THEN r.{c} ELSE e.{c} END" if c in _COUNTED_INFO else f"r.{c}"
    for c in _INFO.split(", ")
)
_NEWEST_ENTRY = (
    "CASE WHEN status = 'running' THEN (SELECT x.{column} FROM ekit_queue_entries AS x "
    "WHERE x.run_id = ekit_queue_runs.run_id AND x.saved IS NOT NULL "
    "ORDER BY x.saved DESC, x.kind, x.name LIMIT 1) END AS newest_{column}"
)


def _info_select(tail: str, order: str = "ASC") -> str:
    """The SELECT of ``_INFO`` of the runs ``... FROM ekit_queue_runs {tail}`` picks, in ``seq`` order."""
    return (
        f"SELECT {_INFO_NEWEST} FROM (SELECT *, {_NEWEST_ENTRY.format(column='kind')}, "
        f"{_NEWEST_ENTRY.format(column='name')} FROM ekit_queue_runs {tail}) AS r "
        "LEFT JOIN ekit_queue_entries AS e ON e.run_id = r.run_id AND e.kind = r.newest_kind "
        f"AND e.name = r.newest_name AND e.saved > r.counted ORDER BY r.seq {order}"
    )


# The lifecycle's named placeholders in SQLite's terms: every one a parameter,
# the clock too (the machine's, time.time(), shared by every process).
_DIALECT = {
    "now": "?", "since": "?", "run_id": "?", "epoch": "?", "workflow": "?", "fingerprint": "?",
    "graph_change": f"instr(options, '{GRAPH_CHANGE_MARK}') > 0",
}
_HELD = render(HELD, _DIALECT)  # args: run_id, epoch, now
_CLAIMABLE = render(CLAIMABLE, _DIALECT)  # args: now
_MATCHES = render(MATCHES, _DIALECT)  # args: workflow, fingerprint
_UNCHANGED = render(UNCHANGED, _DIALECT)  # args: run_id, epoch, now
_COUNTS = "step_index = ?, input_tokens = ?, output_tokens = ?, llm_calls = ?, failures = ?"
# What a write that takes a run out of ``running`` sets besides (an ending, a
# release, a park, a cancel, a sweep of abandoned runs): the counts of the
# run's newest entry into its row, when newer than the row's, so that a
# reader of a run that is not running finds them in the row alone (see
# _info_select). One scan of the run's entries, once per run's ending.
_FOLDED = ("step_index", "input_tokens", "output_tokens", "llm_calls", "failures", "steps_done")
_FOLD = (
    f"({', '.join(_FOLDED)}, steps_total, counted) = (SELECT "
    + ", ".join(f"coalesce(e.{c}, ekit_queue_runs.{c})" for c in _FOLDED)
    + ", e.steps_total, e.saved FROM ekit_queue_entries AS e WHERE e.run_id = ekit_queue_runs.run_id "
    "AND e.saved > ekit_queue_runs.counted UNION ALL SELECT "
    + ", ".join(f"ekit_queue_runs.{c}" for c in (*_FOLDED, "steps_total", "counted"))
    + f" ORDER BY {len(_FOLDED) + 2} DESC LIMIT 1)"
)

# A save's fenced UPDATE (args: the counts, failures, progress, [fingerprint,]
# the save's number, lease_until, updated_at, then _HELD's): the fence, the
# renewal and the cancel flag in one statement (RETURNING), so that a save of
# one step is this UPDATE and one INSERT. (Where SQLite lacks what the views
# below need: every save then writes the run's row.)
_SAVE_SETS = f"{_COUNTS}, steps_done = ?, steps_total = ?, "
_SAVE_TAIL = f"counted = ?, lease_until = ?, updated_at = ? WHERE {_HELD}"
_SAVE = f"UPDATE ekit_queue_runs SET {_SAVE_SETS}{_SAVE_TAIL}"
_SAVE_FULL = f"UPDATE ekit_queue_runs SET {_SAVE_SETS}fingerprint = ?, {_SAVE_TAIL}"

# A worker's writes as ONE statement: an insert into the view
# ekit_queue_writes_v2 of one row per save or per run ending (one run each),
# whose triggers do each row's fenced write. A save's row runs its fenced
# UPDATE and, if it matched, writes the entries (the first in the row's
# kind, name and value, the others as a JSON array of [kind, name, value])
# and the usage; a save in full (``header`` not NULL) also replaces the
# header and the entries. An ending's row (``status`` not NULL) is finish's
# fenced UPDATE. A worker commits the writes of its runs that meet together
# this way (see ekit_runtime.queue.group_commit): one statement, one commit,
# one fsync for all of them.
#
# Why one statement: SQLite's write lock is held from a transaction's first
# write to the end of its commit. With BEGIN IMMEDIATE, UPDATE, INSERT, COMMIT,
# the thread holding it gives up the GIL inside each statement and must win it
# back between them, so a worker whose event loop is busy kept the lock for two
# to three times the statements' own time, and a second worker mostly waited.
# One autocommit statement takes the lock, writes, commits and lets go of it
# inside one call into SQLite, with the GIL released throughout.
#
# Why a trigger for each kind of row (WHEN): an ending runs finish's UPDATE
# and nothing of a save's, and a save of a run's next step (the usual row)
# none of a save in full's statements. Its first entry is read from the
# row's columns rather than parsed out of JSON, which spares the Python side
# encoding it. (Measured with synchronous=OFF, so CPU only: the statement of
# one such save costs about 17 us, a bare insert of its entry in a
# transaction of its own 8 us; each statement a trigger skips by its WHERE
# still costs about half a microsecond, and each trigger whose WHEN is
# false, about as much.)
#
# What each write did comes back through RETURNING, which returns the rows
# whose trigger did not end with RAISE(IGNORE): a save made on a run with no
# cancel asked, and an ending made, are ignored once written, so that the
# usual batch returns nothing and ends in its first step. The rows returned
# are the refused writes (``cancel`` NULL: the lease is not held, nothing was
# written for them) and the saves made on runs asked to cancel (``cancel`` 1).
#
# A trigger's body is part of the layout, as IF NOT EXISTS keeps whatever
# body a file has, and so is its view's name: a change to either is a new
# view (a new ``_vN``). The upgrade to this layout drops the views of the
# layouts before and their triggers. The names must change with the layout,
# not only the triggers': a process of an earlier release that opens a file
# of this layout refuses it, but only after creating its own views and
# triggers where missing (IF NOT EXISTS); a trigger of its own on a view of
# this name would fire on every insert into it and fail ("no such column:
# saves"). Under new names its views sit unused, never dropped (no process
# of this version writes through them; tests/queue/test_queue_schema_upgrade.py).
_HELD_NEW = render(HELD, {"run_id": "NEW.run_id", "epoch": "NEW.epoch", "now": "NEW.now"})
# Whether the row's fenced UPDATE matched: it set lease_until to NEW.lease_until,
# later than NEW.now, which no refused row can hold under NEW.epoch.
_MADE = (
    "EXISTS (SELECT 1 FROM ekit_queue_runs WHERE run_id = NEW.run_id AND epoch = NEW.epoch "
    "AND status = 'running' AND lease_until = NEW.lease_until{more})"
)
_WRITE_COLUMNS = (
    "run_id", "epoch", "now", "lease_until", "step_index", "input_tokens", "output_tokens", "llm_calls",
    "failures", "steps_done", "steps_total", "saved", "kind", "name", "value", "entries", "calls",
    "tokens", "fingerprint", "header", "status", "error",
)
_SAVE_RUN = f"""UPDATE ekit_queue_runs SET step_index = NEW.step_index, input_tokens = NEW.input_tokens,
        output_tokens = NEW.output_tokens, llm_calls = NEW.llm_calls, failures = NEW.failures,
        steps_done = NEW.steps_done, steps_total = NEW.steps_total, counted = NEW.saved,
        {{fingerprint}}lease_until = NEW.lease_until, updated_at = NEW.now
        WHERE {_HELD_NEW};"""
# The entries' order (``ord``): the save's number, then the place in the save.
_SAVE_ENTRIES = f"""INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, NEW.kind, NEW.name, NEW.value, NEW.epoch, NEW.saved << {_ORD_SHIFT}
        FROM ekit_queue_runs WHERE NEW.name IS NOT NULL AND run_id = NEW.run_id AND epoch = NEW.epoch
        AND status = 'running' AND lease_until = NEW.lease_until
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch;
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'),
            json_extract(e.value, '$[2]'), NEW.epoch,
            (NEW.saved << {_ORD_SHIFT}) + e.key + 1
        FROM json_each(NEW.entries) AS e WHERE NEW.entries IS NOT NULL AND {_MADE.format(more="")}
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch;
    INSERT INTO ekit_queue_usage (at, llm_calls, tokens)
        SELECT NEW.now, NEW.calls, NEW.tokens WHERE NEW.calls IS NOT NULL AND {_MADE.format(more="")};
    SELECT RAISE(IGNORE) WHERE {_MADE.format(more=" AND NOT cancel_requested")};"""
_PROCEDURES = f"""
CREATE VIEW IF NOT EXISTS ekit_queue_writes_v2 AS SELECT
    {", ".join(f"NULL AS {c}" for c in _WRITE_COLUMNS)} WHERE 0;
CREATE TRIGGER IF NOT EXISTS ekit_queue_writes_v2_delta INSTEAD OF INSERT ON ekit_queue_writes_v2
WHEN NEW.status IS NULL AND NEW.header IS NULL BEGIN
    {_SAVE_RUN.format(fingerprint="")}
    {_SAVE_ENTRIES}
END;
CREATE TRIGGER IF NOT EXISTS ekit_queue_writes_v2_full INSTEAD OF INSERT ON ekit_queue_writes_v2
WHEN NEW.status IS NULL AND NEW.header IS NOT NULL BEGIN
    {_SAVE_RUN.format(fingerprint="fingerprint = NEW.fingerprint, ")}
    UPDATE ekit_queue_headers SET header = NEW.header
        WHERE {_MADE.format(more="")} AND seq = (SELECT seq FROM ekit_queue_runs WHERE run_id = NEW.run_id);
    DELETE FROM ekit_queue_entries WHERE run_id = NEW.run_id AND {_MADE.format(more="")};
    {_SAVE_ENTRIES}
END;
CREATE TRIGGER IF NOT EXISTS ekit_queue_writes_v2_end INSTEAD OF INSERT ON ekit_queue_writes_v2
WHEN NEW.status IS NOT NULL BEGIN
    UPDATE ekit_queue_runs SET status = NEW.status, error = NEW.error, lease_until = NULL,
        updated_at = NEW.now, {_FOLD} WHERE {_HELD_NEW};
    SELECT RAISE(IGNORE) WHERE changes() = 1;
END;
"""

# The usual save, a step's output and nothing more (one entry, no usage row,
# the header as stored), has a view of its own: ``ekit_queue_steps_v2``, whose
# one trigger writes the entry and nothing else (decision 015). The entry
# carries the run's counts and progress as of this save, and ``saved``, the
# save's number: a reader takes the counts of the entry with the highest
# number when it is above the run's ``counted`` (the number of the last save
# that wrote them into the run's row), and the row's otherwise. The fence is
# a read of the run's row, so the save writes one page of the log, as one
# insert does. The lease is not renewed by every save, but only when less
# than half of it is left (a worker renews it every heartbeat, so this is
# rare): a made save leaves at least half the lease ahead.
#
# Why not write the row every time: the row's page is a second page in the
# log, and its write was most of what a save cost beyond an insert of its
# entry (the statement alone, durable, beside an insert: 1.13-1.15x with the
# row written, 1.07-1.09x with this trigger). Why the counts ride on the
# entry: they change with every save, and a reader must see them without
# decoding. A statement of such saves alone goes there; any other goes to
# ekit_queue_writes_v2, which writes the run's row (counted = the save's
# number) and entries without counts.
_STEP_COLUMNS = (
    "run_id", "epoch", "now", "lease_until", "step_index", "input_tokens", "output_tokens", "llm_calls",
    "failures", "steps_done", "steps_total", "saved", "kind", "name", "value",
)
_STEP_SAVED = _STEP_COLUMNS.index("saved")
_ENTRY_COUNTS = (
    "step_index", "input_tokens", "output_tokens", "llm_calls", "failures", "steps_done", "steps_total",
)
_STEP_PROCEDURES = f"""
CREATE VIEW IF NOT EXISTS ekit_queue_steps_v2 AS SELECT
    {", ".join(f"NULL AS {c}" for c in _STEP_COLUMNS)} WHERE 0;
CREATE TRIGGER IF NOT EXISTS ekit_queue_steps_v2_entry INSTEAD OF INSERT ON ekit_queue_steps_v2 BEGIN
    UPDATE ekit_queue_runs SET lease_until = NEW.lease_until, updated_at = NEW.now
        WHERE {_HELD_NEW} AND lease_until < (NEW.now + NEW.lease_until) / 2;
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord, saved, {", ".join(_ENTRY_COUNTS)})
        SELECT NEW.run_id, NEW.kind, NEW.name, NEW.value, NEW.epoch, NEW.saved << {_ORD_SHIFT}, NEW.saved,
            {", ".join(f"NEW.{c}" for c in _ENTRY_COUNTS)}
        FROM ekit_queue_runs WHERE {_HELD_NEW}
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch,
            saved = excluded.saved, {", ".join(f"{c} = excluded.{c}" for c in _ENTRY_COUNTS)};
    SELECT RAISE(IGNORE) WHERE changes() = 1
        AND NOT (SELECT cancel_requested FROM ekit_queue_runs WHERE run_id = NEW.run_id);
END;
"""
_PROCEDURES += _STEP_PROCEDURES
# At most this many rows per statement (each binds 21 values; SQLite allows
# 32,766 since 3.32, and RETURNING, which this needs, came in 3.35).
_WRITES_PER_STATEMENT = 60


def _insert_statement(view: str, columns: tuple[str, ...], count: int, made: str) -> str:
    """The one insert of ``count`` rows into ``view``, returning what each write did (see ``_PROCEDURES``).

    ``made``: the condition on the run's row ``r`` that holds after a made write of the row.
    """
    row = f"({', '.join('?' * len(columns))})"
    return (
        f"INSERT INTO {view} ({', '.join(columns)}) VALUES " + ", ".join([row] * count)
        + f" RETURNING run_id, (SELECT r.cancel_requested FROM ekit_queue_runs AS r WHERE "
        f"r.run_id = {view}.run_id AND r.epoch = {view}.epoch AND {made.format(view=view)})"
    )


@functools.cache
def _writes_statement(count: int) -> str:
    """The one statement of ``count`` writes (see ``_PROCEDURES``)."""
    # (Its fenced UPDATE set lease_until to the row's, which no refused row can hold.)
    return _insert_statement(
        "ekit_queue_writes_v2", _WRITE_COLUMNS, count, "r.lease_until = {view}.lease_until"
    )


@functools.cache
def _steps_statement(count: int) -> str:
    """The one statement of ``count`` saves of a step's output alone (see ``_STEP_COLUMNS``)."""
    # (It renews rarely: the fence itself, as the trigger read it.)
    return _insert_statement(
        "ekit_queue_steps_v2", _STEP_COLUMNS, count, "r.status = 'running' AND r.lease_until > {view}.now"
    )


# A row of the statement: a save ready to be written, or an ending (its error as stored).
_Row = Prepared | Ending
# The entries after a save's first travel as one JSON text; json_extract gives
# back every string exactly, except that it stops at a NUL character, which
# no stored text holds (the queue refuses one before it writes: see
# RunQueue._encode).
_ENTRIES = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode
_NO_ENTRY = (None, None, None)
# An ending's columns between lease_until and status.
_NO_ROW = (None,) * (len(_WRITE_COLUMNS) - 6)


# Per database file (device, inode): each run's (epoch, number of its last
# save) under the leases held in this process (see SqliteQueue._number).
_NUMBERS: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
_NUMBERS_LOCK = threading.Lock()


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
    save_renews = 0.5  # (see _STEP_PROCEDURES)
    # Whether saves are one statement (``_PROCEDURES``): this SQLite has JSON functions and RETURNING.
    _one_statement = False

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
        self._durable = durable
        try:
            self.conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT
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
        # The save numbers of the runs this process holds leases on in this
        # file, shared by every queue object open on it (see _number).
        try:
            stat = os.stat(self.path)
            self._numbers = _NUMBERS.setdefault((stat.st_dev, stat.st_ino), {})
        except OSError:  # (not a file: this object's own)
            self._numbers = {}
        if limits is not None:
            self.set_limits(limits)

    def _open(self, durable: bool) -> None:
        """Configure the connection, create the tables if missing and check they are the queue's.

        A database of an earlier layout (see ``_PREVIOUS``, ``_OLDEST``) is
        brought up to date in one transaction, by whichever process opens it
        first: the others wait for its lock and then find nothing to do.
        """
        conn = self.conn
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        if self._earlier(self._found(conn)):
            self._tx(self._upgrade)
        else:
            conn.executescript(_SCHEMA)
        conn.execute(_STREAM_TABLE)
        conn.executescript(SQLITE_LINKS)  # (child runs: their links and the durable join's trigger)
        # A parent's early end cancels its children, whose ends cancel theirs: the close trigger
        # fires itself down the tree, which SQLite allows only when asked.
        conn.execute("PRAGMA recursive_triggers = ON")
        conn.executescript(sqlite_close_children(f", {_FOLD}"))
        self._one_statement = _RETURNING and self._json_functions(conn)
        if self._one_statement:
            conn.executescript(_PROCEDURES)
        found = self._found(conn)
        problem = schema_problem(_COLUMNS, found)
        if found["ekit_queue_runs"] & {"context", "saves"}:
            # (An earlier layout's runs beside tables that are not that layout's.)
            problem = (
                "table ekit_queue_runs is of an earlier layout than the other tables; use another database"
            )
        if problem is not None:
            raise CorruptStoreError(self.path, problem)
        # Opened: from here on, :meth:`_tx` waits for locks itself (see _NAP_FIRST).
        conn.execute("PRAGMA busy_timeout = 0")

    @staticmethod
    def _json_functions(conn: sqlite3.Connection) -> bool:
        """Whether this SQLite has its JSON functions (built in since 3.38, an option before)."""
        try:
            return bool(conn.execute("SELECT json_extract('[1]', '$[0]') = 1").fetchone()[0])
        except sqlite3.OperationalError:
            return False

    @staticmethod
    def _found(conn: sqlite3.Connection) -> dict[str, set[str]]:
        return {table: {row[1] for row in conn.execute(f"PRAGMA table_info({table})")} for table in _COLUMNS}

    @staticmethod
    def _earlier(found: dict[str, set[str]]) -> bool:
        """Whether ``found`` is a queue of an earlier layout (which :meth:`_upgrade` brings up to date)."""
        runs, entries = found["ekit_queue_runs"], found["ekit_queue_entries"]
        old = schema_problem(_OLDEST, found) is None or schema_problem(_PREVIOUS, found) is None
        return old and ("header" in runs or "ord" not in entries or "counted" not in runs)

    def _upgrade(self, conn: sqlite3.Connection) -> bool:
        """Bring a queue of an earlier layout up to date, under the write lock; whether it had to.

        The layout is read again under the lock: another process may have
        upgraded the file meanwhile. Every run keeps its row (and ``seq``),
        its entries (and their order), its counts and its lease; the tables
        this layout added are created. The views of earlier layouts are
        dropped (with their triggers): no process of those versions opens a
        file of this layout, as its runs lack ``saves``.
        """
        found = self._found(conn)
        if not self._earlier(found):
            return False
        if found["ekit_queue_workers"]:
            self._refuse_while_served(conn)
        for view in _EARLIER_VIEWS:
            conn.execute(f"DROP VIEW IF EXISTS {view}")
        rebuilt = ("ekit_queue_runs", "ekit_queue_entries")
        for statement in _SCHEMA.split(";"):
            if statement.strip() and not any(table in statement for table in rebuilt):
                conn.execute(statement)  # the tables this layout added (IF NOT EXISTS)
        for table, columns in _KEPT_GAIN.items():
            for name, kind in columns.items():
                if found[table] and name not in found[table]:  # (a table just created has it)
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        # ekit_queue_runs without the context and header, which move to
        # ekit_queue_headers, and with the number of the last save that
        # wrote its counts (every save did, as the save count).
        (sequence,) = conn.execute(
            "SELECT coalesce(max(seq), 0) FROM sqlite_sequence WHERE name = 'ekit_queue_runs'"
        ).fetchone()
        if "header" in found["ekit_queue_runs"]:
            conn.execute(
                "INSERT INTO ekit_queue_headers (seq, context, header) SELECT seq, context, header "
                "FROM ekit_queue_runs"
            )
        self._rebuild(conn, "ekit_queue_runs", found, {"counted": "saves"})
        conn.execute(
            "UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'ekit_queue_runs'", (sequence,)
        )
        conn.execute(_statement("CREATE INDEX IF NOT EXISTS ekit_queue_runs_claim"))
        if "ord" in found["ekit_queue_entries"]:
            # The entries as they are, with room for counts (none: the runs' rows have them).
            for name, kind in _COUNTED_IN_ENTRIES.items():
                conn.execute(f"ALTER TABLE ekit_queue_entries ADD COLUMN {name} {kind}")
        else:
            # ekit_queue_entries keyed by (run, kind, name) alone, each entry's ord its place in the run.
            ordinal = "row_number() OVER (PARTITION BY run_id ORDER BY rowid) - 1"  # (SQLite 3.25)
            self._rebuild(conn, "ekit_queue_entries", found, {"ord": ordinal})
        return True

    def _refuse_while_served(self, conn: sqlite3.Connection) -> None:
        """Refuse to upgrade while workers (of the earlier release) are announced live.

        They would go on claiming on the upgraded file and fail every run at
        its first save (the hostile review saw 266 runs of 300 fail so).
        """
        live = [
            name for (name,) in conn.execute(
                "SELECT name FROM ekit_queue_workers WHERE until > ? ORDER BY name", (time.time(),)
            )
        ]
        if live:
            raise QueueUnavailableError(
                self.path,
                f"{len(live)} worker(s) of an earlier ekit release still serve this queue "
                f"({', '.join(repr(n) for n in live[:5])}{', ...' if len(live) > 5 else ''}); this "
                "version must upgrade the file's layout, which they cannot use: stop them, then "
                "open it again (a worker that died is forgotten once its announcement runs out)",
            )

    @staticmethod
    def _rebuild(
        conn: sqlite3.Connection, table: str, found: dict[str, set[str]], computed: dict[str, str]
    ) -> None:
        """Make ``table`` anew in this layout, copying the columns both have and ``computed`` ones."""
        columns = sorted(_COLUMNS[table] & found[table])
        made = {**{c: c for c in columns}, **computed}
        conn.execute(_statement(f"CREATE TABLE IF NOT EXISTS {table} ").replace(table, f"{table}_new", 1))
        conn.execute(
            f"INSERT INTO {table}_new ({', '.join(made)}) SELECT {', '.join(made.values())} FROM {table}"
        )
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"ALTER TABLE {table}_new RENAME TO {table}")

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

    def _tx(self, body: Callable[[sqlite3.Connection], T], *, write: bool = True, begin: bool = True) -> T:
        """Run ``body`` in one transaction (``BEGIN IMMEDIATE`` to write); roll back on any error.

        ``begin=False``: ``body`` is one statement, its own transaction.

        A transaction that meets another process's lock (``SQLITE_BUSY``) is
        rolled back and run again after a short nap, for up to
        ``_BUSY_TIMEOUT`` seconds; then the "database is locked" error is
        raised. Every ``body`` only reads and writes the database, so running
        it again is safe.
        """
        with self._lock:
            began: float | None = None
            nap = _NAP_FIRST
            while True:
                try:
                    return self._attempt(body, write) if begin else self._alone(body)
                except sqlite3.OperationalError as exc:
                    code = getattr(exc, "sqlite_errorcode", None)
                    if not isinstance(code, int) or code & 0xFF != sqlite3.SQLITE_BUSY:
                        raise
                    now = time.monotonic()
                    began = now if began is None else began
                    if now - began >= _BUSY_TIMEOUT:
                        raise
                _nap(nap * random.uniform(0.5, 1.5))
                nap = min(nap * 2, _NAP_MAX if now - began < 1.0 else _NAP_MAX_LONG)

    def _alone(self, body: Callable[[sqlite3.Connection], T]) -> T:
        conn = self.conn
        if conn.in_transaction:
            conn.execute("ROLLBACK")  # (as in _attempt)
        return body(conn)

    def _attempt(self, body: Callable[[sqlite3.Connection], T], write: bool) -> T:
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

    # -- the dialect of the statements RunQueue writes once -------------------

    _fold = f", {_FOLD}"
    _status_walk = "+status"  # (see RunQueue._status_walk)
    _no_limit = -1

    def _placeholder(self, name: str) -> str:
        return f":{name}"  # (a named parameter, the clock too: time.time(), shared by every process)

    def _snapshot(self, body: Callable[[sqlite3.Connection], T]) -> T:
        return self._tx(body, write=False)

    _read = _snapshot

    def _run(self, body: Callable[[sqlite3.Connection], T]) -> T:
        return self._tx(body)

    def _fenced_row(self, tx: sqlite3.Connection, sql: str, args: Mapping[str, Any]) -> bool | None:
        if _RETURNING:
            rows = tx.execute(sql + " RETURNING cancel_requested", args).fetchall()
            return bool(rows[0][0]) if len(rows) == 1 else None
        if tx.execute(sql, args).rowcount != 1:
            return None
        return self._cancel_asked(tx, args["run_id"])

    def _submit_write(self, tx: sqlite3.Connection, sub: Submission, status: RunStatus) -> None:
        now = time.time()
        added = tx.execute(
            "INSERT INTO ekit_queue_runs (run_id, workflow, priority, status, "
            "created_at, updated_at, options) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(run_id) DO NOTHING",
            (sub.run_id, sub.workflow, sub.priority, status, now, now, sub.options),
        )
        if added.rowcount == 1:
            tx.execute(
                "INSERT INTO ekit_queue_headers (seq, context) VALUES (?, ?)", (added.lastrowid, sub.context)
            )

    def _info_sql(self, where: str, order: str = "ASC", tail: str = "") -> str:
        return _info_select(f"{where} ORDER BY seq {order} {tail}", order)

    def _load(self, conn: sqlite3.Connection, run_id: str, *, missing_ok: bool) -> WorkflowCheckpoint | None:
        return self._read_run(conn, run_id, missing_ok=missing_ok)[0]

    def _read_run(
        self, conn: sqlite3.Connection, run_id: str, *, missing_ok: bool
    ) -> tuple[WorkflowCheckpoint | None, int]:
        """The run's latest checkpoint and the highest save number stored for it.

        The counts are those of the entry with the highest ``saved`` when it
        is above the row's ``counted``, else the row's (see ``_STEP_PROCEDURES``).
        """
        where = f"{self.path}, run {run_id!r}"
        row = conn.execute(
            "SELECT h.header, r.step_index, r.input_tokens, r.output_tokens, r.llm_calls, r.failures, "
            "r.counted FROM ekit_queue_runs AS r LEFT JOIN ekit_queue_headers AS h ON h.seq = r.seq "
            "WHERE r.run_id = ?",
            (run_id,),
        ).fetchone()
        if row is None or row[0] is None:
            checkpoint = self._decode_run(row, run_id, list, where, missing_ok=missing_ok)
            return checkpoint, self._a_number(row[6], "counted", where) if row is not None else 0
        counted = number = self._a_number(row[6], "counted", where)
        entries = conn.execute(
            "SELECT kind, name, value, ord, saved, step_index, input_tokens, output_tokens, llm_calls, "
            "failures FROM ekit_queue_entries WHERE run_id = ? ORDER BY ord",
            (run_id,),
        ).fetchall()
        newest: tuple[Any, ...] | None = None
        for entry in entries:
            number = max(number, self._a_number(entry[3], "ord", where) >> _ORD_SHIFT)
            saved = entry[4]
            if saved is not None:
                saved = self._a_number(saved, "saved", where)
                number = max(number, saved)
                if saved > counted and (newest is None or saved > newest[4]):
                    newest = entry
        counts = row[:6] if newest is None else (row[0], *newest[5:10])
        checkpoint = self._decode_run(
            counts, run_id, lambda: [entry[:3] for entry in entries], where, missing_ok=missing_ok
        )
        return checkpoint, number

    @staticmethod
    def _a_number(value: object, column: str, where: str) -> int:
        """A stored save number or order, checked (a file edited by hand is refused, naming the column).

        A save number must leave room for ``ord``, itself shifted by ``_ORD_SHIFT`` within 63 bits.
        """
        if type(value) is not int or not 0 <= value < 2 ** (63 if column == "ord" else 63 - _ORD_SHIFT):
            raise CorruptStoreError(where, f"column {column} holds {value!r}, not a save number")
        return value

    # -- the verbs' statements (the verbs themselves: RunQueue) --------------

    def _transaction(self, body: Callable[[sqlite3.Connection], T]) -> T:
        return self._tx(body)

    def _prune_write(self, conn: sqlite3.Connection, age: float) -> int:
        cutoff = time.time() - age
        final = f"{FINAL} AND updated_at < ? AND {NOT_A_KEPT_CHILD}"
        conn.execute(
            f"DELETE FROM ekit_queue_stream WHERE run_id IN "
            f"(SELECT run_id FROM ekit_queue_runs WHERE {final})",
            (cutoff,),
        )
        conn.execute(
            f"DELETE FROM ekit_queue_entries WHERE run_id IN "
            f"(SELECT run_id FROM ekit_queue_runs WHERE {final})",
            (cutoff,),
        )
        conn.execute(
            f"DELETE FROM ekit_queue_headers WHERE seq IN "
            f"(SELECT seq FROM ekit_queue_runs WHERE {final})",
            (cutoff,),
        )
        return conn.execute(f"DELETE FROM ekit_queue_runs WHERE {final}", (cutoff,)).rowcount

    # -- a person's verbs: retry, rewind, fork (RunQueue's docstrings) ------

    def _reopen_write(
        self, tx: sqlite3.Connection, run_id: str, epoch: int, written: WorkflowCheckpoint | None
    ) -> RunInfo | None:
        now = time.time()
        sets, args = "", []
        if written is not None:
            enc = self._encode_whole(written)
            sets, args = f", fingerprint = ?, {_COUNTS}, steps_done = ?, steps_total = ?", [
                written.fingerprint, *enc.counts, enc.failures, *progress(written)
            ]
        updated = tx.execute(
            f"UPDATE ekit_queue_runs SET status = '{REOPENED_AS}', epoch = epoch + 1, "
            f"lease_until = NULL, cancel_requested = 0, error = NULL, reason = NULL, "
            f"updated_at = ?{sets} WHERE {_UNCHANGED}",
            (now, *args, run_id, epoch, now),
        ).rowcount
        if updated != 1:
            return None
        if written is not None:
            self._write_header(tx, run_id, enc.header)
            self._write_entries(tx, run_id, enc, epoch + 1)
        rows, served = self._infos(tx, "WHERE run_id = :run_id", {"run_id": run_id})
        return self._run_info(rows[0], served)

    def _fork_write(
        self,
        tx: sqlite3.Connection,
        source: str,
        new_run_id: str,
        priority: int | None,
        options: str | None,
        enc: EncodedCheckpoint | None,
        columns: list[Any],
    ) -> bool:
        now = time.time()
        header, *counts = columns
        made = tx.execute(
            "INSERT INTO ekit_queue_runs (run_id, workflow, options, priority, status, "
            "created_at, updated_at, fingerprint, step_index, input_tokens, output_tokens, "
            "llm_calls, failures, steps_done, steps_total) SELECT ?, workflow, coalesce(?, options), "
            "coalesce(?, priority), 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ? "
            "FROM ekit_queue_runs WHERE run_id = ?",
            (new_run_id, options, priority, now, now, *counts, source),
        )
        tx.execute(
            "INSERT INTO ekit_queue_headers (seq, context, header) SELECT ?, h.context, ? "
            "FROM ekit_queue_runs AS r JOIN ekit_queue_headers AS h ON h.seq = r.seq WHERE r.run_id = ?",
            (made.lastrowid, header, source),
        )
        if enc is not None:
            self._write_entries(tx, new_run_id, enc, 0)
        return True  # (a taken id was told by _fork_read, under the same write lock)

    @staticmethod
    def _write_entries(conn: sqlite3.Connection, run_id: str, enc: EncodedCheckpoint, epoch: int) -> None:
        """Replace the run's entries with those of a checkpoint written in full.

        Their ords are their places, below those of any later save's entries.
        """
        conn.execute("DELETE FROM ekit_queue_entries WHERE run_id = ?", (run_id,))
        conn.executemany(
            "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            [(run_id, kind, name, value, epoch, i) for i, (kind, name, value) in enumerate(enc.rows)],
        )

    @staticmethod
    def _write_header(conn: sqlite3.Connection, run_id: str, header: str | None) -> None:
        """Store the header of a checkpoint written in full (its context, graph and versions)."""
        conn.execute(
            "UPDATE ekit_queue_headers SET header = ? "
            "WHERE seq = (SELECT seq FROM ekit_queue_runs WHERE run_id = ?)",
            (header, run_id),
        )

    # -- the worker's side --------------------------------------------------

    def _claim(
        self, conn: sqlite3.Connection, worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> Lease | None:
        now = time.time()
        # A run whose cancel was asked while its worker was alive, and whose
        # worker then died, is cancelled here rather than resumed.
        self._sweep_abandoned(conn)
        text, limits = self._read_limits_text(conn)
        # Later claims take the quick path while the fleet has no limit a claim counts.
        counted = limits.max_in_flight is not None or limits.runs_per_minute is not None
        self._quick = None if counted or not _RETURNING else (text, limits)
        self._trim_usage(conn, limits.window)
        if not self._below_limits(conn, limits):
            return None
        args = (now, *[v for pair in names for v in pair])
        row = conn.execute(
            "SELECT c.run_id, c.epoch, c.workflow, h.context, c.options FROM "
            f"({self._candidate(names, abandoned=True)}) AS c "
            "LEFT JOIN ekit_queue_headers AS h ON h.seq = c.seq",
            args + args,
        ).fetchone()
        if row is None:
            return None
        run_id, epoch, workflow, context, options = row
        if context is None:
            raise CorruptStoreError(self.path, f"run {run_id!r} has no row in ekit_queue_headers")
        until = now + seconds
        conn.execute(
            "UPDATE ekit_queue_runs SET status = 'running', epoch = ?, owner = ?, lease_until = ?, "
            "updated_at = ?, reason = NULL WHERE run_id = ?",
            (epoch + 1, worker, until, now, run_id),
        )
        if limits.runs_per_minute is not None:
            self._count_start(conn)
        checkpoint, number = self._read_run(conn, run_id, missing_ok=True)
        return self._granted_numbered(
            number, run_id, epoch + 1, workflow, context, checkpoint, until, options, limits
        )

    @staticmethod
    def _candidate(names: list[tuple[str, str | None]], *, abandoned: bool, limit: int = 1) -> str:
        """The SELECT of the next ``limit`` claimable runs (args: ``now`` and the names, twice).

        The first claimable runs of each status, each read off the claim index
        in order (a plain OR would read every queued run and sort them), then
        the first of those. ``abandoned=False`` leaves out the running runs
        whose cancel was asked (a claim in full cancels them first).
        """
        match = " OR ".join(f"({_MATCHES})" for _ in names)
        first = (
            "SELECT * FROM (SELECT run_id, epoch, workflow, options, priority, seq "
            "FROM ekit_queue_runs "
            f"WHERE status = '{{}}' AND {_CLAIMABLE} AND ({match}){{}} "
            f"ORDER BY {CLAIM_ORDER} LIMIT {limit:d})"
        )
        running = first.format("running", "" if abandoned else " AND NOT cancel_requested")
        both = f"{first.format('queued', '')} UNION ALL {running}"
        return f"SELECT * FROM ({both}) ORDER BY {CLAIM_ORDER} LIMIT {limit:d}"

    # -- the quick claim: one statement while the fleet has no limit a claim counts
    #
    # A claim in full is one transaction of several statements (the sweep of
    # abandoned runs, the limits, the window, the pick, the lease, the
    # checkpoint), and like a save in statements it held the write lock while
    # winning back the GIL between them. While the fleet has neither
    # max_in_flight nor runs_per_minute, a claim needs no count, so it is one
    # UPDATE ... RETURNING, guarded by the limits' text as last read (changed:
    # it matches nothing and the claim in full runs); the sweep and the trim
    # of the usage window run at most once a second, as statements of their
    # own; and the run's context and checkpoint are read after the commit
    # (the lease is held by then: no other writer may change them).

    _tidied = -1e9
    claim_many = RunQueue._claim_many_at_once

    def _claim_in_full(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float
    ) -> Lease | None:
        return self._tx(lambda c: self._claim(c, worker, names, seconds))

    def _quick_claim(
        self, worker: str, names: list[tuple[str, str | None]], seconds: float,
        quick: tuple[str | None, Limits], limit: int,
    ) -> list[tuple[Any, ...]]:
        self._tidy(quick[1])
        return self._tx(lambda c: self._claim_quick(c, worker, names, seconds, quick[0], limit), begin=False)

    def _claim_quick(
        self,
        conn: sqlite3.Connection,
        worker: str,
        names: list[tuple[str, str | None]],
        seconds: float,
        limits_text: str | None,
        limit: int,
    ) -> list[tuple[Any, ...]]:
        """Lease the next ``limit`` claimable runs in one statement; their rows, in claim order."""
        now = time.time()
        args = (now, *[v for pair in names for v in pair])
        rows: list[tuple[Any, ...]] = conn.execute(
            "UPDATE ekit_queue_runs SET status = 'running', epoch = epoch + 1, owner = ?, lease_until = ?, "
            "updated_at = ?, reason = NULL "
            f"WHERE run_id IN (SELECT run_id FROM ({self._candidate(names, abandoned=False, limit=limit)})) "
            "AND (SELECT value FROM ekit_queue_config WHERE key = 'limits') IS ? "
            "RETURNING run_id, epoch, workflow, options, seq, lease_until, counted, priority",
            (worker, now + seconds, now, *args, *args, limits_text),
        ).fetchall()
        # RETURNING's order is not the claim's: put them in claim order (priority, then age).
        return [row[:7] for row in sorted(rows, key=lambda row: (-row[7], row[4]))]

    def _granted_quick(self, row: tuple[Any, ...], limits: Limits) -> Lease:
        run_id, epoch, workflow, options, seq, until, number = row

        found = self.conn.execute(
            "SELECT context, header IS NOT NULL FROM ekit_queue_headers WHERE seq = ?", (seq,)
        ).fetchone()
        if found is None:
            raise CorruptStoreError(self.path, f"run {run_id!r} has no row in ekit_queue_headers")
        context, saved = found
        checkpoint = None
        number = self._a_number(number, "counted", f"{self.path}, run {run_id!r}")
        if saved:  # (its header and entries read in one snapshot; a run never saved has neither)
            checkpoint, number = self._tx(lambda c: self._read_run(c, run_id, missing_ok=True), write=False)
        return self._granted_numbered(
            number, run_id, epoch, workflow, context, checkpoint, until, options, limits
        )

    def _granted_numbered(self, number: int, *granted: Any) -> Lease:
        """:meth:`_granted`, the lease's saves numbered from past ``number`` (see :meth:`_number`)."""
        lease = self._granted(*granted)
        self._numbers[lease.run_id] = (lease.epoch, number)
        return lease

    def _tidy(self, limits: Limits) -> None:
        """At most once a second: cancel the abandoned runs and trim the usage window (a statement each)."""
        if time.monotonic() - self._tidied < 1.0:
            return
        self._tx(self._sweep_abandoned, begin=False)
        self._tx(lambda c: self._trim_usage(c, limits.window), begin=False)
        self._tidied = time.monotonic()

    def _fence(self, conn: sqlite3.Connection, lease: Lease, updated: int) -> None:
        if updated != 1:
            self._lost(lease)

    def _fenced_update(
        self, conn: sqlite3.Connection, lease: Lease, sql: str, args: tuple[Any, ...]
    ) -> bool:
        """Run a fenced ``UPDATE`` of the run's row (refused: :class:`LeaseLostError`); the cancel flag."""
        if _RETURNING:
            rows = conn.execute(sql + " RETURNING cancel_requested", args).fetchall()
            if len(rows) != 1:
                self._lost(lease)
            return bool(rows[0][0])
        self._fence(conn, lease, conn.execute(sql, args).rowcount)
        return self._cancel_asked(conn, lease.run_id)

    # -- the number of each save of a lease: the order of its entries, the age of its counts

    def _number(self, conn: sqlite3.Connection, lease: Lease) -> int:
        """The next save's number under ``lease``: above every number stored for the run.

        Kept in this process, not in the database, so that the usual save
        need not write the run's row to count itself. The claim reads where
        the stored numbers end (see :meth:`_read_run`); a lease this process
        did not claim is read from the database once. Only the lease's
        holder writes the run's entries meanwhile, so nothing stored can
        overtake the number. The numbers are shared by every queue object
        open on the file in this process, so that a lease saved through two
        of them still numbers its saves in order (a lease is not handed to
        another process: its holder is the process that claimed it).
        """
        with _NUMBERS_LOCK:
            known = self._numbers.get(lease.run_id)
            if known is not None and known[0] == lease.epoch:
                number = known[1] + 1
            else:
                number = self._stored_number(conn, lease.run_id) + 1
            self._numbers[lease.run_id] = (lease.epoch, number)
            return number

    @staticmethod
    def _stored_number(conn: sqlite3.Connection, run_id: str) -> int:
        """The highest save number stored for ``run_id`` (0 for none)."""
        row = conn.execute(
            f"SELECT max(r.counted, coalesce((SELECT max(max(e.ord >> {_ORD_SHIFT}, coalesce(e.saved, 0))) "
            "FROM ekit_queue_entries AS e WHERE e.run_id = r.run_id), 0)) "
            "FROM ekit_queue_runs AS r WHERE r.run_id = ?",
            (run_id,),
        ).fetchone()
        return int(row[0]) if row is not None and isinstance(row[0], int) else 0

    def _forget(self, run_id: str) -> None:
        super()._forget(run_id)
        self._numbers.pop(run_id, None)

    @staticmethod
    def _cancel_asked(conn: sqlite3.Connection, run_id: str) -> bool:
        row = conn.execute(
            "SELECT cancel_requested FROM ekit_queue_runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        return bool(row[0])

    # -- saves and endings: RunQueue writes them once, these are SQLite's statements
    #
    # A save alone, and a worker's batch of saves and endings, is one insert
    # into a view whose triggers do each row's fenced write (``_PROCEDURES``),
    # in a statement of its own: SQLite's write lock is taken, the rows written
    # and committed, and the lock let go inside one call, the GIL released
    # throughout. Where SQLite lacks what the views need, a save is a
    # transaction of statements (``_write``) and a batch, saves made alone.

    save_many = RunQueue._save_many_at_once
    write_many = RunQueue._write_many_at_once

    def _save_one(
        self, lease: Lease, checkpoint: WorkflowCheckpoint, enc: EncodedCheckpoint, added: TokenUsage,
        seconds: float,
    ) -> bool:
        # (The lease is renewed when less than half of it is left: save_renews.)
        if not self._one_statement or enc.recount is not None:
            return self._tx(lambda c: self._write(c, lease, enc, seconds, checkpoint, added))
        rows: list[_Row] = [(lease, checkpoint, enc, added)]
        (told,) = self._tx(lambda c: self._write_rows(c, rows, seconds), begin=False)
        if told is None:
            self._lost(lease)
        return told

    def _batches(self, writes: int) -> bool:
        return self._one_statement

    def _write_batch(
        self, writes: Writes, saves: Sequence[tuple[Lease, WorkflowCheckpoint]], more: More | None,
        seconds: float,
    ) -> None:
        """Statements of up to ``_WRITES_PER_STATEMENT`` rows, the endings (and what ``more``
        hands over) in the last. ``more`` is asked at each attempt at the write lock (again after
        each wait for another process's): a worker that waited for its turn writes what its runs
        asked meanwhile in the same commit. A statement that fails for another reason than a
        refusal writes nothing: a transient error (the lock held past the timeout, a full disk)
        is each write's own copy, else each write is made again alone."""
        ends = list(writes.ends)
        waiting = list(saves)
        while True:
            chunk: list[Written] = []
            writes.take(waiting[:_WRITES_PER_STATEMENT], chunk)
            del waiting[:_WRITES_PER_STATEMENT]
            last = not waiting  # (the last statement takes the endings, and what joins)
            if last:
                room = max(0, _WRITES_PER_STATEMENT - len(chunk))
                chunk += ends[:room]
                del ends[:room]
                last = not ends
            write = functools.partial(
                self._write_chunk, chunk=chunk, writes=writes, more=more if last else None, seconds=seconds
            )
            try:
                said = self._tx(write, begin=False)
            except Exception as exc:
                writes.failed(chunk, exc, is_transient(exc))
            else:
                writes.told(chunk, said)
            if last:
                break

    def _write_chunk(
        self,
        conn: sqlite3.Connection,
        chunk: list[Written],
        writes: Writes,
        more: More | None,
        seconds: float,
    ) -> list[bool | None]:
        """One attempt at the statement of ``chunk``, grown first by what ``more`` hands over."""
        if more is not None and len(chunk) < _WRITES_PER_STATEMENT:
            writes.take(more(_WRITES_PER_STATEMENT - len(chunk)), chunk)
        if not chunk:
            return []
        return self._write_rows(conn, [row for _where, row in chunk], seconds)

    def _write_rows(self, conn: sqlite3.Connection, rows: list[_Row], seconds: float) -> list[bool | None]:
        """The one statement of ``rows`` (see ``_PROCEDURES``): for each, a save's cancel flag
        (an ending's ``False``), or ``None`` if refused."""
        now = time.time()
        until = now + seconds
        steps = self._step_args(conn, rows, now, until)
        if steps is None and any(not isinstance(row, Ending) and row[2].recount is not None for row in rows):
            return self._write_in_statements(conn, rows, seconds)
        if steps is not None:
            statement = _steps_statement(len(steps) // len(_STEP_COLUMNS))
            return self._told_by(conn.execute(statement, steps).fetchall(), rows)
        args: list[Any] = []
        for row in rows:
            if isinstance(row, Ending):
                lease = row.lease
                args += (lease.run_id, lease.epoch, now, None, *_NO_ROW, row.status, row.error)
                continue
            lease, checkpoint, enc, added = row
            entries = enc.rows
            used = self._uses(added)
            header = enc.header
            args += (
                lease.run_id, lease.epoch, now, until, *enc.counts, enc.failures, *progress(checkpoint),
                self._number(conn, lease), *(entries[0] if entries else _NO_ENTRY),
                _ENTRIES(entries[1:]) if len(entries) > 1 else None,
                added.llm_calls if used else None, added.input_tokens + added.output_tokens,
                # (A delta's trigger reads no fingerprint: a save in full's does.)
                checkpoint.fingerprint if header is not None else None, header, None, None,
            )
        # Read to the end: the statement commits when its last row is read.
        return self._told_by(conn.execute(_writes_statement(len(rows)), args).fetchall(), rows)

    def _step_args(
        self, conn: sqlite3.Connection, rows: list[_Row], now: float, until: float
    ) -> list[Any] | None:
        """The arguments of ``rows`` in ``ekit_queue_steps_v2``; ``None`` unless every one is a
        save of a step's output alone (see ``_STEP_COLUMNS``), or of the output and the usage row
        that holds only its time (a run that records durations: each entry a row of the view,
        with the same counts and number)."""
        args: list[Any] = []
        sizes: list[int] = []
        for row in rows:
            if isinstance(row, Ending):
                return None
            lease, checkpoint, enc, added = row
            entries = enc.rows
            if enc.header is not None or enc.recount is not None or not 0 < len(entries) <= 2 or (
                    self._uses(added) or (len(entries) == 2 and entries[1][0] != "usage")):
                return None
            head = (lease.run_id, lease.epoch, now, until, *enc.counts, enc.failures, *progress(checkpoint),
                    None)
            for entry in entries:
                args += (*head, *entry)
            sizes.append(len(entries))
        # Numbered once the statement is known to be this one (a number skipped
        # would do no harm, but there is no need to).
        width, at = len(_STEP_COLUMNS), _STEP_SAVED
        for row, size in zip(rows, sizes, strict=True):
            number = self._number(conn, row[0])
            for _ in range(size):
                args[at] = number
                at += width
        return args

    def _write_in_statements(
        self, conn: sqlite3.Connection, rows: list[_Row], seconds: float
    ) -> list[bool | None]:
        """``rows`` as one transaction of statements, each write fenced on its own (as
        :meth:`_write_rows`'s outcomes): the way of a batch holding a compacting delta, whose
        deletes and header the views' triggers do not write."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            told: list[bool | None] = []
            for row in rows:
                lease = row[0]
                if isinstance(row, Ending):
                    now = time.time()
                    ended = conn.execute(
                        f"UPDATE ekit_queue_runs SET status = ?, error = ?, lease_until = NULL, "
                        f"updated_at = ?, {_FOLD} WHERE {_HELD}",
                        (row.status, row.error, now, lease.run_id, lease.epoch, now),
                    ).rowcount
                    told.append(False if ended == 1 else None)
                    continue
                try:
                    told.append(self._write(conn, lease, row[2], seconds, row[1], row[3]))
                except LeaseLostError:
                    told.append(None)  # (nothing written for it: its fenced UPDATE matched no row)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise
        return told

    @staticmethod
    def _told_by(said: list[Any], rows: list[_Row]) -> list[bool | None]:
        """Each row's outcome from the rows the statement returned (see ``_PROCEDURES``)."""
        if not said:
            return [False] * len(rows)  # (the usual statement: every write made, no cancel asked)
        returned = dict(said)
        told: list[bool | None] = []
        for row in rows:
            run_id = row[0].run_id
            if run_id not in returned:
                told.append(False)  # made, and no cancel asked (the usual case: no row returned)
            else:
                flag = returned[run_id]
                told.append(None if flag is None else bool(flag))
        return told

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
        # RunInfo's progress (steps_done, steps_total) is read without decoding.
        args: list[Any] = [*enc.counts, enc.failures, *progress(checkpoint)]
        if enc.full:
            args.append(checkpoint.fingerprint)
        number = self._number(conn, lease)
        args += (number, now + seconds, now, lease.run_id, lease.epoch, now)
        cancel = self._fenced_update(conn, lease, _SAVE_FULL if enc.full else _SAVE, tuple(args))
        if enc.full:
            self._write_header(conn, lease.run_id, enc.header)
            conn.execute("DELETE FROM ekit_queue_entries WHERE run_id = ?", (lease.run_id,))
        elif enc.recount is not None:
            # A compacting delta: the header holds the compacted counts, and the rows of the
            # iterations let go of go (never a name the new rows hold: see encode_checkpoint).
            self._write_header(conn, lease.run_id, enc.recount)
            conn.executemany(
                "DELETE FROM ekit_queue_entries WHERE run_id = ? AND kind = ? AND name = ?",
                [(lease.run_id, kind, name) for name in enc.gone for kind in ("output", "usage")],
            )
        base = number << _ORD_SHIFT
        rows = [
            (lease.run_id, kind, name, value, lease.epoch, base + i)
            for i, (kind, name, value) in enumerate(enc.rows)
        ]
        if len(rows) == 1:
            conn.execute(_UPSERT_ENTRY, rows[0])  # (executemany costs more for one row)
        elif rows:
            conn.executemany(_UPSERT_ENTRY, rows)
        if self._uses(added):
            conn.execute(
                "INSERT INTO ekit_queue_usage (at, llm_calls, tokens) VALUES (?, ?, ?)",
                (now, added.llm_calls, added.input_tokens + added.output_tokens),
            )
        return cancel

    # -- why a run waits, and who serves what --------------------------------

    # -- the runs' live streams (ekit_runtime.queue.streams) -----------------

    publish_many = RunQueue._publish_many_at_once

    def _publish(self, batches: list[tuple[Lease, list[Published]]], cap: int) -> dict[str, int | Exception]:
        """See :meth:`RunQueue._publish`. A stream is not a checkpoint: its transaction does not
        wait for the disk (``synchronous=NORMAL``), so a power cut may lose its last rows (a
        killed process loses none); the next durable commit makes them durable."""

        def body(conn: sqlite3.Connection) -> dict[str, int | Exception]:
            now = time.time()
            done: dict[str, int | Exception] = {}
            for lease, events in batches:
                run_id = lease.run_id
                if conn.execute(f"SELECT 1 FROM ekit_queue_runs WHERE {_HELD}",
                                (run_id, lease.epoch, now)).fetchone() is None:
                    done[run_id] = LeaseLostError(run_id, lease.epoch)
                    continue
                (last,) = conn.execute(
                    "SELECT coalesce(max(pos), 0) FROM ekit_queue_stream WHERE run_id = ?", (run_id,)
                ).fetchone()
                conn.executemany(
                    "INSERT INTO ekit_queue_stream (run_id, pos, kind, step, data, epoch, at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(run_id, last + i, e.kind, e.step, e.data, lease.epoch, e.at)
                     for i, e in enumerate(events, 1)],
                )
                last += len(events)
                if last > cap:
                    conn.execute("DELETE FROM ekit_queue_stream WHERE run_id = ? AND pos <= ?",
                                 (run_id, last - cap))
                done[run_id] = last
            return done

        durable = self._durable
        with self._lock:
            if durable:
                self.conn.execute("PRAGMA synchronous=NORMAL")
            try:
                return self._tx(body)
            finally:
                if durable:
                    # Every later save must be durable again: a transaction a failed ROLLBACK
                    # left open (which the setting cannot change inside) is ended first.
                    if self.conn.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self.conn.execute("ROLLBACK")
                    self.conn.execute("PRAGMA synchronous=FULL")

    def close(self) -> None:
        """Close the database connection."""
        self.conn.close()

    def __repr__(self) -> str:
        return f"SqliteQueue({self.path!r})"

    # -- one page of runs, filtered and counted in SQL (the dashboard) ------------

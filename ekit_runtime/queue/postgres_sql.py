"""The PostgreSQL queue's statements, its schema, its connection and its batch of writes.

The text of every statement :class:`~ekit_runtime.queue.postgres.PostgresQueue`
runs, the schema and its upgrade, the queue's connection (its session
settings, a hung-up session noticed), and a worker's batch of saves and
endings as one statement's arguments (``_writes_args``) and what it made (``_said``). Both the
queue (on its database thread) and the worker's loop session
(:mod:`ekit_runtime.queue.postgres_loop`) run them, so they live here,
below both.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from typing import Any

from ekit_runtime.queue.base import (
    Ending,
    RunQueue,
    Written,
    layout_before,
    progress,
    schema_columns,
)
from ekit_runtime.queue.lifecycle import (
    ABANDONED,
    CLAIM_ORDER,
    CLAIMABLE,
    GRAPH_CHANGE_MARK,
    HELD,
    LEFT_WINDOW,
    MATCHES,
    UNCHANGED,
    abandoned_as,
    render,
)
from ekit_runtime.queue.records import Lease, Limits
from ekit_runtime.queue.streams import Published
from ekit_runtime.stores.pg import PgConnection, psycopg

_SCHEMA = """
CREATE TABLE IF NOT EXISTS ekit_queue_runs (
    seq bigserial PRIMARY KEY,
    run_id text NOT NULL UNIQUE,
    workflow text NOT NULL,
    context text NOT NULL,
    priority integer NOT NULL,
    status text NOT NULL,
    epoch bigint NOT NULL DEFAULT 0,
    owner text,
    lease_until double precision,
    cancel_requested boolean NOT NULL DEFAULT false,
    error text,
    fingerprint text,
    header text,
    step_index bigint NOT NULL DEFAULT 0,
    input_tokens bigint NOT NULL DEFAULT 0,
    output_tokens bigint NOT NULL DEFAULT 0,
    llm_calls bigint NOT NULL DEFAULT 0,
    failures text NOT NULL DEFAULT '{}',
    saves bigint NOT NULL DEFAULT 0,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    options text NOT NULL DEFAULT '{}',
    steps_done bigint NOT NULL DEFAULT 0,
    steps_total bigint,
    reason text
) WITH (fillfactor = 50);
CREATE INDEX IF NOT EXISTS ekit_queue_runs_claim ON ekit_queue_runs (status, priority DESC, seq);
CREATE INDEX IF NOT EXISTS ekit_queue_runs_pick ON ekit_queue_runs (priority DESC, seq)
    WHERE status IN ('queued', 'running');
CREATE TABLE IF NOT EXISTS ekit_queue_entries (
    seq bigserial,
    run_id text NOT NULL,
    kind text NOT NULL,
    name text NOT NULL,
    value text NOT NULL,
    epoch bigint NOT NULL,
    PRIMARY KEY (run_id, kind, name)
);
CREATE TABLE IF NOT EXISTS ekit_queue_starts (at double precision NOT NULL);
CREATE TABLE IF NOT EXISTS ekit_queue_usage (
    at double precision NOT NULL, llm_calls bigint NOT NULL, tokens bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS ekit_queue_config (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS ekit_queue_workers (
    name text PRIMARY KEY, workflows text NOT NULL, last_seen double precision NOT NULL,
    until double precision NOT NULL, doing text
);
INSERT INTO ekit_queue_config (key, value) VALUES ('limits', '{}') ON CONFLICT (key) DO NOTHING;
CREATE TABLE IF NOT EXISTS ekit_queue_slots (
    resource text NOT NULL, holder text NOT NULL, run_id text NOT NULL, epoch bigint NOT NULL,
    at double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS ekit_queue_slots_resource ON ekit_queue_slots (resource);
"""

# The index a claim reads its runs off (see _pick): the claimable statuses
# only, in claim order. The claim index (status first) cannot give that order
# across the two statuses, so a pick that read it had either to sort every
# queued run (one scan of both) or to lock runs it would not lease (a scan of
# each, merged), which other claims then skipped, finding nothing while runs
# were claimable. A queue made before it gains it when it is next opened.
_PICK_INDEX = next(s.strip() for s in _SCHEMA.split(";") if "ekit_queue_runs_pick" in s)

_NOW = "extract(epoch from now())::float8"
_INFO = (
    "run_id, workflow, status, priority, epoch, owner, lease_until, cancel_requested, "
    "error, created_at, updated_at, fingerprint, "
    "options, steps_done, steps_total, input_tokens, output_tokens, llm_calls, reason"
)
# The lifecycle's named placeholders in PostgreSQL's terms: the clock is the
# server's.
_DIALECT = {
    "now": _NOW,
    "since": f"{_NOW} - %s",  # args: the window's length
    "run_id": "%s",
    "epoch": "%s",
}
_HELD = render(HELD, _DIALECT)  # args: run_id, epoch
_CLAIMABLE = render(CLAIMABLE, _DIALECT)
_ABANDONED = render(ABANDONED, _DIALECT)
_LEFT_WINDOW = render(LEFT_WINDOW, _DIALECT)

# Whether a run is of one of the claimer's workflows (args: the names, their
# fingerprints, the names again): a filter of the pick's scan, not a join,
# so that the scan keeps its order (a hash join with the names did not).
_MATCH_ANY = render(
    MATCHES,
    {
        "workflow": "ANY(%s::text[])",
        "fingerprint": "(%s::text[])[array_position(%s::text[], workflow)]",
        "graph_change": f"strpos(options, '{GRAPH_CHANGE_MARK}') > 0",
    },
)


def _pick(more: str, limit: str) -> str:
    """The pick of a claim: the first ``limit`` claimable runs of the claimer's workflows.

    One scan of ``ekit_queue_runs_pick`` in claim order, each row locked as it
    is taken, skipping the rows other claims hold, and stopping at ``limit``
    (args: :func:`_names`, then ``limit`` if it is a parameter). ``more``:
    a further filter.
    """
    return (
        f"SELECT run_id FROM ekit_queue_runs WHERE status IN ('queued', 'running') AND {_CLAIMABLE}{more} "
        f"AND {_MATCH_ANY} ORDER BY {CLAIM_ORDER} LIMIT {limit} FOR UPDATE SKIP LOCKED"
    )


def _names(names: list[tuple[str, str | None]]) -> tuple[list[str], list[str | None], list[str]]:
    """The arguments of ``_MATCH_ANY`` for the claimer's (workflow, fingerprint) pairs."""
    workflows = [n for n, _ in names]
    return workflows, [fp for _, fp in names], workflows


# The quick claim: ONE statement, while the fleet has no limit a claim counts.
# A claim in full is a transaction of six to eight round trips (the sweep of
# abandoned runs, the limits, the window, the pick and lease, the checkpoint);
# this one sweeps, trims the window, picks and leases at once, guarded by the
# limits' text as last read (changed: it matches nothing, and the claim in
# full runs), and returns what a checkpoint is decoded from besides its
# entries. The pick leaves out the abandoned runs, which the sweep cancels:
# two updates of one statement must not touch the same row.
_NOT_ABANDONED = f" AND NOT ({_ABANDONED})"
_QUICK_CLAIM = (
    "WITH swept AS (UPDATE ekit_queue_runs SET status = %s, epoch = epoch + 1, "
    f"lease_until = NULL, updated_at = {_NOW} WHERE {_ABANDONED} RETURNING 1), "
    f"trimmed AS (DELETE FROM ekit_queue_usage WHERE {_LEFT_WINDOW} RETURNING 1), "
    "leased AS (UPDATE ekit_queue_runs SET status = 'running', epoch = epoch + 1, owner = %s, "
    f"lease_until = {_NOW} + %s, updated_at = {_NOW}, reason = NULL "
    # (The runs a worker with several free places leases at once: see claim_many.)
    f"WHERE run_id IN ({_pick(_NOT_ABANDONED, '%s')}) "
    "AND (SELECT value FROM ekit_queue_config WHERE key = 'limits') IS NOT DISTINCT FROM %s "
    "RETURNING run_id, epoch, workflow, context, lease_until, options, "
    "header, step_index, input_tokens, output_tokens, llm_calls, failures, priority, seq) "
    "SELECT run_id, epoch, workflow, context, lease_until, options, "
    "header, step_index, input_tokens, output_tokens, llm_calls, failures "
    f"FROM leased ORDER BY {CLAIM_ORDER}"
)


def _quick_args(
    quick: tuple[str | None, Limits],
    worker: str,
    seconds: float,
    names: list[tuple[str, str | None]],
    limit: int,
) -> tuple[Any, ...]:
    """The arguments of ``_QUICK_CLAIM`` (``quick``: the limits' text as last read, and the limits)."""
    return (abandoned_as(), quick[1].window, worker, seconds, *_names(names), limit, quick[0])


# The first key of the advisory lock a slot's take holds on its resource (the
# second is the name's hash): "ekit" in ASCII, apart from any other user's locks.
_SLOT_LOCK = 0x656B6974
_UNCHANGED = render(UNCHANGED, _DIALECT)  # args: run_id, epoch
_WHOLE = (
    "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) "
    "SELECT %s, e.kind, e.name, e.value, %s "
    "FROM unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS e(kind, name, value, ord) "
    "ORDER BY e.ord"
)
_ROWS = (
    "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) "
    "SELECT fenced.run_id, e.kind, e.name, e.value, %s "
    "FROM fenced, unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS e(kind, name, value, ord) "
    "ORDER BY e.ord "
    "ON CONFLICT (run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch"
)

def _held_joined(rows: str) -> str:
    """The fence (HELD) of each run of a batch, the runs ``rows`` names (``rid``, ``ep``).

    The runs are found by their ids, one index probe each. The status test is
    hidden from the planner (``IS TRUE``): as an index condition it read the
    claim index's entries for status running, which hold every running row
    version not yet vacuumed (one per claim), and the planner, counting only
    the few live ones, preferred that to the probes. It cost a scan of the
    runs claimed since the last vacuum on every write.
    """
    held = render(HELD, {**_DIALECT, "run_id": f"{rows}.rid", "epoch": f"{rows}.ep"})
    running = "status = 'running'"
    assert running in held, "HELD's status test is not where _held_joined looks for it"
    return held.replace(running, f"({running}) IS TRUE")


# A worker's writes as one statement (its group commit: see
# ekit_runtime.queue.group_commit): several runs' saves, and the endings of
# other runs, in one commit and one flush of the write-ahead log. Each row is
# fenced on its own: the entries and usage exist only for the saves the
# UPDATE matched, and the runs it returns are the writes made. A save in full
# (``header`` not NULL: a run's first under its lease) also replaces the
# header and fingerprint, deletes the entries its checkpoint lacks and gives
# the others a fresh seq in checkpoint order, as _SAVE_FULL does; its sub-
# statements touch disjoint rows, and no run has two writes in the statement
# (a statement's sub-statements must not modify the same row). An ending is
# finish's fenced UPDATE, returned with a NULL cancel flag. One statement,
# not a transaction of one per run, for the reason _SAVE_FULL gives. Its rows
# come as one JSON text per kind (saves, entries, endings), an array of one
# JSON array per row (``_writes_args``), which psycopg sends as it is. A
# list parameter psycopg dumps in Python, element by element: 23 typed arrays
# cost about 200 us a batch, and a jsonb[] escapes every quote of every row
# with a regular expression (about 0.1 ms of the worker's CPU per run).
_WRITES = (
    "WITH i AS (SELECT d->>0 AS rid, (d->>1)::bigint AS ep, (d->>2)::bigint AS step_index, "
    "(d->>3)::bigint AS input_tokens, (d->>4)::bigint AS output_tokens, (d->>5)::bigint AS llm_calls, "
    "d->>6 AS failures, (d->>7)::bigint AS steps_done, (d->>8)::bigint AS steps_total, "
    "(d->>9)::float8 AS seconds, (d->>10)::bigint AS calls, (d->>11)::bigint AS tokens, "
    "(d->>12)::bool AS used, d->>13 AS header, d->>14 AS fp, d->>15 AS recount "
    "FROM jsonb_array_elements(%s::jsonb) AS j(d)), "
    "fenced AS (UPDATE ekit_queue_runs r SET step_index = i.step_index, input_tokens = i.input_tokens, "
    "output_tokens = i.output_tokens, llm_calls = i.llm_calls, failures = i.failures, "
    "saves = r.saves + 1, steps_done = i.steps_done, steps_total = i.steps_total, "
    "header = COALESCE(i.header, i.recount, r.header), "
    "fingerprint = CASE WHEN i.header IS NULL THEN r.fingerprint ELSE i.fp END, "
    f"lease_until = {_NOW} + i.seconds, updated_at = {_NOW} FROM i "
    f"WHERE {_held_joined('i')} "
    "RETURNING r.run_id, r.epoch, r.cancel_requested, i.header IS NOT NULL AS whole), "
    "e AS (SELECT d->>0 AS rid, d->>1 AS kind, d->>2 AS name, d->>3 AS value, ord "
    "FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS e(d, ord)), "
    "{dropped}"
    "cleared AS (DELETE FROM ekit_queue_entries x USING fenced WHERE fenced.whole "
    "AND x.run_id = fenced.run_id "
    "AND NOT EXISTS (SELECT 1 FROM e WHERE e.rid = x.run_id AND e.kind = x.kind AND e.name = x.name)), "
    "added AS (INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) "
    "SELECT e.rid, e.kind, e.name, e.value, fenced.epoch FROM e "
    "JOIN fenced ON fenced.run_id = e.rid ORDER BY e.ord "
    "ON CONFLICT (run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch, "
    "seq = CASE WHEN EXISTS (SELECT 1 FROM fenced WHERE fenced.run_id = excluded.run_id AND fenced.whole) "
    "THEN excluded.seq ELSE ekit_queue_entries.seq END), "
    f"used AS (INSERT INTO ekit_queue_usage (at, llm_calls, tokens) SELECT {_NOW}, i.calls, i.tokens "
    "FROM i JOIN fenced ON fenced.run_id = i.rid WHERE i.used), "
    "ended AS (UPDATE ekit_queue_runs SET status = x.st, error = x.err, lease_until = NULL, "
    f"updated_at = {_NOW} FROM (SELECT d->>0 AS rid, (d->>1)::bigint AS ep, d->>2 AS st, d->>3 AS err "
    "FROM jsonb_array_elements(%s::jsonb) AS j(d)) AS x "
    f"WHERE {_held_joined('x')} RETURNING run_id) "
    "SELECT run_id, cancel_requested FROM fenced UNION ALL SELECT run_id, NULL FROM ended"
)

# A compacting delta (a loop's keep_last) as one statement: the delta's fenced UPDATE also
# writes the header again (its compacted counts), and the rows of the iterations let go of are
# deleted; those names and the new rows' never meet (see encode_checkpoint), so no row is
# changed twice by one statement. (Args: the header, then _save_delta's, then the names gone.)
_SAVE_COMPACTING = (
    "WITH fenced AS (UPDATE ekit_queue_runs SET header = %s, step_index = %s, input_tokens = %s, "
    "output_tokens = %s, llm_calls = %s, failures = %s, saves = saves + 1, "
    "steps_done = %s, steps_total = %s, "
    f"lease_until = {_NOW} + %s, updated_at = {_NOW} WHERE {_HELD} "
    "RETURNING run_id, cancel_requested), "
    "added AS (" + _ROWS + "), "
    f"used AS (INSERT INTO ekit_queue_usage (at, llm_calls, tokens) SELECT {_NOW}, %s, %s "
    "FROM fenced WHERE %s), "
    "gone AS (DELETE FROM ekit_queue_entries x USING fenced WHERE x.run_id = fenced.run_id "
    "AND x.kind IN ('output', 'usage') AND x.name = ANY(%s::text[])) "
    "SELECT cancel_requested FROM fenced"
)

# The batch of writes as a batch without a compacting save sends it (three arguments), and as
# one with such a save does: the rows its iterations let go of deleted (args: the runs, the
# entries, the [run, name] of each row gone, the endings). Two texts, not an empty fourth
# argument: psycopg dumps each argument in Python, once per batch of every worker.
_WRITES_GONE = _WRITES.format(dropped=(
    "dropped AS (DELETE FROM ekit_queue_entries x USING fenced, (SELECT d->>0 AS rid, d->>1 AS name "
    "FROM jsonb_array_elements(%s::jsonb) AS j(d)) AS g WHERE g.rid = fenced.run_id "
    "AND x.run_id = g.rid AND x.kind IN ('output', 'usage') AND x.name = g.name), "))
_WRITES = _WRITES.format(dropped="")

# A full rewrite of a run as one statement. The DELETE and the INSERT touch
# disjoint rows (a statement's sub-statements must not modify the same row):
# entries the new checkpoint lacks are deleted, the others upserted, each given
# a fresh seq in checkpoint order so that loading keeps that order.
_SAVE_FULL = (
    "WITH fenced AS (UPDATE ekit_queue_runs SET header = %s, fingerprint = %s, step_index = %s, "
    "input_tokens = %s, output_tokens = %s, llm_calls = %s, failures = %s, saves = saves + 1, "
    "steps_done = %s, steps_total = %s, "
    f"lease_until = {_NOW} + %s, updated_at = {_NOW} WHERE {_HELD} RETURNING run_id, cancel_requested), "
    "new AS (SELECT * FROM unnest(%s::text[], %s::text[], %s::text[]) "
    "WITH ORDINALITY AS e(kind, name, value, ord)), "
    "cleared AS (DELETE FROM ekit_queue_entries x USING fenced WHERE x.run_id = fenced.run_id "
    "AND NOT EXISTS (SELECT 1 FROM new WHERE new.kind = x.kind AND new.name = x.name)), "
    "added AS (INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) "
    "SELECT fenced.run_id, new.kind, new.name, new.value, %s FROM fenced, new ORDER BY new.ord "
    "ON CONFLICT (run_id, kind, name) DO UPDATE SET value = excluded.value, epoch = excluded.epoch, "
    "seq = excluded.seq), "
    f"used AS (INSERT INTO ekit_queue_usage (at, llm_calls, tokens) SELECT {_NOW}, %s, %s "
    "FROM fenced WHERE %s) "
    "SELECT cancel_requested FROM fenced"
)


_COLUMNS = schema_columns(_SCHEMA)
# What this version added to the previous release's layout: a database of
# that layout gains these on open, in one transaction under the schema lock.
_ADDED = {
    "ekit_queue_runs": {
        "options": "text NOT NULL DEFAULT '{}'",
        "steps_done": "bigint NOT NULL DEFAULT 0",
        "steps_total": "bigint",
        "reason": "text",
    },
    "ekit_queue_workers": {"doing": "text"},
}
_NEW_TABLES = ("ekit_queue_workers", "ekit_queue_slots")
_BEFORE = layout_before(_COLUMNS, _ADDED, _NEW_TABLES)
# The new tables first: a column added to one of them (the workers' doing) is
# then already there for a database that had none of it.
_UPGRADE = "\n".join(
    m.group(0) for m in re.finditer(r"CREATE TABLE IF NOT EXISTS (\w+) \(.*?\);", _SCHEMA, re.S)
    if m.group(1) in _NEW_TABLES
) + "\n" + "".join(
    f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {kind};\n"
    for table, columns in _ADDED.items()
    for name, kind in columns.items()
)
_MAX_IDLE = (2**31 - 1) // 1000

# Each run's live stream (ekit_runtime.queue.streams), kept out of _SCHEMA
# (the layout an upgrade checks): a database of any layout gains it on open,
# under the schema lock; prune deletes a run's rows with the run.
# The advisory lock class under which a run's stream offsets are numbered (with hashtext(run_id)).
_STREAM_LOCK = 0x656B7374  # "ekst"
# A flush of several runs' streams is two statements in its transaction: the
# runs' advisory locks, taken in the order given (run id order: two publishers never wait in a
# cycle), then every run's append and cap in one statement, whose snapshot, taken once the
# locks are held, sees every offset a publisher before it committed. The fence's clock is read
# when that statement runs (clock_timestamp), not when its transaction began (now()), since it
# follows a wait for the locks. Both take the runs as one JSON text, not arrays (psycopg dumps an
# array element by element in Python): _publish_args. A run's events are appended only if its
# lease is held, and only its newest ``cap`` (what the cap would keep; the offsets are those of
# all of them); each stream is then cut to its newest ``cap``. One row per run whose lease is
# held: run id, how many went in, the stream's newest offset (a run missing: its lease is lost).
_CLOCK_HELD = _HELD.replace(_NOW, "extract(epoch from clock_timestamp())::float8")
# (The locks' statement also makes the transaction's commit not wait for the server's disk:
# set_config(..., true) is SET LOCAL, read at the commit, one statement fewer.)
_STREAM_LOCKS = (
    "SELECT set_config('synchronous_commit', 'off', true), pg_advisory_xact_lock(%s, hashtext(x.id)) "
    "FROM json_array_elements_text(%s::json) AS x(id)"
)
_STREAM_PUBLISH = (
    "WITH b AS (SELECT x.v ->> 0 AS run_id, (x.v ->> 1)::bigint AS epoch, x.v -> 2 AS events, "
    "json_array_length(x.v -> 2) AS total FROM json_array_elements(%(runs)s::json) AS x(v)), "
    "r AS (SELECT b.run_id, b.epoch, b.events, b.total, "
    "(SELECT coalesce(max(pos), 0) FROM ekit_queue_stream s WHERE s.run_id = b.run_id) AS last "
    "FROM b WHERE EXISTS (SELECT 1 FROM ekit_queue_runs WHERE "
    + _CLOCK_HELD.replace("run_id = %s AND epoch = %s", "run_id = b.run_id AND epoch = b.epoch")
    + ")), "
    "ins AS (INSERT INTO ekit_queue_stream (run_id, pos, kind, step, data, epoch, at) "
    "SELECT r.run_id, r.last + e.n, e.v ->> 0, e.v ->> 1, e.v ->> 2, r.epoch, (e.v ->> 3)::float8 "
    "FROM r, json_array_elements(r.events) WITH ORDINALITY AS e(v, n) WHERE e.n > r.total - %(cap)s "
    "RETURNING run_id, pos), "
    "cut AS (DELETE FROM ekit_queue_stream s USING (SELECT b.run_id, coalesce(r.last + r.total, "
    "(SELECT max(pos) FROM ekit_queue_stream t WHERE t.run_id = b.run_id)) - %(cap)s AS upto "
    "FROM b LEFT JOIN r ON r.run_id = b.run_id) AS c WHERE s.run_id = c.run_id AND s.pos <= c.upto) "
    "SELECT run_id, count(*), max(pos) FROM ins GROUP BY run_id"
)
_events_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode


def _publish_args(batches: Sequence[tuple[Lease, Sequence[Published]]]) -> tuple[str, str]:
    """The runs' ids (for _STREAM_LOCKS) and their leases and events (_STREAM_PUBLISH's ``runs``),
    each as one JSON text, in the order given."""
    return (
        _events_json([lease.run_id for lease, _events in batches]),
        _events_json([
            [lease.run_id, lease.epoch, [[e.kind, e.step, e.data, e.at] for e in events]]
            for lease, events in batches
        ]),
    )


_STREAM_TABLE = """CREATE TABLE IF NOT EXISTS ekit_queue_stream (
    run_id text NOT NULL, pos bigint NOT NULL, kind text NOT NULL, step text, data text NOT NULL,
    epoch bigint NOT NULL, at double precision NOT NULL, PRIMARY KEY (run_id, pos)
)"""


def _has_pick_index(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regclass('ekit_queue_runs_pick') IS NOT NULL").fetchone()
    return bool(row and row[0])


def _has_stream_table(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regclass('ekit_queue_stream') IS NOT NULL").fetchone()
    return bool(row and row[0])


def _columns_found(conn: psycopg.Connection[Any]) -> dict[str, set[str]]:
    """The columns of the queue's tables as they are in the database (on its search path)."""
    rows = conn.execute(
        "SELECT c.relname, a.attname FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "WHERE c.oid = ANY (SELECT to_regclass(t)::oid FROM unnest(%s::text[]) AS t) "
        "AND a.attnum > 0 AND NOT a.attisdropped",
        (list(_COLUMNS),),
    ).fetchall()
    found: dict[str, set[str]] = {}
    for table, column in rows:
        found.setdefault(table, set()).add(column)
    return found


# The planner settings of the queue's own sessions. The queue's statements are
# few and fixed, and its tables churn: statistics go stale between two runs of
# autovacuum (a burst of submits is not counted until the next ANALYZE), and
# the plans must not depend on them.
# - plan_cache_mode: each statement is planned once per session. A custom plan
#   of a batch of writes took longer to make (~0.4 ms) than to run.
# - random_page_cost: the rows a queue touches are in memory. At the default
#   4.0 the planner priced a probe by run id of each run of a batch above a
#   scan of a small table.
# - enable_bitmapscan: a bitmap scan cannot keep the claim index's order, and
#   with a burst of submits not yet in the statistics the planner read every
#   queued run through one and sorted them, on every claim.
# Set on every session the queue uses, an adopted connection's too (as its
# idle timeout and autocommit are), at open and on each reconnect.
_SESSION = (
    "SELECT set_config('plan_cache_mode', 'force_generic_plan', false), "
    "set_config('random_page_cost', '1.1', false), set_config('enable_bitmapscan', 'off', false)"
)


def farewell(diag: psycopg.errors.Diagnostic) -> bool:
    """Whether a notice is the server's farewell to an idle session (FATAL, then it hangs up)."""
    return diag.severity_nonlocalized in ("FATAL", "PANIC")


def hung_up(pgconn: psycopg.pq.abc.PGconn) -> bool:
    """Whether the server ended this idle session, as far as reading it without blocking shows.

    Reading parses an idle session's farewell (a FATAL error) into its
    notice handler, which the caller may also consult.
    """
    try:
        pgconn.consume_input()
        pgconn.is_busy()  # parses what was read: an idle session's error goes to the notice handler
        pgconn.consume_input()
    except psycopg.OperationalError:
        return True
    return pgconn.status != psycopg.pq.ConnStatus.OK


class _QueueConnection(PgConnection):
    """The queue's connection: reopened whenever it is not ready, refused once the queue is closed.

    A session the server ended while idle (``pg_terminate_backend``, a
    failover, a restart) is noticed before the next call, which runs on a
    new one; a session that ends during a call fails that call with a
    transient error, and the next call reconnects: a dead session never
    poisons the queue. An adopted ``psycopg.Connection`` is never
    replaced (its owner decides). After
    :meth:`close`, every call is a ``RuntimeError`` (not a transient error a
    worker would wait out).
    """

    _closed_by_caller = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._farewell: dict[int, bool] = {}
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            conn = getattr(self, "conn", None)
            if conn is not None and self._conninfo is not None:
                conn.close()  # opened here, then the schema failed: do not leak it
            raise

    def _connection(self) -> psycopg.Connection[Any]:
        if self._closed_by_caller:
            raise RuntimeError("the PostgresQueue is closed")
        conn = self.conn
        if self._conninfo is not None and self._hung_up(conn):
            self._farewell.pop(id(conn), None)
            with contextlib.suppress(Exception):
                conn.close()
            self.conn = self._connect(self._conninfo)
        return self.conn

    def _connect(self, conninfo: str) -> psycopg.Connection[Any]:
        conn = super()._connect(conninfo)
        key = id(conn)
        self._farewell[key] = False

        def heard(diag: psycopg.errors.Diagnostic) -> None:
            if farewell(diag):
                self._farewell[key] = True

        conn.add_notice_handler(heard)
        return conn

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        super()._configure(conn)
        conn.execute(_SESSION)

    def _hung_up(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the server already ended this idle session (its farewell waits in the socket).

        A session ended while idle (``pg_terminate_backend``, a server
        restart) is sent a FATAL error, then end-of-file; libpq notices only
        when it next reads. Reading now, without blocking, lets the call
        reconnect first instead of failing on it. A session that dies while a
        statement runs still fails that statement (with a transient error).
        """
        return hung_up(conn.pgconn) or self._farewell.get(id(conn), False)

    def close(self) -> None:
        self._closed_by_caller = True
        super().close()


# _WRITES's input: one JSON text per kind (saves, entries, endings), an array of one JSON array
# per row. Each kind is encoded in one call of the encoder (a call costs about as much as a
# small row: a batch's rows one by one cost the worker a few hundred thousand instructions a run).
_row = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def _columns(rows: list[tuple[str, str, str]]) -> tuple[list[str], list[str], list[str]]:
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def _writes_args(rows: Sequence[Written], seconds: float) -> tuple[str, tuple[str, ...]] | None:
    """A batch's writes (saves prepared, endings checked) as its statement (``_WRITES``, or
    ``_WRITES_GONE`` when a compacting save lets rows go) and that statement's arguments;
    ``None``: nothing to write (every write failed before the statement)."""
    if not rows:
        return None
    runs: list[tuple[Any, ...]] = []
    entries: list[tuple[str, str, str, str]] = []
    gone: list[tuple[str, str]] = []
    ended: list[tuple[str, int, str, str | None]] = []
    uses = RunQueue._uses
    for _i, row in rows:
        if isinstance(row, Ending):
            ended.append((row.lease.run_id, row.lease.epoch, row.status, row.error))
            continue
        lease, checkpoint, enc, added = row
        done, total = progress(checkpoint)
        run_id = lease.run_id
        runs.append((
            run_id, lease.epoch, *enc.counts, enc.failures, done, total, seconds,
            added.llm_calls, added.total_tokens, uses(added), enc.header,
            checkpoint.fingerprint if enc.full else None, enc.recount,
        ))
        entries.extend([(run_id, kind, name, value) for kind, name, value in enc.rows])
        if enc.gone:
            gone.extend([(run_id, name) for name in enc.gone])
    if gone:
        return _WRITES_GONE, (_row(runs), _row(entries), _row(gone), _row(ended))
    return _WRITES, (_row(runs), _row(entries), _row(ended))


def _said(rows: Sequence[Written], made: dict[str, Any]) -> list[bool | None]:
    """Each write's outcome from ``_WRITES``'s answer (the runs it wrote, with their cancel flags:
    an ending's NULL): ``None`` for a write it did not make."""
    return [None if (rid := row[0].run_id) not in made else bool(made[rid]) for _i, row in rows]

"""A queue database made by an earlier release opens, is brought up to date, and its runs go on.

Two earlier layouts are written below verbatim. ``OLD_SQLITE`` (and
``OLD_POSTGRES``): ``ekit_queue_runs`` without ``options``, ``steps_done``,
``steps_total`` and ``reason``, and no ``ekit_queue_workers``; opening it
adds them and keeps every run, and a worker drains the runs queued before.
``PREVIOUS_SQLITE``, the layout just before this one: each run's context and
header lived in its row (every save rewrote them) and the entries were a
rowid table beside an index of their key. Opening such a file moves the
context and header to ``ekit_queue_headers`` and rebuilds the entries keyed
by their key alone, in one transaction: every run keeps its status, lease,
checkpoint and the order of its outputs, and goes on from where it was
(a held lease still fences, an expired one is resumed, a parked run is
answered, a failed one retried), without a finished step run again. Of
processes opening such a file at once, exactly one upgrades it. A database
whose tables are not even the oldest layout is refused untouched.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import ekit_runtime.queue.sqlite as sqlite_queue
from ekit_core import WorkflowCheckpoint
from ekit_runtime import Step, Workflow, ask
from ekit_runtime.queue import Lease, QueueUnavailableError, RunInfo, SqliteQueue, Worker, open_queue
from ekit_runtime.queue.base import schema_columns, schema_problem
from ekit_runtime.stores.errors import CorruptStoreError
from tests.support.queue_backends import postgres_url, queue_url
from tests.support.queue_options_child import REGISTRY

__all__ = ["postgres_url", "queue_url"]

OLD_SQLITE = """
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
    updated_at REAL NOT NULL
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
"""


PREVIOUS_SQLITE = """
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
CREATE TABLE IF NOT EXISTS ekit_queue_slots (
    resource TEXT NOT NULL, holder TEXT NOT NULL, run_id TEXT NOT NULL, epoch INTEGER NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS ekit_queue_slots_resource ON ekit_queue_slots (resource);
CREATE TABLE IF NOT EXISTS ekit_queue_workers (
    name TEXT PRIMARY KEY, workflows TEXT NOT NULL, last_seen REAL NOT NULL, until REAL NOT NULL
);
"""


# The layout of the release just before this one: every save rewrote the
# run's row, which counted them (``saves``), and an entry held its output
# alone. With it, that release's views and triggers, as its processes create
# them on every open where missing (long lines wrapped; SQL reads them alike).
LAST_SQLITE = """
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
    saves INTEGER NOT NULL DEFAULT 0,
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
LAST_PROCEDURES = """
CREATE VIEW IF NOT EXISTS ekit_queue_writes AS SELECT
    NULL AS run_id, NULL AS epoch, NULL AS now, NULL AS lease_until, NULL AS step_index, NULL AS
        input_tokens, NULL AS output_tokens, NULL AS llm_calls, NULL AS failures, NULL AS
        steps_done, NULL AS steps_total, NULL AS kind, NULL AS name, NULL AS value, NULL AS entries,
        NULL AS calls, NULL AS tokens, NULL AS fingerprint, NULL AS header, NULL AS status, NULL AS
        error WHERE 0;
CREATE TRIGGER IF NOT EXISTS ekit_queue_writes_delta_v1 INSTEAD OF INSERT ON ekit_queue_writes
WHEN NEW.status IS NULL AND NEW.header IS NULL BEGIN
    UPDATE ekit_queue_runs SET step_index = NEW.step_index, input_tokens = NEW.input_tokens,
        output_tokens = NEW.output_tokens, llm_calls = NEW.llm_calls, failures = NEW.failures,
        steps_done = NEW.steps_done, steps_total = NEW.steps_total, saves = saves + 1,
        lease_until = NEW.lease_until, updated_at = NEW.now
        WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status = 'running' AND lease_until >
            NEW.now;
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, NEW.kind, NEW.name, NEW.value, NEW.epoch, saves << 32
        FROM ekit_queue_runs WHERE NEW.name IS NOT NULL AND run_id = NEW.run_id AND epoch =
            NEW.epoch
        AND status = 'running' AND lease_until = NEW.lease_until
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch =
            excluded.epoch;
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'),
            json_extract(e.value, '$[2]'), NEW.epoch,
            ((SELECT saves FROM ekit_queue_runs WHERE run_id = NEW.run_id) << 32) + e.key + 1
        FROM json_each(NEW.entries) AS e WHERE NEW.entries IS NOT NULL AND EXISTS (SELECT 1 FROM
            ekit_queue_runs WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status = 'running'
            AND lease_until = NEW.lease_until)
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch =
            excluded.epoch;
    INSERT INTO ekit_queue_usage (at, llm_calls, tokens)
        SELECT NEW.now, NEW.calls, NEW.tokens WHERE NEW.calls IS NOT NULL AND EXISTS (SELECT 1
            FROM ekit_queue_runs WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status =
            'running' AND lease_until = NEW.lease_until);
    SELECT RAISE(IGNORE) WHERE EXISTS (SELECT 1 FROM ekit_queue_runs WHERE run_id = NEW.run_id
        AND epoch = NEW.epoch AND status = 'running' AND lease_until = NEW.lease_until AND NOT
        cancel_requested);
END;
CREATE TRIGGER IF NOT EXISTS ekit_queue_writes_full_v1 INSTEAD OF INSERT ON ekit_queue_writes
WHEN NEW.status IS NULL AND NEW.header IS NOT NULL BEGIN
    UPDATE ekit_queue_runs SET step_index = NEW.step_index, input_tokens = NEW.input_tokens,
        output_tokens = NEW.output_tokens, llm_calls = NEW.llm_calls, failures = NEW.failures,
        steps_done = NEW.steps_done, steps_total = NEW.steps_total, saves = saves + 1,
        fingerprint = NEW.fingerprint, lease_until = NEW.lease_until, updated_at = NEW.now
        WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status = 'running' AND lease_until >
            NEW.now;
    UPDATE ekit_queue_headers SET header = NEW.header
        WHERE EXISTS (SELECT 1 FROM ekit_queue_runs WHERE run_id = NEW.run_id AND epoch =
            NEW.epoch AND status = 'running' AND lease_until = NEW.lease_until) AND seq = (SELECT
            seq FROM ekit_queue_runs WHERE run_id = NEW.run_id);
    DELETE FROM ekit_queue_entries WHERE run_id = NEW.run_id AND EXISTS (SELECT 1 FROM
        ekit_queue_runs WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status = 'running' AND
        lease_until = NEW.lease_until);
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, NEW.kind, NEW.name, NEW.value, NEW.epoch, saves << 32
        FROM ekit_queue_runs WHERE NEW.name IS NOT NULL AND run_id = NEW.run_id AND epoch =
            NEW.epoch
        AND status = 'running' AND lease_until = NEW.lease_until
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch =
            excluded.epoch;
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'),
            json_extract(e.value, '$[2]'), NEW.epoch,
            ((SELECT saves FROM ekit_queue_runs WHERE run_id = NEW.run_id) << 32) + e.key + 1
        FROM json_each(NEW.entries) AS e WHERE NEW.entries IS NOT NULL AND EXISTS (SELECT 1 FROM
            ekit_queue_runs WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status = 'running'
            AND lease_until = NEW.lease_until)
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch =
            excluded.epoch;
    INSERT INTO ekit_queue_usage (at, llm_calls, tokens)
        SELECT NEW.now, NEW.calls, NEW.tokens WHERE NEW.calls IS NOT NULL AND EXISTS (SELECT 1
            FROM ekit_queue_runs WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status =
            'running' AND lease_until = NEW.lease_until);
    SELECT RAISE(IGNORE) WHERE EXISTS (SELECT 1 FROM ekit_queue_runs WHERE run_id = NEW.run_id
        AND epoch = NEW.epoch AND status = 'running' AND lease_until = NEW.lease_until AND NOT
        cancel_requested);
END;
CREATE TRIGGER IF NOT EXISTS ekit_queue_writes_end_v1 INSTEAD OF INSERT ON ekit_queue_writes
WHEN NEW.status IS NOT NULL BEGIN
    UPDATE ekit_queue_runs SET status = NEW.status, error = NEW.error, lease_until = NULL,
        updated_at = NEW.now WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status =
            'running' AND lease_until > NEW.now;
    SELECT RAISE(IGNORE) WHERE changes() = 1;
END;

CREATE VIEW IF NOT EXISTS ekit_queue_steps AS SELECT
    NULL AS run_id, NULL AS epoch, NULL AS now, NULL AS lease_until, NULL AS step_index, NULL AS
        input_tokens, NULL AS output_tokens, NULL AS llm_calls, NULL AS failures, NULL AS
        steps_done, NULL AS steps_total, NULL AS kind, NULL AS name, NULL AS value WHERE 0;
CREATE TRIGGER IF NOT EXISTS ekit_queue_steps_v1 INSTEAD OF INSERT ON ekit_queue_steps BEGIN
    UPDATE ekit_queue_runs SET step_index = NEW.step_index, input_tokens = NEW.input_tokens,
        output_tokens = NEW.output_tokens, llm_calls = NEW.llm_calls, failures = NEW.failures,
        steps_done = NEW.steps_done, steps_total = NEW.steps_total, saves = saves + 1,
        lease_until = NEW.lease_until, updated_at = NEW.now
        WHERE run_id = NEW.run_id AND epoch = NEW.epoch AND status = 'running' AND lease_until >
            NEW.now;
    INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord)
        SELECT NEW.run_id, NEW.kind, NEW.name, NEW.value, NEW.epoch, saves << 32
        FROM ekit_queue_runs WHERE changes() = 1 AND run_id = NEW.run_id
        ON CONFLICT(run_id, kind, name) DO UPDATE SET value = excluded.value, epoch =
            excluded.epoch;
    SELECT RAISE(IGNORE) WHERE EXISTS (SELECT 1 FROM ekit_queue_runs WHERE run_id = NEW.run_id
        AND epoch = NEW.epoch AND status = 'running' AND lease_until = NEW.lease_until AND NOT
        cancel_requested);
END;
"""


OLD_POSTGRES = """
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
    updated_at double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS ekit_queue_runs_claim ON ekit_queue_runs (status, priority DESC, seq);
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
INSERT INTO ekit_queue_config (key, value) VALUES ('limits', '{}') ON CONFLICT (key) DO NOTHING;
"""


OLD_RUN = (
    "INSERT INTO ekit_queue_runs (run_id, workflow, context, priority, status, created_at, updated_at) "
    "VALUES ({p}, 'mapped', '{{}}', 0, 'queued', {p}, {p})"
)


def _make_old(url: str) -> None:
    """A queue of the previous release at ``url``, holding one queued run ``old``."""
    now = time.time()
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(OLD_POSTGRES)
            conn.execute(OLD_RUN.format(p="%s"), ("old", now, now))
        return
    conn2 = sqlite3.connect(url)
    try:
        conn2.executescript(OLD_SQLITE)
        conn2.execute(OLD_RUN.format(p="?"), ("old", now, now))
        conn2.commit()
    finally:
        conn2.close()


def _run_columns(url: str) -> set[str]:
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            rows: list[Any] = conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'ekit_queue_runs'"
            ).fetchall()
        return {r[0] for r in rows}
    conn2 = sqlite3.connect(url)
    try:
        return {r[1] for r in conn2.execute("PRAGMA table_info(ekit_queue_runs)")}
    finally:
        conn2.close()


@pytest.mark.timeout(120)
def test_a_queue_of_the_previous_release_opens_and_its_runs_go_on(queue_url: str) -> None:
    _make_old(queue_url)
    assert "options" not in _run_columns(queue_url)
    with open_queue(queue_url) as q:
        info = q.status("old")
        assert (info.status, dict(info.options), info.steps_done, info.steps_total) == ("queued", {}, 0, None)
        assert info.reason == "no worker has workflow mapped"
        assert {"options", "steps_done", "steps_total", "reason"} <= _run_columns(queue_url)
        q.submit("mapped", {}, run_id="new", options={"max_concurrency": 1})
        assert asyncio.run(Worker(q, REGISTRY, poll=0.02).run_until_idle()) == 2
        for run_id in ("old", "new"):
            done = q.status(run_id)
            assert (done.status, done.steps_done, done.steps_total, done.reason) == ("finished", 6, 6, None)
    with open_queue(queue_url) as again:  # opened once more: nothing left to add, nothing lost
        assert [r.run_id for r in again.runs("finished")] == ["old", "new"]


def test_a_postgres_queue_whose_workers_table_predates_doing_gains_it_on_open(postgres_url: str) -> None:
    """The previous release's PostgreSQL layout: ekit_queue_workers without the doing column."""
    import psycopg

    queue_url = postgres_url
    open_queue(queue_url).close()
    with psycopg.connect(queue_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE ekit_queue_workers DROP COLUMN doing")
    with open_queue(queue_url) as q:
        q.submit("mapped", {}, run_id="r")
        lease = q.claim("w", {"mapped": None}, 60)
        assert lease is not None
        q.announce("w", {"mapped": None}, 60, {"r": (lease.epoch, {"split": (time.time(), 1)})})
        assert set(q.in_flight("r")) == {"split"}


def test_tables_that_are_not_even_the_previous_layout_are_refused_untouched(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    columns = {"run_id": "TEXT", "workflow": "TEXT", "status": "TEXT", "priority": "INT", "seq": "INT"}
    conn.execute(f"CREATE TABLE ekit_queue_runs ({', '.join(f'{k} {v}' for k, v in columns.items())})")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError, match=r"not a run.queue"):
        SqliteQueue(db)
    conn = sqlite3.connect(db)
    try:
        assert {r[1] for r in conn.execute("PRAGMA table_info(ekit_queue_runs)")} == set(columns)
    finally:
        conn.close()


# -- the layout just before this one ------------------------------------------------

ran: list[tuple[str, str]] = []  # (the run's ctx["id"], step) of every step run in this process
BROKEN = {"b": True}


def _step(name: str) -> Any:
    async def run(ctx: dict[str, Any]) -> str:
        ran.append((ctx["id"], name))
        return f"{name} of {ctx['id']}"

    return run


async def _b(ctx: dict[str, Any]) -> str:
    ran.append((ctx["id"], "b"))
    if BROKEN["b"]:
        raise RuntimeError("b is broken")
    return "b mended"


async def _pick(ctx: dict[str, Any]) -> str:
    ran.append((ctx["id"], "pick"))
    return f"picked {ask('Which colour?')}"


# The chain's outputs are recorded in an order that is not their names' order.
CHAIN = ("zeta", "eta", "alpha", "mu")
FLOWS = {
    "chain": Workflow([Step(n, _step(n), (CHAIN[i - 1],) if i else ()) for i, n in enumerate(CHAIN)]),
    "flaky": Workflow([Step("a", _step("a")), Step("b", _b, ("a",))]),
    "ask": Workflow([Step("a", _step("a")), Step("pick", _pick, ("a",))]),
}
STATES = ("finished", "failed", "waiting", "running", "queued")


def _drain(queue: SqliteQueue) -> int:
    return asyncio.run(Worker(queue, FLOWS, poll=0.01).run_until_idle())


def _runs_in_every_state(path: Path) -> tuple[Lease, list[WorkflowCheckpoint]]:
    """Runs ``finished``, ``failed``, ``waiting`` (parked on a question), ``running`` (a live lease,
    two steps saved) and ``queued``; the running run's lease and its chain's checkpoints."""
    with SqliteQueue(path) as q:
        q.submit("chain", {"id": "finished"}, run_id="finished")
        q.submit("flaky", {"id": "failed"}, run_id="failed")
        q.submit("ask", {"id": "waiting"}, run_id="waiting")
        assert _drain(q) == 3
        q.submit("chain", {"id": "running"}, run_id="running")
        lease = q.claim("old-worker", {"chain": None}, 3600)
        assert lease is not None and lease.run_id == "running"
        checkpoints: list[WorkflowCheckpoint] = []
        FLOWS["chain"].run_sync({"id": "running"}, checkpoint_fn=checkpoints.append)
        for cp in checkpoints[:2]:
            q.save(lease, cp, 3600)
        q.submit("chain", {"id": "queued"}, run_id="queued")
        assert [q.status(r).status for r in STATES] == ["finished", "failed", "waiting", "running", "queued"]
    ran.clear()
    return lease, checkpoints


# The run's counts as its row held them in the layouts before: those of its
# last save, which this layout keeps in the newest entry when that save wrote
# nothing else (see SqliteQueue._read_run).
_COUNTS = (
    "step_index", "input_tokens", "output_tokens", "llm_calls", "failures", "steps_done", "steps_total",
)
_AS_SAVED = {
    **{c: f"CASE WHEN n.saved > r.counted THEN n.{c} ELSE r.{c} END" for c in _COUNTS},
    "saves": (
        "max(r.counted, coalesce((SELECT max(max(e.ord >> 32, coalesce(e.saved, 0))) "
        "FROM cur.ekit_queue_entries AS e WHERE e.run_id = r.run_id), 0))"
    ),
}
# (one entry: a timed save writes its output and its time's usage row under one number,
# both with the save's counts, as SqliteQueue._read_run reads them)
_NEWEST = (
    "LEFT JOIN cur.ekit_queue_entries AS n ON n.run_id = r.run_id "
    "AND (n.kind, n.name) = (SELECT kind, name FROM cur.ekit_queue_entries WHERE run_id = r.run_id "
    "AND saved IS NOT NULL ORDER BY saved DESC, kind, name LIMIT 1)"
)
LAYOUTS = ("rowid entries", "saves counted")


def _as_previous_layout(
    current: Path, old: Path, sequence: int = 1000, layout: str = "rowid entries"
) -> None:
    """Write the queue at ``current`` into ``old`` in an earlier layout, as that release kept it.

    ``saves counted``, the layout just before: each run's counts in its row,
    with its save count; the entries as they are, without counts.
    ``rowid entries``, the one before that: besides, each run's context and
    header go back into its row, and the entries into a rowid table, each
    run's in the order they were written. The runs' seq counter is set to
    ``sequence``, as if runs up to it had been pruned.
    """
    conn = sqlite3.connect(old, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(PREVIOUS_SQLITE if layout == "rowid entries" else LAST_SQLITE + LAST_PROCEDURES)
        conn.execute("ATTACH DATABASE ? AS cur", (str(current),))
        conn.execute("BEGIN")
        columns = [r[1] for r in conn.execute("PRAGMA cur.table_info(ekit_queue_runs)") if r[1] != "counted"]
        values = [_AS_SAVED.get(c, f"r.{c}") for c in columns] + [_AS_SAVED["saves"]]
        if layout == "rowid entries":
            conn.execute(
                f"INSERT INTO ekit_queue_runs ({', '.join(columns)}, saves, context, header) "
                f"SELECT {', '.join(values)}, h.context, h.header FROM cur.ekit_queue_runs AS r "
                f"JOIN cur.ekit_queue_headers AS h ON h.seq = r.seq {_NEWEST} ORDER BY r.seq"
            )
            conn.execute(
                "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch) "
                "SELECT run_id, kind, name, value, epoch FROM cur.ekit_queue_entries ORDER BY run_id, ord"
            )
        else:
            conn.execute(
                f"INSERT INTO ekit_queue_runs ({', '.join(columns)}, saves) "
                f"SELECT {', '.join(values)} FROM cur.ekit_queue_runs AS r {_NEWEST} ORDER BY r.seq"
            )
            conn.execute("INSERT INTO ekit_queue_headers SELECT * FROM cur.ekit_queue_headers")
            conn.execute(
                "INSERT INTO ekit_queue_entries (run_id, kind, name, value, epoch, ord) "
                "SELECT run_id, kind, name, value, epoch, ord FROM cur.ekit_queue_entries"
            )
        for table in ("ekit_queue_starts", "ekit_queue_usage", "ekit_queue_config", "ekit_queue_slots"):
            conn.execute(f"INSERT INTO {table} SELECT * FROM cur.{table}")
        conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'ekit_queue_runs'", (sequence,))
        conn.execute("COMMIT")
        conn.execute("DETACH DATABASE cur")
    finally:
        conn.close()


def _snapshot(path: Path) -> tuple[list[RunInfo], dict[str, WorkflowCheckpoint | None]]:
    with SqliteQueue(path) as q:
        return [q.status(r) for r in STATES], {r: q.checkpoint(r) for r in STATES}


def _table_sql(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall())
    finally:
        conn.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_queue_of_the_layout_before_upgrades_on_open_and_every_run_goes_on(
    tmp_path: Path, layout: str
) -> None:
    current, old = tmp_path / "current.db", tmp_path / "old.db"
    lease, checkpoints = _runs_in_every_state(current)
    infos, saved = _snapshot(current)
    _as_previous_layout(current, old, layout=layout)
    assert ("header" if layout == "rowid entries" else "saves") in _table_sql(old)["ekit_queue_runs"]

    with SqliteQueue(old) as q:
        # Every run is as it was: its record, its checkpoint, the order of its outputs.
        assert [q.status(r) for r in STATES] == infos
        for run_id in STATES:
            assert q.checkpoint(run_id) == saved[run_id]
            if saved[run_id] is not None:
                assert list(q.checkpoint(run_id).outputs) == list(saved[run_id].outputs)  # type: ignore[union-attr]
        tables = _table_sql(old)
        assert "header" not in tables["ekit_queue_runs"] and "context" not in tables["ekit_queue_runs"]
        assert "WITHOUT ROWID" in tables["ekit_queue_entries"] and "ekit_queue_headers" in tables
        assert "saves" not in tables["ekit_queue_runs"] and "counted" in tables["ekit_queue_runs"]
        # The earlier views are gone (their triggers read saves), this layout's made.
        triggers = {r[0] for r in q.conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")}
        assert "ekit_queue_steps_v2_entry" in triggers and "ekit_queue_steps_v1" not in triggers
        # The workers' table, kept, gains what a worker runs now (the dashboard's running steps).
        assert "doing" in tables["ekit_queue_workers"]
        q.announce("old-worker", {"chain": None}, 60, {"running": (lease.epoch, {"mu": (time.time(), 1)})})
        assert set(q.in_flight("running")) == {"mu"}
        q.retire("old-worker")
        # The lease held before the upgrade still fences, and its saves go on after the old ones.
        assert q.save(lease, checkpoints[2], 3600) is False
        assert list(q.checkpoint("running").outputs) == list(CHAIN[:3])  # type: ignore[union-attr]
        # It keeps the run from every other worker: a drain takes the queued run only.
        assert _drain(q) == 1
        assert ran == [("queued", name) for name in CHAIN]
        ran.clear()

        # Its holder dies: the lease expires, and another worker resumes the run at the next epoch.
        expired = time.time() - 1
        q.conn.execute("UPDATE ekit_queue_runs SET lease_until = ? WHERE run_id = 'running'", (expired,))
        BROKEN["b"] = False
        try:
            assert q.retry("failed").status == "queued"
            assert q.answer("waiting", "pick", "blue").status == "queued"
            assert _drain(q) == 3
        finally:
            BROKEN["b"] = True
        # Only what was not recorded ran: the chain's last step, the failed step, the asking one.
        assert sorted(ran) == [("failed", "b"), ("running", "mu"), ("waiting", "pick")]
        for run_id in STATES:
            assert q.status(run_id).status == "finished"
        assert q.status("running").epoch == lease.epoch + 1
        results = {r: q.result(r) for r in STATES}
        assert list(results["running"].outputs.items()) == [  # type: ignore[union-attr]
            (n, f"{n} of running") for n in CHAIN
        ]
        assert dict(results["failed"].outputs) == {"a": "a of failed", "b": "b mended"}  # type: ignore[union-attr]
        assert results["waiting"].outputs["pick"] == "picked blue"  # type: ignore[union-attr]
        assert results["finished"].outputs == saved["finished"].outputs  # type: ignore[union-attr]
        # Runs submitted now come after every run the file ever had (its seq counter is kept).
        q.submit("chain", {"id": "new"}, run_id="new")
        (seq,) = q.conn.execute("SELECT seq FROM ekit_queue_runs WHERE run_id = 'new'").fetchone()
        assert seq == 1001
        assert q.conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_upgrade_that_fails_midway_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    current, old = tmp_path / "current.db", tmp_path / "old.db"
    _runs_in_every_state(current)
    infos, saved = _snapshot(current)
    _as_previous_layout(current, old, layout=layout)
    before = _table_sql(old)
    real = SqliteQueue._rebuild

    def failing(conn: sqlite3.Connection, table: str, *args: Any) -> None:
        real(conn, table, *args)
        if table == "ekit_queue_runs":  # the views dropped, the runs rebuilt: all of it rolls back
            raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(SqliteQueue, "_rebuild", staticmethod(failing))
    with pytest.raises(QueueUnavailableError, match="disk I/O error"):
        SqliteQueue(old)
    assert _table_sql(old) == before
    monkeypatch.undo()
    assert _snapshot(old) == (infos, saved)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_processes_opening_a_file_of_the_layout_before_at_once_upgrade_it_once(
    tmp_path: Path, layout: str
) -> None:
    current, old = tmp_path / "current.db", tmp_path / "old.db"
    _runs_in_every_state(current)
    with SqliteQueue(current) as q:  # enough runs that an upgrade takes a while
        for i in range(300):
            q.submit("other", {"id": str(i), "text": "x" * 2000}, run_id=f"r{i}")
    infos, saved = _snapshot(current)
    _as_previous_layout(current, old, layout=layout)
    # This process holds the write lock until every opener has read the old
    # layout and waits for the lock to upgrade it: they all see it old.
    holder = sqlite3.connect(old, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    root = Path(__file__).resolve().parents[2]
    openers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.queue_upgrade_child", str(old)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    try:
        for opener in openers:
            assert opener.stdout is not None
            assert opener.stdout.readline().strip() == "waiting"
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    said = []
    for opener in openers:
        out, err = opener.communicate(timeout=90)
        assert opener.returncode == 0, err
        said.append(out.split("\n")[:2])
    assert sorted(said) == [["found it upgraded", f"opened {300 + len(STATES)}"]] * 2 + [
        ["upgraded", f"opened {300 + len(STATES)}"]
    ]
    assert _snapshot(old) == (infos, saved)
    conn = sqlite3.connect(old)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("SELECT count(*) FROM ekit_queue_headers").fetchone() == (300 + len(STATES),)
    finally:
        conn.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_runs_of_the_layout_before_beside_no_other_table_of_it_are_refused(
    tmp_path: Path, layout: str
) -> None:
    db = tmp_path / "mixed.db"
    conn = sqlite3.connect(db)
    schema = PREVIOUS_SQLITE if layout == "rowid entries" else LAST_SQLITE
    conn.executescript(schema.split("CREATE INDEX")[0])  # its ekit_queue_runs alone
    conn.close()
    with pytest.raises(CorruptStoreError, match="ekit_queue_runs is of an earlier layout"):
        SqliteQueue(db)


def test_a_postgres_queue_made_before_the_pick_index_gains_it_on_open(postgres_url: str) -> None:
    """A queue of this layout made before claims read ekit_queue_runs_pick: its runs go on."""
    import psycopg

    def has_index() -> bool:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            row = conn.execute("SELECT to_regclass('ekit_queue_runs_pick') IS NOT NULL").fetchone()
            return bool(row and row[0])

    with open_queue(postgres_url) as q:
        q.submit("mapped", {}, run_id="r")
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP INDEX ekit_queue_runs_pick")
    assert not has_index()
    with open_queue(postgres_url) as q:
        assert has_index()
        lease = q.claim("w", {"mapped": None}, 60)
        assert lease is not None and lease.run_id == "r"


def test_a_role_that_cannot_build_the_pick_index_still_opens_the_queue(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Least privilege: a worker's role may read and write the tables but own none of them."""
    import uuid

    import psycopg

    with open_queue(postgres_url) as q:
        q.submit("mapped", {}, run_id="r")
    role = f"ekit_worker_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("DROP INDEX ekit_queue_runs_pick")
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
    try:
        with caplog.at_level("WARNING", logger="ekit.worker"), open_queue(f"{postgres_url}&user={role}") as q:
            lease = q.claim("w", {"mapped": None}, 60)
            assert lease is not None and lease.run_id == "r"
        (record,) = [r for r in caplog.records if getattr(r, "event", None) == "index_missing"]
        assert "ekit_queue_runs_pick" in record.getMessage()
        with open_queue(postgres_url):  # the owner builds it
            pass
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            row = conn.execute("SELECT to_regclass('ekit_queue_runs_pick') IS NOT NULL").fetchone()
            assert row is not None and row[0]
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


def test_a_worker_of_the_release_before_refuses_this_layout_and_breaks_nothing(tmp_path: Path) -> None:
    # What that release's SqliteQueue does on open, in its order: create its
    # tables and its views and triggers where missing, then check the columns.
    path = tmp_path / "q.db"
    with SqliteQueue(path) as q:
        q.submit("chain", {"id": "held"}, run_id="held")
        lease = q.claim("new-worker", {"chain": None}, 3600)
        assert lease is not None
        checkpoints: list[WorkflowCheckpoint] = []
        FLOWS["chain"].run_sync({"id": "held"}, checkpoint_fn=checkpoints.append)
        q.save(lease, checkpoints[0], 3600)
        q.save(lease, checkpoints[1], 3600)
        old = sqlite3.connect(path, isolation_level=None)
        try:
            old.executescript(LAST_SQLITE)
            old.executescript(LAST_PROCEDURES)
            found = {t: {r[1] for r in old.execute(f"PRAGMA table_info({t})")} for t in sqlite_queue._COLUMNS}
        finally:
            old.close()
        problem = schema_problem(schema_columns(LAST_SQLITE), found)
        assert problem is not None and "ekit_queue_runs lacks column(s) saves" in problem
        # This version's saves go on through its own views, which the old triggers do not touch.
        assert q.save(lease, checkpoints[2], 3600) is False
        q.finish(lease, "finished")
        q.submit("chain", {"id": "next"}, run_id="next")
        assert _drain(q) == 1
    with SqliteQueue(path) as q:  # and the file opens again as it was
        assert q.result("held").outputs == checkpoints[2].outputs  # type: ignore[union-attr]
        assert q.status("next").status == "finished" and q.status("next").steps_done == len(CHAIN)
    ran.clear()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_upgrade_waits_until_no_worker_of_the_earlier_release_is_live(
    tmp_path: Path, layout: str
) -> None:
    # Such a worker would go on claiming on the upgraded file and fail each run at its first save.
    current, old = tmp_path / "current.db", tmp_path / "old.db"
    _runs_in_every_state(current)
    infos, saved = _snapshot(current)
    _as_previous_layout(current, old, layout=layout)
    raw = sqlite3.connect(old, isolation_level=None)
    raw.execute(
        "INSERT INTO ekit_queue_workers (name, workflows, last_seen, until) VALUES (?, '{}', ?, ?)",
        ("old-host:4242", time.time(), time.time() + 3600),
    )
    raw.close()
    before = _table_sql(old)
    refused = r"1 worker\(s\) of an earlier ekit release.*'old-host:4242'"
    with pytest.raises(QueueUnavailableError, match=refused):
        SqliteQueue(old)
    assert _table_sql(old) == before  # nothing upgraded
    raw = sqlite3.connect(old, isolation_level=None)
    raw.execute("UPDATE ekit_queue_workers SET until = ?", (time.time() - 1,))  # it stopped (or died)
    raw.close()
    assert _snapshot(old) == (infos, saved)  # upgraded now, every run as it was

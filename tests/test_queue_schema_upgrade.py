"""A queue database made by the previous release opens, gains the new columns, and its runs go on.

The layout below is that release's, verbatim (``ekit_queue_runs`` without
``options``, ``steps_done``, ``steps_total`` and ``reason``, and no
``ekit_queue_workers``). Opening it adds them (``ALTER TABLE ... ADD
COLUMN``) and keeps every run; a worker then drains the runs queued before.
A database whose tables are not even that layout is refused untouched.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime.queue import SqliteQueue, Worker, open_queue
from ekit_runtime.stores.errors import CorruptStoreError
from tests.queue_backends import queue_url
from tests.queue_options_child import REGISTRY

__all__ = ["queue_url"]

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

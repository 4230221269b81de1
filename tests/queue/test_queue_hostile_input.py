"""What the queue is given: refused up front with a ``ValueError`` naming it, or stored and read back as is.

Hostile strings (a NUL, lone surrogates, very long ones, 4-byte characters)
as a run id, a workflow name, a worker name, a context, a step name and a
run's error, on both backends: never a driver error, never a refusal after
the database was touched. And the queue's own arguments: a file that is not
a queue database, a server that cannot be reached, a DSN in either of
libpq's spellings, a URL of another kind.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ekit_runtime import Step, Workflow
from ekit_runtime.queue import QueueUnavailableError, RunQueue, SqliteQueue, open_queue
from ekit_runtime.stores import CorruptStoreError
from tests.support.queue_backends import chain_checkpoints, postgres_dsn, postgres_url, queue, queue_url

__all__ = ["postgres_url", "queue", "queue_url"]

_SPECIAL = st.sampled_from(["\x00", "\udc80", "\ud800", "\udfff", "\U0001f600", "é", "\n", "'", "\\", "%"])
hostile = st.one_of(
    st.text(st.one_of(st.characters(), _SPECIAL), min_size=0, max_size=20),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\U0001f600"]), st.integers(150, 2100)),
)


def _driver_errors() -> tuple[type[BaseException], ...]:
    import psycopg

    return (sqlite3.Error, psycopg.Error, UnicodeError)


def _refused(exc: BaseException, name: str) -> None:
    """A refusal as promised: a ValueError naming ``name``, not the driver's (nor a codec's) error."""
    assert isinstance(exc, ValueError) and not isinstance(exc, _driver_errors()), repr(exc)
    assert name in str(exc), exc


def _attempt(call: Any, name: str) -> tuple[bool, Any]:
    try:
        return True, call()
    except Exception as exc:
        _refused(exc, name)
        return False, None


def _count(q: RunQueue) -> int:
    return len(q.runs())


@pytest.mark.timeout(120)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=hostile)
@example(text="a\x00b")
@example(text="\udc80")
@example(text="x" * 201)
@example(text="\U0001f600" * 200)
def test_hostile_names_are_refused_up_front_or_stored_as_given(queue: RunQueue, text: str) -> None:
    uid = uuid.uuid4().hex
    wf = f"w-{uid}"  # this example's runs only: the queue is shared by every example
    before = _count(queue)
    ok, run = _attempt(lambda: queue.submit(text, run_id=f"a-{uid}"), "workflow")
    assert _count(queue) == before + ok
    if ok:
        assert queue.status(run).workflow == text
    before = _count(queue)
    ok, run = _attempt(lambda: queue.submit("fixed", run_id=text), "run_id")
    if ok:  # (hypothesis may draw the same text twice: a retried submit)
        assert run == text and queue.status(text).run_id == text and _count(queue) - before in (0, 1)
        assert queue.cancel(text) in (True, False)
    else:
        assert _count(queue) == before
    for i, context in enumerate(({"k": text}, {text: 1})):
        ok, run = _attempt(lambda c=context, i=i: queue.submit(wf, c, run_id=f"c{i}-{uid}"), "context")
        if ok:
            lease = queue.claim("w", {wf: None}, 30)
            assert lease is not None and lease.run_id == run and dict(lease.context) == context
            queue.finish(lease, "finished")
    queue.submit(wf, run_id=f"by-{uid}")
    ok, lease = _attempt(lambda: queue.claim(text, {wf: None}, 30), "worker")
    if ok:
        assert lease is not None and queue.status(lease.run_id).owner == text
        # A run's error text comes from an exception: never refused, stored readable.
        queue.finish(lease, "failed", text)
        error = queue.status(lease.run_id).error
        assert error is not None and "\x00" not in error and (error == text or "\\x" in error)


@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=hostile.filter(bool), value=hostile)
@example(name="a\x00b", value="v")
@example(name="\udc80", value="v")
@example(name="s", value="\udc80")
@example(name="é" * 1001, value="v")
def test_hostile_step_names_and_outputs_are_refused_before_the_save_or_read_back(
    queue: RunQueue, name: str, value: str
) -> None:
    ok, flow = _attempt(lambda: Workflow([Step(name, lambda ctx: value)]), "step")
    if not ok:
        return  # refused when the step is declared: earlier still
    checkpoint = flow.run_sync().checkpoint
    assert checkpoint is not None
    wf = f"w-{uuid.uuid4().hex}"
    run = queue.submit(wf, run_id=uuid.uuid4().hex)
    lease = queue.claim("w", {wf: None}, 30)
    assert lease is not None and lease.run_id == run
    ok, _ = _attempt(lambda: queue.save(lease, checkpoint, 30), "step")
    assert queue.checkpoint(run) == (checkpoint if ok else None)
    queue.finish(lease, "finished")


def test_the_longest_names_allowed_fit_the_servers_index(queue: RunQueue) -> None:
    run = "\U0001f600" * 200  # 800 bytes, the most a run id may take
    step = "é" * 900  # 1,800 bytes
    checkpoint = Workflow([Step(step, lambda ctx: "v")]).run_sync().checkpoint
    assert checkpoint is not None
    queue.submit("\U0001f600" * 200, run_id=run)
    lease = queue.claim("w", {"\U0001f600" * 200: None}, 30)
    assert lease is not None
    queue.save(lease, checkpoint, 30)
    assert queue.checkpoint(run) == checkpoint
    for bad, field in (
        ("x" * 201, "run_id"),
        ("a\x00b", "NUL"),
        ("\udc80", "surrogate"),
    ):
        with pytest.raises(ValueError, match=field):
            queue.submit("w", run_id=bad)
    too_long = Workflow([Step("\U0001f600" * 451, lambda ctx: "v")]).run_sync().checkpoint
    assert too_long is not None
    with pytest.raises(ValueError, match="1800 bytes"):
        queue.save(lease, too_long, 30)
    assert queue.checkpoint(run) == checkpoint


# -- the queue's own arguments ------------------------------------------------------


def test_sqlite_queue_on_a_file_that_is_not_a_queue_names_the_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("these are my notes, not a database " * 20)
    with pytest.raises(CorruptStoreError, match=r"notes\.txt: not a usable SQLite database"):
        SqliteQueue(text)
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE ekit_queue_runs (id INTEGER, payload TEXT)")
    conn.execute("CREATE TABLE ekit_queue_usage (x)")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError, match=r"other\.db: .*not a run queue"):
        SqliteQueue(other)
    conn = sqlite3.connect(other)
    conn.execute("DROP TABLE ekit_queue_runs")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError, match=r"other\.db: table ekit_queue_usage lacks column"):
        open_queue(str(other))
    for unopenable in (tmp_path / "no-such-folder" / "q.db", tmp_path):
        with pytest.raises(QueueUnavailableError, match="cannot open the queue's database") as refused:
            SqliteQueue(unopenable)
        assert refused.value.where == str(unopenable)


def test_postgres_queue_on_a_database_of_another_schema_is_refused(postgres_url: str) -> None:
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE ekit_queue_runs (id integer)")
    with pytest.raises(CorruptStoreError, match="ekit_queue_runs lacks column"):
        open_queue(postgres_url)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://ekit:SECRETpw@127.0.0.1:1/db?connect_timeout=5",
        "host=127.0.0.1 port=1 user=ekit password=SECRETpw dbname=db connect_timeout=5",
        "postgresql://ekit:pa%zzSECRETpw@127.0.0.1:1/db",
        "postgresql://ekit:SECRETpw@[::1/db",
        "host=nowhere.invalid password='SECRETpw' connect_timeout=5",
    ],
)
def test_an_unreachable_or_unparsable_postgres_is_a_clear_error_without_the_password(dsn: str) -> None:
    pytest.importorskip("psycopg")
    with pytest.raises(QueueUnavailableError) as refused:
        open_queue(dsn)
    text = str(refused.value)
    assert "SECRET" not in text and "SECRET" not in refused.value.where
    assert "cannot open the queue's database" in text and "***" in refused.value.where
    assert refused.value.__cause__ is None and refused.value.__suppress_context__


def test_a_key_value_dsn_opens_postgres_and_a_foreign_url_is_refused(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    server = postgres_dsn()
    assert "=" in server and "://" not in server  # the test server's DSN is libpq's key=value form
    # The same spelling, for this test's own database.
    dsn = " ".join(f"{k}={v}" for k, v in parse_qsl(urlsplit(postgres_url).query))
    q = open_queue(dsn)
    try:
        assert q.backend == "postgres"
        run = q.submit("w")
        with open_queue(postgres_url) as same:  # type: ignore[attr-defined]
            assert same.status(run).run_id == run  # the same database
    finally:
        q.close()
    assert list(tmp_path.iterdir()) == []  # no SQLite file named after the DSN
    for url in ("mysql://root:SECRETpw@db/x", "redis://x", "weird=1 x"):
        with pytest.raises(QueueUnavailableError, match="not a queue url") as refused:
            open_queue(url)
        assert "SECRET" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []
    assert open_queue("./weird=1.db").backend == "sqlite"  # a file so named, written as a path


@pytest.mark.parametrize(
    ("key", "step", "field"),
    [
        ("w", "a\x00b", "step"),
        ("w", "\udc80", "step"),
        ("w", "\U0001f600" * 451, "step name"),
        ("\x00", "fine", "registry key"),
    ],
)
def test_a_worker_refuses_what_the_queue_cannot_store_before_any_step_runs(
    queue: RunQueue, key: str, step: str, field: str
) -> None:
    from ekit_runtime.queue import Worker

    ran: list[str] = []
    with pytest.raises(ValueError, match=field):  # when the step is declared, or when the worker is made
        flow = Workflow([Step("ok", lambda ctx: ran.append("ok")), Step(step, lambda ctx: 2, ("ok",))])
        Worker(queue, {key: flow})
    assert ran == []


def test_an_idle_timeout_beyond_the_servers_range_is_refused_naming_it(postgres_url: str) -> None:
    from ekit_runtime.queue import PostgresQueue

    with pytest.raises(ValueError, match="idle_timeout must be at most 2147483 seconds") as refused:
        PostgresQueue(postgres_url, idle_timeout=1e7)
    assert not isinstance(refused.value, QueueUnavailableError)
    PostgresQueue(postgres_url, idle_timeout=2147483).close()


@pytest.mark.parametrize(
    ("table", "column", "value"),
    [
        ("ekit_queue_entries", "saved", "'seven'"),
        ("ekit_queue_entries", "saved", "-1"),
        ("ekit_queue_entries", "ord", "'x'"),
        ("ekit_queue_entries", "ord", "1.5"),
        ("ekit_queue_runs", "counted", "'x'"),
        # (A number shifted into ord must fit 64 bits: the next save would overflow it.)
        ("ekit_queue_entries", "saved", str(2**31)),
        ("ekit_queue_runs", "counted", str(2**40)),
    ],
)
def test_a_save_number_edited_by_hand_is_refused_naming_its_column(
    tmp_path: Path, table: str, column: str, value: str
) -> None:
    # The save numbers say whose counts are newest and where a lease's saves go on from.
    path = tmp_path / "q.db"
    checkpoints = chain_checkpoints(2)
    with SqliteQueue(path) as q:
        q.submit("w", run_id="r")
        lease = q.claim("me", {"w": None}, 60)
        assert lease is not None
        for cp in checkpoints:
            q.save(lease, cp, 60)  # (the second through the narrow view: an entry with a save number)
        q.release(lease)
    raw = sqlite3.connect(path, isolation_level=None)
    where = "kind = 'output' AND name = 's1'" if table == "ekit_queue_entries" else "run_id = 'r'"
    raw.execute(f"UPDATE {table} SET {column} = {value} WHERE {where}")
    raw.close()
    with SqliteQueue(path) as q:
        with pytest.raises(CorruptStoreError, match=f"run 'r'.*column {column} holds"):
            q.checkpoint("r")
        with pytest.raises(CorruptStoreError, match=f"column {column} holds"):
            q.claim("me", {"w": checkpoints[-1].fingerprint}, 60)

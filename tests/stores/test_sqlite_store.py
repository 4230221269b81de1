"""The SQLite store: durability and waiting by default, threads, the path it keeps, closed
connections, foreign tables and views, in-memory databases, one run beside another, rollbacks.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import CorruptStoreError, SqliteStore, StoreLockedError
from tests.support.store_helpers import make_checkpoint


def test_sqlite_is_durable_by_default(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "cp.db", run_id="r") as store:
        assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_sqlite_waits_for_another_connections_write_lock(tmp_path: Path) -> None:
    """Runs of one database share its write lock: a save waits for another's (30 s), not 5 s."""
    with SqliteStore(tmp_path / "cp.db", run_id="r") as store:
        assert store.conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 30_000


def test_sqlite_store_saves_and_loads_from_another_thread(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cp.db", run_id="r")
    errors: list[BaseException] = []

    def work() -> None:
        try:
            store(make_checkpoint(1, {"a": 1}))
            assert store.load() == make_checkpoint(1, {"a": 1})
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    store.close()
    assert errors == []


def test_sqlite_keeps_the_path_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with SqliteStore("cp.db", run_id="r") as store:
        assert store.path == "cp.db"
        assert repr(store) == "SqliteStore('cp.db', run_id='r')"


def test_sqlite_error_on_a_closed_connection_keeps_its_type_and_names_the_database(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cp.db", run_id="r")
    store.conn.close()
    with pytest.raises(sqlite3.ProgrammingError) as info:
        store.load()
    assert str(info.value).startswith(f"{tmp_path / 'cp.db'}: ")
    store.close()


def test_sqlite_store_on_a_closed_shared_connection_names_it() -> None:
    conn = sqlite3.connect(":memory:")
    conn.close()
    with pytest.raises(sqlite3.ProgrammingError) as info:
        SqliteStore(conn, run_id="r")
    assert str(info.value).startswith("<sqlite3.Connection>: ")


def test_sqlite_a_view_of_the_tables_name_is_refused_as_a_view(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "cp.db")
    conn.execute("CREATE VIEW ekit_runs AS SELECT 1 AS x")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError, match="ekit_runs is a view, not the store's table"):
        SqliteStore(tmp_path / "cp.db", run_id="r")


@pytest.mark.parametrize(
    ("ddl", "described"),
    [
        ("CREATE TABLE ekit_entries (a, b, c, PRIMARY KEY (b, a))", "columns a, b, c; primary key b, a"),
        ("CREATE TABLE ekit_entries (a, b)", "columns a, b; primary key none"),
    ],
    ids=["keyed", "unkeyed"],
)
def test_sqlite_a_foreign_table_is_described_by_its_columns_and_key(
    tmp_path: Path, ddl: str, described: str
) -> None:
    conn = sqlite3.connect(tmp_path / "cp.db")
    conn.execute(ddl)
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStoreError) as info:
        SqliteStore(tmp_path / "cp.db", run_id="r")
    assert f"ekit_entries is a table of its own ({described}), not SqliteStore's" in str(info.value)


def test_sqlite_two_in_memory_databases_do_not_share_a_writer() -> None:
    one, two = sqlite3.connect(":memory:"), sqlite3.connect(":memory:")
    first, second = SqliteStore(one, run_id="r"), SqliteStore(two, run_id="r")
    first(make_checkpoint(1, {"a": 1}))
    second(make_checkpoint(1, {"b": 2}))
    assert (first.load(), second.load()) == (make_checkpoint(1, {"a": 1}), make_checkpoint(1, {"b": 2}))
    first.close()
    second.close()
    one.close()
    two.close()


def test_sqlite_deleting_its_own_run_keeps_the_lock_and_another_run_lets_it_go(tmp_path: Path) -> None:
    db = tmp_path / "cp.db"
    with SqliteStore(db, run_id="r") as store:
        store(make_checkpoint(1, {"a": 1}))
        with SqliteStore(db, run_id="other") as other:
            other(make_checkpoint(1, {"o": 1}))
        assert store.delete("r")
        with SqliteStore(db, run_id="r") as rival, pytest.raises(StoreLockedError):
            rival(make_checkpoint(1, {"b": 2}))
        assert store.delete("other")
        with SqliteStore(db, run_id="other") as other:
            other(make_checkpoint(1, {"o": 2}))
    assert SqliteStore(db, run_id="other").load() == make_checkpoint(1, {"o": 2})


def test_sqlite_load_of_a_run_id_that_is_not_text_names_its_type(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cp.db", run_id="r")
    with pytest.raises(ValueError, match=r"^run_id must be a string, got int$"):
        store.load(5)  # type: ignore[arg-type]
    store.close()


def test_sqlite_loading_another_run_does_not_change_what_this_run_rewrites(tmp_path: Path) -> None:
    """The first text of each of this run's outputs survives a load() of another run."""
    db = tmp_path / "cp.db"
    shared = [1]
    with SqliteStore(db, run_id="a") as mine, SqliteStore(db, run_id="b") as theirs:
        mine(make_checkpoint(1, {"s0": shared}))
        theirs(make_checkpoint(1, {"s0": "theirs"}))
        shared.append(2)  # a later step mutates the saved output in place
        mine.load("b")
        mine(make_checkpoint(2, {"s0": shared, "s1": 1}, context={"changed": True}))  # a full rewrite
    loaded = SqliteStore(db, run_id="x").load("a")
    assert loaded is not None and loaded.outputs["s0"] == [1]


class _EndsFail:
    """A connection whose COMMIT and ROLLBACK both fail, the rest passed through."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql in ("COMMIT", "ROLLBACK"):
            raise sqlite3.OperationalError(f"{sql} refused")
        return self._conn.execute(sql, *args)


def test_sqlite_a_failed_rollback_is_a_note_on_the_original_error(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cp.db", run_id="r")
    real = store.conn
    store.conn = _EndsFail(real)  # type: ignore[assignment]
    with pytest.raises(sqlite3.OperationalError, match="COMMIT refused") as info:
        store(make_checkpoint(1, {"a": 1}))
    assert info.value.__notes__ == ["and the rollback failed too: ROLLBACK refused"]
    real.execute("ROLLBACK")
    store.conn = real
    store.close()

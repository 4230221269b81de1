"""The stores' rules that a plausible change could break silently.

Each test pins one promise of docs/stores.md: what is stored for a step
never changes after a later mutation; loading agrees with saving about NaN;
files follow the umask, keep their mode and are written through symlinks;
a torn journal tail is cut even before a shorter record; ``durable=True``
really fsyncs; SQLite writes in ``BEGIN IMMEDIATE`` transactions, refuses a
database whose tables are not its own, and names the database in its errors.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import (
    CorruptStoreError,
    JournalStore,
    JsonFileStore,
    SqliteStore,
    Step,
    Workflow,
    WorkflowCheckpoint,
)
from tests.support.store_helpers import Factory, store_factories

FACTORIES = store_factories("r")


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Open the store under test in a fresh folder (same file every call); close them all after."""
    opened: list[Any] = []

    def open_store(**kw: Any) -> Any:
        opened.append(FACTORIES[request.param](tmp_path, **kw))
        return opened[-1]

    yield open_store
    for store in opened:
        store.close()


def _cp(outputs: dict[str, Any], **fields: Any) -> WorkflowCheckpoint:
    return WorkflowCheckpoint(len(outputs), MappingProxyType(dict(outputs)), **fields)


def _ctx(**values: Any) -> MappingProxyType[str, Any]:
    return MappingProxyType(values)


# -- the mutation rule ------------------------------------------------------------

# A codec other than the default: the stores cannot splice its text, so they
# decode the first encoding again (docs/stores.md).
SPACED = {
    "dumps": lambda data: json.dumps(data, ensure_ascii=False, separators=(", ", ": ")),
    "loads": json.loads,
}


@pytest.mark.parametrize("codec", [{}, SPACED], ids=["default codec", "other codec"])
def test_what_is_stored_for_a_step_never_changes_after_a_mutation(make: Factory, codec: Any) -> None:
    value = {"items": [1], "note": "first"}
    store = make(**codec)
    store(_cp({"a": value}, context=_ctx(k=1)))
    value["items"].append(2)  # a later step mutates the output it was given
    value["note"] = "changed"
    store(_cp({"a": value, "b": "B"}, context=_ctx(k=1)))  # a delta for the journal and SQLite
    store(_cp({"a": value, "b": "B", "c": "C"}, context=_ctx(k=2)))  # a full rewrite everywhere
    loaded = make(**codec).load()
    assert loaded.outputs["a"] == {"items": [1], "note": "first"}
    assert dict(loaded.outputs) == {"a": {"items": [1], "note": "first"}, "b": "B", "c": "C"}
    assert dict(loaded.context) == {"k": 2}


def test_a_compacting_journal_keeps_first_encodings_too(tmp_path: Path) -> None:
    value = ["first"]
    store = JournalStore(tmp_path / "cp.jsonl", compact_after=1)
    store(_cp({"a": value}))
    value.append("mutated")
    for n in range(3):  # each second save rewrites the journal whole
        store(_cp({"a": value, **{f"s{i}": i for i in range(n + 1)}}))
    assert JournalStore(tmp_path / "cp.jsonl").load().outputs["a"] == ["first"]
    store.close()


def test_outputs_loaded_then_mutated_are_written_as_loaded(make: Factory) -> None:
    with make() as first:
        first(_cp({"a": {"items": [1]}}, context=_ctx(k=1)))
    store = make()
    loaded = store.load()
    loaded.outputs["a"]["items"].append("resumed step mutated me")
    store(_cp({**loaded.outputs, "b": "B"}, context=_ctx(k=2)))  # a full rewrite
    assert make().load().outputs["a"] == {"items": [1]}


def test_a_run_whose_step_mutates_an_earlier_output_stores_the_original(make: Factory) -> None:
    def a(ctx: dict[str, Any]) -> dict[str, Any]:
        return {"items": [1]}

    def b(ctx: dict[str, Any]) -> str:
        ctx["a"]["items"].append("b was here")  # after a's output was saved
        return "B"

    workflow = Workflow([Step("a", a), Step("b", b, ("a",)), Step("c", lambda ctx: "C", ("b",))])
    result = workflow.run_sync(checkpoint_fn=make(), max_concurrency=1)
    # The library never copies outputs: the caller's object shows the mutation...
    assert result.outputs["a"] == {"items": [1, "b was here"]}
    # ...and every store holds the output as it was when a finished.
    assert make().load().outputs["a"] == {"items": [1]}


def test_a_different_object_under_a_name_is_encoded_afresh(make: Factory) -> None:
    store = make()
    store(_cp({"a": [1]}, fingerprint="run-1"))
    store(_cp({"a": [2]}, fingerprint="run-2"))  # another run with a step of the same name
    assert make().load().outputs["a"] == [2]


def test_the_json_file_is_still_exactly_to_dict(tmp_path: Path) -> None:
    from ekit_runtime.stores.codec import default_dumps

    store = JsonFileStore(tmp_path / "cp.json")
    outputs: dict[str, Any] = {}
    for i in range(5):
        outputs[f"s{i} ✓"] = {"n": i, "text": "é\n\"\\", "list": [None, True, 1.5]}
        checkpoint = _cp(outputs, context=_ctx(user="Zoë"))
        store(checkpoint)
        raw = (tmp_path / "cp.json").read_bytes()
        assert raw == default_dumps(checkpoint.to_dict()).encode()
    store.close()


# -- NaN and infinities: refused on load as on save ----------------------------------

COST = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_file_with_nan_is_corrupt_naming_the_place(tmp_path: Path, constant: str) -> None:
    path = tmp_path / "cp.json"
    path.write_text(f'{{"step_index": 1, "outputs": {{"a": [1, {constant}]}}, "cost": {json.dumps(COST)}}}')
    with pytest.raises(
        CorruptStoreError, match=rf"cp\.json: .*{constant} at \['outputs'\]\['a'\]\[1\]"
    ):
        JsonFileStore(path).load()


def test_journal_with_nan_is_corrupt_naming_the_line(tmp_path: Path) -> None:
    from ekit_runtime.stores.journal import _frame

    path = tmp_path / "cp.jsonl"
    with JournalStore(path) as store:
        store(_cp({"a": 1}))
    delta = b'{"kind":"delta","step_index":2,"outputs":{"b":{"x":NaN}},"cost":%s}' % json.dumps(
        COST
    ).encode()
    path.write_bytes(path.read_bytes() + _frame(delta))
    refused = r"cp\.jsonl, line 2: record does not decode .*NaN at \['outputs'\]\['b'\]\['x'\]"
    with pytest.raises(CorruptStoreError, match=refused) as info:
        JournalStore(path).load()
    assert info.value.line == 2


@pytest.mark.parametrize(("column", "what"), [("value", "output of step 'a'"), ("failures", "failures")])
def test_sqlite_with_nan_is_corrupt_naming_the_run_and_value(
    tmp_path: Path, column: str, what: str
) -> None:
    db = tmp_path / "cp.db"
    with SqliteStore(db, run_id="r") as store:
        store(_cp({"a": 1}))
    conn = sqlite3.connect(db, isolation_level=None)
    table = "ekit_entries" if column == "value" else "ekit_runs"
    conn.execute(f"UPDATE {table} SET {column} = ?", ('{"x": [Infinity]}',))
    conn.close()
    with SqliteStore(db, run_id="r") as store, pytest.raises(
        CorruptStoreError, match=rf"cp\.db, run 'r': {what} does not decode .*Infinity at \['x'\]\[0\]"
    ):
        store.load()


def test_a_custom_loads_may_still_accept_nan(make: Factory) -> None:
    codec = {"dumps": lambda d: json.dumps(d), "loads": json.loads}
    make(**codec)(_cp({"a": float("inf")}))
    assert make(**codec).load().outputs["a"] == float("inf")


# -- file modes and symlinks ---------------------------------------------------------


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    """Set the process umask for the test; the previous one comes back after it."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("kind", ["json", "journal"])
@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_new_files_follow_the_umask(
    tmp_path: Path, umask: Callable[[int], None], kind: str, mask: int
) -> None:
    umask(mask)
    store = FACTORIES[kind](tmp_path)
    store(_cp({"a": 1}))
    assert _mode(Path(store.path)) == 0o666 & ~mask
    (lock,) = [p for p in tmp_path.iterdir() if p.name.endswith(".lock")]
    assert _mode(lock) == 0o666 & ~mask
    store.close()


@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_chmod_survives_full_saves(tmp_path: Path, kind: str) -> None:
    store = FACTORIES[kind](tmp_path)
    store(_cp({"a": 1}))
    path = Path(store.path)
    path.chmod(0o640)
    store(_cp({"a": 1, "b": 2}, context=_ctx(new=True)))  # a full write for the journal too
    assert _mode(path) == 0o640
    if isinstance(store, JournalStore):
        store(_cp({"a": 1, "b": 2, "c": 3}, context=_ctx(new=True)))  # an append
        assert store.compact() is not None
        assert _mode(path) == 0o640
    assert FACTORIES[kind](tmp_path).load().step_index >= 2
    store.close()


@pytest.mark.parametrize("kind", ["json", "journal"])
def test_saves_go_through_a_symlink_to_its_target(tmp_path: Path, kind: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    target = data / ("real.json" if kind == "json" else "real.jsonl")
    link = tmp_path / "link"
    link.symlink_to(target)
    store = JsonFileStore(link) if kind == "json" else JournalStore(link)
    for n in range(1, 4):
        store(_cp({f"s{i}": i for i in range(n)}, context=_ctx(n=n)))  # full writes
        store(_cp({f"s{i}": i for i in range(n + 1)}, context=_ctx(n=n)))
    assert link.is_symlink() and link.resolve() == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "link"]
    assert sorted(p.name for p in data.iterdir()) == [target.name, target.name + ".lock"]
    reader = JsonFileStore(target) if kind == "json" else JournalStore(target)
    assert reader.load() == _cp({f"s{i}": i for i in range(4)}, context=_ctx(n=3))
    with pytest.raises(ValueError, match="held by another store object"):
        reader(_cp({}))  # the link and its target are one file: one writer
    store.close()


# -- a torn journal tail, then a shorter record ---------------------------------------


def _journal_lines(path: Path, *checkpoints: WorkflowCheckpoint) -> list[bytes]:
    with JournalStore(path, durable=False) as store:
        for checkpoint in checkpoints:
            store(checkpoint)
    return path.read_bytes().splitlines(keepends=True)


@pytest.mark.parametrize("damage", ["cut", "bad checksum"])
def test_a_torn_tail_is_cut_before_a_shorter_record_at_every_offset(tmp_path: Path, damage: str) -> None:
    """The record appended after a torn tail is shorter than the tail: dropping the cut fails."""
    base = _cp({"a": "A"})
    long = _cp({"a": "A", "big": "ü" * 300})
    short = _cp({"a": "A", "b": 1})
    first, torn_line = _journal_lines(tmp_path / "long.jsonl", base, long)
    _, short_line = _journal_lines(tmp_path / "short.jsonl", base, short)
    path = tmp_path / "cp.jsonl"
    if damage == "cut":
        tails = [torn_line[:cut] for cut in range(1, len(torn_line))]
    else:
        flipped = b"%08x" % (int(torn_line[6:14], 16) ^ 1)
        tails = [torn_line[:6] + flipped + torn_line[14:]]
    shorter = 0
    for tail in tails:
        path.write_bytes(first + tail)
        store = JournalStore(path, durable=False)
        assert store.load() == base
        assert store.torn_tail == len(tail)
        store(short)
        store.close()
        assert path.read_bytes() == first + short_line
        again = JournalStore(path)
        assert again.load() == short and again.torn_tail == 0
        shorter += len(short_line) < len(tail)
    assert shorter >= len(tails) // 2  # most tails are longer than the record after them


# -- durable=True fsyncs; durable=False does not -------------------------------------


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every os.fsync call, as (inode, is a folder)."""
    calls: list[tuple[int, bool]] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        calls.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


@pytest.mark.parametrize("durable", [True, False])
def test_journal_fsyncs_full_writes_and_appends(
    tmp_path: Path, fsyncs: list[tuple[int, bool]], durable: bool
) -> None:
    path = tmp_path / "cp.jsonl"
    store = JournalStore(path, durable=durable, compact_after=2)
    folder = (tmp_path.stat().st_ino, True)
    kinds = []
    for n in range(1, 6):
        fsyncs.clear()
        store(_cp({f"s{i}": i for i in range(n)}))
        kinds.append(json.loads(path.read_bytes().splitlines()[-1])["r"]["kind"])
        journal = (path.stat().st_ino, False)
        if not durable:
            assert fsyncs == []
        elif kinds[-1] == "full":  # the new file before its rename, then the folder
            assert fsyncs == [journal, folder]
        else:  # the appended line
            assert fsyncs == [journal]
    assert kinds == ["full", "delta", "delta", "full", "delta"]
    fsyncs.clear()
    store.compact()
    assert fsyncs == ([(path.stat().st_ino, False), folder] if durable else [])
    store.close()


@pytest.mark.parametrize("durable", [True, False])
def test_json_file_fsyncs_the_file_and_its_folder(
    tmp_path: Path, fsyncs: list[tuple[int, bool]], durable: bool
) -> None:
    path = tmp_path / "cp.json"
    with JsonFileStore(path, durable=durable) as store:
        for n in range(1, 3):
            fsyncs.clear()
            store(_cp({f"s{i}": i for i in range(n)}))
            expected = [(path.stat().st_ino, False), (tmp_path.stat().st_ino, True)]
            assert fsyncs == (expected if durable else [])


@pytest.mark.parametrize(("durable", "level"), [(True, 2), (False, 1)])  # FULL, NORMAL
def test_sqlite_durability_is_its_synchronous_pragma(tmp_path: Path, durable: bool, level: int) -> None:
    with SqliteStore(tmp_path / "cp.db", run_id="r", durable=durable) as store:
        store(_cp({"a": 1}))
        assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == level
        assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# -- SQLite: BEGIN IMMEDIATE, its own tables, errors naming the database -------------


def test_sqlite_writes_begin_immediate_and_reads_begin_deferred(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "cp.db", run_id="r")
    statements: list[str] = []
    store.conn.set_trace_callback(statements.append)
    for n in range(1, 4):
        store(_cp({f"s{i}": i for i in range(n)}))
    store.delete("r")
    store(_cp({"a": 1}))
    store.load()
    begins = [s for s in statements if s.startswith("BEGIN")]
    assert begins == ["BEGIN IMMEDIATE"] * 5 + ["BEGIN"]
    store.close()


def test_sqlite_a_save_takes_the_write_lock_at_begin(tmp_path: Path) -> None:
    """Behaviourally: with another connection writing, the save fails at BEGIN, before any write."""
    db = tmp_path / "cp.db"
    conn = sqlite3.connect(db, isolation_level=None, timeout=0)
    store = SqliteStore(conn, run_id="r")
    store(_cp({"a": 1}))
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    with pytest.raises(sqlite3.OperationalError, match=rf"^{re.escape(str(db))}: database is locked"):
        store(_cp({"a": 1, "b": 2}))
    # A deferred BEGIN would succeed here, and the UPDATE after it would fail.
    assert statements == ["BEGIN IMMEDIATE"]
    other.execute("ROLLBACK")
    other.close()
    store(_cp({"a": 1, "b": 2}))
    assert SqliteStore(conn, run_id="r").load() == _cp({"a": 1, "b": 2})
    store.close()
    conn.close()


FOREIGN = {
    "ekit_runs": "CREATE TABLE ekit_runs (id INTEGER PRIMARY KEY, name TEXT)",
    "ekit_entries": "CREATE TABLE ekit_entries (run_id TEXT, value TEXT)",
    "ekit_runs view": "CREATE VIEW ekit_runs AS SELECT 1 AS run_id",
    "ekit_entries without rowid": (
        "CREATE TABLE ekit_entries (run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, "
        "value TEXT NOT NULL, PRIMARY KEY (run_id, kind, name)) WITHOUT ROWID"
    ),
    "ekit_runs without a primary key": (
        "CREATE TABLE ekit_runs (run_id TEXT, header TEXT, step_index INTEGER, input_tokens "
        "INTEGER, output_tokens INTEGER, llm_calls INTEGER, failures TEXT, saves INTEGER, "
        "updated_at REAL)"
    ),
}


@pytest.mark.parametrize("table", list(FOREIGN))
@pytest.mark.parametrize("given", ["path", "connection"])
def test_sqlite_a_foreign_table_of_the_same_name_is_refused_at_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, table: str, given: str
) -> None:
    db = tmp_path / "theirs.db"
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(FOREIGN[table])
    opened: list[sqlite3.Connection] = []
    real = sqlite3.connect

    def connect(*args: Any, **kw: Any) -> sqlite3.Connection:
        opened.append(real(*args, **kw))
        return opened[-1]

    monkeypatch.setattr(sqlite3, "connect", connect)
    name = table.split()[0]
    refused = rf"theirs\.db: {name} is a .*not (SqliteStore's|the store's)"
    with pytest.raises(CorruptStoreError, match=refused):
        SqliteStore(db if given == "path" else conn, run_id="r")
    if given == "path":  # the store closes what it opened
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            opened[0].execute("SELECT 1")
    conn.close()


def test_sqlite_errors_name_the_database(tmp_path: Path) -> None:
    missing = tmp_path / "no such folder" / "cp.db"
    # Refused before sqlite3 is asked, naming the argument and the folder.
    expected = rf"^database {re.escape(repr(str(missing)))}: its folder .* does not exist"
    with pytest.raises(ValueError, match=expected):
        SqliteStore(missing, run_id="r")
    db = tmp_path / "cp.db"
    with SqliteStore(db, run_id="r") as store:
        store(_cp({"a": 1}))
        store.conn.execute(
            "CREATE TRIGGER no AFTER INSERT ON ekit_entries BEGIN SELECT RAISE(ABORT, 'nope'); END"
        )
        with pytest.raises(sqlite3.IntegrityError, match=rf"^{re.escape(str(db))}: nope") as info:
            store(_cp({"a": 1, "b": 2}))
        assert info.value.sqlite_errorname == "SQLITE_CONSTRAINT_TRIGGER"  # still sqlite3's own error
        store.conn.execute("DROP TRIGGER no")
        store(_cp({"a": 1, "b": 2}))
    conn = sqlite3.connect(db, isolation_level=None)
    shared = SqliteStore(conn, run_id="r")
    assert shared.path == str(db)  # a connection's store names its file too
    assert repr(shared) == f"SqliteStore({str(db)!r}, run_id='r')"
    shared.close()
    conn.close()


def test_sqlite_a_run_id_that_sqlite_cannot_hold_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run_id must be encodable as UTF-8"):
        SqliteStore(tmp_path / "cp.db", run_id="lone \ud800")


def test_sqlite_lock_files_go_beside_the_database(tmp_path: Path, umask: Callable[[int], None]) -> None:
    umask(0o027)
    with SqliteStore(tmp_path / "cp.db", run_id="nightly ✓") as store:
        store(_cp({"a": 1}))
        (lock,) = [p for p in tmp_path.iterdir() if p.name.endswith(".lock")]
        assert lock.name.startswith("cp.db-ekit-nightly__-") and _mode(lock) == 0o640
    assert not lock.exists()

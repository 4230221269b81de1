"""One writer per file (per run id for SQLite), enforced: real processes, then one process.

The process tests drive children of tests/support/crash_child.py through pipes (a
line each way), never sleeps: a holder takes a store's write lock and keeps
saving while a second writer is refused and a reader loads all along; a
SIGKILLed holder leaves the store to the next writer. The in-process tests
pin the rest: the lock's life (first save to close, ``with``, garbage
collection), a lost lock, a store that finds another writer's saves since
it last read, and a journal that never cuts lines it did not write.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import (
    JournalStore,
    JsonFileStore,
    SqliteStore,
    StoreLockedError,
    WorkflowCheckpoint,
)
from ekit_runtime import stores as stores_package

CHILD = Path(__file__).resolve().parents[1] / "support" / "crash_child.py"
KINDS = ("json", "journal", "sqlite")
SUFFIX = {"json": "cp.json", "journal": "cp.jsonl", "sqlite": "cp.db"}
RUN_ID = "crash-run"  # crash_child.RUN_ID

Factory = Callable[..., Any]


def _open(kind: str, path: Path, run_id: str = RUN_ID) -> Any:
    if kind == "json":
        return JsonFileStore(path)
    if kind == "journal":
        return JournalStore(path)
    return SqliteStore(path, run_id=run_id)


def _cp(count: int, **extra: Any) -> WorkflowCheckpoint:
    outputs = {f"s{i}": f"output {i} ✓" for i in range(count)}
    return WorkflowCheckpoint(count, MappingProxyType({**outputs, **extra}))


def _lock_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".lock"))


# -- real processes -----------------------------------------------------------------


class Child:
    """A child of crash_child.py, spoken to one line at a time."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith(prefix):
            _, err = self.proc.communicate(timeout=30)
            pytest.fail(f"expected {prefix!r}, got {line!r}; stderr:\n{err.decode()}")
        return line.rstrip("\n")

    def finish(self) -> str:
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err.decode()
        return out.decode()


def _write(kind: str, path: Path, *run_id: str) -> str:
    writer = Child("write", kind, str(path), *run_id)
    return writer.finish().strip()


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_process_is_refused_while_a_reader_loads_throughout(kind: str, tmp_path: Path) -> None:
    path = tmp_path / SUFFIX[kind]
    holder = Child("hold", kind, str(path))
    holder.expect("held")
    reader = Child("read", kind, str(path))
    reader.expect("reading")
    holder.send("save 40")  # the holder saves while the next writer tries
    refused = _write(kind, path)
    holder.expect("saved")
    assert refused.startswith("refused "), refused
    assert str(path) in refused
    assert f"held by process {holder.proc.pid}" in refused
    assert "To take over, close that store" in refused
    if kind == "sqlite":
        assert f"run {RUN_ID!r}" in refused
        # The lock is per run: another run of the same database is written meanwhile.
        assert _write(kind, path, "another-run") == "saved"
    summary = json.loads(reader.finish())  # communicate() ends its stdin: "stop"
    assert summary["errors"] == []  # never a CorruptStoreError, whatever it caught mid-save
    assert summary["loads"] >= 1
    assert set(summary["seen"]) <= set(range(1, 42))
    # The refused writer wrote nothing: the store holds the holder's 41 outputs.
    final = _open(kind, path).load()
    assert final.step_index == 41 and list(final.outputs) == [f"w{i:04d}" for i in range(41)]
    holder.send("exit")
    holder.finish()
    assert _lock_files(tmp_path) == []
    # Closed, the holder's lock is free: the next writer goes on from its checkpoint.
    assert _write(kind, path) == "saved"
    assert _open(kind, path).load().step_index == 42


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("kind", KINDS)
def test_a_sigkilled_holder_leaves_the_store_to_the_next_writer(kind: str, tmp_path: Path) -> None:
    path = tmp_path / SUFFIX[kind]
    holder = Child("hold", kind, str(path))
    holder.expect("held")
    holder.send("save 2")
    holder.expect("saved")
    assert _write(kind, path).startswith("refused ")
    holder.proc.kill()
    holder.proc.communicate(timeout=30)
    assert holder.proc.returncode == -signal.SIGKILL
    # The lock file outlives its holder, naming a dead pid; the OS freed the lock.
    assert len(_lock_files(tmp_path)) == 1
    assert _write(kind, path) == "saved"
    assert _open(kind, path).load().step_index == 4
    # And the next writer in this process takes it as well.
    store = _open(kind, path)
    loaded = store.load()
    store(_cp(0, **loaded.outputs, extra="✓"))
    store.close()
    assert list(_open(kind, path).load().outputs)[-1] == "extra"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("kind", KINDS)
def test_a_forked_child_does_not_inherit_the_right_to_write(kind: str, tmp_path: Path) -> None:
    path = tmp_path / SUFFIX[kind]
    store = _open(kind, path)
    store(_cp(1))
    pid = os.fork()
    if pid == 0:  # the child: the inherited store must not write, nor free the lock
        code = 1
        try:
            store(_cp(2))
        except StoreLockedError:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    with pytest.raises(StoreLockedError):  # the child's exit left the parent's lock alone
        _open(kind, path)(_cp(2))
    store(_cp(2))
    assert _open(kind, path).load() == _cp(2)
    store.close()


# -- one process --------------------------------------------------------------------


def _json(folder: Path) -> JsonFileStore:
    return JsonFileStore(folder / "cp.json")


def _journal(folder: Path) -> JournalStore:
    return JournalStore(folder / "cp.jsonl")


def _sqlite(folder: Path) -> SqliteStore:
    return SqliteStore(folder / "cp.db", run_id="r")


@pytest.fixture(params=["json", "journal", "sqlite"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Factory:
    """A function opening the store under test in a fresh folder (same file every call)."""
    factory = {"json": _json, "journal": _journal, "sqlite": _sqlite}[request.param]
    return lambda: factory(tmp_path)


def test_the_error_is_exported_and_documented() -> None:
    import ekit_runtime

    assert ekit_runtime.StoreLockedError is stores_package.StoreLockedError is StoreLockedError
    assert issubclass(StoreLockedError, ValueError)
    assert StoreLockedError.__doc__ and "take over" in StoreLockedError.__doc__


def test_a_second_store_object_is_refused_until_the_first_closes(make: Factory, tmp_path: Path) -> None:
    first, second = make(), make()
    assert second.load() is None  # reading needs no lock
    assert _lock_files(tmp_path) == []  # nor does opening: the first save takes it
    first(_cp(1))
    assert len(_lock_files(tmp_path)) == 1
    with pytest.raises(StoreLockedError, match="held by another store object in this process") as info:
        second(_cp(2))
    error = info.value
    assert error.path == first.path and error.pid == os.getpid()
    assert error.lock_path is not None and Path(error.lock_path).parent == tmp_path
    assert error.run_id == ("r" if isinstance(first, SqliteStore) else None)
    assert "close that store" in str(error) and str(error).startswith(str(error.path))
    assert make().load() == _cp(1)  # nothing of the refused save reached the file
    first(_cp(2))  # the holder goes on
    assert second.load() == _cp(2)
    first.close()
    assert _lock_files(tmp_path) == []  # released normally, the lock file goes
    second(_cp(3))
    assert make().load() == _cp(3)
    second.close()


def test_a_with_block_releases_the_lock(make: Factory) -> None:
    with make() as store:
        store(_cp(1))
        with pytest.raises(StoreLockedError):
            make()(_cp(2))
    other = make()
    other(_cp(2))
    assert make().load() == _cp(2)
    other.close()


def test_a_store_nobody_references_does_not_keep_the_lock(make: Factory) -> None:
    store = make()
    store(_cp(1))
    store.cycle = store  # only the cycle collector can free it now
    del store
    other = make()
    other(_cp(2))  # collected before refusing: the garbage store's lock is gone
    assert make().load() == _cp(2)
    other.close()
    gc.collect()


@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_closed_file_store_takes_the_lock_again_at_its_next_save(kind: str, tmp_path: Path) -> None:
    store = _open(kind, tmp_path / SUFFIX[kind])
    store(_cp(1))
    store.close()
    store(_cp(2))
    with pytest.raises(StoreLockedError):
        _open(kind, tmp_path / SUFFIX[kind])(_cp(3))
    store.close()


def test_a_store_whose_lock_file_was_removed_is_refused_for_good(make: Factory, tmp_path: Path) -> None:
    store = make()
    store(_cp(1))
    (lock,) = _lock_files(tmp_path)
    (tmp_path / lock).unlink()  # a cleaner, or a user, removed it while held
    other = make()
    other.load()
    other(_cp(2))  # takes a new lock on a new file: it is the writer now
    for _ in range(2):
        with pytest.raises(StoreLockedError, match="lost its write lock"):
            store(_cp(3))
    assert make().load() == _cp(2)
    store.close()  # must leave the new holder's lock file alone
    assert _lock_files(tmp_path) == [lock]
    other(_cp(3))
    other.close()


def test_a_save_after_another_writer_saved_is_refused_until_load(make: Factory) -> None:
    """The lock keeps writers from overlapping; this keeps one from undoing another's saves."""
    late = make()
    assert late.load() is None
    early = make()
    early(_cp(2))
    early.close()
    with pytest.raises(StoreLockedError, match="since this store last read or wrote it"):
        late(_cp(1))  # would replace the other's two outputs with one
    assert make().load() == _cp(2)
    assert late.load() == _cp(2)  # having read what is stored, it goes on
    late(_cp(3))
    assert make().load() == _cp(3)
    late.close()


def test_a_fresh_store_object_replaces_what_is_stored(make: Factory) -> None:
    """Without load(), a store knows nothing to protect: its first save writes the run whole."""
    with make() as first:
        first(_cp(3))
    with make() as fresh:
        fresh(_cp(1))
    assert make().load() == _cp(1)


def test_a_journal_never_cuts_whole_lines_it_did_not_write(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    with JournalStore(path) as one:
        one(_cp(1))
        one(_cp(2))
    with JournalStore(path) as two:
        assert two.load() == _cp(2)
        two(_cp(3))  # appended by another writer after one let go
    before = path.read_bytes()
    with pytest.raises(StoreLockedError, match="none of its lines were cut"):
        one(_cp(4, x=1))  # one's knowledge ends at two lines; the third is not a torn tail
    assert path.read_bytes() == before
    assert JournalStore(path).load() == _cp(3)
    one.close()


def test_a_journal_replaced_by_another_writer_is_not_written_over(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    with JournalStore(path) as one:
        for n in range(1, 4):
            one(_cp(n))
    late = JournalStore(path)
    assert late.load() == _cp(3)
    with JournalStore(path) as other:
        other(_cp(1, x="new run"))  # a fresh store writes the journal whole: shorter, new file
    with pytest.raises(StoreLockedError, match="the journal changed since this store last read"):
        late(_cp(4))
    assert JournalStore(path).load() == _cp(1, x="new run")
    late.close()


def test_the_journal_tail_rule_cuts_only_part_of_one_line() -> None:
    from ekit_runtime.stores.journal import _frame, _is_torn

    line = _frame(b'{"kind":"delta"}')
    assert _is_torn(line[:-1]) and _is_torn(line[:7]) and _is_torn(b"\0" * 300)
    assert _is_torn(line[:6] + b"%08x" % (int(line[6:14], 16) ^ 1) + line[14:])  # bad checksum
    assert not _is_torn(line)  # a whole record line: someone's save
    assert not _is_torn(line + line[:5])  # a whole line, then a fragment
    assert not _is_torn(b"garbage")


def test_sqlite_runs_are_locked_one_by_one(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    monday, tuesday = SqliteStore(db, run_id="monday"), SqliteStore(db, run_id="tuesday")
    monday(_cp(1))
    tuesday(_cp(2))  # another run: no conflict
    with pytest.raises(StoreLockedError, match=r"runs\.db, run 'monday'"):
        SqliteStore(db, run_id="monday")(_cp(3))
    # delete() is a write: it waits for no one and refuses while the run is held.
    with pytest.raises(StoreLockedError, match="run 'monday'"):
        tuesday.delete("monday")
    # A store given a connection to the same file locks the same run.
    conn = sqlite3.connect(db, isolation_level=None)
    shared = SqliteStore(conn, run_id="monday")
    with pytest.raises(StoreLockedError, match="run 'monday'"):
        shared(_cp(3))
    monday.close()
    assert tuesday.delete("monday") is True
    assert tuesday.runs() == ["tuesday"]
    shared(_cp(3))
    assert SqliteStore(db, run_id="monday").load() == _cp(3)
    for store in (tuesday, shared):
        store.close()
    conn.close()
    assert _lock_files(tmp_path) == []


def test_sqlite_run_ids_of_any_text_get_their_own_lock_file(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    names = ["a/b", "a_b", "../x", "日本 ✓", "x" * 300, "A", "a"]
    stores = [SqliteStore(db, run_id=name) for name in names]
    for i, store in enumerate(stores):
        store(_cp(i + 1))
    assert len(_lock_files(tmp_path)) == len(names)
    for i, name in enumerate(names):
        assert SqliteStore(db, run_id=name).load() == _cp(i + 1)
    for store in stores:
        store.close()
    assert _lock_files(tmp_path) == []


def test_sqlite_in_memory_database_is_locked_within_the_process() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    one, two = SqliteStore(conn, run_id="r"), SqliteStore(conn, run_id="r")
    one(_cp(1))
    with pytest.raises(StoreLockedError, match="another store object in this process"):
        two(_cp(2))
    SqliteStore(conn, run_id="other")(_cp(2))
    one.close()
    two(_cp(2))
    assert SqliteStore(conn, run_id="r").load() == _cp(2)
    two.close()
    conn.close()


def test_a_refused_save_leaves_the_holder_and_the_data_alone(make: Factory) -> None:
    holder = make()
    seen = [_cp(n) for n in (1, 2)]
    holder(seen[0])
    stranger = make()
    with pytest.raises(StoreLockedError):
        stranger(dataclasses.replace(seen[1], context=MappingProxyType({"other": True})))
    holder(seen[1])  # as a delta: the refused one changed nothing the holder knows
    assert make().load() == seen[1]
    holder.close()

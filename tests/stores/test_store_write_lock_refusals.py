"""What a store's write lock refuses and what the refusal names: the holder's process (or "another
writer"), this process, a lost lock file; and lock files removed or replaced as they are taken.

Deterministic and fast: a "holder in another process" is an ``flock`` taken here on the lock file,
with another pid written into it.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import JsonFileStore, SqliteStore, StoreLockedError
from tests.support.store_helpers import journal_store, json_store, make_checkpoint, three_checkpoints


@pytest.fixture
def foreign_lock(tmp_path: Path) -> Iterator[tuple[Path, Any]]:
    """cp.json's lock file, flock'ed here as another writer would; yields (lock path, writer)."""
    lock = Path(os.path.realpath(tmp_path / "cp.json") + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def write(content: bytes) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, content, 0)

    try:
        yield lock, write
    finally:
        os.close(fd)


def test_a_refusal_names_the_process_that_holds_the_lock(
    tmp_path: Path, foreign_lock: tuple[Path, Any]
) -> None:
    lock, write = foreign_lock
    write(b"4242\n")
    with pytest.raises(StoreLockedError) as info:
        json_store(tmp_path)(make_checkpoint(1, {"a": 1}))
    assert info.value.pid == 4242
    assert info.value.lock_path == str(lock)
    assert f"(held by process 4242; lock file {lock})" in str(info.value)


def test_a_refusal_without_a_readable_pid_says_another_writer(
    tmp_path: Path, foreign_lock: tuple[Path, Any]
) -> None:
    lock, write = foreign_lock
    write(b"")
    with pytest.raises(StoreLockedError) as info:
        json_store(tmp_path)(make_checkpoint(1, {"a": 1}))
    assert info.value.pid is None
    assert f"(held by another writer; lock file {lock})" in str(info.value)


def test_a_refusal_by_a_store_of_this_process_says_so(tmp_path: Path) -> None:
    with json_store(tmp_path) as first:
        first(make_checkpoint(1, {"a": 1}))
        with pytest.raises(StoreLockedError) as info:
            json_store(tmp_path)(make_checkpoint(1, {"a": 1}))
    assert info.value.pid == os.getpid()
    assert "(held by another store object in this process; lock file " in str(info.value)


def test_an_in_memory_sqlite_refusal_has_no_lock_file_and_names_this_process() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    first, second = SqliteStore(conn, run_id="r"), SqliteStore(conn, run_id="r")
    first(make_checkpoint(1, {"a": 1}))
    with pytest.raises(StoreLockedError) as info:
        second(make_checkpoint(1, {"a": 1}))
    assert info.value.lock_path is None
    assert info.value.pid == os.getpid()
    assert info.value.run_id == "r"
    first.close()
    conn.close()


def test_closing_a_store_whose_lock_file_is_already_gone_is_quiet(tmp_path: Path) -> None:
    store = json_store(tmp_path)
    store(make_checkpoint(1, {"a": 1}))
    Path(os.path.realpath(tmp_path / "cp.json") + ".lock").unlink()
    store.close()
    assert JsonFileStore(tmp_path / "cp.json").load() == make_checkpoint(1, {"a": 1})


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_a_store_whose_lock_file_was_removed_saves_nothing_more(tmp_path: Path, make: Any) -> None:
    store = make(tmp_path)
    first, second, third = three_checkpoints()
    store(first)
    Path(os.path.realpath(store.path) + ".lock").unlink()
    for checkpoint in (second, third):
        with pytest.raises(StoreLockedError, match="this store lost its write lock") as info:
            store(checkpoint)
        assert info.value.path == store.path
    store.close()
    assert make(tmp_path).load() == first


def _lock_of(tmp_path: Path) -> Path:
    return Path(os.path.realpath(tmp_path / "cp.json") + ".lock")


def test_a_lock_file_removed_as_its_holder_let_go_is_taken_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opened just before the holder removed it: the lock on that nameless file is no write lock."""
    import ekit_runtime.stores.locks as locks

    real = locks._try_lock
    calls: list[int] = []

    def holder_lets_go_first(fd: int) -> bool:
        calls.append(fd)
        if len(calls) == 1:
            _lock_of(tmp_path).unlink()
        return real(fd)

    monkeypatch.setattr(locks, "_try_lock", holder_lets_go_first)
    with json_store(tmp_path) as store:
        store(make_checkpoint(1, {"a": 1}))
        assert len(calls) == 2
        assert _lock_of(tmp_path).read_text() == f"{os.getpid()}\n"
        store(make_checkpoint(2, {"a": 1, "b": 2}))
        with pytest.raises(StoreLockedError):
            json_store(tmp_path)(make_checkpoint(1, {"x": 1}))
    assert json_store(tmp_path).load() == make_checkpoint(2, {"a": 1, "b": 2})


def test_a_lock_file_replaced_at_every_try_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ekit_runtime.stores.locks as locks

    real = locks._try_lock

    def always_replaced(fd: int) -> bool:
        _lock_of(tmp_path).unlink()
        return real(fd)

    monkeypatch.setattr(locks, "_try_lock", always_replaced)
    with pytest.raises(StoreLockedError) as info:
        json_store(tmp_path)(make_checkpoint(1, {"a": 1}))
    lock = _lock_of(tmp_path)
    assert (info.value.path, info.value.lock_path) == (str(tmp_path / "cp.json"), str(lock))
    assert info.value.pid is None
    assert f"(held by another writer; lock file {lock})" in str(info.value)
    assert not (tmp_path / "cp.json").exists()


def test_a_lock_whose_pid_cannot_be_written_fails_with_that_error_and_holds_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ekit_runtime.stores.locks as locks

    def full(fd: int, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(locks, "write_all", full)
    with pytest.raises(OSError, match="No space"):
        json_store(tmp_path)(make_checkpoint(1, {"a": 1}))
    monkeypatch.undo()
    with json_store(tmp_path) as store:
        store(make_checkpoint(1, {"a": 1}))
    assert json_store(tmp_path).load() == make_checkpoint(1, {"a": 1})

"""What a store's refusal names: the step, context key or field it cannot encode, the run and process
holding an in-memory database's lock, the journal line another writer changed.
"""

from __future__ import annotations

import gc
import json
import os
import sqlite3
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
    StoreLockedError,
    WorkflowCheckpoint,
)
from ekit_runtime.stores import UnencodableError

KINDS = ("json", "journal", "sqlite")


def _cp(count: int, context: dict[str, Any] | None = None, **extra: Any) -> WorkflowCheckpoint:
    outputs = {f"s{i}": f"o{i}" for i in range(count)}
    return WorkflowCheckpoint(
        count, MappingProxyType({**outputs, **extra}), context=MappingProxyType(context or {})
    )


def _store(kind: str, folder: Path, **codec: Any) -> Any:
    if kind == "json":
        return JsonFileStore(folder / "cp.json", **codec)
    if kind == "journal":
        return JournalStore(folder / "cp.jsonl", **codec)
    return SqliteStore(folder / "cp.db", run_id="r", **codec)


@pytest.fixture(params=KINDS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    opened: list[Any] = []

    def make(**codec: Any) -> Any:
        opened.append(_store(request.param, tmp_path, **codec))
        return opened[-1]

    yield make
    for store in opened:
        store.close()


# -- an encoding error says what the user must fix -------------------------------------


def test_an_unencodable_output_is_reported_with_its_own_error(make: Callable[..., Any]) -> None:
    store = make()
    with pytest.raises(UnencodableError) as info:
        store(_cp(2, bad=float("nan")))
    assert info.value.step == "bad"
    message = str(info.value)
    assert message.startswith("cannot encode the output of step 'bad': ValueError: Out of range float")
    assert "nothing was saved" in message
    assert make().load() is None


def test_an_unencodable_context_key_is_named_among_encodable_ones(make: Callable[..., Any]) -> None:
    store = make()
    with pytest.raises(UnencodableError) as info:
        store(_cp(1, context={"fine": 1, "when": float("nan")}))
    assert str(info.value).startswith("cannot encode context key 'when': ValueError: Out of range float")
    assert "nothing was saved" in str(info.value)


@pytest.mark.parametrize("kind", ["json", "journal"])
def test_a_dumps_that_fails_only_on_the_whole_checkpoint_is_reported(kind: str, tmp_path: Path) -> None:
    def dumps(data: Any) -> Any:
        return b"not text" if isinstance(data, dict) and "outputs" in data else json.dumps(data)

    store = _store(kind, tmp_path, dumps=dumps)
    with pytest.raises(UnencodableError) as info:
        store(_cp(1))
    store.close()
    assert str(info.value) == (
        "cannot encode the checkpoint: TypeError: dumps must return str, got bytes; nothing was saved"
    )


def test_a_loads_that_cannot_read_a_stored_output_names_that_step(tmp_path: Path) -> None:
    def loads(text: str) -> Any:
        value = json.loads(text)
        if value == "o0":
            raise ValueError("cannot read o0")
        return value

    store = JsonFileStore(tmp_path / "cp.json", dumps=json.dumps, loads=loads)
    store(_cp(1))
    with pytest.raises(UnencodableError) as info:
        store(_cp(2))  # s0 is written again from its stored encoding
    store.close()
    assert info.value.step == "s0"
    assert "step 's0'" in str(info.value)
    assert "(ValueError: cannot read o0)" in str(info.value)


# -- the write lock of an in-memory SQLite database ----------------------------------


def test_a_refusal_in_memory_carries_the_store_the_run_and_this_process() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    one, two = SqliteStore(conn, run_id="r"), SqliteStore(conn, run_id="r")
    one(_cp(1))
    with pytest.raises(StoreLockedError) as info:
        two(_cp(2))
    assert info.value.path == one.path
    assert info.value.run_id == "r"
    assert info.value.pid == os.getpid()
    assert info.value.lock_path is None
    assert "one writer at a time" in str(info.value)
    one.close()
    conn.close()


def test_an_unreachable_in_memory_store_does_not_keep_the_lock() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    was_enabled = gc.isenabled()
    gc.disable()  # only the store's own collection may free the cycle below
    try:
        holder = SqliteStore(conn, run_id="r")
        holder(_cp(1))
        cycle: list[Any] = [holder]
        cycle.append(cycle)
        del holder, cycle  # unreachable, but alive until a collection
        successor = SqliteStore(conn, run_id="r")
        successor(_cp(2))
    finally:
        if was_enabled:
            gc.enable()
    assert SqliteStore(conn, run_id="other").load() is None
    successor.close()
    conn.close()


def test_a_closed_in_memory_store_takes_the_lock_again_at_its_next_save() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    store = SqliteStore(conn, run_id="r")
    store(_cp(1))
    store.close()
    store(_cp(2))
    with pytest.raises(StoreLockedError):
        SqliteStore(conn, run_id="r")(_cp(3))
    store.close()
    conn.close()


# -- a journal that another writer changed ------------------------------------------------


def test_a_journal_changed_by_another_writer_is_refused_naming_its_file(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    first = JournalStore(path)
    first(_cp(1))
    first.close()
    second = JournalStore(path)
    second.load()
    second(_cp(2))
    second.close()
    with pytest.raises(StoreLockedError, match="the journal changed since this store last read") as info:
        first(_cp(3))
    assert info.value.path == str(path)
    assert info.value.run_id is None
    assert JournalStore(path).load() == _cp(2)


def _rewrite_line(path: Path, index: int, change: Callable[[dict[str, Any]], None]) -> None:
    """Change the record on line ``index`` (0-based) and frame it again with a valid checksum."""
    from ekit_runtime.stores.journal import _frame

    lines = path.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[index])["r"]
    change(record)
    lines[index] = _frame(json.dumps(record, separators=(",", ":")).encode())
    path.write_bytes(b"".join(lines))


def _journal(path: Path, *checkpoints: WorkflowCheckpoint) -> None:
    store = JournalStore(path)
    for checkpoint in checkpoints:
        store(checkpoint)
    store.close()


def test_a_delta_whose_cleared_steps_are_a_string_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal(path, _cp(1), _cp(2))
    _rewrite_line(path, 1, lambda record: record.__setitem__("cleared", "s0"))
    with pytest.raises(CorruptStoreError, match="'cleared' must be a list of step names") as info:
        JournalStore(path).load()
    assert (info.value.path, info.value.line) == (str(path), 2)


def test_a_first_record_that_is_no_checkpoint_is_corruption_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal(path, _cp(1), _cp(2))
    _rewrite_line(path, 0, lambda record: record.__setitem__("step_index", -3))
    with pytest.raises(CorruptStoreError, match=r"cp\.jsonl, line 1: .*step_index") as info:
        JournalStore(path).load()
    assert (info.value.path, info.value.line) == (str(path), 1)

"""Store behaviours that a mutation run (docs/testing.md) found no test pinning.

The run mutated ``ekit_runtime/stores/{_common,jsonfile,journal,sqlite}.py``;
each test here pins one rule a user relies on that a surviving mutant broke
unnoticed: what an error names (path, line, run, holder, offending type or
field), what a store remembers between a load and the next save, which bytes
a journal may cut, durability and connection settings, and the journal's
history. Grouped by module. Every test is deterministic and fast: no sleeps,
no subprocesses (a "holder in another process" is an ``flock`` taken here on
the lock file, with another pid written into it), no network.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import zlib
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from ekit_core import FailureRecord, TokenUsage, WorkflowCheckpoint
from ekit_runtime import CorruptStoreError, JournalStore, JsonFileStore, SqliteStore, StoreLockedError
from ekit_runtime.stores import UnencodableError
from tests.store_helpers import journal_store, json_store


def _cp(
    step_index: int,
    outputs: dict[str, Any],
    cost: TokenUsage | None = None,
    **fields: Any,
) -> WorkflowCheckpoint:
    wrapped = {k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in fields.items()}
    return WorkflowCheckpoint(step_index, MappingProxyType(outputs), cost or TokenUsage(), **wrapped)


def _framed(body: bytes) -> bytes:
    """One journal line holding ``body`` with a correct checksum (the journal's own framing)."""
    return b'{"c":"%08x","r":%s}\n' % (zlib.crc32(body), body)


def _journal_lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _journal_of(path: Path, *checkpoints: WorkflowCheckpoint) -> None:
    with JournalStore(path) as store:
        for checkpoint in checkpoints:
            store(checkpoint)


def _three(start: int = 1) -> list[WorkflowCheckpoint]:
    return [_cp(i, {f"s{j}": j for j in range(i)}) for i in range(start, start + 3)]


def _full_disk_on_call(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, n: int) -> None:
    """Make ``module.name``'s ``n``-th call from now fail as a full disk; the others run it."""
    real = getattr(module, name)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Give the file new content without replacing it (the inode stays)."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


# -- _common: what a refusal and a decoding error name ------------------------------------


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
        json_store(tmp_path)(_cp(1, {"a": 1}))
    assert info.value.pid == 4242
    assert info.value.lock_path == str(lock)
    assert f"(held by process 4242; lock file {lock})" in str(info.value)


def test_a_refusal_without_a_readable_pid_says_another_writer(
    tmp_path: Path, foreign_lock: tuple[Path, Any]
) -> None:
    lock, write = foreign_lock
    write(b"")
    with pytest.raises(StoreLockedError) as info:
        json_store(tmp_path)(_cp(1, {"a": 1}))
    assert info.value.pid is None
    assert f"(held by another writer; lock file {lock})" in str(info.value)


def test_a_refusal_by_a_store_of_this_process_says_so(tmp_path: Path) -> None:
    with json_store(tmp_path) as first:
        first(_cp(1, {"a": 1}))
        with pytest.raises(StoreLockedError) as info:
            json_store(tmp_path)(_cp(1, {"a": 1}))
    assert info.value.pid == os.getpid()
    assert "(held by another store object in this process; lock file " in str(info.value)


def test_a_nan_at_the_top_level_is_located_as_such(tmp_path: Path) -> None:
    (tmp_path / "cp.json").write_text("NaN")
    with pytest.raises(CorruptStoreError, match="NaN at the top level: "):
        json_store(tmp_path).load()


def _save_loaded(store: JsonFileStore, loaded: WorkflowCheckpoint) -> None:
    store(loaded)


def _compact(store: JournalStore, loaded: WorkflowCheckpoint) -> None:
    store.compact()


@pytest.mark.parametrize(
    ("make", "rewrite"), [(json_store, _save_loaded), (journal_store, _compact)], ids=["json", "journal"]
)
def test_a_loaded_output_its_dumps_cannot_write_loads_and_fails_at_the_rewrite(
    tmp_path: Path, make: Any, rewrite: Any
) -> None:
    """A ``loads`` may build what ``dumps`` refuses: load() still works; rewriting it names the step."""
    with make(tmp_path) as store:
        store(_cp(1, {"price": 1.5}))
    with make(tmp_path, loads=lambda text: json.loads(text, parse_float=Decimal)) as reader:
        loaded = reader.load()
        assert loaded is not None and loaded.outputs["price"] == Decimal("1.5")
        with pytest.raises(UnencodableError) as info:
            rewrite(reader, loaded)
    assert info.value.step == "price"


def test_an_in_memory_sqlite_refusal_has_no_lock_file_and_names_this_process() -> None:
    conn = sqlite3.connect(":memory:", isolation_level=None)
    first, second = SqliteStore(conn, run_id="r"), SqliteStore(conn, run_id="r")
    first(_cp(1, {"a": 1}))
    with pytest.raises(StoreLockedError) as info:
        second(_cp(1, {"a": 1}))
    assert info.value.lock_path is None
    assert info.value.pid == os.getpid()
    assert info.value.run_id == "r"
    first.close()
    conn.close()


def test_an_unencodable_checkpoint_field_names_the_real_cause(tmp_path: Path) -> None:
    """Neither an output nor a context key is at fault: the message gives the encoder's error."""
    with SqliteStore(tmp_path / "cp.db", run_id="r") as store, pytest.raises(UnencodableError) as info:
        store(_cp(1, {"a": 1}, versions={"a": "\ud800"}))
    assert str(info.value).startswith("cannot encode the checkpoint: UnicodeEncodeError: ")
    assert isinstance(info.value.__cause__, UnicodeEncodeError)
    assert SqliteStore(tmp_path / "cp.db", run_id="r").load() is None


# -- jsonfile -------------------------------------------------------------------------------


def test_a_json_file_changed_by_another_writer_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cp.json"
    mine = JsonFileStore(path)
    mine(_cp(1, {"a": 1}))
    mine.close()
    with JsonFileStore(path) as other:
        other(_cp(2, {"a": 1, "b": 2}))
    with pytest.raises(StoreLockedError) as info:
        mine(_cp(2, {"a": 1, "c": 3}))
    mine.close()
    assert info.value.path == str(path)
    assert info.value.run_id is None
    assert str(info.value).startswith(f"{path}: the file changed since this store last read")
    assert JsonFileStore(path).load() == _cp(2, {"a": 1, "b": 2})


def test_a_failed_json_save_does_not_refuse_the_next_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a write that failed, what is on disk is unknown to the store, not "changed by another"."""
    import ekit_runtime.stores.jsonfile as jsonfile

    path = tmp_path / "cp.json"
    _full_disk_on_call(monkeypatch, jsonfile, "atomic_write", 2)
    with JsonFileStore(path) as store:
        store(_cp(1, {"a": 1}))
        with pytest.raises(OSError, match="No space"):
            store(_cp(2, {"a": 1, "b": 2}))
        store(_cp(2, {"a": 1, "b": 2}))
    assert JsonFileStore(path).load() == _cp(2, {"a": 1, "b": 2})


def test_an_unreadable_json_file_names_the_decoder_error(tmp_path: Path) -> None:
    (tmp_path / "cp.json").write_text("{not json")
    with pytest.raises(CorruptStoreError, match=r"not a readable checkpoint \(JSONDecodeError: "):
        json_store(tmp_path).load()


# -- journal: which bytes may be cut ------------------------------------------------------


def test_a_journal_tail_of_nul_bytes_is_a_torn_append(tmp_path: Path) -> None:
    """A power cut can leave the file extended with zeros: load() forgives it like a torn line."""
    path = tmp_path / "cp.jsonl"
    saved = _three()
    _journal_of(path, *saved)
    with open(path, "ab") as f:
        f.write(b"\0" * 5)
    store = JournalStore(path)
    assert store.load() == saved[-1]
    assert store.torn_tail == 5


def test_two_whole_lines_of_another_writer_are_never_cut(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, *_three())
    whole = path.read_bytes()
    lines = _journal_lines(path)
    _rewrite_in_place(path, lines[0])
    store = JournalStore(path)
    store.load()
    with open(path, "ab") as f:  # another writer appends two lines, bypassing the lock
        f.write(lines[1] + lines[2])
    with pytest.raises(StoreLockedError, match="none of its lines were cut"):
        store(_cp(9, {"x": 1}))
    store.close()
    assert path.read_bytes() == whole


def test_a_single_foreign_byte_after_the_journal_is_never_cut(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    first, second, _ = _three()
    store = JournalStore(path)
    store(first)
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(StoreLockedError):
        store(second)
    store.close()
    assert path.read_bytes().endswith(b"}\nx")


@pytest.mark.parametrize(
    ("old", "new"), [(b'{"c":"', b'["c":"'), (b'","r":', b'","q":')], ids=["head", "middle"]
)
def test_a_line_with_damaged_framing_before_the_end_is_corruption(
    tmp_path: Path, old: bytes, new: bytes
) -> None:
    """The checksum covers the record only; damaged framing around it is damage all the same."""
    path = tmp_path / "cp.jsonl"
    _journal_of(path, *_three())
    lines = _journal_lines(path)
    lines[1] = lines[1].replace(old, new, 1)
    path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert info.value.path == str(path)
    assert info.value.line == 2
    assert str(info.value).startswith(f"{path}, line 2: damaged line")


def test_a_last_line_that_is_not_a_record_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, *_three())
    with open(path, "ab") as f:
        f.write(b"garbage")
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert info.value.path == str(path)
    assert info.value.line == 4
    assert str(info.value).startswith(f"{path}, line 4: the last line does not start like")


_JSON_HINT = " (it looks like a JSON document: a JsonFileStore file?)"


@pytest.mark.parametrize(
    ("first", "hint"),
    [
        (b"hello\n", ""),
        (b'{"c":"00000000","r":{"kind":"full"}}\n', ""),
        (b'  {"step_index": 1}\n', _JSON_HINT),
    ],
    ids=["text", "journal-line-with-bad-checksum", "indented-json"],
)
def test_a_damaged_first_line_gets_the_json_hint_only_when_it_looks_like_json(
    tmp_path: Path, first: bytes, hint: str
) -> None:
    path = tmp_path / "cp.jsonl"
    path.write_bytes(first)
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert str(info.value).endswith(f"and no crash can damage it{hint}")


# -- journal: what a bad record names --------------------------------------------------------


def _journal_with_line_2(path: Path, body: bytes) -> None:
    _journal_of(path, _cp(1, {"a": 1}))
    with open(path, "ab") as f:
        f.write(_framed(body))


def test_a_record_that_does_not_decode_names_the_decoder_error(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_with_line_2(path, b"{not json")
    with pytest.raises(CorruptStoreError, match=r"line 2: record does not decode \(JSONDecodeError: "):
        JournalStore(path).load()


def test_a_record_that_is_not_an_object_names_file_line_and_type(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_with_line_2(path, b"[1]")
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert (info.value.path, info.value.line) == (str(path), 2)
    assert str(info.value) == f"{path}, line 2: record must be an object, got list"


def test_a_record_of_an_unknown_kind_names_file_line_and_kind(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_with_line_2(path, b'{"kind":"other"}')
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert (info.value.path, info.value.line) == (str(path), 2)
    assert str(info.value) == f"{path}, line 2: record kind must be 'full' or 'delta', got 'other'"


_ZERO = {"input_tokens": 0, "output_tokens": 0, "llm_calls": 0}


@pytest.mark.parametrize(
    ("field", "again"),
    [("outputs", {"outputs": {"a": 2}}), ("step_usage", {"outputs": {}, "step_usage": {"a": _ZERO}})],
)
def test_a_delta_that_records_a_step_twice_names_the_field_and_step(
    tmp_path: Path, field: str, again: dict[str, Any]
) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, _cp(1, {"a": 1}, step_usage={"a": TokenUsage()}))
    record = {"kind": "delta", "step_index": 2, "cost": _ZERO, **again}
    with open(path, "ab") as f:
        f.write(_framed(json.dumps(record).encode()))
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert str(info.value) == f"{path}, line 2: delta record: '{field}' records step 'a' a second time"


# -- journal: what a save writes -----------------------------------------------------------


@pytest.mark.parametrize("field", ["output_tokens", "llm_calls"])
def test_a_journal_keeps_a_checkpoint_whose_usage_went_down_in_any_count(
    tmp_path: Path, field: str
) -> None:
    path = tmp_path / "cp.jsonl"
    before = TokenUsage(10, 10, 10)
    after = TokenUsage(**{**before.to_dict(), field: 5})
    first, second = _cp(1, {"a": 1}, before), _cp(2, {"a": 1, "b": 2}, after)
    _journal_of(path, first, second)
    assert JournalStore(path).load() == second


@pytest.mark.parametrize(
    "second",
    [
        _cp(1, {"a": 1, "b": 2}),
        _cp(1, {"a": 1}, step_usage={"a": TokenUsage(0, 0, 0)}),
        _cp(2, {"a": 1}),
    ],
    ids=["an-output", "a-step-usage", "the-step-index"],
)
def test_a_save_that_changes_only_one_thing_is_recorded(
    tmp_path: Path, second: WorkflowCheckpoint
) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, _cp(1, {"a": 1}), second)
    assert len(_journal_lines(path)) == 2
    assert JournalStore(path).load() == second


def test_compact_after_counts_the_deltas_a_load_found(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    with JournalStore(path, compact_after=3) as first:
        for checkpoint in _three():
            first(checkpoint)
    assert len(_journal_lines(path)) == 3  # full + 2 deltas
    with JournalStore(path, compact_after=3) as second:
        second.load()
        fourth, fifth, _ = _three(4)
        second(fourth)
        assert len(_journal_lines(path)) == 4  # the third delta
        second(fifth)
        assert len(_journal_lines(path)) == 1  # compacted
    assert JournalStore(path).load() == fifth


def test_an_empty_journal_file_holds_nothing_and_takes_a_save(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    path.write_bytes(b"")
    store = JournalStore(path)
    assert store.load() is None
    assert store.torn_tail == 0
    assert list(store.history()) == []
    store(_cp(1, {"a": 1}))
    store.close()
    assert JournalStore(path).load() == _cp(1, {"a": 1})


def _remove(path: Path) -> None:
    path.unlink()


def _empty_in_place(path: Path) -> None:
    _rewrite_in_place(path, b"")


def _replace_by_empty(path: Path) -> None:
    other = path.with_name("other")
    other.write_bytes(b"")
    os.replace(other, path)


def _cut_short(path: Path) -> None:
    _rewrite_in_place(path, _journal_lines(path)[0][:-5])


@pytest.mark.parametrize(
    "damage", [_remove, _empty_in_place, _replace_by_empty, _cut_short],
    ids=["removed", "emptied", "replaced-by-empty", "cut-short"],
)
def test_a_journal_that_lost_its_content_is_written_whole_by_the_next_save(
    tmp_path: Path, damage: Any
) -> None:
    """Gone, empty or cut short: nothing of anyone else's to keep, so the save rewrites it."""
    path = tmp_path / "cp.jsonl"
    first, second, third = _three()
    with JournalStore(path) as store:
        store(first)
        store(second)
        damage(path)
        store(third)
    assert [json.loads(line[len(b'{"c":"00000000","r":'):-2])["kind"] for line in _journal_lines(path)] == [
        "full"
    ]
    assert JournalStore(path).load() == third


# -- journal: history ------------------------------------------------------------------------


def _history_run() -> list[WorkflowCheckpoint]:
    """Saves that exercise every part of a delta: outputs (two at once), usage, failures, context."""
    context = {"user": "u"}
    common: dict[str, Any] = {
        "context": context, "fingerprint": "f" * 8, "versions": {"a": "1"},
        "graph": {"a": (), "b": ("a",), "c": ("a",), "d": ("b", "c")},
    }
    return [
        _cp(1, {"a": 1}, TokenUsage(1, 2, 1), step_usage={"a": TokenUsage(1, 2, 1)}, **common),
        _cp(
            3, {"a": 1, "c": [3], "b": "two"}, TokenUsage(4, 6, 3),
            step_usage={"a": TokenUsage(1, 2, 1), "c": TokenUsage(1, 1, 1), "b": TokenUsage(2, 3, 1)},
            failures={"d": FailureRecord("ValueError", "boom")}, **common,
        ),
        _cp(
            4, {"a": 1, "c": [3], "b": "two", "d": None}, TokenUsage(5, 6, 4),
            step_usage={"a": TokenUsage(1, 2, 1), "c": TokenUsage(1, 1, 1), "b": TokenUsage(2, 3, 1),
                        "d": TokenUsage(1, 0, 1)},
            **common,
        ),
    ]


def _same(got: WorkflowCheckpoint, want: WorkflowCheckpoint) -> None:
    assert got == want
    assert list(got.outputs.items()) == list(want.outputs.items())
    assert list(got.step_usage.items()) == list(want.step_usage.items())


def test_history_is_each_save_in_order_with_every_field(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    saved = _history_run()
    _journal_of(path, *saved)
    history = list(JournalStore(path).history())
    assert len(history) == len(saved)
    for got, want in zip(history, saved, strict=True):
        _same(got, want)
    delta = history[2].delta_since(history[1])
    assert delta.extends
    assert [name for name, _ in delta.outputs] == ["d"]


def test_history_skips_a_torn_tail_and_restarts_at_a_full_record(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    saved = _history_run()
    _journal_of(path, *saved)
    with open(path, "ab") as f:
        f.write(b'{"c":"0')
    assert len(list(JournalStore(path).history())) == 3
    JournalStore(path).compact()
    history = list(JournalStore(path).history())
    assert len(history) == 1
    _same(history[0], saved[-1])
    assert list(JournalStore(tmp_path / "missing.jsonl").history()) == []


def test_history_of_a_delta_before_any_full_record_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, *_three())
    lines = _journal_lines(path)
    path.write_bytes(lines[1] + lines[2])
    with pytest.raises(CorruptStoreError) as info:
        list(JournalStore(path).history())
    assert (info.value.path, info.value.line) == (str(path), 1)
    assert str(info.value) == f"{path}, line 1: a delta record before any full one"


def test_load_of_a_delta_before_any_full_record_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, *_three())
    lines = _journal_lines(path)
    path.write_bytes(lines[1] + lines[2])
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert (info.value.path, info.value.line) == (str(path), 1)
    assert str(info.value) == f"{path}, line 1: a delta record before any full one"


def _read_history(store: JournalStore) -> None:
    list(store.history())


def _read_load(store: JournalStore) -> None:
    store.load()


@pytest.mark.parametrize("read", [_read_history, _read_load], ids=["history", "load"])
@pytest.mark.parametrize("bad_line", [1, 2])
def test_a_record_with_a_bad_field_names_its_line(tmp_path: Path, read: Any, bad_line: int) -> None:
    path = tmp_path / "cp.jsonl"
    _journal_of(path, *_three())
    lines = _journal_lines(path)
    record = json.loads(lines[bad_line - 1][len(b'{"c":"00000000","r":') : -2])
    record["step_index"] = "one"
    lines[bad_line - 1] = _framed(json.dumps(record).encode())
    path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptStoreError) as info:
        read(JournalStore(path))
    assert (info.value.path, info.value.line) == (str(path), bad_line)
    assert str(info.value).startswith(f"{path}, line {bad_line}: ")
    assert "step_index" in str(info.value)


# -- sqlite ---------------------------------------------------------------------------------


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
            store(_cp(1, {"a": 1}))
            assert store.load() == _cp(1, {"a": 1})
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
    first(_cp(1, {"a": 1}))
    second(_cp(1, {"b": 2}))
    assert (first.load(), second.load()) == (_cp(1, {"a": 1}), _cp(1, {"b": 2}))
    first.close()
    second.close()
    one.close()
    two.close()


def test_sqlite_deleting_its_own_run_keeps_the_lock_and_another_run_lets_it_go(tmp_path: Path) -> None:
    db = tmp_path / "cp.db"
    with SqliteStore(db, run_id="r") as store:
        store(_cp(1, {"a": 1}))
        with SqliteStore(db, run_id="other") as other:
            other(_cp(1, {"o": 1}))
        assert store.delete("r")
        with SqliteStore(db, run_id="r") as rival, pytest.raises(StoreLockedError):
            rival(_cp(1, {"b": 2}))
        assert store.delete("other")
        with SqliteStore(db, run_id="other") as other:
            other(_cp(1, {"o": 2}))
    assert SqliteStore(db, run_id="other").load() == _cp(1, {"o": 2})


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
        mine(_cp(1, {"s0": shared}))
        theirs(_cp(1, {"s0": "theirs"}))
        shared.append(2)  # a later step mutates the saved output in place
        mine.load("b")
        mine(_cp(2, {"s0": shared, "s1": 1}, context={"changed": True}))  # a full rewrite
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
        store(_cp(1, {"a": 1}))
    assert info.value.__notes__ == ["and the rollback failed too: ROLLBACK refused"]
    real.execute("ROLLBACK")
    store.conn = real
    store.close()


# -- _common, second pass: temporary files, lost locks, the first encoding -------------------


def test_the_temporary_file_of_a_save_is_created_beside_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rename is atomic only within one folder: the temporary file goes beside the target."""
    folder, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    real = os.replace
    renamed: list[tuple[str, str]] = []

    def spy(src: Any, dst: Any) -> None:
        renamed.append((os.fspath(src), os.fspath(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    with JsonFileStore(folder / "cp.json") as store:
        store(_cp(1, {"a": 1}))
    [(src, dst)] = renamed
    assert dst == os.path.realpath(folder / "cp.json")
    assert os.path.dirname(src) == os.path.dirname(dst)
    assert os.path.basename(src).startswith(".cp.json.") and src.endswith(".tmp")
    assert os.listdir(elsewhere) == []


def test_closing_a_store_whose_lock_file_is_already_gone_is_quiet(tmp_path: Path) -> None:
    store = json_store(tmp_path)
    store(_cp(1, {"a": 1}))
    Path(os.path.realpath(tmp_path / "cp.json") + ".lock").unlink()
    store.close()
    assert JsonFileStore(tmp_path / "cp.json").load() == _cp(1, {"a": 1})


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_a_store_whose_lock_file_was_removed_saves_nothing_more(tmp_path: Path, make: Any) -> None:
    store = make(tmp_path)
    first, second, third = _three()
    store(first)
    Path(os.path.realpath(store.path) + ".lock").unlink()
    for checkpoint in (second, third):
        with pytest.raises(StoreLockedError, match="this store lost its write lock") as info:
            store(checkpoint)
        assert info.value.path == store.path
    store.close()
    assert make(tmp_path).load() == first


def _changed_fingerprint(checkpoint: WorkflowCheckpoint) -> dict[str, Any]:
    return {"fingerprint": "other"}


def _changed_graph(checkpoint: WorkflowCheckpoint) -> dict[str, Any]:
    return {"graph": {"a": (), "b": ("a",)}}


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
@pytest.mark.parametrize("change", [_changed_fingerprint, _changed_graph], ids=["fingerprint", "graph"])
def test_an_output_of_another_version_of_the_workflow_is_encoded_afresh(
    tmp_path: Path, make: Any, change: Any
) -> None:
    """Another fingerprint or graph is another run: an equal-looking new object is not the saved one."""
    shared = [1]
    first = _cp(1, {"a": shared}, fingerprint="f", graph={"a": ()})
    with make(tmp_path) as store:
        store(first)
        shared.append(2)  # mutated after it was saved: the stored text stays [1]
        second = _cp(2, {"a": [1, 2], "b": 1}, **{"fingerprint": "f", "graph": {"a": ()}, **change(first)})
        store(second)
    loaded = make(tmp_path).load()
    assert loaded is not None and loaded.outputs["a"] == [1, 2]
    assert loaded == second


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_a_full_rewrite_keeps_the_first_encoding_of_an_output_mutated_since(
    tmp_path: Path, make: Any
) -> None:
    """Another output changed, so the save is written whole; the mutated one keeps its first text."""
    shared = [1]
    with make(tmp_path) as store:
        store(_cp(1, {"a": shared}))
        store(_cp(2, {"a": shared, "b": 1}))  # only "b" is new: "a" is not looked at again
        shared.append(2)
        store(_cp(3, {"a": shared, "b": 2}))
        store(_cp(4, {"a": shared, "b": 3}))
    loaded = make(tmp_path).load()
    assert loaded is not None and loaded.outputs == {"a": [1], "b": 3}


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_an_output_that_left_the_checkpoint_is_encoded_afresh_when_it_comes_back(
    tmp_path: Path, make: Any
) -> None:
    """Its stored text went with it: what comes back under that name is written as it is now."""
    shared = [1]
    with make(tmp_path) as store:
        store(_cp(1, {"a": shared}))
        store(_cp(0, {}))  # rewound: nothing of "a" is stored any more
        shared.append(2)
        store(_cp(1, {"a": shared}))
    loaded = make(tmp_path).load()
    assert loaded is not None and loaded.outputs == {"a": [1, 2]}


@pytest.mark.parametrize("make", [json_store, journal_store], ids=["json", "journal"])
def test_a_save_writes_every_byte_when_the_os_writes_a_few_at_a_time(
    tmp_path: Path, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:5])))
    first, second, third = _three()
    with make(tmp_path) as store:
        store(first)
        store(second)
        store(third)
    monkeypatch.undo()
    assert make(tmp_path).load() == third


def _names_in_turn(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> None:
    """Make the temporary file names ``.<file>.<name>.tmp``, the ``names`` in turn (the last one repeated)."""
    import secrets

    def token_hex(nbytes: int | None = None) -> str:
        return names.pop(0) if len(names) > 1 else names[0]

    monkeypatch.setattr(secrets, "token_hex", token_hex)


def test_a_taken_temporary_file_name_is_left_alone_and_another_one_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = tmp_path / ".cp.json.taken.tmp"
    taken.write_bytes(b"someone else's")
    _names_in_turn(monkeypatch, ["taken", "free"])
    with json_store(tmp_path) as store:
        store(_cp(1, {"a": 1}))
    assert taken.read_bytes() == b"someone else's"
    assert not (tmp_path / ".cp.json.free.tmp").exists()
    assert json_store(tmp_path).load() == _cp(1, {"a": 1})


def test_no_free_temporary_file_name_is_an_error_naming_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".cp.json.taken.tmp").write_bytes(b"")
    _names_in_turn(monkeypatch, ["taken"])
    target = os.path.realpath(tmp_path / "cp.json")
    with json_store(tmp_path) as store, pytest.raises(FileExistsError) as info:
        store(_cp(1, {"a": 1}))
    assert str(info.value) == f"{target}: no free temporary file name beside it"
    assert not (tmp_path / "cp.json").exists()


def test_a_failed_rename_whose_temporary_file_is_gone_raises_the_renames_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clean-up of the temporary file never hides why the save failed."""

    def vanish(src: Any, dst: Any) -> None:
        os.unlink(src)  # removed meanwhile (by a cleaner, say): the rename finds nothing
        raise FileNotFoundError(2, "No such file or directory", os.fspath(src))

    monkeypatch.setattr(os, "replace", vanish)
    with json_store(tmp_path) as store, pytest.raises(FileNotFoundError, match="No such file"):
        store(_cp(1, {"a": 1}))
    assert os.listdir(tmp_path) == []


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
        store(_cp(1, {"a": 1}))
        assert len(calls) == 2
        assert _lock_of(tmp_path).read_text() == f"{os.getpid()}\n"
        store(_cp(2, {"a": 1, "b": 2}))
        with pytest.raises(StoreLockedError):
            json_store(tmp_path)(_cp(1, {"x": 1}))
    assert json_store(tmp_path).load() == _cp(2, {"a": 1, "b": 2})


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
        json_store(tmp_path)(_cp(1, {"a": 1}))
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
        json_store(tmp_path)(_cp(1, {"a": 1}))
    monkeypatch.undo()
    with json_store(tmp_path) as store:
        store(_cp(1, {"a": 1}))
    assert json_store(tmp_path).load() == _cp(1, {"a": 1})


def _plain_dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"))


def test_another_codec_names_the_context_key_it_cannot_encode(tmp_path: Path) -> None:
    store = JsonFileStore(tmp_path / "cp.json", dumps=_plain_dumps, loads=json.loads)
    with pytest.raises(UnencodableError) as info:
        store(_cp(1, {"a": 1}, context={"fine": 1, "bad": object()}))
    assert info.value.step is None
    assert str(info.value).startswith("cannot encode context key 'bad': TypeError: ")
    store.close()
    assert not (tmp_path / "cp.json").exists()


# -- journal, second pass: defaults, arguments, a failed append ------------------------------


def test_a_journal_is_durable_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = JournalStore(tmp_path / "cp.jsonl")
    assert store.durable is True
    store(_cp(1, {"a": 1}))
    full = len(synced)
    store(_cp(2, {"a": 1, "b": 2}))
    store.close()
    assert full >= 1 and len(synced) > full  # the full write and the append are both fsynced


@pytest.mark.parametrize("bad", [True, False, 0, -1, 2.5, "3"])
def test_a_journal_refuses_a_compact_after_that_is_not_a_positive_int(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^compact_after must be a positive int or None, got "):
        JournalStore(tmp_path / "cp.jsonl", compact_after=bad)


def test_a_journal_has_no_torn_tail_before_any_load(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    assert JournalStore(path).torn_tail == 0
    _journal_of(path, *_three())
    store = JournalStore(path)
    assert store.torn_tail == 0
    store(_cp(9, {"x": 1}))
    assert store.torn_tail == 0
    store.close()


def test_a_failed_journal_append_does_not_refuse_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an append that failed, the file is unknown to the store: the next save writes it whole."""
    import ekit_runtime.stores.journal as journal

    path = tmp_path / "cp.jsonl"
    first, second, third = _three()
    with JournalStore(path) as store:
        store(first)
        _full_disk_on_call(monkeypatch, journal, "write_all", 1)
        with pytest.raises(OSError, match="No space"):
            store(second)
        store(third)
    assert JournalStore(path).load() == third

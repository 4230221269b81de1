"""The journal store: which bytes a load may cut (a torn append, never another writer's lines), what
a bad record names (file, line, field), what a save writes, its defaults and arguments.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from ekit_core import TokenUsage, WorkflowCheckpoint
from ekit_runtime import CorruptStoreError, JournalStore, StoreLockedError
from tests.support.store_helpers import (
    framed_line,
    full_disk_on_call,
    journal_lines,
    journal_of,
    make_checkpoint,
    three_checkpoints,
)


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Give the file new content without replacing it (the inode stays)."""
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)


# -- journal: which bytes may be cut ------------------------------------------------------


def test_a_journal_tail_of_nul_bytes_is_a_torn_append(tmp_path: Path) -> None:
    """A power cut can leave the file extended with zeros: load() forgives it like a torn line."""
    path = tmp_path / "cp.jsonl"
    saved = three_checkpoints()
    journal_of(path, *saved)
    with open(path, "ab") as f:
        f.write(b"\0" * 5)
    store = JournalStore(path)
    assert store.load() == saved[-1]
    assert store.torn_tail == 5


def test_two_whole_lines_of_another_writer_are_never_cut(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    journal_of(path, *three_checkpoints())
    whole = path.read_bytes()
    lines = journal_lines(path)
    _rewrite_in_place(path, lines[0])
    store = JournalStore(path)
    store.load()
    with open(path, "ab") as f:  # another writer appends two lines, bypassing the lock
        f.write(lines[1] + lines[2])
    with pytest.raises(StoreLockedError, match="none of its lines were cut"):
        store(make_checkpoint(9, {"x": 1}))
    store.close()
    assert path.read_bytes() == whole


def test_a_single_foreign_byte_after_the_journal_is_never_cut(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    first, second, _ = three_checkpoints()
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
    journal_of(path, *three_checkpoints())
    lines = journal_lines(path)
    lines[1] = lines[1].replace(old, new, 1)
    path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptStoreError) as info:
        JournalStore(path).load()
    assert info.value.path == str(path)
    assert info.value.line == 2
    assert str(info.value).startswith(f"{path}, line 2: damaged line")


def test_a_last_line_that_is_not_a_record_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    journal_of(path, *three_checkpoints())
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
    journal_of(path, make_checkpoint(1, {"a": 1}))
    with open(path, "ab") as f:
        f.write(framed_line(body))


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
    journal_of(path, make_checkpoint(1, {"a": 1}, step_usage={"a": TokenUsage()}))
    record = {"kind": "delta", "step_index": 2, "cost": _ZERO, **again}
    with open(path, "ab") as f:
        f.write(framed_line(json.dumps(record).encode()))
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
    first, second = make_checkpoint(1, {"a": 1}, before), make_checkpoint(2, {"a": 1, "b": 2}, after)
    journal_of(path, first, second)
    assert JournalStore(path).load() == second


@pytest.mark.parametrize(
    "second",
    [
        make_checkpoint(1, {"a": 1, "b": 2}),
        make_checkpoint(1, {"a": 1}, step_usage={"a": TokenUsage(0, 0, 0)}),
        make_checkpoint(2, {"a": 1}),
    ],
    ids=["an-output", "a-step-usage", "the-step-index"],
)
def test_a_save_that_changes_only_one_thing_is_recorded(
    tmp_path: Path, second: WorkflowCheckpoint
) -> None:
    path = tmp_path / "cp.jsonl"
    journal_of(path, make_checkpoint(1, {"a": 1}), second)
    assert len(journal_lines(path)) == 2
    assert JournalStore(path).load() == second


def test_compact_after_counts_the_deltas_a_load_found(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    with JournalStore(path, compact_after=3) as first:
        for checkpoint in three_checkpoints():
            first(checkpoint)
    assert len(journal_lines(path)) == 3  # full + 2 deltas
    with JournalStore(path, compact_after=3) as second:
        second.load()
        fourth, fifth, _ = three_checkpoints(4)
        second(fourth)
        assert len(journal_lines(path)) == 4  # the third delta
        second(fifth)
        assert len(journal_lines(path)) == 1  # compacted
    assert JournalStore(path).load() == fifth


def test_an_empty_journal_file_holds_nothing_and_takes_a_save(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    path.write_bytes(b"")
    store = JournalStore(path)
    assert store.load() is None
    assert store.torn_tail == 0
    assert list(store.history()) == []
    store(make_checkpoint(1, {"a": 1}))
    store.close()
    assert JournalStore(path).load() == make_checkpoint(1, {"a": 1})


def _remove(path: Path) -> None:
    path.unlink()


def _empty_in_place(path: Path) -> None:
    _rewrite_in_place(path, b"")


def _replace_by_empty(path: Path) -> None:
    other = path.with_name("other")
    other.write_bytes(b"")
    os.replace(other, path)


def _cut_short(path: Path) -> None:
    _rewrite_in_place(path, journal_lines(path)[0][:-5])


@pytest.mark.parametrize(
    "damage", [_remove, _empty_in_place, _replace_by_empty, _cut_short],
    ids=["removed", "emptied", "replaced-by-empty", "cut-short"],
)
def test_a_journal_that_lost_its_content_is_written_whole_by_the_next_save(
    tmp_path: Path, damage: Any
) -> None:
    """Gone, empty or cut short: nothing of anyone else's to keep, so the save rewrites it."""
    path = tmp_path / "cp.jsonl"
    first, second, third = three_checkpoints()
    with JournalStore(path) as store:
        store(first)
        store(second)
        damage(path)
        store(third)
    assert [json.loads(line[len(b'{"c":"00000000","r":'):-2])["kind"] for line in journal_lines(path)] == [
        "full"
    ]
    assert JournalStore(path).load() == third


# -- journal: defaults, arguments, a failed append ---------------------------------------------


def test_a_journal_is_durable_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = JournalStore(tmp_path / "cp.jsonl")
    assert store.durable is True
    store(make_checkpoint(1, {"a": 1}))
    full = len(synced)
    store(make_checkpoint(2, {"a": 1, "b": 2}))
    store.close()
    assert full >= 1 and len(synced) > full  # the full write and the append are both fsynced


@pytest.mark.parametrize("bad", [True, False, 0, -1, 2.5, "3"])
def test_a_journal_refuses_a_compact_after_that_is_not_a_positive_int(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"^compact_after must be a positive int or None, got "):
        JournalStore(tmp_path / "cp.jsonl", compact_after=bad)


def test_a_journal_has_no_torn_tail_before_any_load(tmp_path: Path) -> None:
    path = tmp_path / "cp.jsonl"
    assert JournalStore(path).torn_tail == 0
    journal_of(path, *three_checkpoints())
    store = JournalStore(path)
    assert store.torn_tail == 0
    store(make_checkpoint(9, {"x": 1}))
    assert store.torn_tail == 0
    store.close()


def test_a_failed_journal_append_does_not_refuse_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After an append that failed, the file is unknown to the store: the next save writes it whole."""
    import ekit_runtime.stores.journal as journal

    path = tmp_path / "cp.jsonl"
    first, second, third = three_checkpoints()
    with JournalStore(path) as store:
        store(first)
        full_disk_on_call(monkeypatch, journal, "write_all", 1)
        with pytest.raises(OSError, match="No space"):
            store(second)
        store(third)
    assert JournalStore(path).load() == third
